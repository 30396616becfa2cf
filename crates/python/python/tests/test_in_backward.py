"""``headroom.torch.optimizer_in_backward`` against the plain loop it replaces.

Each case trains two copies of one small network from the same weights on the same batches: one
with ``loss.backward(); optimizer.step()`` (or what torch's own tools add to it: a scheduler,
accumulation, ``clip_grad_norm_``, a ``GradScaler``), the other with the same ``headroom.optim``
optimizer stepped inside backward. Updates are elementwise, so where the plain loop's
arithmetic is the same the parameters must be the same bits (buckets of 1 KiB, many per step,
and of the default 25 MiB, one per step); clipping's norm is a sum in another order, so there
the bound is stated. Misuse raises its documented error with nothing stepped.

Two rigs, as in ``test_optim_misuse.py``: ``cpu`` (the optimizers' Python with the kernel
replaced by a stand-in that checks every pointer against the live tensors and then runs torch's
single-tensor Adam) and ``cuda`` (the real kernels). Loss scaling runs on ``cuda`` only.
"""

import functools
import inspect
import sys

from torch_gate import main, need_gpu, pytest, torch
from optim_rigs import RIG_NAMES, Rig, raises, rig_for

if torch is not None:
    import headroom.torch as ht

TINY_BUCKET_MB = 1 / 1024  # 1 KiB: every parameter its own bucket or nearly
STEPS = 20
ACCUMULATIONS = (1, 2)  # exact clipping: two passes of one micro-batch, or the last one held


def pytest_generate_tests(metafunc):
    if "rig_name" in metafunc.fixturenames:
        metafunc.parametrize("rig_name", RIG_NAMES)
    if "bucket_mb" in metafunc.fixturenames:
        metafunc.parametrize("bucket_mb", [TINY_BUCKET_MB, ht.DEFAULT_BUCKET_MB])
    if "accumulate" in metafunc.fixturenames:
        metafunc.parametrize("accumulate", ACCUMULATIONS)


class Net(torch.nn.Module if torch is not None else object):
    """Three layers, a parameter used only when ``extra`` (no gradient otherwise), and one
    unused by any forward."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(24, 48)
        self.b = torch.nn.Linear(48, 48)
        self.c = torch.nn.Linear(48, 8)
        self.side = torch.nn.Parameter(torch.randn(48) * 0.1)
        self.unused = torch.nn.Parameter(torch.randn(5))

    def forward(self, x, extra=False):
        h = torch.tanh(self.a(x))
        if extra:
            h = h + self.side
        return self.c(torch.tanh(self.b(h)))


def twins(rig, seed=0):
    """Two networks with the same weights on the rig's device."""
    torch.manual_seed(seed)
    first = Net().to(rig.device)
    second = Net().to(rig.device)
    second.load_state_dict(first.state_dict())
    return first, second


def batch(rig, step, micro=0):
    g = torch.Generator().manual_seed(10_000 + 97 * step + micro)
    x = torch.randn(16, 24, generator=g).to(rig.device)
    y = torch.randn(16, 8, generator=g).to(rig.device)
    return x, y


def loss_of(net, x, y, extra=False):
    return torch.nn.functional.mse_loss(net(x, extra), y)


def assert_same_bits(plain, ours):
    for (name, a), (_, b) in zip(plain.named_parameters(), ours.named_parameters()):
        assert torch.equal(a.detach(), b.detach()), (
            f"{name}: max difference {(a - b).abs().max().item():.3e}"
        )


def assert_close(plain, ours, rtol):
    for (name, a), (_, b) in zip(plain.named_parameters(), ours.named_parameters()):
        scale = a.detach().abs().max().item() or 1.0
        diff = (a - b).abs().max().item()
        assert diff <= rtol * scale, f"{name}: {diff:.3e} apart, bound {rtol * scale:.3e}"


