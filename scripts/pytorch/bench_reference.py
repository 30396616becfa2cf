"""PyTorch's side of `cargo xtask bench-memory`: the same cases on the same models, measured with
PyTorch's reference protocol, written as the `anchor.jsonl` that `bench-memory --pytorch` reads.

Models: torchvision's ViTs (`loss = model(x).sum()` on `rand(batch, 3, 224, 224)`; autocast cases
`model(x).float().sum()`), Hugging Face's GPT-2 family (`GPT2LMHeadModel`) and Llama family
(`LlamaForCausalLM` with the shapes of headroom-nn's `LlamaConfig` presets: Llama-3.2-1B/3B and
Llama-3.1-8B, vocabulary 128256, rotary base 500000 with Llama 3's scaling, tied embeddings for
1B and 3B; `llama-tiny` and `qwen2-tiny` too; Llama-3.1-70B, and Qwen2.5-14B/32B as
`Qwen2ForCausalLM`, for find_max_model.py), each with `attn_implementation="sdpa"`, dropout
off, `use_cache=False`, random init from seed 0; `loss = model(input_ids=ids, labels=ids).loss`
on `--seq` random tokens a row (default 1024 for GPT-2, 2048 for the Llama shapes, 64 for the
tiny ones). The checkpointing cases wrap every block in `torch.utils.checkpoint` (non-reentrant);
on a Llama they call Hugging Face's own `gradient_checkpointing_enable()` (non-reentrant), which
checkpoints every decoder layer.

Protocol per case: a fresh model and optimizer; the peak is reset, 3 warm-up steps give the
first-3 peak; the peak is reset again and 6 steps timed with CUDA events give the steady peak
(allocated and reserved) and the median step time. Each case runs in its own process unless
`--in-process` (then `gc.collect()` and `empty_cache()` between cases).

Usage:
    python3 scripts/pytorch/bench_reference.py --out anchor.jsonl                 # ViT-L/16, batch 1 and 32, every case
    python3 scripts/pytorch/bench_reference.py --batch 32 --cases sgd_bf16_model --out anchor_vit_step.jsonl
    python3 scripts/pytorch/bench_reference.py --model gpt2 --seq 1024 --batch 8 \\
        --cases fwd_bwd,fwd_bwd_bf16,adam_fused --out anchor.jsonl
    python3 scripts/pytorch/bench_reference.py --model llama-3.2-1b --seq 2048 --batch 4 \\
        --cases fwd_bwd,fwd_bwd_bf16 --out anchor.jsonl
then `cargo xtask bench-memory ... --pytorch anchor.jsonl` with the same model, batches and cases.

Case names are bench-memory's. `adam8bit` needs bitsandbytes (its line reports the error
without it); the `adamw8bit_*` and `adamw4bit_*` cases torchao (0.18: `AdamW8bit`, `AdamW4bit`
with `bf16_stochastic_round=True` on the bf16 model; inside backward one optimizer per
parameter, stepped by a post-accumulate-grad hook); `adamw_inbwd_bf16` torchao's `_AdamW`
(f32 moments, `bf16_stochastic_round=True`) the same way and `adamw_offload_inbwd_bf16` its
`CPUOffloadOptimizer(torch.optim.AdamW, offload_gradients=True, fused=True)` (also the anchor
of `adamw_offload_stream_inbwd_bf16`, whose GPU steps the host-held moments); `adam_fp8` and
`adam_inbwd_ckpt_fp8` torchao's float8 training (tensorwise) on every linear but the head inside
bf16 autocast, compiled (`to_float8_training`), and `adam_inbwd_fp8` the same with the
tutorial's optimizer in backward; bench-memory's cases with no PyTorch counterpart (`adam_foreach_unbounded` is
`adam_foreach` here, `adam8bit_inbwd`, `adam_inbwd_clip`, `adam_inbwd_clip_prev`,
`adam_ckpt8bit`, `adam_auto`) are not offered. `sgd_bf16_model` is no bench-memory case but
PyTorch's side of `crates/ops-cuda/benches/vit_step.rs`'s bf16 setting: `model.bfloat16()` (bf16
parameters, input and activations, no autocast) with the default SGD at lr 1e-3; it runs only
when `--cases` names it.
"""
import argparse
import contextlib
import gc
import json
import math
import subprocess
import sys
import time

