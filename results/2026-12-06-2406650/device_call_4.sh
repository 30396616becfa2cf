#!/usr/bin/env bash
# Session 20, call 4 at 2406650 (main's GPU head 9461061; quick kernels bench built at f388211):
# where the Hopper default's forward + backward spends its time, kernel by kernel, under Nsight
# Compute (gpu__time_duration, the GPU's own clocks: --clock-control none), at issue 35's full and
# causal shapes at head dim 128: the forward, the backward's Δ, wgmma's dQ and the
# warp-specialised dK/dV. For the next speed step (dQ inside the warp-specialised kernel).
w=/tmp/headroom-call
mkdir -p $w
nvidia-smi > $w/smi.txt
ncu --version >> $w/smi.txt 2>&1
for mask in full causal; do
  timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum -k regex:^attention --launch-count 12 \
    .gpu-quick/benches/kernels --bench "hopper_attention/bf16_${mask}_fwd_bwd_default_b4_h16_s4096_d128" \
    > $w/ncu_${mask}_d128.log 2>&1
  echo "ncu_${mask}_d128: rc=$?" >> $w/steps.txt
  tar cJf "$OUT/results.tar.xz" -C $w .
done
