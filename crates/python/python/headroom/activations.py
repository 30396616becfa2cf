"""Saved activations kept compressed: ``headroom.torch.saved_activations``.

``with saved_activations(compress="int8"): loss = model(x)`` installs
``torch.autograd.graph.saved_tensors_hooks`` for the forward: every activation autograd saves for
backward is encoded when it is saved (its own memory is freed as soon as the forward no longer
holds it) and decoded into a fresh tensor when backward needs it.

Codecs (Headroom's, those of ``headroom-checkpoint``'s ``Compression``):

- ``"int8"``: linear symmetric absmax quantisation per block of ``block`` consecutive elements
  (a power of two from 32 to 4096, default 256): one f32 absmax a block and one signed byte an
  element, ``code = round_half_even(x / absmax * 127)``; decoded as ``code / 127 * absmax``, so
  every element comes back within ``absmax / 254`` of its block's largest magnitude (which comes
  back exactly), and a block holding a NaN or an infinity decodes to NaN throughout. 1 + 4/block
  bytes an element: 0.254x of f32, 0.508x of bf16. On CUDA tensors it is one kernel launch each
  way on torch's default stream (the same bits as the CPU's); on CPU tensors the host codec.
- ``"bf16"``: a round-to-nearest-even cast of f32 and f64 activations (2 bytes an element).
- ``None``: nothing is encoded (the hooks only count), for a baseline with the same code path.

Which saved tensors are encoded: floating tensors of at least ``min_elements`` elements
(default 16 Ki) that require grad and are not parameters; a view with other strides (attention's
q, k and v, permuted views of one projection) is read through a contiguous copy and comes back
contiguous, with its shape. So parameters (leaves that
require grad) and tensors derived from one parameter through casts and views (autocast's copies
of the weights, a transposed weight) are kept: their memory outlives the step anyway. Tensors
that do not require grad are kept too: integer and boolean saves (indices, dropout masks), the
statistics an op computes for its own backward (layer norm's mean and rstd, attention's
log-sum-exp), whose errors backward would amplify, and inputs that need no gradient. Saves of one
tensor object in one forward (its version unchanged) share one encoded copy. A saved tensor
modified in place after it was saved raises at backward, as PyTorch's own check would.

Offload (``offload=True``, or a ``PinnedPool`` to share one pool between contexts): the CUDA
saves the codec would take (any floating dtype when ``compress=None``), after encoding, are
copied to pinned host memory on a side stream that waits for the work that made them; their
device memory goes back to torch's allocator once the copy is done (``record_stream``: stream
order, not Python's lifetimes). Backward brings each back on the side stream into memory
allocated on its own stream, which waits for the copy's event before it reads; while it
decodes one save, the saves made just before it (backward's next ones) are fetched ahead, up
to ``prefetch_mb`` MiB in flight (0: none). With ``hold_peak=True`` fetching ahead follows a
schedule drawn from the first backward on that device, which fetches nothing ahead (the peak
of ``save_on_cpu``'s schedule) and records, between each two unpacks, the highest bytes it
held: each later save is fetched at the earliest unpack from which every step up to its own
keeps those bytes, what is already held ahead and the copy under that backward's peak, with at
most ``prefetch_mb`` MiB held ahead; a backward whose unpacks differ (another graph) drops the
schedule and the next is profiled again. It reads torch's running peak
(``torch.cuda.max_memory_allocated``): reset it (``torch.cuda.reset_peak_memory_stats()``)
before each step, or the profile sees no room and nothing is fetched ahead (a
``RuntimeWarning`` says so once, when the running peak did not rise during the profiled
backward). Under Headroom's allocator, which does not serve those statistics, it is refused.
``keep_last_mb`` keeps the
last that many MiB of offloaded saves on the device until later saves push them out: the
forward's last saves never leave, and backward, which takes them first, neither waits for
their copy out nor for their copy back. They cost up to ``keep_last_mb`` MiB from the end of
the forward until backward takes them, below the step's peak wherever that peak comes late in
backward (as the gradients grow). With ``every_save=True`` every CUDA save that is not a
parameter's memory is offloaded as it is, whatever its size, dtype or need of a gradient, as
``save_on_cpu`` does: the statistics, integer saves and saves under ``min_elements`` that the
codec leaves on the device go too (0.66 MB of ViT-L/16's saves at batch 32, which otherwise
stay on the device through the step).
A pool range is reused only after the last copy that read it has completed
(``headroom.pinned``). ``budget_mb`` bounds the pool
(``offload=True`` only); a save the budget cannot hold raises ``PinnedBudgetError`` in the
forward. Offloaded saves come back bit for bit (then decoded by their codec), contiguous.
CPU saves are never offloaded.

What raises: an unknown codec, a block size the codec does not take, ``min_elements`` below 1,
an ``offload`` that is not a bool or a pool, ``budget_mb`` without ``offload=True``, a negative
``prefetch_mb`` or ``keep_last_mb``, ``keep_last_mb`` or ``every_save`` without offload, an
``every_save`` or a ``hold_peak`` that is not a bool, a ``hold_peak`` under Headroom's allocator
(``ValueError``, at construction); a save the pool's budget cannot hold
(``PinnedBudgetError``, in the forward); an ``"int8"`` save of a CUDA tensor while torch's current
stream is not the default stream (``ValueError``, in the forward: the kernel runs on the default
stream; ``"bf16"`` works on any stream).

``stats`` counts what the context saw: ``saved`` tensors, ``encoded`` ones, ``shared`` saves,
``original_bytes`` of the encoded tensors and their ``encoded_bytes``, ``offloaded`` saves and
their ``offloaded_bytes`` (after encoding); ``pool.stats()`` has the pinned bytes.

This module sits on torch's saved-tensor hooks and streams, ``headroom.pinned`` and
``headroom._native``'s codec; it knows no model.
"""

