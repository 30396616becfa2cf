#!/usr/bin/env bash
# One device call over a tree packed by scripts/gpu-pack.sh (carry [".gpu-carry", ".whl"]): it
# unpacks .gpu-carry/bundle.tar.xz into .gpu-bundle (and scripts/gpu-quick.sh's quick.tar.xz into
# .gpu-quick, scripts/gpu-variants.sh's variants.tar.xz into .gpu-variants, for cmd: steps to
# run), installs .whl/*.whl into /tmp/site, runs
# the gpu-measure.sh phases and the techniques.sh parts it is given, in order, and tars every
# log and result into $OUT/results.tar.xz (the device tool returns eight files at most), with
# run.log beside it: each step's exit status and seconds. The results are packed again after
# every step, so a call cut off by the tool's limit still returns what finished.
#   COMMIT=<short hash> bash scripts/gpu-call.sh PHASE... [py:PART...] [cmd:NAME:COMMAND...]
#   e.g. COMMIT=e791612 bash scripts/gpu-call.sh tests plans py:tests py:optim
# PHASE: a phase of scripts/gpu-measure.sh (its --help lists them); py:PART: a part of
# crates/python/bench/techniques.sh (tests, in_backward, saved, optim, clients, examples), run
# together after the phases; cmd:NAME:COMMAND: a command of its own (bash -c, the wheels on
# PYTHONPATH), its output in NAME.log, run last in the order given; a script it runs takes its
# steps' limits and packing from scripts/gpu-steps.sh (source it).
# COMMIT names the sources (the device's copy has no .git). Mind the ten-minute limit of a call:
# the tests phase takes about 3 minutes, py:tests 1, py:optim 1, plans 4, find-max-model 10.
# The tool counts the tree on disk: gpu-pack.sh prints what a call with its bundle carries.
set -uo pipefail
if [[ $# == 0 || $1 == -h || $1 == --help ]]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
: "${COMMIT:?set COMMIT to the short hash of the sources}"
: "${OUT:?run on the device tool, which sets OUT}"
work=/tmp/headroom-call
mkdir -p "$work" /tmp/site
export RESULTS=$work/measure HEADROOM_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
start=$SECONDS
log() { echo "[$((SECONDS - start)) s] $*" | tee -a "$OUT/run.log"; }
if [[ -f .gpu-carry/bundle.tar.xz ]]; then
  tar xJf .gpu-carry/bundle.tar.xz
  log "bundle unpacked: $(ls .gpu-bundle/bin | wc -l) binaries"
fi
if [[ -f .gpu-carry/quick.tar.xz ]]; then
  tar xJf .gpu-carry/quick.tar.xz
  log "quick binaries unpacked (scripts/gpu-quick.sh): $(ls .gpu-quick/bin .gpu-quick/benches | grep -vc ':$')"
fi
if [[ -f .gpu-carry/variants.tar.xz ]]; then
  tar xJf .gpu-carry/variants.tar.xz
  log "kernel variants unpacked (scripts/gpu-variants.sh): $(ls .gpu-variants | wc -l)"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    > "$work/pip.log" 2>&1
  log "wheels installed: rc=$?"
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
pack() { tar cJf "$OUT/results.tar.xz" -C "$work" .; }
parts=() commands=()
for phase in "$@"; do
  if [[ $phase == py:* ]]; then
    parts+=("${phase#py:}")
    continue
  fi
  if [[ $phase == cmd:* ]]; then
    commands+=("${phase#cmd:}")
    continue
  fi
  bash scripts/gpu-measure.sh "$phase" > "$work/measure_$phase.txt" 2>&1
  log "measure $phase: rc=$? ($(grep -c 'rc=[^0]' "$work/measure_$phase.txt") step(s) failing)"
  pack
done
if (( ${#parts[@]} )); then
  PARTS=$(IFS=,; echo "${parts[*]}") OUT=$work/python \
    bash crates/python/bench/techniques.sh .whl > "$work/techniques.txt" 2>&1
  log "python ${parts[*]}: rc=$?"
  grep -h "FAILED\|passed\|failed" "$work/techniques.txt" | tail -5 | tee -a "$OUT/run.log"
  pack
fi
for command in "${commands[@]}"; do
  name=${command%%:*}
  bash -c "${command#*:}" > "$work/$name.log" 2>&1
  log "$name: rc=$?"
  pack
done
pack
log "results packed: $(du -h "$OUT/results.tar.xz" | cut -f1)"
