"""A pinned host memory pool under an explicit byte budget: ``headroom.torch.PinnedPool``.

What ``saved_activations(offload=...)`` copies its activations into. The pool holds chunks of
page-locked host memory (``torch.empty(..., pin_memory=True)``), each a power of two of
``chunk_mb`` MiB or more, or less where the rest of the budget is smaller (torch's host
allocator rounds every pinned block up to a power of two, so the pool asks for exactly those
sizes and the budget bounds the bytes really pinned), and hands out 512-byte-aligned ranges of
them, first fit, coalescing freed neighbours. Chunks are kept until ``close()`` (or the pool's
end): pinning is slow, reuse is free, so a pool lives across steps and a second forward finds
its chunks.

A range is released with the CUDA event after which nothing reads or writes it any more (the
host-to-device copy that brought it back): it returns to the free list only once that event has
completed, checked without waiting at the next allocation, and waited on only when nothing else
fits. So a range is never reused while a copy may still touch it, whatever Python does with the
objects that held it.

Exhaustion is a typed error: an allocation that fits neither a free range nor a new chunk under
the budget raises ``PinnedBudgetError`` (a ``MemoryError``) naming the budget, the bytes pinned
and in use, and the request — never a CUDA error from the host allocator.

One lock guards the lists: backward releases ranges on autograd's device thread while another
thread may allocate.

``stats()``: ``budget_bytes`` (``None``: unbounded), ``pinned_bytes`` (chunks held),
``in_use_bytes`` (ranges handed out and not yet reusable), ``peak_in_use_bytes``, ``chunks``.

This module sits on torch's pinned tensors and CUDA events; it knows nothing of autograd.
"""

import threading

import torch

__all__ = ["PinnedPool", "PinnedBudgetError", "ALIGNMENT"]

#: Every range starts at a multiple of this many bytes.
ALIGNMENT = 512
_MIB = 1 << 20


class PinnedBudgetError(MemoryError):
    """An allocation that the pool's budget cannot hold."""


def _next_power_of_two(n):
    return 1 << max(0, (n - 1).bit_length())


class _Chunk:
    __slots__ = ("buffer", "size", "free")

    def __init__(self, size, pin):
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.size = size
        self.free = [(0, size)]  # (offset, length), sorted by offset, coalesced

    def take(self, nbytes):
        for i, (offset, length) in enumerate(self.free):
            if length >= nbytes:
                if length == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = (offset + nbytes, length - nbytes)
                return offset
        return None

    def give_back(self, offset, nbytes):
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, nbytes))
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i] = (free[i][0], free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]


class PinnedRange:
    """``nbytes`` bytes of a pool's chunk from ``offset``; ``view(dtype, shape)`` reads them as
    a tensor."""

    __slots__ = ("chunk", "offset", "nbytes")

    def __init__(self, chunk, offset, nbytes):
        self.chunk, self.offset, self.nbytes = chunk, offset, nbytes

    def view(self, dtype, shape):
        """The range's first ``prod(shape)`` elements of ``dtype`` as a pinned tensor."""
        count = torch.Size(shape).numel() * dtype.itemsize
        raw = self.chunk.buffer[self.offset:self.offset + count]
        return raw.view(dtype).view(shape)


class PinnedPool:
    """Pinned host memory under ``budget_mb`` MiB (``None``: unbounded), in chunks of at least
    ``chunk_mb`` MiB; see the module's documentation."""

    def __init__(self, budget_mb=None, *, chunk_mb=64):
        if budget_mb is not None and (not isinstance(budget_mb, (int, float)) or budget_mb <= 0):
            raise ValueError(f"budget_mb={budget_mb!r}: give a positive number of MiB, or None")
        if not isinstance(chunk_mb, int) or chunk_mb < 1:
            raise ValueError(f"chunk_mb={chunk_mb!r}: give a positive int")
        self.budget_bytes = None if budget_mb is None else int(budget_mb * _MIB)
        self.chunk_bytes = _next_power_of_two(chunk_mb * _MIB)
        self._chunks = []
        self._pending = []  # (event, range): released, reusable once the event completed
        self._in_use = 0
        self._peak_in_use = 0
        self._pin = True  # False only in tests of the bookkeeping on a machine with no GPU
        # Backward releases ranges on autograd's device thread (saved tensors die there) while a
        # forward may allocate on another: every change of the lists holds this lock.
        self._lock = threading.RLock()

    @property
    def pinned_bytes(self):
        return sum(c.size for c in self._chunks)

    def stats(self):
        return {"budget_bytes": self.budget_bytes, "pinned_bytes": self.pinned_bytes,
                "in_use_bytes": self._in_use, "peak_in_use_bytes": self._peak_in_use,
                "chunks": len(self._chunks)}

    def reset_peak(self):
        """Starts ``peak_in_use_bytes`` again from the bytes in use now."""
        self._peak_in_use = self._in_use

    def allocate(self, nbytes):
        """A ``PinnedRange`` of at least ``nbytes`` bytes (``PinnedBudgetError`` when the budget
        cannot hold it)."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: give a non-negative size")
        size = max(ALIGNMENT, (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
        with self._lock:
            self._collect(wait=False)
            found = self._take(size)
            if found is None and self._pending:
                self._collect(wait=True)
                found = self._take(size)
            if found is None:
                found = self._grow(size)
            self._in_use += size
            self._peak_in_use = max(self._peak_in_use, self._in_use)
            return found

    def release(self, pinned, after=None):
        """Gives ``pinned`` back once the CUDA event ``after`` has completed (at once when
        ``None``: nothing in flight touches it)."""
        with self._lock:
            if after is None:
                self._give_back(pinned)
            else:
                self._pending.append((after, pinned))

    def close(self):
        """Waits for every pending copy and unpins every chunk."""
        with self._lock:
            self._collect(wait=True)
            self._chunks.clear()

    def _take(self, size):
        for chunk in self._chunks:
            offset = chunk.take(size)
            if offset is not None:
                return PinnedRange(chunk, offset, size)
        return None

    def _grow(self, size):
        pinned = self.pinned_bytes
        chunk_size = max(self.chunk_bytes, _next_power_of_two(size))
        if self.budget_bytes is not None and pinned + chunk_size > self.budget_bytes:
            # A smaller chunk where the budget's rest holds the request but not a whole chunk:
            # the largest power of two that fits (still torch's pinned size).
            room = self.budget_bytes - pinned
            if room >= _next_power_of_two(size):
                chunk_size = 1 << (room.bit_length() - 1)
        if self.budget_bytes is not None and pinned + chunk_size > self.budget_bytes:
            raise PinnedBudgetError(
                f"the pinned pool's budget of {self.budget_bytes} bytes "
                f"({self.budget_bytes / _MIB:.1f} MiB) cannot hold {size} more bytes: "
                f"{pinned} bytes are pinned in chunks, {self._in_use} in use, and a new chunk "
                f"would pin {chunk_size}; raise budget_mb, offload fewer tensors "
                "(min_elements) or compress them first (compress=\"int8\")"
            )
        chunk = _Chunk(chunk_size, self._pin)
        self._chunks.append(chunk)
        offset = chunk.take(size)
        return PinnedRange(chunk, offset, size)

    def _give_back(self, pinned):
        pinned.chunk.give_back(pinned.offset, pinned.nbytes)
        self._in_use -= pinned.nbytes

    def _collect(self, wait):
        still = []
        for event, pinned in self._pending:
            if wait:
                event.synchronize()
            if wait or event.query():
                self._give_back(pinned)
            else:
                still.append((event, pinned))
        self._pending = still
