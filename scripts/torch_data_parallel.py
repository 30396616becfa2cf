"""PyTorch's side of scripts/gpu-data-parallel.sh: the same models, batches per GPU, Adam and
step protocol as examples/data_parallel, under torchrun on the GPUs of one host.

Modes: `single` (one GPU, no process group), `ddp_zero` (DDP + ZeroRedundancyOptimizer: gradients
all-reduced in buckets, Adam's state sharded, parameters broadcast: ZeRO-1), `fsdp2` (FSDP2's
`fully_shard` on each block and the root, `reshard_after_forward=False`: gradients
reduce-scattered, parameters kept unsharded between forward and backward: ZeRO-2's memory).
Prints one JSON line per rank: median step time over the steps after 3 warm-up steps, and the
peak allocated over those steps (torch.cuda.max_memory_allocated after a reset).
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def build(model_name):
    if model_name == "vit-l16":
        import torchvision

        model = torchvision.models.vit_l_16()
        blocks = list(model.encoder.layers)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_embd=1024, n_layer=24, n_head=16, embd_pdrop=0.0,
                            attn_pdrop=0.0, resid_pdrop=0.0)
        model = GPT2LMHeadModel(config)
        blocks = list(model.transformer.h)
    return model, blocks


def batch_of(model_name, batch, seq, device, step, rank):
    g = torch.Generator(device="cpu").manual_seed(step * 1000 + rank)
    if model_name == "vit-l16":
        images = torch.rand(batch, 3, 224, 224, generator=g) * 2 - 1
        labels = torch.randint(0, 1000, (batch,), generator=g)
        return images.to(device), labels.to(device)
    ids = torch.randint(0, 50257, (batch, seq), generator=g).to(device)
    return ids, ids


def loss_of(model, model_name, inputs):
    if model_name == "vit-l16":
        return torch.nn.functional.cross_entropy(model(inputs[0]), inputs[1])
    return model(input_ids=inputs[0], labels=inputs[1]).loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["single", "ddp_zero", "fsdp2"], required=True)
    parser.add_argument("--model", choices=["vit-l16", "gpt2-medium"], required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-mib", type=int, default=25)
    args = parser.parse_args()

    distributed = args.mode != "single"
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if distributed:
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    model, blocks = build(args.model)
    model = model.to(device)

    if args.mode == "single":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        runner = model
    elif args.mode == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model, device_ids=[local_rank],
                                         bucket_cap_mb=args.bucket_mib)
        optimizer = ZeroRedundancyOptimizer(runner.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=1e-4, fused=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        runner = model
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    times = []
    peak = 0
    for step in range(args.steps):
        if step == 3:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        # The data is made before the clock starts: the step is what is timed.
        inputs = batch_of(args.model, args.batch, args.seq, device, step, rank)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = loss_of(runner, args.model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 3:
            times.append((time.perf_counter() - start) * 1e3)
            peak = max(peak, torch.cuda.max_memory_allocated())
    print(json.dumps({
        "impl": "pytorch", "stage": args.mode, "model": args.model, "world_size": world_size,
        "rank": rank, "per_rank_batch": args.batch, "steps": args.steps,
        "step_ms_median": statistics.median(times), "peak_allocated": peak,
        "torch": torch.__version__,
    }), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
