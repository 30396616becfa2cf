"""Headroom inside a Lightning module: a GPT-2-shaped model (random_gpt2.py) in bfloat16 whose
blocks keep, compress or recompute their activations under a byte budget
(``headroom.torch.plan_blocks``, applied in ``setup``), trained on random tokens by
``headroom.optim.AdamWBf16`` (bfloat16 parameters, float32 moments, stochastic rounding: 12 bytes
a parameter, no master copy) from ``configure_optimizers``. Runs on a GPU (with Headroom's
allocator) or on the CPU alike: the optimizer and the plan have both.

    python3 lightning_module.py [--steps 20] [--budget-mb 12] [--layers 4] [--batch 2] [--seq 128]
"""

import random_gpt2  # first: it installs Headroom's allocator before anything touches CUDA

import lightning
import torch

import headroom.optim
import headroom.torch

args = random_gpt2.options(__doc__)
model, cuda = random_gpt2.model(args)
model = model.to(torch.bfloat16)


class CausalLm(lightning.LightningModule):
    """The model's causal-LM loss, a block plan and AdamWBf16."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.plan = None

    def setup(self, stage):
        sample = random_gpt2.token_rows(args, args.batch, self.model.config.vocab_size, seed=7)
        sample = sample.to(self.device)
        self.plan = headroom.torch.plan_blocks(
            self.model.transformer.h, args.budget_mb,
            lambda: self.model(sample, labels=sample).loss)

    def training_step(self, ids, index):
        loss = self.model(ids, labels=ids).loss
        self.log("loss", loss.float(), prog_bar=True)
        return loss

    def configure_optimizers(self):
        return headroom.optim.AdamWBf16(self.model.parameters(), lr=3e-4)


rows = random_gpt2.token_rows(args, args.steps * args.batch, model.config.vocab_size)
loader = torch.utils.data.DataLoader(rows, batch_size=args.batch)
module = CausalLm(model)
trainer = lightning.Trainer(max_steps=args.steps, accelerator="gpu" if cuda else "cpu", devices=1,
                            logger=False, enable_checkpointing=False, enable_model_summary=False,
                            gradient_clip_val=None)
trainer.fit(module, loader)
print(f"trained {trainer.global_step} steps, last loss {trainer.callback_metrics['loss']:.4f}")
if cuda:
    print(f"peak allocated {headroom.cuda.max_memory_allocated() / 2**20:.1f} MiB")
module.plan.remove()
