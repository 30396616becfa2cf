"""Issue 33's real clients: a causal LM trained by Hugging Face's ``Trainer`` or a Lightning
module for ``--steps`` steps, on PyTorch alone (``--side native``: its allocator, fused
``torch.optim.AdamW``, the client's own gradient clipping, the model's own loss) or with every
feature of the ``headroom`` wheel on (``--side headroom``: Headroom's allocator, ``AdamW``
stepped inside backward with clipping by the previous step's norm — the clients call
``loss.backward()`` themselves, one pass, where exact clipping needs two —, ``plan_blocks``
keeping, compressing or recomputing
each block under ``--budget-mb``, and the loss without logits, ``patch_causal_lm``). One process
a run (an allocator is chosen before CUDA starts); one JSON line: the losses, the median step
(steps after the fifth, synchronised), the training's peak reserved and allocated bytes (the
plan's profile runs before it: its peaks are ``setup_peak_*``, and the cache it left is given
back before training), the plan. ``--without allocator,in_backward,plan,loss`` leaves features
out of the headroom side, to see what each costs.

    python3 clients.py --client hf|lightning --side native|headroom [--model gpt2|llama-tiny|llama-1b]
                       [--steps 200] [--batch 8] [--seq 512] [--bf16] [--budget-mb 2048]
                       [--without FEATURE,...]
    python3 clients.py --summarize RUNS.jsonl     # headroom against native per client and model

On a machine without a GPU it runs on the CPU (the allocator and the byte figures left out), to
check the script; the figures are the GPU's.
"""

import argparse
import json
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--client", choices=["hf", "lightning"])
parser.add_argument("--side", choices=["native", "headroom"])
parser.add_argument("--model", choices=["gpt2", "llama-tiny", "llama-1b"], default="gpt2")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=512)
parser.add_argument("--bf16", action="store_true",
                    help="bf16 autocast on both sides (Trainer's bf16=True, Lightning's bf16-mixed)")
parser.add_argument("--budget-mb", type=float, default=2048.0,
                    help="the blocks' saved activations under plan_blocks (headroom side)")
parser.add_argument("--without", default="",
                    help="headroom side: features left out, comma-separated among allocator, "
                         "in_backward, plan, loss (to see what each costs)")
parser.add_argument("--loss-chunk-mb", type=float, default=64.0,
                    help="headroom side: patch_causal_lm's chunk_mb (the fused loss's block)")
parser.add_argument("--loss-gradients", choices=["auto", "forward", "backward"], default="auto",
                    help="headroom side: where the fused loss computes its gradients (auto: "
                         "its rule, in the forward for float32 without TF32)")
parser.add_argument("--summarize", metavar="RUNS", help="print headroom/native from a JSON-lines file")
args = parser.parse_args()


def summarize(path):
    runs = [json.loads(line) for line in open(path) if line.startswith('{"client"')]
    for native in (r for r in runs if r["side"] == "native"):
        for ours in (r for r in runs if r["side"] == "headroom" and r["client"] == native["client"]
                     and r["model"] == native["model"]):
            worst = max(abs(a / b - 1) for a, b in zip(ours["losses"], native["losses"]))
            row = {"client": native["client"], "model": native["model"],
                   "without": ours.get("without", []), "plan": ours.get("plan"),
                   "step_ratio": ours["step_ms_median"] / native["step_ms_median"],
                   "max_loss_relative_difference": worst,
                   "final_losses": [native["losses"][-1], ours["losses"][-1]]}
            if native.get("peak_reserved_bytes"):
                row["reserved_ratio"] = ours["peak_reserved_bytes"] / native["peak_reserved_bytes"]
                row["allocated_ratio"] = ours["peak_allocated_bytes"] / native["peak_allocated_bytes"]
            print(json.dumps(row))


if args.summarize:
    summarize(args.summarize)
    sys.exit(0)
if args.client is None or args.side is None:
    parser.error("--client and --side are required (or --summarize RUNS)")
WITHOUT = {name for name in args.without.split(",") if name}
if WITHOUT - {"allocator", "in_backward", "plan", "loss"}:
    parser.error(f"--without {args.without}: name features among allocator, in_backward, plan, loss")

import torch  # noqa: E402

cuda = torch.cuda.is_available()
import headroom.cuda  # noqa: E402

if cuda and args.side == "headroom" and "allocator" not in WITHOUT:
    headroom.cuda.use_allocator()  # before transformers, whose imports can start CUDA

import transformers  # noqa: E402

import headroom.loss  # noqa: E402
import headroom.optim  # noqa: E402
import headroom.torch  # noqa: E402

device = torch.device("cuda" if cuda else "cpu")
LR = 3e-4


def build_model():
    torch.manual_seed(0)
    if args.model == "gpt2":
        config = transformers.GPT2Config(n_positions=max(1024, args.seq), resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        return model.to(device), model.transformer.h
    shapes = {
        "llama-tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, vocab_size=32000),
        "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         rope_theta=500000.0, tie_word_embeddings=True),
    }[args.model]
    config = transformers.LlamaConfig(max_position_embeddings=max(2048, args.seq),
                                      attn_implementation="sdpa", **shapes)
    model = transformers.LlamaForCausalLM(config)
    return model.to(device), model.model.layers


def token_rows(vocab, rows):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (rows, args.seq), generator=generator)


