"""Headroom inside PyTorch.

- ``headroom.cuda``: Headroom's caching allocator as PyTorch's pluggable CUDA allocator
  (``use_allocator`` before the first CUDA allocation), with ``memory_stats``,
  ``memory_summary``, ``snapshot`` and the calls PyTorch cannot make on a pluggable allocator.
- ``headroom.optim``: fused ``Adam``/``AdamW``, bitsandbytes-compatible ``Adam8bit``/``AdamW8bit``
  ``AdamBf16``/``AdamWBf16`` (bfloat16 parameters, stochastic rounding), torchao-exact
  ``Adam4bit``/``AdamW4bit``, ``SGD`` and ``MasterWeights`` (float32 masters of half-precision
  parameters) as
  ``torch.optim.Optimizer`` subclasses, stepping Headroom's kernels on torch's memory.
- ``headroom.torch``: techniques on ``torch.nn.Module``s through PyTorch's extension points:
  ``optimizer_in_backward`` (a ``headroom.optim`` optimizer stepped in buckets inside backward,
  with schedulers, clipping, accumulation and loss scaling), ``saved_activations`` (saved
  activations kept as 8-bit codes or bf16 between forward and backward) ``plan_blocks``
  (keep, 8-bit or recompute per block under a byte budget) and ``linear_cross_entropy`` /
  ``patch_causal_lm`` (a causal LM's loss without its logits).

``import headroom`` needs no torch; ``headroom.optim``, ``headroom.torch`` and
``use_allocator`` import it.
"""

from . import _native, cuda

__all__ = ["cuda", "optim", "torch"]


def __getattr__(name):
    if name in ("optim", "torch"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'headroom' has no attribute {name!r}")
