"""PyTorch's side of `cargo xtask find-max-batch`: the largest batch each case trains at under a
memory cap, `torch.cuda.set_per_process_memory_fraction(cap / total)`.

The recipe's `find_max_batch_size` (memory-optimisation article, ../shared/notes/recipes.md no. 3)
doubles the batch until `torch.OutOfMemoryError` and stops there; this version then bisects
between the largest batch that fit and the smallest that did not. Per case one model and
optimizer (bench_reference.py's `build_case`) are built and a step at batch 1 creates the
optimizer's state; each probe is one training step (input, forward, backward, step, zero_grad).
After every probe the gradients are set to None, the exception and its frames are dropped,
`gc.collect()` and `torch.cuda.empty_cache()` run, and the bytes still allocated above the
baseline are recorded (`leaked_bytes`, the largest over the probes).

Usage:
    python3 scripts/pytorch/find_max_batch.py --memory-cap-mb 24576 --out fmb_torch.jsonl
    python3 scripts/pytorch/find_max_batch.py --model gpt2 --seq 1024 --cases adam_fused,sgd
    python3 scripts/pytorch/find_max_batch.py --model llama-3.2-1b --seq 2048 \\
        --cases fwd_bwd_bf16,fwd_bwd_bf16_ckpt --memory-cap-mb 65536
then `cargo xtask find-max-batch --memory-cap-mb 24576 --pytorch fmb_torch.jsonl` with the same
model and cases. One JSON line per case: case, model, max_batch, peak_allocated_bytes at that
batch, ooms, seconds, probes.
"""
import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reference import CASES, LANGUAGE_MODELS, build_case, default_seq  # noqa: E402


def find_max_batch_size(try_batch, max_batch):
    """Doubling until a probe runs out of memory, then bisection: the largest batch that fits.

    `try_batch(b)` returns True when a step at batch b fits and False when it ran out of memory.
    """
    lo, hi, batch = 0, None, 1
    while batch <= max_batch:
        if try_batch(batch):
            lo = batch
            if batch == max_batch:
                break
            batch = min(batch * 2, max_batch)
        else:
            hi = batch
            break
    if hi is None:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if try_batch(mid):
            lo = mid
        else:
            hi = mid
    return lo


def search_case(case, model_name, seq, max_batch):
    import torch

    started = time.time()
    step, make_input, zero_grad, _ = build_case(case, model_name, seq)
    probes = []
    state = dict(baseline=None, leaked=0)

    def try_batch(batch):
        fits = True
        x = None
        try:
            x = make_input(batch)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            step(x)
            torch.cuda.synchronize()
            ms = (time.time() - t0) * 1e3
            peak = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
        except torch.OutOfMemoryError:
            fits = False
        del x
        zero_grad()
        gc.collect()
        torch.cuda.empty_cache()
        now = torch.cuda.memory_allocated()
        if state['baseline'] is None:
            state['baseline'] = now
        state['leaked'] = max(state['leaked'], now - state['baseline'])
        probes.append(dict(batch=batch, fits=fits,
                           peak_allocated_bytes=peak if fits else None,
                           peak_reserved_bytes=reserved if fits else None,
                           step_ms=ms if fits else None))
        return fits

    best = find_max_batch_size(try_batch, max_batch)
    at_max = next((p for p in probes if p['batch'] == best and p['fits']), {})
    row = dict(case=case, model=model_name, max_batch=best,
               peak_allocated_bytes=at_max.get('peak_allocated_bytes', 0),
               peak_reserved_bytes=at_max.get('peak_reserved_bytes', 0),
               step_ms=at_max.get('step_ms'),
               ooms=sum(not p['fits'] for p in probes), probes=probes,
               leaked_bytes=state['leaked'], seconds=round(time.time() - started, 2))
    if model_name in LANGUAGE_MODELS:
        row['seq'] = seq
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='vit_l_16')
    parser.add_argument('--seq', type=int,
                        help='tokens a row of a language model (default 1024 for GPT-2, 2048 '
                             'for a Llama shape, 64 for the tiny ones)')
    parser.add_argument('--cases', default=','.join(CASES))
    parser.add_argument('--memory-cap-mb', type=int, default=24 << 10,
                        help='MiB; default 24576')
    parser.add_argument('--max-batch', type=int, default=1 << 16)
    parser.add_argument('--out', default='fmb_torch.jsonl', help='appended to')
    args = parser.parse_args()
    if args.seq is None:
        args.seq = default_seq(args.model)
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    cap = args.memory_cap_mb << 20
    if cap > total:
        raise SystemExit(f'--memory-cap-mb {args.memory_cap_mb}: the device has {total >> 20} MiB')
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    cases = [c for c in args.cases.split(',') if c]
    for case in cases:
        if case not in CASES:
            raise SystemExit(f'unknown case {case} (cases: {", ".join(CASES)})')
    with open(args.out, 'a') as out:
        def emit(row):
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + '\n')
            out.flush()

        emit(dict(tool='find_max_batch.py', torch=torch.__version__,
                  gpu=torch.cuda.get_device_name(0), memory_cap_bytes=cap,
                  alloc_conf=os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')))
        for case in cases:
            try:
                row = search_case(case, args.model, args.seq, args.max_batch)
            except Exception as ex:  # reported, the other cases still run
                row = dict(case=case, model=args.model, error=repr(ex)[:300])
            gc.collect()
            torch.cuda.empty_cache()
            emit(row)


if __name__ == '__main__':
    main()