# bench-memory's cases that PyTorch has.
CASES = [
    'adam_foreach', 'adam_single', 'sgd', 'adam_fused', 'adam_inbwd', 'adam8bit', 'adam_ckpt',
    'adam_inbwd_ckpt', 'adam_fused_clip', 'adam_offload', 'adam_bf16', 'adam_fp16',
    'adam_inbwd_ckpt_bf16', 'fwd_bwd', 'fwd_bwd_bf16', 'fwd_bwd_bf16_ckpt',
    'adamw8bit_bf16_ckpt', 'adamw8bit_inbwd_bf16_ckpt', 'adamw4bit_bf16_ckpt',
    'adamw4bit_inbwd_bf16_ckpt', 'adamw8bit_bf16', 'adamw8bit_inbwd_bf16', 'adamw4bit_bf16',
    'adamw4bit_inbwd_bf16', 'adamw_inbwd_bf16', 'adamw_offload_inbwd_bf16',
    'adamw_offload_stream_inbwd_bf16', 'adam_fp8', 'adam_inbwd_ckpt_fp8', 'adam_inbwd_fp8',
]
# Cases of other benches, run when --cases names them (not by default, not by find_max_batch.py).
OTHER_CASES = ['sgd_bf16_model']
# Cases whose whole model is bf16 (`model.bfloat16()`), without autocast.
BF16_MODEL_CASES = {'fwd_bwd_bf16', 'fwd_bwd_bf16_ckpt', 'sgd_bf16_model', 'adamw8bit_bf16_ckpt',
                    'adamw8bit_inbwd_bf16_ckpt', 'adamw4bit_bf16_ckpt',
                    'adamw4bit_inbwd_bf16_ckpt', 'adamw4bit_inbwd_bf16', 'adamw8bit_bf16',
                    'adamw8bit_inbwd_bf16', 'adamw4bit_bf16', 'adamw_inbwd_bf16',
                    'adamw_offload_inbwd_bf16', 'adamw_offload_stream_inbwd_bf16'}
# bf16 autocast with every linear but the head in torchao's float8 training (tensorwise).
FP8_CASES = {'adam_fp8', 'adam_inbwd_ckpt_fp8', 'adam_inbwd_fp8'}
VIT_MODELS = {'vit_l_16', 'vit_b_16'}
GPT2_MODELS = {  # Hugging Face's configs: (n_embd, n_layer, n_head)
    'gpt2': (768, 12, 12),
    'gpt2-medium': (1024, 24, 16),
    'gpt2-large': (1280, 36, 20),
}
LLAMA3_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
    rope_parameters=dict(rope_type='llama3', rope_theta=500000.0, factor=32.0,
                         low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192))
LLAMA_TINY = dict(
    LLAMA3_1B, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    tie_word_embeddings=False, rope_parameters=dict(LLAMA3_1B['rope_parameters'], factor=8.0))
# headroom-nn's `LlamaConfig` presets, as Hugging Face config arguments (`LlamaConfig::named`).
LLAMA_MODELS = {
    'llama-tiny': LLAMA_TINY,
    'qwen2-tiny': dict(LLAMA_TINY, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters=dict(rope_type='default', rope_theta=1e6)),
    'llama-3.2-1b': LLAMA3_1B,
    'llama-3.2-3b': dict(LLAMA3_1B, hidden_size=3072, num_hidden_layers=28,
                         num_attention_heads=24, head_dim=128),
    'llama-3.1-8b': dict(LLAMA3_1B, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, head_dim=128, tie_word_embeddings=False,
                         rope_parameters=dict(LLAMA3_1B['rope_parameters'], factor=8.0)),
}
LLAMA_MODELS['llama-3.1-70b'] = dict(LLAMA_MODELS['llama-3.1-8b'], hidden_size=8192,
                                     intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64)
