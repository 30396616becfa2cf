#!/usr/bin/env bash
# Device script for the `headroom` Python package: installs the wheel (and bitsandbytes if
# carried), checks bad input, trains ViT-L/16 and GPT-2 small on three allocators (GPT-2 in two
# interleaved rounds), compares the optimizers and summarises the runs (summarize.py).
# Usage: bash run.sh DIR STEPS (DIR holds the wheel, bnb.tar.xz and the scripts).
set -uo pipefail
DIR=$1; STEPS=${2:-200}
export HEADROOM_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$DIR"/headroom-*.whl
python3 -c "import bitsandbytes" 2>/dev/null || tar xJf "$DIR/bnb.tar.xz" -C /tmp/site
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, headroom; print('torch', torch.__version__)"
timeout 40 python3 "$DIR/checks.py" 2>&1 | tee "$OUT/checks.log"
for alloc in native expandable headroom; do
  timeout 150 python3 "$DIR/train.py" --model vit --alloc $alloc --steps "$STEPS" 2>&1 | grep -v Warning | tee -a "$OUT/train.jsonl"
done
timeout 120 python3 "$DIR/optim_compare.py" 2>&1 | tee "$OUT/optim.jsonl"
# GPT-2's steps vary with their lengths, and a machine drifts over minutes: a second round of
# native and Headroom pairs each run with the native run just before it.
for alloc in native expandable headroom native headroom; do
  timeout 90 python3 "$DIR/train.py" --model gpt2 --alloc $alloc --steps "$STEPS" 2>&1 | grep -v Warning | tee -a "$OUT/train.jsonl"
done
python3 "$DIR/summarize.py" "$OUT/train.jsonl" | tee "$OUT/summary.txt"
