#!/usr/bin/env bash
# Packs benches and tests built several times, once per version of one kernel's PTX, for an A/B
# of kernel versions in one device call: every binary embeds the gzipped PTX (include_bytes!), so
# swapping the committed .ptx.gz file and building again gives a binary of that version, with no
# other source changed. A version is a git revision (the file as committed there; a revision
# from before the PTX was gzipped gives its plain .ptx, gzipped here) or a path to a .ptx or
# .ptx.gz file (an uncommitted variant, e.g. nvcc's output under other launch bounds). Run from
# the workspace root on the development machine:
#   bash scripts/gpu-variants.sh --ptx PATH [--bench NAME]... [--test NAME]... VERSION=REV|FILE...
#   e.g. bash scripts/gpu-variants.sh --ptx crates/optim/kernels/ptx/adam4bit.ptx.gz \
#          --bench cuda_adam --test cuda_adam4bit base=579a00b new=HEAD staged=wip/adam4bit-staged
# The binaries land in .gpu-variants/<target>_<version>, packed into .gpu-carry/variants.tar.xz;
# carry it and scripts/gpu-call.sh unpacks it (run each from the workspace root, tests with
# HEADROOM_REQUIRE_GPU=1 and --include-ignored). The working tree's PTX file is put back after.
set -euo pipefail
ptx='' tests=() benches=() versions=()
while (( $# )); do
  case $1 in
    --ptx) ptx=${2:?--ptx takes the PTX file to swap}; shift 2 ;;
    --test) tests+=("${2:?--test takes a target name}"); shift 2 ;;
    --bench) benches+=("${2:?--bench takes a target name}"); shift 2 ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *=*) versions+=("$1"); shift ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -f Cargo.toml && -d crates ]] || { echo "run from the workspace root" >&2; exit 2; }
[[ -f $ptx ]] || { echo "--ptx names no file: '$ptx' (see --help)" >&2; exit 2; }
(( ${#versions[@]} )) || { echo "name at least one VERSION=REV|FILE (see --help)" >&2; exit 2; }
(( ${#tests[@]} + ${#benches[@]} )) || { echo "name at least one --bench or --test" >&2; exit 2; }
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_BENCH_DEBUG=0
stage=$(mktemp -d)
saved=$(mktemp)
cp "$ptx" "$saved"
trap 'cp "$saved" "$ptx"; rm -rf "$stage" "$saved"' EXIT
mkdir -p "$stage/.gpu-variants" .gpu-carry
workspace=(--workspace --all-features --exclude headroom-python)
# The executable cargo reports for one target (its `Executable ... (path)` line).
executable() { grep -o '([^()]*/release/deps/[^()]*)' | tr -d '()' | tail -1; }
for version in "${versions[@]}"; do
  name=${version%%=*} source=${version#*=}
  if [[ -f $source && $source == *.gz ]]; then
    cp "$source" "$ptx"
  elif [[ -f $source ]]; then
    gzip -9 -n -c "$source" > "$ptx"
  elif ! git show "$source:$ptx" > "$ptx" 2> /dev/null; then
    git show "$source:${ptx%.gz}" | gzip -9 -n > "$ptx" ||
      { echo "no $ptx (nor ${ptx%.gz}) at $source" >&2; exit 1; }
  fi
  for target in "${benches[@]}"; do
    exe=$(cargo bench --no-run "${workspace[@]}" --bench "$target" 2>&1 | executable)
    [[ -n $exe ]] || { echo "no bench target named $target" >&2; exit 1; }
    cp "$exe" "$stage/.gpu-variants/${target}_$name"
  done
  for target in "${tests[@]}"; do
    exe=$(cargo test --release --no-run "${workspace[@]}" --test "$target" 2>&1 | executable)
    [[ -n $exe ]] || { echo "no test target named $target" >&2; exit 1; }
    cp "$exe" "$stage/.gpu-variants/${target}_$name"
  done
  echo "built $name ($source)"
done
strip "$stage"/.gpu-variants/* 2>/dev/null || true
# One xz stream with a wide dictionary: the binaries differ in little but their PTX.
tar cf - -C "$stage" .gpu-variants | xz -T1 --lzma2=preset=9,dict=512MiB > .gpu-carry/variants.tar.xz
echo "packed $(find "$stage/.gpu-variants" -type f | wc -l) binaries: .gpu-carry/variants.tar.xz" \
  "($(du -h .gpu-carry/variants.tar.xz | cut -f1))"
