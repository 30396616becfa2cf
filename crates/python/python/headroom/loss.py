"""The language-model loss without its logits: ``headroom.torch.linear_cross_entropy`` and
``headroom.torch.patch_causal_lm``.

``linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
chunk_mb=64)`` is ``F.cross_entropy(hidden @ weight.T + bias, labels)`` computed a block of rows
at a time, as headroom-autograd-core's fused loss does: a block's logits (float32, float64 for
float64 inputs; at most ``chunk_mb`` MiB) exist only while that block is computed, in the forward and again in the
backward (recomputed from the saved hidden states and weight rather than kept), so a 128K-token
vocabulary never holds a ``[tokens, vocab]`` tensor. The forward saves the per-row log-sum-exp
(float32); the backward forms each block's ``softmax - one_hot`` and multiplies it into the
hidden states' and the weight's gradients.

On CUDA (from torch's default stream) it runs Headroom's fused kernels, as
headroom-autograd-core's op does: each block of rows is computed a tile of classes at a time,
the tile's logits in the inputs' dtype by torch's matrix product (``addmm`` with the bias),
folded by ``_native.cross_entropy_tile`` into each row's running maximum, sum of exponentials
and target logit (float32; float64 for float64 inputs) — no float32 copy of the logits, one pass
over them; in backward each recomputed tile is overwritten in place by its gradient
``g · (softmax − onehot)`` (``_native.cross_entropy_tile_backward``, rounded once into the
inputs' dtype) and multiplied into the gradients: the hidden states' in a float32 accumulator
per block of rows for float16 and bfloat16 (rounded once), the weight's in its own dtype
(rounded once per block of rows), the bias's in float32. Under CUDA autocast the hidden states
and the weight are cast to autocast's dtype first, as autocast casts a linear layer's operands.
``chunk_mb`` bounds the tile and the accumulator together. Labels outside ``[0, vocab)`` other
than ``ignore_index`` fail a device-side assertion, as ``F.cross_entropy``'s do.

For float32 (without TF32) and float64, where a product of the logits' size costs more than the
memory traffic around it, a ``"mean"`` or ``"sum"`` loss that autograd records computes its
gradients in the forward instead, a block of whole rows at a time (three products in all, as the
unfused loss, instead of four): each block's logits are made once, folded, overwritten by their
gradient for an upstream gradient of 1 and multiplied into the gradients, which backward then
scales in place by its upstream gradient (exact when that is 1). A block's rows are padded to
a multiple of eight classes with −∞ (nothing to the statistics, a zero gradient) so the tile
kernels read them in 16-byte packs. The products run at the unfused loss's pace from blocks of
about a thousand rows: at GPT-2's head (4,088 tokens, 50,257 classes, measured at 190e3f5) the
loss took 26.3 ms at ``chunk_mb=64`` (314-row blocks), 21.6 at 256 and 20.8 at 512 against
eager PyTorch's 20.1 ms and 2.3 GB, so give a float32 model ``chunk_mb=256``. The gradients
exist from the forward on (the peak beyond them is the same); a second backward through the
same loss (``retain_graph=True``) raises ``RuntimeError``: they were given to the first.

Elsewhere (the CPU, or a forward under ``torch.cuda.stream(...)``) it runs in torch's own
kernels, a block of full rows at a time: the logits in float32 (``torch.matmul`` then
``.float()``, as autocast's matmul and PyTorch's float32 cross-entropy would), the hidden
states' and the weight's gradients accumulated in float32 and cast once.

``patch_causal_lm(model)`` makes a Hugging Face causal LM (a base model and an output
embedding: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``GPT2LMHeadModel``, ...) compute its
training loss this way: called with ``labels``, its forward runs the base model, shifts the
labels as Hugging Face does (``-100`` ignored; with the Trainer's ``num_items_in_batch``, the
sum over that count) and returns the loss with ``logits=None``; without labels it is the
model's own forward. ``unpatch_causal_lm`` restores it.

What raises: ``labels`` whose shape is not ``hidden``'s without the feature dimension, a
``weight`` whose columns are not ``hidden``'s features, ``reduction`` other than ``"mean"``,
``"sum"`` or ``"none"``, ``chunk_mb`` not positive (``ValueError``); labels that are not int64,
a model without a base model and an output embedding (``TypeError``); a second backward through
a loss whose gradients the forward computed (``RuntimeError``).

This module sits on torch and ``headroom._native``'s cross-entropy tiles.
"""

