#!/usr/bin/env bash
# The GPU figures of the README, ours beside PyTorch's in the same run, in phases that each fit
# a ten-minute slot. Run on the GPU machine from the workspace root, with the test binaries and a
# release headroom-bench (the binary `cargo xtask bench-memory` runs; $BENCH names another, e.g.
# scripts/gpu-quick.sh's .gpu-quick/bin/headroom-bench) in .gpu-bundle/bin (build
# them where cargo is, no GPU needed:
#   cargo build --release -p headroom-bench
#   ../shared/tools/gpu-bundle.sh --bin target/release/headroom-bench -- --workspace \
#       --all-features --exclude headroom-python --exclude headroom-distributed \
#       --exclude headroom-bench --exclude xtask
# or copy `cargo test --release --no-run` executables and target/release/headroom-bench there
# yourself; scripts/gpu-pack.sh packs the GPU test binaries, headroom-bench and the wheel under
# the device tool's 64 MiB). The bench phases run bench executables from .gpu-bundle/benches
# (BENCHES overrides it; not bin/, whose every binary the tests phase runs as a test), found by
# name as NAME-<hash> (vit_step, cuda_adam, cuda_alloc, allocator, cpu_vit, cpu_gemm); build them after
# the bundle (gpu-bundle.sh empties .gpu-bundle):
#   mkdir -p .gpu-bundle/benches && CARGO_PROFILE_BENCH_DEBUG=0 cargo bench --no-run \
#       -p headroom-ops-cuda -p headroom-optim -p headroom-caching-allocator -p headroom-nn \
#       -p headroom-ops-cpu -p headroom \
#       --features headroom-ops-cuda/cuda,headroom-optim/cuda,headroom-caching-allocator/cuda \
#       --bench vit_step --bench cuda_adam --bench cuda_alloc --bench allocator \
#       --bench cpu_vit --bench cpu_gemm 2>&1 | tee .gpu-bundle/benches.log |
#     sed -n 's/^ *Executable .*(\(.*\))$/\1/p' | xargs -I{} cp {} .gpu-bundle/benches/ &&
#     strip .gpu-bundle/benches/*
# (cpu-benches needs only cpu_vit and cpu_gemm, and no GPU: it runs on any machine.) The phases
# fused-ce and llama-parity run ops-cuda's examples of those names from the same folder (NAME
# alone is found too):
#   cargo build --release -p headroom-ops-cuda --features cuda --example fused_ce_bench \
#       --example llama_loss_parity &&
#     cp target/release/examples/fused_ce_bench target/release/examples/llama_loss_parity \
#       .gpu-bundle/benches/
#
#   bash scripts/gpu-measure.sh PHASE...      PHASE: tests vit gpt2 fmb fmb-llama planner reclaim
#                                                    noreclaim plugin benches llama llama8b fp8
#                                                    fp8-torch
#                                                    llama-parity kernels sanitizer
#                                                    fused-ce plans
#                                                    find-max-model streamed
#                                                    allocator-benches cpu-benches
#
# tests    every test binary with --include-ignored (the GPU tests are marked
#          #[ignore = "needs a CUDA device"], so a plain run leaves them out) and
#          HEADROOM_REQUIRE_GPU=1 (a skip is a failure), with --show-output so that what passing
#          tests print reaches the log. The multi-GPU test binaries (multi_gpu_tests below:
#          distributed's nccl) are left out by name, saying so: under HEADROOM_REQUIRE_GPU=1 a
#          test that sees fewer GPUs than it needs fails, and scripts/gpu-data-parallel.sh runs
#          them on two GPUs
# vit      bench-memory, ViT-L/16 at batch 1 and 32, every case but adam_auto (the planner's
#          phase), then PyTorch's cases (scripts/pytorch/bench_reference.py) in the same run, as
#          --pytorch reads them
# gpt2     GPT-2 small, batch 8 × 1024 tokens, forward + backward in f32 and bf16, both sides
# fmb      find-max-batch under a 24 GiB cap, PyTorch's side first
# fmb-llama  find-max-batch of Llama-3.2-1B at 2048 tokens a row under a 24 GiB cap
#          (LLAMA_FMB_CAP_MB overrides it, and the files' names carry it: fmb_llama1b_<cap>.json,
#          fmb_llama1b_<cap>_torch.jsonl), the cases fwd_bwd (f32), fwd_bwd_bf16,
#          fwd_bwd_bf16_ckpt and adam_inbwd_ckpt_bf16, Hugging Face's LlamaForCausalLM (SDPA,
#          scripts/pytorch/find_max_batch.py) first, then ours beside it
# planner  adam_auto at five budgets evenly between adam_ckpt's peak (5,324,016,128 B) and
#          adam_fused's (13,683,924,992 B) at 91ab5d2 (ViT-L/16, batch 32)
# reclaim  bench-memory with the default allocator against AllocatorConfig::reclaiming()
# noreclaim the same cases without reclaiming (reclaim_free_pages:False, the default before
#          reclaim_settles)
# plugin   the `headroom` wheel in PyTorch trainers (crates/python/bench/run.sh, 200 steps a run):
#          PLUGIN_DIR holds the wheel (maturin build --release -m crates/python/Cargo.toml) and
#          bnb.tar.xz (bitsandbytes 0.50 for --target install), copied beside run.sh's scripts.
#          With PLUGIN_DIR set, fmb's PyTorch side finds bitsandbytes too (its adam8bit case).
# benches  the CUDA benches that print JSON lines, each beside PyTorch's side of its setting:
#          crates/ops-cuda/benches/vit_step.rs (ViT-L/16 SGD steps, fp32 at batch 1 and 32, the
#          bf16 model at batch 32; vit_step.jsonl) and bench_reference.py's sgd at batch 1 and 32
#          and sgd_bf16_model at 32 (anchor_vit_step.jsonl); crates/optim/benches/cuda_adam.rs
#          (Adam on 1e9 parameters; cuda_adam.jsonl) and scripts/pytorch/adam_step_1e9.py
#          (adam_step_1e9_torch.jsonl; its bitsandbytes line needs PLUGIN_DIR as fmb's does).
#          About 5 minutes
# allocator-benches  the cached allocate + free pair (criterion, --bench): on CUDA, with the
#          driver's own pairs and the driver call costs it prints first
#          (crates/caching-allocator/benches/cuda_alloc.rs; cuda_alloc.txt), and on host and
#          simulated storage on this machine's CPU (the workspace's allocator bench;
#          allocator.txt). About 3 minutes
# cpu-benches  the CPU backend's criterion benches (crates/nn/benches/cpu_vit.rs,
#          crates/ops-cpu/benches/cpu_gemm.rs; cpu_vit.txt, cpu_gemm.txt): no GPU needed, and
#          meta.json names the CPU
# llama    bench-memory, Llama-3.2-1B at batch 4 x 2048 in f32 and bf16 beside Hugging Face's
#          LlamaForCausalLM with SDPA (bench_reference.py --model llama-3.2-1b), same run
# fp8      issue 37: bench-memory's fp8 cases beside their bf16 ones on GPT-2 large (b8 x 1024)
#          and Llama-3.2-1B (b4 x 2048), and the op profile of each adam_fp8 step (2 minutes)
# fp8-torch  torchao's float8 training (tensorwise, compiled) on the same two models, and with
#          the optimizer in backward on GPT-2 large (12 minutes: two calls; run it beside fp8
#          when the figures are to be compared)
# llama8b  Llama-3.1-8B in bf16 at 1 x 4096, every block checkpointed, beside Hugging Face with
#          gradient_checkpointing_enable()
# llama-parity  issue 30's loss parity: ops-cuda's llama_loss_parity example writes a random-init
#          Llama-3.2-1B (f32, seed 0, TF32 off) as a Hugging Face checkpoint with 2 x 2048 token
#          ids into a temporary folder (5 GB, removed after; LLAMA_PARITY_DIR names one to keep) and
#          prints our f32 losses (llama_parity_ours.json); scripts/pytorch/llama_loss_parity.py
#          loads it into transformers' LlamaForCausalLM (SDPA and eager, TF32 off) and writes
#          llama_parity.json, failing when a loss differs from ours by over 1e-6 relative
# kernels  ops-cuda's criterion kernels bench (copy ceiling, RMSNorm, SwiGLU, rotary, grouped-
#          query and packed attention, issue 35's Hopper shapes; kernels.txt) and torch SDPA on
#          cuDNN at the same attention shapes (scripts/pytorch/attention_reference.py, and with
#          --shape issue35)
# sanitizer  compute-sanitizer memcheck and racecheck over the attention parity tests (the
#          wgmma binary, parity's attention:: tests but the Llama-sized one), 4 steps of at
#          most 4 minutes each; SANITIZE_BIN=.gpu-quick/bin takes those two binaries from
#          scripts/gpu-quick.sh's pack instead of the bundle
# fused-ce linear_cross_entropy at Llama-3.2-1B's head (.gpu-bundle/benches/fused_ce_bench,
#          ops-cuda's example) and scripts/pytorch/fused_ce_reference.py (eager, Liger, Cut
#          Cross-Entropy: install their wheels into PYTHONPATH first)
# plans    issue 32's plans measured (`plan --run --json`): Llama-3.2-1B and Llama-3.1-8B at
#          2048 tokens under the H200's 139 GiB, and 8B under 40,000 and 30,000 MiB, where the
#          plan recomputes some of the 32 blocks (plan_<model>_<cap>.json: predicted and measured
#          peak and step)
# find-max-model  issue 32's largest model on one GPU at 2048 tokens, both sides measured:
#          `plan --find-max-model --run` (the largest planned shape that runs, a smaller one
#          when it fails; fmm_plan.json), then scripts/pytorch/find_max_model.py's bisection
#          with torchao's AdamW4bit inside backward and every block checkpointed
#          (FMM_RECIPES overrides the recipes, FMM_TORCH_ARGS adds options such as an earlier
#          run's --known-fit/--known-fail bounds; fmm_torch.jsonl). Each probe builds a model of
#          up to 70B parameters: give it the ten minutes
# streamed issue 32's offload and streamed-state steps beside their on-GPU cases: Llama-3.2-1B
#          at batch 8 (f32 moments streamed) and Llama-3.1-8B at batch 1 (4-bit state streamed),
#          small copies by kernel (the default) and through the copy engine
#          (--copy-engine-copies); then the 1B case at 2.5, 5 and 10 GiB stream budgets and its
#          op profile (streamed_<model>_<variant>.json)
#
# Every step fails when its log holds the word `skipped` on any line: only testkit's gate
# prints it (`skipped: <test>: <why>`, a panic instead under HEADROOM_REQUIRE_GPU=1), and
# xtask's tidy test keeps it out of every other literal of tests, benches, examples, xtask and
# headroom-bench, so a run cannot pass by skipping in any way. It fails too when a libtest
# summary (`test result: ...`) counts an ignored test: a GPU test left out of the run.
#
# A bench step's stdout is its results file too (beside the step's log, which keeps stdout and
# stderr); criterion keeps its baselines in a temporary CRITERION_HOME, so it prints no
# comparison with an earlier run.
#
# Output: RESULTS (default results/<date>-<commit>/ under the workspace root, results/README.md)
# gets one log per step, the JSON files and meta.json: the GPU's name and driver, the CPU, the
# versions of PyTorch, transformers and bitsandbytes, the commit (git rev-parse --short HEAD,
# else COMMIT: the device machine's copy may have no .git), the date and this command. Commit
# the folder; `cargo xtask tables` renders the README tables from it.
set -uo pipefail
export HEADROOM_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
export COMMIT=$commit
[[ -n $commit ]] || { echo "no git metadata: set COMMIT to the sources' short hash" >&2; exit 2; }
out=${RESULTS:-results/$(date -u +%F)-$commit}
bin=.gpu-bundle/bin
bench=${BENCH:-$bin/headroom-bench}
benches=${BENCHES:-.gpu-bundle/benches}
# The bench executable NAME-<hash> (cargo's name for it) or NAME in $benches, if exactly one.
bench_exe() {
  local exe exes=()
  for exe in "$benches/$1"-[0-9a-f]* "$benches/$1"; do
    [[ -f $exe && -x $exe && $exe != *.d ]] && exes+=("$exe")
  done
  (( ${#exes[@]} == 1 )) && echo "${exes[0]}"
}
# The bench executables each bench phase runs.
bench_names() {
  case $1 in
    benches) echo vit_step cuda_adam ;;
    allocator-benches) echo cuda_alloc allocator ;;
    cpu-benches) echo cpu_vit cpu_gemm ;;
    llama-parity) echo llama_loss_parity ;;
  esac
}
# Every phase but `tests`, the bench phases and llama-parity runs the release headroom-bench.
for phase in "$@"; do
  if [[ $phase == *benches || $phase == llama-parity ]]; then
    for name in $(bench_names "$phase"); do
      [[ -n $(bench_exe "$name") ]] || { echo "no single $benches/$name-<hash> for phase" \
        "$phase: build the bench executables first (see the header)" >&2; exit 2; }
    done
    continue
  fi
  [[ $phase == tests || -x $bench ]] ||
    { echo "no $bench for phase $phase: build the bundle first (see the header)" >&2; exit 2; }
