"""Misuse of ``headroom.optim``: every way a tensor handed to the kernels can stop matching what
they were told (state dicts of other models or in another order, parameters cast, moved or given
new storage after construction, gradient sets that change, gradients and states of the wrong
dtype, size, device or layout, aliasing) either raises the documented ``TypeError`` or
``ValueError`` before anything is launched, or steps exactly as PyTorch's own Adam does.

Two rigs run every case (``optim_rigs.py``):

- ``cpu`` (wherever torch is installed, no GPU needed): the optimizers' own Python (the checks,
  the launch plans, the caching) with CPU tensors, their kernel replaced by a stand-in that looks
  every pointer it is handed up among the live tensors it must belong to — the parameter with
  that address, its gradient, its state — and fails the test when one is anything else or its
  length differs (there the GPU kernel would have read or written out of bounds), then runs
  torch's single-tensor Adam on those tensors. The reference is ``torch.optim.Adam``/``AdamW``
  with ``foreach=False``: the same arithmetic, so parameters compare bit for bit.
- ``cuda`` (a GPU): the real kernels, compared bit for bit with ``torch.optim.AdamW(fused=True)``
  (and ``Adam(fused=True)`` without weight decay).

Run: ``python3 -m pytest crates/python/python/tests/test_optim_misuse.py`` (or ``python3`` on
this file, which runs it through pytest when installed and through a small loop otherwise).
Without torch the module is skipped; with ``HEADROOM_REQUIRE_GPU=1`` a missing torch or GPU
fails instead. ``run_memcheck.sh`` beside it runs it under ``compute-sanitizer``.
"""

import copy
import functools
import os
import random
import sys
import warnings

from torch_gate import main, pytest, skip, torch

from optim_rigs import (
    MIN_8BIT,
    RIG_NAMES,
    Pair,
    Rig,
    adamw_with_unit_grad,
    assert_step_refused,
    raises,
    rig_for,
    set_grad_any_dtype,
)


def pytest_generate_tests(metafunc):
    if "rig_name" in metafunc.fixturenames:
        metafunc.parametrize("rig_name", RIG_NAMES)


# ---------------------------------------------------------------------------------------------
# State dicts of other models, parameters in another order.
# ---------------------------------------------------------------------------------------------


def test_state_dict_of_other_model_same_count_shapes_differ(rig_name):
    """Same group size, same total count (8x4 + 8 = 40 = 4x8 + 8 elements), other shapes: the
    step raises ValueError naming the state, before writing anything."""
    rig = rig_for(rig_name)
    other = rig.params([(4, 8), (8,)])
    donor = rig.AdamW(other, lr=1e-2)
    for p in other:
        p.grad = torch.ones_like(p)
    donor.step()
    mine = rig.params([(8, 4), (8,)], seed=7)
    opt = rig.AdamW(mine, lr=1e-2)
    opt.load_state_dict(donor.state_dict())
    for p in mine:
        p.grad = torch.ones_like(p)
    assert_step_refused(rig, opt, mine, ValueError, "exp_avg", "shape")


def test_state_dict_of_other_model_same_total_numel_differs(rig_name):
    """16 + 24 elements against 32 + 8: another per-tensor size raises ValueError."""
    rig = rig_for(rig_name)
    other = rig.params([(4, 4), (24,)])
    donor = rig.AdamW(other)
    for p in other:
        p.grad = torch.ones_like(p)
    donor.step()
    mine = rig.params([(8, 4), (8,)])
    opt = rig.AdamW(mine)
    opt.load_state_dict(donor.state_dict())
    for p in mine:
        p.grad = torch.ones_like(p)
    raises(ValueError, opt.step, "shape")


def test_state_dict_permuted_within_group_raises(rig_name):
    """The optimizer's own state dict loaded into one over the same parameters in another
    order: each parameter gets another's state of another shape: ValueError."""
    rig = rig_for(rig_name)
    w, b = rig.params([(8, 4), (8,)])
    opt = rig.AdamW([w, b])
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    permuted = rig.AdamW([b, w])
    permuted.load_state_dict(opt.state_dict())
    assert_step_refused(rig, permuted, [w, b], ValueError, "shape")


