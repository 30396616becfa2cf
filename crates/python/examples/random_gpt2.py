"""The model the examples train: a GPT-2-shaped causal LM (transformers' ``GPT2LMHeadModel``,
random weights, dropout off) on random token ids, on a GPU when there is one (with Headroom's
allocator, installed when this module is imported: import it before transformers or lightning)
and else on the CPU; and the options the examples take."""

import argparse

import torch

if torch.cuda.is_available():
    import headroom.cuda

    # Before the first CUDA allocation, so before transformers and lightning are imported:
    # importing them can initialise CUDA (transformers imports torchao where it is installed,
    # and torchao reads the GPU's properties), after which the allocator cannot change. The
    # examples import this module first for that reason.
    headroom.cuda.use_allocator()

from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402 (after the allocator)


def options(doc):
    """The examples' command line: ``--steps``, ``--budget-mb`` (the blocks' saved activations,
    MiB), ``--layers``, ``--batch``, ``--seq``."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget-mb", type=float, default=24.0,
                        help="the blocks' saved activations, MiB")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    return parser.parse_args()


def model(args):
    """(the model on its device, whether that is a GPU)."""
    cuda = torch.cuda.is_available()  # the allocator was installed at import
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_positions=args.seq, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).to("cuda" if cuda else "cpu"), cuda


def token_rows(args, rows, vocab_size, seed=1):
    """``rows`` rows of ``args.seq`` random token ids (on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (rows, args.seq), generator=generator)
