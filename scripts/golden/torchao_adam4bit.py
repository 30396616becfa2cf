"""Reference data for headroom-optim's 4-bit Adam/AdamW (torchao's `Adam4bit`/`AdamW4bit`), made
with torchao on the GPU machine (PyTorch there; torchao travels as a wheel).

Writes OUTDIR/torchao_adam4bit_golden.safetensors:
- `qmap.signed`, `qmap.unsigned` [16] f32: torchao's code tables (`create_dynamic_map(True, 3, 4)`
  for the first moment, `linspace(0, 1, 17)[1:]` for the second).
- The quantiser on its own (`scale_tensor` with blocks of 128, then `quantize_4bit_with_qmap`),
  for each table: `quant.<table>.input` [2048] f32 (random blocks, an all-zero block, values on
  the midpoints between codes, values one f32 ulp either side of them, huge and tiny magnitudes),
  `quant.<table>.codes` [2048] u8 (one code an element), `quant.<table>.packed` [1024] u8 (two
  codes a byte, the even element in the high nibble, as torchao stores them), `quant.<table>.scale`
  [16] f32 and `quant.<table>.dequant` [2048] f32 (`dequant_with_qmap`).
- Training: a parameter `w` [64, 128] (8,192 elements: 4-bit states) and `b` [37] (fewer than
  4,096: f32 states, as torchao and bitsandbytes keep small tensors), `param.<w|b>.0` and five
  gradients `grad.<w|b>.<t>`; for each configuration, after every step t = 1..5,
  `<config>.<w|b>.param.<t>` and the states: for `w` `<config>.w.exp_avg.{packed,scale}.<t>` and
  `<config>.w.exp_avg_sq.{packed,scale}.<t>`, for `b` `<config>.b.exp_avg.<t>` and
  `<config>.b.exp_avg_sq.<t>` (f32).
  `eager_*` configurations call torchao's `single_param_adam` as written, uncompiled, on the CPU
  (the arithmetic a CPU port can match); `cuda_*` run the optimizer class itself on the GPU, its
  step compiled by `torch.compile` as torchao does (what its users get).
The metadata holds the versions, the device and each configuration's hyperparameters as JSON.
Run from the repository root: python3 scripts/golden/torchao_adam4bit.py OUTDIR
"""
import json
import sys

import torch
import torchao
from safetensors.torch import save_file
from torchao.optim import Adam4bit, AdamW4bit
from torchao.optim.adam import single_param_adam
from torchao.optim.quant_utils import dequant_with_qmap, quantize_4bit_with_qmap, scale_tensor
from torchao.optim.subclass_4bit import OptimState4bit, get_qmap_signed, get_qmap_unsigned

BLOCK = 128
out = sys.argv[1]
torch.manual_seed(11)
tensors = {}
qmaps = {
    "signed": torch.tensor(get_qmap_signed(), dtype=torch.float32),
    "unsigned": torch.tensor(get_qmap_unsigned(), dtype=torch.float32),
}


def quantiser_input(qmap, signed):
    """16 blocks of 128: random, zeros, midpoints, ulps either side, extremes."""
    blocks = []
    blocks.append(torch.randn(BLOCK) if signed else torch.rand(BLOCK))
    blocks.append(torch.randn(BLOCK) * 1e-3 if signed else torch.rand(BLOCK) ** 4)
    blocks.append(torch.zeros(BLOCK))
    mids = (qmap[:-1] + qmap[1:]) / 2
    # Midpoints, then one ulp below and above each, in blocks whose largest magnitude is 1 (so
    # the scale is 1 and the scaled values are these exactly).
    for shift in (None, -1, 1):
        values = mids.clone()
        if shift is not None:
            values = torch.nextafter(values, torch.full_like(values, float(shift) * 2.0))
        block = torch.zeros(BLOCK)
        block[: values.numel()] = values
        block[values.numel()] = 1.0
        block[values.numel() + 1 :] = qmap[torch.randint(0, 16, (BLOCK - values.numel() - 1,))]
        blocks.append(block)
    # The same midpoints under a scale that is not 1 (the division rounds first).
    block = torch.zeros(BLOCK)
    block[: mids.numel()] = mids * 3.7
    block[mids.numel()] = 3.7
    blocks.append(block)
    blocks.append((torch.randn(BLOCK) if signed else torch.rand(BLOCK)) * 1e30)
    blocks.append((torch.randn(BLOCK) if signed else torch.rand(BLOCK)) * 1e-30)
    blocks.append(torch.full((BLOCK,), 1e-13))  # below the scale's 1e-12 floor
    while len(blocks) < 16:
        blocks.append(torch.randn(BLOCK) * 0.02 if signed else torch.rand(BLOCK) * 1e-4)
    x = torch.cat(blocks)
    return x if signed else x.abs()


