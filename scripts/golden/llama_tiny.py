"""Golden data for headroom-nn's Llama family: Hugging Face's LlamaForCausalLM and
Qwen2ForCausalLM with the shapes of `LlamaConfig::tiny()` and `LlamaConfig::qwen2_tiny()`, in
float64 on the CPU (any machine with torch 2.11 and transformers 5.17; the GPU machine has them).

Both models: vocab 128, hidden 64, intermediate 128, 2 layers, 4 query heads sharing 2 key/value
heads of 16, eager attention, no dropout. Llama: RMSNorm eps 1e-5, untied lm_head, Llama 3.1's
rotary scaling (theta 500000, factor 8, low 1, high 4, original 8192). Qwen2: q/k/v biases, tied
lm_head, RMSNorm eps 1e-6, theta 1e6 unscaled. Each is built with Hugging Face's seeded init, then
every parameter is redrawn from a seeded generator: matrices, embeddings and biases from
N(0, 0.15^2), norm scales from 1 + N(0, 0.1^2), so that no parameter sits at a value that hides a
mistake (unit norm scales, zero biases) and the logits are far from uniform. The batch is
input_ids [2, 16] with labels = input_ids; forward, Hugging Face's causal-LM loss and backward.

Writes OUTDIR/llama_golden.safetensors with, under `llama.` and `qwen2.`: `param.<name>` for every
parameter (Hugging Face's names, `named_parameters()`, so no `lm_head.weight` when tied),
`input_ids` (int64), `logits` (float64), `loss` ([1], the dtype Hugging Face returns),
`grad.<name>` for every parameter and `inv_freq` (the rotary buffer, float32); the metadata holds
the versions, each config as JSON and each loss's dtype.

Hugging Face rounds to float32 inside a float64 model in four places, so the reference carries
float32 rounding: RMSNorm (`hidden_states.to(torch.float32)`), the rotary tables (f32 `inv_freq`,
angle, cos and sin), eager attention's softmax (`dtype=torch.float32`) and the loss
(`logits.float()` in ForCausalLMLoss, so the loss is float32 and every gradient passes through
it).

Run from the repository root: python3 scripts/golden/llama_tiny.py testdata
"""
import json
import math
import platform
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else "testdata"

SHAPES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    hidden_act="silu",
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=False,
    attn_implementation="eager",
)
# Qwen2 derives its head width, hidden_size / num_attention_heads; Llama is given the same.
HEAD_DIM = 16
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def llama3_inv_freq(rope, dim):
    """`_compute_llama3_parameters` as headroom-nn's RotaryEmbedding computes it (f32)."""
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    stretched = torch.where(wavelen > low_wavelen, inv / rope["factor"], inv)
    smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
        rope["high_freq_factor"] - rope["low_freq_factor"]
    )
    smoothed = (1 - smooth) * stretched / rope["factor"] + smooth * stretched
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, stretched)


def build(prefix, seed):
    if prefix == "llama":
        config = LlamaConfig(
            **SHAPES,
            head_dim=HEAD_DIM,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            rope_parameters=dict(LLAMA3_ROPE),
        )
        cls = LlamaForCausalLM
    else:
        config = Qwen2Config(
            **SHAPES,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        )
        cls = Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64)
    model.train()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.15 * noise)
    return config, model


def run(prefix, seed):
    config, model = build(prefix, seed)
    inv_freq = model.model.rotary_emb.inv_freq.detach().cpu()
    if prefix == "llama":
        expected = llama3_inv_freq(LLAMA3_ROPE, HEAD_DIM)
    else:
        expected = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
    # The config was read as meant (rotary type, base and scaling).
    assert torch.equal(inv_freq, expected), (inv_freq, expected)
    ids = torch.randint(0, SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed + 200))
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    tensors = {
        f"{prefix}.input_ids": ids.contiguous(),
        f"{prefix}.logits": output.logits.detach().contiguous(),
        f"{prefix}.loss": output.loss.detach().reshape(1).contiguous(),
        f"{prefix}.inv_freq": inv_freq.float().contiguous(),
    }
    names = []
    for name, param in model.named_parameters():
        names.append(name)
        tensors[f"{prefix}.param.{name}"] = param.detach().contiguous()
        tensors[f"{prefix}.grad.{name}"] = param.grad.detach().contiguous()
    assert output.logits.dtype == torch.float64, output.logits.dtype
    meta = {
        f"{prefix}.config": config.to_json_string(use_diff=False),
        f"{prefix}.loss_dtype": str(output.loss.dtype),
        f"{prefix}.parameters": str(len(names)),
    }
    return tensors, meta, output.loss.item()


tensors, meta = {}, {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "python": platform.python_version(),
    "script": "scripts/golden/llama_tiny.py",
}
losses = {}
for seed, prefix in enumerate(["llama", "qwen2"]):
    model_tensors, model_meta, loss = run(prefix, seed)
    tensors.update(model_tensors)
    meta.update(model_meta)
    losses[prefix] = loss
path = f"{out}/llama_golden.safetensors"
save_file(tensors, path, metadata=meta)
print(
    f"wrote {path}: {len(tensors)} tensors, torch {torch.__version__}, transformers "
    f"{transformers.__version__}, llama loss {losses['llama']:.6f} ({meta['llama.loss_dtype']}), "
    f"qwen2 loss {losses['qwen2']:.6f} ({meta['qwen2.loss_dtype']}); "
    + json.dumps({k: meta[k] for k in ("llama.parameters", "qwen2.parameters")})
)
