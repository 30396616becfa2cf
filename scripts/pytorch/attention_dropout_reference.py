"""PyTorch's side of the attention cases of `crates/ops-cuda/benches/kernels.rs` with and without
dropout (`f32_forward_512x197x64`, `bf16_dropout_backward_512x197x64` and so on): ViT-L/16's
batch-32 attention (32 × 16 heads, 197 tokens, head dim 64, not causal) through
`torch.nn.functional.scaled_dot_product_attention` with `dropout_p` 0 and 0.1, in bf16 on the
flash backend and in f32 on the memory-efficient one (the backends that take dropout; each
forced with `sdpa_kernel`).

q, k and v are the heads of one packed [32, 197, 3 · 1024] projection, as the Rust bench lays them
out. Cases: forward (no graph), backward (`out.backward(dout)` on a kept graph), each timed as
`attention_reference.py` times its cases (the median of 20 after 5 warm-ups, CUDA events). FLOPs as the Rust
bench counts them: 2 products forward, 5 backward, of 2 · 512 · 197² · 64 each.

Prints one JSON line per case: case, ms, tflops, times_ms, torch version, device, backend; a line
with `error` says why a case did not run.

Usage (on the GPU machine):
    python3 scripts/pytorch/attention_dropout_reference.py [--out attention_dropout_reference.jsonl]
"""
import argparse
import json

from attention_reference import median_ms

BATCH, HEADS, SEQ, HEAD_DIM = 32, 16, 197, 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the JSON lines to this file as well")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    product = 2 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM
    lines = []
    for dtype, tag, backend in [
        (torch.bfloat16, "bf16", SDPBackend.FLASH_ATTENTION),
        (torch.float32, "f32", SDPBackend.EFFICIENT_ATTENTION),
    ]:
        gen = torch.Generator(device=device).manual_seed(23)
        width = HEADS * HEAD_DIM
        packed = torch.randn(BATCH, SEQ, 3 * width, device=device, dtype=dtype, generator=gen)
        packed.requires_grad_(True)
        q, k, v = (
            packed[..., i * width : (i + 1) * width].view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)
            for i in range(3)
        )
        dout = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, dtype=dtype, generator=gen)
        meta = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device),
            "backend": str(backend),
            "shape": f"b{BATCH} h{HEADS} s{SEQ} d{HEAD_DIM} {tag}",
        }
        for suffix, p in [("", 0.0), ("_dropout", 0.1)]:

            def attend():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p)

            def forward():
                with torch.no_grad():
                    attend()

            kept = {}

            def backward():
                kept["out"].backward(dout, retain_graph=True)

            with sdpa_kernel(backend):
                for case, run, flops in [
                    (f"{tag}{suffix}_forward_512x197x64", forward, 2 * product),
                    (f"{tag}{suffix}_backward_512x197x64", backward, 5 * product),
                ]:
                    try:
                        if "backward" in case:
                            kept["out"] = attend()
                        ms, times = median_ms(torch, run)
                        line = {
                            "case": case,
                            "ms": ms,
                            "tflops": flops / (ms * 1e-3) / 1e12,
                            "times_ms": times,
                            **meta,
                        }
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
