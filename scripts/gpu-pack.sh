#!/usr/bin/env bash
# Packs what a device call needs into the two ignored folders that travel with the working tree
# (the device tool's `carry`), under its 64 MiB limit for the tree and everything carried (the
# tracked tree alone is about 44 MiB on disk, the gzipped PTX 4 of them):
#   .gpu-carry/bundle.tar.xz   the release test binaries that hold GPU tests (every binary with
#                              an ignored test: the CPU-only ones run in CI) and headroom-bench,
#                              about 11 MB (700 MB unpacked: each binary embeds the PTX)
#   .whl/                      the `headroom` wheel (release, about 7 MB) and torchao 0.18's
#                              (3.4 MB), which the device machine lacks
# Run from the workspace root on the development machine (cargo, maturin or $MATURIN, pip):
#   bash scripts/gpu-pack.sh [--no-wheel] [--no-bundle]
# Then one device call: `COMMIT=<hash> bash scripts/gpu-call.sh PHASE... [py:PART...]`, which does
# the following and packs the results; by hand, on the device, from the workspace root:
#   tar xJf .gpu-carry/bundle.tar.xz        # restores .gpu-bundle/bin
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
#   bash scripts/gpu-measure.sh tests plans ...
# with carry [".gpu-carry", ".whl"]. The device returns at most 8 files of $OUT: write logs to a
# folder of /tmp and tar it into $OUT at the end.
set -euo pipefail
wheel=1 bundle=1
for arg in "$@"; do
  case $arg in
    --no-wheel) wheel=0 ;;
    --no-bundle) bundle=0 ;;
    -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
[[ -f Cargo.toml && -d crates ]] || { echo "run from the workspace root" >&2; exit 2; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
mkdir -p .gpu-carry .whl
if (( bundle )); then
  cargo build --release -p headroom-bench
  ../shared/tools/gpu-bundle.sh --bin target/release/headroom-bench -- --workspace \
    --all-features --exclude headroom-python --exclude headroom-distributed \
    --exclude headroom-bench --exclude xtask
  stage=$(mktemp -d)
  mkdir -p "$stage/.gpu-bundle/bin"
  for exe in .gpu-bundle/bin/*; do
    name=$(basename "$exe")
    # The listing is read whole before grep: `... | grep -q` closes the pipe at its first match,
    # and under pipefail the test binary's SIGPIPE would drop a binary that has GPU tests.
    listing=$("$exe" --list --ignored 2>/dev/null || true)
    if [[ $name == headroom-bench ]] || grep -q ': test$' <<< "$listing"; then
      cp "$exe" "$stage/.gpu-bundle/bin/"
    fi
  done
  echo "$(ls "$stage/.gpu-bundle/bin" | wc -l) binaries with GPU tests (and headroom-bench)"
  tar cf - -C "$stage" .gpu-bundle | xz -T1 --lzma2=preset=9,dict=512MiB > .gpu-carry/bundle.tar.xz
  rm -rf "$stage"
fi
if (( wheel )); then
  rm -f .whl/headroom-*.whl
  "${MATURIN:-maturin}" build -q --release -m crates/python/Cargo.toml -o .whl
  ls .whl/torchao-0.18.0-*.whl >/dev/null 2>&1 ||
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      -d .whl torchao==0.18.0
fi
# The device tool counts what travels as disk usage, not bytes: it refused a tree of 49.5 MiB of
# tracked bytes with a 13.1 MiB bundle (62.6 MiB, but 68.6 MiB on disk). Since the PTX is
# committed gzipped (23 MiB of it in 4) the tree and the bundle travel whole, as committed.
# du reads the whole list itself: split by xargs, tail would count its last part alone.
tracked=$(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1)
carried=$(du -ck .gpu-carry .whl 2> /dev/null | tail -1 | cut -f1)
echo "travels: $(( (tracked + carried) / 1024 )) MiB of 64 on disk (tracked $(( tracked / 1024 )), carried $(( carried / 1024 )))"