import bisect
import collections
import sys
import warnings
import weakref

import torch

from . import _native
from .pinned import PinnedPool

__all__ = ["saved_activations", "DEFAULT_BLOCK", "DEFAULT_MIN_ELEMENTS", "CODECS"]

#: The 8-bit block: 256 elements (headroom-checkpoint's ``DEFAULT_BLOCK``).
DEFAULT_BLOCK = 256
#: The smallest save encoded: 16 Ki elements (headroom-checkpoint's ``DEFAULT_MIN_ELEMENTS``).
DEFAULT_MIN_ELEMENTS = 1 << 14
#: The codecs ``compress`` takes.
CODECS = ("int8", "bf16", None)

_INT8_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_BF16_DTYPES = (torch.float32, torch.float64)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
# Autograd nodes of casts and views: a tensor reached from a parameter through them alone is the
# parameter's memory or a copy that lives as long (autocast's cache).
_CAST_AND_VIEW_NODES = ("ToCopyBackward", "TBackward", "ViewBackward", "TransposeBackward",
                        "PermuteBackward", "ExpandBackward", "UnsqueezeBackward",
                        "AliasBackward")


def _derived_from_parameter(t):
    """Whether ``t`` is a parameter, or reached from one through casts and views only."""
    if t.is_leaf:
        return t.requires_grad
    node = t.grad_fn
    for _ in range(8):
        if node is None:
            return False
        if type(node).__name__ == "AccumulateGrad":
            return True
        if not type(node).__name__.startswith(_CAST_AND_VIEW_NODES):
            return False
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


def _stream_handle(device):
    """Torch's current stream's handle on ``device`` (0 for the legacy default stream)."""
    return torch.cuda.current_stream(device).cuda_stream


