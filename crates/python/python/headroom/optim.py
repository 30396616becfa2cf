"""Headroom's fused, 8-bit and bfloat16 optimizers as ``torch.optim.Optimizer`` subclasses.

The fused and bfloat16 Adam families and ``SGD`` are here, the 4-bit and 8-bit ones and
``MasterWeights`` in ``headroom._quantized_optim`` (re-exported), the checks and the step driver
they share in ``headroom._optim_base``.

``AdamBf16``/``AdamWBf16`` step bfloat16 parameters with float32 moments and stochastic
rounding, ``Adam4bit``/``AdamW4bit`` float32 or bfloat16 ones with torchao's 4-bit states, and
``SGD`` float32, bfloat16 or float16 ones, on CUDA or CPU tensors (see ``_Bf16Adam``,
``_Adam4bitBase`` and ``SGD``); what follows about float32 CUDA parameters is the fused and
8-bit Adam families'.

``Adam``, ``AdamW`` (fused: one kernel launch per step for every parameter, in the arithmetic of
PyTorch's own ``fused=True`` kernel: ``AdamW`` gives the same bits; ``Adam``'s L2 weight decay
is not yet bit for bit, see ``Adam``) and ``Adam8bit``, ``AdamW8bit`` (bitsandbytes' blockwise
8-bit Adam within 3e-5 a step, or with its own fast-math instructions; its state dicts load both
ways) run Headroom's CUDA kernels on the parameters' and gradients' own device memory, on
torch's default stream, and keep their state in torch tensors under PyTorch's (or
bitsandbytes') keys, so ``state_dict()``, LR schedulers and ``torch.amp.GradScaler`` work as
usual.

The kernels write through raw device pointers, so every tensor is checked before its pointer is
handed over. What raises (before anything is launched, so a step that raises changes nothing):

- a parameter that is not a CUDA tensor, or not float32: ``TypeError``; not contiguous, or a
  group on several devices, or two parameters sharing memory: ``ValueError`` — at construction
  and again at any step after it changed (``model.half()``, ``model.cpu()``, ``p.data = ...``);
- a gradient of another dtype, or sparse: ``TypeError``; on another device than its parameter,
  of another number of elements, or not contiguous: ``ValueError`` — at every step;
- a state tensor (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``; 8-bit: ``state1``,
  ``state2``, ``absmax1``, ``absmax2``) that is missing or of another shape than its parameter
  (or than its block count): ``ValueError``; of another dtype: ``TypeError``; on another device
  or not contiguous: ``ValueError`` — whenever the launch lists are built: at the first step,
  after ``load_state_dict``, when the set of parameters with gradients changes, and when a
  parameter's or a state tensor's storage, dtype, size or device changed since the last step.
  (PyTorch's fused kernels raise ``RuntimeError`` for the same mismatches; the typed errors here
  follow this module's construction checks.) A state dict of another model with the same group
  sizes but other shapes, or with parameters permuted inside a group, raises here instead of
  writing past a buffer;
- ``grad_scale``/``found_inf`` that are not one-element float32 tensors on the group's device:
  ``TypeError`` for the type or dtype, ``ValueError`` for the device or size;
- ``step()`` off torch's default stream: ``ValueError``.

Per step the optimizers compare, for every parameter, its ``(data_ptr, dtype, numel, device,
contiguity)`` and its gradient's with what the lists were built from, and the state tensors'
pointers: a parameter given new storage of the same kind (``p.data = ...``) is stepped in its
new storage. Entries of ``optimizer.state`` replaced by hand are read when the lists are next
built (the lists keep the tensors they point into alive meanwhile); ``load_state_dict`` is the
way to change state.
"""

import torch

from . import _native
from ._optim_base import (
    _DTYPE_NAMES, _HeadroomOptimizer, _LaunchPlan, _check_seed, _check_state, _data_ptr,
    _load_keeping_dtypes, _lr, _pick, _slots_of,
)

__all__ = ["Adam", "AdamW", "AdamBf16", "AdamWBf16", "SGD", "Adafactor", "Adam4bit", "AdamW4bit",
           "Adam8bit", "AdamW8bit", "MasterWeights"]


