"""``headroom.torch.plan_blocks`` on six transformer blocks, on the CPU and on CUDA: a budget
above every save keeps every block; under a smaller one the plan's predicted bytes fit it, a
plan of keep and checkpoint gives the plain gradients, one of keep and int8 gradients within the
codec's error; ``remove()`` restores the blocks; on CUDA the allocator's bytes after the forward
are the plan's prediction; misuse raises.

Run: ``python3 -m pytest crates/python/python/tests/test_plan_blocks.py`` (or ``python3`` on this
file). The ``cuda`` cases need a GPU (skipped without one; under ``HEADROOM_REQUIRE_GPU=1`` a
failure instead).
"""

import sys

from torch_gate import device_cases, main, on_device as on, torch

if torch is not None:
    import headroom.torch as ht
    from test_saved_activations import Block, raises

MIB = 1 << 20


class Rig:
    """Six blocks and a batch; the plain gradients; the step ``plan_blocks`` profiles."""

    def __init__(self, device):
        self.device = on(device)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[Block() for _ in range(6)]).to(self.device)
        self.x = torch.randn(4, 64, 256, device=self.device)
        self.step().backward()
        self.plain = self.grads()

    def step(self):
        return self.model(self.x).square().mean()

    def grads(self):
        grads = [p.grad.detach().clone() for p in self.model.parameters()]
        self.model.zero_grad(set_to_none=True)
        return grads

    def trained(self):
        self.step().backward()
        return self.grads()

    def plan(self, budget_mb, **kwargs):
        return ht.plan_blocks(self.model, budget_mb, self.step, print_plan=False, **kwargs)

    def total_mb(self):
        plan = self.plan(1 << 20)
        plan.remove()
        return plan.predicted_bytes / MIB


def worst_error(got, want):
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))


def test_a_budget_above_every_save_keeps_every_block(device):
    rig = Rig(device)
    plan = rig.plan(1 << 20)
    assert plan.strategies == ["keep"] * 6
    assert all("forward" not in block.__dict__ for block in rig.model)
    assert "keep" in plan.table and plan.predicted_bytes > 0


def graph_tensors():
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_the_profile_and_an_unbackwarded_forward_leave_no_graph_alive(device):
    # Layer norm saves its own statistics: a pack hook that returned them as they are would
    # close a cycle through the node that no backward breaks (the profile never runs one).
    rig = Rig(device)
    before = graph_tensors()
    rig.plan(1 << 20, allow=("keep", "int8", "checkpoint")).remove()
    assert graph_tensors() == before
    with ht.saved_activations("int8", min_elements=1):
        loss = rig.step()
    del loss
    assert graph_tensors() == before


def test_a_plan_of_keep_and_checkpoint_fits_and_gives_the_plain_gradients(device):
    rig = Rig(device)
    total = rig.total_mb()
    plan = rig.plan(total / 2, allow=("checkpoint",))
    assert plan.predicted_bytes <= total / 2 * MIB
    assert "checkpoint" in plan.strategies and set(plan.strategies) <= {"keep", "checkpoint"}
    got = rig.trained()
    if rig.device.type == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(got, rig.plain))
    else:
        assert worst_error(got, rig.plain) <= 1e-5
    plan.remove()


def test_a_plan_of_keep_and_int8_bounds_the_gradients(device):
    rig = Rig(device)
    total = rig.total_mb()
    plan = rig.plan(total * 0.6, allow=("int8",))
    assert plan.predicted_bytes <= total * 0.6 * MIB
    assert "int8" in plan.strategies and set(plan.strategies) <= {"keep", "int8"}
    got = rig.trained()
    assert plan.stats["encoded"] > 0
    assert worst_error(got, rig.plain) <= 0.03
    plan.remove()