class _Int8:
    """One activation's 8-bit codes and absmax."""

    __slots__ = ("codes", "absmax", "shape", "dtype", "block", "source", "version",
                 "__weakref__")

    def __init__(self, t, block):
        n = t.numel()
        self.codes = torch.empty(n, dtype=torch.int8, device=t.device)
        self.absmax = torch.empty((n + block - 1) // block, dtype=torch.float32, device=t.device)
        self.shape, self.dtype, self.block = t.shape, t.dtype, block
        self.source, self.version = weakref.ref(t), t._version
        index, stream = _where(t.device)
        # A view with other strides (attention's q, k and v of one projection) is read through
        # a contiguous copy that lives only for the launch (stream-ordered on CUDA).
        dense = t if t.is_contiguous() else t.contiguous()
        _native.quantize_int8(index, stream, _DTYPE_NAMES[t.dtype], dense.data_ptr(), n, block,
                              self.codes.data_ptr(), self.absmax.data_ptr())

    def encoded_bytes(self):
        return self.codes.numel() + 4 * self.absmax.numel()

    def payload(self):
        return [self.codes, self.absmax]

    def set_payload(self, tensors):
        self.codes, self.absmax = tensors if tensors is not None else (None, None)

    def decode(self):
        _check_version(self)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.codes.device)
        index, stream = _where(out.device)
        _native.dequantize_int8(index, stream, _DTYPE_NAMES[self.dtype], self.codes.data_ptr(),
                                self.absmax.data_ptr(), out.numel(), self.block, out.data_ptr())
        return out


class _Bf16:
    """One activation cast to bf16."""

    __slots__ = ("half", "dtype", "source", "version", "__weakref__")

    def __init__(self, t):
        self.half = t.to(torch.bfloat16)
        self.dtype = t.dtype
        self.source, self.version = weakref.ref(t), t._version

    def encoded_bytes(self):
        return 2 * self.half.numel()

    def payload(self):
        return [self.half]

    def set_payload(self, tensors):
        self.half = tensors[0] if tensors is not None else None

    def decode(self):
        _check_version(self)
        return self.half.to(self.dtype)


class _Raw:
    """One activation as it is (``compress=None``), so that it can be offloaded."""

    __slots__ = ("tensor", "source", "version", "__weakref__")

    def __init__(self, t):
        self.tensor = t
        self.source, self.version = weakref.ref(t), t._version

    def encoded_bytes(self):
        return self.tensor.numel() * self.tensor.element_size()

    def payload(self):
        return [self.tensor]

    def set_payload(self, tensors):
        self.tensor = tensors[0] if tensors is not None else None

    def decode(self):
        _check_version(self)
        return self.tensor


class _Offloaded:
    """An encoded activation whose payload lives in pinned host memory: the pool's ``ranges``,
    written on the offload stream up to the event ``stored``; ``gpu`` holds its copies back on
    the device once fetched (the event ``fetched``), until backward takes them. The ranges go
    back to the pool when autograd lets go of this object, after the last copy that read them."""

    __slots__ = ("inner", "ranges", "specs", "device", "nbytes", "stored", "fetched", "gpu",
                 "resident", "index", "owner", "__weakref__")

    def __init__(self, inner, ranges, specs, device, stored, index, owner, resident=None):
        self.inner, self.ranges, self.specs, self.device = inner, ranges, specs, device
        # The payload's bytes (the ranges are rounded up).
        self.nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs)
        self.stored, self.fetched, self.gpu = stored, None, None
        # The payload while it is kept on the device, not yet copied out (keep_last_mb).
        self.resident = resident
        self.index, self.owner = index, owner

    def decode(self):
        return self.owner._unpack_offloaded(self)

    def __del__(self):
        owner = getattr(self, "owner", None)
        if owner is None:
            return
        try:
            if self.resident is not None:
                owner._resident_bytes -= self.nbytes
                self.resident = None
            if self.gpu is not None:
                owner._in_flight -= self.nbytes  # fetched ahead, never taken
                # Its memory goes back to the current stream once the copy into it is done.
                torch.cuda.current_stream(self.device).wait_event(self.fetched)
                self.gpu = None
            if self.ranges:
                last = self.fetched if self.fetched is not None else self.stored
                for pinned in self.ranges:
                    owner.pool.release(pinned, after=last)
                self.ranges = []
        except Exception:  # noqa: BLE001 (at interpreter shutdown the pool may be gone)
            if not sys.is_finalizing():
                raise


