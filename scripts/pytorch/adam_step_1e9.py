"""PyTorch's side of `crates/optim/benches/cuda_adam.rs`: one Adam step on 1e9 fp32 parameters.

The same setting: 160 fp32 tensors of 6.25 M parameters on the GPU, each with a gradient (random
values), lr 1e-4 and Adam's other defaults. Per implementation a fresh optimizer takes a first
step (which creates its state); the peak is reset, and 5 steps are timed, each synchronized
(wall clock, as the Rust bench times them). It prints, and appends to --out, one JSON line per
implementation in the bench's field names: case `adam_step_1e9`, impl, ms (the median of the 5),
GBps (28 bytes a parameter for fp32 Adam, 16 for 8-bit, as the bench counts), step_extra_bytes
(`torch.cuda.max_memory_allocated()` over the timed steps less what was allocated before them)
and times_ms. Implementations: `torch.optim.Adam` with fused=True (torch_fused), foreach=True
(torch_foreach) and foreach=False (torch_single), then bitsandbytes' Adam8bit
(bitsandbytes_adam8bit) and torchao's Adam8bit and Adam4bit (torchao_adam8bit,
torchao_adam4bit: 14 bytes a parameter, on tensors of 6_249_984, whole blocks of 128, so its
states are 4-bit; each compiles its step on the untimed first one) when they import; a line with `error` says why one did not run.

Usage:
    python3 scripts/pytorch/adam_step_1e9.py --out adam_step_1e9_torch.jsonl
"""
import argparse
import gc
import time
from importlib.metadata import PackageNotFoundError, version as package_version

from bench_reference import json_lines

N_TENSORS = 160
PER_TENSOR = 6_250_000
PER_TENSOR_4BIT = 6_249_984  # whole blocks of 128


def version(package):
    """The installed version of `package`, or None."""
    try:
        return package_version(package)
    except PackageNotFoundError:
        return None


def time_steps(torch, step):
    """Median of 5 timed steps after a first one, the bytes they allocate beyond their start,
    and the 5 times in ms (sorted)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    extra = torch.cuda.max_memory_allocated() - base
    times.sort()
    return times[len(times) // 2], extra, times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', default='adam_step_1e9_torch.jsonl', help='appended to')
    args = parser.parse_args()
    import torch

    generator = torch.Generator(device='cuda').manual_seed(0)
    params = []
    for _ in range(N_TENSORS):
        p = torch.rand(PER_TENSOR, device='cuda', generator=generator) - 0.5
        p.grad = torch.rand(PER_TENSOR, device='cuda', generator=generator) - 0.5
        params.append(p)
    n = N_TENSORS * PER_TENSOR

    def adam(**options):
        return lambda: torch.optim.Adam(params, lr=1e-4, **options)

    def adam8bit():
        import bitsandbytes as bnb
        return bnb.optim.Adam8bit(params, lr=1e-4)

    def whole_blocks():
        """Copies of the parameters and gradients cut to 6_249_984 elements: torchao quantises
        whole blocks of 128 only, and the Rust bench's 4-bit case steps tensors of that size.
        Made when the case runs, freed with its optimizer."""
        params4 = []
        for p in params:
            q = p.detach()[:PER_TENSOR_4BIT].clone().requires_grad_(True)
            q.grad = p.grad[:PER_TENSOR_4BIT].clone()
            params4.append(q)
        return params4

    def torchao(name, tensors):
        def make():
            import torchao.optim
            return getattr(torchao.optim, name)(tensors(), lr=1e-4)
        return make

    implementations = [
        ('torch_fused', 28.0, adam(fused=True)),
        ('torch_foreach', 28.0, adam(foreach=True)),
        ('torch_single', 28.0, adam(foreach=False)),
        ('bitsandbytes_adam8bit', 16.0, adam8bit),
        ('torchao_adam8bit', 16.0, torchao('Adam8bit', lambda: params)),
        ('torchao_adam4bit', 14.0, torchao('Adam4bit', whole_blocks)),
    ]
    with json_lines(args.out) as emit:
        emit(dict(case='env', torch=torch.__version__, torchao=version('torchao'), gpu=torch.cuda.get_device_name(0),
                  n_tensors=N_TENSORS, per_tensor=PER_TENSOR))
        for name, bytes_per_param, make in implementations:
            row = dict(case='adam_step_1e9', impl=name)
            optimizer = None
            try:
                optimizer = make()
                with torch.no_grad():
                    ms, extra, times = time_steps(torch, optimizer.step)
                row.update(ms=round(ms, 3), GBps=round(bytes_per_param * n / (ms / 1e3) / 1e9, 1),
                           step_extra_bytes=extra, times_ms=[round(t, 3) for t in times])
            except Exception as ex:  # reported, the other implementations still run
                row['error'] = repr(ex)[:300]
            optimizer = None  # its state goes before the next one's is made
            gc.collect()
            torch.cuda.empty_cache()
            emit(row)


if __name__ == '__main__':
    main()