def test_remove_restores_the_blocks(device):
    rig = Rig(device)
    plan = rig.plan(rig.total_mb() / 3)
    assert any(s != "keep" for s in plan.strategies)
    plan.remove()
    assert all("forward" not in block.__dict__ for block in rig.model)
    assert all(torch.equal(a, b) for a, b in zip(rig.trained(), rig.plain))


def test_the_allocators_bytes_after_the_forward_are_the_plans_on_cuda():
    rig = Rig("cuda")

    def kept_after_forward():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = rig.step()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        loss.backward()
        rig.grads()
        return kept

    keep_all = rig.plan(1 << 20)
    outside_blocks = kept_after_forward() - keep_all.predicted_bytes
    keep_all.remove()
    for allow in (("checkpoint",), ("int8",), ("int8", "checkpoint")):
        plan = rig.plan(rig.total_mb() * 0.5, allow=allow)
        measured = kept_after_forward() - outside_blocks
        assert abs(measured - plan.predicted_bytes) <= 0.05 * plan.predicted_bytes, (
            allow, measured, plan.predicted_bytes)
        plan.remove()


def test_misuse_raises():
    rig = Rig("cpu")
    raises(ValueError, lambda: rig.plan(0), "budget_mb=0")
    raises(ValueError, lambda: rig.plan(0.01), "smallest plan", "raise budget_mb")
    raises(ValueError, lambda: rig.plan(10, allow=("int4",)), "allow=")
    raises(ValueError, lambda: ht.plan_blocks([], 10, rig.step), "non-empty")
    twice = torch.nn.Sequential(rig.model[0], rig.model[0])
    raises(ValueError, lambda: ht.plan_blocks(twice, 10, lambda: twice(rig.x).sum(),
                                              print_plan=False), "block 0 ran 2 times")
    third = rig.total_mb() / 3
    plan = rig.plan(third, allow=("checkpoint",))
    raises(ValueError, lambda: rig.plan(third), "already has a plan")
    plan.remove()
    raises(ValueError, lambda: rig.plan(third, allow=("offload",)), "offload", "CPU")
    raises(ValueError, lambda: rig.plan(third, pool=object()), "PinnedPool")


def test_offload_is_chosen_below_what_checkpointing_keeps():
    # A profile of two blocks, by hand: each saves 100 MB, int8 leaves 30 (0.4 ms more),
    # checkpointing keeps an input of 20 (its 1 ms forward again), offload leaves 5 and copies
    # 95 each way (3.45 ms at 55 GB/s).
    import headroom.blocks as hblocks

    mb = 10**6

    class Profile:
        blocks = [0, 1]
        saved, encoded, inputs = [100 * mb] * 2, [30 * mb] * 2, [20 * mb] * 2
        offloaded, moved = [5 * mb] * 2, [95 * mb] * 2
        ms = [1.0, 1.0]

    allow = ("keep", "int8", "checkpoint", "offload")
    # Where the cheaper moves fit, they are taken; below what checkpointing keeps only offload
    # fits.
    strategies, total, _, cost = hblocks._choose(Profile, [1.2, 1.2], 120 * mb, allow)
    assert total <= 120 * mb and "offload" not in strategies, strategies
    strategies, total, _, cost = hblocks._choose(Profile, [1.2, 1.2], 12 * mb, allow)
    assert strategies == ["offload", "offload"] and total == 10 * mb, strategies
    assert abs(cost["offload"][0] - 2 * 95 * mb / 55e6) < 1e-9


def test_a_plan_with_offload_gives_the_plain_gradients_on_cuda():
    rig = Rig("cuda")
    total = rig.total_mb()
    plan = rig.plan(total / 10, allow=("offload",))
    assert "offload" in plan.strategies and set(plan.strategies) <= {"keep", "offload"}
    assert plan.predicted_bytes <= total / 10 * MIB
    got = rig.trained()
    assert plan.stats["offloaded"] > 0 and plan.pool.pinned_bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(got, rig.plain))  # offloading loses nothing
    plan.remove()


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
