"""PyTorch's side of the Llama attention cases of `crates/ops-cuda/benches/kernels.rs`
(`benches/kernels/llama_attention.rs`, issue 30): causal bf16 grouped-query attention through
`torch.nn.functional.scaled_dot_product_attention` with the cuDNN backend forced
(`torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`, `enable_gqa=True`).

Shape: batch 4, 32 query heads, 8 key/value heads, 2048 tokens, head dim 64, laid out as a Llama
layer passes them ([batch, seq, heads, head_dim] projections viewed as [batch, heads, seq,
head_dim]). Cases: forward, backward (given the forward's graph, `out.backward(dout)`) and
forward + backward. Each is run 5 times to warm up, then timed 20 times with CUDA events; the
median is reported.

FLOP convention (the Rust bench's): the causal half only, forward 4 · b · h · s² · d / 2, backward
2.5× that, forward + backward 3.5× that.

Prints one JSON line per case: case, ms, tflops, times_ms, torch and cudnn versions, device; a
line with `error` says why a case did not run (e.g. no cuDNN attention for this GPU or build).

With `--shape issue35`, issue 35's targets instead (the kernels bench's `hopper_attention`
family): batch 4, 16 heads (no grouping), 4096 tokens, head dims 128 and 64, causal and not
(a full forward counts every score: 4 · b · h · s² · d); the cases are named
`bf16_<causal|full>_<forward|backward|fwd_bwd>_b4_h16_s4096_d<dim>`.

`--backends` names SDPA's backends to time (default: cudnn, and for issue35 also flash and
efficient, PyTorch's FlashAttention-2 and memory-efficient kernels); each line carries its
`backend`, and the cases of backends other than cuDNN end in `_<backend>`.

Usage (on the GPU machine):
    python3 scripts/pytorch/attention_reference.py [--shape llama1b|issue35]
        [--backends cudnn,flash,efficient] [--out FILE]
"""
import argparse
import json

WARMUP, TIMED = 5, 20
# --backends' names and SDPBackend's members.
BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION"}
# (batch, heads, kv heads, tokens, head dim, causal, case suffix) of each shape set.
SHAPES = {
    "llama1b": [(4, 32, 8, 2048, 64, True, "")],
    "issue35": [
        (4, 16, 16, 4096, head_dim, causal, f"_b4_h16_s4096_d{head_dim}")
        for head_dim in (128, 64)
        for causal in (True, False)
    ],
}


def forward_flops(batch, heads, seq, head_dim, causal):
    return 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)


def median_ms(torch, run):
    for _ in range(WARMUP):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b",
                        help="the shape set: issue 30's Llama-3.2-1B shape (default) or issue 35's")
    parser.add_argument("--backends", help="comma-separated SDPA backends among "
                        f"{', '.join(BACKENDS)} (default: cudnn; for issue35 all three)")
    parser.add_argument("--out", help="append the JSON lines to this file as well")
    args = parser.parse_args()
    default = "cudnn,flash,efficient" if args.shape == "issue35" else "cudnn"
    backends = (args.backends or default).split(",")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}: choose among {', '.join(BACKENDS)}")

    import torch

    lines = []
    for backend in backends:
        for shape in SHAPES[args.shape]:
            lines.extend(run_shape(torch, backend, *shape))
    if args.out:
        with open(args.out, "a") as out:
            for line in lines:
                out.write(json.dumps(line) + "\n")


def run_shape(torch, backend, batch, n_heads, kv_heads, seq, head_dim, causal, suffix):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(30)

    def heads(count):
        x = torch.randn(batch, seq, count, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        return x.transpose(1, 2).requires_grad_(True)

    q, k, v = heads(n_heads), heads(kv_heads), heads(kv_heads)
    dout = torch.randn(batch, n_heads, seq, head_dim, device=device, dtype=torch.bfloat16, generator=gen)

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != n_heads)

    def forward():
        with torch.no_grad():
            attend()

    def forward_backward():
        attend().backward(dout)

    # Backward alone: one forward with a graph kept for every timed backward.
    kept = {}

    def backward():
        kept["out"].backward(dout, retain_graph=True)

    mask = "causal" if causal else "full"
    meta = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(device),
        "shape": f"b{batch} h{n_heads} kv{kv_heads} s{seq} d{head_dim} {mask} bf16",
        "backend": backend,
    }
    if backend != "cudnn":
        suffix += f"_{backend}"
    # Issue 30's names keep their form (bf16_causal_forward, ...).
    prefix = f"bf16_{mask}"
    flops = forward_flops(batch, n_heads, seq, head_dim, causal)
    lines = []
    with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
        for case, run, multiple in [
            ("forward", forward, 1.0),
            ("backward", backward, 2.5),
            ("fwd_bwd", forward_backward, 3.5),
        ]:
            name = f"{prefix}_{case}{suffix}"
            try:
                if case == "backward":
                    kept["out"] = attend()
                ms, times = median_ms(torch, run)
                tflops = multiple * flops / (ms * 1e-3) / 1e12
                line = {"case": name, "ms": ms, "tflops": tflops, "times_ms": times, **meta}
            except Exception as error:  # a backend that cannot run this case says why
                line = {"case": name, "error": f"{type(error).__name__}: {error}", **meta}
            lines.append(line)
            print(json.dumps(line), flush=True)
    return lines


if __name__ == "__main__":
    main()