for table, qmap in qmaps.items():
    signed = table == "signed"
    x = quantiser_input(qmap, signed)
    scaled, scale = scale_tensor(x, BLOCK)
    codes = quantize_4bit_with_qmap(scaled, qmap)
    tensors[f"qmap.{table}"] = qmap
    tensors[f"quant.{table}.input"] = x
    tensors[f"quant.{table}.codes"] = codes
    tensors[f"quant.{table}.packed"] = (codes[::2] << 4) | codes[1::2]
    tensors[f"quant.{table}.scale"] = scale
    tensors[f"quant.{table}.dequant"] = dequant_with_qmap(codes, qmap, scale)

steps = 5
params0 = {"w": torch.randn(64, 128) * 0.05, "b": torch.randn(37) * 0.05}
grads = {name: [torch.randn_like(p) * 1e-2 for _ in range(steps)] for name, p in params0.items()}
for name, p in params0.items():
    tensors[f"param.{name}.0"] = p
    for t, g in enumerate(grads[name], 1):
        tensors[f"grad.{name}.{t}"] = g

configs = {
    "adamw": dict(cls="AdamW4bit", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "adam_l2": dict(cls="Adam4bit", lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
}


def record(prefix, name, p, state, t):
    tensors[f"{prefix}.{name}.param.{t}"] = p.detach().float().cpu().clone()
    for key in ("exp_avg", "exp_avg_sq"):
        s = state[key]
        if isinstance(s, OptimState4bit):
            tensors[f"{prefix}.{name}.{key}.packed.{t}"] = s.codes.cpu().clone()
            tensors[f"{prefix}.{name}.{key}.scale.{t}"] = s.scale.cpu().clone()
        else:
            tensors[f"{prefix}.{name}.{key}.{t}"] = s.float().cpu().clone()


meta = {
    "torch": torch.__version__,
    "torchao": torchao.__version__,
    "device": torch.cuda.get_device_name(0),
    "steps": str(steps),
    "block_size": str(BLOCK),
}
for config, cfg in configs.items():
    kwargs = {k: v for k, v in cfg.items() if k != "cls"}
    meta[f"eager_{config}"] = json.dumps(cfg)
    meta[f"cuda_{config}"] = json.dumps(cfg)
    # Eager, on the CPU: torchao's step function uncompiled, states made as its optimizer makes them.
    for name, p0 in params0.items():
        p = p0.clone()
        quantised = p.numel() >= 4096 and p.numel() % BLOCK == 0
        zeros = (lambda signed: OptimState4bit.zeros(p.shape, signed, BLOCK, "cpu")) if quantised else (
            lambda signed: torch.zeros_like(p)
        )
        state = {"step": torch.tensor(0.0), "exp_avg": zeros(True), "exp_avg_sq": zeros(False)}
        lr = torch.tensor(cfg["lr"])
        for t, g in enumerate(grads[name], 1):
            state["step"] += 1
            single_param_adam(
                p, g, state["step"], state["exp_avg"], state["exp_avg_sq"], None, lr,
                cfg["betas"][0], cfg["betas"][1], cfg["weight_decay"], cfg["eps"],
                cfg["cls"] == "AdamW4bit", False,
            )
            record(f"eager_{config}", name, p, state, t)
    # The optimizer class on the GPU, compiled as torchao runs it.
    params = {name: torch.nn.Parameter(p0.clone().cuda()) for name, p0 in params0.items()}
    opt = getattr(torchao.optim, cfg["cls"])(list(params.values()), **kwargs)
    for t in range(1, steps + 1):
        for name, p in params.items():
            p.grad = grads[name][t - 1].cuda()
        opt.step()
        for name, p in params.items():
            record(f"cuda_{config}", name, p, opt.state[p], t)

save_file(tensors, f"{out}/torchao_adam4bit_golden.safetensors", metadata=meta)
print("wrote", f"{out}/torchao_adam4bit_golden.safetensors", meta)
# How far the compiled GPU run is from the eager CPU one (the bound a CPU port can claim against
# what torchao's users get).
for config in configs:
    for name in params0:
        a, b = tensors[f"eager_{config}.{name}.param.{steps}"], tensors[f"cuda_{config}.{name}.param.{steps}"]
        print(f"{config}.{name}: eager CPU vs compiled CUDA after {steps} steps: max |diff| "
              f"{(a - b).abs().max().item():.3e}, equal {torch.equal(a, b)}")
        if name == "w":
            for key in ("exp_avg", "exp_avg_sq"):
                ca = tensors[f"eager_{config}.w.{key}.packed.{steps}"]
                cb = tensors[f"cuda_{config}.w.{key}.packed.{steps}"]
                print(f"  {key} packed codes equal: {torch.equal(ca, cb)} "
                      f"({(ca != cb).sum().item()} of {ca.numel()} bytes differ)")
