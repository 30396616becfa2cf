"""Headroom's caching allocator as PyTorch's pluggable CUDA allocator.

Call ``use_allocator()`` before anything allocates CUDA memory (before the model moves to the
GPU). PyTorch then allocates and frees through Headroom's policy: expandable segments by
default, PyTorch's classic policy with ``conf="expandable_segments:False"``; ``conf`` takes
``PYTORCH_CUDA_ALLOC_CONF``'s syntax, ``per_process_memory_fraction`` included, plus Headroom's
keys. One default differs from the Rust crate's: pages are mapped in physical handles of up to
8 MiB (``expandable_handle_size_mb:8``), a quarter of the driver calls that make the steps where
memory grows slower than with PyTorch's native allocator; ``expandable_handle_size_mb:2`` maps one
handle per 2 MiB page, which lets reclaims give back a little more memory (up to 0.9% of the peak
in our traces).

PyTorch's Python API sets no other hook of a pluggable allocator, so under it
``torch.cuda.memory_stats()``/``memory_allocated()``/``reset_peak_memory_stats()`` raise and
``torch.cuda.empty_cache()``, ``Tensor.record_stream()`` and ``set_per_process_memory_fraction()``
do nothing. Use the functions here instead. Across streams: memory is reused in the order of the
stream it was allocated on, as with PyTorch's allocator; a tensor used on another stream must be
kept alive until that stream is done with it, or marked with ``record_stream(tensor, stream)``.

The statistics functions may be called at any time: until the allocator has served its first
allocation they report an allocator that has served nothing (``memory_stats()`` is ``{}``, as
PyTorch's is before CUDA starts), touch neither CUDA nor the allocator's settings, and leave
``use_allocator(conf)`` free to choose them. ``record_memory_history()`` called before
``use_allocator()`` is remembered and starts with it.
"""

import json as _json

from . import _native

__all__ = [
    "use_allocator",
    "is_active",
    "settings",
    "memory_stats",
    "memory_summary",
    "max_memory_reserved",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "empty_cache",
    "record_memory_history",
    "snapshot",
    "record_stream",
]

_active = False
_conf = ""
# record_memory_history() calls made before use_allocator(): (device, enabled, max_entries).
_pending_history = []


class AllocatorError(RuntimeError):
    """The allocator cannot be installed or used as asked."""


def use_allocator(conf=""):
    """Makes Headroom's allocator PyTorch's CUDA allocator, with settings ``conf``.

    Must run before the first CUDA allocation of the process (before CUDA is initialised):
    otherwise ``AllocatorError``. A bad setting raises ``ValueError`` naming the key. Calling it
    again with the same ``conf`` does nothing.
    """
    global _active, _conf
    import torch

    if _active:
        if conf != _conf:
            raise AllocatorError(
                f"headroom's allocator is already in use with conf={_conf!r}; settings can "
                "only be chosen once, before the first CUDA allocation"
            )
        return
    if torch.cuda.is_initialized():
        raise AllocatorError(
            "CUDA is already initialised in this process, so PyTorch's own allocator is in "
            "use; call headroom.cuda.use_allocator() before the first CUDA allocation (before "
            "moving a model or tensor to the GPU)"
        )
    try:
        _native.configure(conf)
    except RuntimeError as error:
        raise AllocatorError(
            "headroom's allocator already serves allocations in this process (its C functions "
            f"were called directly); its settings can no longer change: {error}"
        ) from error
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        _native.__file__, "headroom_alloc", "headroom_free"
    )
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as error:
        raise AllocatorError(
            "PyTorch refused to swap its allocator (it has already allocated CUDA memory); "
            f"call headroom.cuda.use_allocator() first thing in the program: {error}"
        ) from error
    _active, _conf = True, conf
    pending = list(_pending_history)
    _pending_history.clear()
    for device, enabled, max_entries in pending:
        record_memory_history(enabled, max_entries, device)