import types

import torch

from . import _native

__all__ = ["linear_cross_entropy", "patch_causal_lm", "unpatch_causal_lm"]

_REDUCTIONS = ("mean", "sum", "none")


def _row_blocks(rows, vocab, chunk_mb):
    """Rows per block: as many float32 logits as ``chunk_mb`` MiB hold, at least one row."""
    return max(1, int(chunk_mb * (1 << 20)) // (4 * vocab))


def _stats_dtype(dtype):
    """float64 for float64 inputs, else float32 (the logits' and statistics' dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce(ctx, inputs, losses, valid, lse, reduction):
    """Saves what backward reads (``inputs``, then the valid rows, the log-sum-exp and their
    count) and returns the reduced loss (``_reduced``)."""
    count = valid.sum()
    ctx.save_for_backward(*inputs, valid, lse, count)
    ctx.reduction = reduction
    return _reduced(losses, valid, count, reduction)


def _reduced(losses, valid, count, reduction):
    """The rows' losses with the ignored ones zeroed, reduced as ``reduction`` says over the
    ``count`` valid rows."""
    losses = torch.where(valid, losses, torch.zeros_like(losses))
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / count.clamp_min(1) if reduction == "mean" else total


def _row_statistics(rows, stats, device):
    """Each row's running maximum (−∞), sum of exponentials and target logit (0), in the
    statistics dtype, before the tile kernels fold the first tile into them."""
    return (torch.full((rows,), float("-inf"), dtype=stats, device=device),
            torch.zeros(rows, dtype=stats, device=device),
            torch.zeros(rows, dtype=stats, device=device))


def _row_scale(reduction, grad_out, valid, count):
    """Each row's share of the loss's gradient (0 for an ignored row), dense."""
    if reduction == "none":
        return (grad_out * valid).contiguous()
    return (grad_out / (count.clamp_min(1) if reduction == "mean" else 1) * valid).contiguous()


def _block_logits(h, weight, bias):
    stats = _stats_dtype(h.dtype)
    logits = torch.matmul(h, weight.t()).to(stats)
    if bias is not None:
        logits = logits + bias.to(stats)
    return logits


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, chunk_mb):
        rows, vocab = hidden.shape[0], weight.shape[0]
        block = _row_blocks(rows, vocab, chunk_mb)
        stats = _stats_dtype(hidden.dtype)
        losses = torch.empty(rows, dtype=stats, device=hidden.device)
        lse = torch.empty(rows, dtype=stats, device=hidden.device)
        valid = labels != ignore_index
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        for start in range(0, rows, block):
            end = min(start + block, rows)
            logits = _block_logits(hidden[start:end], weight, bias)
            lse[start:end] = torch.logsumexp(logits, dim=1)
            picked = logits.gather(1, safe[start:end, None]).squeeze(1)
            losses[start:end] = lse[start:end] - picked
        ctx.block = block
        return _reduce(ctx, (hidden, weight, bias, safe), losses, valid, lse, reduction)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, safe, valid, lse, count = ctx.saved_tensors
        rows = hidden.shape[0]
        stats = lse.dtype
        row_scale = _row_scale(ctx.reduction, grad_out.to(stats), valid, count)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=stats, device=weight.device) if want_w else None
        grad_b = (torch.zeros(weight.shape[0], dtype=stats, device=weight.device)
                  if want_b and bias is not None else None)
        for start in range(0, rows, ctx.block):
            end = min(start + ctx.block, rows)
            logits = _block_logits(hidden[start:end], weight, bias)
            d = torch.exp(logits - lse[start:end, None])  # softmax
            d.scatter_add_(1, safe[start:end, None],
                           -torch.ones(end - start, 1, device=d.device, dtype=d.dtype))
            d.mul_(row_scale[start:end, None])
            if grad_h is not None:
                grad_h[start:end] = torch.matmul(d.to(weight.dtype), weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.add_(torch.matmul(d.t().to(hidden.dtype), hidden[start:end]).to(stats))
            if grad_b is not None:
                grad_b.add_(d.sum(dim=0))
        return (grad_h,
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None)


_NATIVE_DTYPES = {torch.float32: "float32", torch.float64: "float64",
                  torch.bfloat16: "bfloat16", torch.float16: "float16"}
_HALVES = (torch.float16, torch.bfloat16)


def _tiles(rows, vocab, features, dtype, chunk_mb):
    """(rows a block, classes a tile) under ``chunk_mb`` MiB: half the budget to the block's
    float32 accumulator of the hidden states' gradient and its product (float16 and bfloat16),
    the rest to the tile, whose width is a multiple of 8 classes where it is not the vocabulary
    (16-byte rows for the kernels' packed loads)."""
    budget = int(chunk_mb * (1 << 20))
    size = torch.empty((), dtype=dtype).element_size()
    block = max(1, min(rows, (budget // 2) // (8 * features)))
    accumulator = 8 * features * block if dtype in _HALVES else 0
    width = max(1, (budget - accumulator) // (block * size))
    if width < vocab:
        width = max(8, width - width % 8)
    return block, min(width, vocab)


def _tile_logits(h, weight, bias, start, end):
    """``h @ weight[start:end].T (+ bias[start:end])`` in the inputs' dtype, dense."""
    if bias is None:
        return torch.mm(h, weight[start:end].t())
    return torch.addmm(bias[start:end], h, weight[start:end].t())


_ADDMM_INTO_FLOAT32 = [None]  # whether addmm(out_dtype=float32, out=acc) takes a float32 acc


def _accumulate_float32(acc, a, b):
    """``acc += a @ b`` for half-precision ``a`` and ``b`` into the float32 ``acc``: one product
    with a float32 result (cuBLAS's float32 accumulation, no rounding to the inputs' dtype)."""
    if _ADDMM_INTO_FLOAT32[0] is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _ADDMM_INTO_FLOAT32[0] = True
            return
        except (RuntimeError, TypeError):
            _ADDMM_INTO_FLOAT32[0] = False
    acc.add_(torch.mm(a, b, out_dtype=torch.float32))


def _launch_args(t):
    device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return device, torch.cuda.current_stream(t.device).cuda_stream


def _padded_width(vocab):
    """A whole row's width in the forward-gradient blocks: the vocabulary rounded up to eight
    classes, so the tile kernels read and write the rows in 16-byte packs (a row of an odd
    vocabulary such as GPT-2's 50,257 is otherwise read one value at a time, which left each
    warp waiting on its loads: 8.7 ms of a 4,088-row f32 loss at 9490a50's kernels)."""
    return -(-vocab // 8) * 8


def _full_rows(rows, vocab, features, dtype, chunk_mb):
    """Rows a block when a block holds whole (padded) rows of logits in the inputs' dtype and,
    for float16 and bfloat16, the float32 product of the hidden states' gradient, under
    ``chunk_mb`` MiB, spread evenly over the blocks; 0 when not even one row fits."""
    size = torch.empty((), dtype=dtype).element_size()
    per_row = _padded_width(vocab) * size + (4 * features if dtype in _HALVES else 0)
    most = min(rows, int(chunk_mb * (1 << 20)) // per_row)
    if most == 0:
        return 0
    blocks = -(-rows // most)
    return -(-rows // blocks)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The CUDA path: torch's products, Headroom's tile kernels (see the module's notes)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, chunk_mb, recorded):
        rows, features = hidden.shape
        vocab = weight.shape[0]
        stats = _stats_dtype(hidden.dtype)
        block, width = _tiles(rows, vocab, features, hidden.dtype, chunk_mb)
        device, stream = _launch_args(hidden)
        name = _NATIVE_DTYPES[hidden.dtype]
        valid = labels != ignore_index
        torch._assert_async(((labels >= 0) & (labels < vocab) | ~valid).all(),
                            "linear_cross_entropy: a label outside [0, vocab) that is not "
                            "ignore_index")
        whole = _full_rows(rows, vocab, features, hidden.dtype, chunk_mb)
        in_forward = (_products_dominate(hidden.dtype) if _GRADIENTS_IN_FORWARD[0] is None
                      else _GRADIENTS_IN_FORWARD[0])
        if recorded and reduction != "none" and any(ctx.needs_input_grad[:3]) and whole > 0 \
                and in_forward:
            return _forward_with_gradients(ctx, hidden, weight, bias, labels, valid,
                                           ignore_index, reduction, whole)
        ctx.gradients = None
        row_max, row_sum, target = _row_statistics(rows, stats, hidden.device)
        for start in range(0, rows, block):
            end = min(start + block, rows)
            n = end - start
            h = hidden[start:end]
            for first in range(0, vocab, width):
                last = min(first + width, vocab)
                logits = _tile_logits(h, weight, bias, first, last)
                tile = (name, logits.data_ptr(), n, last - first, first,
                        labels[start:end].data_ptr(), 1, ignore_index)
                _native.cross_entropy_tile(device, stream, tile, row_max[start:end].data_ptr(),
                                           row_sum[start:end].data_ptr(),
                                           target[start:end].data_ptr())
                # Freed before the next tile is made: one tile at a time under the budget.
                del logits
        lse = torch.add(row_max, row_sum.log())
        losses = torch.sub(lse, target)
        ctx.ignore_index, ctx.chunk_mb = ignore_index, chunk_mb
        return _reduce(ctx, (hidden, weight, bias, labels), losses, valid, lse, reduction)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.gradients is not None:
            return _scaled_gradients(ctx, grad_out)
        hidden, weight, bias, labels, valid, lse, count = ctx.saved_tensors
        rows, features = hidden.shape
        vocab = weight.shape[0]
        stats = lse.dtype
        row_scale = _row_scale(ctx.reduction, grad_out.to(stats), valid, count)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        block, width = _tiles(rows, vocab, features, hidden.dtype, ctx.chunk_mb)
        device, stream = _launch_args(hidden)
        name = _NATIVE_DTYPES[hidden.dtype]
        half = hidden.dtype in _HALVES
        grad_h = (torch.zeros_like(hidden) if want_h and not half
                  else torch.empty_like(hidden) if want_h else None)
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = (torch.zeros(vocab, dtype=stats, device=weight.device)
                  if want_b and bias is not None else None)
        for start in range(0, rows, block):
            end = min(start + block, rows)
            n = end - start
            h = hidden[start:end]
            acc = (torch.zeros(n, features, dtype=torch.float32, device=hidden.device)
                   if want_h and half else None)
            for first in range(0, vocab, width):
                last = min(first + width, vocab)
                d = _tile_logits(h, weight, bias, first, last)
                tile = (name, d.data_ptr(), n, last - first, first,
                        labels[start:end].data_ptr(), 1, ctx.ignore_index)
                _native.cross_entropy_tile_backward(device, stream, tile,
                                                    lse[start:end].data_ptr(),
                                                    row_scale[start:end].data_ptr())
                w = weight[first:last]
                if acc is not None:
                    _accumulate_float32(acc, d, w)
                elif grad_h is not None:
                    grad_h[start:end].addmm_(d, w)
                if grad_w is not None:
                    grad_w[first:last].addmm_(d.t(), h)
                if grad_b is not None:
                    grad_b[first:last].add_(d.sum(dim=0, dtype=stats))
                del d, w  # one tile at a time, as in forward
            if acc is not None:
                grad_h[start:end].copy_(acc)
        return (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None)


# Whether a reduced CUDA loss computes its gradients in the forward: None follows
# ``_products_dominate``; True or False forces it (the benchmarks time both ways).
_GRADIENTS_IN_FORWARD = [None]


def _products_dominate(dtype):
    """Whether a product of the logits' size costs more than accumulating the weight's gradient
    once a block of whole rows: float64, and float32 without TF32 (CUDA cores); float16,
    bfloat16 and TF32 products run on tensor cores, where the repeated accumulation costs more
    than the product it saves (at a 128K vocabulary about 10 ms against 6)."""
    if dtype == torch.float64:
        return True
    return dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32


def _forward_with_gradients(ctx, hidden, weight, bias, labels, valid, ignore_index, reduction,
                            block):
    """The forward of a reduced loss that also computes the gradients, for an upstream gradient
    of 1, a block of whole rows at a time: each block's logits are made once (three products in
    all, as unfused, instead of four), its statistics folded, then overwritten in place by
    ``scale · (softmax − onehot)`` and multiplied into the gradients, which backward scales by
    its upstream gradient (exact when that is 1). The gradients are held on ``ctx``, out of
    reach of saved-tensor hooks, and given to the one backward that takes them."""
    rows, features = hidden.shape
    vocab = weight.shape[0]
    stats = _stats_dtype(hidden.dtype)
    device, stream = _launch_args(hidden)
    name = _NATIVE_DTYPES[hidden.dtype]
    want_h, want_w, want_b = ctx.needs_input_grad[:3]
    half = hidden.dtype in _HALVES
    count = valid.sum()
    one = torch.ones((), dtype=stats, device=hidden.device)
    row_scale = _row_scale(reduction, one, valid, count)
    grad_h = torch.empty_like(hidden) if want_h else None
    grad_w = torch.zeros_like(weight) if want_w else None
    grad_b = (torch.zeros(vocab, dtype=stats, device=weight.device)
              if want_b and bias is not None else None)
    row_max, row_sum, target = _row_statistics(rows, stats, hidden.device)
    lse = torch.empty(rows, dtype=stats, device=hidden.device)
    padded = _padded_width(vocab)
    padded_rows = torch.empty(block, padded, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, rows, block):
        end = min(start + block, rows)
        n = end - start
        h = hidden[start:end]
        # The block's logits in the first `vocab` columns of padded rows whose last columns
        # are −∞: they add nothing to a row's statistics and their gradient is 0.
        rows_of = padded_rows[:n]
        d = rows_of[:, :vocab]
        if padded > vocab:
            rows_of[:, vocab:].fill_(float("-inf"))
        if bias is None:
            torch.mm(h, weight.t(), out=d)
        else:
            torch.addmm(bias, h, weight.t(), out=d)
        tile = (name, rows_of.data_ptr(), n, padded, 0, labels[start:end].data_ptr(), 1,
                ignore_index)
        _native.cross_entropy_tile(device, stream, tile, row_max[start:end].data_ptr(),
                                   row_sum[start:end].data_ptr(), target[start:end].data_ptr())
        # This block's log-sum-exp, which its gradient reads.
        torch.add(row_max[start:end], row_sum[start:end].log(), out=lse[start:end])
        _native.cross_entropy_tile_backward(device, stream, tile, lse[start:end].data_ptr(),
                                            row_scale[start:end].data_ptr())
        if grad_h is not None:
            if half:
                acc = torch.mm(d, weight, out_dtype=torch.float32)
                grad_h[start:end].copy_(acc)
                del acc
            else:
                torch.mm(d, weight, out=grad_h[start:end])
        if grad_w is not None:
            grad_w.addmm_(d.t(), h)
        if grad_b is not None:
            grad_b.add_(d.sum(dim=0, dtype=stats))
        del d, rows_of
    del padded_rows
    ctx.gradients = (grad_h, grad_w, grad_b)
    ctx.bias_dtype = None if bias is None else bias.dtype
    return _reduced(torch.sub(lse, target), valid, count, reduction)


def _scaled_gradients(ctx, grad_out):
    """Backward after ``_forward_with_gradients``: its gradients times the upstream gradient,
    in place; a second backward through the same loss has nothing left to give."""
    if ctx.gradients is False:
        raise RuntimeError(
            "linear_cross_entropy computed its gradients in the forward and gave them to the "
            "first backward through it: a second one (retain_graph=True) needs the loss again"
        )
    grad_h, grad_w, grad_b = ctx.gradients
    ctx.gradients = False
    for grad in (grad_h, grad_w, grad_b):
        if grad is not None:
            grad.mul_(grad_out)  # in the gradient's dtype, computed in float32: exact for 1
    if grad_b is not None:
        grad_b = grad_b.to(ctx.bias_dtype)
    return grad_h, grad_w, grad_b, None, None, None, None, None


def _runs_native(hidden, weight, bias):
    """Whether the CUDA kernels take these operands: CUDA tensors of one float dtype on one
    device, from torch's default stream."""
    if not (hidden.is_cuda and weight.device == hidden.device):
        return False
    if hidden.dtype not in _NATIVE_DTYPES or weight.dtype != hidden.dtype:
        return False
    if bias is not None and (bias.dtype != hidden.dtype or bias.device != hidden.device):
        return False
    return torch.cuda.current_stream(hidden.device).cuda_stream == 0


def linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                         chunk_mb=64):
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` a block of rows at a time; see the
    module's documentation. ``hidden``: ``[..., features]``; ``labels``: ``hidden``'s leading
    shape; ``weight``: ``[vocab, features]``."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: give one of {_REDUCTIONS}")
    if not chunk_mb or chunk_mb <= 0:
        raise ValueError(f"chunk_mb={chunk_mb!r}: give a positive number of MiB")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} for hidden states of "
                         f"{hidden.shape[-1]} features: give [vocab, {hidden.shape[-1]}]")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels of dtype {labels.dtype}: give torch.int64 class indices, as "
                        "F.cross_entropy takes")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels of shape {tuple(labels.shape)} for hidden states of shape "
                         f"{tuple(hidden.shape)}: give {tuple(hidden.shape[:-1])}")
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.is_cuda and torch.is_autocast_enabled("cuda"):
        # As autocast casts a linear layer's operands (a no-op for tensors of its dtype).
        cast = torch.get_autocast_dtype("cuda")
        flat, weight = flat.to(cast), weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    if _runs_native(flat, weight, bias):
        with torch.autocast("cuda", enabled=False):
            # Whether autograd records the loss (inside forward it never does).
            recorded = torch.is_grad_enabled()
            out = _FusedLinearCrossEntropy.apply(flat.contiguous(), weight.contiguous(),
                                                 None if bias is None else bias.contiguous(),
                                                 labels.reshape(-1).contiguous(), ignore_index,
                                                 reduction, chunk_mb, recorded)
    else:
        out = _LinearCrossEntropy.apply(flat, weight, bias, labels.reshape(-1), ignore_index,
                                        reduction, chunk_mb)
    return out.reshape(lead) if reduction == "none" else out


def patch_causal_lm(model, chunk_mb=64):
    """Makes ``model`` (a Hugging Face causal LM: a base model and an output embedding) compute
    its loss with ``linear_cross_entropy`` when called with ``labels``; returns ``model``."""
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or head is None:
        raise TypeError(f"{type(model).__name__} has no base model and output embedding: give "
                        "a Hugging Face causal LM (LlamaForCausalLM, GPT2LMHeadModel, ...)")
    if "forward" in model.__dict__:
        return model  # patched already

    def forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        if labels is None:
            return type(self).forward(self, input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        outputs = base(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state[:, :-1]
        shifted = labels[:, 1:]
        if num_items_in_batch is None:
            loss = linear_cross_entropy(hidden, head.weight, shifted, bias=head.bias,
                                        chunk_mb=chunk_mb)
        else:
            # The Trainer's gradient accumulation: the sum over this micro-batch divided by
            # the tokens of the whole batch, as Hugging Face's loss does.
            loss = linear_cross_entropy(hidden, head.weight, shifted, bias=head.bias,
                                        reduction="sum", chunk_mb=chunk_mb)
            loss = loss / num_items_in_batch
        return CausalLMOutputWithPast(loss=loss, logits=None,
                                      past_key_values=getattr(outputs, "past_key_values", None))

    model.forward = types.MethodType(forward, model)
    return model


def unpatch_causal_lm(model):
    """Restores the forward ``patch_causal_lm`` replaced."""
    model.__dict__.pop("forward", None)
    return model
