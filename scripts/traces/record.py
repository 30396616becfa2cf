#!/usr/bin/env python3
"""Records the allocator-trace corpus: real PyTorch training and generation runs, each run twice.

Every workload runs in two fresh Python processes, one with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`` (PyTorch's classic policy) and one with
``expandable_segments:True``, so that both of PyTorch's peak reserved figures are known for the
same sequence of requests. Each process starts ``torch.cuda.memory._record_memory_history`` before
it builds anything on the GPU, so its trace holds every allocation of the run (nothing was live
before the first event). It then writes:

- ``NAME.MODE.tsv.gz``: the ``alloc`` and ``free_completed`` events of device 0, oldest first, as
  gzipped TSV with the header ``action addr size stream`` (``size`` of an ``alloc`` is the
  requested size; a ``free_completed`` carries the size of the block's request). The allocator's
  own decisions (``segment_*``, ``free_requested``) are left out: a replay does not use them.
- ``NAME.MODE.json``: PyTorch's figures for the run (``torch.cuda.memory_stats()``: peak allocated,
  peak reserved, peak requested, retries and OOMs, device allocations and frees), the peak of the
  live requests each rounded up to 512 bytes (computed from the trace), event counts, a digest of
  the request sequence, and the versions and device.

The driver (``all``) runs the workloads, at most ``--budget-gb`` of estimated device memory at a
time, checks that the two runs of a workload made the same requests (same digest), and writes
``corpus.json`` with one entry per workload.

Usage (on a GPU machine with torch 2.11, torchvision and transformers; no downloads needed, every
model is randomly initialised from its config)::

    python3 scripts/traces/record.py all OUTDIR [--only NAME,...] [--budget-gb 110]
    python3 scripts/traces/record.py one NAME MODE OUTDIR     # one process; MODE classic|expandable
    python3 scripts/traces/record.py dry-run                  # every workload, tiny, on the CPU
    python3 scripts/traces/record.py list

``dry-run`` checks the workloads' code paths (model configs, checkpointing, autocast, generation)
on the CPU with tiny sizes and records nothing.
"""

import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import time

MODES = {"classic": "expandable_segments:False", "expandable": "expandable_segments:True"}


# ----- workloads ---------------------------------------------------------------------------------
# Each takes (device, tiny) and runs the whole workload: model construction included, so that its
# parameters are part of the trace. `tiny` shrinks every size for the CPU dry run.


def _vit(device, tiny, arch, batches, steps_per_batch, optimizer):
    import torch
    import torchvision

    torch.manual_seed(0)
    with torch.device(device):
        if tiny:
            model = torchvision.models.VisionTransformer(
                image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
            )
        else:
            model = getattr(torchvision.models, arch)(weights=None)
    size = 32 if tiny else 224
    opt = optimizer(model.parameters(), lr=1e-4)
    for batch, steps in zip(batches, steps_per_batch):
        batch = 2 if tiny else batch
        x = torch.rand(batch, 3, size, size, device=device)
        for _ in range(steps):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        del x


def vit_l16_b8(device, tiny):
    import torch

    _vit(device, tiny, "vit_l_16", [8], [3], torch.optim.Adam)


def vit_l16_b32(device, tiny):
    import torch

    _vit(device, tiny, "vit_l_16", [32], [3], torch.optim.Adam)


def vit_b16_batch_change(device, tiny):
    import torch

    _vit(device, tiny, "vit_b_16", [16, 96, 48], [3, 3, 2], torch.optim.AdamW)


def _train_lm(model, vocab_size, device, steps, draw_shape, bf16_autocast=False):
    """Trains a language model on random token ids (labels = inputs) with AdamW: `steps` steps,
    each of the (batch, sequence length) that `draw_shape()` returns."""
    import contextlib

    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        batch, seq = draw_shape()
        ids = torch.randint(0, vocab_size, (batch, seq), device=device)
        autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if bf16_autocast
                    else contextlib.nullcontext())
        with autocast:
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, ids


