#!/usr/bin/env bash
# Runs compute-sanitizer over the test binaries of a GPU bundle: memcheck on every binary, then
# racecheck on the binaries named in RACECHECK (default: overlap_cuda, whose small shared-memory
# kernels racecheck can afford). Each binary runs with --include-ignored (the GPU tests are
# marked #[ignore = "needs a CUDA device"]). A missing GPU fails the tests instead of skipping
# them, and a run whose output holds the word `skipped` (with --show-output, what passing tests
# print too) or whose libtest summary counts an ignored test fails as well, as in
# scripts/gpu-measure.sh; the multi-GPU test binaries (distributed's nccl) are left out by name,
# saying so.
#
# Build the bundle here (no GPU needed), from the workspace root:
#   ../shared/tools/gpu-bundle.sh -- -p headroom-ops-cuda --features cuda
# Then, on the GPU machine, from the workspace root, with .gpu-bundle carried:
#   bash scripts/gpu-sanitize.sh
# Environment: OUT (log folder, default /tmp/gpu-sanitize), RACECHECK (space-separated binary
# names), LIMIT (seconds per sanitizer run, default 300).
set -uo pipefail
export HEADROOM_REQUIRE_GPU=1
out=${OUT:-/tmp/gpu-sanitize}
limit=${LIMIT:-300}
mkdir -p "$out"
[[ -d .gpu-bundle/bin ]] || { echo "no .gpu-bundle/bin: build the bundle first (see the header)" >&2; exit 2; }
# Test binaries that need more than one GPU (testkit's gpus_or_skip): not run by this script.
multi_gpu_tests="nccl"
failed=0
run() { # tool binary
  local name; name=$(basename "$2")
  local log="$out/$1_$name.log"
  timeout "$limit" compute-sanitizer --tool "$1" --error-exitcode 86 --print-limit 20 "$2" \
    --include-ignored --show-output > "$log" 2>&1
  local rc=$?
  local skips ignored
  skips=$(grep -c -w skipped "$log")
  ignored=$(grep -E '^test result:' "$log" | grep -c -v ' 0 ignored;')
  (( rc != 0 || skips > 0 || ignored > 0 )) && failed=$((failed + 1))
  echo "$1 $name: rc=$rc, $skips skip line(s) $(grep -E '^test result' "$log" | tail -1) |" \
    "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|Device not supported' "$log" | tail -1)"
}
for t in .gpu-bundle/bin/*; do
  name=$(basename "$t" | sed 's/-[0-9a-f]*$//')
  case $name in xtask* | headroom-bench | headroom_bench*) continue ;; esac
  if [[ " $multi_gpu_tests " == *" $name "* ]]; then
    echo "$name: not run here: it needs two GPUs (scripts/gpu-data-parallel.sh)"
    continue
  fi
  run memcheck "$t"
done
for name in ${RACECHECK:-overlap_cuda}; do
  for t in .gpu-bundle/bin/"$name"-*; do
    [[ -e $t ]] && run racecheck "$t"
  done
done
echo "$failed sanitizer run(s) failed; logs in $out"
[[ $failed == 0 ]]
