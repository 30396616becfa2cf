#!/usr/bin/env bash
# Checks the caching allocator's CUDA storage on a GPU machine: runs the bundled test binaries,
# then the `cuda_alloc` bench if it was bundled, and tees every log to $OUT.
#
# Build the bundle here (no GPU needed), from the workspace root:
#   ../shared/tools/gpu-bundle.sh -- -p headroom-caching-allocator --features cuda
#   cargo bench --no-run --features cuda -p headroom-caching-allocator --bench cuda_alloc
#   mkdir -p .gpu-bundle/bench && cp <the cuda_alloc-* executable it printed> .gpu-bundle/bench/
#   strip .gpu-bundle/bench/*
# (the bench lives in bench/, not bin/, so that run.sh does not run it as a test).
# Then, on the GPU machine, from the workspace root, with .gpu-bundle carried:
#   bash scripts/gpu-allocator-check.sh [TEST_FILTER]
# Each binary runs with --include-ignored (the GPU tests are marked
# #[ignore = "needs a CUDA device"]); a libtest summary that counts an ignored test fails the run.
# Environment: OUT (log folder, default /tmp/gpu-allocator-check), BENCH_ARGS (extra criterion
# arguments, default a short run), SKIP_BENCH=1 to run the tests only.
set -uo pipefail
# A missing GPU fails the tests instead of skipping them (testkit's gpu::cuda_or_skip).
export HEADROOM_REQUIRE_GPU=1
out=${OUT:-/tmp/gpu-allocator-check}
mkdir -p "$out"
[[ -f .gpu-bundle/run.sh ]] || { echo "no .gpu-bundle/run.sh: build the bundle first (see the header)" >&2; exit 2; }

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee "$out/gpu.txt"

echo "== tests"
bash .gpu-bundle/run.sh "$@" --include-ignored --nocapture 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
ignored=$(grep -E 'test result:' "$out/tests.log" | grep -c -v ' 0 ignored;')
(( ignored == 0 )) || { echo "$ignored test binaries left ignored tests out"; tests_rc=1; }
# Every binary's full output in one file ($OUT brings back at most 8 files).
for log in .gpu-bundle/logs/*.log; do
  [[ -f $log ]] || continue
  echo "=== $(basename "$log")"; cat "$log"
done > "$out/tests-full.log"

bench_rc=0
bench=$(ls .gpu-bundle/bench/cuda_alloc* .gpu-bundle/bin/cuda_alloc* 2>/dev/null | head -1)
if [[ ${SKIP_BENCH:-0} != 1 && -n $bench ]]; then
  echo "== bench $(basename "$bench")"
  # Criterion keeps its data out of $OUT (only 8 files come back).
  # shellcheck disable=SC2086
  CRITERION_HOME=/tmp/criterion "$bench" --bench ${BENCH_ARGS:---warm-up-time 1 --measurement-time 3} \
    2>&1 | tee "$out/bench.log"
  bench_rc=${PIPESTATUS[0]}
else
  echo "== no bench bundled (or SKIP_BENCH=1)"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc; logs in $out"
[[ $tests_rc == 0 && $bench_rc == 0 ]]