# Qwen2.5's shapes (Qwen2ForCausalLM: q/k/v biases, its head width hidden / heads = 128).
QWEN2_5_14B = dict(
    vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
    num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=False,
    rope_parameters=dict(rope_type='default', rope_theta=1e6))
LLAMA_MODELS['qwen2.5-14b'] = QWEN2_5_14B
LLAMA_MODELS['qwen2.5-32b'] = dict(QWEN2_5_14B, intermediate_size=27648, num_hidden_layers=64)
LANGUAGE_MODELS = set(GPT2_MODELS) | set(LLAMA_MODELS)


def default_seq(model_name):
    """bench-memory's tokens a row without --seq: GPT-2's 1024, 2048 for a Llama shape, the tiny
    ones' whole context (64)."""
    if model_name in LLAMA_MODELS:
        return min(2048, LLAMA_MODELS[model_name]['max_position_embeddings'])
    return 1024


def build_model(model_name, case, layers=None):
    """The model on the GPU, its blocks checkpointed or offloaded as the case says (a Llama-family
    model with `layers` decoder layers when given; a bf16-model case's Llama built in bf16)."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    if model_name in VIT_MODELS:
        from torchvision import models
        model = getattr(models, model_name)(weights=None)
        blocks = model.encoder.layers
    elif model_name in GPT2_MODELS:
        from transformers import AutoModelForCausalLM, GPT2Config
        n_embd, n_layer, n_head = GPT2_MODELS[model_name]
        config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, attn_pdrop=0.0,
                            resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
        model = AutoModelForCausalLM.from_config(config, attn_implementation='sdpa')
        blocks = model.transformer.h
    elif model_name in LLAMA_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
        shapes = dict(LLAMA_MODELS[model_name], attention_dropout=0.0, hidden_act='silu',
                      initializer_range=0.02, use_cache=False, attn_implementation='sdpa')
        if layers is not None:
            shapes['num_hidden_layers'] = layers
        if model_name.startswith('qwen2'):
            # Qwen2's head width is hidden / heads (as given); q/k/v carry biases.
            shapes.pop('head_dim', None)
            shapes.pop('attention_bias', None)
            config, cls = Qwen2Config(**shapes, use_sliding_window=False), Qwen2ForCausalLM
        else:
            config, cls = LlamaConfig(**shapes, mlp_bias=False), LlamaForCausalLM
        # Initialised on the GPU (8B parameters in f32 are 32 GB; a bf16-model case's in bf16,
        # so that a model whose f32 weights would not fit is built), in training mode: Hugging
        # Face's checkpointing acts only while training.
        default_dtype = torch.get_default_dtype()
        if case in BF16_MODEL_CASES:
            torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device('cuda'):
                model = cls(config)
        finally:
            torch.set_default_dtype(default_dtype)
        model.train()
        assert model.config._attn_implementation == 'sdpa', model.config._attn_implementation
        if 'ckpt' in case:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=dict(use_reentrant=False))
        blocks = model.model.layers
    else:
        raise SystemExit(f'unknown model {model_name} (models: vit_l_16, vit_b_16, '
                         f'{", ".join(sorted(LANGUAGE_MODELS))})')

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    class Offloaded(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return self.inner(*args, **kwargs)

    n = len(blocks)
    if 'ckpt' in case and model_name not in LLAMA_MODELS:
        for i in range(n):
            blocks[i] = Checkpointed(blocks[i])
    if case == 'adam_offload':
        # bench-memory's offload_blocks: the first 7/12 of the blocks.
        for i in range(math.ceil(7 * n / 12)):
            blocks[i] = Offloaded(blocks[i])
    model = model.cuda()
    if case in BF16_MODEL_CASES:
        model = model.bfloat16()
    return model


def to_float8_training(model):
    """torchao's float8 training (`convert_to_float8_training`, its default tensorwise recipe) on
    every linear but the head, compiled as torchao advises (its casts are fused only under
    `torch.compile`). GPT-2's projections are transformers' `Conv1D`, which torchao does not
    convert, so they first become the equal `nn.Linear`."""
    import torch
    from torch import nn
    from torchao.float8 import convert_to_float8_training
    from transformers.pytorch_utils import Conv1D

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                fan_in, fan_out = child.weight.shape
                linear = nn.Linear(fan_in, fan_out, device=child.weight.device,
                                   dtype=child.weight.dtype)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(module, child_name, linear)
    convert_to_float8_training(
        model, module_filter_fn=lambda mod, fqn: 'lm_head' not in fqn and 'heads' not in fqn)
    return torch.compile(model)


def step_in_backward(params, optimizer_of):
    """The tutorial's optimizer in backward: `optimizer_of(p)` for each parameter, stepped and
    zeroed by a post-accumulate-grad hook as soon as the parameter's gradient is final."""
    per_param = {p: optimizer_of(p) for p in params}

    def hook(p):
        per_param[p].step()
        per_param[p].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def build_case(case, model_name, seq, layers=None):
    """A case's model and optimizer: `(step(batch_input), make_input(batch), zero_grad())`."""
    import torch

    model = build_model(model_name, case, layers)
    if case in FP8_CASES:
        model = to_float8_training(model)
    params = list(model.parameters())
    autocast_bf16 = 'bf16' in case or case in FP8_CASES
    amp = torch.bfloat16 if autocast_bf16 and case not in BF16_MODEL_CASES else None
    scaler = None
    if 'fp16' in case:
        amp = torch.float16
        scaler = torch.amp.GradScaler('cuda')
    opt = None
    if case == 'adamw_inbwd_bf16':
        # torchao's AdamW with f32 moments and bf16 stochastic rounding, one per parameter from
        # a post-accumulate-grad hook.
        import torchao.optim
        step_in_backward(params, lambda p: torchao.optim._AdamW(
            [p], lr=1e-4, bf16_stochastic_round=True))
    elif case in ('adamw_offload_inbwd_bf16', 'adamw_offload_stream_inbwd_bf16'):
        # torchao's CPUOffloadOptimizer: AdamW on the host, gradients moved out from
        # post-accumulate-grad hooks (offload_gradients=True), parameters copied back in step().
        import torchao.optim
        opt = torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True,
                                                lr=1e-4, fused=True)
    elif case.startswith(('adamw8bit', 'adamw4bit')):
        # torchao's AdamW8bit / AdamW4bit on the bf16 model, stochastic rounding (no master
        # copy); inside backward, one optimizer per parameter as the tutorial does.
        import torchao.optim
        cls = torchao.optim.AdamW8bit if '8bit' in case else torchao.optim.AdamW4bit
        if 'inbwd' in case:
            step_in_backward(params, lambda p: cls([p], lr=1e-4, bf16_stochastic_round=True))
        else:
            opt = cls(params, lr=1e-4, bf16_stochastic_round=True)
    elif case.startswith('adam8bit'):
        import bitsandbytes as bnb
        opt = bnb.optim.Adam8bit(params, lr=1e-4)
    elif case in ('sgd', 'sgd_bf16_model'):
        opt = torch.optim.SGD(params, lr=1e-3)
    elif case.startswith('fwd_bwd'):
        opt = None
    elif 'inbwd' in case:
        # The tutorial's optimizer in backward: one Adam(foreach=False) per parameter.
        step_in_backward(params, lambda p: torch.optim.Adam([p], lr=1e-4, foreach=False))
    elif case == 'adam_single':
        opt = torch.optim.Adam(params, lr=1e-4, foreach=False)
    elif case == 'adam_foreach':
        opt = torch.optim.Adam(params, lr=1e-4)  # foreach on CUDA by default
    else:
        opt = torch.optim.Adam(params, lr=1e-4, fused=True)
    clip = case == 'adam_fused_clip'
    language = model_name in LANGUAGE_MODELS
    dtype = torch.bfloat16 if case in BF16_MODEL_CASES else torch.float32

    def make_input(batch):
        if language:
            return torch.randint(0, model.config.vocab_size, (batch, seq), device='cuda')
        return torch.rand(batch, 3, 224, 224, device='cuda', dtype=dtype)

    def loss_of(x):
        if language:
            return model(input_ids=x, labels=x).loss
        out = model(x)
        return out.float().sum() if out.dtype != torch.float32 else out.sum()

    def step(x):
        autocast = (torch.autocast('cuda', dtype=amp) if amp is not None
                    else contextlib.nullcontext())
        with autocast:
            loss = loss_of(x)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return
        loss.backward()
        del loss
        if opt is not None:
            if clip:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        zero_grad()

    def zero_grad():
        for p in params:
            p.grad = None

    return step, make_input, zero_grad, sum(p.numel() * p.element_size() for p in params)