class _FusedAdam(_HeadroomOptimizer):
    _decoupled = False
    _native_class = _native.FusedAdam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None,
                 amsgrad=False, *, maximize=False):
        if weight_decay is None:
            weight_decay = 1e-2 if self._decoupled else 0.0
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def _step_value(step):
        return torch.tensor(float(step), dtype=torch.float32)

    def _init_state(self, p, group):
        state = self.state[p]
        state["step"] = self._step_value(0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _plan_matches_group(self, plan, group):
        return plan.amsgrad == bool(group["amsgrad"])

    def _build(self, group, params, steps):
        amsgrad = bool(group["amsgrad"])
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
        checked = {key: [] for key in keys}
        for p in params:
            state = self.state[p]
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in keys:
                checked[key].append(_check_state(p, state, key, self._state_dtype(group), p.shape,
                                                 self._who))
        lists = {key: list(map(_data_ptr, ts)) for key, ts in checked.items()}
        states = [t for ts in checked.values() for t in ts]
        return _LaunchPlan(params, lists, states, steps, amsgrad)

    def _launch(self, group, plan, grads, stream, step, which, scaling):
        if not which:
            return
        n = len(plan.params)
        lists = plan.lists
        max_sq = lists.get("max_exp_avg_sq")
        beta1, beta2 = group["betas"]
        self._kernel(plan.device).step(
            stream, step,
            (_lr(group), float(beta1), float(beta2), float(group["eps"]),
             float(group["weight_decay"])),
            self._decoupled, bool(group["maximize"]), *self._rule_args(group),
            _pick(plan.signature[0], which, n), _pick(grads, which, n),
            _pick(lists["exp_avg"], which, n), _pick(lists["exp_avg_sq"], which, n),
            None if max_sq is None else _pick(max_sq, which, n), _pick(plan.lens, which, n),
            *self._slot_args(plan, which, n), *scaling, **self._launch_options(group),
        )

    def _state_dtype(self, group):
        """The moments' dtype: float32 here."""
        return torch.float32

    def _launch_options(self, group):
        """The native step's keyword arguments: none here."""
        return {}

    def _rule_args(self, group):
        """What the native step takes after ``maximize``: nothing here."""
        return ()

    def _slot_args(self, plan, which, n):
        """What the native step takes after the lengths: nothing here."""
        return ()


class Adam(_FusedAdam):
    """``torch.optim.Adam(fused=True)``'s update (L2 weight decay) in one Headroom launch, with
    its kernel's arithmetic (float hyperparameters, fma moments): the same bits without weight
    decay. With it, not yet bit for bit: after 20 steps of ViT-L/16 (weight decay 1e-2), 18 of
    its 296 tensors equal torch's to the bit and the rest are at most 1.5e-4 apart; against
    ``testdata/torch_fused_adam_golden.safetensors`` (20 steps, weight decay 0.1) the parameter
    stays within 9e-8 of its largest magnitude."""

    _who = "headroom.optim.Adam"


class AdamW(_FusedAdam):
    """``torch.optim.AdamW(fused=True)``'s update (decoupled weight decay) in one Headroom launch,
    with its kernel's arithmetic: the same bits."""

    _who = "headroom.optim.AdamW"
    _decoupled = True


class _Bf16Adam(_FusedAdam):
    """Adam/AdamW on bfloat16 parameters with float32 moments, each new parameter rounded to
    bfloat16 stochastically (headroom-optim's ``AdamStochasticConfig``): 12 bytes a parameter
    with its gradient, no float32 master copy, and updates smaller than half a bfloat16 step
    kept on average instead of lost. ``state_dtype=torch.bfloat16`` keeps the moments in
    bfloat16 (torchao's ``_AdamW`` layout: 8 bytes a parameter with its gradient): each step
    reads them widened, updates the parameter from their new float32 values and stores them
    rounded to nearest-even. On CUDA tensors one launch for every parameter; on CPU
    tensors the same arithmetic on the host (the same bits). The random bits are counter-based:
    parameter ``i`` (its position among the optimizer's parameters, in the order they were
    given) at step ``t`` draws from a stream keyed by ``seed``, ``i`` and ``t``, so a run is
    reproducible and a state dict continues it. The state: ``step`` (a float32 tensor, as
    torch's), ``exp_avg`` and ``exp_avg_sq`` (and with ``amsgrad`` ``max_exp_avg_sq``) in
    ``state_dtype``, of the parameter's shape. The arithmetic is the optimizer's own fused one
    (``torch.optim.Adam``'s single-tensor formula in float32), not torch's fused kernel's."""

    _native_class = _native.AdamStochastic
    _param_dtype = torch.bfloat16
    _device_type = ("cuda", "cpu")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None,
                 amsgrad=False, *, maximize=False, seed=0, state_dtype=torch.float32):
        _check_seed(seed)
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype={state_dtype!r}: give torch.float32 or torch.bfloat16")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)
        for group in self.param_groups:
            group.setdefault("seed", seed)
            group.setdefault("state_dtype", state_dtype)

    def _state_dtype(self, group):
        return group.get("state_dtype", torch.float32)

    def _launch_options(self, group):
        return {"bf16_state": True} if self._state_dtype(group) == torch.bfloat16 else {}

    def _plan_matches_group(self, plan, group):
        dtype = self._state_dtype(group)
        return super()._plan_matches_group(plan, group) and all(t.dtype == dtype for t in plan.states)

    def _init_state(self, p, group):
        state = self.state[p]
        dtype = self._state_dtype(group)
        state["step"] = self._step_value(0)
        state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)

    def _build(self, group, params, steps):
        if group["amsgrad"]:
            for p in params:
                state = self.state[p]
                if "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=self._state_dtype(group),
                                                          device=p.device)
        plan = super()._build(group, params, steps)
        plan.lists["slots"] = _slots_of(self, params)
        return plan

    def load_state_dict(self, state_dict):
        """Loads a state dict of this class: the float32 moments stay float32 (torch's loader
        would cast them to bfloat16); their sizes are checked at the next step."""
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        _load_keeping_dtypes(self, state_dict, keys, super().load_state_dict)

    def _rule_args(self, group):
        """The seed of the rounding bits."""
        return (int(group["seed"]),)

    def _slot_args(self, plan, which, n):
        """Each parameter's position among the optimizer's, which keys its random stream."""
        return (_pick(plan.lists["slots"], which, n),)


