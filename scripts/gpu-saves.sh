#!/usr/bin/env bash
# What a block keeps for backward, measured: ViT-L/16 at batch 32 (fused Adam, every block but
# the last checkpointed, and the planner at budgets from 5.5 GB up) and GPT-2 small at batch
# 8 x 1024 (forward + backward, f32 and bf16), by one headroom-bench binary. Run it with two
# binaries in one device call to compare two versions of the models on the same GPU:
#   bash scripts/gpu-saves.sh BENCH OUT_DIR [TAG]
# e.g. (issue 36's gelu_linear, against the build before it, carried as an xz file):
#   bash scripts/gpu-saves.sh .gpu-bundle/bin/headroom-bench /tmp/saves new
#   bash scripts/gpu-saves.sh /tmp/headroom-bench-37184de /tmp/saves old
# Files: OUT_DIR/TAG_vit.json, TAG_planner_<budget>.json, TAG_gpt2.json and a .log beside each.
set -uo pipefail
if [[ $# -lt 2 || $1 == -h || $1 == --help ]]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
bench=$1 out=$2 tag=${3:-run}
mkdir -p "$out"
run() { # name args...
  local name=$1; shift
  local start=$SECONDS
  "$bench" "$@" > "$out/${tag}_$name.log" 2>&1
  echo "$tag $name: rc=$?, $((SECONDS - start)) s"
}
run vit bench-memory --device cuda --batch 32 --cases adam_fused,adam_ckpt \
  --json "$out/${tag}_vit.json"
for budget in 5500000000 6000000000 6717334272 8110652416 9503970560 10897288704 12290606848 \
  13683924992; do
  run "planner_$budget" bench-memory --device cuda --batch 32 --cases adam_auto \
    --budget "$budget" --json "$out/${tag}_planner_$budget.json"
done
run gpt2 bench-memory --device cuda --model gpt2 --seq 1024 --batch 8 \
  --cases fwd_bwd,fwd_bwd_bf16,adam_fused --json "$out/${tag}_gpt2.json"
