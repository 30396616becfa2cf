#!/usr/bin/env bash
# Session 20, call 1: two branches of the warp-specialised dK/dV kernel's statistics hand-over,
# neither run on a GPU before, one after the other:
#   rendezvous/  wip/ws-stats-rendezvous (0bc2baa): producer warp and consumers meet on a
#                blocking bar.sync 2, 288 once a step (.gpu-carry/quick.tar.xz);
#   all_arrive/  wip/ws-stats-all-arrive (9461061): every producer lane and every consumer thread
#                arrives on the stage's mbarriers (.gpu-carry/quick-arrive.tar.xz).
# For each: the Hopper attention test (every build, the default, 0), racecheck and memcheck of
# it, then the Hopper default's forward + backward at issue 35's shapes. Results packed after
# each step.
w=/tmp/headroom-call
export HEADROOM_REQUIRE_GPU=1
pack() { tar cJf "$OUT/results.tar.xz" -C $w . ; }
deadline=540
left() { echo $((deadline - SECONDS)); }
run_step() { # name seconds command... : runs when that many seconds are left, logs to name.log
  local name=$1 need=$2; shift 2
  if (( $(left) < need )); then echo "$name: skipped, $(left) s left" >> $w/steps.txt; return 99; fi
  local t0=$SECONDS
  timeout "$need" "$@" > "$w/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0)) s" | tee -a $w/steps.txt >> "$w/$name.log"
  pack
  return $rc
}
nvidia-smi > $w/smi.txt
mkdir -p /tmp/all_arrive && tar xJf .gpu-carry/quick-arrive.tar.xz -C /tmp/all_arrive
for variant in rendezvous all_arrive; do
  Q=.gpu-quick
  [[ $variant == all_arrive ]] && Q=/tmp/all_arrive/.gpu-quick
  mkdir -p $w/$variant
  run_step $variant/test_attention_wgmma 60 $Q/bin/attention_wgmma --include-ignored --test-threads 1 --show-output
  export HEADROOM_NO_CUDA_MEMORY_CACHING=1
  run_step $variant/racecheck_wgmma 120 compute-sanitizer --tool racecheck --error-exitcode 86 $Q/bin/attention_wgmma --include-ignored --test-threads 1
  run_step $variant/memcheck_wgmma 25 compute-sanitizer --tool memcheck --error-exitcode 86 $Q/bin/attention_wgmma --include-ignored --test-threads 1
  unset HEADROOM_NO_CUDA_MEMORY_CACHING
  run_step $variant/hopper_attention 30 $Q/benches/kernels --bench 'hopper_attention/bf16_.*_fwd_bwd_default_b4'
done
pack
