"""Misuse of the optimizers that step CPU tensors too (``AdamWBf16``, ``AdamW4bit``, ``SGD``): on
the CPU their host kernels write through raw pointers, so every change that would make a pointer
or a length wrong must raise its typed error before anything is written. A property test runs
random episodes over a model of parameters with equal counts and shapes: a valid change and a
step, equal bit for bit to a twin optimizer of the same class stepping an untouched copy; or an
invalidating change (a cast, a gradient of another dtype, a transposed parameter, a state tensor
given other storage of another size, the states of two parameters exchanged through a state
dict; with flat 4-bit states of equal counts that exchange is in bounds and steps) whose step
must raise with the parameters unchanged, then undone.

Run: ``python3 -m pytest crates/python/python/tests/test_optim_property.py`` (or ``python3`` on
this file). The ``cuda`` cases need a GPU (skipped without one; under ``HEADROOM_REQUIRE_GPU=1``
a failure instead).
"""

import copy
import random
import sys

from torch_gate import device_cases, main, on_device as on, torch

if torch is not None:
    import headroom.optim as hopt
    from optim_rigs import set_grad_any_dtype
    from test_saved_activations import raises

# Two pairs of equal counts with other shapes, one-element parameters, a 4-bit-quantised one.
SHAPES = [(64, 128), (128, 64), (8, 4), (4, 8), (1,), (1,), (37,)]
KINDS = ("step", "step", "new_storage", "zero_grad", "cast", "grad_cast", "transpose",
         "state_storage", "exchange_states")
OPTIMIZERS = {
    "adamw_bf16": (torch.bfloat16, lambda ps: hopt.AdamWBf16(ps, lr=1e-2)) if torch else None,
    "adamw_4bit": (torch.float32, lambda ps: hopt.AdamW4bit(ps, lr=1e-2)) if torch else None,
    "sgd_momentum": (torch.float16, lambda ps: hopt.SGD(ps, lr=1e-2, momentum=0.9)) if torch else None,
}


class Twins:
    """An optimizer over ``ours`` and one of the same class over an untouched copy."""

    def __init__(self, dev, dtype, make, seed):
        g = torch.Generator().manual_seed(seed)
        self.ours = [torch.nn.Parameter(torch.randn(*s, generator=g).to(dev, dtype)) for s in SHAPES]
        for i in (4, 5):
            self.ours[i].data.fill_(0.25)  # one-element parameters of equal values
        self.ref = [torch.nn.Parameter(p.detach().clone()) for p in self.ours]
        self.make = make
        self.opt, self.ref_opt = make(self.ours), make(self.ref)
        self.dev = dev

    def grads(self, which, seed):
        g = torch.Generator().manual_seed(seed)
        for i, (a, b) in enumerate(zip(self.ours, self.ref)):
            if i in which:
                grad = torch.randn(a.shape, generator=g).to(a.device, a.dtype)
                a.grad, b.grad = grad.clone(), grad.clone()
            else:
                a.grad = b.grad = None

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def assert_equal(self):
        self.sync()
        for i, (a, b) in enumerate(zip(self.ours, self.ref)):
            assert a.dtype == b.dtype and torch.equal(a.detach(), b.detach()), f"parameter {i}"


