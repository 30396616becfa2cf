"""``headroom.torch.saved_activations`` on the CPU and on CUDA: the 8-bit codes are the codec's
formula bit for bit (the formula written again here in torch's f32 arithmetic), CPU and CUDA give
the same bits, a network trained through the hooks has the uncompressed forward's loss exactly
and gradients within the codec's error, parameters and what does not require grad are kept,
saves of one tensor share one copy, the bytes are the encoded bytes, and misuse raises.

Run: ``python3 -m pytest crates/python/python/tests/test_saved_activations.py`` (or ``python3``
on this file). The ``cuda`` cases need a GPU (skipped without one; under
``HEADROOM_REQUIRE_GPU=1`` a failure instead).
"""

import sys

from torch_gate import device_cases, main, on_device as on, torch

if torch is not None:
    import headroom.activations as hact
    import headroom.torch as ht

DTYPES = ("float32", "bfloat16", "float16", "float64")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def raises(exc, fn, *words):
    try:
        fn()
    except exc as error:
        for word in words:
            assert word in str(error), f"{word!r} not in {error}"
        return
    raise AssertionError(f"expected {exc.__name__}")


def formula(x, block):
    """The codec in torch's f32 arithmetic: absmax per block, codes round-half-even(x / a * 127),
    NaN absmax and zero codes for a block holding a non-finite value."""
    flat = x.detach().reshape(-1).float().cpu()
    n = flat.numel()
    blocks = (n + block - 1) // block
    padded = torch.zeros(blocks * block)
    padded[:n] = flat
    rows = padded.view(blocks, block)
    finite = torch.isfinite(rows).all(dim=1)
    absmax = rows.abs().amax(dim=1)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    codes = torch.round((rows / scale[:, None]) * 127.0).to(torch.int8)
    codes[~finite] = 0
    absmax = torch.where(finite, absmax, torch.full_like(absmax, float("nan")))
    return codes.reshape(-1)[:n], absmax


