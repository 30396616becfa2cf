#!/usr/bin/env bash
# Session 17, one call: the warp-specialised attention's parity test (every build, progress on
# stderr), issue 32's small-copy A/B (Llama-3.2-1B batch 8, streamed moments: reads and writes
# of <= 4/16 KiB through a kernel, then through the copy engine), the attention kernels beside
# PyTorch's SDPA backends, racecheck and memcheck of the Hopper attention test, then as much of the
# whole GPU bundle as the call's time leaves. Steps are skipped when the time left is short.
w=/tmp/headroom-call
B=.gpu-bundle/bin Q=.gpu-quick
export HEADROOM_REQUIRE_GPU=1 RESULTS=$w/measure
pack() { tar cJf "$OUT/results.tar.xz" -C $w . ; }
deadline=520
left() { echo $((deadline - SECONDS)); }
run_step() { # name seconds command... : runs when that many seconds are left, logs to name.log
  local name=$1 need=$2; shift 2
  if (( $(left) < need )); then echo "$name: skipped, $(left) s left" >> $w/steps.txt; return; fi
  local t0=$SECONDS
  timeout "$need" "$@" > "$w/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s" | tee -a $w/steps.txt >> "$w/$name.log"
  pack
}
nvidia-smi > $w/smi.txt
run_step attention_wgmma 150 $Q/bin/attention_wgmma --include-ignored --nocapture --test-threads 1
for variant in kernel engine; do
  flags=(); [[ $variant == engine ]] && flags=(--copy-engine-copies)
  run_step streamed_l1b_$variant 90 $B/headroom-bench bench-memory --device cuda --seq 2048 --steps 5 \
    --model llama-3.2-1b --batch 8 --cases adamw_inbwd_bf16,adamw_offload_stream_inbwd_bf16 \
    "${flags[@]}" --json $w/streamed_l1b_$variant.json
done
run_step kernels_attention 110 $Q/benches/kernels --bench attention
cp $w/kernels_attention.log $w/kernels_attention.txt 2>/dev/null
run_step attention_torch_issue35 80 python3 scripts/pytorch/attention_reference.py --shape issue35 --out $w/attention_reference_issue35.jsonl
export HEADROOM_NO_CUDA_MEMORY_CACHING=1
run_step racecheck_wgmma 60 compute-sanitizer --tool racecheck --error-exitcode 86 $Q/bin/attention_wgmma --include-ignored --test-threads 1
run_step memcheck_wgmma 60 compute-sanitizer --tool memcheck --error-exitcode 86 $Q/bin/attention_wgmma --include-ignored --test-threads 1
unset HEADROOM_NO_CUDA_MEMORY_CACHING
rm -f $B/attention_wgmma-*
(( $(left) > 30 )) && run_step tests $(left) bash scripts/gpu-measure.sh tests
pack