def bert_varlen(device, tiny):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    random.seed(0)
    torch.manual_seed(0)
    config = BertConfig()
    if tiny:
        config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64)
    with torch.device(device):
        model = BertForMaskedLM(config)

    def shape():
        batch, seq = random.choice([8, 16, 24]), random.randint(32, 512)
        return (2, seq // 16) if tiny else (batch, seq)

    _train_lm(model, config.vocab_size, device, 3 if tiny else 30, shape)


def gpt2_medium_varlen(device, tiny):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    random.seed(0)
    torch.manual_seed(0)
    if tiny:
        config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
    else:
        # GPT-2 medium: 355M parameters.
        config = GPT2Config(n_embd=1024, n_layer=24, n_head=16)
    with torch.device(device):
        model = GPT2LMHeadModel(config)

    def shape():
        seq = random.randint(64, 1024)
        return (2, seq // 32) if tiny else (8, seq)

    _train_lm(model, config.vocab_size, device, 3 if tiny else 16, shape)


def _llama_config(tiny, layers):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                           max_position_embeddings=256)
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                       max_position_embeddings=4096)


def llama_bf16_ckpt(device, tiny):
    import torch
    from transformers import LlamaForCausalLM

    random.seed(0)
    torch.manual_seed(0)
    config = _llama_config(tiny, 16)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def shape():
        seq = random.randint(512, 2048)
        return (2, seq // 64) if tiny else (4, seq)

    _train_lm(model, config.vocab_size, device, 3 if tiny else 8, shape, bf16_autocast=True)


def llama_generate(device, tiny):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = _llama_config(tiny, 12)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    # Two requests of different shapes, as a server would see them; greedy, never stopping early.
    for batch, prompt, new in [(8, 128, 256), (4, 320, 192)]:
        if tiny:
            batch, prompt, new = 2, prompt // 32, new // 32
        ids = torch.randint(3, config.vocab_size, (batch, prompt), device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0, use_cache=True)
        assert out.shape == (batch, prompt + new), out.shape
        del out, ids


def resnet50_sgd(device, tiny):
    import torch
    import torchvision

    torch.manual_seed(0)
    with torch.device(device):
        model = torchvision.models.resnet50(weights=None)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    batch, size = (2, 64) if tiny else (128, 224)
    x = torch.rand(batch, 3, size, size, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(2 if tiny else 5):
        loss_fn(model(x), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# name -> (function, description, estimated peak reserved in GB under the classic policy)
WORKLOADS = {
    "vit_l16_b8_adam_3steps": (
        vit_l16_b8, "torchvision vit_l_16 (fp32), batch 8 of 224x224, loss = output.sum(), "
        "Adam (foreach), 3 steps", 9),
    "vit_l16_b32_adam_3steps": (
        vit_l16_b32, "torchvision vit_l_16 (fp32), batch 32 of 224x224, loss = output.sum(), "
        "Adam (foreach), 3 steps", 18),
    "vit_b16_batch_change_adamw": (
        vit_b16_batch_change, "torchvision vit_b_16 (fp32), loss = output.sum(), AdamW (foreach), "
        "3 steps at batch 16, then 3 at batch 96, then 2 at batch 48", 22),
    "bert_varlen_adamw_30steps": (
        bert_varlen, "Hugging Face BertForMaskedLM(BertConfig()), AdamW, 30 steps, batch from "
        "{8,16,24} and sequence length uniform in 32..512 each step (random.seed(0))", 28),
    "gpt2_medium_varlen_adamw_16steps": (
        gpt2_medium_varlen, "Hugging Face GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, "
        "n_head=16)) (GPT-2 medium, 355M parameters, fp32, sdpa attention), AdamW (foreach), "
        "16 steps of batch 8 with a sequence length uniform in 64..1024 (random.seed(0))", 45),
    "llama_bf16_ckpt_adamw_8steps": (
        llama_bf16_ckpt, "Hugging Face LlamaForCausalLM(LlamaConfig(hidden_size=2048, "
        "intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, "
        "num_key_value_heads=4, vocab_size=32000)) (0.9B parameters, fp32), forward under "
        "torch.autocast(bfloat16), gradient checkpointing (use_reentrant=False), AdamW (foreach), "
        "8 steps of batch 4 with a sequence length uniform in 512..2048 (random.seed(0))", 28),
    "llama_generate_kvcache": (
        llama_generate, "Hugging Face LlamaForCausalLM (as the checkpointed one, 12 layers) in "
        "bfloat16, model.generate greedy with the dynamic KV cache (grown by torch.cat each "
        "token): batch 8, prompt 128, 256 new tokens; then batch 4, prompt 320, 192 new tokens",
        8),
    "resnet50_sgd_b128_5steps": (
        resnet50_sgd, "torchvision resnet50 (fp32, NCHW), batch 128 of 224x224, cross-entropy, "
        "SGD (momentum 0.9, weight decay 1e-4), 5 steps", 28),
}


# ----- one recording -----------------------------------------------------------------------------


def round512(size):
    return max(size, 1) + (-max(size, 1)) % 512


def trace_figures(events):
    """Counts, the peak of live requests rounded to 512 B, and a digest of the request sequence
    that does not depend on addresses (a free names the index of its allocation)."""
    live = {}
    current = peak = 0
    digest = hashlib.sha256()
    n_alloc = n_free = unmatched = 0
    for action, addr, size, stream in events:
        if action == "alloc":
            live[addr] = (n_alloc, size)
            current += round512(size)
            peak = max(peak, current)
            digest.update(f"a{size},{stream};".encode())
            n_alloc += 1
        elif addr in live:
            index, requested = live.pop(addr)
            current -= round512(requested)
            digest.update(f"f{index};".encode())
            n_free += 1
        else:
            unmatched += 1
    return dict(events=len(events), allocs=n_alloc, frees=n_free, unmatched_frees=unmatched,
                live_at_end=len(live),
                peak_live_rounded_bytes=peak, sequence_sha256=digest.hexdigest())


def record_one(name, mode, outdir):
    import torch

    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == MODES[mode], "set by the driver"
    function, description, _ = WORKLOADS[name]
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    started = time.time()
    function("cuda", False)
    torch.cuda.synchronize()
    seconds = time.time() - started
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    actions = {}
    events = []
    for entry in snapshot["device_traces"][0]:
        actions[entry["action"]] = actions.get(entry["action"], 0) + 1
        if entry["action"] in ("alloc", "free_completed"):
            events.append((entry["action"], entry["addr"], entry["size"], entry["stream"]))
    with gzip.open(os.path.join(outdir, f"{name}.{mode}.tsv.gz"), "wt", compresslevel=9) as f:
        f.write("action\taddr\tsize\tstream\n")
        for action, addr, size, stream in events:
            f.write(f"{action}\t{addr}\t{size}\t{stream}\n")
    figures = trace_figures(events)
    result = dict(
        workload=name, mode=mode, description=description,
        alloc_conf=os.environ["PYTORCH_CUDA_ALLOC_CONF"],
        torch=torch.__version__, cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(0),
        total_memory=torch.cuda.get_device_properties(0).total_memory,
        peak_allocated_bytes=stats["allocated_bytes.all.peak"],
        peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        peak_requested_bytes=stats["requested_bytes.all.peak"],
        num_alloc_retries=stats["num_alloc_retries"], num_ooms=stats["num_ooms"],
        num_device_alloc=stats["num_device_alloc"], num_device_free=stats["num_device_free"],
        expandable_segments_seen=sum(1 for s in snapshot["segments"] if s.get("is_expandable")),
        recorded_actions=actions, seconds=round(seconds, 2), **figures)
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import torchvision

        result["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    with open(os.path.join(outdir, f"{name}.{mode}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("workload", "mode", "events", "peak_allocated_bytes",
                                             "peak_reserved_bytes", "peak_live_rounded_bytes",
                                             "num_alloc_retries", "seconds")}), flush=True)


# ----- the driver --------------------------------------------------------------------------------


def record_all(outdir, names, budget_gb, timeout_s):
    os.makedirs(outdir, exist_ok=True)
    queue = [(name, mode) for name in names for mode in MODES]
    # Largest first, so that the small ones fill the gaps at the end.
    queue.sort(key=lambda job: -WORKLOADS[job[0]][2])
    running = {}
    failures = {}
    while queue or running:
        in_use = sum(WORKLOADS[job[0]][2] for _, job, _, _ in running.values())
        for job in list(queue):
            if not running or in_use + WORKLOADS[job[0]][2] <= budget_gb:
                name, mode = job
                env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=MODES[mode])
                log = open(os.path.join(outdir, f"{name}.{mode}.log"), "w")
                process = subprocess.Popen(
                    ["timeout", str(timeout_s), sys.executable, __file__, "one", name, mode,
                     outdir], env=env, stdout=log, stderr=subprocess.STDOUT)
                running[process.pid] = (process, job, log, time.time())
                in_use += WORKLOADS[name][2]
                queue.remove(job)
                print(f"started {name} {mode}", flush=True)
        time.sleep(0.2)
        for pid, (process, job, log, started) in list(running.items()):
            if process.poll() is not None:
                log.close()
                print(f"finished {job[0]} {job[1]}: rc {process.returncode} "
                      f"in {time.time() - started:.1f} s", flush=True)
                if process.returncode != 0:
                    failures[f"{job[0]}.{job[1]}"] = process.returncode
                del running[pid]
    corpus = {}
    for name in names:
        runs = {}
        for mode in MODES:
            path = os.path.join(outdir, f"{name}.{mode}.json")
            if os.path.exists(path):
                with open(path) as f:
                    runs[mode] = json.load(f)
        entry = dict(description=WORKLOADS[name][1], runs=runs)
        if len(runs) == 2:
            entry["same_requests"] = (runs["classic"]["sequence_sha256"]
                                      == runs["expandable"]["sequence_sha256"])
        corpus[name] = entry
    with open(os.path.join(outdir, "corpus.json"), "w") as f:
        json.dump(dict(corpus=corpus, failures=failures), f, indent=1)
    for name, entry in corpus.items():
        runs = entry["runs"]
        row = [name, str(entry.get("same_requests"))]
        for mode in MODES:
            if mode in runs:
                r = runs[mode]
                row += [mode, str(r["events"]), str(r["peak_allocated_bytes"]),
                        str(r["peak_reserved_bytes"]),
                        f"{r['peak_reserved_bytes'] / r['peak_live_rounded_bytes']:.4f}"]
        print("\t".join(row), flush=True)
    return 1 if failures else 0


