"""``headroom.optim.AdamWBf16`` and ``AdamBf16``: bfloat16 parameters, float32 moments, stochastic
rounding, on the CPU (the host kernel through the extension: no stand-in) and on CUDA.

What holds: the moments are float32 Adam's (the first step's are ``(1 - beta1) g`` and
``(1 - beta2) g^2`` to the bit); the new parameter is one of the two bfloat16 neighbours of the
float32 update, the lower one taken with the probability its distance says, so that where
rounding to nearest would lose every update (smaller than half a bfloat16 step) the parameters
still move by the update on average; a seed gives the same bits twice and another seed other
bits; a state dict continues a run bit for bit; CUDA gives the CPU's bits; misuse raises. With
``state_dtype=torch.bfloat16`` (torchao's layout) each stored moment is the float32 moment rounded
once and the parameter the float32-moment optimizer's, bit for bit.

Run: ``python3 -m pytest crates/python/python/tests/test_bf16_optim.py`` (or ``python3`` on this
file). The ``cuda`` cases need a GPU (skipped without one; under ``HEADROOM_REQUIRE_GPU=1`` a
failure instead).
"""

import sys

from torch_gate import device_cases, main, on_device as on, torch

if torch is not None:
    import headroom.optim as hopt
    from optim_rigs import set_grad_any_dtype
    from test_saved_activations import raises

N = 1 << 16


def bf16_param(dev, seed=0, n=N, value=None):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) if value is None else torch.full((n,), value)
    return torch.nn.Parameter(t.to(device=dev, dtype=torch.bfloat16))


