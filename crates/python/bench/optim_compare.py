"""headroom.optim against bitsandbytes' Adam8bit and torch's fused AdamW on ViT-L/16's
parameters (the head initialised at random, so that every tensor has a gradient) with the
gradients of one batch-1 step: fused AdamW, Adam with L2 decay and AMSGrad; 8-bit Adam in both
arithmetics. State bytes, the optimizer step timed alone (median of synchronised steps),
parameters after 20 steps (bitwise and in ulps), and state-dict interop both ways. Prints one
JSON object per comparison.

    python3 optim_compare.py [--steps 20]
"""

import argparse
import copy
import json
import time

import torch
import torchvision

import headroom.optim

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

device = torch.device("cuda", 0)
torch.manual_seed(0)
with device:
    base = torchvision.models.vit_l_16(weights=None)
# torchvision initialises the head to zero, which leaves every other parameter without a
# gradient at the first step: a small random head makes every tensor move.
torch.nn.init.normal_(base.heads.head.weight, std=0.02)
x = torch.randn(1, 3, 224, 224, device=device)
torch.nn.functional.cross_entropy(base(x), torch.tensor([3], device=device)).backward()
grads = [p.grad.detach().clone() for p in base.parameters()]
base.zero_grad(set_to_none=True)
print(json.dumps({"case": "gradients", "tensors": len(grads),
                  "tensors_with_nonzero_gradient": sum(int(bool(g.any())) for g in grads)}), flush=True)


def fresh():
    model = copy.deepcopy(base)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    return model


def run(make, steps=args.steps):
    model = fresh()
    opt = make(list(model.parameters()))
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    timed = sorted(times[3:])
    return model, opt, timed[len(timed) // 2]


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
               if isinstance(v, torch.Tensor) and k != "step")


def ulps(a, b):
    ia = a.view(torch.int32).to(torch.int64)
    ib = b.view(torch.int32).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max())


def compare(m1, m2):
    named = list(m1.named_parameters())
    ps1, ps2 = [p for _, p in named], list(m2.parameters())
    equal = sum(int(torch.equal(a, b)) for a, b in zip(ps1, ps2))
    return {
        "differing_tensors": [n for (n, a), b in zip(named, ps2) if not torch.equal(a, b)][:8],
        "tensors_bitwise_equal": f"{equal}/{len(ps1)}",
        "elements_differing": int(sum(int((a != b).sum()) for a, b in zip(ps1, ps2))),
        "max_abs_diff": float(max(float((a - b).abs().max().detach()) for a, b in zip(ps1, ps2))),
        "max_ulps": max(ulps(a, b) for a, b in zip(ps1, ps2)),
    }


# Fused AdamW against torch's fused AdamW.
torch_model, _, torch_ms = run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2, fused=True))
ours_model, ours_opt, ours_ms = run(lambda ps: headroom.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2))
print(json.dumps({"case": "adamw_fused", "torch_ms": torch_ms, "headroom_ms": ours_ms,
                  "ratio": ours_ms / torch_ms, **compare(torch_model, ours_model)}), flush=True)
del torch_model, ours_model
# Adam with L2 weight decay, and AMSGrad, against torch's fused kernel.
for case, kwargs in (("adam_l2_fused", dict(weight_decay=1e-2)), ("adamw_amsgrad_fused", dict(amsgrad=True))):
    cls = torch.optim.Adam if case.startswith("adam_l2") else torch.optim.AdamW
    ours_cls = headroom.optim.Adam if case.startswith("adam_l2") else headroom.optim.AdamW
    torch_model, _, torch_ms = run(lambda ps: cls(ps, lr=1e-3, fused=True, **kwargs))
    ours_model, _, ours_ms = run(lambda ps: ours_cls(ps, lr=1e-3, **kwargs))
    print(json.dumps({"case": case, "torch_ms": torch_ms, "headroom_ms": ours_ms,
                      "ratio": ours_ms / torch_ms, **compare(torch_model, ours_model)}), flush=True)
    del torch_model, ours_model
sd = ours_opt.state_dict()
reload = torch.optim.AdamW(list(fresh().parameters()), lr=1e-3, fused=True)
reload.load_state_dict(sd)
print(json.dumps({"case": "adamw_state_dict_into_torch", "ok": True,
                  "state_keys": sorted(sd["state"][0].keys()), "step": float(sd["state"][0]["step"])}), flush=True)
del ours_opt, reload, sd

try:
    import bitsandbytes as bnb
except Exception as error:  # noqa: BLE001
    print(json.dumps({"case": "adam8bit", "error": f"bitsandbytes: {error}"}), flush=True)
    raise SystemExit(0)

bnb_model, bnb_opt, bnb_ms = run(lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3))
bnb_model2, _, bnb_ms2 = run(lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3))
exact_model, _, exact_ms = run(lambda ps: headroom.optim.Adam8bit(ps, lr=1e-3, bitsandbytes_arithmetic=True))
ours_model, ours_opt, ours_ms = run(lambda ps: headroom.optim.Adam8bit(ps, lr=1e-3))
print(json.dumps({
    "case": "adam8bit", "bnb_version": bnb.__version__, "bnb_ms": bnb_ms, "bnb_ms_rerun": bnb_ms2,
    "headroom_ms": ours_ms, "speedup": bnb_ms / ours_ms,
    "headroom_bitsandbytes_arithmetic_ms": exact_ms,
    "bnb_state_bytes": state_bytes(bnb_opt), "headroom_state_bytes": state_bytes(ours_opt),
    "vs_bnb": compare(bnb_model, ours_model),
    "bitsandbytes_arithmetic_vs_bnb": compare(bnb_model, exact_model),
    "bnb_run_to_run": compare(bnb_model, bnb_model2),
}), flush=True)
del exact_model

# State dicts both ways: load the other's state after 20 steps, step once more, compare.
bnb_sd, ours_sd = bnb_opt.state_dict(), ours_opt.state_dict()
m_a = copy.deepcopy(bnb_model)
for p, g in zip(m_a.parameters(), grads):
    p.grad = g.clone()
into_ours = headroom.optim.Adam8bit(list(m_a.parameters()), lr=1e-3)
into_ours.load_state_dict(bnb_sd)
into_ours.step()
m_b = copy.deepcopy(ours_model)
for p, g in zip(m_b.parameters(), grads):
    p.grad = g.clone()
into_bnb = bnb.optim.Adam8bit(list(m_b.parameters()), lr=1e-3)
into_bnb.load_state_dict(ours_sd)
into_bnb.step()
bnb_opt.step()
ours_opt.step()
print(json.dumps({"case": "adam8bit_state_dicts",
                  "bnb_state_into_headroom_vs_bnb": compare(m_a, bnb_model),
                  "headroom_state_into_bnb_vs_headroom": compare(m_b, ours_model)}), flush=True)
