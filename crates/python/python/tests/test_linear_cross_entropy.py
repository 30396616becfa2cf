"""``headroom.torch.linear_cross_entropy`` and ``patch_causal_lm`` against PyTorch's
``F.cross_entropy`` on the materialised logits, on the CPU and on CUDA: values and gradients of the
hidden states, weight and bias in float64 within 1e-13 relative and float32 within 1e-5, every
reduction, ``ignore_index``, blocks of rows that do not divide the tokens (on CUDA, tiles of
classes that do not divide the vocabulary: Headroom's tile kernels); bfloat16 within bfloat16's
precision; on CUDA, float32's gradients computed in the forward and given to one backward (a second
raises), also over rows of an 8,200-class vocabulary, the loss under bfloat16 autocast equal to the
loss of bfloat16 operands, the torch path under a side stream, and the peak beyond the inputs and
gradients within ``chunk_mb`` plus 8 bytes a token; a Hugging Face GPT-2 patched gives its own loss
(and the Trainer's ``num_items_in_batch`` form) with no logits, and its own forward again once
unpatched; misuse raises.

Run: ``python3 -m pytest crates/python/python/tests/test_linear_cross_entropy.py`` (or
``python3`` on this file; the patch case needs transformers). The ``cuda`` cases need a GPU.
"""

import sys

from torch_gate import device_cases, main, on_device as on, skip, torch

if torch is not None:
    import torch.nn.functional as F

    import headroom.torch as ht
    from test_saved_activations import raises


def operands(dev, dtype, seed=0, rows=(3, 37), features=24, vocab=130):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*rows, features, generator=g).to(dev, dtype).requires_grad_()
    w = (torch.randn(vocab, features, generator=g) * 0.3).to(dev, dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dev, dtype).requires_grad_()
    y = torch.randint(0, vocab, rows, generator=g).to(dev)
    y[0, :7] = -100
    return h, w, b, y


def reference(h, w, b, y, reduction):
    logits = (h @ w.t() + b).float() if h.dtype != torch.float64 else h @ w.t() + b
    out = F.cross_entropy(logits.reshape(-1, w.shape[0]), y.reshape(-1), reduction=reduction)
    return out.reshape(y.shape) if reduction == "none" else out


def compare(dev, dtype, bound, chunk_mb=0.004):
    for reduction in ("mean", "sum", "none"):
        h, w, b, y = operands(dev, dtype)
        ours = ht.linear_cross_entropy(h, w, y, bias=b, reduction=reduction, chunk_mb=chunk_mb)
        theirs = reference(h, w, b, y, reduction)
        torch.manual_seed(1)
        seed = torch.randn(ours.shape, dtype=ours.dtype).to(dev)
        got = torch.autograd.grad(ours, (h, w, b), seed)
        want = torch.autograd.grad(theirs, (h, w, b), seed.to(theirs.dtype))
        assert ((ours.double() - theirs.double()).abs().max()
                <= bound * theirs.double().abs().max()), (dtype, reduction)
        for name, a, c in zip("hwb", got, want):
            error = ((a.double() - c.double()).abs().max() / c.double().abs().max()).item()
            assert error <= bound, (dtype, reduction, name, error)


def test_float64_and_float32_equal_cross_entropy_of_the_logits(device):
    dev = on(device)
    compare(dev, torch.float64, 1e-13)
    compare(dev, torch.float32, 1e-5)


def test_bfloat16_within_its_precision(device):
    dev = on(device)
    # 111 rows in three blocks: the weight's gradient is rounded to bfloat16 once a block.
    compare(dev, torch.bfloat16, 2**-6, chunk_mb=0.02)