class AdamBf16(_Bf16Adam):
    """Adam (L2 weight decay, default 0) on bfloat16 parameters with float32 moments and
    stochastic rounding; see ``_Bf16Adam``."""

    _who = "headroom.optim.AdamBf16"


class AdamWBf16(_Bf16Adam):
    """AdamW (decoupled weight decay, default 1e-2) on bfloat16 parameters with float32 moments
    and stochastic rounding, torchao's ``_AdamW(bf16_stochastic_round=True)`` recipe: 12 bytes a
    parameter with its gradient; see ``_Bf16Adam``."""

    _who = "headroom.optim.AdamWBf16"
    _decoupled = True


class SGD(_HeadroomOptimizer):
    """``torch.optim.SGD``'s update (momentum, dampening, Nesterov, L2 weight decay, maximize) in
    PyTorch's fused SGD's order of operations in float32 arithmetic (torch forms its products with
    the hyperparameters in double: within a few ulps of it), over float32, bfloat16 or float16 parameters (one
    dtype a group; the momentum buffer in the parameter's dtype, as torch keeps it): on CUDA
    tensors one launch a group, on CPU tensors the same arithmetic on the host. Its state is
    torch's (``momentum_buffer``) with a ``step`` count of its own, so a torch SGD state dict
    loads and continues; usable inside backward (``headroom.torch.optimizer_in_backward``)."""

    _who = "headroom.optim.SGD"
    _native_class = _native.Sgd
    _param_dtype = (torch.float32, torch.bfloat16, torch.float16)
    _device_type = ("cuda", "cpu")

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def _step_value(step):
        return torch.tensor(float(step), dtype=torch.float32)

    def _saved_step(self, p):
        state = self.state[p]
        if "step" in state:
            return int(state["step"])
        # torch's SGD keeps no count: a momentum buffer means at least one step was taken.
        return 1 if state.get("momentum_buffer") is not None else 0

    def _init_state(self, p, group):
        self.state[p]["step"] = self._step_value(0)

    def _plan_matches_group(self, plan, group):
        return ("momentum_buffer" in plan.lists) == (group["momentum"] != 0)

    def _build(self, group, params, steps):
        if len({p.dtype for p in params}) > 1:
            raise ValueError(f"{self._who}: a parameter group mixes dtypes; give each its own group")
        states = []
        if group["momentum"] != 0:
            for i, p in enumerate(params):
                state = self.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    steps[i] = 0  # the buffer takes the gradient at the next step
                states.append(_check_state(p, state, "momentum_buffer", p.dtype, p.shape, self._who))
        lists = {"momentum_buffer": list(map(_data_ptr, states))} if states else {}
        return _LaunchPlan(params, lists, states, steps)

    def _launch(self, group, plan, grads, stream, step, which, scaling):
        if not which:
            return
        n = len(plan.params)
        buffers = plan.lists.get("momentum_buffer")
        self._kernel(plan.device).step(
            stream, step,
            (_lr(group), float(group["momentum"]), float(group["dampening"]),
             float(group["weight_decay"])),
            bool(group["nesterov"]), bool(group["maximize"]), _DTYPE_NAMES[plan.params[0].dtype],
            _pick(plan.signature[0], which, n), _pick(grads, which, n),
            None if buffers is None else _pick(buffers, which, n), _pick(plan.lens, which, n),
            *scaling,
        )


