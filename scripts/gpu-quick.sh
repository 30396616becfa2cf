#!/usr/bin/env bash
# Packs a few release binaries for a quick device call, when the whole bundle of
# scripts/gpu-pack.sh (about ten minutes to build) is more than one iteration needs: integration
# tests and benches by target name, and headroom-bench on request, built without debug info,
# stripped, into .gpu-carry/quick.tar.xz (a few MB a binary; each embeds the PTX).
# Run from the workspace root on the development machine:
#   bash scripts/gpu-quick.sh [--headroom-bench] [--test NAME]... [--bench NAME]...
#   e.g. bash scripts/gpu-quick.sh --headroom-bench --test parity --test golden_models \
#          --bench kernels --bench attention_f32
# NAME is a test or bench target of any workspace crate (tests/NAME.rs or tests/NAME/main.rs,
# benches/NAME.rs); CARGO_TARGET_DIR is honoured. On the device, carry
# [".gpu-carry/quick.tar.xz"] and unpack it yourself (`tar xJf .gpu-carry/quick.tar.xz`) or let
# scripts/gpu-call.sh do it: the binaries land in
# .gpu-quick/bin/NAME (tests, and headroom-bench) and .gpu-quick/benches/NAME, and run from the
# workspace root (tests read testdata/). Run GPU tests with HEADROOM_REQUIRE_GPU=1 and
# --include-ignored, as gpu-measure.sh does.
set -euo pipefail
tests=() benches=() headroom_bench=0
while (( $# )); do
  case $1 in
    --test) tests+=("${2:?--test takes a target name}"); shift 2 ;;
    --bench) benches+=("${2:?--bench takes a target name}"); shift 2 ;;
    --headroom-bench) headroom_bench=1; shift ;;
    -h | --help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -f Cargo.toml && -d crates ]] || { echo "run from the workspace root" >&2; exit 2; }
(( ${#tests[@]} + ${#benches[@]} + headroom_bench )) ||
  { echo "name at least one --test, --bench or --headroom-bench (see --help)" >&2; exit 2; }
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_BENCH_DEBUG=0
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/.gpu-quick/bin" "$stage/.gpu-quick/benches" .gpu-carry
workspace=(--workspace --all-features --exclude headroom-python)
# The executable cargo reports for one target (its `Executable ... (path)` line).
executable() { grep -o '([^()]*/release/deps/[^()]*)' | tr -d '()' | tail -1; }
for name in "${tests[@]}"; do
  exe=$(cargo test --release --no-run "${workspace[@]}" --test "$name" 2>&1 | tee /dev/stderr | executable)
  [[ -n $exe ]] || { echo "no test target named $name" >&2; exit 1; }
  cp "$exe" "$stage/.gpu-quick/bin/$name"
done
for name in "${benches[@]}"; do
  exe=$(cargo bench --no-run "${workspace[@]}" --bench "$name" 2>&1 | tee /dev/stderr | executable)
  [[ -n $exe ]] || { echo "no bench target named $name" >&2; exit 1; }
  cp "$exe" "$stage/.gpu-quick/benches/$name"
done
if (( headroom_bench )); then
  cargo build --release -p headroom-bench
  cp "${CARGO_TARGET_DIR:-target}/release/headroom-bench" "$stage/.gpu-quick/bin/"
fi
strip "$stage"/.gpu-quick/bin/* "$stage"/.gpu-quick/benches/* 2>/dev/null || true
# One xz stream with a dictionary wider than all the binaries together: they share most of their
# code, so 10 binaries (about 200 MB) pack into about 6 MB, where xz -6 over threads' blocks gave
# 18 MB (the device tool carries 64 MiB with the working tree).
tar cf - -C "$stage" .gpu-quick | xz -T1 --lzma2=preset=9,dict=512MiB > .gpu-carry/quick.tar.xz
echo "packed $(find "$stage/.gpu-quick" -type f | wc -l) binaries: .gpu-carry/quick.tar.xz" \
  "($(du -h .gpu-carry/quick.tar.xz | cut -f1))"
