"""What the wheel does without torch or a GPU (CI): it imports; statistics read before the first
allocation report an allocator that has served nothing and leave its settings open; a stream
given to record_stream is never taken as a bare integer; and the allocator it carries serves
host memory through the same C functions PyTorch would call, with exact statistics, a summary,
a snapshot pickle and clear errors; the activation codec runs on host memory as its formula
says. Run: python3 test_no_torch.py"""

import ctypes
import json
import math
import os
import pickle
import struct
import tempfile

import headroom
from headroom import _native


def statistics_before_first_allocation():
    """Reading statistics before anything was allocated answers an allocator that has served
    nothing and leaves the settings open (it used to freeze them, so that use_allocator(conf)
    then failed with "already serves allocations")."""
    cuda = headroom.cuda
    assert _native.memory_stats_json(0) is None
    assert _native.memory_summary(0) is None
    assert _native.reset_peak_stats(0) is False
    assert _native.empty_cache(0) is False
    assert cuda.memory_stats(0) == {}
    assert cuda.memory_stats() == {}  # device=None: no CUDA (nor torch) is touched
    assert cuda.max_memory_reserved(0) == 0 and cuda.max_memory_allocated() == 0
    assert "served no allocation" in cuda.memory_summary(0), cuda.memory_summary(0)
    cuda.reset_peak_memory_stats(0)
    cuda.empty_cache()
    cuda.record_memory_history(device=0)  # kept for use_allocator()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "empty.pickle")
        assert _native.snapshot(0, path) is False and not os.path.exists(path)
        cuda.snapshot(path, 0)
        with open(path, "rb") as f:
            snap = pickle.load(f)
    assert snap["segments"] == [] and snap["device_traces"] == [[]], snap
    assert not _native.is_in_use()
    # A stream given to record_stream is never taken as a bare integer: the native function
    # wants a torch.cuda.Stream (without torch, importing torch.cuda fails first).
    for stream in (0xDEAD0, None):
        try:
            _native.record_stream(0x1000, 0, stream)
        except (TypeError, ImportError):
            pass
        else:
            raise AssertionError(f"record_stream accepted {stream!r} as a stream")
    try:
        cuda.record_stream(object(), 0xDEAD0)
    except ValueError as error:
        assert "CUDA tensor" in str(error), error
    else:
        raise AssertionError("record_stream accepted a non-tensor")
    assert not _native.is_in_use()
    cuda._pending_history.clear()


def f32(value):
    """``value`` rounded to the nearest f32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def int8_codec_on_host_memory():
    """The 8-bit codec of ``headroom.torch.saved_activations`` on host memory through the
    extension (its CPU path): codes and absmax are the formula's in f32 arithmetic
    (``round_half_even(f32(f32(x / a) * 127))``), including a block of zeros and one holding a
    NaN; the decode is ``f32(f32(code / 127) * a)``; bad arguments raise."""
    n, block = 300, 32
    values = [f32((i - 150) * 0.37 + (i % 7) * 1.3) for i in range(n)]
    values[64:96] = [0.0] * 32
    values[100] = float("nan")
    x = (ctypes.c_float * n)(*values)
    codes = (ctypes.c_int8 * n)()
    blocks = (n + block - 1) // block
    absmax = (ctypes.c_float * blocks)()
    address = ctypes.addressof
    _native.quantize_int8(None, 0, "float32", address(x), n, block, address(codes), address(absmax))
    for b in range(blocks):
        chunk = values[b * block:(b + 1) * block]
        if any(math.isnan(v) for v in chunk):
            assert math.isnan(absmax[b]) and all(codes[i] == 0 for i in range(b * block, b * block + len(chunk)))
            continue
        a = max(abs(v) for v in chunk)
        assert absmax[b] == a, (b, absmax[b], a)
        for i, v in enumerate(chunk, start=b * block):
            want = 0 if a == 0 else round(f32(f32(v / a) * 127.0))  # round(): half to even
            assert codes[i] == want, (i, codes[i], want)
    out = (ctypes.c_float * n)()
    _native.dequantize_int8(None, 0, "float32", address(codes), address(absmax), n, block, address(out))
    for i in range(n):
        a = absmax[i // block]
        want = f32(f32(codes[i] / 127.0) * a)
        assert (math.isnan(out[i]) and math.isnan(want)) or out[i] == want, (i, out[i], want)
        if not math.isnan(a):
            assert abs(out[i] - values[i]) <= a / 254 * (1 + 1e-5), i
    args = (None, 0, "float32", address(x), n, block, address(codes), address(absmax))
    for index, bad, error, words in ((2, "int8", TypeError, "int8 tensors are not compressed"),
                                     (5, 100, ValueError, "block=100"),
                                     (3, 0, ValueError, "`x` is a null address")):
        changed = list(args)
        changed[index] = bad
        try:
            _native.quantize_int8(*changed)
        except error as raised:
            assert words in str(raised), raised
        else:
            raise AssertionError(f"quantize_int8 accepted {bad!r}")


def main():
    statistics_before_first_allocation()
    int8_codec_on_host_memory()
    # The plugin's own default: 8 MiB physical handles, kept under a user's other settings.
    assert "expandable_handle_size_mb:8" in headroom.cuda.settings(), headroom.cuda.settings()
    try:
        _native.configure("max_split_sise_mb:64")
    except ValueError as error:
        assert "max_split_sise_mb" in str(error), error
    else:
        raise AssertionError("a bad key was accepted")
    _native.configure("expandable_segments:False")
    _native.use_host_memory(1 << 30)
    assert not _native.is_in_use()

    # The functions PyTorch's CUDAPluggableAllocator loads, called by name as it does.
    lib = ctypes.CDLL(_native.__file__)
    lib.headroom_alloc.restype = ctypes.c_void_p
    lib.headroom_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.headroom_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    a = lib.headroom_alloc(1000, 0, None)
    b = lib.headroom_alloc(3 << 20, 0, None)
    assert a and b and _native.is_in_use()
    assert ctypes.cast(lib.headroom_alloc, ctypes.c_void_p).value == _native.function_addresses()[0]
    stats = json.loads(_native.memory_stats_json(0))
    assert stats["allocated_bytes.all.current"] == 1024 + (3 << 20), stats
    assert stats["reserved_bytes.all.current"] == (2 << 20) + (20 << 20), stats
    try:
        _native.configure("")
    except RuntimeError as error:
        assert "before the first" in str(error), error
    else:
        raise AssertionError("configure after the first allocation was accepted")
    _native.record_history(0, True, 0)
    lib.headroom_free(b, 3 << 20, 0, None)
    lib.headroom_free(a, 1000, 0, None)
    assert json.loads(_native.memory_stats_json(0))["allocated_bytes.all.current"] == 0
    assert "PyTorch CUDA memory summary" in _native.memory_summary(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snapshot.pickle")
        _native.snapshot(0, path)
        with open(path, "rb") as f:
            snap = pickle.load(f)
    frees = [e for e in snap["device_traces"][0] if e["action"] == "free_requested"]
    assert len(frees) == 2, snap["device_traces"]
    assert len(_native.bnb_maps()[0]) == 256
    settings = headroom.cuda.settings()
    assert "expandable_segments:False" in settings, settings
    assert "expandable_handle_size_mb:8" in settings, settings
    print("headroom wheel without torch: ok")


if __name__ == "__main__":
    main()
