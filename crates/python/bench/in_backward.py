"""``headroom.torch.optimizer_in_backward`` on torchvision's ViT-L/16 (f32) against the standard
step and PyTorch's tutorial version of stepping in backward, in one process.

Four variants, each from the same initial weights on the same batches:

- ``torch_fused``: ``loss.backward(); torch.optim.AdamW(fused=True).step(); zero_grad()``;
- ``torch_tutorial_inbwd``: the tutorial "How to save memory by fusing the optimizer step into
  the backward pass": one ``torch.optim.AdamW(foreach=False)`` per parameter, stepped and
  zeroed from its post-accumulate-grad hook;
- ``headroom_fused``: ``headroom.optim.AdamW``'s standard step;
- ``headroom_inbwd``: the same optimizer through ``optimizer_in_backward`` (25 MiB buckets).

Per variant: the median step (forward, backward, step, synchronised) over the timed steps, the
peak allocated bytes of a step from a settled state (``max_memory_allocated`` after
``reset_peak_memory_stats``; the initial weights and the reference parameters wait in host
memory, so the device holds the variant's model, optimizer and batches alone), and whether its
parameters after every step equal ``headroom_fused``'s bit for bit. Attention's fused backward
kernels accumulate with atomics, so two runs of one variant may differ in the last bits: a last
line (``"check"``) runs ``headroom_fused`` and ``headroom_inbwd`` again with deterministic
kernels (math attention, ``torch.use_deterministic_algorithms``) and compares their parameters
after ``--steps`` steps, the equality the issue asks for. One JSON object per line.

    python3 in_backward.py --batch 1 [--steps 20] [--warmup 3]
"""

import argparse
import copy
import gc
import json
import statistics
import time

import torch
import torchvision

import headroom.optim
import headroom.torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--steps", type=int, default=20, help="steps in all (the first --warmup untimed)")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--variants", default="torch_fused,torch_tutorial_inbwd,headroom_fused,headroom_inbwd")
args = parser.parse_args()

device = torch.device("cuda", 0)
LR = 1e-4
torch.manual_seed(0)
with device:
    base = torchvision.models.vit_l_16(weights=None)
# torchvision initialises the head to zero, which leaves every other parameter without a
# gradient at the first step: a small random head makes every tensor move.
torch.nn.init.normal_(base.heads.head.weight, std=0.02)
base = base.cpu()
base_state = copy.deepcopy(base.state_dict())
g = torch.Generator(device="cpu").manual_seed(1)
batches = [
    (torch.randn(args.batch, 3, 224, 224, generator=g), torch.randint(0, 1000, (args.batch,), generator=g))
    for _ in range(4)
]
batches = [(x.to(device), y.to(device)) for x, y in batches]


def standard(opt):
    def step(model, x, y):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# The tutorial's hook handles: its hooks and per-parameter optimizers hold each other through
# the parameters' C++ side, a cycle Python's collector cannot see, so the variant's model and
# state (3.65 GB at ViT-L/16) outlive it unless the hooks are removed (measured on the H200: the
# variants after it started 3.65 GB higher, gc.collect() or not).
HOOKS = []


def release_hooks():
    for handle in HOOKS:
        handle.remove()
    HOOKS.clear()


def build(variant, model):
    params = list(model.parameters())
    if variant == "torch_fused":
        return standard(torch.optim.AdamW(params, lr=LR, fused=True))
    if variant == "headroom_fused":
        return standard(headroom.optim.AdamW(params, lr=LR))
    if variant == "headroom_inbwd":
        ib = headroom.torch.optimizer_in_backward(model, headroom.optim.AdamW(params, lr=LR))
        return standard(ib)
    if variant == "torch_tutorial_inbwd":
        per_param = {p: torch.optim.AdamW([p], lr=LR, foreach=False) for p in params}

        def hook(p):
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in params:
            HOOKS.append(p.register_post_accumulate_grad_hook(hook))

        def step(model, x, y):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        return step
    raise SystemExit(f"unknown variant {variant}")


def fresh_model():
    model = copy.deepcopy(base)
    model.load_state_dict(base_state)
    return model.to(device)


reference = None
for variant in args.variants.split(","):
    # The tutorial's hooks and per-parameter optimizers hold each other in a cycle: collected,
    # the previous variant's parameters and state leave the device before this one starts.
    gc.collect()
    torch.cuda.empty_cache()
    model = fresh_model()
    step = build(variant, model)
    times = []
    peak = None
    for i in range(args.steps):
        x, y = batches[i % len(batches)]
        if i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start_alloc = torch.cuda.memory_allocated()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, x, y)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated()
    params = [p.detach().cpu() for p in model.parameters()]
    if variant == "headroom_fused":
        reference = params
    equal = None if reference is None else all(torch.equal(a, b) for a, b in zip(reference, params))
    print(json.dumps({
        "model": "vit_l_16", "dtype": "float32", "batch": args.batch, "variant": variant,
        "steps": args.steps, "timed_steps": len(times),
        "step_ms_median": statistics.median(times), "step_ms_min": min(times),
        "peak_allocated_bytes": peak, "settled_allocated_bytes": start_alloc,
        "params_equal_headroom_fused": equal,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
    }), flush=True)
    del model, step, params
    release_hooks()


# The equality check with deterministic kernels.
torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)
torch.backends.cuda.enable_cudnn_sdp(False)
torch.use_deterministic_algorithms(True, warn_only=True)
finals = {}
for variant in ("headroom_fused", "headroom_inbwd"):
    gc.collect()
    torch.cuda.empty_cache()
    model = fresh_model()
    step = build(variant, model)
    for i in range(args.steps):
        x, y = batches[i % len(batches)]
        step(model, x, y)
    torch.cuda.synchronize()
    finals[variant] = [p.detach().cpu() for p in model.parameters()]
    del model, step
equal = all(torch.equal(a, b) for a, b in zip(finals["headroom_fused"], finals["headroom_inbwd"]))
print(json.dumps({
    "model": "vit_l_16", "dtype": "float32", "batch": args.batch, "check": "deterministic",
    "steps": args.steps, "params_equal_inbwd_fused": equal, "torch": torch.__version__,
    "gpu": torch.cuda.get_device_name(device),
}), flush=True)