def is_active():
    """Whether ``use_allocator`` installed Headroom's allocator in this process."""
    return _active


def settings():
    """The allocator's settings, every one written out (``PYTORCH_CUDA_ALLOC_CONF`` syntax)."""
    return _native.settings()


def _device_index(device):
    if device is None:
        import torch

        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is None:
        import torch

        device = torch.device(device)
        return device.index if device.index is not None else torch.cuda.current_device()
    return index


def _serving():
    """Whether the allocator has served an allocation (before that, reading it would freeze the
    settings that ``use_allocator`` chooses, and resolving ``device=None`` would start CUDA)."""
    return _native.is_in_use()


def memory_stats(device=None):
    """Every statistic of ``torch.cuda.memory_stats()`` (same flat keys), from Headroom's
    allocator; ``{}`` until it has served an allocation."""
    if not _serving():
        return {}
    text = _native.memory_stats_json(_device_index(device))
    return {} if text is None else _json.loads(text)


def max_memory_reserved(device=None):
    """Peak bytes reserved (``reserved_bytes.all.peak``; 0 before the first allocation)."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def max_memory_allocated(device=None):
    """Peak bytes allocated (``allocated_bytes.all.peak``; 0 before the first allocation)."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_summary(device=None, abbreviated=False):
    """``torch.cuda.memory_summary()``'s table, with Headroom's fragmentation lines."""
    summary = _native.memory_summary(_device_index(device), abbreviated) if _serving() else None
    if summary is None:
        return (
            "headroom's allocator has served no allocation yet (headroom.cuda.use_allocator() "
            f"installs it before CUDA starts); settings: {_native.settings()}\n"
        )
    return summary


def reset_peak_memory_stats(device=None):
    """Resets the peaks to the current values (nothing to do before the first allocation)."""
    if _serving():
        _native.reset_peak_stats(_device_index(device))


def empty_cache(device=None):
    """Releases cached memory no tensor uses (``torch.cuda.empty_cache()``)."""
    if _serving():
        _native.empty_cache(_device_index(device))


def record_memory_history(enabled=True, max_entries=0, device=None):
    """Starts (or stops) recording allocation history for ``snapshot``. Called before
    ``use_allocator()``, it takes effect there (recording from the first allocation)."""
    if not (_active or _serving()):
        _pending_history.append((device, bool(enabled), int(max_entries)))
        return
    _native.record_history(_device_index(device), bool(enabled), int(max_entries))


def snapshot(path, device=None):
    """Writes a snapshot pickle that https://pytorch.org/memory_viz opens (one with no segments
    and no events before the first allocation)."""
    if _serving() and _native.snapshot(_device_index(device), str(path)):
        return
    import pickle

    with open(path, "wb") as f:
        pickle.dump(
            {"segments": [], "device_traces": [[]], "allocator_settings": {},
             "external_annotations": []},
            f,
        )


def record_stream(tensor, stream):
    """``tensor.record_stream(stream)`` for Headroom's allocator: the tensor's block is reused
    only after the work queued on ``stream`` up to its free has completed.

    ``stream`` must be one of PyTorch's own ``torch.cuda.Stream`` objects (from its pools, or the
    default stream), on the tensor's device: they live for the rest of the process, which the
    allocator relies on since it records an event on the stream when the tensor is freed.
    Anything else raises ``TypeError``; a ``torch.cuda.ExternalStream`` (whose owner may destroy
    it first) or a stream of another device raises ``ValueError``. While PyTorch's own allocator
    serves the tensor (``use_allocator`` not called), this is ``tensor.record_stream(stream)``."""
    if not getattr(tensor, "is_cuda", False):
        raise ValueError("record_stream needs a CUDA tensor")
    if not _serving():
        tensor.record_stream(stream)
        return
    storage = tensor.untyped_storage()
    _native.record_stream(storage.data_ptr(), tensor.device.index, stream)