def test_parameters_equal_the_plain_loop(rig_name, bucket_mb):
    rig = rig_for(rig_name)
    plain, ours = twins(rig)
    opt_plain = rig.AdamW(plain.parameters(), lr=1e-2)
    ib = ht.optimizer_in_backward(ours, rig.AdamW(ours.parameters(), lr=1e-2), bucket_mb=bucket_mb)
    for step in range(STEPS):
        x, y = batch(rig, step)
        extra = step % 3 == 0  # `side` gets a gradient on some steps only
        loss_of(plain, x, y, extra).backward()
        opt_plain.step()
        opt_plain.zero_grad()
        loss_of(ours, x, y, extra).backward()
        ib.step()
        ib.zero_grad()
        assert all(p.grad is None for p in ours.parameters()), "a gradient outlived its bucket"
    rig.sync()
    assert_same_bits(plain, ours)
    steps_plain, steps_ours = (
        {name: int(state[i]["step"]) for i, (name, _) in enumerate(net.named_parameters()) if i in state}
        for net, state in ((plain, opt_plain.state_dict()["state"]), (ours, ib.state_dict()["state"]))
    )
    assert steps_plain == steps_ours
    assert steps_ours["side"] == len(range(0, STEPS, 3))
    assert "unused" not in steps_ours


def test_a_scheduler_on_the_returned_object_sets_each_steps_rate(rig_name):
    rig = rig_for(rig_name)
    plain, ours = twins(rig, seed=1)
    opt_plain = rig.AdamW(plain.parameters(), lr=1e-2)
    ib = ht.optimizer_in_backward(ours, rig.AdamW(ours.parameters(), lr=1e-2),
                                  bucket_mb=TINY_BUCKET_MB)
    decay = lambda step: 0.8 ** step  # noqa: E731
    sched_plain = torch.optim.lr_scheduler.LambdaLR(opt_plain, decay)
    sched_ours = torch.optim.lr_scheduler.LambdaLR(ib, decay)
    for step in range(STEPS):
        x, y = batch(rig, step)
        loss_of(plain, x, y).backward()
        opt_plain.step()
        opt_plain.zero_grad()
        sched_plain.step()
        loss_of(ours, x, y).backward()
        ib.step()
        sched_ours.step()
        assert ib.optimizer.param_groups[0]["lr"] == opt_plain.param_groups[0]["lr"]
    rig.sync()
    assert_same_bits(plain, ours)


def test_accumulation_steps_once_per_cycle_like_the_plain_loop(rig_name):
    rig = rig_for(rig_name)
    plain, ours = twins(rig, seed=2)
    opt_plain = rig.AdamW(plain.parameters(), lr=1e-2)
    ib = ht.optimizer_in_backward(ours, rig.AdamW(ours.parameters(), lr=1e-2),
                                  bucket_mb=TINY_BUCKET_MB, accumulate=3)
    for step in range(8):
        for micro in range(3):
            x, y = batch(rig, step, micro)
            extra = micro == 0  # `side`'s gradient comes only in the first micro-batch
            (loss_of(plain, x, y, extra) / 3).backward()
            (loss_of(ours, x, y, extra) / 3).backward()
            if micro < 2:
                assert ours.a.weight.grad is not None, "a micro-batch before the last stepped"
        opt_plain.step()
        opt_plain.zero_grad()
        assert all(p.grad is None for p in ours.parameters())
    rig.sync()
    assert_same_bits(plain, ours)


def _clipped_plain_step(plain, opt_plain, max_norm):
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
    opt_plain.step()
    opt_plain.zero_grad()
    return norm


