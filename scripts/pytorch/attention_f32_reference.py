"""PyTorch's side of `crates/ops-cuda/benches/attention_f32.rs` (issue 35): f32 attention through
`torch.nn.functional.scaled_dot_product_attention` with the memory-efficient backend forced
(`sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)`, the kernel PyTorch picks for f32 on this GPU).

Shapes (the Rust bench's): GPT-2 small b8 x 1024 (12 heads, causal), ViT-L/16 b32 x 197 (16 heads),
both at batch 1 too,
the Llama-3.2-1B shape b4 x 2048 (32 query, 8 key/value heads, causal) and head dim 128 at
b1 x 4096 (32/8 heads, causal). q, k and v are head views of one packed projection
([batch, seq, (heads + 2 kv_heads) * head_dim], as Hugging Face's GPT-2 splits c_attn); grouped
heads are repeated inside the timed call as Hugging Face's Llama does (`repeat_kv`) before SDPA.

Cases: forward, backward (given the forward's graph) and forward + backward; 5 warm-ups, 20 timed
runs with CUDA events, the median reported. TFLOP/s: forward 4 * b * h * s^2 * d, halved when
causal; backward 2.5x that.

Prints one JSON line per case (shape, case, kernel, ms, tflops, versions).

Usage (on the GPU machine):
    python3 scripts/pytorch/attention_f32_reference.py [--out attention_f32_reference.jsonl]
"""
import argparse
import json

# The same warm-ups and timed runs as the bf16 reference (5 and 20, the median).
from attention_reference import median_ms

SHAPES = [
    ("gpt2_b8x1024", 8, 12, 12, 1024, 64, True),
    ("vit_l16_b32", 32, 16, 16, 197, 64, False),
    ("gpt2_b1x1024", 1, 12, 12, 1024, 64, True),
    ("vit_l16_b1", 1, 16, 16, 197, 64, False),
    ("llama_1b_b4x2048", 4, 32, 8, 2048, 64, True),
    ("llama_8b_b1x4096", 1, 32, 8, 4096, 128, True),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the JSON lines to this file as well")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(35)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device),
            "kernel": "pytorch-efficient"}
    lines = []
    for name, batch, heads, kv_heads, seq, d, causal in SHAPES:
        width, kv_width = heads * d, kv_heads * d
        packed = torch.rand(batch, seq, width + 2 * kv_width, device=device, generator=gen) * 2 - 1
        packed.requires_grad_(True)
        dout = torch.rand(batch, heads, seq, d, device=device, generator=gen) * 2 - 1
        group = heads // kv_heads

        def attend():
            q, k, v = packed.split([width, kv_width, kv_width], dim=2)
            q = q.view(batch, seq, heads, d).transpose(1, 2)
            k = k.view(batch, seq, kv_heads, d).transpose(1, 2)
            v = v.view(batch, seq, kv_heads, d).transpose(1, 2)
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def forward():
            with torch.no_grad():
                attend()

        kept = {}

        def backward():
            kept["out"].backward(dout, retain_graph=True)

        def forward_backward():
            attend().backward(dout)

        flops = 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            for case, run, multiple in [
                ("forward", forward, 1.0),
                ("backward", backward, 2.5),
                ("fwd_bwd", forward_backward, 3.5),
            ]:
                try:
                    if case == "backward":
                        kept["out"] = attend()
                    ms, _ = median_ms(torch, run)
                    line = {"shape": name, "case": case, "ms": ms,
                            "tflops": multiple * flops / (ms * 1e-3) / 1e12, **meta}
                except Exception as error:  # a backend that cannot run this case says why
                    line = {"shape": name, "case": case, "error": f"{type(error).__name__}: {error}",
                            **meta}
                lines.append(line)
                print(json.dumps(line), flush=True)
        kept.clear()
        packed.grad = None
    if args.out:
        with open(args.out, "a") as out:
            for line in lines:
                out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
