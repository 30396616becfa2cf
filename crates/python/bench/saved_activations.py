"""``headroom.torch.saved_activations`` on torchvision's ViT-L/16 (f32) beside the same step
with no hooks, and beside PyTorch's ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, in
one process.

Variants, each from the same initial weights on the same batches, AdamW(fused=True) stepping:

- ``plain``: no hooks;
- ``none``: ``saved_activations(None)`` (the hooks' own cost, nothing encoded);
- ``int8``, ``bf16``: ``saved_activations("int8")`` and ``("bf16")``;
- ``offload``, ``int8_offload``: ``saved_activations(None, offload=pool)`` and
  ``("int8", offload=pool)``, one ``PinnedPool`` kept across steps (fetching ahead up to the
  default ``prefetch_mb=128``); ``offload_prefetchN``: the first with ``prefetch_mb=N``
  (``offload_prefetch0``: without fetching ahead, the peak of ``save_on_cpu``'s schedule);
  ``offload_fitN``, ``int8_offload_fitN``: fetching ahead while the bytes in flight and the
  save backward is decoding stay under N MiB (a large save leaves less room ahead);
  ``offload_peak``, ``int8_offload_peak``: ``hold_peak=True`` with ``prefetch_mb=1024`` (or
  ``_prefetchN``'s): fetching ahead as the first step's backward, profiled, leaves room under
  its peak; any of these with ``_all`` (``offload_peak_all``): ``every_save=True``, every save
  that is not a parameter's memory offloaded, the statistics and small saves too, as
  ``save_on_cpu`` does;
  and with ``_lastN`` last (``offload_peak_all_last1024``): ``keep_last_mb=N``, the forward's
  last N MiB of offloaded saves kept on the device;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``.

Per variant: the median step (forward, backward, step, synchronised) over the timed steps; the
activation bytes (allocated after the forward minus before it, in a settled step); the peak
allocated bytes of a step; the ratios of both to ``plain``'s; and from one more, traced step
(hooks on every encoder block) where the peak is reached: ``trace_peak_between`` names the two
events around it, ``trace_peak_rises_mb`` the events at which the running peak rose, and
``trace_allocated_mb`` the allocated MiB at each event. One JSON object per line.

    python3 saved_activations.py --batch 32 [--steps 20] [--warmup 3]

``--gpt2 STEPS`` instead trains a GPT-2-small-shaped model (transformers' GPT2LMHeadModel, random
weights, dropout off, 8 x 1024 random tokens from a fixed seed) for STEPS steps with and without
``saved_activations("int8")`` and reports both loss curves and the largest relative difference
of the int8 run's loss from the plain run's (the issue's bound: 0.1% at 300 steps).
"""

import argparse
import contextlib
import copy
import json
import statistics
import time

import torch

import headroom.torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--steps", type=int, default=20, help="steps in all (the first --warmup untimed)")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--variants",
                    default="plain,none,int8,bf16,offload,offload_prefetch0,offload_prefetch16,"
                            "offload_prefetch48,int8_offload,save_on_cpu")
parser.add_argument("--gpt2", type=int, metavar="STEPS", help="the GPT-2 loss comparison instead")
args = parser.parse_args()

device = torch.device("cuda", 0)
LR = 1e-4
POOL = headroom.torch.PinnedPool()


def hooks(variant):
    """The variant's saved-tensor context (``plain``: none)."""
    if variant == "plain":
        return contextlib.nullcontext()
    if variant == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if "offload" in variant:
        compress = "int8" if variant.startswith("int8") else None
        variant, _, last_mb = variant.partition("_last")
        every_save = variant.endswith("_all")
        variant = variant.removesuffix("_all")
        hold_peak = variant.endswith("_peak")
        _, _, ahead = variant.partition("_prefetch")
        _, fit, fit_mb = variant.partition("_fit")
        prefetch_mb = int(ahead or fit_mb or (1024 if hold_peak else 128))
        context = headroom.torch.saved_activations(compress, offload=POOL, prefetch_mb=prefetch_mb,
                                                   hold_peak=hold_peak,
                                                   keep_last_mb=int(last_mb or 0),
                                                   every_save=every_save)
        context._prefetch_counts_taken = bool(fit)
        return context
    return headroom.torch.saved_activations(None if variant == "none" else variant)