def test_exact_clipping_matches_clip_grad_norm(rig_name, accumulate):
    rig = rig_for(rig_name)
    plain, ours = twins(rig, seed=3)
    opt_plain = rig.AdamW(plain.parameters(), lr=1e-2)
    ib = ht.optimizer_in_backward(ours, rig.AdamW(ours.parameters(), lr=1e-2),
                                  bucket_mb=TINY_BUCKET_MB, clip=0.05, accumulate=accumulate)
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = batch(rig, step, micro)
            loss_of(plain, x, y).backward()
            ib.backward(loss_of(ours, x, y))
        norm = _clipped_plain_step(plain, opt_plain, 0.05)
        assert torch.allclose(ib.grad_norm, norm, rtol=1e-6), (ib.grad_norm, norm)
        assert norm.item() > 0.05, "the case must clip"
    rig.sync()
    # The norm is a sum of squares in another order: the coefficient can differ in its last
    # bit, which Adam's normalisation carries into the update at the same relative size.
    assert_close(plain, ours, rtol=2e-5)


def test_previous_step_clipping_uses_the_last_norm(rig_name):
    rig = rig_for(rig_name)
    plain, ours = twins(rig, seed=4)
    opt_plain = rig.AdamW(plain.parameters(), lr=1e-2)
    ib = ht.optimizer_in_backward(ours, rig.AdamW(ours.parameters(), lr=1e-2),
                                  bucket_mb=TINY_BUCKET_MB, clip=0.05, clip_mode="previous")
    coefficient = None
    for step in range(STEPS):
        x, y = batch(rig, step)
        loss_of(plain, x, y).backward()
        grads = [p.grad for p in plain.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if coefficient is not None:
            torch._foreach_mul_(grads, coefficient)
        opt_plain.step()
        opt_plain.zero_grad()
        coefficient = torch.clamp(0.05 / (norm + 1e-6), max=1.0)
        loss_of(ours, x, y).backward()  # one pass: a plain backward serves
        assert torch.allclose(ib.grad_norm, norm, rtol=1e-6)
    rig.sync()
    assert_close(plain, ours, rtol=2e-5)


def test_scaled_steps_match_grad_scaler_and_skip_whole_steps():
    need_gpu()
    rig = Rig("cuda")
    plain, ours = twins(rig, seed=5)
    opt_plain = rig.AdamW(plain.parameters(), lr=1e-2)
    inner = rig.AdamW(ours.parameters(), lr=1e-2)
    scaler_plain = torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=3)
    scaler_ours = torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=3)
    ib = ht.optimizer_in_backward(ours, inner, bucket_mb=TINY_BUCKET_MB, scaler=scaler_ours)
    for step in range(STEPS):
        x, y = batch(rig, step)
        if step in (4, 11):
            x = x.clone()
            x[0, 0] = float("inf")  # an overflowing step: skipped whole
        with torch.autocast("cuda", dtype=torch.float16):
            loss_plain = loss_of(plain, x, y)
            loss_ours = loss_of(ours, x, y)
        scaler_plain.scale(loss_plain).backward()
        scaler_plain.step(opt_plain)
        scaler_plain.update()
        opt_plain.zero_grad()
        ib.backward(loss_ours)
        assert scaler_ours.get_scale() == scaler_plain.get_scale(), step
    rig.sync()
    assert_same_bits(plain, ours)
    plain_steps = [int(s["step"]) for s in opt_plain.state_dict()["state"].values()]
    ours_steps = [int(s["step"]) for s in ib.state_dict()["state"].values()]
    assert ours_steps == plain_steps and plain_steps[0] == STEPS - 2


def test_a_plain_backward_where_two_passes_are_needed_raises_before_any_update(rig_name):
    rig = rig_for(rig_name)
    _, ours = twins(rig, seed=6)
    ib = ht.optimizer_in_backward(ours, rig.AdamW(ours.parameters(), lr=1e-2), clip=1.0)
    before = [p.detach().clone() for p in ours.parameters()]
    x, y = batch(rig, 0)
    raises(RuntimeError, lambda: loss_of(ours, x, y).backward(), "InBackward.backward(loss)")
    rig.sync()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, ours.parameters()))
    ours.zero_grad()
    ib.backward(loss_of(ours, x, y))  # the next pass starts clean
    rig.sync()
    assert not all(torch.equal(a, b.detach()) for a, b in zip(before, ours.parameters()))


