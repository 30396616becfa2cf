#!/usr/bin/env bash
# The step runner of a device call's own script (scripts/gpu-call.sh's `cmd:NAME:bash FILE`), to
# be sourced, so each call's script holds only its steps: every step gets a time limit and runs
# only while the call's deadline leaves it that much, logs to $GPU_STEPS_DIR/NAME.log, appends its
# exit status and seconds to steps.txt there, and packs that folder into $OUT/results.tar.xz, so a
# call cut off by the device tool's limit still returns what finished.
#   source scripts/gpu-steps.sh [DEADLINE]      # seconds from here, default 560
#   run_step NAME SECONDS COMMAND...            # NAME may hold a folder: a/b logs to a/b.log
#   pack                                        # once more at the end
# GPU_STEPS_DIR defaults to /tmp/headroom-call, the folder gpu-call.sh packs too.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
GPU_STEPS_DIR=${GPU_STEPS_DIR:-/tmp/headroom-call}
gpu_steps_end=$((SECONDS + ${1:-560}))
mkdir -p "$GPU_STEPS_DIR"
pack() { tar cJf "$OUT/results.tar.xz" -C "$GPU_STEPS_DIR" . ; }
left() { echo $((gpu_steps_end - SECONDS)); }
run_step() {
  local name=$1 need=$2; shift 2
  if (( $(left) < need )); then
    echo "$name: skipped, $(left) s left" >> "$GPU_STEPS_DIR/steps.txt"
    return 99
  fi
  mkdir -p "$(dirname "$GPU_STEPS_DIR/$name")"
  local t0=$SECONDS
  timeout "$need" "$@" > "$GPU_STEPS_DIR/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0)) s" | tee -a "$GPU_STEPS_DIR/steps.txt" >> "$GPU_STEPS_DIR/$name.log"
  pack
  return $rc
}
