"""Where PyTorch's step time goes: bench_reference.py's case (same model, same step) run under
torch.profiler after the warm-up, printed as two tables, GPU kernels by name and ATen ops by
their device time, each sorted by total device time, largest first.

Usage (on the GPU machine, beside `cargo xtask bench-memory ... --op-profile`):
    python3 scripts/pytorch/profile_reference.py --model gpt2 --seq 1024 --batch 8 \\
        --cases fwd_bwd,fwd_bwd_bf16
"""
import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_reference  # noqa: E402


def profile_case(case, model_name, batch, seq, rows, warmup=3):
    import torch
    from torch.profiler import ProfilerActivity, profile

    step, make_input, _, _ = bench_reference.build_case(case, model_name, seq)
    x = make_input(batch)
    for _ in range(warmup):
        step(x)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        step(x)
        end.record()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in kernels)
    print(f'## {model_name} {case} batch {batch} seq {seq}: step {start.elapsed_time(end):.2f} ms '
          f'(events, under the profiler), kernels {total_us / 1e3:.2f} ms on the device\n')
    print('| ms | % | calls | kernel |\n|---:|---:|---:|---|')
    for e in kernels[:rows]:
        ms = e.self_device_time_total / 1e3
        print(f'| {ms:.3f} | {100 * e.self_device_time_total / max(total_us, 1):.1f} | {e.count} '
              f'| {e.key[:150]} |')
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
           and e.key.startswith('aten::') and e.device_time_total > 0]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print('\n| self device ms | calls | aten op |\n|---:|---:|---|')
    for e in ops[:rows]:
        print(f'| {e.self_device_time_total / 1e3:.3f} | {e.count} | {e.key} |')
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt2')
    parser.add_argument('--seq', type=int, default=1024)
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--cases', default='fwd_bwd,fwd_bwd_bf16')
    parser.add_argument('--rows', type=int, default=30)
    args = parser.parse_args()
    import torch
    for case in [c for c in args.cases.split(',') if c]:
        profile_case(case, args.model, args.batch, args.seq, args.rows)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
