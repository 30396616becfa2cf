"""``headroom.optim.AdamW4bit`` and ``Adam4bit`` against torchao 0.18's own steps, recorded in
``testdata/torchao_adam4bit_golden.safetensors`` (see testdata/README.md): five steps on a
[64, 128] parameter (4-bit states) and a [37] one (f32 states), for ``AdamW4bit`` (lr 1e-3,
weight decay 1e-2) and ``Adam4bit`` (lr 3e-3, betas (0.8, 0.99), eps 1e-6, L2 decay 0.1).
On the CPU (the host kernel through the extension) and on CUDA: the packed codes and scales of
``w`` and the f32 states of ``b`` equal torchao's eager run bit for bit at every step, ``b`` too,
and ``w`` within 1e-8 (PyTorch's CPU square root is not correctly rounded everywhere, as the
Rust golden test says); the state has the promised layout and bytes; a state dict continues the
run bit for bit; bf16 parameters with stochastic rounding step; misuse raises.

Run: ``python3 -m pytest crates/python/python/tests/test_adam4bit.py`` (or ``python3`` on this
file; it needs the ``safetensors`` package). The ``cuda`` cases need a GPU.
"""

import os
import sys

from torch_gate import device_cases, main, on_device as on, skip, torch

if torch is not None:
    import headroom.optim as hopt
    from test_saved_activations import raises

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..",
                      "testdata", "torchao_adam4bit_golden.safetensors")
CONFIGS = {
    "adamw": (hopt.AdamW4bit if torch is not None else None,
              dict(lr=1e-3, weight_decay=1e-2)),
    "adam_l2": (hopt.Adam4bit if torch is not None else None,
                dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
}


def golden():
    try:
        from safetensors.torch import load_file
    except ImportError:
        skip("the safetensors package is not installed")
    return load_file(GOLDEN)


def run(dev, tag, data, steps=5, state=None, start=0, params=None):
    cls, kw = CONFIGS[tag]
    if params is None:
        params = [torch.nn.Parameter(data[f"param.{p}.0"].to(dev, copy=True)) for p in ("w", "b")]
    opt = cls(params, **kw)
    if state is not None:
        opt.load_state_dict(state)
    for t in range(start + 1, start + steps + 1):
        for name, p in zip(("w", "b"), params):
            p.grad = data[f"grad.{name}.{t}"].to(dev)
        opt.step()
    return params, opt


def test_five_steps_equal_torchaos(device):
    dev = on(device)
    data = golden()
    for tag in CONFIGS:
        cls, kw = CONFIGS[tag]
        w, b = (torch.nn.Parameter(data[f"param.{p}.0"].to(dev, copy=True)) for p in ("w", "b"))
        opt = cls([w, b], **kw)
        for t in range(1, 6):
            w.grad, b.grad = data[f"grad.w.{t}"].to(dev), data[f"grad.b.{t}"].to(dev)
            opt.step()
            ref = f"eager_{tag}"
            sw, sb = opt.state[w], opt.state[b]
            for mine, theirs in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
                assert torch.equal(sw[mine].cpu(), data[f"{ref}.w.{theirs}.packed.{t}"]), (tag, t)
                absmax = "absmax" + mine[-1]
                assert torch.equal(sw[absmax].cpu(), data[f"{ref}.w.{theirs}.scale.{t}"]), (tag, t)
                assert torch.equal(sb[mine].cpu(), data[f"{ref}.b.{theirs}.{t}"]), (tag, t)
            assert torch.equal(b.detach().cpu(), data[f"{ref}.b.param.{t}"]), (tag, t)
            worst = (w.detach().cpu() - data[f"{ref}.w.param.{t}"]).abs().max().item()
            assert worst <= 1e-8, (tag, t, worst)


def test_the_state_is_torchaos_layout(device):
    dev = on(device)
    data = golden()
    (w, b), opt = run(dev, "adamw", data, steps=1)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in opt.state[w].items() if k != "step"} == {
        "state1": (torch.uint8, (4096,)), "state2": (torch.uint8, (4096,)),
        "absmax1": (torch.float32, (64,)), "absmax2": (torch.float32, (64,)),
    }
    state_bytes = sum(t.numel() * t.element_size() for k, t in opt.state[w].items() if k != "step")
    assert state_bytes == 8192 + 8 * 64  # 1.0625 bytes a parameter
    assert opt.state[b]["state1"].dtype == torch.float32 and "absmax1" not in opt.state[b]


def test_a_state_dict_continues_the_run_bit_for_bit(device):
    dev = on(device)
    data = golden()
    whole, _ = run(dev, "adamw", data, steps=5)
    params, first = run(dev, "adamw", data, steps=2)
    saved = first.state_dict()
    resumed, _ = run(dev, "adamw", data, steps=3, state=saved, start=2, params=params)
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole))


def test_bf16_parameters_round_stochastically_and_reproducibly(device):
    dev = on(device)

    def trained(seed):
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 128, generator=g).to(dev, torch.bfloat16))
        opt = hopt.AdamW4bit([p], lr=1e-4, bf16_stochastic_round=True, seed=seed)
        for _ in range(3):
            p.grad = torch.randn(64, 128, generator=g).to(dev, torch.bfloat16)
            opt.step()
        return p.detach().clone()

    a, b, c = trained(0), trained(0), trained(1)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_misuse_raises(device):
    dev = on(device)
    half = torch.nn.Parameter(torch.zeros(4096, device=dev, dtype=torch.float16))
    raises(TypeError, lambda: hopt.AdamW4bit([half]), "torch.float16")
    mixed = [torch.nn.Parameter(torch.zeros(4096, device=dev)),
             torch.nn.Parameter(torch.zeros(4096, device=dev, dtype=torch.bfloat16))]
    opt = hopt.AdamW4bit(mixed)
    for p in mixed:
        p.grad = torch.zeros_like(p)
    raises(ValueError, opt.step, "mixes dtypes")
    p = torch.nn.Parameter(torch.zeros(4096, device=dev))
    opt = hopt.AdamW4bit([p])
    opt.state[p] = {"step": torch.tensor(0.0),
                    "state1": torch.zeros(4096, dtype=torch.uint8, device=dev),  # not 2048
                    "state2": torch.zeros(2048, dtype=torch.uint8, device=dev),
                    "absmax1": torch.zeros(32, device=dev), "absmax2": torch.zeros(32, device=dev)}
    p.grad = torch.zeros_like(p)
    raises(ValueError, opt.step, "state1")


if __name__ == "__main__":
    sys.exit(main(__file__, lambda: device_cases(globals())))
