#!/usr/bin/env bash
# The GPU figures of the README, ours beside PyTorch's in the same run, in phases that each fit
# a ten-minute slot. Run on the GPU machine from the workspace root, with the test binaries and a
# release xtask in .gpu-bundle/bin (build them where cargo is, no GPU needed:
#   cargo build --release -p xtask
#   ../shared/tools/gpu-bundle.sh --bin target/release/xtask -- --workspace --all-features \
#       --exclude headroom-python --exclude headroom-distributed
# or copy `cargo test --release --no-run` executables and target/release/xtask there yourself).
#
#   bash scripts/gpu-measure.sh PHASE...      PHASE: tests vit gpt2 fmb planner reclaim noreclaim
#                                                    plugin
#
# tests    every test binary with HEADROOM_REQUIRE_GPU=1 (a skip is a failure)
# vit      bench-memory, ViT-L/16 at batch 1 and 32, every case, then PyTorch's cases
#          (scripts/pytorch/bench_reference.py) in the same run, as --pytorch reads them
# gpt2     GPT-2 small, batch 8 × 1024 tokens, forward + backward in f32 and bf16, both sides
# fmb      find-max-batch under a 24 GiB cap, PyTorch's side first
# planner  adam_auto at five budgets evenly between adam_ckpt's peak (5,324,016,128 B) and
#          adam_fused's (13,683,924,992 B) at 91ab5d2 (ViT-L/16, batch 32)
# reclaim  bench-memory with the default allocator against AllocatorConfig::reclaiming()
# noreclaim the same cases without reclaiming (reclaim_free_pages:False, the default before
#          reclaim_settles)
# plugin   the `headroom` wheel in PyTorch trainers (crates/python/bench/run.sh, 200 steps a run):
#          PLUGIN_DIR holds the wheel (maturin build --release -m crates/python/Cargo.toml) and
#          bnb.tar.xz (bitsandbytes 0.50 for --target install), copied beside run.sh's scripts.
#          With PLUGIN_DIR set, fmb's PyTorch side finds bitsandbytes too (its adam8bit case).
#
# Output: OUT (default /tmp/gpu-measure) gets one log per phase and the JSON files.
set -uo pipefail
export HEADROOM_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-measure}
mkdir -p "$out"
bin=.gpu-bundle/bin
xtask=$bin/xtask
[[ -x $xtask ]] || { echo "no $xtask: build the bundle first (see the header)" >&2; exit 2; }
(( $# > 0 )) || { sed -n '2,26p' "$0"; exit 2; }
if [[ -n ${PLUGIN_DIR:-} && -f $PLUGIN_DIR/bnb.tar.xz ]]; then
  mkdir -p /tmp/headroom-site
  python3 -c "import bitsandbytes" 2>/dev/null || tar xJf "$PLUGIN_DIR/bnb.tar.xz" -C /tmp/headroom-site
  export PYTHONPATH=/tmp/headroom-site${PYTHONPATH:+:$PYTHONPATH}
fi
failed=0
step() { # name command...
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  (( rc != 0 )) && failed=$((failed + 1))
  echo "$name: rc=$rc, $((SECONDS - start)) s"
}
for phase in "$@"; do
  case $phase in
    tests)
      for t in "$bin"/*; do
        case $(basename "$t") in xtask*) continue ;; esac
        step "test_$(basename "$t" | sed 's/-[0-9a-f]*$//')" "$t"
      done
      grep -l "skipped: no CUDA" "$out"/test_*.log && failed=$((failed + 1)) ;;
    vit)
      step vit_ours "$xtask" bench-memory --device cuda --batch 1 --batch 32 --json "$out/vit.json"
      step vit_torch python3 scripts/pytorch/bench_reference.py --batch 1 --batch 32 \
        --out "$out/anchor_vit.jsonl"
      step vit_table "$xtask" bench-memory --device cuda --batch 32 \
        --cases adam_fused,adam_ckpt,adam_inbwd_ckpt,adam_bf16,adam_fp16 \
        --pytorch "$out/anchor_vit.jsonl" --json "$out/vit_again.json" ;;
    gpt2)
      step gpt2_torch python3 scripts/pytorch/bench_reference.py --in-process --model gpt2 \
        --seq 1024 --batch 8 --cases fwd_bwd,fwd_bwd_bf16,adam_fused --out "$out/anchor_gpt2.jsonl"
      step gpt2_ours "$xtask" bench-memory --device cuda --model gpt2 --seq 1024 --batch 8 \
        --cases fwd_bwd,fwd_bwd_bf16,adam_fused --pytorch "$out/anchor_gpt2.jsonl" \
        --json "$out/gpt2.json" ;;
    fmb)
      step fmb_torch python3 scripts/pytorch/find_max_batch.py --memory-cap-mb 24576 \
        --out "$out/fmb_torch.jsonl"
      step fmb_ours "$xtask" find-max-batch --device cuda --memory-cap-mb 24576 \
        --pytorch "$out/fmb_torch.jsonl" --json "$out/fmb.json" ;;
    planner)
      for budget in 6717334272 8110652416 9503970560 10897288704 12290606848; do
        step "planner_$budget" "$xtask" bench-memory --device cuda --batch 32 --cases adam_auto \
          --budget "$budget" --json "$out/planner_$budget.json"
      done ;;
    reclaim)
      cases=adam_fused,adam_inbwd,adam_ckpt
      step reclaim_default "$xtask" bench-memory --device cuda --batch 1 --batch 32 \
        --cases $cases --json "$out/reclaim_default.json"
      HEADROOM_ALLOC_CONF=reclaim_free_pages:True,reclaim_settles:False step reclaim_on \
        "$xtask" bench-memory --device cuda --batch 1 --batch 32 --cases $cases \
        --json "$out/reclaim_on.json" ;;
    noreclaim)
      HEADROOM_ALLOC_CONF=reclaim_free_pages:False step reclaim_off "$xtask" bench-memory \
        --device cuda --batch 1 --batch 32 --cases adam_fused,adam_inbwd,adam_ckpt \
        --json "$out/reclaim_off.json" ;;
    plugin)
      [[ -n ${PLUGIN_DIR:-} ]] || { echo "plugin: set PLUGIN_DIR (see the header)" >&2; exit 2; }
      cp crates/python/bench/*.py crates/python/bench/run.sh "$PLUGIN_DIR"/
      export OUT=$out
      step plugin bash "$PLUGIN_DIR/run.sh" "$PLUGIN_DIR" 200 ;;
    *) echo "unknown phase $phase (tests vit gpt2 fmb planner reclaim noreclaim plugin)" >&2; exit 2 ;;
  esac
done
echo "$failed step(s) failed; logs in $out"
(( failed == 0 ))