class _Profile:
    """``hold_peak``'s record of one device's backward and the schedule it gives the next ones
    (a backward is one autograd graph task; its k-th unpack of an offloaded save stands for the
    same node in every backward of the same graph).

    A backward with no schedule is profiled and fetches nothing ahead: at each unpack it records
    the save's index offset from the backward's first (``offsets``), the bytes its fetch moves
    (``sizes``: 0 for a save kept on the device or taken already) and the allocator's running
    peak (``maxima``); when it ends, ``highs[k]`` is the running peak at the next unpack (the
    end's peak after the last): no lower than what step k held at its highest. Its peak is the
    ceiling, and ``_prefetch_plan`` places each save's fetch as early as it fits under it.
    Backwards that follow fetch what the schedule names at each unpack; one whose unpacks do not
    match (another graph) drops the schedule, and the next is profiled again. The peaks are
    torch's running statistic: without ``torch.cuda.reset_peak_memory_stats()`` before the
    profiled step every ``highs[k]`` equals the ceiling and nothing is fetched ahead."""

    __slots__ = ("task", "mode", "first_index", "steps", "offsets", "sizes", "maxima",
                 "plan", "cap")

    def __init__(self):
        self.task, self.mode, self.first_index, self.steps = None, "profile", 0, 0
        self.offsets, self.sizes, self.maxima, self.plan, self.cap = [], [], [], None, 0

    def begin_unpack(self, entry, size, cap):
        """Records an unpack of ``entry`` (``size`` bytes to fetch) in the running backward;
        returns the indices of the saves to fetch now."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return ()  # outside backward (torch.autograd.graph's unpack by hand)
        if task != self.task:
            self.task, self.first_index = task, entry.index
            self.mode = "follow" if self.plan is not None and self.cap == cap else "profile"
            self.steps = 0
            if self.mode == "profile":
                self.offsets, self.sizes, self.maxima, self.cap = [], [], [], cap
            device = entry.device
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self.finish(torch.cuda.max_memory_allocated(device)))
        step, self.steps = self.steps, self.steps + 1
        offset = entry.index - self.first_index
        if self.mode == "profile":
            self.maxima.append(torch.cuda.max_memory_allocated(entry.device))
            self.offsets.append(offset)
            self.sizes.append(size)
            return ()
        if self.mode == "discard":
            return ()
        if step >= len(self.offsets) or (self.offsets[step], self.sizes[step]) != (offset, size):
            self.mode, self.plan = "discard", None  # another graph: profile the next backward
            return ()
        return [self.first_index + self.offsets[later] for later in self.plan[step]]

    def finish(self, end_peak):
        if self.mode == "follow" and self.steps != len(self.offsets):
            self.plan = None
        if self.mode != "profile":
            return
        highs = self.maxima[1:] + [end_peak]
        self.plan = _prefetch_plan(self.sizes, highs, end_peak, self.cap)
        if self.maxima and self.maxima[0] >= end_peak and any(self.sizes):
            _warn_once(
                "hold_peak=True: torch's running peak did not rise during the profiled backward, "
                "so nothing will be fetched ahead; if the peak statistics are not reset before "
                "each step, call torch.cuda.reset_peak_memory_stats() there"
            )


_WARNED = set()


def _warn_once(message):
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _prefetch_plan(sizes, highs, ceiling, cap):
    """Per step k, the later steps whose saves step k fetches ahead. A save taken at step u
    (``sizes[u]`` bytes, 0 for none to fetch) fetched at step f holds its bytes through steps
    f to u-1; steps are served in the order backward takes them, each fetched at the earliest
    step f from which every step to u-1 keeps its high point (``highs``), what is already held
    ahead and the save under ``ceiling``, and what is held ahead under ``cap``. A save that fits
    nowhere is fetched when taken."""
    held = [0] * len(sizes)
    plan = [[] for _ in sizes]
    for taken in range(1, len(sizes)):
        size = sizes[taken]
        if size == 0:
            continue
        first = None
        step = taken - 1
        while step >= 0 and highs[step] + held[step] + size <= ceiling \
                and held[step] + size <= cap:
            first, step = step, step - 1
        if first is None:
            continue
        for step in range(first, taken):
            held[step] += size
        plan[first].append(taken)
    return plan


_PROFILES = {}  # device index -> _Profile


def _device_index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


def _headroom_allocator_active():
    cuda = sys.modules.get("headroom.cuda")
    return cuda is not None and cuda.is_active()


def _where(device):
    """(device index or ``None`` for the CPU, torch's current stream's handle)."""
    if device.type == "cuda":
        index = _device_index(device)
        return index, _stream_handle(index)
    return None, 0


def _check_version(packed):
    source = packed.source()
    if source is not None and source._version != packed.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a saved activation of shape {tuple(source.shape)} is at version "
            f"{source._version}; expected version {packed.version} (saved_activations encoded "
            "it when it was saved)"
        )


class saved_activations:
    """A context manager that keeps the activations its forward saves encoded with
    ``compress`` (``"int8"``, ``"bf16"`` or ``None``) and, with ``offload``, in pinned host
    memory; see the module's documentation."""

    def __init__(self, compress="int8", *, offload=False, budget_mb=None, prefetch_mb=128,
                 hold_peak=False, keep_last_mb=0, every_save=False, block=DEFAULT_BLOCK,
                 min_elements=DEFAULT_MIN_ELEMENTS):
        if compress not in CODECS:
            raise ValueError(f"compress={compress!r}: give one of {CODECS}")
        if compress == "int8" and (
            not isinstance(block, int) or block < 32 or block > 4096 or block & (block - 1)
        ):
            raise ValueError(f"block={block!r}: give a power of two from 32 to 4096")
        if not isinstance(min_elements, int) or min_elements < 1:
            raise ValueError(f"min_elements={min_elements!r}: give a positive int")
        if isinstance(offload, PinnedPool):
            if budget_mb is not None:
                raise ValueError("budget_mb is the pool's: give it to PinnedPool, not here")
            pool = offload
        elif offload is True:
            pool = PinnedPool(budget_mb)
        elif offload is False:
            if budget_mb is not None:
                raise ValueError("budget_mb bounds the offload pool: give offload=True with it")
            pool = None
        else:
            raise ValueError(f"offload={offload!r}: give True, False or a PinnedPool")
        if not isinstance(prefetch_mb, (int, float)) or prefetch_mb < 0:
            raise ValueError(f"prefetch_mb={prefetch_mb!r}: give a non-negative number of MiB")
        if not isinstance(hold_peak, bool):
            raise ValueError(f"hold_peak={hold_peak!r}: give True or False")
        if not isinstance(keep_last_mb, (int, float)) or keep_last_mb < 0:
            raise ValueError(f"keep_last_mb={keep_last_mb!r}: give a non-negative number of MiB")
        if keep_last_mb and pool is None:
            raise ValueError("keep_last_mb keeps the last offloaded saves: give offload with it")
        if not isinstance(every_save, bool):
            raise ValueError(f"every_save={every_save!r}: give True or False")
        if every_save and pool is None:
            raise ValueError("every_save chooses what is offloaded: give offload with it")
        if hold_peak and _headroom_allocator_active():
            raise ValueError(
                "hold_peak=True reads PyTorch's allocator statistics, which Headroom's allocator "
                "does not serve: leave hold_peak out under headroom.cuda.use_allocator()"
            )
        self.compress = compress
        self.hold_peak = hold_peak
        self.block = block
        self.min_elements = min_elements
        self.pool = pool
        self.prefetch_bytes = int(prefetch_mb * (1 << 20))
        self.keep_last_bytes = int(keep_last_mb * (1 << 20))
        self.every_save = every_save
        self.stats = {"saved": 0, "encoded": 0, "shared": 0, "original_bytes": 0,
                      "encoded_bytes": 0, "offloaded": 0, "offloaded_bytes": 0}
        self._shared = {}
        self._hooks = None
        self._streams = {}
        self._order = []  # weak references to the offloaded saves, in the order they were made
        self._indices = []  # their indices (increasing)
        self._count = 0
        self._in_flight = 0  # bytes fetched ahead and not yet taken by backward
        # An experiment of bench/saved_activations.py (offload_fitN variants): the save backward
        # is decoding counts against prefetch_mb, so a large save leaves less room ahead.
        self._prefetch_counts_taken = False
        self._resident = collections.deque()  # saves kept on the device (weak), oldest first
        self._resident_bytes = 0

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        if len(self._order) > 4096:
            live = [(i, ref) for i, ref in zip(self._indices, self._order) if ref() is not None]
            self._indices = [i for i, _ in live]
            self._order = [ref for _, ref in live]
        if len(self._resident) > 4096:
            # Kept saves that autograd let go of before later saves pushed them out (a forward
            # whose saves all fit under keep_last_mb): their references would pile up.
            self._resident = collections.deque(ref for ref in self._resident if ref() is not None)
        return self

    def __exit__(self, *exc):
        hooks, self._hooks = self._hooks, None
        self._shared.clear()
        return hooks.__exit__(*exc)

    def _selected(self, t, dtypes):
        return (
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.dtype in dtypes
            and t.layout == torch.strided
            and t.device.type in ("cuda", "cpu")
            and t.numel() >= self.min_elements
            and t.requires_grad
            and not _derived_from_parameter(t)
        )

    def _encodes(self, t):
        if self.compress is None:
            return False
        return self._selected(t, _INT8_DTYPES if self.compress == "int8" else _BF16_DTYPES)

    def _offloads(self, t):
        if self.pool is None or t.device.type != "cuda":
            return False
        if self.every_save:
            return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
                    and t.numel() > 0 and (t.numel() == 1 or 0 not in t.stride())
                    and not _derived_from_parameter(t))
        return self._selected(t, _INT8_DTYPES)

    def _pack(self, t):
        self.stats["saved"] += 1
        encodes, offloads = self._encodes(t), self._offloads(t)
        if not (encodes or offloads):
            # A detached alias (same storage and version counter), never ``t`` itself: a node
            # that saves its own output would otherwise hold the tensor that holds the node, a
            # cycle through C++ that keeps the graph alive when no backward releases it.
            return t.detach()
        entry = self._shared.get(id(t))
        if entry is not None:
            ref, version, packed_ref = entry
            packed = packed_ref()
            if ref() is t and version == t._version and packed is not None:
                self.stats["shared"] += 1
                return packed
        with torch.no_grad():
            if not encodes:
                packed = _Raw(t)
            elif self.compress == "int8":
                packed = _Int8(t, self.block)
            else:
                packed = _Bf16(t)
            if encodes:
                self.stats["encoded"] += 1
                self.stats["original_bytes"] += t.numel() * t.element_size()
                self.stats["encoded_bytes"] += packed.encoded_bytes()
            if offloads:
                packed = self._offload(packed, t.device)
        if len(self._shared) >= 4096:
            # A context around many forwards: forget the tensors that are gone.
            self._shared = {k: v for k, v in self._shared.items() if v[0]() is not None}
        self._shared[id(t)] = (weakref.ref(t), t._version, weakref.ref(packed))
        return packed

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.decode()

    def _side_stream(self, device):
        index = _device_index(device)
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(index)
        return stream

    def _offload(self, packed, device):
        """Copies ``packed``'s payload to the pool on the offload stream, after the work that
        made it; its device memory returns to torch's allocator once the copy is done. With
        ``keep_last_mb``, the copy waits until that many bytes of later saves follow it."""
        self._count += 1
        payload = packed.payload()
        specs = [(t.dtype, tuple(t.shape)) for t in payload]
        packed.set_payload(None)
        if self.keep_last_bytes:
            entry = _Offloaded(packed, [], specs, device, None, self._count, self,
                               resident=payload)
            self._resident.append(weakref.ref(entry))
            self._resident_bytes += entry.nbytes
            while self._resident_bytes > self.keep_last_bytes and self._resident:
                oldest = self._resident.popleft()()
                if oldest is not None and oldest.resident is not None:
                    payload, oldest.resident = oldest.resident, None
                    self._resident_bytes -= oldest.nbytes
                    self._store(oldest, payload)
        else:
            entry = _Offloaded(packed, [], specs, device, None, self._count, self)
            self._store(entry, payload)
        self._order.append(weakref.ref(entry))
        self._indices.append(self._count)
        return entry

    def _store(self, entry, payload):
        """Copies ``payload`` (``entry``'s) to the pool on the offload stream."""
        compute = torch.cuda.current_stream(entry.device)
        side = self._side_stream(entry.device)
        side.wait_stream(compute)
        ranges = []
        try:
            with torch.cuda.stream(side):
                for tensor in payload:
                    pinned = self.pool.allocate(tensor.numel() * tensor.element_size())
                    ranges.append(pinned)
                    pinned.view(tensor.dtype, tensor.shape).copy_(tensor, non_blocking=True)
                    tensor.record_stream(side)
        finally:
            stored = torch.cuda.Event()
            stored.record(side)
            entry.ranges, entry.stored = ranges, stored
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += entry.nbytes

    def _fetch(self, entry, device):
        """Starts the copy of ``entry`` back to the device on the offload stream, into memory
        allocated on the current stream (so it waits for that stream's work so far).

        The copies are not recorded on the offload stream (``record_stream``): the current
        stream waits for the event ``fetched`` before anything reads them (in backward, or when
        a save fetched ahead is dropped untaken), so their memory is free for the current
        stream's next allocation as soon as backward lets go of them, as ``save_on_cpu``'s is.
        A recorded use would hold each until the offload stream's next event, one save beyond
        ``save_on_cpu``'s peak (measured at 5ec2bce: 26 MiB, the size of one of ViT-L/16's
        1,024-wide saves at batch 32)."""
        compute = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        gpu = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in entry.specs]
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            for tensor, pinned, (dtype, shape) in zip(gpu, entry.ranges, entry.specs):
                tensor.copy_(pinned.view(dtype, shape), non_blocking=True)
        fetched = torch.cuda.Event()
        fetched.record(side)
        entry.gpu, entry.fetched = gpu, fetched
        self._in_flight += entry.nbytes

    def _unpack_offloaded(self, entry):
        device = entry.device
        scheduled = None
        if self.hold_peak:
            taken = entry.fetched is not None and entry.gpu is None
            size = 0 if entry.resident is not None or taken else entry.nbytes
            scheduled = _PROFILES.setdefault(_device_index(device), _Profile()).begin_unpack(
                entry, size, self.prefetch_bytes)
        if entry.resident is not None:
            # Never copied out: backward reads it where it is, and it goes when autograd lets go
            # of the entry (after this node, or with a retained graph).
            gpu = list(entry.resident)
        else:
            if entry.gpu is None:
                self._fetch(entry, device)
            torch.cuda.current_stream(device).wait_event(entry.fetched)
            gpu, entry.gpu = entry.gpu, None
            self._in_flight -= entry.nbytes
        if scheduled is None:
            self._prefetch_before(entry, device)
        else:
            for index in scheduled:
                self._fetch_scheduled(index, device)
        inner = entry.inner
        inner.set_payload(gpu)
        try:
            return inner.decode()
        finally:
            inner.set_payload(None)

    def _fetch_scheduled(self, index, device):
        """Fetches the save of ``index`` (``hold_peak``'s schedule), unless it is gone, on the
        device or fetched already."""
        position = bisect.bisect_left(self._indices, index)
        if position == len(self._indices) or self._indices[position] != index:
            return
        other = self._order[position]()
        if other is None or other.gpu is not None or not other.ranges or other.fetched is not None:
            return
        self._fetch(other, device)

    def _prefetch_before(self, entry, device):
        """Fetches the saves made before ``entry`` (backward's next ones), nearest first, while
        fewer than ``prefetch_mb`` MiB are in flight."""
        if self.prefetch_bytes == 0:
            return
        order = self._order
        bound = self.prefetch_bytes - (entry.nbytes if self._prefetch_counts_taken else 0)
        position = bisect.bisect_left(self._indices, entry.index) - 1
        while position >= 0 and self._in_flight < bound:
            other = order[position]()
            position -= 1
            if other is None or other.gpu is not None or not other.ranges:
                continue
            if other.fetched is not None:
                continue  # taken by backward already (a retained graph fetches on demand)
            self._fetch(other, device)
