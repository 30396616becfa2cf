"""PyTorch's side of `cargo xtask plan --find-max-model --run`: the largest Llama-shaped model
that PyTorch with torchao fully fine-tunes on this GPU at a sequence length and batch, under a
memory cap (`torch.cuda.set_per_process_memory_fraction(cap / total)`).

The shapes are the plan's: the standard ones (Llama-3.2-1B and 3B, Llama-3.1-8B, Qwen2.5-14B
and 32B, Llama-3.1-70B, as bench_reference.py builds them with transformers) and, between each
and the next, the smaller one four layers deeper at a time. For each recipe (bench_reference.py's
case names: bf16 weights with torchao's AdamW4bit or AdamW8bit and stochastic rounding, every
block checkpointed with Hugging Face's gradient_checkpointing_enable, stepped after backward or,
as PyTorch's tutorial does, one optimizer per parameter inside backward) find_max_batch.py's
search (doubling, then bisection) over the shapes, sorted by parameter count, finds the largest
that runs `--steps` steps. Each probe runs
in a child process of its own (an out-of-memory error leaves nothing behind), which prints one
JSON line: the shape, whether it fitted, its peak allocated bytes and median step.

Usage:
    python3 scripts/pytorch/find_max_model.py --seq 2048 --batch 1 --out fmm_torch.jsonl
    python3 scripts/pytorch/find_max_model.py --recipes adamw4bit_inbwd_bf16_ckpt \\
        --memory-cap-mb 142336
    python3 scripts/pytorch/find_max_model.py --known-fit qwen2.5-32b:76 \\
        --known-fail qwen2.5-32b:84   # only the shapes between an earlier run's bounds
One JSON line per probe, then one per recipe: its largest shape (model, layers, parameters),
the probes it took, and that shape's step and tokens per second.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reference import LLAMA_MODELS  # noqa: E402
from find_max_batch import find_max_batch_size  # noqa: E402

STANDARD = ['llama-3.2-1b', 'llama-3.2-3b', 'llama-3.1-8b', 'qwen2.5-14b', 'qwen2.5-32b',
            'llama-3.1-70b']
RECIPES = ['adamw4bit_inbwd_bf16_ckpt', 'adamw4bit_bf16_ckpt', 'adamw8bit_inbwd_bf16_ckpt']


def parameters(model_name, layers):
    """The parameter count of `model_name` with `layers` decoder layers, from its shapes."""
    c = LLAMA_MODELS[model_name]
    h, i, v = c['hidden_size'], c['intermediate_size'], c['vocab_size']
    heads, kv = c['num_attention_heads'], c['num_key_value_heads']
    d = c.get('head_dim') or h // heads
    per_layer = 2 * h + h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i
    if model_name.startswith('qwen2'):
        per_layer += heads * d + 2 * kv * d  # q/k/v biases
    embeddings = v * h * (1 if c['tie_word_embeddings'] else 2)
    return embeddings + layers * per_layer + h


def shapes():
    """(model, layers, parameters): the standard shapes and the deeper variants between them,
    smallest first."""
    found = []
    for k, name in enumerate(STANDARD):
        layers = LLAMA_MODELS[name]['num_hidden_layers']
        found.append((name, layers, parameters(name, layers)))
        if k + 1 < len(STANDARD):
            nxt = STANDARD[k + 1]
            limit = parameters(nxt, LLAMA_MODELS[nxt]['num_hidden_layers'])
            deeper = layers + 4
            while parameters(name, deeper) < limit:
                found.append((name, deeper, parameters(name, deeper)))
                deeper += 4
    return sorted(found, key=lambda s: s[2])


def probe(args):
    """One child: `--probe MODEL LAYERS RECIPE`; prints one JSON line, exits 0 when it fitted."""
    import torch

    from bench_reference import build_case

    model, layers, recipe = args.probe[0], int(args.probe[1]), args.probe[2]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_mb * 2**20 / total))
    row = dict(model=model, layers=layers, parameters=parameters(model, layers), recipe=recipe,
               seq=args.seq, batch=args.batch)
    try:
        step, make_input, _, _ = build_case(recipe, model, args.seq, layers)
        x = make_input(args.batch)
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(x)
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
        times.sort()
        row.update(fits=True, peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                   step_ms=times[len(times) // 2],
                   tokens_per_s=args.seq * args.batch / times[len(times) // 2] * 1e3)
    except torch.OutOfMemoryError as error:
        row.update(fits=False, error=str(error).splitlines()[0])
    print(json.dumps(row), flush=True)
    return 0 if row['fits'] else 3


def known(text):
    """`MODEL:LAYERS` as (model, layers, parameters), or None."""
    if not text:
        return None
    model, layers = text.split(':')
    return (model, int(layers), parameters(model, int(layers)))


def search(args, recipe, emit):
    """The largest shape `recipe` runs, by bisection over `shapes()`, or over the shapes between
    `--known-fit` and `--known-fail` (an earlier run's bounds) when given."""
    fit, fail = known(args.known_fit), known(args.known_fail)
    candidates = [s for s in shapes()
                  if (fit is None or s[2] > fit[2]) and (fail is None or s[2] < fail[2])]
    results = {}

    def fits(k):
        model, layers, _ = candidates[k]
        command = [sys.executable, os.path.abspath(__file__), '--probe', model, str(layers),
                   recipe, '--seq', str(args.seq), '--batch', str(args.batch),
                   '--memory-cap-mb', str(args.memory_cap_mb), '--steps', str(args.steps)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith('{')]
        row = json.loads(lines[-1]) if lines else dict(
            model=model, layers=layers, recipe=recipe, fits=False,
            error=f'exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}')
        emit(row)
        results[k] = row
        return row['fits']

    # find_max_batch.py's search over the shapes' positions (1-based): doubling, then bisection.
    found = find_max_batch_size(lambda k: fits(k - 1), len(candidates)) if candidates else 0
    largest = results.get(found - 1)
    if largest is None and fit is not None:
        largest = dict(model=fit[0], layers=fit[1], parameters=fit[2], recipe=recipe, fits=True,
                       known='--known-fit')
    return dict(recipe=recipe, seq=args.seq, batch=args.batch, memory_cap_mb=args.memory_cap_mb,
                probes=len(results), largest=largest,
                bounds=dict(known_fit=args.known_fit, known_fail=args.known_fail))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--seq', type=int, default=2048)
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--memory-cap-mb', type=int, default=139 * 1024)
    parser.add_argument('--recipes', default=','.join(RECIPES))
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--timeout', type=int, default=600, help='seconds a probe may take')
    parser.add_argument('--out', help='also append the JSON lines here')
    parser.add_argument('--known-fit', metavar='MODEL:LAYERS',
                        help='a shape an earlier run fitted: search only larger ones')
    parser.add_argument('--known-fail', metavar='MODEL:LAYERS',
                        help='a shape an earlier run ran out of memory on: search only smaller')
    parser.add_argument('--probe', nargs=3, metavar=('MODEL', 'LAYERS', 'RECIPE'),
                        help=argparse.SUPPRESS)
    parser.add_argument('--list', action='store_true', help='print the shapes and stop')
    args = parser.parse_args()
    if args.probe:
        return probe(args)
    if args.list:
        for model, layers, count in shapes():
            print(json.dumps(dict(model=model, layers=layers, parameters=count)))
        return 0
    out = open(args.out, 'a') if args.out else None

    def emit(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + '\n')
            out.flush()

    for recipe in args.recipes.split(','):
        emit(search(args, recipe, emit))
    return 0


if __name__ == '__main__':
    sys.exit(main())
