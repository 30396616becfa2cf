"""``headroom.torch.saved_activations(offload=...)`` and its ``PinnedPool``: the pool's ranges
(alignment, first fit, coalescing, reuse only after the releasing copy's event, the budget as a
typed error) on any machine; on CUDA, offloaded saves give the plain run's gradients bit for
bit (with int8, the int8 run's), keep the forward's device memory down, reuse the pool's
chunks step after step, survive a retained graph and a side stream, and a budget too small
raises ``PinnedBudgetError`` in the forward.

Run: ``python3 -m pytest crates/python/python/tests/test_offloaded_activations.py`` (or
``python3`` on this file). The ``cuda`` cases need a GPU (skipped without one; under
``HEADROOM_REQUIRE_GPU=1`` a failure instead).
"""

import sys

from torch_gate import device_cases, main, on_device as on, torch

if torch is not None:
    import headroom.pinned as hpin
    import headroom.torch as ht
    from test_saved_activations import Block, raises

MIB = 1 << 20


class FakeEvent:
    """A CUDA event's ``query``/``synchronize`` for the pool's bookkeeping on the CPU."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def unpinned_pool(budget_mb=None, chunk_mb=1):
    pool = hpin.PinnedPool(budget_mb, chunk_mb=chunk_mb)
    pool._pin = False
    return pool


def test_the_pool_aligns_coalesces_and_reuses_after_the_event():
    pool = unpinned_pool(chunk_mb=1)
    a, b, c = pool.allocate(100), pool.allocate(1000), pool.allocate(512)
    assert (a.offset, b.offset, c.offset) == (0, 512, 1536)  # 512-byte ranges
    assert pool.stats()["in_use_bytes"] == 512 + 1024 + 512 and pool.stats()["chunks"] == 1
    pool.release(a)
    pool.release(b)  # neighbours coalesce: a 1536-byte hole at 0
    d = pool.allocate(1500)
    assert d.offset == 0
    event = FakeEvent()
    pool.release(d, after=event)
    e = pool.allocate(512)  # the event has not completed: d's range is not reused
    assert e.offset == 2048 and event.waited == 0
    event.done = True
    f = pool.allocate(512)  # now it is (collected without waiting)
    assert f.offset == 0 and event.waited == 0
    view = f.view(torch.float32, (4, 32))
    assert view.shape == (4, 32) and view.data_ptr() == f.chunk.buffer.data_ptr()
    assert pool.stats()["peak_in_use_bytes"] >= pool.stats()["in_use_bytes"]


def test_the_pool_waits_for_a_pending_range_before_it_grows_and_raises_at_its_budget():
    pool = unpinned_pool(budget_mb=2, chunk_mb=1)
    whole = pool.allocate(MIB)
    event = FakeEvent()
    pool.release(whole, after=event)
    again = pool.allocate(MIB)  # fits only the pending range: waited for, not a new chunk
    assert event.waited == 1 and again.offset == 0 and pool.stats()["chunks"] == 1
    pool.allocate(MIB)  # a second chunk: the budget's last
    raises(hpin.PinnedBudgetError, lambda: pool.allocate(1), "budget of 2097152 bytes",
           "raise budget_mb")
    raises(hpin.PinnedBudgetError, lambda: unpinned_pool(1).allocate(3 * MIB), "budget")
    # A budget smaller than a chunk: chunks of the largest power of two the rest holds.
    small = hpin.PinnedPool(budget_mb=3, chunk_mb=64)
    small._pin = False
    small.allocate(1000)
    small.allocate(MIB)  # the first chunk (2 MiB) holds both
    small.allocate(MIB)  # a second of the 1 MiB left
    assert [c.size for c in small._chunks] == [2 * MIB, MIB], [c.size for c in small._chunks]
    raises(hpin.PinnedBudgetError, lambda: small.allocate(MIB), "budget of 3145728 bytes")
    assert issubclass(hpin.PinnedBudgetError, MemoryError)


def test_bad_offload_settings_raise():
    raises(ValueError, lambda: ht.saved_activations(None, offload="yes"), "offload='yes'")
    raises(ValueError, lambda: ht.saved_activations(None, budget_mb=64), "offload=True")
    raises(ValueError, lambda: ht.saved_activations(None, offload=True, prefetch_mb=-1),
           "prefetch_mb")
    raises(ValueError, lambda: ht.saved_activations(None, offload=True, hold_peak=1),
           "hold_peak=1")
    raises(ValueError, lambda: ht.saved_activations(None, offload=True, keep_last_mb=-1),
           "keep_last_mb=-1")
    raises(ValueError, lambda: ht.saved_activations(None, keep_last_mb=64), "give offload")
    raises(ValueError, lambda: ht.saved_activations(None, offload=True, every_save=1),
           "every_save=1")
    raises(ValueError, lambda: ht.saved_activations(None, every_save=True), "give offload")
    raises(ValueError, lambda: ht.saved_activations(None, offload=ht.PinnedPool(), budget_mb=8),
           "PinnedPool")
    raises(ValueError, lambda: ht.PinnedPool(0), "budget_mb=0")
    raises(ValueError, lambda: ht.PinnedPool(chunk_mb=0), "chunk_mb=0")


def model_and_input(dev, seed=0, width=256, heads=4, blocks=2):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[Block(width, heads) for _ in range(blocks)]).to(dev)
    return model, torch.randn(4, 64, width, device=dev)


def grads_with(dev, context, retain=False, stream=None):
    model, x = model_and_input(dev)
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        if context is None:
            loss = model(x).square().mean()
        else:
            with context:
                loss = model(x).square().mean()
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return [p.grad.detach().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cpu_saves_are_not_offloaded():
    dev = torch.device("cpu")
    plain = grads_with(dev, None)
    saved = ht.saved_activations(None, offload=True)
    got = grads_with(dev, saved)
    assert saved.stats["offloaded"] == 0 and saved.pool.stats()["chunks"] == 0
    assert all(torch.equal(a, b) for a, b in zip(got, plain))


def test_offloaded_saves_give_the_plain_gradients_bit_for_bit():
    dev = on("cuda")
    plain = grads_with(dev, None)
    # hold_peak twice: the first backward sets the level the second fetches ahead under.
    for prefetch_mb, hold_peak in ((128, False), (0, False), (128, True), (128, True)):
        saved = ht.saved_activations(None, offload=True, prefetch_mb=prefetch_mb,
                                     hold_peak=hold_peak)
        got = grads_with(dev, saved)
        assert saved.stats["offloaded"] > 0 and saved.stats["offloaded_bytes"] > 0
        for i, (a, b) in enumerate(zip(got, plain)):
            assert torch.equal(a, b), (prefetch_mb, hold_peak, i)
    int8 = grads_with(dev, ht.saved_activations("int8"))
    saved = ht.saved_activations("int8", offload=True)
    got = grads_with(dev, saved)
    assert saved.stats["encoded"] == saved.stats["offloaded"] > 0
    assert saved.stats["offloaded_bytes"] == saved.stats["encoded_bytes"]
    assert all(torch.equal(a, b) for a, b in zip(got, int8))


def test_every_save_offloaded_the_schedule_and_kept_saves_give_the_plain_gradients():
    # Every save offloaded (every_save=True), hold_peak's schedule
    # (the first backward is profiled, the next ones follow it) and the forward's last saves
    # kept on the device, with a retained graph too (a kept save is read again).
    dev = on("cuda")
    for retain in (False, True):
        plain = grads_with(dev, None, retain=retain)
        for every, hold_peak, last_mb in ((True, False, 0), (False, True, 0), (False, True, 0),
                                          (False, False, 1), (True, True, 1), (True, True, 1),
                                          (False, False, 64)):
            torch.cuda.reset_peak_memory_stats()
            saved = ht.saved_activations(None, offload=True, hold_peak=hold_peak,
                                         prefetch_mb=1024, keep_last_mb=last_mb, every_save=every)
            got = grads_with(dev, saved, retain=retain)
            case = (retain, every, hold_peak, last_mb)
            assert saved._resident_bytes == 0, case
            assert (saved.stats["offloaded"] > 0) == (last_mb < 64), case
            for i, (a, b) in enumerate(zip(got, plain)):
                assert torch.equal(a, b), (case, i)
    # hold_peak's schedule: a backward with none is profiled, the next ones of the same graph
    # follow it, one of another graph (here: no save kept on the device, so other sizes to
    # fetch) drops it, and the one after profiles that graph.
    from headroom.activations import _PROFILES

    _PROFILES.clear()
    plain = grads_with(dev, None)
    modes = []
    for last_mb in (1, 1, 0, 0, 0):
        saved = ht.saved_activations(None, offload=True, hold_peak=True, prefetch_mb=1024,
                                     keep_last_mb=last_mb, every_save=True)
        torch.cuda.reset_peak_memory_stats()
        got = grads_with(dev, saved)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
        profile = _PROFILES[torch.cuda.current_device()]
        modes.append(profile.mode)
    assert modes == ["profile", "follow", "discard", "profile", "follow"], modes
    assert len(profile.plan) == profile.steps == len(profile.sizes)


def test_kept_saves_stay_on_the_device_and_the_rest_are_copied_out():
    dev = on("cuda")
    model, x = model_and_input(dev)
    whole = ht.saved_activations(None, offload=True)
    with whole:
        loss = model(x).square().mean()
    loss.backward()
    half_mb = whole.stats["offloaded_bytes"] / 2 / MIB
    tail = ht.saved_activations(None, offload=True, keep_last_mb=half_mb)
    with tail:
        loss = model(x).square().mean()
    kept = tail._resident_bytes
    assert 0 < kept <= tail.keep_last_bytes
    assert tail.stats["offloaded_bytes"] + kept == whole.stats["offloaded_bytes"]
    loss.backward()
    assert tail._resident_bytes == 0  # autograd let go of every kept save
    # One context entered step after step, its forward's saves all kept: the references to the
    # saves autograd let go of do not pile up.
    loop = ht.saved_activations(None, offload=True, keep_last_mb=1024)
    for step in range(400):
        with loop:
            loss = model(x).square().mean()
        loss.backward()
        if step == 0:
            per_forward = len(loop._resident)  # one forward's kept saves, all gone by now
    assert loop.stats["offloaded"] == 0 and loop._resident_bytes == 0
    assert 400 * per_forward > 4096 + per_forward  # enough steps to pile up without the pruning
    assert len(loop._resident) <= 4096 + per_forward, len(loop._resident)


def test_offload_survives_a_retained_graph_and_a_side_stream():
    dev = on("cuda")
    plain = grads_with(dev, None, retain=True)
    got = grads_with(dev, ht.saved_activations(None, offload=True), retain=True)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    plain = grads_with(dev, None, stream=side)
    got = grads_with(dev, ht.saved_activations("bf16", offload=True), stream=side)
    reference = grads_with(dev, ht.saved_activations("bf16"), stream=side)
    assert all(torch.equal(a, b) for a, b in zip(got, reference))
    assert len(got) == len(plain)


def test_offload_keeps_the_forwards_memory_down_and_reuses_its_pool():
    dev = on("cuda")
    model, x = model_and_input(dev, width=1024, heads=16, blocks=4)
    x = torch.randn(8, 256, 1024, device=dev)
    pool = ht.PinnedPool(budget_mb=4096)
    kept, pinned = {}, []
    for name, context in (("plain", None), ("offload", ht.saved_activations(None, offload=pool))):
        for step in range(3):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            if context is None:
                loss = model(x).square().mean()
            else:
                with context:
                    loss = model(x).square().mean()
            torch.cuda.synchronize()
            torch.empty(1, device=dev)  # the allocator takes back what the copies released
            kept[name] = torch.cuda.memory_allocated() - before
            loss.backward()
            model.zero_grad(set_to_none=True)
            del loss
            torch.cuda.synchronize()
            if context is not None:
                pinned.append(pool.stats()["pinned_bytes"])
    assert kept["offload"] <= 0.25 * kept["plain"], kept
    assert pinned[0] == pinned[1] == pinned[2] > 0, pinned  # the second step pins nothing new
    pool.close()


def test_a_budget_too_small_raises_in_the_forward():
    dev = on("cuda")
    model, x = model_and_input(dev)
    with ht.saved_activations(None, offload=True, budget_mb=1) as saved:
        saved.pool.chunk_bytes = MIB
        raises(ht.PinnedBudgetError, lambda: model(x), "budget of 1048576 bytes")


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