def synchronize():
    if cuda:
        torch.cuda.synchronize()


model, blocks = build_model()
rows = token_rows(model.config.vocab_size, args.steps * args.batch)
features = []
plan = None
if args.side == "headroom":
    if "loss" not in WITHOUT:
        # First: the plan's profile runs the fused loss.
        headroom.torch.patch_causal_lm(model, chunk_mb=args.loss_chunk_mb)
        headroom.loss._GRADIENTS_IN_FORWARD[0] = {"auto": None, "forward": True,
                                                  "backward": False}[args.loss_gradients]
        features.append("linear_cross_entropy")
    if "plan" not in WITHOUT:
        sample = rows[:args.batch].to(device)

        def profiled_loss():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                return model(sample, labels=sample).loss

        plan = headroom.torch.plan_blocks(blocks, args.budget_mb, profiled_loss)
        features.append("plan_blocks")
    if cuda:
        features += [f for f in ("allocator", "in_backward") if f not in WITHOUT]


# Inside backward (headroom on CUDA) the optimizer clips; otherwise the client does, to 1.0.
IN_BACKWARD = args.side == "headroom" and cuda and "in_backward" not in WITHOUT
CLIENT_CLIP = 0.0 if IN_BACKWARD else 1.0


def make_optimizer(params):
    """The optimizer the client steps (headroom.optim.AdamW steps CUDA tensors only)."""
    if not IN_BACKWARD:
        return torch.optim.AdamW(params, lr=LR, fused=cuda)
    inner = headroom.optim.AdamW(params, lr=LR)
    return headroom.torch.optimizer_in_backward(model, inner, clip=1.0, clip_mode="previous")


# The statistics this side's allocator keeps (under Headroom's, torch's own raise:
# CUDAPluggableAllocator keeps none, and the plugin answers with the same keys).
STATS = headroom.cuda if headroom.cuda.is_active() else torch.cuda
setup = {}
if cuda:
    # The plan's profile (four forwards, once before training) is reported on its own: the
    # peaks below are the training's, after the cache the profile left is given back.
    setup = {"setup_peak_reserved_bytes": STATS.max_memory_reserved(),
             "setup_peak_allocated_bytes": STATS.max_memory_allocated()}
    STATS.empty_cache()
    STATS.reset_peak_memory_stats()

# The allocator's driver calls and retries during training (the tiny Llama's steps differed by 8
# ms between runs that differ only in the plan's profile before training, at 190e3f5).
COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


def allocator_counts():
    stats = STATS.memory_stats() if cuda else {}
    return {key: stats.get(key, 0) for key in COUNTS}


counts_before = allocator_counts()
losses, times = [], []
started = [0.0]


def step_begins():
    synchronize()
    started[0] = time.perf_counter()


def step_ends(loss):
    synchronize()
    times.append(1e3 * (time.perf_counter() - started[0]))
    losses.append(float(loss))


if args.client == "hf":
    class Timing(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            step_begins()

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

        def on_step_end(self, *a, **k):
            synchronize()
            times.append(1e3 * (time.perf_counter() - started[0]))

    optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    settings = transformers.TrainingArguments(
        output_dir="/tmp/headroom-clients", max_steps=args.steps,
        per_device_train_batch_size=args.batch, logging_steps=1, save_strategy="no",
        report_to=[], max_grad_norm=CLIENT_CLIP, use_cpu=not cuda, disable_tqdm=True,
        bf16=args.bf16,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=settings, train_dataset=dataset,
                                   optimizers=(optimizer, scheduler), callbacks=[Timing()])
    trainer.train()
else:
    import lightning

    class CausalLm(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, ids, index):
            return self.model(ids, labels=ids).loss

        def configure_optimizers(self):
            return make_optimizer(self.model.parameters())

    class Timing(lightning.Callback):
        def on_train_batch_start(self, *a, **k):
            step_begins()

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            step_ends(outputs["loss"])

    loader = torch.utils.data.DataLoader(rows, batch_size=args.batch)
    trainer = lightning.Trainer(max_steps=args.steps, accelerator="gpu" if cuda else "cpu",
                                devices=1, logger=False, enable_checkpointing=False,
                                enable_model_summary=False, enable_progress_bar=False,
                                gradient_clip_val=CLIENT_CLIP or None, callbacks=[Timing()],
                                precision="bf16-mixed" if args.bf16 else "32-true")
    trainer.fit(CausalLm(), loader)

row = {"client": args.client, "side": args.side, "model": args.model, "steps": args.steps,
       "batch": args.batch, "seq": args.seq, "bf16": args.bf16, "budget_mb": args.budget_mb,
       "loss_chunk_mb": args.loss_chunk_mb, "loss_gradients": args.loss_gradients,
       "without": sorted(WITHOUT), "features": features,
       "plan": None if plan is None else list(plan.strategies),
       "losses": losses, "step_ms_median": statistics.median(times[5:] or times),
       "torch": torch.__version__, "transformers": transformers.__version__,
       "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
if cuda:
    row["peak_reserved_bytes"] = STATS.max_memory_reserved()
    row["peak_allocated_bytes"] = STATS.max_memory_allocated()
    row["allocator_counts_in_training"] = {
        key: value - counts_before[key] for key, value in allocator_counts().items()}
    row.update(setup)
print(json.dumps(row), flush=True)
