"""Headroom inside PyTorch.

- ``headroom.cuda``: Headroom's caching allocator as PyTorch's pluggable CUDA allocator
  (``use_allocator`` before the first CUDA allocation), with ``memory_stats``,
  ``memory_summary``, ``snapshot`` and the calls PyTorch cannot make on a pluggable allocator.
- ``headroom.optim``: fused ``Adam``/``AdamW`` and bitsandbytes-compatible ``Adam8bit``/``AdamW8bit``
  as ``torch.optim.Optimizer`` subclasses, stepping Headroom's CUDA kernels on torch's memory.

``import headroom`` needs no torch; ``headroom.optim`` and ``use_allocator`` import it.
"""

from . import _native, cuda

__all__ = ["cuda", "optim"]


def __getattr__(name):
    if name == "optim":
        import importlib

        return importlib.import_module(".optim", __name__)
    raise AttributeError(f"module 'headroom' has no attribute {name!r}")
