"""What the wheel does without torch or a GPU (CI): it imports, and the allocator it carries
serves host memory through the same C functions PyTorch would call, with exact statistics,
a summary, a snapshot pickle and clear errors. Run: python3 test_no_torch.py"""

import ctypes
import json
import os
import pickle
import tempfile

import headroom
from headroom import _native


def main():
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
