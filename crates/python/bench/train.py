"""One training run of ViT-L/16 (batch 32, Adam) or GPT-2 small (variable-length batches, AdamW)
under PyTorch's native allocator, its expandable segments, or Headroom's allocator; prints one
JSON line: losses (as float bits), median step ms, peak reserved and allocated bytes.

    python3 train.py --model vit|gpt2 --alloc native|expandable|headroom --steps 200 [--conf S]
"""

import argparse
import json
import os
import struct
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", choices=["vit", "gpt2"], required=True)
parser.add_argument("--alloc", choices=["native", "expandable", "headroom"], required=True)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--conf", default="", help="settings for headroom.cuda.use_allocator (--alloc headroom)")
args = parser.parse_args()

if args.alloc == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

if args.alloc == "headroom":
    import headroom.cuda

    headroom.cuda.use_allocator(args.conf)

# Every op deterministic (PyTorch raises where one has no deterministic kernel), so that two runs
# differ only by their allocator: with warn_only=True, SDPA's memory-efficient backward (the fp32
# attention of both models) keeps its atomic, run-to-run varying order.
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
torch.manual_seed(0)
device = torch.device("cuda", 0)

if args.model == "vit":
    import torchvision

    with device:
        model = torchvision.models.vit_l_16(weights=None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def batch(step):
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(32, 3, 224, 224, device=device, generator=g)
        y = torch.randint(0, 1000, (32,), device=device, generator=g)
        return x, y

    def loss_of(b):
        x, y = b
        return torch.nn.functional.cross_entropy(model(x), y)
else:
    from transformers import GPT2Config, GPT2LMHeadModel

    with device:
        model = GPT2LMHeadModel(GPT2Config())
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def batch(step):
        g = torch.Generator(device=device).manual_seed(step)
        length = int(torch.randint(64, 1025, (1,), generator=torch.Generator().manual_seed(step)))
        return torch.randint(0, 50257, (8, length), device=device, generator=g)

    def loss_of(ids):
        return model(input_ids=ids, labels=ids).loss

losses, times = [], []
for step in range(args.steps):
    b = batch(step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = loss_of(b)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) * 1e3)
    losses.append(struct.unpack("<I", struct.pack("<f", loss.item()))[0])

if args.alloc == "headroom":
    stats = headroom.cuda.memory_stats()
    peak_reserved, peak_alloc = stats["reserved_bytes.all.peak"], stats["allocated_bytes.all.peak"]
    counters = {k: v for k, v in stats.items() if k.startswith("num_")}
else:
    counters = {k: v for k, v in torch.cuda.memory_stats().items() if k.startswith("num_")}
    peak_reserved, peak_alloc = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
timed = sorted(times[3:]) if len(times) > 3 else sorted(times)
print(json.dumps({
    "model": args.model, "alloc": args.alloc, "steps": args.steps,
    "median_step_ms": timed[len(timed) // 2], "mean_step_ms": sum(timed) / len(timed),
    "peak_reserved": peak_reserved, "peak_allocated": peak_alloc, "loss_bits": losses,
    "conf": args.conf, "counters": counters, "times_ms": [round(t, 3) for t in times],
    "last_loss": struct.unpack("<f", struct.pack("<I", losses[-1]))[0],
}))
sys.stdout.flush()
