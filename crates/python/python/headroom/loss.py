"""The language-model loss without its logits: ``headroom.torch.linear_cross_entropy`` and
``headroom.torch.patch_causal_lm``.

``linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
chunk_mb=64)`` is ``F.cross_entropy(hidden @ weight.T + bias, labels)`` computed a block of rows
at a time, as headroom-autograd-core's fused loss does: a block's logits (float32, float64 for
float64 inputs; at most ``chunk_mb`` MiB) exist only while that block is computed, in the forward and again in the
backward (recomputed from the saved hidden states and weight rather than kept), so a 128K-token
vocabulary never holds a ``[tokens, vocab]`` tensor. The forward saves the per-row log-sum-exp
(float32); the backward forms each block's ``softmax - one_hot`` and multiplies it into the
hidden states' and the weight's gradients (accumulated in float32, cast once). Half-precision
inputs are multiplied in their dtype with float32 results (``torch.matmul`` then ``.float()``),
as autocast's matmul and PyTorch's float32 cross-entropy would. It runs on any device torch
does, in torch's own kernels: Headroom's fused CUDA kernel is not wired to it yet.

``patch_causal_lm(model)`` makes a Hugging Face causal LM (a base model and an output
embedding: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``GPT2LMHeadModel``, ...) compute its
training loss this way: called with ``labels``, its forward runs the base model, shifts the
labels as Hugging Face does (``-100`` ignored; with the Trainer's ``num_items_in_batch``, the
sum over that count) and returns the loss with ``logits=None``; without labels it is the
model's own forward. ``unpatch_causal_lm`` restores it.

What raises: ``labels`` whose shape is not ``hidden``'s without the feature dimension, a
``weight`` whose columns are not ``hidden``'s features, ``reduction`` other than ``"mean"``,
``"sum"`` or ``"none"``, ``chunk_mb`` not positive (``ValueError``); a model without a base model
and an output embedding (``TypeError``).

This module sits on torch alone.
"""

import types

import torch

__all__ = ["linear_cross_entropy", "patch_causal_lm", "unpatch_causal_lm"]

_REDUCTIONS = ("mean", "sum", "none")


def _row_blocks(rows, vocab, chunk_mb):
    """Rows per block: as many float32 logits as ``chunk_mb`` MiB hold, at least one row."""
    return max(1, int(chunk_mb * (1 << 20)) // (4 * vocab))


def _stats_dtype(dtype):
    """float64 for float64 inputs, else float32 (the logits' and statistics' dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
        losses = torch.where(valid, losses, torch.zeros_like(losses))
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse, count)
        ctx.reduction, ctx.block = reduction, block
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / count.clamp_min(1) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, safe, valid, lse, count = ctx.saved_tensors
        rows = hidden.shape[0]
        stats = lse.dtype
        if ctx.reduction == "none":
            row_scale = grad_out.to(stats) * valid
        else:
            scale = grad_out.to(stats) / (count.clamp_min(1) if ctx.reduction == "mean" else 1)
            row_scale = scale * valid
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
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels of shape {tuple(labels.shape)} for hidden states of shape "
                         f"{tuple(hidden.shape)}: give {tuple(hidden.shape[:-1])}")
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
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
