"""Headroom's techniques in a plain PyTorch loop: a GPT-2-shaped model (random_gpt2.py) whose
blocks keep, compress or recompute their activations under a byte budget
(``headroom.torch.plan_blocks``), trained on random tokens. On a GPU the step is
``headroom.optim.AdamW`` run inside backward (``optimizer_in_backward``: no full set of
gradients ever exists, clipping to 1.0 exactly in two passes) with Headroom's allocator; on the
CPU, ``torch.optim.AdamW`` after backward. Prints the plan, each step's loss and time, and on a
GPU the peak.

    python3 plain_loop.py [--steps 20] [--budget-mb 24] [--layers 4] [--batch 2] [--seq 128]
"""

import time

import random_gpt2  # first: it installs Headroom's allocator before anything touches CUDA

import torch

import headroom.torch

args = random_gpt2.options(__doc__)
model, cuda = random_gpt2.model(args)
device = next(model.parameters()).device
if cuda:
    import headroom.optim

    optimizer = headroom.torch.optimizer_in_backward(
        model, headroom.optim.AdamW(model.parameters(), lr=3e-4), clip=1.0)
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

rows = random_gpt2.token_rows(args, (args.steps + 1) * args.batch, model.config.vocab_size)
batches = rows.to(device).split(args.batch)
plan = headroom.torch.plan_blocks(model.transformer.h, args.budget_mb,
                                  lambda: model(batches[-1], labels=batches[-1]).loss)
for step, ids in enumerate(batches[:-1]):
    started = time.perf_counter()
    loss = model(ids, labels=ids).loss
    if cuda:
        optimizer.backward(loss)  # exact clipping: a measuring pass, then the stepping one
        torch.cuda.synchronize()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"step {step:3d}  loss {loss.item():.4f}  {1e3 * (time.perf_counter() - started):.1f} ms")
if cuda:
    print(f"peak allocated {headroom.cuda.max_memory_allocated() / 2**20:.1f} MiB")
plan.remove()
