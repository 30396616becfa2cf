"""Reference data for headroom-optim's `FusedAdamMath::Torch` (the arithmetic of PyTorch's own
fused Adam kernel), made with PyTorch on the GPU machine.

Writes OUTDIR/torch_fused_adam_golden.safetensors: one parameter of 1,027 elements (`param.0`,
not a multiple of four, so the kernel's scalar tail runs too) and 20 gradients (`grad.1` ..
`grad.20`), and the parameter after 20 steps of `torch.optim.Adam/AdamW(fused=True)` in each
configuration below (`<config>.param.20`, with its `exp_avg`, `exp_avg_sq` and for AMSGrad
`max_exp_avg_sq`). The metadata holds each configuration's hyperparameters as JSON.
Run from the repository root: python3 scripts/golden/torch_fused_adam.py OUTDIR
"""
import json
import sys

import torch
from safetensors.torch import save_file

out = sys.argv[1]
torch.manual_seed(7)
n, steps = 1027, 20
param0 = torch.randn(n) * 0.05
grads = [torch.randn(n) * 1e-2 for _ in range(steps)]
configs = {
    "adamw": dict(cls="AdamW", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "adam_l2": dict(cls="Adam", lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "adamw_amsgrad": dict(cls="AdamW", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=True),
    "adam_maximize": dict(cls="Adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=True),
}
tensors = {"param.0": param0}
for t, g in enumerate(grads, 1):
    tensors[f"grad.{t}"] = g
meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "steps": str(steps)}
for name, cfg in configs.items():
    kwargs = {k: v for k, v in cfg.items() if k != "cls"}
    p = torch.nn.Parameter(param0.clone().cuda())
    opt = getattr(torch.optim, cfg["cls"])([p], fused=True, **kwargs)
    for g in grads:
        p.grad = g.cuda()
        opt.step()
    tensors[f"{name}.param.20"] = p.detach().cpu()
    for key, value in opt.state[p].items():
        if key != "step":
            tensors[f"{name}.{key}.20"] = value.cpu()
    meta[name] = json.dumps(cfg)
save_file(tensors, f"{out}/torch_fused_adam_golden.safetensors", metadata=meta)
print("wrote", f"{out}/torch_fused_adam_golden.safetensors", meta)
