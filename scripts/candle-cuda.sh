#!/usr/bin/env bash
# headroom-candle-cuda (crates/candle-cuda, a workspace of its own) built here and run on the GPU
# machine. candle's `cuda` feature compiles candle's kernels with nvcc and links the CUDA
# libraries, so the build needs the pinned nvcc of the developers' guide (a virtualenv with
# nvidia-cuda-nvcc==13.0.88 and its companions; NVCC_ENV names it) and link-time stand-ins for
# the driver libraries this machine lacks (empty shared objects with the real sonames; the
# symbols resolve on the GPU machine, whose libraries the run preloads).
#   bash scripts/candle-cuda.sh pack          # here: build, strip, pack into .gpu-candle/
#   bash scripts/candle-cuda.sh run           # on the device: unpack, run the tests and the
#                                             # example, logs and JSON into $OUT
# With carry [".gpu-candle"]. About 10 minutes to build from scratch on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  pack)
    env_dir=${NVCC_ENV:-/work/nvccenv}
    nv=$(ls -d "$env_dir"/lib/python*/site-packages/nvidia/cu13)
    stubs=$(mktemp -d)
    echo > "$stubs/empty.c"
    for pair in cuda:libcuda.so.1 nvrtc:libnvrtc.so.13 cublas:libcublas.so.13 \
      cublasLt:libcublasLt.so.13 curand:libcurand.so.10; do
      gcc -shared -fPIC -o "$stubs/lib${pair%%:*}.so" -Wl,-soname,"${pair#*:}" "$stubs/empty.c"
    done
    ln -sf "$nv/lib/libcudart.so.13" "$stubs/libcudart.so"
    export PATH=$nv/bin:$PATH CUDA_ROOT=$nv CUDA_PATH=$nv CUDA_HOME=$nv CUDA_COMPUTE_CAP=90
    export LIBRARY_PATH=$stubs:$nv/lib
    export RUSTFLAGS="-C link-arg=-Wl,--unresolved-symbols=ignore-in-object-files"
    (cd crates/candle-cuda && cargo build --release --tests --examples &&
      cargo clippy --release --all-targets -- -D warnings &&
      RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps)
    rm -rf .gpu-candle && mkdir -p .gpu-candle/bin
    exe=$(ls -t crates/candle-cuda/target/release/deps/cuda_optimizers-* | grep -v '\.d$' | head -1)
    cp "$exe" .gpu-candle/bin/cuda_optimizers
    cp crates/candle-cuda/target/release/examples/candle_t5_cuda .gpu-candle/bin/
    cp "$nv/lib/libcudart.so.13" .gpu-candle/bin/
    strip .gpu-candle/bin/cuda_optimizers .gpu-candle/bin/candle_t5_cuda
    tar cf - -C .gpu-candle bin | xz -T2 -9 > .gpu-candle.tar.xz
    rm -rf .gpu-candle/bin && mv .gpu-candle.tar.xz .gpu-candle/bin.tar.xz
    du -h .gpu-candle/bin.tar.xz
    ;;
  run)
    : "${OUT:?run on the device tool, which sets OUT}"
    tar xJf .gpu-candle/bin.tar.xz -C .gpu-candle
    libs=$(find / -xdev \( -name 'libcublas.so.13' -o -name 'libnvrtc.so.13' -o -name 'libcurand.so.10' \) \
      2>/dev/null | xargs -r -n1 dirname | sort -u | paste -sd:)
    export LD_LIBRARY_PATH=$PWD/.gpu-candle/bin:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # The stand-ins had no symbols, so the linker dropped them from the binaries' needs: the
    # real libraries are preloaded, and cudarc's calls resolve against them.
    export LD_PRELOAD="libcuda.so.1 libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10"
    export HEADROOM_REQUIRE_GPU=1
    .gpu-candle/bin/cuda_optimizers --include-ignored --test-threads 1 --nocapture \
      > "$OUT/test_candle_cuda.log" 2>&1 && rc=0 || rc=$?
    echo "tests: rc=$rc" | tee -a "$OUT/run.log"
    .gpu-candle/bin/candle_t5_cuda --json "$OUT/candle_t5_cuda.jsonl" \
      > "$OUT/candle_t5_cuda.log" 2>&1 && rc=0 || rc=$?
    echo "example: rc=$rc" | tee -a "$OUT/run.log"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/run.log"
    tail -5 "$OUT/test_candle_cuda.log"; cat "$OUT/candle_t5_cuda.log"
    ;;
  *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' ;;
esac