def test_state_dict_permuted_same_shapes_steps_like_torch(rig_name):
    """Parameters of one shape swapped: nothing can tell, and the step equals torch's with the
    same swapped state dict (no pointer goes astray)."""
    rig = rig_for(rig_name)
    pair = Pair(rig, [(4, 4), (4, 4), (3,)])
    pair.grads({0, 1, 2}, seed=1)
    pair.step()
    ours_sd, ref_sd = pair.ours.state_dict(), pair.ref.state_dict()
    for sd in (ours_sd, ref_sd):
        sd["state"][0], sd["state"][1] = sd["state"][1], sd["state"][0]
    pair.ours.load_state_dict(ours_sd)
    pair.ref.load_state_dict(ref_sd)
    pair.grads({0, 1, 2}, seed=2)
    pair.step()
    pair.assert_equal()


def test_state_dict_of_other_optimizer_missing_keys_raises(rig_name):
    """An SGD state dict (``momentum_buffer``, no ``exp_avg``) loaded into AdamW: ValueError."""
    rig = rig_for(rig_name)
    p = rig.params([(5,)])[0]
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones_like(p)
    sgd.step()
    opt = rig.AdamW([p])
    sd = sgd.state_dict()
    sd["param_groups"][0].update(opt.state_dict()["param_groups"][0])
    sd["param_groups"][0]["params"] = [0]
    opt.load_state_dict(sd)
    raises(ValueError, opt.step, "has no")


# ---------------------------------------------------------------------------------------------
# Parameters changed after construction.
# ---------------------------------------------------------------------------------------------


def test_model_half_after_construction_raises_type_error(rig_name):
    rig = rig_for(rig_name)
    model = torch.nn.Linear(4, 3).to(rig.device)
    opt = rig.AdamW(model.parameters())
    model(torch.ones(2, 4, device=rig.device)).sum().backward()
    opt.step()
    model.half()
    model.zero_grad(set_to_none=False)
    raises(TypeError, opt.step, "float16")


def test_model_to_float64_after_construction_raises_type_error(rig_name):
    rig = rig_for(rig_name)
    model = torch.nn.Linear(4, 3).to(rig.device)
    opt = rig.Adam(model.parameters())
    model.to(torch.float64)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    raises(TypeError, opt.step, "float64")


def test_parameter_moved_off_the_gpu_raises_type_error():
    rig, p, opt = adamw_with_unit_grad("cuda", (16,))
    opt.step()
    p.data = p.data.cpu()
    p.grad = torch.ones_like(p)
    raises(TypeError, opt.step, "cpu")


def test_p_data_new_storage_steps_the_new_storage_like_torch(rig_name):
    """``p.data = ...`` (new storage, same dtype and shape) after steps: the next step writes
    the new storage, equal to torch's fused step bit for bit, and leaves the old one alone."""
    rig = rig_for(rig_name)
    pair = Pair(rig, [(8, 4), (8,)])
    pair.grads({0, 1}, seed=1)
    pair.step()
    old = pair.ours_params[0].data
    old_before = old.clone()
    fresh = rig.tensor(8, 4, seed=99)
    pair.ours_params[0].data = fresh.clone()
    pair.ref_params[0].data = fresh.clone()
    pair.grads({0, 1}, seed=2)
    pair.step()
    pair.assert_equal()
    assert torch.equal(old, old_before), "the step wrote the parameter's old storage"
    assert not torch.equal(pair.ours_params[0].detach(), fresh), "the new storage was not stepped"


def test_p_data_other_shape_raises_value_error(rig_name):
    """New storage of another size: the state no longer fits: ValueError (torch's fused kernel
    raises RuntimeError there)."""
    rig, p, opt = adamw_with_unit_grad(rig_name, (8,))
    opt.step()
    p.data = rig.tensor(16)
    p.grad = torch.ones_like(p)
    raises(ValueError, opt.step, "exp_avg", "(16,)")


