"""``headroom.optim.MasterWeights``: float16 and bfloat16 parameters stepped through float32
masters by a ``headroom.optim`` optimizer, on the CPU (``SGD``, ``AdamW4bit``: their host
kernels) and on CUDA (``AdamW``). The masters equal a float32 copy of the model stepped by the
same optimizer on the same gradients widened, bit for bit, and the parameters are those masters
rounded to nearest; a scheduler drives the inner optimizer; a state dict continues the run bit
for bit; misuse raises before anything is written.

Run: ``python3 -m pytest crates/python/python/tests/test_master_weights.py`` (or ``python3`` on
this file). The ``cuda`` cases need a GPU.
"""

import sys

from torch_gate import device_cases, main, on_device as on, torch

if torch is not None:
    import headroom.optim as hopt
    from optim_rigs import set_grad_any_dtype
    from test_saved_activations import raises

SHAPES = [(64, 128), (37,), (8, 4)]


def inner_optimizers(dev):
    """(name, make) of the inner optimizers the device steps float32 masters with."""
    if dev.type == "cuda":
        yield "adamw", lambda ps: hopt.AdamW(ps, lr=1e-2)
    yield "sgd", lambda ps: hopt.SGD(ps, lr=0.1, momentum=0.9)
    yield "adamw4bit", lambda ps: hopt.AdamW4bit(ps, lr=1e-2)


def half_and_float(dev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    half = [torch.nn.Parameter(torch.randn(*s, generator=g).to(dev, dtype)) for s in SHAPES]
    full = [torch.nn.Parameter(p.detach().float()) for p in half]
    return half, full


def set_grads(half, full, step):
    g = torch.Generator().manual_seed(100 + step)
    for p, q in zip(half, full):
        grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
        p.grad, q.grad = grad, grad.float()


def test_masters_are_a_float32_runs_bits(device):
    dev = on(device)
    for dtype in (torch.float16, torch.bfloat16):
        for name, make in inner_optimizers(dev):
            half, full = half_and_float(dev, dtype)
            ours, reference = hopt.MasterWeights(half, make), make(full)
            for step in range(4):
                set_grads(half, full, step)
                ours.step()
                reference.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            for p, q, m in zip(half, full, ours._masters):
                assert torch.equal(m, q), (dtype, name)
                assert torch.equal(p.detach(), q.detach().to(dtype)), (dtype, name)


def test_a_scheduler_drives_the_inner_optimizer(device):
    dev = on(device)
    half, _ = half_and_float(dev, torch.bfloat16)
    opt = hopt.MasterWeights(half, lambda ps: hopt.SGD(ps, lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        for p in half:
            p.grad = torch.ones_like(p)
        opt.step()
        scheduler.step()
    assert abs(opt._inner.param_groups[0]["lr"] - 0.1 * 0.5**3) < 1e-12


def test_a_state_dict_continues_the_run_bit_for_bit(device):
    dev = on(device)
    make = lambda ps: hopt.AdamW4bit(ps, lr=1e-2)  # noqa: E731
    whole, full = half_and_float(dev, torch.bfloat16)
    opt = hopt.MasterWeights(whole, make)
    for step in range(4):
        set_grads(whole, full, step)
        opt.step()
    half, full = half_and_float(dev, torch.bfloat16)
    first = hopt.MasterWeights(half, make)
    for step in range(2):
        set_grads(half, full, step)
        first.step()
    saved = first.state_dict()
    fresh, _ = half_and_float(dev, torch.bfloat16, seed=9)  # other values: the masters restore
    resumed = hopt.MasterWeights(fresh, make)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        set_grads(fresh, full, step)
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(fresh, whole))


def test_misuse_raises(device):
    dev = on(device)
    sgd = lambda ps: hopt.SGD(ps, lr=0.1)  # noqa: E731
    whole = torch.nn.Parameter(torch.zeros(4, device=dev, dtype=torch.float64))
    raises(TypeError, lambda: hopt.MasterWeights([whole], sgd), "float16, bfloat16 or float32")
    half, _ = half_and_float(dev, torch.float16)
    raises(TypeError, lambda: hopt.MasterWeights(half, lambda ps: torch.optim.SGD(ps, lr=0.1)),
           "headroom.optim optimizer")
    opt = hopt.MasterWeights(half, sgd)
    before = [p.detach().clone() for p in half]
    set_grad_any_dtype(half[0], torch.zeros(half[0].shape, device=dev))
    raises(TypeError, opt.step, "a gradient of dtype")
    half[0].grad = None
    half[1].data = half[1].data.float()
    raises(TypeError, opt.step, "the masters cannot follow a cast")
    half[1].data = before[1].clone()
    assert all(torch.equal(p.detach(), b) for p, b in zip(half, before))
    other, _ = half_and_float(dev, torch.float16)
    state = hopt.MasterWeights(other[:2], sgd).state_dict()
    raises(ValueError, lambda: opt.load_state_dict(state), "a state dict of other parameters")


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
