"""Misuse of ``headroom.cuda``: statistics read before ``use_allocator()`` (they used to freeze
the allocator's settings, so that ``use_allocator(conf)`` then failed), history asked for before
it, and streams handed to ``record_stream`` that the allocator cannot keep (a bare integer, a
``torch.cuda.ExternalStream``, a stream rebuilt from an external stream's id).

``use_allocator`` must run before CUDA starts, so each GPU case runs in a fresh Python process.
Run: ``python3 -m pytest crates/python/python/tests/test_cuda_allocator.py`` (or ``python3`` on
this file). Without torch the module is skipped, without a GPU the GPU cases are;
``HEADROOM_REQUIRE_GPU=1`` turns both into failures.
"""

import os
import subprocess
import sys
import textwrap

from torch_gate import main, need_gpu, torch


def run_fresh(code):
    """Runs ``code`` in a new interpreter (nothing of CUDA started yet); returns its output and
    fails with it when the process fails."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_statistics_before_use_allocator_touch_neither_cuda_nor_settings():
    """With any torch (a GPU not needed): every statistic read with ``device=None`` before
    ``use_allocator`` answers an allocator that has served nothing, starts no CUDA and leaves
    the settings open."""
    run_fresh("""
        import os, pickle, tempfile
        import torch
        import headroom.cuda as hc
        from headroom import _native
        assert hc.memory_stats() == {}
        assert hc.max_memory_reserved() == 0 and hc.max_memory_allocated() == 0
        assert "served no allocation" in hc.memory_summary()
        hc.reset_peak_memory_stats()
        hc.empty_cache()
        with tempfile.TemporaryDirectory() as tmp:
            hc.snapshot(os.path.join(tmp, "s.pickle"))
            assert pickle.load(open(os.path.join(tmp, "s.pickle"), "rb"))["segments"] == []
        assert not torch.cuda.is_initialized(), "a statistic started CUDA"
        assert not _native.is_in_use(), "a statistic froze the settings"
        _native.configure("expandable_segments:False")  # still open
        assert "expandable_segments:False" in hc.settings()
    """)


def test_use_allocator_with_conf_after_statistics():
    """The issue's sequence: statistics first, then ``use_allocator(conf)``: installed with that
    conf, and the statistics then count the allocations."""
    need_gpu()
    out = run_fresh("""
        import torch
        import headroom.cuda as hc
        before = hc.memory_stats()
        hc.reset_peak_memory_stats()
        summary = hc.memory_summary()
        hc.use_allocator("expandable_segments:False,max_split_size_mb:64")
        assert hc.is_active()
        x = torch.ones(1 << 20, device="cuda")
        stats = hc.memory_stats()
        assert before == {}, before
        assert stats["allocated_bytes.all.current"] >= 4 << 20, stats
        assert "expandable_segments:False" in hc.settings()
        assert "max_split_size_mb:64" in hc.settings()
        try:
            hc.use_allocator("expandable_segments:True")
        except hc.AllocatorError:
            pass
        else:
            raise AssertionError("a second conf was accepted")
        print("ok", stats["allocated_bytes.all.current"])
    """)
    assert "ok" in out


def test_record_memory_history_before_use_allocator_records_from_the_start():
    need_gpu()
    run_fresh("""
        import os, pickle, tempfile
        import torch
        import headroom.cuda as hc
        hc.record_memory_history()  # before use_allocator: kept, started by it
        hc.use_allocator()
        x = torch.ones(1000, device="cuda")
        del x
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.pickle")
            hc.snapshot(path)
            snap = pickle.load(open(path, "rb"))
        actions = [e["action"] for t in snap["device_traces"] for e in t]
        assert "alloc" in actions and "free_requested" in actions, actions
    """)


def test_record_stream_refuses_what_may_die():
    """``record_stream``: a bare integer and a non-stream raise TypeError, an
    ``ExternalStream`` and a ``torch.cuda.Stream`` rebuilt from an external stream's id raise
    ValueError, the native function refuses an integer too; PyTorch's pooled streams and the
    default stream are accepted."""
    need_gpu()
    run_fresh("""
        import torch
        import headroom.cuda as hc
        from headroom import _native
        hc.use_allocator()
        t = torch.ones(1 << 16, device="cuda")
        pooled = torch.cuda.Stream()
        external = torch.cuda.ExternalStream(pooled.cuda_stream)
        rebuilt = torch.cuda.Stream(stream_id=external.stream_id, device_index=0, device_type=1)
        def expect(exc, fn, label):
            try:
                fn()
            except exc:
                return
            raise AssertionError(label)
        expect(TypeError, lambda: hc.record_stream(t, pooled.cuda_stream), "an integer")
        expect(TypeError, lambda: hc.record_stream(t, "stream"), "a string")
        expect(ValueError, lambda: hc.record_stream(t, external), "an ExternalStream")
        expect(ValueError, lambda: hc.record_stream(t, rebuilt), "a rebuilt external stream")
        ptr = t.untyped_storage().data_ptr()
        expect(TypeError, lambda: _native.record_stream(ptr, 0, 0xDEAD0), "native: an integer")
        expect(RuntimeError, lambda: _native.record_stream(12345, 0, pooled), "an unknown address")
        hc.record_stream(t, pooled)
        hc.record_stream(t, torch.cuda.default_stream())
        with torch.cuda.stream(pooled):
            t.mul_(2)
        del t
        torch.cuda.synchronize()
        print("ok")
    """)


def test_record_stream_under_pytorchs_allocator_is_tensor_record_stream():
    """Without ``use_allocator`` the tensor is PyTorch's: ``record_stream`` forwards to
    ``Tensor.record_stream`` and leaves Headroom's allocator untouched."""
    need_gpu()
    run_fresh("""
        import torch
        import headroom.cuda as hc
        from headroom import _native
        t = torch.ones(16, device="cuda")
        hc.record_stream(t, torch.cuda.Stream())
        assert not _native.is_in_use()
    """)


def _cases():
    """Every test of this file, for ``torch_gate.run_cases``."""
    return [(name, fn) for name, fn in sorted(globals().items())
            if name.startswith("test_") and callable(fn)]


if __name__ == "__main__":
    sys.exit(main(__file__, _cases))
