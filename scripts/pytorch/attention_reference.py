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

Usage (on the GPU machine):
    python3 scripts/pytorch/attention_reference.py [--out attention_reference.jsonl]
"""
import argparse
import json

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 4, 32, 8, 2048, 64
WARMUP, TIMED = 5, 20


def forward_flops():
    return 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM / 2


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
    parser.add_argument("--out", help="append the JSON lines to this file as well")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(30)

    def heads(n_heads):
        x = torch.randn(BATCH, SEQ, n_heads, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        return x.transpose(1, 2).requires_grad_(True)

    q, k, v = heads(HEADS), heads(KV_HEADS), heads(KV_HEADS)
    dout = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def forward():
        with torch.no_grad():
            attend()

    def forward_backward():
        attend().backward(dout)

    # Backward alone: one forward with a graph kept for every timed backward.
    kept = {}

    def backward():
        kept["out"].backward(dout, retain_graph=True)

    meta = {
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(device),
        "shape": f"b{BATCH} h{HEADS} kv{KV_HEADS} s{SEQ} d{HEAD_DIM} causal bf16",
    }
    lines = []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for case, run, multiple in [
            ("bf16_causal_forward", forward, 1.0),
            ("bf16_causal_backward", backward, 2.5),
            ("bf16_causal_fwd_bwd", forward_backward, 3.5),
        ]:
            try:
                if case == "bf16_causal_backward":
                    kept["out"] = attend()
                ms, times = median_ms(torch, run)
                tflops = multiple * forward_flops() / (ms * 1e-3) / 1e12
                line = {"case": case, "ms": ms, "tflops": tflops, "times_ms": times, **meta}
            except Exception as error:  # a backend that cannot run this case says why
                line = {"case": case, "error": f"{type(error).__name__}: {error}", **meta}
            lines.append(line)
            print(json.dumps(line), flush=True)
    if args.out:
        with open(args.out, "a") as out:
            for line in lines:
                out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