def run_case(case, model_name, batch, seq, warmup=3, steps=6):
    """PyTorch's reference protocol for one case: one anchor line."""
    import torch

    step, make_input, _, param_bytes = build_case(case, model_name, seq)
    x = make_input(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step(x)
    torch.cuda.synchronize()
    first3_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    row = dict(case=case, model=model_name, batch=batch, param_bytes=param_bytes,
               first3_peak_alloc=first3_peak,
               steady_peak_alloc=torch.cuda.max_memory_allocated(),
               steady_peak_reserved=torch.cuda.max_memory_reserved(),
               step_ms_median=times[len(times) // 2], step_ms_min=times[0], times_ms=times)
    if model_name in LANGUAGE_MODELS:
        row['seq'] = seq
    return row



@contextlib.contextmanager
def json_lines(path):
    """An `emit(row)` that prints `row` as JSON and appends it as one line to `path`."""
    with open(path, 'a') as out:
        def emit(row):
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + '\n')
            out.flush()

        yield emit

def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='vit_l_16')
    parser.add_argument('--seq', type=int,
                        help='tokens a row of a language model (default 1024 for GPT-2, 2048 '
                             'for a Llama shape, 64 for the tiny ones)')
    parser.add_argument('--batch', type=int, action='append',
                        help='repeatable; default 1 and 32')
    parser.add_argument('--cases', default=','.join(CASES))
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--steps', type=int, default=6)
    parser.add_argument('--out', default='anchor.jsonl', help='appended to')
    parser.add_argument('--in-process', action='store_true',
                        help='run every case in this process (faster; peaks after empty_cache)')
    parser.add_argument('--one', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [c for c in args.cases.split(',') if c]
    for case in cases:
        if case not in CASES + OTHER_CASES:
            raise SystemExit(f'unknown case {case} (cases: {", ".join(CASES + OTHER_CASES)})')
    batches = args.batch or [1, 32]
    if args.seq is None:
        args.seq = default_seq(args.model)
    if args.one:
        print(json.dumps(run_case(cases[0], args.model, batches[0], args.seq, args.warmup,
                                  args.steps)))
        return
    import torch
    with json_lines(args.out) as emit:
        emit(dict(case='env', torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
                  model=args.model))
        for batch in batches:
            for case in cases:
                started = time.time()
                if args.in_process:
                    try:
                        row = run_case(case, args.model, batch, args.seq, args.warmup, args.steps)
                    except Exception as ex:  # reported, the other cases still run
                        row = dict(case=case, model=args.model, batch=batch, error=repr(ex)[:300])
                    gc.collect()
                    torch.cuda.empty_cache()
                else:
                    command = [sys.executable, __file__, '--one', '--model', args.model,
                               '--seq', str(args.seq), '--batch', str(batch), '--cases', case,
                               '--warmup', str(args.warmup), '--steps', str(args.steps)]
                    done = subprocess.run(command, capture_output=True, text=True)
                    lines = [l for l in done.stdout.splitlines() if l.startswith('{')]
                    row = (json.loads(lines[-1]) if lines else
                           dict(case=case, model=args.model, batch=batch,
                                error=done.stderr[-300:]))
                row['wall_s'] = round(time.time() - started, 1)
                emit(row)


if __name__ == '__main__':
    main()