def test_p_data_transposed_raises_value_error(rig_name):
    rig, p, opt = adamw_with_unit_grad(rig_name, (8, 4))
    opt.step()
    p.data = p.data.t()
    raises(ValueError, opt.step, "non-contiguous parameter")


def test_parameter_restored_after_raise_steps_again(rig_name):
    """A step that raised leaves nothing behind: cast back to float32, the next step equals
    torch's (each with one step counted)."""
    rig = rig_for(rig_name)
    pair = Pair(rig, [(6,), (2, 3)])
    pair.grads({0, 1}, seed=3)
    pair.ours_params[1].data = pair.ours_params[1].data.half()
    raises(TypeError, pair.ours.step, "float16")
    pair.ours_params[1].data = pair.ours_params[1].data.float()
    pair.ref_params[1].data = pair.ref_params[1].data.half().float()
    pair.grads({0, 1}, seed=4)
    pair.step()
    pair.assert_equal()


# ---------------------------------------------------------------------------------------------
# Gradient sets that change, one-element parameters.
# ---------------------------------------------------------------------------------------------


def test_gradient_set_changes_at_equal_count(rig_name):
    """Steps with gradients on {a, b}, then {b, c}, then {a, c} (``set_to_none``, conditional
    branches, MoE experts): the lists are compared by identity, never with ``==``."""
    rig = rig_for(rig_name)
    pair = Pair(rig, [(5, 3), (5, 3), (5, 3)])
    for seed, which in enumerate(({0, 1}, {1, 2}, {0, 2}, {0, 1})):
        pair.grads(which, seed)
        pair.step()
        pair.assert_equal()


def test_one_element_parameters_with_equal_values_step_separately(rig_name):
    """Two one-element parameters holding the same value: the gradient set {x} then {y} steps y
    the second time (``==`` would have found the lists equal and stepped x again)."""
    rig = rig_for(rig_name)
    x = torch.nn.Parameter(torch.ones(1, device=rig.device))
    y = torch.nn.Parameter(torch.ones(1, device=rig.device))
    rx = torch.nn.Parameter(torch.ones(1, device=rig.device))
    ry = torch.nn.Parameter(torch.ones(1, device=rig.device))
    opt, ref = rig.AdamW([x, y], lr=0.1), rig.reference("adamw", [rx, ry], lr=0.1)
    for ours, theirs in ((x, rx), (y, ry), (y, ry), (x, rx)):
        for p in (x, y, rx, ry):
            p.grad = None
        ours.grad = torch.full((1,), 0.5, device=rig.device)
        theirs.grad = torch.full((1,), 0.5, device=rig.device)
        opt.step()
        ref.step()
        rig.sync()
        assert torch.equal(x.detach(), rx.detach()) and torch.equal(y.detach(), ry.detach())
    assert float(x.detach()) != 1.0 and float(y.detach()) != 1.0


def test_zero_grad_set_to_none_with_unused_parameters(rig_name):
    """``zero_grad(set_to_none=True)`` and a model whose branches leave some parameters without
    gradients: equal to torch over 6 steps."""
    rig = rig_for(rig_name)
    pair = Pair(rig, [(4,), (4,), (4,), (4,)])
    rng = random.Random(5)
    for seed in range(6):
        which = set(rng.sample(range(4), 2))
        pair.grads(which, seed)
        pair.step()
        pair.ours.zero_grad(set_to_none=True)
        pair.ref.zero_grad(set_to_none=True)
    pair.assert_equal()


def test_empty_parameter_is_counted_not_launched(rig_name):
    rig = rig_for(rig_name)
    pair = Pair(rig, [(0,), (3,)])
    pair.grads({0, 1}, seed=1)
    pair.step()
    pair.assert_equal()


# ---------------------------------------------------------------------------------------------
# Gradients of the wrong kind.
# ---------------------------------------------------------------------------------------------


def test_float16_gradient_of_float32_parameter_raises_type_error(rig_name):
    rig, p, opt = adamw_with_unit_grad(rig_name, (8,))
    opt.step()
    set_grad_any_dtype(p, torch.ones(8, dtype=torch.half, device=rig.device))
    assert_step_refused(rig, opt, [p], TypeError, "gradient of dtype torch.float16")