def vit():
    import torchvision

    torch.manual_seed(0)
    with device:
        base = torchvision.models.vit_l_16(weights=None)
    torch.nn.init.normal_(base.heads.head.weight, std=0.02)
    state = copy.deepcopy(base.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, 3, 224, 224, generator=g).to(device),
                torch.randint(0, 1000, (args.batch,), generator=g).to(device)) for _ in range(4)]
    for variant in args.variants.split(","):
        base.load_state_dict(state)
        model = base
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        times, activations, peaks = [], [], []
        for i in range(args.steps):
            x, y = batches[i % len(batches)]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            with hooks(variant):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            torch.cuda.synchronize()
            torch.empty(1, device=device)  # the allocator takes back what finished copies freed
            after_forward = torch.cuda.memory_allocated()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(1e3 * (time.perf_counter() - start))
                activations.append(after_forward - before)
                peaks.append(torch.cuda.max_memory_allocated())
        held = list(state.values()) + [t for batch in batches for t in batch]
        trace = traced_step(model, opt, variant, *batches[0], held)
        del opt
        yield {
            "model": "vit_l_16", "batch": args.batch, "variant": variant,
            "step_ms": statistics.median(times), "times_ms": times,
            "activation_bytes": max(activations), "peak_allocated_bytes": max(peaks),
            "pinned_pool_bytes": POOL.pinned_bytes if "offload" in variant else None,
            **trace,
        }


def live_tensors(model, opt, held):
    """The CUDA tensors Python holds at the traced step's start other than the model's
    parameters, their gradients, the optimizer's state and what the script holds (``held``: the
    initial weights, the batches): the largest 8 as
    [MiB, shape, dtype, grad_fn, requires_grad]."""
    import gc

    known = {id(p) for p in model.parameters()} | {id(t) for t in held}
    known |= {id(p.grad) for p in model.parameters() if p.grad is not None}
    known |= {id(v) for state in opt.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)}
    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and id(obj) not in known:
                found.append([round(obj.untyped_storage().nbytes() / 2**20, 2), list(obj.shape),
                              str(obj.dtype), type(obj.grad_fn).__name__, obj.requires_grad])
        except Exception:  # noqa: BLE001 (objects that only look like tensors)
            continue
    found.sort(key=lambda row: -row[0])
    return {"count": len(found), "mib": round(sum(row[0] for row in found), 2), "largest": found[:8]}


def traced_step(model, opt, variant, x, y, held):
    """One more step with hooks on the encoder blocks: where the step's peak is reached (between
    which two events), the events at which the running peak rose, and the allocated MiB at every
    block boundary."""
    events = []

    def mark(label):
        events.append((label, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))

    handles = []
    for i, block in enumerate(model.encoder.layers):
        handles += [
            block.register_forward_pre_hook(lambda *_, i=i: mark(f"fwd{i}<")),
            block.register_forward_hook(lambda *_, i=i: mark(f"fwd{i}>")),
            block.register_full_backward_pre_hook(lambda *_, i=i: mark(f"bwd{i}<")),
            block.register_full_backward_hook(lambda *_, i=i: mark(f"bwd{i}>")),
        ]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    mark("start")
    live = live_tensors(model, opt, held)
    with hooks(variant):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    mark("forward_end")
    torch.cuda.synchronize()
    mark("forward_synced")
    loss.backward()
    mark("backward_end")
    torch.cuda.synchronize()
    mark("backward_synced")
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    mark("step_end")
    for handle in handles:
        handle.remove()
    peak = events[-1][2]
    at = next(i for i, event in enumerate(events) if event[2] >= peak)
    rises, high_so_far = [], 0
    for label, _, high in events:
        if high > high_so_far + (1 << 20):
            rises.append([label, round(high / 2**20, 1)])
        high_so_far = max(high_so_far, high)
    return {
        "trace_peak_bytes": peak,
        "trace_peak_between": [events[max(at - 1, 0)][0], events[at][0]],
        "trace_peak_rises_mb": rises,
        "trace_live_at_start": live,
        "trace_allocated_mb": [[label, round(now / 2**20, 1)] for label, now, _ in events],
    }


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    g = torch.Generator().manual_seed(2)
    curves = {}
    for variant in ("plain", "int8"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        g.manual_seed(2)
        losses = []
        for _ in range(args.gpt2):
            ids = torch.randint(0, config.vocab_size, (8, 1024), generator=g).to(device)
            with hooks(variant):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves[variant] = losses
        del model, opt
    worst = max(abs(a / b - 1) for a, b in zip(curves["int8"], curves["plain"]))
    yield {"model": "gpt2", "steps": args.gpt2, "losses": curves, "max_relative_difference": worst}


rows = list(gpt2() if args.gpt2 else vit())
plain = next((r for r in rows if r.get("variant") == "plain"), None)
for row in rows:
    if plain is not None and "variant" in row:
        row["activation_ratio"] = row["activation_bytes"] / plain["activation_bytes"]
        row["step_ratio"] = row["step_ms"] / plain["step_ms"]
    row["torch"] = torch.__version__
    print(json.dumps(row), flush=True)
