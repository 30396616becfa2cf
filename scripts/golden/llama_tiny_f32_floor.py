"""How close float32 arithmetic comes to the tiny Llama and Qwen2 golden: Hugging Face's own
LlamaForCausalLM and Qwen2ForCausalLM run in float32 from the golden's parameters and batch
(`testdata/llama_golden.safetensors`, written in float64 by `scripts/golden/llama_tiny.py`), with
the errors our tests use (`max |ours - theirs| / max |theirs|` per tensor: logits, loss, and the
worst parameter gradient). It measures the floor issue 30's 1e-6 float32 bound sits against:
what PyTorch's float32 reaches on the same reference, on any machine with torch 2.11 and
transformers 5.17 (CPU).

Run from the repository root: python3 scripts/golden/llama_tiny_f32_floor.py
"""
import json
import platform
import sys

import torch
import transformers
from safetensors.torch import load_file

# The golden script's model builders, without its writing step.
source = open("scripts/golden/llama_tiny.py").read().split("\ntensors, meta = {}")[0]
builders = {}
sys.argv = [sys.argv[0], "unused"]
exec(compile(source, "scripts/golden/llama_tiny.py", "exec"), builders)

golden = load_file("testdata/llama_golden.safetensors")


def relative(ours, theirs):
    ours, theirs = ours.double(), theirs.double()
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


rows = []
for seed, prefix in enumerate(["llama", "qwen2"]):
    _, model = builders["build"](prefix, seed)
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(golden[f"{prefix}.param.{name}"].to(torch.float32))
    ids = golden[f"{prefix}.input_ids"]
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    worst = max((relative(p.grad, golden[f"{prefix}.grad.{n}"]), n) for n, p in model.named_parameters())
    rows.append(
        dict(
            model=prefix,
            dtype="float32",
            logits=relative(output.logits, golden[f"{prefix}.logits"]),
            loss=relative(output.loss.reshape(1), golden[f"{prefix}.loss"]),
            worst_gradient=worst[0],
            worst_gradient_name=worst[1],
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            machine=platform.processor() or platform.machine(),
        )
    )
for row in rows:
    print(json.dumps(row))
