"""Summarises train.py's JSON lines: per run, the median and mean step against the native run of
the same model that came last before it (so interleaved runs pair up), the median of the
step-by-step ratios (every run of a model sees the same batches), peak reserved bytes, and
whether the losses equal that native run's to the bit.

    python3 summarize.py train.jsonl [more.jsonl ...]
"""

import json
import statistics
import sys

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0 if len(sys.argv) > 1 else 2)

native = {}
for path in sys.argv[1:]:
    for line in open(path):
        if not line.startswith("{"):
            continue
        run = json.loads(line)
        model, alloc = run["model"], run["alloc"]
        name = alloc + (f" ({run['conf']})" if run.get("conf") else "")
        if alloc == "native":
            native[model] = run
            print(f"{model:5} {name:40} median {run['median_step_ms']:8.2f} ms  "
                  f"mean {run['mean_step_ms']:8.2f} ms  reserved {run['peak_reserved']:,} B")
            continue
        base = native.get(model)
        if base is None:
            print(f"{model:5} {name:40} (no native run before it)")
            continue
        line_out = (f"{model:5} {name:40} median {run['median_step_ms'] / base['median_step_ms']:.4f}x"
                    f"  mean {run['mean_step_ms'] / base['mean_step_ms']:.4f}x")
        if "times_ms" in run and "times_ms" in base:
            pairs = [a / b for a, b in zip(run["times_ms"][3:], base["times_ms"][3:])]
            line_out += f"  step by step {statistics.median(pairs):.4f}x"
        line_out += f"  reserved {run['peak_reserved']:,} B"
        same = sum(a == b for a, b in zip(run["loss_bits"], base["loss_bits"]))
        line_out += f"  losses {same}/{len(base['loss_bits'])} bitwise"
        if run.get("counters", {}).get("num_sync_all_streams"):
            line_out += f"  waits {run['counters']['num_sync_all_streams']}"
        print(line_out)
