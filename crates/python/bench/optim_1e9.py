"""The wheel's optimizers beside their anchors on 1e9 parameters in ten tensors of 1e8, in one
process, each pair on the same recipe: ``AdamWBf16`` (float32 moments, then bfloat16 ones) and
torchao's ``_AdamW(bf16_stochastic_round=True)`` (bfloat16 parameters, moments of the
parameters' dtype, stochastic rounding); ``AdamW4bit`` and torchao's ``AdamW4bit`` (bfloat16
parameters, 4-bit states, stochastic rounding); ``SGD`` with momentum and
``torch.optim.SGD(fused=True)`` (bfloat16 parameters). Per line: the median step over the timed steps (CUDA events), the state's bytes,
the optimizer's extra bytes during a step (peak allocated minus allocated before it), and the
ratio of the anchor's step to ours. One JSON object per line; an anchor that is not importable
(torchao travels as a wheel, see the device README) carries its error.

    python3 optim_1e9.py [--steps 20] [--warmup 3] [--numel 100000000] [--tensors 10] [--only WORD]

``--only WORD`` runs the pairs whose Headroom name holds WORD (for a profiler).
"""

import argparse
import json
import statistics

import torch

import headroom.optim

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--numel", type=int, default=100_000_000)
parser.add_argument("--tensors", type=int, default=10)
parser.add_argument("--only", default="", help="run the pairs whose Headroom name holds this")
args = parser.parse_args()
device = torch.device("cuda", 0)


def measure(name, make):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.numel, device=device, dtype=torch.bfloat16))
              for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt = make(params)
    except Exception as error:  # noqa: BLE001 (an anchor that is not installed)
        return {"impl": name, "error": f"{type(error).__name__}: {error}"}
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(end))
        extra = torch.cuda.max_memory_allocated() - before
    state_bytes = sum(tensor_bytes(t) for s in opt.state.values()
                      for t in s.values() if isinstance(t, torch.Tensor) and t.numel() > 1)
    return {"impl": name, "parameters": args.numel * args.tensors,
            "step_ms": statistics.median(times), "times_ms": times,
            "state_bytes": state_bytes, "step_extra_bytes": extra}


def tensor_bytes(t):
    """The bytes ``t`` holds: a tensor subclass (torchao's 4-bit and 8-bit states) by the inner
    tensors it flattens to, not by its apparent dtype."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def torchao_adamw(params):
    import torchao.optim

    return torchao.optim._AdamW(params, lr=1e-4, bf16_stochastic_round=True)


def torchao_adamw4bit(params):
    import torchao.optim

    return torchao.optim.AdamW4bit(params, lr=1e-4, bf16_stochastic_round=True)


PAIRS = [
    (("headroom_adamw_bf16", lambda ps: headroom.optim.AdamWBf16(ps, lr=1e-4)),
     ("torchao_adamw_bf16_sr", torchao_adamw)),
    (("headroom_adamw_bf16_bf16_state",
      lambda ps: headroom.optim.AdamWBf16(ps, lr=1e-4, state_dtype=torch.bfloat16)),
     ("torchao_adamw_bf16_sr", torchao_adamw)),
    (("headroom_adamw4bit_bf16",
      lambda ps: headroom.optim.AdamW4bit(ps, lr=1e-4, bf16_stochastic_round=True)),
     ("torchao_adamw4bit_bf16_sr", torchao_adamw4bit)),
    (("headroom_sgd_momentum_bf16", lambda ps: headroom.optim.SGD(ps, lr=1e-3, momentum=0.9)),
     ("torch_sgd_fused_momentum_bf16",
      lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True))),
]
for (ours_name, ours_make), (anchor_name, anchor_make) in PAIRS:
    if args.only not in ours_name:
        continue
    ours, anchor = measure(ours_name, ours_make), measure(anchor_name, anchor_make)
    if "step_ms" in ours and "step_ms" in anchor:
        anchor["ratio_to_headroom"] = anchor["step_ms"] / ours["step_ms"]
    for row in (ours, anchor):
        row["torch"] = torch.__version__
        print(json.dumps(row), flush=True)