def test_cuda_autocast_casts_the_operands_and_a_side_stream_takes_torchs_kernels():
    dev = on("cuda")
    h, w, _, y = operands(dev, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        autocast = ht.linear_cross_entropy(h, w, y, chunk_mb=0.02)
    got = torch.autograd.grad(autocast, (h, w))
    hb, wb = (t.detach().bfloat16().requires_grad_() for t in (h, w))
    plain = ht.linear_cross_entropy(hb, wb, y, chunk_mb=0.02)
    want = torch.autograd.grad(plain, (hb, wb))
    assert autocast.dtype == torch.float32 and autocast.item() == plain.item()
    for a, c in zip(got, want):
        assert a.dtype == torch.float32 and torch.equal(a, c.float())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        streamed = ht.linear_cross_entropy(h, w, y, chunk_mb=0.004)
        streamed_grads = torch.autograd.grad(streamed, (h, w))
    torch.cuda.current_stream().wait_stream(side)
    plain32 = ht.linear_cross_entropy(h, w, y, chunk_mb=0.004)
    want32 = torch.autograd.grad(plain32, (h, w))
    assert abs(streamed.item() - plain32.item()) <= 1e-5 * abs(plain32.item())
    for a, c in zip(streamed_grads, want32):
        assert (a - c).abs().max() <= 1e-5 * c.abs().max()


def test_cuda_float32_gradients_come_from_the_forward_once():
    dev = on("cuda")
    h, w, b, y = operands(dev, torch.float32)
    loss = ht.linear_cross_entropy(h, w, y, bias=b, chunk_mb=0.004)
    loss.backward(retain_graph=True)
    raises(RuntimeError, lambda: loss.backward(), "retain_graph=True")
    with torch.no_grad():  # not recorded: no gradients computed, the same loss
        assert ht.linear_cross_entropy(h, w, y, bias=b, chunk_mb=0.004).item() == loss.item()


def test_cuda_float32_rows_of_a_wide_vocabulary_equal_the_unfused_loss():
    # 111 rows of 8,200 classes in two blocks of whole rows (padded to 8,200: one block of
    # threads a row in the forward's tile kernel), gradients computed in the forward.
    dev = on("cuda")
    for reduction in ("mean", "sum"):
        h, w, b, y = operands(dev, torch.float32, seed=5, vocab=8200)
        ours = ht.linear_cross_entropy(h, w, y, bias=b, reduction=reduction, chunk_mb=2)
        theirs = reference(h, w, b, y, reduction)
        got = torch.autograd.grad(ours, (h, w, b))
        want = torch.autograd.grad(theirs, (h, w, b))
        assert abs(ours.item() - theirs.item()) <= 1e-5 * abs(theirs.item()), reduction
        for name, a, c in zip("hwb", got, want):
            error = ((a - c).abs().max() / c.abs().max()).item()
            assert error <= 1e-5, (reduction, name, error)


def test_cuda_peak_stays_within_the_chunk_budget():
    # bfloat16: tiles, gradients in backward; float32: blocks of whole rows padded to eight
    # classes (an odd vocabulary), gradients in the forward.
    for dtype, vocab in ((torch.bfloat16, 8192), (torch.float32, 8191)):
        peak_within_the_budget(on("cuda"), dtype, vocab)


def peak_within_the_budget(dev, dtype, vocab):
    tokens, features, chunk_mb = 1024, 256, 4
    g = torch.Generator().manual_seed(3)
    h = torch.randn(tokens, features, generator=g).to(dev, dtype).requires_grad_()
    w = (torch.randn(vocab, features, generator=g) * 0.1).to(dev, dtype)
    w.requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g).to(dev)

    def step():
        h.grad = w.grad = None
        ht.linear_cross_entropy(h, w, y, chunk_mb=chunk_mb).backward()

    step()  # cuBLAS's workspace, which torch keeps, is taken here
    h.grad = w.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = (h.grad.numel() + w.grad.numel()) * h.element_size()
    beyond = torch.cuda.max_memory_allocated() - before - grads
    # One tile and the float32 accumulator (or one block of padded rows) at a time, in the
    # budget; the per-token vectors, and 64 KiB for the scalars and the allocator's rounding.
    assert beyond <= chunk_mb * (1 << 20) + 8 * tokens + (64 << 10), (dtype, beyond)


def test_a_patched_gpt2_gives_its_own_loss_without_logits(device):
    dev = on(device)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        skip("transformers is not installed")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(dev)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1)).to(dev)
    labels = ids.clone()
    labels[0, :5] = -100
    own = model(ids, labels=labels)
    own_grads = torch.autograd.grad(own.loss, list(model.parameters()))
    ht.patch_causal_lm(model, chunk_mb=0.01)
    ours = model(ids, labels=labels)
    assert ours.logits is None
    assert abs(ours.loss.item() - own.loss.item()) <= 1e-5 * abs(own.loss.item())
    grads = torch.autograd.grad(ours.loss, list(model.parameters()))
    for a, c in zip(grads, own_grads):
        assert (a - c).abs().max() <= 1e-4 * c.abs().max() + 1e-8
    counted = model(ids, labels=labels, num_items_in_batch=torch.tensor(100))
    total = own.loss * (labels[:, 1:] != -100).sum()
    assert abs(counted.loss.item() - total.item() / 100) <= 1e-5 * abs(total.item() / 100)
    assert model(ids).logits is not None  # no labels: the model's own forward
    ht.unpatch_causal_lm(model)
    assert "forward" not in model.__dict__
    assert model(ids, labels=labels).logits is not None


def test_misuse_raises():
    h, w, b, y = operands("cpu", torch.float32)
    raises(ValueError, lambda: ht.linear_cross_entropy(h, w, y, reduction="max"), "reduction")
    raises(ValueError, lambda: ht.linear_cross_entropy(h, w, y, chunk_mb=0), "chunk_mb")
    raises(ValueError, lambda: ht.linear_cross_entropy(h, w.t(), y), "weight of shape")
    raises(ValueError, lambda: ht.linear_cross_entropy(h, w, y[:, :-1]), "labels of shape")
    raises(TypeError, lambda: ht.linear_cross_entropy(h, w, y.int()), "torch.int64")
    raises(TypeError, lambda: ht.patch_causal_lm(torch.nn.Linear(2, 2)), "causal LM")


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
