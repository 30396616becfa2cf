"""``headroom.optim.Adafactor``: ``torch.optim.Adafactor``'s update on float32 parameters, on the
CPU (the host kernel through the extension) and on CUDA (``CudaAdafactor``'s raw-buffer kernels).

What holds: after five steps every parameter (factored matrices, a batch of matrices, vectors)
is within 1e-7 of torch's single-tensor Adafactor relative to its largest magnitude (the
update's two norms are float64 sums in another order); the state is torch's (keys, shapes,
float32 ``step``), so a torch state dict loads into ours and ours into torch, each continuing
within the same bound; CUDA is within four ulps of the CPU; stepped inside backward it gives the
plain loop's bits; misuse raises.

Run: ``python3 -m pytest crates/python/python/tests/test_adafactor.py`` (or ``python3`` on this
file). The ``cuda`` cases need a GPU (skipped without one; under ``HEADROOM_REQUIRE_GPU=1`` a
failure instead).
"""

import copy
import sys

from torch_gate import device_cases, main, on_device as on, torch

if torch is not None:
    import headroom.optim as hopt
    import headroom.torch as ht
    from test_saved_activations import raises

SHAPES = [(64, 32), (3, 8, 16), (100,), (7,)]
SETTINGS = dict(lr=1e-2, weight_decay=1e-2)


def params(dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dev)) for s in SHAPES]


def grads(like, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in like]


def apart(ours, ref):
    return max(((p.detach() - q.detach()).abs().max() / q.detach().abs().max()).item()
               for p, q in zip(ours, ref))


def run(opt, ps, steps):
    for step in steps:
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()


def test_five_steps_are_torchs_adafactor_within_rounding(device):
    dev = on(device)
    for settings in (SETTINGS, dict(lr=1e-3, maximize=True, d=2.0, eps=(1e-30, 1e-3))):
        ours, ref = params(dev), params(dev)
        a = hopt.Adafactor(ours, **settings)
        b = torch.optim.Adafactor(ref, foreach=False, **settings)
        for step in range(5):
            run(a, ours, [step])
            run(b, ref, [step])
        assert apart(ours, ref) <= 1e-7, (settings, apart(ours, ref))
        for p, q in zip(ours, ref):
            mine, theirs = a.state[p], b.state[q]
            assert set(mine) == set(theirs)
            for key in mine:
                assert mine[key].shape == theirs[key].shape and mine[key].dtype == theirs[key].dtype


def test_state_dicts_load_both_ways_and_continue(device):
    dev = on(device)
    torch_p, ours_p = params(dev), params(dev)
    first = torch.optim.Adafactor(torch_p, foreach=False, **SETTINGS)
    run(first, torch_p, range(3))
    # torch's state into ours: both continue from the same state.
    ours_p = [torch.nn.Parameter(p.detach().clone()) for p in torch_p]
    ours = hopt.Adafactor(ours_p, **SETTINGS)
    ours.load_state_dict(copy.deepcopy(first.state_dict()))  # a state dict shares the tensors
    run(ours, ours_p, range(3, 6))
    run(first, torch_p, range(3, 6))
    assert apart(ours_p, torch_p) <= 1e-7
    assert float(ours.state_dict()["state"][0]["step"]) == 6.0
    # ours into torch.
    back_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    back = torch.optim.Adafactor(back_p, foreach=False, **SETTINGS)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    run(back, back_p, [6])
    run(ours, ours_p, [6])
    assert apart(ours_p, back_p) <= 1e-7


def test_cuda_is_within_four_ulps_of_the_cpu():
    dev = on("cuda")
    cpu_p, gpu_p = params(torch.device("cpu")), params(dev)
    cpu, gpu = hopt.Adafactor(cpu_p, **SETTINGS), hopt.Adafactor(gpu_p, **SETTINGS)
    for step in range(4):
        for p, q, g in zip(cpu_p, gpu_p, grads(cpu_p, step)):
            p.grad, q.grad = g, g.to(dev)
        cpu.step()
        gpu.step()
    torch.cuda.synchronize()
    for p, q in zip(cpu_p, gpu_p):
        q = q.detach().cpu()
        ulps = ((p.detach() - q).abs() / (p.detach().abs().clamp_min(1e-6) * 2**-23)).max()
        assert ulps.item() <= 4.0, ulps.item()


def test_in_backward_gives_the_plain_loops_bits(device):
    dev = on(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    twin.load_state_dict(model.state_dict())
    model, twin = model.to(dev), twin.to(dev)
    plain = hopt.Adafactor(model.parameters(), **SETTINGS)
    inner = ht.optimizer_in_backward(twin, hopt.Adafactor(twin.parameters(), **SETTINGS),
                                     bucket_mb=0.001)
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(dev)
        model(x).square().mean().backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        twin(x).square().mean().backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_misuse_raises(device):
    dev = on(device)
    raises(TypeError, lambda: hopt.Adafactor([torch.nn.Parameter(torch.zeros(8, device=dev,
                                                                               dtype=torch.bfloat16))]),
           "torch.float32")
    ps = params(dev)
    for bad, word in ((dict(lr=-1.0), "Learning rate"), (dict(beta2_decay=0.5), "beta2_decay"),
                      (dict(eps=(None, -1.0)), "epsilon2"), (dict(d=0.5), "Clipping threshold"),
                      (dict(weight_decay=-1.0), "weight_decay")):
        raises(ValueError, lambda bad=bad: hopt.Adafactor(ps, **bad), word)
    opt = hopt.Adafactor(ps)
    for p, g in zip(ps, grads(ps, 0)):
        p.grad = g
    scale = torch.ones(1, device=dev)
    raises(ValueError, lambda: opt.step(grad_scale=scale), "grad_scale")
    opt.step()
    # A state dict whose row moment has another shape (another model's): refused at the next
    # step, before anything is written.
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["row_var"] = torch.zeros(63, 1)
    opt.load_state_dict(saved)
    before = [p.detach().clone() for p in ps]
    raises(ValueError, opt.step, "row_var", "(63, 1)")
    assert all(torch.equal(p.detach(), q) for p, q in zip(ps, before))
    del saved["state"][0]["row_var"]
    opt.load_state_dict(saved)
    raises(ValueError, opt.step, "row_var")

if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