def episode(twins, rng, number):
    kind = rng.choice(KINDS)
    which = set(rng.sample(range(len(SHAPES)), rng.randint(1, len(SHAPES))))
    if kind == "new_storage":
        i = rng.randrange(len(SHAPES))
        fresh = torch.randn(SHAPES[i], generator=torch.Generator().manual_seed(number))
        fresh = fresh.to(twins.dev, twins.ours[i].dtype)
        twins.ours[i].data, twins.ref[i].data = fresh.clone(), fresh.clone()
    elif kind == "zero_grad":
        twins.opt.zero_grad(set_to_none=True)
        twins.ref_opt.zero_grad(set_to_none=True)
    if kind in ("step", "new_storage", "zero_grad"):
        twins.grads(which, number)
        twins.opt.step()
        twins.ref_opt.step()
        twins.assert_equal()
        return kind
    i = rng.choice([0, 1]) if kind in ("transpose", "exchange_states") else rng.randrange(len(SHAPES))
    twins.grads(which | {i}, number)
    p = twins.ours[i]
    kept, expected = p.data, None
    if kind == "cast":
        p.data = p.data.double()
        expected = TypeError
    elif kind == "grad_cast":
        set_grad_any_dtype(p, p.grad.double())
        expected = TypeError
    elif kind == "transpose":
        p.data = p.data.t()
        expected = ValueError
    elif kind == "state_storage":
        state = twins.opt.state.get(p)
        if not state:
            return "skipped"
        key = next((k for k, v in state.items()
                    if isinstance(v, torch.Tensor) and v.numel() > 1), None)
        if key is None:
            return "skipped"
        held = state[key].data
        state[key].data = torch.zeros(held.numel() + 1, dtype=held.dtype, device=held.device)
        expected = ValueError
    else:  # exchange_states: (64, 128) and (128, 64), the same count, other shapes
        sd = twins.opt.state_dict()
        if 0 not in sd["state"] or 1 not in sd["state"]:
            return "skipped"
        sd["state"][0], sd["state"][1] = sd["state"][1], sd["state"][0]
        try:
            twins.opt.load_state_dict(sd)
        except ValueError:
            pass  # refused at loading already: nothing was written
        else:
            # States shaped like their parameter (Adam's f32 moments, SGD's buffer) no longer
            # fit: the step raises. Flat states of equal counts (4-bit codes and scales) still
            # fit: the step runs on them, in bounds.
            shaped = any(isinstance(v, torch.Tensor) and v.dim() > 1
                         for v in twins.opt.state[p].values())
            expected = ValueError if shaped else None
            if expected is None:
                twins.opt.step()
    if expected is not None:
        before = [q.detach().clone() for q in twins.ours]
        raises(expected, twins.opt.step)
        twins.sync()
        for q, b in zip(twins.ours, before):
            assert torch.equal(q.detach(), b), f"{kind}: a step that raised wrote"
    # Undo: the parameter as it was (every parameter the twin's values, after an exchange that
    # stepped), the state the twin's.
    p.data = kept
    p.grad = None
    for a, b in zip(twins.ours, twins.ref):
        if not torch.equal(a.detach(), b.detach()):
            a.data = b.detach().clone()
    twins.opt.load_state_dict(copy.deepcopy(twins.ref_opt.state_dict()))
    twins.grads(which, number)
    twins.opt.step()
    twins.ref_opt.step()
    twins.assert_equal()
    return kind


def property_run(dev, name, seed, episodes):
    dtype, make = OPTIMIZERS[name]
    rng = random.Random(seed)
    twins = Twins(dev, dtype, make, seed)
    return [episode(twins, rng, e) for e in range(episodes)]


def test_random_interleavings_never_write_out_of_bounds(device):
    dev = on(device)
    for name in OPTIMIZERS:
        kinds = []
        for run in range(4):
            kinds += property_run(dev, name, 20261203 + run, 20)
        for kind in ("step", "cast", "grad_cast", "transpose", "state_storage"):
            assert kind in kinds, f"{name}: no {kind!r} episode in 80"


def test_an_optimizer_steps_from_any_thread(device):
    # On CUDA, autograd runs backward (and so in-backward steps) on its own device thread: an
    # optimizer whose native kernel was made there must step on the main thread too, and the
    # other way round, and be dropped anywhere.
    import threading

    dev = on(device)
    for name, (dtype, make) in OPTIMIZERS.items():
        twins = Twins(dev, dtype, make, seed=5)
        for step_here in (False, True, False):
            for ps in (twins.ours, twins.ref):
                for p in ps:
                    p.grad = torch.full_like(p, 0.25)
            errors = []

            def step(errors=errors, twins=twins):
                try:
                    twins.opt.step()
                except BaseException as error:  # noqa: BLE001 (reported below)
                    errors.append(error)

            if step_here:
                step()
            else:
                worker = threading.Thread(target=step)
                worker.start()
                worker.join()
            assert not errors, (name, errors)
            twins.ref_opt.step()
        twins.assert_equal()
        worker = threading.Thread(target=lambda twins=twins: twins.__dict__.clear())
        worker.start()
        worker.join()


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
