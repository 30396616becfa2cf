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

What raises: an unknown codec, a block size the codec does not take, ``min_elements`` below 1
(``ValueError``, at construction); an ``"int8"`` save of a CUDA tensor while torch's current
stream is not the default stream (``ValueError``, in the forward: the kernel runs on the default
stream; ``"bf16"`` works on any stream).

``stats`` counts what the context saw: ``saved`` tensors, ``encoded`` ones, ``shared`` saves,
``original_bytes`` of the encoded tensors and their ``encoded_bytes``.

This module sits on torch's saved-tensor hooks and ``headroom._native``'s codec; it knows no
model.
"""

import weakref

import torch

from . import _native

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

    def decode(self):
        _check_version(self)
        return self.half.to(self.dtype)


def _where(device):
    """(device index or ``None`` for the CPU, torch's current stream's handle)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
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
    ``compress`` (``"int8"``, ``"bf16"`` or ``None``); see the module's documentation."""

    def __init__(self, compress="int8", *, block=DEFAULT_BLOCK,
                 min_elements=DEFAULT_MIN_ELEMENTS):
        if compress not in CODECS:
            raise ValueError(f"compress={compress!r}: give one of {CODECS}")
        if compress == "int8" and (
            not isinstance(block, int) or block < 32 or block > 4096 or block & (block - 1)
        ):
            raise ValueError(f"block={block!r}: give a power of two from 32 to 4096")
        if not isinstance(min_elements, int) or min_elements < 1:
            raise ValueError(f"min_elements={min_elements!r}: give a positive int")
        self.compress = compress
        self.block = block
        self.min_elements = min_elements
        self.stats = {"saved": 0, "encoded": 0, "shared": 0, "original_bytes": 0,
                      "encoded_bytes": 0}
        self._shared = {}
        self._hooks = None

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        hooks, self._hooks = self._hooks, None
        self._shared.clear()
        return hooks.__exit__(*exc)

    def _encodes(self, t):
        dtypes = _INT8_DTYPES if self.compress == "int8" else _BF16_DTYPES
        return (
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.dtype in dtypes
            and t.layout == torch.strided
            and t.device.type in ("cuda", "cpu")
            and t.numel() >= self.min_elements
            and t.requires_grad
            and not _derived_from_parameter(t)
        )

    def _pack(self, t):
        self.stats["saved"] += 1
        if self.compress is None or not self._encodes(t):
            return t
        entry = self._shared.get(id(t))
        if entry is not None:
            ref, version, packed_ref = entry
            packed = packed_ref()
            if ref() is t and version == t._version and packed is not None:
                self.stats["shared"] += 1
                return packed
        with torch.no_grad():
            packed = _Int8(t, self.block) if self.compress == "int8" else _Bf16(t)
        if len(self._shared) >= 4096:
            # A context around many forwards: forget the tensors that are gone.
            self._shared = {k: v for k, v in self._shared.items() if v[0]() is not None}
        self._shared[id(t)] = (weakref.ref(t), t._version, weakref.ref(packed))
        self.stats["encoded"] += 1
        self.stats["original_bytes"] += t.numel() * t.element_size()
        self.stats["encoded_bytes"] += packed.encoded_bytes()
        return packed

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.decode()
