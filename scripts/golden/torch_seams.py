"""Reference data for the seams and amp work, made with PyTorch on the GPU machine.

Writes, into the folder given as the first argument:
- clip_golden.safetensors: torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on the gradients of
  testdata/optim_golden.safetensors (step 0 and step 3 of parameters a, b, c), on the CPU and on CUDA.
- autocast_dtypes.json: the output dtype of every op Headroom has, under torch.autocast("cuda")
  with float16 and bfloat16, for float32 inputs and for inputs already in the autocast dtype.
Run from the repository root: python3 scripts/golden/torch_seams.py OUTDIR
"""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

out = sys.argv[1]
golden = load_file("testdata/optim_golden.safetensors")
names = ["a", "b", "c"]
tensors = {}
meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
for device in ["cpu", "cuda"]:
    for step in [0, 3]:
        grads = [golden[f"grad.{n}.{step}"].clone().to(device) for n in names]
        for norm_name, norm_type in [("l2", 2.0), ("inf", float("inf"))]:
            params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
            for factor_name, factor in [("clip", 0.25), ("noclip", 4.0)]:
                for p, g in zip(params, grads):
                    p.grad = g.clone()
                max_norm = float(total) * factor
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
                key = f"{device}.step{step}.{norm_name}.{factor_name}"
                tensors[f"{key}.total_norm"] = norm.reshape(1).cpu()
                tensors[f"{key}.max_norm"] = torch.tensor([max_norm], dtype=torch.float64)
                for n, p in zip(names, params):
                    tensors[f"{key}.grad.{n}"] = p.grad.cpu()
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_value_(params, 0.01)
        for n, p in zip(names, params):
            tensors[f"{device}.step{step}.value0.01.grad.{n}"] = p.grad.cpu()
save_file(tensors, f"{out}/clip_golden.safetensors", metadata={k: str(v) for k, v in meta.items()})

# Autocast output dtypes.
dev = "cuda"
def f32(*shape):
    return torch.randn(*shape, device=dev)

ops = {
    "matmul": lambda t: torch.matmul(t(4, 8), t(8, 3)),
    "linear": lambda t: F.linear(t(4, 8), t(3, 8), t(3)),
    "linear_gelu": lambda t: F.gelu(F.linear(t(4, 8), t(3, 8), t(3))),
    "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention(t(2, 2, 5, 8), t(2, 2, 5, 8), t(2, 2, 5, 8)),
    "patch_embedding": lambda t: F.conv2d(t(1, 3, 32, 32), t(8, 3, 16, 16), t(8), stride=16),
    "softmax": lambda t: F.softmax(t(4, 8), -1),
    "log_softmax": lambda t: F.log_softmax(t(4, 8), -1),
    "layer_norm": lambda t: F.layer_norm(t(4, 8), (8,), t(8), t(8)),
    "cross_entropy": lambda t: F.cross_entropy(t(4, 8), torch.tensor([1, 2, 3, 0], device=dev)),
    "sum": lambda t: t(4, 8).sum(),
    "sum_dim": lambda t: t(4, 8).sum(-1),
    "mean": lambda t: t(4, 8).mean(),
    "max_dim": lambda t: t(4, 8).max(-1).values,
    "min_dim": lambda t: t(4, 8).min(-1).values,
    "exp": lambda t: t(4, 8).exp(),
    "log": lambda t: t(4, 8).abs().log(),
    "pow_scalar": lambda t: t(4, 8).pow(2.0),
    "pow": lambda t: t(4, 8).abs().pow(t(4, 8)),
    "sqrt": lambda t: t(4, 8).abs().sqrt(),
    "rsqrt": lambda t: t(4, 8).abs().rsqrt(),
    "tanh": lambda t: t(4, 8).tanh(),
    "relu": lambda t: F.relu(t(4, 8)),
    "gelu": lambda t: F.gelu(t(4, 8)),
    "gelu_tanh": lambda t: F.gelu(t(4, 8), approximate="tanh"),
    "neg": lambda t: -t(4, 8),
    "add": lambda t: t(4, 8) + t(4, 8),
    "sub": lambda t: t(4, 8) - t(4, 8),
    "mul": lambda t: t(4, 8) * t(4, 8),
    "div": lambda t: t(4, 8) / t(4, 8),
    "add_scalar": lambda t: t(4, 8) + 1.5,
    "embedding": lambda t: F.embedding(torch.tensor([1, 2], device=dev), t(10, 8)),
    "dropout": lambda t: F.dropout(t(4, 8), 0.1, training=True),
    "cat": lambda t: torch.cat([t(4, 8), t(4, 8)]),
    "gather": lambda t: t(4, 8).gather(1, torch.zeros(4, 2, dtype=torch.long, device=dev)),
    "scatter_add": lambda t: t(4, 8).scatter_add(1, torch.zeros(4, 2, dtype=torch.long, device=dev), t(4, 2)),
    "masked_fill": lambda t: t(4, 8).masked_fill(torch.zeros(4, 8, dtype=torch.bool, device=dev), 0.0),
    "transpose": lambda t: t(4, 8).t(),
    "reshape": lambda t: t(4, 8).reshape(8, 4),
}
mixed = {
    "cat": lambda lo: torch.cat([f32(4, 8), f32(4, 8).to(lo)]),
    "add": lambda lo: f32(4, 8) + f32(4, 8).to(lo),
    "mul": lambda lo: f32(4, 8) * f32(4, 8).to(lo),
    "matmul": lambda lo: torch.matmul(f32(4, 8), f32(8, 3).to(lo)),
    "linear": lambda lo: F.linear(f32(4, 8).to(lo), f32(3, 8), f32(3)),
    "scatter_add": lambda lo: f32(4, 8).scatter_add(1, torch.zeros(4, 2, dtype=torch.long, device=dev), f32(4, 2).to(lo)),
}
table = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "ops": {}}
for name, op in ops.items():
    row = {}
    for lo_name, lo in [("float16", torch.float16), ("bfloat16", torch.bfloat16)]:
        for input_name, make in [("float32", f32), (lo_name, lambda *s, lo=lo: f32(*s).to(lo))]:
            with torch.autocast("cuda", dtype=lo):
                res = op(make)
            row[f"{lo_name}/{input_name}"] = str(res.dtype).removeprefix("torch.")
        if name in mixed:
            with torch.autocast("cuda", dtype=lo):
                res = mixed[name](lo)
            row[f"{lo_name}/mixed"] = str(res.dtype).removeprefix("torch.")
    table["ops"][name] = row
with open(f"{out}/autocast_dtypes.json", "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
print("wrote", len(tensors), "tensors and", len(table["ops"]), "autocast rows")
