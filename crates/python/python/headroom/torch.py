"""Headroom's techniques on ``torch.nn.Module``s, through PyTorch's own extension points.

``saved_activations(compress="int8" | "bf16" | None, offload=...)`` keeps what a forward saves
for backward encoded and, with ``offload``, in a pinned host pool (``PinnedPool``) with
stream-ordered copies (``headroom.activations``); ``plan_blocks(blocks, budget_mb, step)``
keeps, encodes or recomputes each block's saves so that they fit a byte budget
(``headroom.blocks``);
``linear_cross_entropy`` and ``patch_causal_lm`` compute a language model's loss without its
logits (``headroom.loss``). The rest of this module is in-backward stepping:

``optimizer_in_backward(model, optimizer, ...)`` steps a ``headroom.optim`` optimizer inside
backward: each parameter gets a post-accumulate-grad hook; when its gradient is final the
parameter joins the pending bucket, and a bucket of ``bucket_mb`` MiB of gradients is stepped
with one launch (``headroom.optim``'s kernels, on torch's default stream) and its gradients
freed at once. Buckets form in the order gradients become final, so gradients never pile up:
the peak is parameters, optimizer state and the activations live when backward starts, plus a
bucket. A backward-end callback steps the last bucket. Each parameter's update is the one the
plain loop (``loss.backward(); optimizer.step()``) computes: the same bits.

Around that core:

- LR schedulers: the returned object is a ``torch.optim.Optimizer`` sharing the optimizer's
  ``param_groups`` and ``state``; a scheduler built on it changes the learning rate every later
  bucket reads, and its ``step()`` does nothing (the updates happened in backward), so trainers
  that call ``optimizer.step()``, ``zero_grad()`` and ``scheduler.step()`` (Hugging Face's
  ``Trainer``, Lightning with manual optimisation, plain loops) run unchanged.
- Accumulation over ``accumulate`` micro-batches: the backwards before the last leave their
  gradients in ``.grad``; the last one steps (a parameter that got a gradient only in an earlier
  micro-batch is stepped at its end, as the plain loop would).
- Clipping to ``clip`` (torch's ``clip_grad_norm_`` with norm 2: coefficient
  ``min(1, clip / (norm + 1e-6))``), in two modes. ``"exact"``: the norm of this step's
  gradients; with one micro-batch that takes two backward passes (the first only measures,
  freeing each gradient; the second updates), so it needs ``InBackward.backward(loss)``; with
  accumulation the last micro-batch holds its gradients (the earlier ones held theirs anyway),
  measures them at its end and then steps bucket by bucket. ``"previous"``: the coefficient of
  the previous step's norm, in one pass (the first step is not clipped). The norm measured is in
  ``InBackward.grad_norm`` (a device tensor; no synchronisation).
- fp16 loss scaling with a ``torch.amp.GradScaler``: ``InBackward.backward(loss)`` scales the
  loss, a first pass checks every gradient for infinities and NaNs (freeing them), and the
  second pass steps with the scale divided out in the kernels, which write nothing when the
  check found one — never a partial update; it then updates the scaler (do not call its
  ``step`` or ``update`` yourself). A skipped step is not counted in the optimizer's step
  numbers, as in torch's fused Adam: that reads the flag once, at the end of the pass (one
  synchronisation).

What raises: an optimizer that is not a ``headroom.optim`` one (``TypeError``); a parameter
already stepped inside backward by another registration, or an optimizer parameter that is not
``model``'s (``ValueError``); the optimizer's own ``step()`` while registered (``RuntimeError``);
a plain ``loss.backward()`` where two passes are needed (``RuntimeError`` from the first hook,
before any update); bad settings (``ValueError``). A backward that fails leaves the buckets it
stepped stepped and the rest of its gradients in ``.grad``; the next pass starts clean.

This module sits on torch's hooks and ``headroom.optim``; it knows no kernel.
"""

import math
import weakref

import torch

from . import optim as _optim
from ._quantized_optim import _SharedWithOptimizer
from .activations import saved_activations
from .pinned import PinnedBudgetError, PinnedPool
from .blocks import BlockPlan, plan_blocks
from .loss import linear_cross_entropy, patch_causal_lm, unpatch_causal_lm

__all__ = ["InBackward", "optimizer_in_backward", "saved_activations", "PinnedPool",
           "PinnedBudgetError", "plan_blocks", "BlockPlan",
           "linear_cross_entropy", "patch_causal_lm", "unpatch_causal_lm", "DEFAULT_BUCKET_MB"]