def bf16_grad(dev, like, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(like.shape, generator=g).to(device=dev, dtype=torch.bfloat16)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def test_first_step_moments_are_float32_adams(device):
    dev = on(device)
    p = bf16_param(dev)
    opt = hopt.AdamWBf16([p], lr=1e-3, betas=(0.9, 0.999))
    p.grad = bf16_grad(dev, p, 0)
    opt.step()
    sync(dev)
    state = opt.state[p]
    g = p.grad.float()
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == p.shape
    assert torch.equal(state["exp_avg"], g * torch.tensor(1 - 0.9, dtype=torch.float32))
    # (1 - beta2) g^2 in one order or another of two float32 products: within one rounding.
    torch.testing.assert_close(state["exp_avg_sq"], (g * g) * (1 - 0.999), rtol=2**-23, atol=0)
    assert float(opt.state_dict()["state"][0]["step"]) == 1.0


def test_each_parameter_lands_on_a_neighbour_of_the_update_unbiased(device):
    dev = on(device)
    # Every parameter 1.0 (a bf16 step of 2^-7 above it): the first AdamW step moves each by
    # -lr * sign(g) (and the decay -lr * wd), far below half a step, so rounding to nearest
    # would keep 1.0 everywhere.
    lr, wd = 1e-4, 0.0
    p = bf16_param(dev, value=1.0)
    p.grad = bf16_grad(dev, p, 1)
    exact = 1.0 - lr * torch.sign(p.grad.float())  # float32 update of step 1
    opt = hopt.AdamWBf16([p], lr=lr, weight_decay=wd)
    opt.step()
    sync(dev)
    new = p.detach().float()
    below = torch.tensor(1.0 - 2**-8, device=dev)  # the bf16 neighbour below 1.0
    above = torch.tensor(1.0 + 2**-7, device=dev)
    lower = torch.where(exact < 1.0, below.expand_as(exact), torch.ones_like(exact))
    upper = torch.where(exact < 1.0, torch.ones_like(exact), above.expand_as(exact))
    assert torch.all((new == lower) | (new == upper)), "a value off the update's neighbours"
    moved = (new != 1.0).float().mean().item()
    assert 0 < moved < 0.05, moved  # about lr / step of the parameters move
    # The mean change is the update's mean (-lr * mean sign), within sampling error.
    mean_change = (new - 1.0).mean().item()
    expected = (exact - 1.0).mean().item()
    spread = (2**-8) * (moved / N) ** 0.5 * 4  # a few standard errors of the draws
    assert abs(mean_change - expected) <= spread + 1e-7, (mean_change, expected)
    per_sign = ((new - 1.0) * -torch.sign(p.grad.float())).mean().item()
    assert abs(per_sign / lr - 1) <= 0.15, per_sign


def train(dev, seed, steps, opt_seed=0, state=None, state_dtype=torch.float32 if torch else None):
    p = bf16_param(dev, seed)
    q = bf16_param(dev, seed + 1, n=300)  # under a block, another slot
    opt = hopt.AdamWBf16([p, q], lr=1e-2, seed=opt_seed, state_dtype=state_dtype)
    if state is not None:
        opt.load_state_dict(state)
    for step in range(steps):
        p.grad, q.grad = bf16_grad(dev, p, step), bf16_grad(dev, q, 100 + step)
        opt.step()
    sync(dev)
    return p.detach().clone(), q.detach().clone(), opt


def test_a_seed_gives_the_same_bits_and_another_other_bits(device):
    dev = on(device)
    a = train(dev, 0, 3)
    b = train(dev, 0, 3)
    c = train(dev, 0, 3, opt_seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_a_state_dict_continues_the_run_bit_for_bit(device):
    dev = on(device)
    whole = train(dev, 0, 5)
    p = bf16_param(dev, 0)
    q = bf16_param(dev, 1, n=300)
    opt = hopt.AdamWBf16([p, q], lr=1e-2)
    for step in range(2):
        p.grad, q.grad = bf16_grad(dev, p, step), bf16_grad(dev, q, 100 + step)
        opt.step()
    saved = opt.state_dict()
    assert float(saved["state"][0]["step"]) == 2.0
    resumed = hopt.AdamWBf16([p, q], lr=1e-2)
    resumed.load_state_dict(saved)
    for step in range(2, 5):
        p.grad, q.grad = bf16_grad(dev, p, step), bf16_grad(dev, q, 100 + step)
        resumed.step()
    sync(dev)
    assert torch.equal(p.detach(), whole[0]) and torch.equal(q.detach(), whole[1])


def test_cuda_gives_the_cpus_bits():
    dev = on("cuda")
    for state_dtype in (torch.float32, torch.bfloat16):
        cpu = train(torch.device("cpu"), 0, 4, state_dtype=state_dtype)
        gpu = train(dev, 0, 4, state_dtype=state_dtype)
        assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu()), state_dtype
        for key in ("exp_avg", "exp_avg_sq"):
            for a, b in zip(cpu[2].state.values(), gpu[2].state.values()):
                assert b[key].dtype == state_dtype
                assert torch.equal(a[key], b[key].cpu()), (state_dtype, key)


def test_bf16_moments_are_the_float32_moments_rounded_once(device):
    # torchao's _AdamW layout (8 bytes a parameter with its gradient): the update reads the new
    # float32 moments, which are stored rounded to nearest-even. So from the same state the new
    # parameter is the float32-moment optimizer's to the bit, and each moment is its moment
    # rounded once.
    dev = on(device)
    wide_p, half_p = bf16_param(dev, 3), bf16_param(dev, 3)
    wide = hopt.AdamWBf16([wide_p], lr=1e-2, seed=5)
    half = hopt.AdamWBf16([half_p], lr=1e-2, seed=5, state_dtype=torch.bfloat16)
    for step in range(3):
        wide_p.grad = half_p.grad = bf16_grad(dev, half_p, step)
        if step > 0:  # the float32 optimizer starts from the bf16 one's state
            wide_p.data.copy_(half_p.detach())
            for key in ("exp_avg", "exp_avg_sq"):
                wide.state[wide_p][key].copy_(half.state[half_p][key])
        wide.step()
        half.step()
        sync(dev)
        assert torch.equal(wide_p.detach(), half_p.detach()), step
        for key in ("exp_avg", "exp_avg_sq"):
            got = half.state[half_p][key]
            assert got.dtype == torch.bfloat16 and got.shape == half_p.shape
            assert torch.equal(got, wide.state[wide_p][key].to(torch.bfloat16)), (step, key)
    state_bytes = sum(t.numel() * t.element_size() for k, t in half.state[half_p].items()
                      if k != "step")
    assert state_bytes == 4 * half_p.numel()
    # A state dict of bf16 moments continues the run bit for bit.
    resumed_p = torch.nn.Parameter(half_p.detach().clone())
    resumed = hopt.AdamWBf16([resumed_p], lr=1e-2, seed=5, state_dtype=torch.bfloat16)
    resumed.load_state_dict(half.state_dict())
    half_p.grad = resumed_p.grad = bf16_grad(dev, half_p, 9)
    half.step()
    resumed.step()
    sync(dev)
    assert torch.equal(half_p.detach(), resumed_p.detach())


def test_adam_with_l2_decay_and_amsgrad_steps(device):
    dev = on(device)
    p = bf16_param(dev)
    opt = hopt.AdamBf16([p], lr=1e-2, weight_decay=0.1, amsgrad=True)
    before = p.detach().clone()
    for step in range(3):
        p.grad = bf16_grad(dev, p, step)
        opt.step()
    sync(dev)
    assert opt.state[p]["max_exp_avg_sq"].dtype == torch.float32
    assert not torch.equal(p.detach(), before)
    assert torch.isfinite(p.detach().float()).all()


def test_misuse_raises(device):
    dev = on(device)
    f32 = torch.nn.Parameter(torch.zeros(8, device=dev))
    raises(TypeError, lambda: hopt.AdamWBf16([f32]), "torch.bfloat16")
    p = bf16_param(dev, n=64)
    opt = hopt.AdamWBf16([p])
    set_grad_any_dtype(p, torch.zeros(64, device=dev, dtype=torch.float32))
    raises(TypeError, opt.step, "gradients of the parameter's dtype")
    p.grad = None
    raises(ValueError, lambda: hopt.AdamWBf16([p], seed=-1), "seed=-1")
    raises(ValueError, lambda: hopt.AdamWBf16([p], state_dtype=torch.float16), "state_dtype")
    # float32 moments where the optimizer keeps bfloat16 ones.
    opt = hopt.AdamWBf16([p], state_dtype=torch.bfloat16)
    opt.state[p] = {"step": torch.tensor(0.0),
                    "exp_avg": torch.zeros(64, device=dev, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros(64, device=dev, dtype=torch.float32)}
    p.grad = torch.zeros(64, device=dev, dtype=torch.bfloat16)
    raises(TypeError, opt.step, "exp_avg", "torch.bfloat16")
    p.grad = None
    # A state of bfloat16 moments (as torch's own AdamW keeps for bfloat16 parameters).
    opt = hopt.AdamWBf16([p])
    opt.state[p] = {"step": torch.tensor(0.0),
                    "exp_avg": torch.zeros(64, device=dev, dtype=torch.bfloat16),
                    "exp_avg_sq": torch.zeros(64, device=dev, dtype=torch.float32)}
    p.grad = torch.zeros(64, device=dev, dtype=torch.bfloat16)
    raises(TypeError, opt.step, "exp_avg", "torch.float32")
    if dev.type == "cpu":
        opt = hopt.AdamWBf16([p])
        scale = torch.ones(1)
        raises(ValueError, lambda: opt.step(grad_scale=scale, found_inf=torch.zeros(1)),
               "CUDA")



def test_in_backward_gives_the_plain_loops_bits(device):
    """Stepped inside backward in buckets of 1 KiB (``headroom.torch.optimizer_in_backward``),
    each parameter draws from its own stream: the plain loop's bits."""
    import headroom.torch as ht

    dev = on(device)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                   torch.nn.Linear(128, 8)).to(dev, torch.bfloat16)

    plain, inner = model(), model()
    ours = ht.optimizer_in_backward(inner, hopt.AdamWBf16(inner.parameters(), lr=1e-2),
                                    bucket_mb=1 / 1024)
    reference = hopt.AdamWBf16(plain.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(16, 64, generator=g).to(dev, torch.bfloat16)
        plain(x).float().square().mean().backward()
        reference.step()
        reference.zero_grad(set_to_none=True)
        inner(x).float().square().mean().backward()
        ours.step()
        ours.zero_grad(set_to_none=True)
    sync(dev)
    for a, b in zip(inner.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    ours.remove()


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
