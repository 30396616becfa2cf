#!/usr/bin/env bash
# Runs the Python misuse suites (test_optim_misuse.py, test_cuda_allocator.py) under
# compute-sanitizer's memcheck on the GPU machine: every misuse case either raises before a
# launch or steps in bounds, so memcheck must report no error. PyTorch's caching allocator
# carves tensors out of large segments, where memcheck cannot see a write that runs into the
# next tensor, so PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own allocation
# (use_allocator's cases install Headroom's allocator in child processes, which memcheck follows
# with --target-processes all). A missing GPU fails the suites (HEADROOM_REQUIRE_GPU=1).
#
# Usage, from the repository root, with the wheel installed (or on PYTHONPATH):
#   bash crates/python/python/tests/run_memcheck.sh [pytest arguments]
# Environment: OUT (log folder, default /tmp/python-memcheck).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/python-memcheck}
mkdir -p "$out"
export HEADROOM_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 --target-processes all \
  python3 -m pytest -q -p no:cacheprovider "$here/test_optim_misuse.py" \
  "$here/test_cuda_allocator.py" "$@" 2>&1 | tee "$out/memcheck.log"
rc=${PIPESTATUS[0]}
grep -E "ERROR SUMMARY|Device not supported|passed|failed" "$out/memcheck.log" | tail -5
echo "compute-sanitizer memcheck: rc=$rc (86: memcheck found an error); log in $out/memcheck.log"
exit "$rc"