class FailInBackward(torch.autograd.Function if torch is not None else object):
    """The identity, whose backward raises: a backward pass that fails half-way."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("a backward that fails")


def test_a_failed_backward_keeps_what_it_stepped_and_the_next_pass_starts_clean(rig_name):
    rig = rig_for(rig_name)
    plain, ours = twins(rig, seed=8)
    opt_plain = rig.AdamW(plain.parameters(), lr=1e-2)
    ib = ht.optimizer_in_backward(ours, rig.AdamW(ours.parameters(), lr=1e-2))
    x, y = batch(rig, 0)
    h = torch.tanh(ours.b(FailInBackward.apply(torch.tanh(ours.a(x)))))
    loss = torch.nn.functional.mse_loss(ours.c(h), y)
    raises(ArithmeticError, loss.backward, "fails")
    # The default bucket held c's gradients when the pass failed: nothing was stepped, and they
    # are still in .grad; a and b got none.
    assert ours.c.weight.grad is not None and ours.a.weight.grad is None
    ours.zero_grad()
    for step in range(3):
        x, y = batch(rig, step + 1)
        loss_of(plain, x, y).backward()
        opt_plain.step()
        opt_plain.zero_grad()
        loss_of(ours, x, y).backward()
    rig.sync()
    assert_same_bits(plain, ours)


def test_misuse_raises_typed_errors(rig_name):
    rig = rig_for(rig_name)
    _, ours = twins(rig, seed=7)
    other = Net().to(rig.device)
    inner = rig.AdamW(ours.parameters(), lr=1e-2)
    raises(TypeError, lambda: ht.optimizer_in_backward(ours, torch.optim.SGD(ours.parameters(), lr=0.1)),
           "headroom.optim")
    raises(ValueError, lambda: ht.optimizer_in_backward(other, inner), "not the model's")
    for settings, word in (
        (dict(bucket_mb=0), "bucket_mb"), (dict(bucket_mb=float("nan")), "bucket_mb"),
        (dict(accumulate=0), "accumulate"), (dict(accumulate=1.5), "accumulate"),
        (dict(clip=-1.0), "clip"), (dict(clip=float("inf")), "clip"),
        (dict(clip_mode="sometimes"), "clip_mode"),
    ):
        raises(ValueError, lambda: ht.optimizer_in_backward(ours, inner, **settings), word)
    raises(TypeError, lambda: ht.optimizer_in_backward(ours, inner, scaler=object()), "GradScaler")
    ib = ht.optimizer_in_backward(ours, inner)
    raises(ValueError, lambda: ht.optimizer_in_backward(ours, inner), "already")
    second = rig.AdamW(ours.parameters(), lr=1e-2)
    raises(ValueError, lambda: ht.optimizer_in_backward(ours, second), "already stepped inside")
    x, y = batch(rig, 0)
    loss_of(ours, x, y).backward()
    for p in ours.parameters():
        p.grad = torch.ones_like(p)
    raises(RuntimeError, inner.step, "inside backward")
    ib.remove()
    inner.step()  # its own step again once removed
    ib2 = ht.optimizer_in_backward(ours, second)  # the parameters are free again
    ib2.remove()


def _cases():
    res = []
    for name, fn in sorted(globals().items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        params = inspect.signature(fn).parameters
        rigs = RIG_NAMES if "rig_name" in params else (None,)
        buckets = (TINY_BUCKET_MB, ht.DEFAULT_BUCKET_MB) if "bucket_mb" in params else (None,)
        accumulations = ACCUMULATIONS if "accumulate" in params else (None,)
        for rig in rigs:
            for bucket in buckets:
                for accumulate in accumulations:
                    args = [a for a in (rig, bucket, accumulate) if a is not None]
                    res.append((f"{name}{args}", functools.partial(fn, *args)))
    return res


if __name__ == "__main__":
    sys.exit(main(__file__, _cases))