def sample(n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.linspace(0.01, 30.0, n)
    if n > 17:
        x[17] = 0.0
    if n > 600:
        x[512:768] = 0.0  # a block of zeros
        x[300] = float("nan")  # a block holding a NaN
        x[540] = 0.0
    return x.to(device=device, dtype=getattr(torch, dtype))


def test_int8_codes_and_decode_are_the_codecs_formula(device):
    dev = on(device)
    for dtype in DTYPES:
        for n, block in ((1000, 256), (1000, 32), (4096, 4096), (7, 32)):
            x = sample(n, dtype, dev, seed=n + block)
            packed = hact._Int8(x, block)
            sync(dev)
            codes, absmax = formula(x, block)
            assert torch.equal(packed.codes.cpu(), codes), (dtype, n, block)
            got = packed.absmax.cpu()
            assert torch.equal(torch.isnan(got), torch.isnan(absmax)), (dtype, n, block)
            assert torch.equal(got.nan_to_num(), absmax.nan_to_num()), (dtype, n, block)
            out = packed.decode()
            sync(dev)
            assert out.dtype == x.dtype and out.shape == x.shape and out.device == x.device
            per_element = absmax.repeat_interleave(block)[:n]
            expected = ((codes.float() / 127.0) * per_element).to(x.dtype)
            assert torch.equal(out.cpu().isnan(), expected.isnan()), (dtype, n, block)
            assert torch.equal(out.cpu().nan_to_num(), expected.nan_to_num()), (dtype, n, block)


def test_cuda_codes_equal_the_cpus():
    dev = on("cuda")
    for dtype in DTYPES:
        x = sample(5000, dtype, torch.device("cpu"), seed=3)
        cpu = hact._Int8(x, 256)
        gpu = hact._Int8(x.to(dev), 256)
        torch.cuda.synchronize()
        assert torch.equal(cpu.codes, gpu.codes.cpu()), dtype
        assert torch.equal(cpu.absmax.nan_to_num(), gpu.absmax.cpu().nan_to_num()), dtype
        assert torch.equal(cpu.decode().nan_to_num(), gpu.decode().cpu().nan_to_num()), dtype


class Block(torch.nn.Module if torch is not None else object):
    """A pre-norm transformer block: layer norm, attention through SDPA, a GELU MLP."""

    def __init__(self, width=256, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def train_once(dev, compress, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Block(), Block()).to(dev)
    x = torch.randn(4, 64, 256, device=dev)
    with ht.saved_activations(compress) as saved:
        loss = model(x).square().mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return loss.detach(), grads, saved.stats


def test_training_through_the_hooks_keeps_the_loss_and_bounds_the_gradients(device):
    dev = on(device)
    loss, grads, plain = train_once(dev, None)
    assert plain["encoded"] == 0 and plain["saved"] > 0
    # Relative error of every gradient: 8 bits a value (absmax / 254 at most) and bf16's 2^-8.
    for compress, bound in (("int8", 0.03), ("bf16", 0.01)):
        got_loss, got, stats = train_once(dev, compress)
        assert torch.equal(got_loss, loss), compress  # the forward itself is untouched
        assert stats["saved"] == plain["saved"] and stats["encoded"] > 0
        for i, (a, b) in enumerate(zip(got, grads)):
            error = ((a - b).norm() / b.norm()).item()
            assert error <= bound, f"{compress}: gradient {i} off by {error:.4f}"


def test_encoded_bytes_are_the_codecs(device):
    dev = on(device)
    _, _, stats = train_once(dev, "int8")
    # Every encoded save here is f32 with a whole number of 256-element blocks.
    assert stats["encoded_bytes"] * 4 == stats["original_bytes"] * (1 + 4 / 256)
    assert stats["encoded_bytes"] <= 0.26 * stats["original_bytes"]
    _, _, stats = train_once(dev, "bf16")
    assert 2 * stats["encoded_bytes"] == stats["original_bytes"]


class Recording(hact.saved_activations if torch is not None else object):
    """``saved_activations`` that remembers each save and what it was packed as."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _pack(self, t):
        packed = super()._pack(t)
        self.seen.append((t, packed))
        return packed


def test_parameters_casts_and_statistics_are_kept(device):
    dev = on(device)
    weight = torch.nn.Parameter(torch.randn(512, 512, device=dev))
    x = torch.randn(64, 512, device=dev, requires_grad=True) * 1.0  # not a leaf
    with Recording("int8", min_elements=1) as saved:
        y = torch.nn.functional.linear(x, weight)  # saves x (encoded) and the weight (kept)
        cast = weight.t().to(torch.float64).to(torch.float32)
        z = torch.nn.functional.linear(x, cast)  # a cast of a transposed parameter: kept
        n = torch.nn.functional.layer_norm(y, (512,))  # mean and rstd need no grad: kept
    # Kept: a detached alias of the save (its storage, no grad_fn: no cycle through the node).
    kept = [t for t, packed in saved.seen if isinstance(packed, torch.Tensor)]
    assert all(packed.data_ptr() == t.data_ptr() and packed.grad_fn is None
               for t, packed in saved.seen if isinstance(packed, torch.Tensor))
    encoded = [t for t, packed in saved.seen if not isinstance(packed, torch.Tensor)]
    assert any(t is weight or t._base is weight for t in kept), "the parameter (a view) is kept"
    assert any(t is cast or t._base is cast for t in kept), "a cast of a parameter is kept"
    assert any(not t.requires_grad for t in kept), "layer norm's statistics are kept"
    assert any(t is x for t in encoded), "the activation is encoded"
    assert all(t.requires_grad for t in encoded)
    (y.sum() + z.sum() + n.sum()).backward()


def test_saves_of_one_tensor_share_one_copy(device):
    dev = on(device)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(512, 512).to(dev), torch.nn.Linear(512, 512).to(dev)
    x = torch.randn(64, 512, device=dev)
    (a(x * 1.0) + b(x * 1.0)).square().sum().backward()
    plain = [p.grad.clone() for p in (a.weight, b.weight)]
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    h = x.requires_grad_() * 1.0
    with ht.saved_activations("int8") as saved:
        y = a(h) + b(h)  # both linears save h
    assert saved.stats["encoded"] == 1 and saved.stats["shared"] == 1, saved.stats
    y.square().sum().backward()
    for got, want in zip((a.weight.grad, b.weight.grad), plain):
        assert ((got - want).norm() / want.norm()).item() <= 0.03


def test_a_save_modified_in_place_raises_at_backward(device):
    dev = on(device)
    x = torch.randn(128, 256, device=dev, requires_grad=True) * 1.0
    with ht.saved_activations("int8", min_elements=1):
        y = x.exp()  # saves its output
    y.mul_(2.0)
    raises(RuntimeError, lambda: y.sum().backward(), "modified by an inplace operation")


def test_the_prefetch_plan_fetches_each_save_as_early_as_the_peak_and_cap_allow():
    from headroom.activations import _prefetch_plan

    # Step k's high point (highs), the profiled peak 20: the save taken at step 1 fits from
    # step 0, the one at step 2 too (step 0 then holds both: 10 + 10 = 20), the one at step 3
    # only from step 1 (step 0 would reach 25).
    assert _prefetch_plan([0, 5, 5, 5], [10, 10, 12, 14], 20, 100) == [[1, 2], [3], [], []]
    # At most 8 bytes held ahead: one save at a time, each fetched one step early.
    assert _prefetch_plan([0, 5, 5, 5], [10, 10, 12, 14], 20, 8) == [[1], [2], [3], []]
    # A save too large to hold ahead, steps with nothing to fetch (kept or taken already), and
    # a save that step 1 (17 + 4 > 20) keeps from being fetched before step 2.
    assert _prefetch_plan([0, 30, 0, 4], [10, 17, 16, 16], 20, 100) == [[], [], [3], []]
    assert _prefetch_plan([], [], 5, 100) == []


def test_a_profile_whose_running_peak_never_rose_plans_nothing_and_warns_once():
    import warnings

    from headroom.activations import _WARNED, _Profile

    _WARNED.clear()
    fresh = _Profile()  # peaks reset before the step: the backward's rises are seen
    fresh.maxima, fresh.sizes, fresh.cap = [10, 12, 14], [0, 5, 5], 1000
    stale = _Profile()  # never reset: every unpack sees an older, higher peak
    stale.maxima, stale.sizes, stale.cap = [100, 100, 100], [0, 5, 5], 1000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.finish(30)
        stale.finish(100)
        stale.finish(100)
    assert fresh.plan == [[1, 2], [], []] and stale.plan == [[], [], []]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "reset_peak_memory_stats" in messages[0], messages


def test_bad_settings_raise():
    raises(ValueError, lambda: ht.saved_activations("int4"), "compress='int4'")
    raises(ValueError, lambda: ht.saved_activations("int8", block=100), "block=100")
    raises(ValueError, lambda: ht.saved_activations("int8", block=8192), "block=8192")
    raises(ValueError, lambda: ht.saved_activations("bf16", min_elements=0), "min_elements=0")


def test_int8_off_the_default_stream_raises_and_bf16_runs():
    dev = on("cuda")
    x = torch.randn(256, 256, device=dev, requires_grad=True) * 1.0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with ht.saved_activations("int8", min_elements=1):
            raises(ValueError, lambda: x.exp(), "default stream")
        with ht.saved_activations("bf16", min_elements=1):
            y = x.exp()
        y.sum().backward()
    torch.cuda.synchronize()


def test_int8_lowers_the_forwards_peak_on_cuda():
    dev = on("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(1024, 16) for _ in range(4)]).to(dev)
    x = torch.randn(8, 256, 1024, device=dev)
    kept = {}
    for compress in (None, "int8"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with ht.saved_activations(compress):
            loss = model(x).square().mean()
        torch.cuda.synchronize()
        kept[compress] = torch.cuda.memory_allocated() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
    assert kept["int8"] <= 0.45 * kept[None], kept


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