class Adafactor(_HeadroomOptimizer):
    """``torch.optim.Adafactor``'s update (relative step size ``min(lr, 1/sqrt(t))``, the
    parameter's RMS floored at ``eps[1]``, second moments decayed by ``1 - t^beta2_decay`` and
    factored into row and column moments for two or more dims, the update's RMS clipped at
    ``d``, decoupled weight decay, maximize) over float32 parameters, CUDA or CPU: headroom-optim's
    ``AdafactorConfig`` in its fused form (the update recomputed instead of kept: no temporary
    of a parameter's size; the two norms are float64 sums), each parameter at its own step
    count. The state is torch's: ``step`` (a float32 tensor), ``row_var`` of shape
    ``[..., rows, 1]`` and ``col_var`` of shape ``[..., 1, cols]`` for two or more dims,
    ``variance`` like the parameter otherwise, so a torch Adafactor state dict loads and
    continues. ``grad_scale``/``found_inf`` are refused (torch's Adafactor takes none either:
    ``GradScaler`` unscales and skips through ``step()`` itself); usable inside backward without
    a scaler."""

    _who = "headroom.optim.Adafactor"
    _native_class = _native.Adafactor
    _device_type = ("cuda", "cpu")

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
                 weight_decay=0.0, *, maximize=False):
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= beta2_decay:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        if eps[0] is not None and not 0.0 <= eps[0]:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
        if not 0.0 <= eps[1]:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
        if not 1.0 <= d:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def _step_value(step):
        return torch.tensor(float(step), dtype=torch.float32)

    @staticmethod
    def _moment_shapes(p):
        """torch's shapes of ``p``'s moments: ``{"row_var": ..., "col_var": ...}`` for two or
        more dims, ``{"variance": ...}`` otherwise."""
        if p.dim() > 1:
            rows, cols = list(p.shape), list(p.shape)
            rows[-1], cols[-2] = 1, 1
            return {"row_var": tuple(rows), "col_var": tuple(cols)}
        return {"variance": tuple(p.shape)}

    def _init_state(self, p, group):
        state = self.state[p]
        state["step"] = self._step_value(0)
        for key, shape in self._moment_shapes(p).items():
            state[key] = torch.zeros(shape, dtype=torch.float32, device=p.device)

    def _build(self, group, params, steps):
        lists = {"row_var": [], "col_var": [], "variance": []}
        states = []
        for p in params:
            shapes = self._moment_shapes(p)
            for key in lists:
                if key in shapes:
                    t = _check_state(p, self.state[p], key, torch.float32, shapes[key], self._who)
                    states.append(t)
                    lists[key].append(t.data_ptr())
                else:
                    lists[key].append(0)
        plan = _LaunchPlan(params, lists, states, steps)
        plan.lists["shapes"] = [list(p.shape) for p in params]
        return plan

    def _step_buckets(self, buckets, grad_scale=None, found_inf=None):
        # Every step, plain or inside backward, comes through here: one refusal of scaling.
        if grad_scale is not None or found_inf is not None:
            raise ValueError(
                f"{self._who} takes no grad_scale/found_inf (torch's Adafactor has no scaled "
                "step): let torch.amp.GradScaler unscale the gradients and call step() itself, "
                "and step it inside backward without a scaler"
            )
        return super()._step_buckets(buckets)

    def _launch(self, group, plan, grads, stream, step, which, scaling):
        if not which:
            return
        n = len(plan.params)
        eps1, eps2 = group["eps"]
        self._kernel(plan.device).step(
            stream, step,
            (_lr(group), float(group["beta2_decay"]), None if eps1 is None else float(eps1),
             float(eps2), float(group["d"]), float(group["weight_decay"])),
            bool(group["maximize"]),
            _pick(plan.signature[0], which, n), _pick(grads, which, n),
            _pick(plan.lists["row_var"], which, n), _pick(plan.lists["col_var"], which, n),
            _pick(plan.lists["variance"], which, n), _pick(plan.lists["shapes"], which, n),
        )


from ._quantized_optim import (  # noqa: E402 (the quantised rules, on the classes above)
    Adam4bit, Adam8bit, AdamW4bit, AdamW8bit, MasterWeights,
)
