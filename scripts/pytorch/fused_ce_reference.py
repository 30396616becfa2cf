"""The anchors of issue 31 at the Llama-3.2-1B head: the loss of 8192 tokens of 2048 features
against a 128,256-token vocabulary, bf16 inputs, forward + backward.

PyTorch's side of `crates/ops-cuda/examples/fused_ce_bench.rs` (Headroom's fused and unfused
loss at the same shape). Implementations:
- torch_eager_unfused: `F.cross_entropy((x @ W.T).float(), y)`, the logits and their f32 copy held;
- liger_flce: Liger-Kernel's `LigerFusedLinearCrossEntropyLoss` (liger-kernel 0.8.5);
- cce: Cut Cross-Entropy's `linear_cross_entropy` (cut-cross-entropy 25.1.1) at its defaults,
  which filter the gradient (`filter_eps="high"`: blocks whose softmax is below bf16's precision
  are skipped in backward);
- cce_no_filter: the same with `filter_eps=None`, every gradient element computed, as
  Headroom's op computes them (issue 31: no gradient filtering or skipping);
- headroom_python: the `headroom` wheel's `headroom.torch.linear_cross_entropy` (blocks of rows
  under `chunk_mb=64`, in torch's kernels: issue 33's loss from Python), when the wheel imports.
An implementation that does not import prints "not installed" in its `error` field.

Per implementation: one warm-up forward + backward, then ITERS timed ones (wall clock, the
device synchronised around each, as the Rust example times them). It prints one JSON object:
per implementation the median ms, the loss, `peak_beyond_inputs_bytes`
(`torch.cuda.max_memory_allocated()` during a step less what was allocated before it, with the
inputs and the weight allocated and no gradients) and `peak_beyond_inputs_and_grads_bytes` (that
less the gradients of x and W, the issue's target: <= 64 MiB + 8 B per token).

With `--dtype f32` the inputs are float32 (TF32 off, PyTorch's default), as GPT-2's loss under
Hugging Face's Trainer without autocast; then headroom_python_backward (the gradients by
recompute in backward) and headroom_python_forward (computed in the forward, a block of whole
rows under `chunk_mb`; `_forward_N` under N MiB) are timed beside the automatic choice.
`--profile` adds per implementation the CUDA kernels of two profiled steps (`kernels`: name,
calls and microseconds a step, the largest first).

Usage:
    python3 scripts/pytorch/fused_ce_reference.py [--iters 10] [--tokens 8192 --hidden 2048 --vocab 128256]
        [--dtype bf16|f32] [--profile]
"""
import argparse
import json
import time


def measure(torch, step, params, iters):
    """Median ms of `iters` forward + backward runs after a warm-up, the largest peak beyond
    what was allocated before a run, and the last loss."""
    times, peak, loss_value = [], 0, None
    for run in range(iters + 1):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = step()
        loss.backward()
        torch.cuda.synchronize()
        if run > 0:
            times.append((time.perf_counter() - start) * 1e3)
        peak = max(peak, torch.cuda.max_memory_allocated() - before)
        loss_value = float(loss.detach())
        del loss
    times.sort()
    return {"median_ms": round(times[len(times) // 2], 3), "peak_beyond_inputs_bytes": peak, "loss": loss_value}


def kernels(torch, step, params, steps=2):
    """The CUDA kernels of `steps` forward + backward runs: [name, calls, microseconds] a step,
    the largest first (the twelve largest and the rest summed)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for p in params:
                p.grad = None
            step().backward()
        torch.cuda.synchronize()
    rows = [(e.key, e.count // steps, e.device_time_total / steps)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    top = [[name[:90], calls, round(us, 1)] for name, calls, us in rows[:12]]
    rest = sum(us for _, _, us in rows[12:])
    return top + [["(the rest)", sum(c for _, c, _ in rows[12:]), round(rest, 1)],
                  ["(total)", sum(c for _, c, _ in rows), round(sum(us for *_, us in rows), 1)]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    device = "cuda"
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    x = (torch.rand(args.tokens, args.hidden, device=device) * 2 - 1).to(dtype).requires_grad_()
    w = ((torch.rand(args.vocab, args.hidden, device=device) * 2 - 1) * 0.02).to(dtype).requires_grad_()
    y = torch.arange(args.tokens, device=device, dtype=torch.int64) * 7919 % args.vocab
    grads = (args.tokens + args.vocab) * args.hidden * x.element_size()

    impls = {"torch_eager_unfused": lambda: (lambda: F.cross_entropy((x @ w.T).float(), y))}

    def liger():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss()
        return lambda: loss_fn(w, x, y)

    def cce():
        from cut_cross_entropy import linear_cross_entropy

        return lambda: linear_cross_entropy(x, w, y)

    def cce_no_filter():
        from cut_cross_entropy import linear_cross_entropy

        return lambda: linear_cross_entropy(x, w, y, filter_eps=None)

    def headroom_python():
        import headroom.torch

        return lambda: headroom.torch.linear_cross_entropy(x, w, y)

    def headroom_python_gradients(in_forward, chunk_mb=64):
        def make():
            import headroom.loss
            import headroom.torch

            def step():
                headroom.loss._GRADIENTS_IN_FORWARD[0] = in_forward
                try:
                    return headroom.torch.linear_cross_entropy(x, w, y, chunk_mb=chunk_mb)
                finally:
                    headroom.loss._GRADIENTS_IN_FORWARD[0] = None
            return step
        return make

    impls["liger_flce"] = liger
    impls["headroom_python"] = headroom_python
    if args.dtype == "f32":
        impls["headroom_python_backward"] = headroom_python_gradients(False)
        impls["headroom_python_forward"] = headroom_python_gradients(True)
        for chunk_mb in (128, 256, 512):
            impls[f"headroom_python_forward_{chunk_mb}"] = headroom_python_gradients(True, chunk_mb)
    impls["cce"] = cce
    impls["cce_no_filter"] = cce_no_filter

    results = {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype},
        "iters": args.iters,
        "target_beyond_grads_bytes": 64 * 2**20 + 8 * args.tokens,
        "torch": torch.__version__,
    }
    for name, make in impls.items():
        try:
            step = make()
        except ImportError:
            results[name] = {"error": "not installed"}
            continue
        try:
            entry = measure(torch, step, [x, w], args.iters)
            entry["peak_beyond_inputs_and_grads_bytes"] = entry["peak_beyond_inputs_bytes"] - grads
            if args.profile:
                entry["kernels"] = kernels(torch, step, [x, w])
            results[name] = entry
        except Exception as err:  # one failing anchor must not hide the others
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
