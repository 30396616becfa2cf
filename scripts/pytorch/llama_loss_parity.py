"""transformers' side of the Llama loss parity (issue 30: "the 1B shape's loss equal to
transformers' f32 loss within 1e-6 relative from the same safetensors").

Reads the directory that ops-cuda's `llama_loss_parity` example wrote (`config.json` and
`model.safetensors`, a Hugging Face checkpoint of headroom-nn's random-init model;
`input_ids.safetensors`, the token ids and our rotary `inv_freq`; `headroom_loss.json`, our f32
losses), loads it with `LlamaForCausalLM.from_pretrained(DIR, dtype=torch.float32,
attn_implementation=...)` on CUDA with TF32 off, once per attention implementation (`sdpa`, then
`eager`; --device cpu for a tiny model), and computes `model(input_ids=ids, labels=ids).loss` under `no_grad`. Before each loss
it checks that transformers built our model: no missing, unexpected or mismatched weight, the
head tied to the embedding exactly when the config says so, the same parameter count, and the
rotary `inv_freq` bit-equal to ours (the rotary type, base and Llama 3 scaling read as meant).

Writes --out (JSON): our two losses (`loss_forward`: `forward` + `loss`; `loss_from_hidden`: the
fused head and loss), transformers' per attention implementation, every relative difference
|ours - theirs| / |theirs|, the tolerance, the versions and the GPU; exits 1 when a relative
difference exceeds --tolerance (default 1e-6), 2 when the checkpoint did not load as our model.

Usage (scripts/gpu-measure.sh llama-parity runs both sides):
    .gpu-bundle/benches/llama_loss_parity /tmp/parity      # or cargo run --example, see its header
    python3 scripts/pytorch/llama_loss_parity.py /tmp/parity --out llama_parity.json
"""
import argparse
import gc
import json
import os
import sys


def load(directory, attn, dtype, device):
    """The checkpoint as transformers' LlamaForCausalLM on `device`, and its loading report."""
    import transformers
    from transformers import AutoModelForCausalLM

    major = int(transformers.__version__.split('.')[0])
    # transformers 5 names the argument `dtype`; 4 takes `torch_dtype`.
    dtype_arg = {'dtype': dtype} if major >= 5 else {'torch_dtype': dtype}
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation=attn, output_loading_info=True, **dtype_arg)
    return model.to(device).eval(), info


def check_model(model, info, ours, inv_freq, attn):
    """Problems with transformers' model as a copy of ours (empty: it is ours)."""
    import torch

    problems = []
    config = model.config
    tied = bool(config.tie_word_embeddings)
    for kind in ('missing_keys', 'unexpected_keys', 'mismatched_keys', 'error_msgs'):
        found = [k for k in (info.get(kind) or [])
                 if not (tied and kind == 'missing_keys' and 'lm_head.weight' in str(k))]
        if found:
            problems.append(f'{attn}: {kind}: {found[:5]}')
    if config._attn_implementation != attn:
        problems.append(f'{attn}: attention is {config._attn_implementation}')
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if tied != (head.data_ptr() == embed.data_ptr()):
        problems.append(f'{attn}: tie_word_embeddings {tied} but the head '
                        f'{"is" if head.data_ptr() == embed.data_ptr() else "is not"} the embedding')
    count = sum(p.numel() for p in model.parameters())
    if count != ours['num_parameters']:
        problems.append(f'{attn}: {count} parameters, ours {ours["num_parameters"]}')
    theirs = model.model.rotary_emb.inv_freq.detach().float().cpu()
    if not torch.equal(theirs, inv_freq):
        worst = (theirs - inv_freq).abs().max().item()
        problems.append(f'{attn}: rotary inv_freq differs from ours (worst {worst:.3e})')
    if any(p.dtype != torch.float32 for p in model.parameters()):
        problems.append(f'{attn}: parameters not all float32')
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('dir', help='the directory the llama_loss_parity example wrote')
    parser.add_argument('--out', default='llama_parity.json', help='the result, JSON')
    parser.add_argument('--attn', default='sdpa,eager',
                        help='attention implementations, by commas (default sdpa,eager)')
    parser.add_argument('--tolerance', type=float, default=1e-6,
                        help='the largest relative difference that passes (default 1e-6)')
    parser.add_argument('--device', default='cuda',
                        help='where transformers runs (default cuda; cpu checks a tiny model)')
    args = parser.parse_args()

    import torch
    import transformers
    from safetensors.torch import load_file

    # f32 products in f32 (TF32 off), as our side runs them.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision('highest')

    with open(os.path.join(args.dir, 'headroom_loss.json')) as f:
        ours = json.load(f)
    inputs = load_file(os.path.join(args.dir, 'input_ids.safetensors'))
    ids = inputs['input_ids'].to(args.device)
    inv_freq = inputs['inv_freq'].float()
    assert list(ids.shape) == [ours['batch'], ours['seq']], (ids.shape, ours)

    result = dict(
        tool='llama_loss_parity.py', model=ours['model'], batch=ours['batch'], seq=ours['seq'],
        seed=ours['seed'], dtype='float32', tf32=False, tolerance=args.tolerance,
        device=args.device,
        gpu=torch.cuda.get_device_name(0) if args.device.startswith('cuda') else None,
        versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                      python=sys.version.split()[0]),
        headroom=dict(device=ours.get('device'), loss_forward=ours['loss_forward'],
                      loss_from_hidden=ours['loss_from_hidden']),
        transformers={}, relative_differences={}, problems=[])
    for attn in [a for a in args.attn.split(',') if a]:
        model, info = load(args.dir, attn, torch.float32, args.device)
        result['problems'] += check_model(model, info, ours, inv_freq, attn)
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        assert loss.dtype == torch.float32, loss.dtype
        result['transformers'][attn] = loss.item()
        del model, loss
        gc.collect()
        if args.device.startswith('cuda'):
            torch.cuda.empty_cache()
    for attn, theirs in result['transformers'].items():
        for name in ('loss_forward', 'loss_from_hidden'):
            key = f'{name}_vs_{attn}'
            result['relative_differences'][key] = abs(ours[name] - theirs) / abs(theirs)
    if {'sdpa', 'eager'} <= set(result['transformers']):
        sdpa, eager = result['transformers']['sdpa'], result['transformers']['eager']
        # transformers against itself, for scale (not checked).
        result['transformers_sdpa_vs_eager'] = abs(sdpa - eager) / abs(eager)
    worst = max(result['relative_differences'].values(), default=float('inf'))
    result['worst_relative_difference'] = worst
    result['pass'] = not result['problems'] and worst <= args.tolerance
    text = json.dumps(result, indent=2)
    with open(args.out, 'w') as f:
        f.write(text + '\n')
    print(text)
    if result['problems']:
        print('the checkpoint did not load as our model:', *result['problems'], sep='\n  ',
              file=sys.stderr)
        sys.exit(2)
    if worst > args.tolerance:
        print(f'relative difference {worst:.3e} is over the tolerance {args.tolerance:g}',
              file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    main()
