"""Headroom inside Hugging Face's ``Trainer``: a GPT-2-shaped model (random_gpt2.py) whose blocks
keep, compress or recompute their activations under a byte budget
(``headroom.torch.plan_blocks``, applied to the model before the Trainer sees it), trained on
random tokens. On a GPU the optimizer is ``headroom.optim.AdamW`` stepped inside backward
(``optimizer_in_backward``, handed to the Trainer, which builds its scheduler on it and calls its
no-op ``step()``; clipping is the in-backward optimizer's, so the Trainer's is off) with
Headroom's allocator; on the CPU, the Trainer's own AdamW.

    python3 hf_trainer.py [--steps 20] [--budget-mb 24] [--layers 4] [--batch 2] [--seq 128]
"""

import tempfile

import random_gpt2  # first: it installs Headroom's allocator before anything touches CUDA

import torch
from transformers import Trainer, TrainingArguments

import headroom.torch

args = random_gpt2.options(__doc__)
model, cuda = random_gpt2.model(args)
device = next(model.parameters()).device


class RandomTokens(torch.utils.data.Dataset):
    """Rows of random token ids, each its own label (the model shifts them)."""

    def __init__(self, rows):
        self.ids = random_gpt2.token_rows(args, rows, model.config.vocab_size)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


data = RandomTokens(args.steps * args.batch)
sample = data.ids[: args.batch].to(device)
plan = headroom.torch.plan_blocks(model.transformer.h, args.budget_mb,
                                  lambda: model(sample, labels=sample).loss)
optimizers = (None, None)
if cuda:
    import headroom.optim

    optimizer = headroom.torch.optimizer_in_backward(
        model, headroom.optim.AdamW(model.parameters(), lr=3e-4), clip=1.0, clip_mode="previous")
    optimizers = (optimizer, None)
with tempfile.TemporaryDirectory() as out:
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=3e-4, logging_steps=5, report_to=[], save_strategy="no",
        max_grad_norm=0.0 if cuda else 1.0, use_cpu=not cuda, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=data, optimizers=optimizers)
    result = trainer.train()
print(f"trained {result.global_step} steps, final loss {result.training_loss:.4f}")
if cuda:
    print(f"peak allocated {headroom.cuda.max_memory_allocated() / 2**20:.1f} MiB")
plan.remove()