def test_gradient_resized_through_data_raises_value_error(rig_name):
    """``p.grad.data = smaller`` (PyTorch allows it): the kernel would read past the gradient."""
    rig, p, opt = adamw_with_unit_grad(rig_name, (64,))
    opt.step()
    p.grad.data = torch.ones(3, device=rig.device)
    raises(ValueError, opt.step, "gradient of shape (3,)")


def test_non_contiguous_gradient_raises_value_error(rig_name):
    rig, p, opt = adamw_with_unit_grad(rig_name, (4, 4))
    p.grad = rig.tensor(4, 4).t()
    raises(ValueError, opt.step, "non-contiguous gradient")


def test_sparse_gradient_raises_type_error(rig_name):
    rig, p, opt = adamw_with_unit_grad(rig_name, (4,))
    p.grad = torch.zeros(4, device=rig.device).to_sparse()
    raises(TypeError, opt.step, "sparse")


def test_gradient_on_another_device_raises_value_error():
    rig, p, opt = adamw_with_unit_grad("cuda", (4,))
    try:
        p.grad.data = torch.ones(4)
    except RuntimeError:
        skip("this PyTorch refuses a CPU gradient for a CUDA parameter")
    raises(ValueError, opt.step, "gradient on cpu")


def test_shared_gradient_with_grad_scale_raises_value_error(rig_name):
    """With ``grad_scale`` the gradients are divided in place: two parameters sharing one
    gradient tensor would race."""
    rig = rig_for(rig_name)
    a, b = rig.params([(4,), (4,)])
    opt = rig.AdamW([a, b])
    g = torch.ones(4, device=rig.device)
    a.grad, b.grad = g, g
    scale = torch.ones((), device=rig.device)
    raises(ValueError, lambda: opt.step(grad_scale=scale), "gradients", "share memory")


# ---------------------------------------------------------------------------------------------
# State tensors of the wrong kind.
# ---------------------------------------------------------------------------------------------


def _fresh_state_case(rig, **state_overrides):
    p = rig.params([(6, 2)])[0]
    opt = rig.AdamW([p])
    state = {
        "step": torch.tensor(0.0),
        "exp_avg": torch.zeros_like(p),
        "exp_avg_sq": torch.zeros_like(p),
    }
    state.update(state_overrides)
    opt.state[p] = state
    p.grad = torch.ones_like(p)
    return p, opt


def test_state_of_wrong_dtype_raises_type_error(rig_name):
    rig = rig_for(rig_name)
    _, opt = _fresh_state_case(rig, exp_avg=torch.zeros(6, 2, dtype=torch.float64, device=rig.device))
    raises(TypeError, opt.step, "exp_avg", "float64")


def test_state_of_wrong_shape_raises_value_error(rig_name):
    rig = rig_for(rig_name)
    _, opt = _fresh_state_case(rig, exp_avg_sq=torch.zeros(3, device=rig.device))
    raises(ValueError, opt.step, "exp_avg_sq", "(3,)")


def test_state_not_contiguous_raises_value_error(rig_name):
    rig = rig_for(rig_name)
    _, opt = _fresh_state_case(rig, exp_avg=torch.zeros(2, 6, device=rig.device).t())
    raises(ValueError, opt.step, "not contiguous")


def test_state_on_another_device_raises_value_error():
    rig = rig_for("cuda")
    _, opt = _fresh_state_case(rig, exp_avg=torch.zeros(6, 2))
    raises(ValueError, opt.step, "exp_avg", "cpu")


def test_state_storage_swapped_between_steps_is_checked_again(rig_name):
    """``state.data = ...`` between steps (optimizer offload recipes): a smaller buffer raises
    ValueError; a same-shaped one is stepped in place of the old, like torch."""
    rig = rig_for(rig_name)
    pair = Pair(rig, [(8,)])
    pair.grads({0}, seed=1)
    pair.step()
    ours_m = pair.ours.state[pair.ours_params[0]]["exp_avg"]
    kept = ours_m.data
    ours_m.data = torch.zeros(2, device=rig.device)
    raises(ValueError, pair.ours.step, "exp_avg", "(2,)")
    ours_m.data = kept.clone()
    pair.grads({0}, seed=2)
    pair.step()
    pair.assert_equal()