def dry_run(names):
    import traceback

    failed = []
    for name in names:
        started = time.time()
        try:
            WORKLOADS[name][0]("cpu", True)
            print(f"ok {name} {time.time() - started:.1f} s", flush=True)
        except Exception:  # noqa: BLE001 - report every workload, then fail
            traceback.print_exc()
            failed.append(name)
    return 1 if failed else 0


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    command = argv[1]
    if command == "list":
        for name, (_, description, gb) in WORKLOADS.items():
            print(f"{name}\t~{gb} GB\t{description}")
        return 0
    if command == "one":
        name, mode, outdir = argv[2], argv[3], argv[4]
        record_one(name, mode, outdir)
        return 0
    options = {"--only": ",".join(WORKLOADS), "--budget-gb": "110", "--timeout-s": "300"}
    rest = argv[3:] if command == "all" else argv[2:]
    while rest:
        flag = rest.pop(0)
        if flag not in options or not rest:
            print(f"unknown option or missing value: {flag} (see --help)", file=sys.stderr)
            return 2
        options[flag] = rest.pop(0)
    names = options["--only"].split(",")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        print(f"unknown workloads {unknown}; `list` names them", file=sys.stderr)
        return 2
    if command == "all":
        return record_all(argv[2], names, float(options["--budget-gb"]),
                          int(options["--timeout-s"]))
    if command == "dry-run":
        return dry_run(names)
    print(f"unknown command {command} (see --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
