"""Per-block activation plans under a byte budget: ``headroom.torch.plan_blocks``.

``plan = plan_blocks(blocks, budget_mb, step)`` measures what each block of a model saves for
backward in one forward of ``step`` (a callable that runs the model's forward and returns the
loss; it is not backpropagated), then picks per block the strategy that frees the most bytes per
millisecond it costs until the blocks' saved activations fit ``budget_mb``, applies it by
wrapping each block's ``forward``, and prints the plan:

- ``keep``: the block as it is (no cost);
- ``int8``: its saves kept as 8-bit codes (``saved_activations("int8")``: what it encodes is
  about a quarter of its f32 bytes, what it keeps stays; costs an encode and a decode);
- ``checkpoint``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: only its
  inputs are kept and backward runs its forward again (costs that forward);
- ``offload`` (CUDA blocks, when ``allow`` names it): its saves in pinned host memory
  (``saved_activations(None, offload=plan.pool)``: what it offloads leaves the device, the rest
  stays), costed as the copies both ways at ``host_gb_s`` GB/s with no overlap, an upper bound
  (on ViT-L/16 the copies hid about two thirds of that behind compute).

The bytes are measured, not modelled: each save's storage is counted once per block (views of
one storage are one), parameters and what is derived from one through casts and views are not
activations, a checkpointed block keeps the tensors it is called with, and an ``int8`` block's
bytes are what ``saved_activations`` would leave (each encodable save at 1 + 4/256 bytes an
element, views of one storage each on its own, the rest as they are). The costs are measured too: each block's forward time alone, and again
under ``int8`` encoding (the encode measured in the forward, the decode taken as equal). On CUDA
the times are synchronised around each block; on the CPU they are wall time.

``allow`` limits the strategies (``("keep", "int8")``: never recompute; ``("keep",
"checkpoint")``: exact gradients). ``plan.remove()`` restores every block's forward; ``plan.strategies``, ``plan.predicted_bytes``
(the blocks' saved bytes under the plan), ``plan.table``. What raises (``ValueError``): a budget
that is not positive, or below the smallest plan (every block checkpointed; the message says
how much that is); a block that does not run exactly once in ``step``'s forward; a block that
already has a plan.

The profile runs ``step`` four times (twice without ``int8``) with autograd recording and drops
the losses, each block's time the faster of two rounds: modules that update buffers in their
forward (batch norm's running statistics) see four more batches.

This module sits on ``headroom.activations`` and ``torch.utils.checkpoint``; it knows no model.
"""

import time

import torch
import torch.utils.checkpoint

from .activations import _INT8_DTYPES, saved_activations, _derived_from_parameter
from .pinned import PinnedPool

__all__ = ["plan_blocks", "BlockPlan", "STRATEGIES", "DEFAULT_ALLOW"]

#: The strategies a block can take.
STRATEGIES = ("keep", "int8", "checkpoint", "offload")
#: The strategies ``plan_blocks`` considers unless told otherwise (``offload`` is asked for).
DEFAULT_ALLOW = ("keep", "int8", "checkpoint")
_MIB = 1 << 20


def _storage_key(t):
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensor_arguments(args, kwargs):
    found = [a for a in args if isinstance(a, torch.Tensor)]
    found += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    return found


