"""Golden data for autograd-core's fused `linear_cross_entropy` (issue 31): PyTorch's
`F.cross_entropy(hidden @ weight.T + bias, labels, ignore_index=..., reduction=...,
label_smoothing=...)` plus the z-loss term, its value and the gradients of hidden, weight and bias
by torch autograd, all in float64 on the CPU (any machine with torch; no GPU needed).

The head: hidden [37, 16] ~ N(0, 1), weight [301, 16] ~ N(0, 0.5^2), bias [301] ~ N(0, 0.3^2),
seed 0; 301 classes, so a 256-class tile leaves a 45-class tail. Two label sets of 37 tokens,
drawn uniformly from the classes:
- `input.labels`: tokens 3, 10, 11, 20 and 36 set to -100 (ignored under the default
  ignore_index) and tokens 5 and 29 set to class 7 (a valid class there; token 23 is drawn as 7
  too);
- `input.labels_ignore7`: the same with the -100 tokens set to 7 too (no -100: PyTorch rejects an
  out-of-range label that is not the ignore_index), so 8 tokens are ignored under
  ignore_index = 7.

PyTorch has no z-loss; it is PaLM's (and Liger's, and headroom's) auxiliary term: each token not
ignored adds `z_loss * logsumexp(logits)^2` to its loss, an ignored token adds nothing, and the
terms combine by the case's reduction (the mean divides by the number of tokens not ignored, as
PyTorch's mean of the cross-entropy does; `none` keeps one value per token, 0 at ignored ones).

Cases, named `<reduction>.ls<label_smoothing>.z<z_loss>.ignore<ignore_index>` (numbers as
Python's `:g` formats them): every reduction (mean, sum, none) x label_smoothing (0, 0.1, 1) x
z_loss (0, 0.001) with ignore_index -100, and two with ignore_index 7 (mean with 0.1 and 0.001;
sum with 0 and 0). Each case stores `<case>.loss` (a scalar for mean and sum, [37] for none),
`<case>.grad.hidden`, `<case>.grad.weight` and `<case>.grad.bias`: the gradients of the loss
for mean and sum, and for none of `(loss * input.loss_weights).sum()`, an uneven output gradient
(`0.5 + i / 10` for token i) so that each token's share of the gradient is checked. The metadata holds the torch and Python
versions, the seed, the shapes, `cases` (the names in order, comma-separated) and each case's
options as JSON.

The file is written with a few lines of this script (the safetensors layout: an 8-byte
little-endian header length, a JSON header padded with spaces to 8 bytes, the tensors' bytes),
so that nothing beyond torch is needed.

Run from the repository root: python3 scripts/golden/linear_cross_entropy.py testdata
"""
import json
import platform
import struct
import sys

import torch
import torch.nn.functional as F

out = sys.argv[1] if len(sys.argv) > 1 else "testdata"
SEED, TOKENS, FEATURES, CLASSES = 0, 37, 16, 301

torch.manual_seed(SEED)
dt = torch.float64
hidden0 = torch.randn(TOKENS, FEATURES, dtype=dt)
weight0 = torch.randn(CLASSES, FEATURES, dtype=dt) * 0.5
bias0 = torch.randn(CLASSES, dtype=dt) * 0.3
labels = torch.randint(0, CLASSES, (TOKENS,), dtype=torch.int64)
ignored = [3, 10, 11, 20, 36]
sevens = [5, 29]
labels[ignored] = -100
labels[sevens] = 7
labels_ignore7 = labels.clone()
labels_ignore7[ignored] = 7
loss_weights = 0.5 + torch.arange(TOKENS, dtype=dt) / 10

cases = []
for reduction in ["mean", "sum", "none"]:
    for label_smoothing in [0.0, 0.1, 1.0]:
        for z_loss in [0.0, 1e-3]:
            cases.append((reduction, label_smoothing, z_loss, -100))
cases.append(("mean", 0.1, 1e-3, 7))
cases.append(("sum", 0.0, 0.0, 7))


def name(reduction, label_smoothing, z_loss, ignore_index):
    return f"{reduction}.ls{label_smoothing:g}.z{z_loss:g}.ignore{ignore_index}"


def loss_of(hidden, weight, bias, target, reduction, label_smoothing, z_loss, ignore_index):
    logits = hidden @ weight.T + bias
    loss = F.cross_entropy(
        logits,
        target,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    if z_loss == 0.0:
        return loss
    kept = (target != ignore_index).to(dt)
    z_term = z_loss * torch.logsumexp(logits, dim=-1) ** 2 * kept
    if reduction == "none":
        return loss + z_term
    if reduction == "sum":
        return loss + z_term.sum()
    return loss + z_term.sum() / kept.sum()


tensors = {
    "input.hidden": hidden0,
    "input.weight": weight0,
    "input.bias": bias0,
    "input.labels": labels,
    "input.labels_ignore7": labels_ignore7,
    "input.loss_weights": loss_weights,
}
meta = {
    "torch": torch.__version__,
    "python": platform.python_version(),
    "seed": str(SEED),
    "shapes": json.dumps({"tokens": TOKENS, "features": FEATURES, "classes": CLASSES}),
    "cases": ",".join(name(*case) for case in cases),
}
for case in cases:
    reduction, label_smoothing, z_loss, ignore_index = case
    target = labels if ignore_index == -100 else labels_ignore7
    hidden = hidden0.clone().requires_grad_(True)
    weight = weight0.clone().requires_grad_(True)
    bias = bias0.clone().requires_grad_(True)
    loss = loss_of(hidden, weight, bias, target, *case)
    (loss * loss_weights if reduction == "none" else loss).sum().backward()
    key = name(*case)
    tensors[f"{key}.loss"] = loss.detach()
    tensors[f"{key}.grad.hidden"] = hidden.grad
    tensors[f"{key}.grad.weight"] = weight.grad
    tensors[f"{key}.grad.bias"] = bias.grad
    meta[key] = json.dumps(
        dict(
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            ignore_index=ignore_index,
            labels="input.labels" if ignore_index == -100 else "input.labels_ignore7",
        )
    )


def save_safetensors(tensors, path, metadata):
    header = {"__metadata__": metadata}
    offset, blobs = 0, []
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous()
        blob = t.numpy().tobytes()
        dtype = {torch.float64: "F64", torch.int64: "I64"}[t.dtype]
        header[key] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


path = f"{out}/linear_cross_entropy_golden.safetensors"
save_safetensors(tensors, path, meta)
print("wrote", path, "with", len(cases), "cases")
for case in cases:
    print(f"  {name(*case)}: loss {tensors[name(*case) + '.loss'].sum().item():.15g}")
