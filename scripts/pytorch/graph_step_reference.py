"""PyTorch's side of `crates/ops-cuda/benches/graph_step.rs`: batch-1 training steps, eager
against a whole step captured with `torch.cuda.graph` (PyTorch's "whole network capture"
recipe: warm-up on a side stream, `zero_grad(set_to_none=True)` before the capture, forward,
loss, backward and `AdamW(capturable=True)` inside, `static_input.copy_(batch)` then
`graph.replay()` after). Models: torchvision's ViT-L/16 (`loss = model(x).sum()` on 1 × 3 × 224²)
and Hugging Face's GPT-2 small (`GPT2LMHeadModel`, SDPA, dropout off, 1 × 1024 tokens, `loss =
model(input_ids=ids, labels=ids).loss`), f32, AdamW (the eager loop's `fused=True`). 20 steps
a loop, the median wall time (synchronised every step) of the steps after the capture (the
eager loop: after the same 4 steps), one JSON line per model in the bench's format.

Usage: python3 scripts/pytorch/graph_step_reference.py [--models vit,gpt2] [--out FILE]
"""
import argparse
import json
import statistics
import time

import torch

STEPS, WARMUP = 20, 3


def build(name):
    torch.manual_seed(0)
    if name == "vit":
        import torchvision

        model = torchvision.models.vit_l_16().cuda()
        batches = [torch.rand(1, 3, 224, 224, device="cuda") for _ in range(2)]
        loss_of = lambda x: model(x).sum()
        static = torch.zeros_like(batches[0])
    else:
        from transformers import AutoModelForCausalLM, GPT2Config

        config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().train()
        batches = [torch.randint(0, config.vocab_size, (1, 1024), device="cuda") for _ in range(2)]
        loss_of = lambda ids: model(input_ids=ids, labels=ids).loss
        static = torch.zeros_like(batches[0])
    return model, batches, loss_of, static


def eager(name):
    model, batches, loss_of, static = build(name)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    times = []
    for step in range(STEPS):
        start = time.perf_counter()
        static.copy_(batches[step % 2])
        opt.zero_grad(set_to_none=True)
        loss_of(static).backward()
        opt.step()
        torch.cuda.synchronize()
        if step > WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def graphed(name):
    model, batches, loss_of, static = build(name)
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    times = []
    with torch.cuda.stream(side):
        for step in range(WARMUP):
            static.copy_(batches[step % 2])
            opt.zero_grad(set_to_none=True)
            loss_of(static).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    static.copy_(batches[WARMUP % 2])
    with torch.cuda.graph(graph):
        static_loss = loss_of(static)
        static_loss.backward()
        opt.step()
    graph.replay()
    for step in range(WARMUP + 1, STEPS):
        start = time.perf_counter()
        static.copy_(batches[step % 2])
        graph.replay()
        torch.cuda.synchronize()
        if step > WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vit,gpt2")
    parser.add_argument("--out")
    args = parser.parse_args()
    cases = {"vit": "vit_l16_b1_adamw", "gpt2": "gpt2_small_b1x1024_adamw"}
    lines = []
    for name in args.models.split(","):
        torch.cuda.reset_peak_memory_stats()
        eager_ms, eager_peak = eager(name)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            graph_ms, graph_peak = graphed(name)
        except Exception as error:  # a model PyTorch cannot capture: say why, go on
            print(json.dumps({"case": cases[name], "impl": "pytorch", "error": repr(error)}))
            continue
        finally:
            torch.cuda.empty_cache()
        line = {
            "case": cases[name], "impl": "pytorch", "dtype": "F32", "steps": STEPS,
            "eager_step_ms": round(eager_ms, 3), "graph_step_ms": round(graph_ms, 3),
            "ratio": round(graph_ms / eager_ms, 4), "eager_peak_allocated_bytes": eager_peak,
            "graph_peak_allocated_bytes": graph_peak, "torch": torch.__version__,
        }
        print(json.dumps(line), flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