class _Profile:
    """What each block saved and how long its forward took, from one forward."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.calls = [0] * len(blocks)
        self.saved = [0] * len(blocks)
        self.encoded = [0] * len(blocks)
        self.offloaded = [0] * len(blocks)  # the bytes an offloaded block leaves on the device
        self.moved = [0] * len(blocks)  # and the bytes it copies each way
        self.inputs = [0] * len(blocks)
        self.ms = [0.0] * len(blocks)
        self._seen = [set() for _ in blocks]
        self._current = None
        self._started = 0.0
        self._codec = saved_activations("int8")

    def _sync(self, tensors):
        if any(t.device.type == "cuda" for t in tensors):
            torch.cuda.synchronize()

    def hooks(self):
        handles = []
        for i, block in enumerate(self.blocks):
            def before(module, args, kwargs, i=i):
                tensors = _tensor_arguments(args, kwargs)
                self._sync(tensors)
                self.calls[i] += 1
                self._current = i
                self.inputs[i] = sum(t.untyped_storage().nbytes() for t in
                                     {_storage_key(t): t for t in tensors}.values())
                self._started = time.perf_counter()

            def after(module, args, kwargs, output, i=i):
                self._sync(_tensor_arguments(args, kwargs))
                self.ms[i] += 1e3 * (time.perf_counter() - self._started)
                self._current = None

            handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(block.register_forward_hook(after, with_kwargs=True))
        return handles

    def pack(self, t):
        # A detached alias, never ``t`` itself: a node that saves its own output (exp, layer
        # norm's statistics) would hold the tensor that holds the node, a cycle through C++
        # that Python's collector cannot see, and the profile's forwards never run backward to
        # release it: each would keep its whole graph alive.
        i = self._current
        if i is None or _derived_from_parameter(t):
            return t.detach()
        key = _storage_key(t)
        first = key not in self._seen[i]
        self._seen[i].add(key)
        if first:
            self.saved[i] += key[1]
        if self._codec._encodes(t):
            # Each encodable save is encoded on its own (views of one storage too).
            self.encoded[i] += t.numel() + 4 * -(-t.numel() // self._codec.block)
        elif first:
            self.encoded[i] += key[1]
        if t.device.type == "cuda" and self._codec._selected(t, _INT8_DTYPES):
            self.moved[i] += t.numel() * t.element_size()  # each save copied on its own
        elif first:
            self.offloaded[i] += key[1]
        return t.detach()


def _profile(blocks, step, encode):
    profile = _Profile(blocks)
    handles = profile.hooks()
    try:
        if encode:
            # Every block under int8 hooks, to time the encoding.
            originals = [_wrap(block, "int8", None) for block in blocks]
            try:
                step()
            finally:
                for block, original in zip(blocks, originals):
                    _unwrap(block, original)
        else:
            with torch.autograd.graph.saved_tensors_hooks(profile.pack, lambda t: t):
                step()
    finally:
        for handle in handles:
            handle.remove()
    return profile


def _wrap(block, strategy, stats, pool=None):
    """Replaces ``block.forward`` by one that runs it as ``strategy`` says (``offload`` into
    ``pool``); returns what the instance held before (``None``: the class's method)."""
    original = block.__dict__.get("forward")
    inner = block.forward

    if strategy == "checkpoint":
        def forward(*args, **kwargs):
            return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
    elif strategy in ("int8", "offload"):
        def forward(*args, **kwargs):
            if strategy == "int8":
                context = saved_activations("int8")
            else:
                context = saved_activations(None, offload=pool)
            with context as saved:
                out = inner(*args, **kwargs)
            if stats is not None:
                for key, value in saved.stats.items():
                    stats[key] = stats.get(key, 0) + value
            return out
    else:
        return original
    forward.__headroom_plan__ = strategy
    block.forward = forward
    return original


def _unwrap(block, original):
    if original is None:
        block.__dict__.pop("forward", None)
    else:
        block.forward = original


class BlockPlan:
    """The strategies ``plan_blocks`` chose and applied; ``remove()`` undoes them."""

    def __init__(self, blocks, strategies, predicted_bytes, budget_bytes, table, originals):
        self.blocks = blocks
        self.strategies = strategies
        self.predicted_bytes = predicted_bytes
        self.budget_bytes = budget_bytes
        self.table = table
        self.stats = {"saved": 0, "encoded": 0, "shared": 0, "original_bytes": 0,
                      "encoded_bytes": 0}
        self.pool = None  # the PinnedPool of the offloaded blocks, if any
        self._originals = originals

    def remove(self):
        """Restores every block's own forward."""
        for block, original in zip(self.blocks, self._originals):
            _unwrap(block, original)
        self._originals = [None] * len(self.blocks)
        self.strategies = ["keep"] * len(self.blocks)

    def __repr__(self):
        return self.table


def _choose(profile, plain_ms_int8, budget, allow, host_gb_s=55.0):
    """Greedy: from every block kept, the move (to a strategy in ``allow``) that frees the most
    bytes per millisecond until the total fits ``budget``."""
    n = len(profile.blocks)
    memory = {
        "keep": profile.saved,
        "int8": profile.encoded,
        "checkpoint": profile.inputs,
        "offload": profile.offloaded,
    }
    cost = {
        "keep": [0.0] * n,
        "int8": [2 * max(plain_ms_int8[i] - profile.ms[i], 0.0) for i in range(n)],
        "checkpoint": profile.ms,
        "offload": [2 * moved / (host_gb_s * 1e6) for moved in profile.moved],
    }
    strategies = ["keep"] * n
    total = sum(memory["keep"])
    smallest = sum(min(memory[s][i] for s in allow) for i in range(n))
    if smallest > budget:
        raise ValueError(
            f"budget {budget / _MIB:.2f} MiB: the smallest plan of {'/'.join(allow)} saves "
            f"{smallest / _MIB:.2f} MiB (every block at its least); raise budget_mb"
        )
    while total > budget:
        best = None
        for i in range(n):
            now = strategies[i]
            for target in allow:
                freed = memory[now][i] - memory[target][i]
                if freed <= 0:
                    continue
                extra = cost[target][i] - cost[now][i]
                score = freed / max(extra, 1e-3)
                if best is None or score > best[0]:
                    best = (score, i, target, freed)
        _, i, target, freed = best
        strategies[i] = target
        total -= freed
    # The moves overshoot: give back the cheapest-to-keep memory while it still fits, the
    # change that saves the most milliseconds first.
    while True:
        best = None
        for i in range(n):
            now = strategies[i]
            for target in allow:
                grown = memory[target][i] - memory[now][i]
                saved = cost[now][i] - cost[target][i]
                if grown <= 0 or saved <= 0 or total + grown > budget:
                    continue
                if best is None or saved > best[0]:
                    best = (saved, i, target, grown)
        if best is None:
            return strategies, total, memory, cost
        _, i, target, grown = best
        strategies[i] = target
        total += grown


def plan_blocks(blocks, budget_mb, step, *, allow=DEFAULT_ALLOW, print_plan=True, pool=None,
                host_gb_s=55.0):
    """Plans and applies keep, int8, checkpoint or offload per block so that the blocks' saved
    activations fit ``budget_mb`` MiB; see the module's documentation. ``blocks``: the model's
    blocks (e.g. ``model.encoder.layers``), each run once a forward; ``step``: a callable that
    runs the forward and returns the loss; ``allow``: the strategies a block may take besides
    ``keep`` (e.g. ``("keep", "int8")``: never recompute; add ``"offload"`` to let saves go to
    host memory, into ``pool`` or a ``PinnedPool`` of the plan's own, ``plan.pool``);
    ``host_gb_s``: the host link's rate that offload's cost assumes."""
    allow = tuple(dict.fromkeys(("keep",) + tuple(allow)))
    if any(s not in STRATEGIES for s in allow):
        raise ValueError(f"allow={allow!r}: give strategies among {STRATEGIES}")
    blocks = list(blocks)
    if not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks):
        raise ValueError("blocks: give the model's blocks, a non-empty list of nn.Modules")
    if "offload" in allow:
        devices = {p.device.type for b in blocks for p in b.parameters()}
        if devices != {"cuda"}:
            raise ValueError(
                f"allow names 'offload', but the blocks' parameters are on {sorted(devices)}: "
                "offload moves CUDA saves to pinned host memory; leave it out on the CPU"
            )
        if not isinstance(host_gb_s, (int, float)) or host_gb_s <= 0:
            raise ValueError(f"host_gb_s={host_gb_s!r}: give the host link's rate in GB/s")
    if pool is not None and not isinstance(pool, PinnedPool):
        raise ValueError(f"pool={pool!r}: give a headroom.torch.PinnedPool")
    if not budget_mb or budget_mb <= 0:
        raise ValueError(f"budget_mb={budget_mb!r}: give a positive number of MiB")
    for i, block in enumerate(blocks):
        if getattr(block.forward, "__headroom_plan__", None) is not None:
            raise ValueError(f"block {i} already has a plan; remove() it first")
    budget = int(budget_mb * _MIB)
    plain = _profile(blocks, step, encode=False)
    for i, calls in enumerate(plain.calls):
        if calls != 1:
            raise ValueError(
                f"block {i} ran {calls} times in step's forward; plan_blocks needs each block "
                "to run once"
            )
    encoded = _profile(blocks, step, encode=True) if "int8" in allow else plain
    # A second round, each block's time the faster of the two: the first forward pays for
    # first launches (lazy initialisation, autotuning) that would count as block 0's cost.
    again = _profile(blocks, step, encode=False)
    plain.ms = [min(a, b) for a, b in zip(plain.ms, again.ms)]
    if "int8" in allow:
        encoded_again = _profile(blocks, step, encode=True)
        encoded.ms = [min(a, b) for a, b in zip(encoded.ms, encoded_again.ms)]
    strategies, total, memory, cost = _choose(plain, encoded.ms, budget, allow, host_gb_s)
    lines = [f"{'block':>5}  {'strategy':<10} {'saves (MiB)':>11} {'planned (MiB)':>13} "
             f"{'forward (ms)':>12} {'extra (ms)':>10}"]
    for i, strategy in enumerate(strategies):
        lines.append(f"{i:>5}  {strategy:<10} {memory['keep'][i] / _MIB:>11.2f} "
                     f"{memory[strategy][i] / _MIB:>13.2f} {plain.ms[i]:>12.2f} "
                     f"{cost[strategy][i]:>10.2f}")
    extra = sum(cost[s][i] for i, s in enumerate(strategies))
    lines.append(f"saved activations {total / _MIB:.2f} MiB of {sum(memory['keep']) / _MIB:.2f} "
                 f"kept (budget {budget / _MIB:.2f} MiB), about {extra:.2f} ms more a step")
    table = "\n".join(lines)
    plan = BlockPlan(blocks, strategies, total, budget, table, [])
    if "offload" in strategies:
        plan.pool = pool if pool is not None else PinnedPool()
    plan._originals = [_wrap(b, s, plan.stats, plan.pool) for b, s in zip(blocks, strategies)]
    if print_plan:
        print(table)
    return plan