done
vit_cases=adam_foreach,adam_foreach_unbounded,adam_single,sgd,adam_fused,adam_inbwd,adam8bit
vit_cases+=,adam8bit_inbwd,adam_ckpt,adam_inbwd_ckpt,adam_fused_clip,adam_inbwd_clip
vit_cases+=,adam_inbwd_clip_prev,adam_offload,adam_offload_ckpt,adam_ckpt8bit,adam_bf16,adam_fp16
vit_cases+=,adam_inbwd_ckpt_bf16,fwd_bwd,fwd_bwd_bf16
(( $# > 0 )) || { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 2; }
if [[ -n ${PLUGIN_DIR:-} && -f $PLUGIN_DIR/bnb.tar.xz ]]; then
  mkdir -p /tmp/headroom-site
  python3 -c "import bitsandbytes" 2>/dev/null || tar xJf "$PLUGIN_DIR/bnb.tar.xz" -C /tmp/headroom-site
  export PYTHONPATH=/tmp/headroom-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The folder's provenance (results/README.md), read before the steps run: the machine and the
# libraries they use. A second call into the same folder adds its command.
mkdir -p "$out"
python3 - "$out/meta.json" "$commit" "bash scripts/gpu-measure.sh $*" <<'META' ||
import datetime, importlib, json, os, platform, subprocess, sys
path, commit, command = sys.argv[1:4]
def gpus(field):  # one value per GPU; none when nvidia-smi fails
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.CalledProcessError):
        return []
def distinct(values):
    return ", ".join(sorted(set(values))) or "unknown (nvidia-smi failed)"
def cpu():  # the CPU's model name (/proc/cpuinfo on Linux)
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
def version(module):
    try:
        return importlib.import_module(module).__version__
    except Exception as err:
        return f"not importable ({type(err).__name__})"
meta = json.load(open(path)) if os.path.exists(path) else {}
commands = meta.get("commands", [])
commands.append(command)
meta.update({
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    "commit": commit,
    "machine": {"gpu": distinct(gpus("name")), "driver": distinct(gpus("driver_version")),
                "gpus": len(gpus("name")), "host": os.uname().nodename,
                "cpu": cpu(), "cpus": os.cpu_count()},
    "versions": {"python": sys.version.split()[0], "torch": version("torch"),
                 "transformers": version("transformers"), "bitsandbytes": version("bitsandbytes"),
                 "torchao": version("torchao")},
    "command": "; ".join(commands),
    "commands": commands,
})
json.dump(meta, open(path, "w"), indent=2)
META
  { echo "could not write $out/meta.json" >&2; exit 2; }
# Test binaries that need more than one GPU (testkit's gpus_or_skip): not run by this script.
multi_gpu_tests="nccl"
failed=0
step() { # name command...
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local skips ignored
  skips=$(grep -c -w skipped "$out/$name.log")
  # libtest summaries that count an ignored test (" 0 ignored;" is the only clean count).
  ignored=$(grep -E '^test result:' "$out/$name.log" | grep -c -v ' 0 ignored;')
  (( rc != 0 || skips > 0 || ignored > 0 )) && failed=$((failed + 1))
  echo "$name: rc=$rc, $skips skip line(s), $ignored summary(ies) with ignored tests," \
    "$((SECONDS - start)) s"
  (( skips > 0 )) && grep -n -w -m 5 skipped "$out/$name.log" | sed 's/^/  /'
  (( ignored > 0 )) && grep -n -E '^test result:' "$out/$name.log" | grep -v ' 0 ignored;' |
    sed 's/^/  /'
}
# A step whose stdout is also $out/FILE, the raw result a table reads: bench_step NAME FILE
# command... (the step's log keeps stdout and stderr, and its checks hold).
bench_step() {
  local name=$1 file=$2; shift 2
  # shellcheck disable=SC2016 # the inner shell expands its own arguments
  step "$name" bash -o pipefail -c '"${@:2}" | tee "$1"' _ "$out/$file" "$@"
}
criterion_home=$(mktemp -d)
export CRITERION_HOME=$criterion_home
for phase in "$@"; do
  case $phase in
    tests)
      for t in "$bin"/*; do
        name=$(basename "$t" | sed 's/-[0-9a-f]*$//')
        # The tools, and their tests wherever a bundle holds them (CPU tests, which CI runs).
        case $name in xtask* | headroom-bench | headroom_bench*) continue ;; esac
        if [[ " $multi_gpu_tests " == *" $name "* ]]; then
          echo "test_$name: not run here: it needs two GPUs (scripts/gpu-data-parallel.sh)"
          continue
        fi
        step "test_$name" "$t" --include-ignored --show-output
      done ;;
    vit)
      # Every case but adam_auto (the planner phase measures it at its budgets).
      step vit_ours "$bench" bench-memory --device cuda --batch 1 --batch 32 \
        --cases "$vit_cases" --json "$out/vit.json"
      step vit_torch python3 scripts/pytorch/bench_reference.py --batch 1 --batch 32 \
        --out "$out/anchor_vit.jsonl" ;;
    gpt2)
      step gpt2_torch python3 scripts/pytorch/bench_reference.py --in-process --model gpt2 \
        --seq 1024 --batch 8 --cases fwd_bwd,fwd_bwd_bf16,adam_fused --out "$out/anchor_gpt2.jsonl"
      step gpt2_ours "$bench" bench-memory --device cuda --model gpt2 --seq 1024 --batch 8 \
        --cases fwd_bwd,fwd_bwd_bf16,adam_fused --pytorch "$out/anchor_gpt2.jsonl" \
        --json "$out/gpt2.json" ;;
    fmb)
      step fmb_torch python3 scripts/pytorch/find_max_batch.py --memory-cap-mb 24576 \
        --out "$out/fmb_torch.jsonl"
      step fmb_ours "$bench" find-max-batch --device cuda --memory-cap-mb 24576 \
        --pytorch "$out/fmb_torch.jsonl" --json "$out/fmb.json" ;;
    fmb-llama)
      # Issue 30: the largest batch of Llama-3.2-1B at 2048 tokens a row, Hugging Face first.
      cap=${LLAMA_FMB_CAP_MB:-24576}
      cases=fwd_bwd,fwd_bwd_bf16,fwd_bwd_bf16_ckpt,adam_inbwd_ckpt_bf16
      step "fmb_llama1b_${cap}_torch" python3 scripts/pytorch/find_max_batch.py \
        --model llama-3.2-1b --seq 2048 --cases $cases --memory-cap-mb "$cap" \
        --out "$out/fmb_llama1b_${cap}_torch.jsonl"
      step "fmb_llama1b_${cap}_ours" "$bench" find-max-batch --device cuda --model llama-3.2-1b \
        --seq 2048 --cases $cases --memory-cap-mb "$cap" \
        --pytorch "$out/fmb_llama1b_${cap}_torch.jsonl" --json "$out/fmb_llama1b_${cap}.json" ;;
    planner)
      for budget in 6717334272 8110652416 9503970560 10897288704 12290606848; do
        step "planner_$budget" "$bench" bench-memory --device cuda --batch 32 --cases adam_auto \
          --budget "$budget" --json "$out/planner_$budget.json"
      done ;;
    reclaim)
      cases=adam_fused,adam_inbwd,adam_ckpt
      step reclaim_default "$bench" bench-memory --device cuda --batch 1 --batch 32 \
        --cases $cases --json "$out/reclaim_default.json"
      HEADROOM_ALLOC_CONF=reclaim_free_pages:True,reclaim_settles:False step reclaim_on \
        "$bench" bench-memory --device cuda --batch 1 --batch 32 --cases $cases \
        --json "$out/reclaim_on.json" ;;
    noreclaim)
      HEADROOM_ALLOC_CONF=reclaim_free_pages:False step reclaim_off "$bench" bench-memory \
        --device cuda --batch 1 --batch 32 --cases adam_fused,adam_inbwd,adam_ckpt \
        --json "$out/reclaim_off.json" ;;
    plugin)
      [[ -n ${PLUGIN_DIR:-} ]] || { echo "plugin: set PLUGIN_DIR (see the header)" >&2; exit 2; }
      cp crates/python/bench/*.py crates/python/bench/run.sh "$PLUGIN_DIR"/
      export OUT=$out
      step plugin bash "$PLUGIN_DIR/run.sh" "$PLUGIN_DIR" 200 ;;
    benches)
      bench_step vit_step vit_step.jsonl "$(bench_exe vit_step)"
      step vit_step_torch python3 scripts/pytorch/bench_reference.py --batch 1 --batch 32 \
        --cases sgd --out "$out/anchor_vit_step.jsonl"
      step vit_step_torch_bf16 python3 scripts/pytorch/bench_reference.py --batch 32 \
        --cases sgd_bf16_model --out "$out/anchor_vit_step.jsonl"
      bench_step cuda_adam cuda_adam.jsonl "$(bench_exe cuda_adam)"
      step adam_step_1e9_torch python3 scripts/pytorch/adam_step_1e9.py \
        --out "$out/adam_step_1e9_torch.jsonl" ;;
    llama)
      # Issue 30's model targets: Llama-3.2-1B at batch 4 x 2048 in bf16 and f32, Llama-3.1-8B
      # in bf16 at 1 x 4096 with every block checkpointed; Hugging Face (SDPA) first.
      step llama1b_torch python3 scripts/pytorch/bench_reference.py --model llama-3.2-1b \
        --seq 2048 --batch 4 --cases fwd_bwd,fwd_bwd_bf16 --out "$out/anchor_llama1b.jsonl"
      step llama1b_ours "$bench" bench-memory --device cuda --model llama-3.2-1b --seq 2048 \
        --batch 4 --cases fwd_bwd,fwd_bwd_bf16 --pytorch "$out/anchor_llama1b.jsonl" \
        --json "$out/llama1b.json" ;;
    fp8)
      # Issue 37: fp8 beside bf16 autocast on GPT-2 large (b8 x 1024) and Llama-3.2-1B
      # (b4 x 2048), plain, in-backward, and in-backward with every block checkpointed, and the
      # op profile of each adam_fp8 step. About 3 minutes; fp8-torch is torchao's side.
      fp8_cases=adam_bf16,adam_fp8,adam_inbwd_fp8,adam_inbwd_ckpt_bf16,adam_inbwd_ckpt_fp8
      step fp8_gpt2_large "$bench" bench-memory --device cuda --model gpt2-large --batch 8 \
        --cases $fp8_cases --json "$out/fp8_gpt2_large.json"
      step fp8_llama1b "$bench" bench-memory --device cuda --model llama-3.2-1b --seq 2048 \
        --batch 4 --cases $fp8_cases --json "$out/fp8_llama1b.json"
      step fp8_gpt2_large_profile "$bench" bench-memory --device cuda --model gpt2-large \
        --batch 8 --cases adam_fp8 --op-profile --json "$out/fp8_gpt2_large_profile.json"
      step fp8_llama1b_profile "$bench" bench-memory --device cuda --model llama-3.2-1b \
        --seq 2048 --batch 4 --cases adam_fp8 --op-profile \
        --json "$out/fp8_llama1b_profile.json" ;;
    fp8-torch)
      # torchao's float8 training (tensorwise, compiled; the torchao wheel on PYTHONPATH) on
      # the fp8 phase's models: about 4 minutes each, most of it torch.compile.
      step fp8_gpt2_large_torch python3 scripts/pytorch/bench_reference.py --model gpt2-large \
        --batch 8 --cases adam_fp8 --out "$out/fp8_gpt2_large_torch.jsonl"
      step fp8_llama1b_torch python3 scripts/pytorch/bench_reference.py --model llama-3.2-1b \
        --seq 2048 --batch 4 --cases adam_fp8 --out "$out/fp8_llama1b_torch.jsonl"
      step fp8_gpt2_large_inbwd_torch python3 scripts/pytorch/bench_reference.py \
        --model gpt2-large --batch 8 --cases adam_inbwd_fp8 \
        --out "$out/fp8_gpt2_large_inbwd_torch.jsonl" ;;
    llama8b)
      step llama8b_torch python3 scripts/pytorch/bench_reference.py --model llama-3.1-8b \
        --seq 4096 --batch 1 --cases fwd_bwd_bf16_ckpt --out "$out/anchor_llama8b.jsonl"
      step llama8b_ours "$bench" bench-memory --device cuda --model llama-3.1-8b --seq 4096 \
        --batch 1 --cases fwd_bwd_bf16_ckpt --pytorch "$out/anchor_llama8b.jsonl" \
        --json "$out/llama8b.json" ;;
    llama-parity)
      # Issue 30: the 1B shape's f32 loss against transformers' from the same safetensors.
      parity_dir=${LLAMA_PARITY_DIR:-$(mktemp -d)}
      bench_step llama_parity_ours llama_parity_ours.json "$(bench_exe llama_loss_parity)" \
        "$parity_dir" llama-3.2-1b 2 2048 0
      step llama_parity_torch python3 scripts/pytorch/llama_loss_parity.py "$parity_dir" \
        --out "$out/llama_parity.json"
      # The checkpoint (5 GB) goes unless the caller named its folder.
      [[ -n ${LLAMA_PARITY_DIR:-} ]] || rm -rf "$parity_dir" ;;
    plans)
      for model_cap in llama-3.2-1b:142336 llama-3.1-8b:142336 llama-3.1-8b:40000 \
        llama-3.1-8b:30000; do
        model=${model_cap%%:*} cap=${model_cap#*:}
        step "plan_${model}_$cap" "$bench" plan --model "$model" --seq 2048 --batch 1 \
          --memory-cap-mb "$cap" --run --device cuda --json "$out/plan_${model}_$cap.json"
      done ;;
    streamed)
      l1b=(--model llama-3.2-1b --batch 8 --cases adamw_inbwd_bf16,adamw_offload_stream_inbwd_bf16)
      l8b=(--model llama-3.1-8b --batch 1 --cases adamw4bit_inbwd_bf16,adamw4bit_stream_inbwd_bf16)
      for variant in kernel engine; do
        flags=()
        [[ $variant == engine ]] && flags=(--copy-engine-copies)
        step "streamed_l1b_$variant" "$bench" bench-memory --device cuda --seq 2048 --steps 5 \
          "${l1b[@]}" "${flags[@]}" --json "$out/streamed_l1b_$variant.json"
        step "streamed_l8b_$variant" "$bench" bench-memory --device cuda --seq 2048 --steps 5 \
          "${l8b[@]}" "${flags[@]}" --json "$out/streamed_l8b_$variant.json"
      done
      for mib in 2560 5120 10240; do
        step "streamed_l1b_kernel_$mib" "$bench" bench-memory --device cuda --seq 2048 --steps 5 \
          "${l1b[@]}" --stream-budget-mib "$mib" --json "$out/streamed_l1b_kernel_$mib.json"
      done
      step streamed_l1b_profile "$bench" bench-memory --device cuda --seq 2048 --steps 5 \
        --model llama-3.2-1b --batch 8 --cases adamw_offload_stream_inbwd_bf16 --op-profile \
        --json "$out/streamed_l1b_profile.json" ;;
    find-max-model)
      step fmm_plan "$bench" plan --find-max-model --seq 2048 --batch 1 --run --device cuda \
        --json "$out/fmm_plan.json"
      # shellcheck disable=SC2086 # FMM_TORCH_ARGS is words (e.g. --known-fit MODEL:LAYERS).
      step fmm_torch python3 scripts/pytorch/find_max_model.py --seq 2048 --batch 1 \
        --recipes "${FMM_RECIPES:-adamw4bit_inbwd_bf16_ckpt}" ${FMM_TORCH_ARGS:-} \
        --out "$out/fmm_torch.jsonl" ;;
    kernels)
      # Issue 30's kernel targets: RMSNorm, SwiGLU and rotary against the copy ceiling, causal
      # grouped-query bf16 attention and packed sequences against cuDNN's SDPA, one run.
      bench_step kernels kernels.txt "$(bench_exe kernels)" --bench
      step attention_torch python3 scripts/pytorch/attention_reference.py \
        --out "$out/attention_reference.jsonl"
      step attention_torch_issue35 python3 scripts/pytorch/attention_reference.py --shape issue35 \
        --out "$out/attention_reference_issue35.jsonl" ;;
    sanitizer)
      # Issue 35: compute-sanitizer's memcheck and racecheck over the attention kernels' parity
      # tests (the wgmma binary; parity's attention tests but the Llama-sized one, which the
      # tools would take minutes over). --error-exitcode makes a reported hazard fail the step;
      # HEADROOM_NO_CUDA_MEMORY_CACHING=1 gives each tensor its own driver allocation, so an
      # access past a tensor's end is not hidden inside a cached segment.
      # SANITIZE_BIN names another folder of the two binaries (scripts/gpu-quick.sh's .gpu-quick/bin).
      parity=$(ls "${SANITIZE_BIN:-$bin}"/parity* | head -1)
      wgmma=$(ls "${SANITIZE_BIN:-$bin}"/attention_wgmma* | head -1)
      export HEADROOM_NO_CUDA_MEMORY_CACHING=1
      for tool in memcheck racecheck; do
        step "sanitizer_${tool}_wgmma" timeout 240 compute-sanitizer --tool "$tool" \
          --error-exitcode 86 "$wgmma" --include-ignored --test-threads 1
        step "sanitizer_${tool}_attention" timeout 240 compute-sanitizer --tool "$tool" \
          --error-exitcode 86 "$parity" --include-ignored --test-threads 1 attention:: \
          --skip at_the_llama_target_shape
      done
      unset HEADROOM_NO_CUDA_MEMORY_CACHING ;;
    fused-ce)
      # Issue 31: linear_cross_entropy at Llama-3.2-1B's head (8192 tokens, bf16) beside eager
      # PyTorch, Liger and Cut Cross-Entropy (wheels installed by the caller into PYTHONPATH).
      bench_step fused_ce_ours fused_ce.jsonl "$(bench_exe fused_ce_bench)" 10
      bench_step fused_ce_torch fused_ce_reference.jsonl \
        python3 scripts/pytorch/fused_ce_reference.py --iters 10 ;;
    allocator-benches)
      bench_step cuda_alloc cuda_alloc.txt "$(bench_exe cuda_alloc)" --bench
      bench_step allocator allocator.txt "$(bench_exe allocator)" --bench ;;
    cpu-benches)
      bench_step cpu_vit cpu_vit.txt "$(bench_exe cpu_vit)" --bench
      bench_step cpu_gemm cpu_gemm.txt "$(bench_exe cpu_gemm)" --bench ;;
    *) echo "unknown phase $phase (tests vit gpt2 fmb fmb-llama planner reclaim noreclaim" \
         "plugin benches llama llama8b llama-parity kernels sanitizer fused-ce plans" \
         "find-max-model allocator-benches cpu-benches)" >&2; exit 2 ;;
  esac
done
rm -rf "$criterion_home"
echo "$failed step(s) failed; logs in $out"
(( failed == 0 ))