#: Gradient MiB a bucket collects before it is stepped: PyTorch DDP's 25 MiB.
DEFAULT_BUCKET_MB = 25
_CLIP_MODES = ("exact", "previous")
# Every parameter stepped inside backward, by id: a weak reference to it and to the registration
# that steps it (tensors compare by value, so they cannot be keys themselves).
_REGISTERED = {}


def _registration(p):
    """The live ``InBackward`` that steps ``p``, or None."""
    entry = _REGISTERED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def optimizer_in_backward(model, optimizer, *, bucket_mb=DEFAULT_BUCKET_MB, clip=None,
                          clip_mode="exact", accumulate=1, scaler=None):
    """Steps ``optimizer`` (a ``headroom.optim`` optimizer over ``model``'s parameters) inside
    backward, ``bucket_mb`` MiB of gradients at a time; see the module's documentation.
    Returns the ``InBackward`` to hand to schedulers and trainers in the optimizer's place."""
    return InBackward(model, optimizer, bucket_mb=bucket_mb, clip=clip, clip_mode=clip_mode,
                      accumulate=accumulate, scaler=scaler)


class InBackward(torch.optim.Optimizer):
    """A ``headroom.optim`` optimizer stepped inside backward (``optimizer_in_backward``). As a
    ``torch.optim.Optimizer`` its ``param_groups`` and ``state`` are the wrapped optimizer's,
    ``state_dict``/``load_state_dict`` are its, and ``step()`` does nothing."""

    def __init__(self, model, optimizer, *, bucket_mb=DEFAULT_BUCKET_MB, clip=None,
                 clip_mode="exact", accumulate=1, scaler=None):
        who = "headroom.torch.optimizer_in_backward"
        if not isinstance(optimizer, _optim._HeadroomOptimizer):
            raise TypeError(
                f"{who}: a {type(optimizer).__name__}; pass a headroom.optim optimizer "
                "(Adam, AdamW, Adam8bit, AdamW8bit)"
            )
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not (
            math.isfinite(bucket_mb) and bucket_mb > 0
        ):
            raise ValueError(f"{who}: bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"{who}: accumulate must be an int of at least 1, got {accumulate!r}")
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float))
            or not (math.isfinite(clip) and clip > 0)
        ):
            raise ValueError(f"{who}: clip must be None or a positive finite max norm, got {clip!r}")
        if clip_mode not in _CLIP_MODES:
            raise ValueError(f"{who}: clip_mode must be one of {_CLIP_MODES}, got {clip_mode!r}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"{who}: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        if scaler is not None and clip is not None and clip_mode == "previous":
            raise ValueError(
                f"{who}: previous-step clipping would carry an overflowed step's norm into the "
                "next step; clip with clip_mode='exact' under a loss scale"
            )
        if optimizer._stepped_in_backward is not None:
            raise ValueError(f"{who}: this optimizer is already stepped inside backward")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not params:
            raise ValueError(f"{who}: the optimizer has no parameter that requires a gradient")
        if model is not None:
            own = set(map(id, model.parameters()))
            stray = [p for p in params if id(p) not in own]
            if stray:
                raise ValueError(
                    f"{who}: {len(stray)} of the optimizer's parameters (the first of shape "
                    f"{tuple(stray[0].shape)}) are not the model's; build the optimizer from "
                    "model.parameters()"
                )
        for p in params:
            if _registration(p) is not None:
                raise ValueError(
                    f"{who}: a parameter of shape {tuple(p.shape)} is already stepped inside "
                    "backward by another registration; remove() that one first"
                )
        devices = {p.device for p in params}
        if scaler is not None and len(devices) > 1:
            raise ValueError(f"{who}: a loss scale needs every parameter on one device")
        super().__init__([{"params": params}], dict(optimizer.defaults))
        self._inner = optimizer
        self._who = who
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.clip = None if clip is None else float(clip)
        self.clip_mode = clip_mode
        self.accumulate = accumulate
        self.scaler = scaler
        self.grad_norm = None
        self._params = params
        self._group_of = {
            id(p): index for index, g in enumerate(optimizer.param_groups) for p in g["params"]
        }
        self._micro_batch = 0
        self._mode = None  # the pass's mode while a backward runs
        self._task = None  # the graph task of that pass
        self._via_backward = False  # whether InBackward.backward runs the pass
        self._asked = None  # the mode InBackward.backward asked for its next pass
        self._reset_pass()
        self._coefficient = None  # previous-step clipping: this step's coefficient
        # A scaled step's (scale for the kernels, or None once unscaled; found_inf; 1 / scale).
        self._scaling = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]
        for p in params:
            _REGISTERED[id(p)] = (weakref.ref(p), weakref.ref(self))
        optimizer._stepped_in_backward = self

    # -- the optimizer's face ----------------------------------------------------------------

    param_groups = _SharedWithOptimizer()
    state = _SharedWithOptimizer()

    @property
    def optimizer(self):
        """The wrapped ``headroom.optim`` optimizer."""
        return self._inner

    def step(self, closure=None):
        """Nothing to do: the parameters were stepped inside backward. Runs ``closure`` (whose
        backward steps them) when given, and returns its loss."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict):
        self._inner.load_state_dict(state_dict)

    def remove(self):
        """Removes the hooks: the optimizer steps through its own ``step()`` again. Gradients of
        an unfinished accumulation stay in ``.grad``."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p in self._params:
            if _registration(p) is self:
                del _REGISTERED[id(p)]
        if self._inner._stepped_in_backward is self:
            self._inner._stepped_in_backward = None

    # -- driving a step ----------------------------------------------------------------------

    def backward(self, loss):
        """``loss.backward()`` with the updates inside it, in the passes the settings need: two
        for exact clipping of one micro-batch or under a loss scale (the first with
        ``retain_graph=True``), one otherwise."""
        last = self._micro_batch + 1 == self.accumulate
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        self._via_backward = True
        try:
            if not last or not self._two_passes():
                self._asked = None
                loss.backward()
                return
            if self.scaler is not None:
                scale = self.scaler._scale
                found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
                self._scaling = (scale, found_inf, scale.double().reciprocal().float())
            self._asked = "measure"
            loss.backward(retain_graph=True)
            self._asked = "update"
            loss.backward()
        finally:
            self._via_backward = False
            self._asked = None
            self._scaling = None

    def _measures_first(self):
        """Whether every gradient of the last micro-batch must be measured before any update
        (exact clipping, or a loss scale's check)."""
        return self.scaler is not None or (self.clip is not None and self.clip_mode == "exact")

    def _two_passes(self):
        """Whether the last micro-batch measures in a pass of its own (with one micro-batch;
        with more, it holds its gradients and measures them at its end)."""
        return self.accumulate == 1 and self._measures_first()

    def _reset_pass(self):
        self._pending = []
        self._unprepared = []  # gradients of the pending bucket that _flush prepares
        self._pending_bytes = 0
        self._queued = set()  # the parameters queued in this pass
        self._norms = []
        self._plans_launched = []

    def _open_pass(self):
        """The mode of the backward pass whose first gradient just arrived, with its end
        callback queued."""
        if self.scaler is not None and not self._via_backward:
            raise RuntimeError(
                f"{self._who}: under a loss scale, run backward through InBackward.backward(loss) "
                "(it scales the loss and checks the gradients before any update)"
            )
        last = self._micro_batch + 1 == self.accumulate
        if not last:
            mode = "hold"
        elif self._asked is not None:
            mode = self._asked
        elif self._two_passes():
            raise RuntimeError(
                f"{self._who}: exact clipping of one micro-batch, or a loss scale, takes two "
                "backward passes: call InBackward.backward(loss) instead of loss.backward()"
            )
        elif self._measures_first():
            mode = "collect"
        else:
            mode = "update"
        self._reset_pass()
        self._mode = mode
        self._task = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(self._close_pass)
        return mode

    def _on_gradient(self, p):
        mode = self._mode
        if mode is None or self._task != torch._C._current_graph_task_id():
            # The first gradient of a pass (or of one after a pass that failed: what that one
            # left pending stays in .grad, never stepped twice).
            mode = self._open_pass()
        if mode in ("hold", "collect"):
            return
        grad = p.grad
        if grad is None:
            return
        if mode == "measure":
            self._measure([grad])
            p.grad = None
            return
        self._prepare(grad)
        self._add(p, grad)

    def _prepare(self, grad):
        """Marks an updating pass's gradient for ``_flush`` to prepare before its step: its norm
        part recorded (previous-step clipping), then scaled by the step's clipping coefficient
        (a bucket's gradients at once, two launches instead of two a parameter)."""
        self._unprepared.append(grad)

    def _prepare_bucket(self):
        grads, self._unprepared = self._unprepared, []
        if not grads:
            return
        if self.clip is not None and self.clip_mode == "previous":
            self._norms.extend(torch._foreach_norm(grads, 2.0))
        if self._coefficient is not None:
            torch._foreach_mul_(grads, self._coefficient)

    def _add(self, p, grad):
        """Adds ``p`` to the pending bucket, stepping the bucket once it holds ``bucket_mb``."""
        self._pending.append(p)
        self._queued.add(id(p))
        self._pending_bytes += grad.numel() * grad.element_size()
        if self._pending_bytes >= self.bucket_bytes:
            self._flush()

    def _measure(self, grads):
        """Records the norm parts of ``grads`` (unscaled, under a loss scale, after checking
        them for infinities and NaNs)."""
        if self._scaling is not None:
            _, found_inf, inv_scale = self._scaling
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if self.clip is not None:
            self._norms.extend(torch.linalg.vector_norm(g, 2.0) for g in grads)

    def _total_norm(self):
        norms = self._norms
        self._norms = []
        if not norms:
            return None
        device = norms[0].device
        stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
        return torch.linalg.vector_norm(stacked, 2.0)

    def _coefficient_of(self, total):
        return torch.clamp(self.clip / (total + 1e-6), max=1.0)

    def _flush(self):
        """Steps the pending bucket and frees its gradients."""
        pending = self._pending
        if not pending:
            return
        self._prepare_bucket()
        self._pending = []
        self._pending_bytes = 0
        by_group = {}
        for p in pending:
            by_group.setdefault(self._group_of[id(p)], []).append(p)
        groups = self._inner.param_groups
        buckets = [
            ((index, tuple(map(id, ps))), groups[index], ps) for index, ps in by_group.items()
        ]
        scale, found_inf = (None, None) if self._scaling is None else self._scaling[:2]
        self._plans_launched.extend(self._inner._step_buckets(buckets, scale, found_inf))
        for p in pending:
            p.grad = None

    def _step_left_over(self, prepare):
        """Steps, in buckets, every parameter with a gradient not stepped in this pass (one
        that got its gradient in an earlier micro-batch, or every one in ``collect`` mode),
        each gradient through ``_prepare`` first when ``prepare``."""
        for p in self._params:
            grad = p.grad
            if grad is None or id(p) in self._queued:
                continue
            if prepare:
                self._prepare(grad)
            self._add(p, grad)
        self._flush()

    def _close_pass(self):
        mode = self._mode
        self._mode = None
        if mode == "hold":
            self._micro_batch += 1
            return
        if mode == "measure":
            total = self._total_norm()
            if total is not None:
                self.grad_norm = total
                self._coefficient = self._coefficient_of(total)
            return
        try:
            if mode == "collect":
                held = [p.grad for p in self._params if p.grad is not None]
                if self.scaler is not None:
                    scale = self.scaler._scale
                    found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
                    self._scaling = (None, found_inf, scale.double().reciprocal().float())
                    self._measure(held)
                elif self.clip is not None:
                    self._measure(held)
                total = self._total_norm()
                if total is not None:
                    self.grad_norm = total
                    coefficient = self._coefficient_of(total)
                    torch._foreach_mul_(held, coefficient)
                del held
            self._step_left_over(prepare=mode == "update")
            if self.clip is not None and self.clip_mode == "previous" and mode == "update":
                total = self._total_norm()
                self.grad_norm = total
                self._coefficient = None if total is None else self._coefficient_of(total)
            elif mode in ("update", "collect"):
                self._coefficient = None
            if self._scaling is not None:
                self._finish_scaled_step()
        finally:
            self._micro_batch = 0
            if mode == "collect":
                self._scaling = None

    def _finish_scaled_step(self):
        """A scaled step's end: a skipped step leaves the step counts as they were (one read of
        the flag), and the scaler updates its scale from the flag."""
        found_inf = self._scaling[1]
        if found_inf.item() != 0.0:
            for plan in self._plans_launched:
                plan.taken -= 1
        scaler = self.scaler
        state = scaler._per_optimizer_states[id(self)]
        state["found_inf_per_device"][found_inf.device] = found_inf
        scaler.update()