def test_amsgrad_state_of_wrong_shape_raises_value_error(rig_name):
    rig = rig_for(rig_name)
    p = rig.params([(5,)])[0]
    opt = rig.AdamW([p], amsgrad=True)
    p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["max_exp_avg_sq"] = torch.zeros(4)
    opt.load_state_dict(sd)
    raises(ValueError, opt.step, "max_exp_avg_sq")


def test_amsgrad_steps_like_torch(rig_name):
    rig = rig_for(rig_name)
    pair = Pair(rig, [(7,), (3, 3)], amsgrad=True)
    for seed in range(3):
        pair.grads({0, 1}, seed)
        pair.step()
    pair.assert_equal()


# ---------------------------------------------------------------------------------------------
# Aliasing, scaler tensors, groups, atomicity.
# ---------------------------------------------------------------------------------------------


def test_parameter_listed_twice_raises_value_error(rig_name):
    rig = rig_for(rig_name)
    p = rig.params([(4,)])[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = rig.AdamW([p, p])
    p.grad = torch.ones_like(p)
    raises(ValueError, opt.step, "share memory")


def test_overlapping_views_as_parameters_raise_value_error(rig_name):
    rig = rig_for(rig_name)
    base = rig.tensor(12)
    a = torch.nn.Parameter(base[0:8])
    b = torch.nn.Parameter(base[4:12])
    opt = rig.AdamW([a, b])
    a.grad, b.grad = torch.ones(8, device=rig.device), torch.ones(8, device=rig.device)
    raises(ValueError, opt.step, "share memory")


def test_bad_grad_scale_and_found_inf_raise(rig_name):
    rig, p, opt = adamw_with_unit_grad(rig_name, (4,))
    raises(TypeError, lambda: opt.step(grad_scale=2.0), "grad_scale must be a tensor")
    raises(TypeError, lambda: opt.step(grad_scale=torch.ones((), dtype=torch.float64, device=rig.device)),
           "float32")
    raises(ValueError, lambda: opt.step(found_inf=torch.zeros(2, device=rig.device)), "one element")
    if rig.name == "cuda":
        raises(ValueError, lambda: opt.step(grad_scale=torch.ones(())), "cpu")


def test_failed_group_leaves_every_group_unstepped(rig_name):
    """Group 0 valid, group 1 holds a float16 parameter: nothing is launched for either."""
    rig = rig_for(rig_name)
    a, b = rig.params([(4,), (4,)])
    opt = rig.AdamW([{"params": [a]}, {"params": [b]}])
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    b.data = b.data.half()
    assert_step_refused(rig, opt, [a], TypeError, "float16")
    assert len(opt.state[a]) == 0 or int(opt.state_dict()["state"][0]["step"]) == 0


def test_step_on_side_stream_raises_value_error():
    rig, p, opt = adamw_with_unit_grad("cuda", (4,))
    with torch.cuda.stream(torch.cuda.Stream()):
        raises(ValueError, opt.step, "default stream")


# ---------------------------------------------------------------------------------------------
# 8-bit.
# ---------------------------------------------------------------------------------------------


def _adam8bit_case(rig, numel=MIN_8BIT * 2):
    p = rig.params([(numel,)])[0]
    opt = rig.Adam8bit([p])
    p.grad = torch.ones_like(p)
    opt.step()
    rig.sync()
    return p, opt


def test_8bit_missing_absmax_raises_value_error(rig_name):
    rig = rig_for(rig_name)
    p, opt = _adam8bit_case(rig)
    sd = opt.state_dict()
    del sd["state"][0]["absmax1"]
    opt.load_state_dict(sd)
    assert_step_refused(rig, opt, [p], ValueError, "absmax1")


def test_8bit_absmax_of_wrong_size_raises_value_error(rig_name):
    rig = rig_for(rig_name)
    _, opt = _adam8bit_case(rig)
    sd = opt.state_dict()
    sd["state"][0]["absmax2"] = torch.zeros(3)
    opt.load_state_dict(sd)
    raises(ValueError, opt.step, "absmax2", "(32,)")


def test_8bit_absmax_of_wrong_dtype_raises_type_error(rig_name):
    rig = rig_for(rig_name)
    _, opt = _adam8bit_case(rig)
    sd = opt.state_dict()
    sd["state"][0]["absmax1"] = torch.zeros(32, dtype=torch.float16)
    opt.load_state_dict(sd)
    raises(TypeError, opt.step, "absmax1", "float16")


def test_8bit_state_dict_of_smaller_model_raises(rig_name):
    """A 32-bit state (under 4096 elements) loaded for an 8-bit-sized parameter: the codes'
    dtype is wrong (TypeError); u8 codes of another size: ValueError."""
    rig = rig_for(rig_name)
    _, small = _adam8bit_case(rig, numel=100)
    _, opt = _adam8bit_case(rig)
    opt.load_state_dict(small.state_dict())
    raises(TypeError, opt.step, "state1", "torch.uint8")
    _, other = _adam8bit_case(rig, numel=MIN_8BIT * 3)
    opt.load_state_dict(other.state_dict())
    raises(ValueError, opt.step, "state1", "shape")


def test_8bit_model_half_raises_type_error(rig_name):
    rig = rig_for(rig_name)
    p, opt = _adam8bit_case(rig)
    p.data = p.data.half()
    p.grad = torch.ones_like(p)
    raises(TypeError, opt.step, "float16")


def test_8bit_state_dict_round_trip_steps_on(rig_name):
    """A state dict taken and loaded back (the codes keep their dtypes) steps on from the same
    state: two optimizers, one reloaded, stay equal."""
    rig = rig_for(rig_name)
    a = rig.params([(MIN_8BIT * 2,), (10,)], seed=3)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = rig.AdamW8bit(a), rig.AdamW8bit(b)
    for seed in range(3):
        for pa, pb in zip(a, b):
            g = rig.tensor(*pa.shape, seed=seed)
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
        if seed == 1:
            ob.load_state_dict(copy.deepcopy(ob.state_dict()))
    rig.sync()
    for pa, pb in zip(a, b):
        assert torch.equal(pa.detach(), pb.detach())


# ---------------------------------------------------------------------------------------------
# The property: random interleavings never corrupt memory.
# ---------------------------------------------------------------------------------------------

SHAPES = [(8, 4), (8,), (4, 8), (1,), (1,), (32,)]
# Invalidating episodes and the error each must raise at the next step that touches them.
BREAKS = ("half", "grad_half", "shuffle_states", "shrink_state", "transpose")


def _episode(pair, rng, episode):
    """One random episode on ``pair``: a valid change and a step (equal to torch), or a change
    that must make the next step raise its typed error (parameters untouched), then undone."""
    rig = pair.rig
    n = len(SHAPES)
    kind = rng.choice(("step", "step", "new_storage", "swap_same_shape", "zero_grad") + BREAKS)
    which = set(rng.sample(range(n), rng.randint(1, n)))
    if kind == "new_storage":
        i = rng.randrange(n)
        fresh = rig.tensor(*SHAPES[i], seed=10_000 + episode)
        pair.ours_params[i].data = fresh.clone()
        pair.ref_params[i].data = fresh.clone()
    elif kind == "swap_same_shape":
        ours_sd, ref_sd = pair.ours.state_dict(), pair.ref.state_dict()
        for sd in (ours_sd, ref_sd):
            sd["state"][3], sd["state"][4] = sd["state"].get(4), sd["state"].get(3)
            sd["state"] = {k: v for k, v in sd["state"].items() if v is not None}
        pair.ours.load_state_dict(ours_sd)
        pair.ref.load_state_dict(ref_sd)
    elif kind == "zero_grad":
        pair.ours.zero_grad(set_to_none=True)
        pair.ref.zero_grad(set_to_none=True)
    if kind in BREAKS:
        i = rng.choice([0, 2]) if kind in ("shuffle_states", "transpose") else rng.randrange(n)
        pair.grads(which | {i}, seed=episode)
        p = pair.ours_params[i]
        undo = None
        if kind == "half":
            p.data = p.data.half()
            expected, undo_data = TypeError, True
        elif kind == "grad_half":
            set_grad_any_dtype(p, p.grad.half())
            expected, undo_data = TypeError, False
        elif kind == "transpose":
            p.data = p.data.t()
            expected, undo_data = ValueError, True
        elif kind == "shuffle_states":
            # States of (8, 4) and (4, 8) exchanged: same count, other shapes.
            sd = pair.ours.state_dict()
            if 0 not in sd["state"] or 2 not in sd["state"]:
                return "skipped"
            sd["state"][0], sd["state"][2] = sd["state"][2], sd["state"][0]
            pair.ours.load_state_dict(sd)
            expected, undo_data = ValueError, False
        else:  # shrink_state
            state = pair.ours.state.get(p)
            if not state or "exp_avg" not in state:
                return "skipped"
            kept = state["exp_avg"].data
            state["exp_avg"].data = torch.zeros(p.numel() + 1, device=rig.device)
            undo = lambda: setattr(state["exp_avg"], "data", kept)  # noqa: E731
            expected, undo_data = ValueError, False
        assert_step_refused(rig, pair.ours, pair.ours_params, expected)
        # Undo: the parameter back to float32 / contiguous (the same values as the reference's),
        # the reference's state reloaded.
        if undo_data:
            p.data = pair.ref_params[i].detach().clone()
        if undo is not None:
            undo()
        # (a copy: torch's loader keeps tensors of the right dtype and device as they are, and
        # the two optimizers must not share state)
        pair.ours.load_state_dict(copy.deepcopy(pair.ref.state_dict()))
        return kind
    pair.grads(which, seed=episode)
    pair.step()
    pair.assert_equal()
    return kind


def run_property(rig, seed, episodes):
    rng = random.Random(seed)
    pair = Pair(rig, SHAPES, seed=seed)
    for i in range(SHAPES.index((1,)), SHAPES.index((1,)) + 2):
        for params in (pair.ours_params, pair.ref_params):
            params[i].data.fill_(0.25)  # one-element parameters of equal values
    return [_episode(pair, rng, e) for e in range(episodes)]


def test_random_interleavings_never_corrupt_memory(rig_name):
    """200 random episodes over a model with parameters of equal counts and shapes, one-element
    parameters of equal values: each step raises its typed error with the parameters untouched,
    or equals torch's bit for bit (``HEADROOM_PROPERTY_SEED`` picks another sequence)."""
    rig = rig_for(rig_name)
    seed = int(os.environ.get("HEADROOM_PROPERTY_SEED", "20261201"))
    kinds = []
    for run in range(8):
        kinds += run_property(rig, seed + run, 25)
    assert len(kinds) == 200
    for kind in ("step", "new_storage", "half", "grad_half", "shrink_state", "transpose"):
        assert kind in kinds, f"no {kind!r} episode in 200"


if torch is not None and pytest is not None:
    try:
        from hypothesis import given, settings, strategies

        @settings(max_examples=40, deadline=None)
        @given(seed=strategies.integers(0, 2**31 - 1))
        def test_hypothesis_interleavings_on_cpu(seed):
            """The same property over seeds that hypothesis draws (cpu rig: cheap)."""
            run_property(Rig("cpu"), seed, 12)

    except ImportError:
        pass


# ---------------------------------------------------------------------------------------------
# Without pytest: python3 test_optim_misuse.py
# ---------------------------------------------------------------------------------------------


def _cases():
    """Every test of this file, once per rig where it takes one, for ``torch_gate.run_cases``."""
    import inspect

    res = []
    for name, fn in sorted(globals().items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        if "rig_name" in inspect.signature(fn).parameters:
            res.extend((f"{name}[{rig}]", functools.partial(fn, rig)) for rig in RIG_NAMES)
        else:
            res.append((name, fn))
    return res


if __name__ == "__main__":
    sys.exit(main(__file__, _cases))
