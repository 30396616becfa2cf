#!/usr/bin/env bash
# The data-parallel targets of issue 16 on one host with 2 GPUs (the device kind nvidia-h200-x2),
# Headroom's ZeRO-1 and ZeRO-2 against PyTorch's DDP + ZeroRedundancyOptimizer and FSDP2 in the
# same call, on ViT-L/16 (fp32, Adam, batch 32 per GPU) and GPT-2 medium (batch 8 × 1024 per GPU):
#   - parameters after 20 steps against one GPU trained on the same global batch (as 2
#     micro-batches, rank order): bitwise expected (a sum of two values is the same in any order);
#   - per-GPU peak allocated, step time (median of steps 4..20), bytes reduce-scattered and
#     all-gathered per step (counted by the communicator);
#   - one GPU's step at the same per-GPU batch, ours and PyTorch's, for the scaling target;
#   - the crate's NCCL tests (two GPUs, HEADROOM_REQUIRE_GPU=1, --include-ignored: they are
#     marked #[ignore = "needs a CUDA device"]; a summary that counts an ignored test fails).
#
# Build here (no GPU needed), from the workspace root, into .gpu-bench/zero/:
#   cargo build --release --features cuda,nccl --example data_parallel
#   cargo build --release -p headroom-distributed --features nccl --bin headroom-launch
#   CARGO_PROFILE_RELEASE_DEBUG=0 cargo test --release --no-run -p headroom-distributed \
#     --features nccl --test nccl --message-format=json  # copy the executable it lists
#   mkdir -p .gpu-bench/zero && cp target/release/examples/data_parallel \
#     target/release/headroom-launch .gpu-bench/zero/ && cp <nccl test exe> .gpu-bench/zero/nccl_test
#   strip .gpu-bench/zero/*; cp scripts/gpu-data-parallel.sh scripts/torch_data_parallel.py .gpu-bench/zero/
# Then on the device, with carry [".gpu-bench/zero"]: bash .gpu-bench/zero/gpu-data-parallel.sh
# Environment: OUT (results folder, default /tmp/gpu-data-parallel), MODELS (default
# "vit-l16 gpt2-medium"), STEPS (default 20).
set -uo pipefail
export HEADROOM_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/gpu-data-parallel}
steps=${STEPS:-20}
mkdir -p "$out"
results="$out/results.jsonl"
: > "$results"

# NCCL: PyTorch's wheel ships libnccl.so.2; cudarc opens libnccl.so.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
mkdir -p "$out/lib" && ln -sf "$nccl_dir/libnccl.so.2" "$out/lib/libnccl.so"
export LD_LIBRARY_PATH="$out/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi -L | tee "$out/gpus.txt"

launch="$here/headroom-launch"
example="$here/data_parallel"
failed=0
record() { # label, command...
  local label=$1; shift
  echo "== $label" | tee -a "$out/log"
  "$@" > "$out/$label.out" 2>&1
  local rc=$?
  cat "$out/$label.out" >> "$out/log"
  grep -h '^{' "$out/$label.out" >> "$results"
  (( rc != 0 )) && { failed=$((failed + 1)); echo "   failed rc=$rc" | tee -a "$out/log"; }
}

if [[ -x "$here/nccl_test" ]]; then
  record nccl_tests "$here/nccl_test" --include-ignored --test-threads 1
  if grep -E '^test result:' "$out/nccl_tests.out" | grep -q -v ' 0 ignored;'; then
    failed=$((failed + 1)); echo "   nccl_tests left ignored tests out" | tee -a "$out/log"
  fi
fi

for model in ${MODELS:-vit-l16 gpt2-medium}; do
  case $model in vit-l16) batch=32 ;; *) batch=8 ;; esac
  common=(--device cuda --model "$model" --batch "$batch" --steps "$steps")
  record "$model.ours.single" "$example" "${common[@]}" --stage single --accumulate 1
  record "$model.ours.reference" "$example" "${common[@]}" --stage single --accumulate 2 \
    --dump "$out/$model.reference.bin"
  for stage in zero1 zero2; do
    record "$model.ours.$stage" "$launch" --nproc 2 -- "$example" "${common[@]}" --stage "$stage" \
      --dump "$out/$model.$stage.bin"
  done
  torch_common=(--model "$model" --batch "$batch" --steps "$steps")
  record "$model.torch.single" python3 "$here/torch_data_parallel.py" --mode single "${torch_common[@]}"
  for mode in ddp_zero fsdp2; do
    record "$model.torch.$mode" torchrun --standalone --nproc_per_node 2 \
      "$here/torch_data_parallel.py" --mode "$mode" "${torch_common[@]}"
  done
done

python3 - "$out" <<'PY'
import json, os, sys
import numpy as np
out = sys.argv[1]
rows = [json.loads(l) for l in open(os.path.join(out, "results.jsonl")) if l.strip()]
print(f"{'model':<12} {'impl':<9} {'stage':<9} {'rank':>4} {'peak GB':>8} {'step ms':>8} {'RS MB':>8} {'AG MB':>8}")
for r in rows:
    print(f"{r['model']:<12} {r.get('impl', 'headroom'):<9} {r['stage']:<9} {r['rank']:>4} "
          f"{r['peak_allocated'] / 1e9:>8.2f} {r['step_ms_median']:>8.1f} "
          f"{r.get('reduce_scatter_bytes', 0) / 1e6:>8.1f} {r.get('all_gather_bytes', 0) / 1e6:>8.1f}")
for model in sorted({r['model'] for r in rows}):
    ref = os.path.join(out, f"{model}.reference.bin")
    for stage in ("zero1", "zero2"):
        path = os.path.join(out, f"{model}.{stage}.bin")
        if os.path.exists(ref) and os.path.exists(path):
            a, b = np.fromfile(path, np.float32), np.fromfile(ref, np.float32)
            same = a.tobytes() == b.tobytes()
            print(f"{model} {stage}: parameters after the steps {'bitwise equal' if same else 'differ'}"
                  f" to one GPU on the global batch (max |diff| {np.max(np.abs(a - b)):.3e})")
    base = [r for r in rows if r['model'] == model and r['stage'] == 'single'
            and 'impl' not in r and r.get('accumulate') == 1]
    if base:
        one = base[0]['step_ms_median']
        for r in rows:
            if r['model'] == model and r['stage'] in ("zero1", "zero2") and r['rank'] == 0:
                print(f"{model} {r['stage']}: step {r['step_ms_median']:.1f} ms = "
                      f"{r['step_ms_median'] / one:.3f} x one GPU's at the same per-GPU batch "
                      f"(scaling {2 * one / r['step_ms_median']:.2f}x)")
PY
echo "$failed run(s) failed; results in $out"
[[ $failed == 0 ]]
