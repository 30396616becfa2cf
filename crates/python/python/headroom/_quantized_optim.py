"""The quantised optimizers of ``headroom.optim`` (``Adam4bit``/``AdamW4bit`` with torchao's
4-bit states, ``Adam8bit``/``AdamW8bit`` with bitsandbytes' 8-bit ones) and ``MasterWeights``;
``headroom.optim`` re-exports them and documents what raises.

This module sits on ``headroom._optim_base``; it knows no other rule.
"""

import torch

from . import _native
from ._optim_base import (
    BLOCK_SIZE, MIN_8BIT_SIZE, _BNB_WRAPPED, _DTYPE_NAMES, _HeadroomOptimizer, _RAW_KEYS,
    _blockwise_plan, _check_seed, _load_keeping_dtypes, _lr, _pick, _slots_of,
)

AO_BLOCK_SIZE = 128
MIN_4BIT_SIZE = 4096


def _quantized_4bit(numel):
    """Whether torchao quantises a state of ``numel`` elements (at least 4096, whole blocks)."""
    return numel >= MIN_4BIT_SIZE and numel % AO_BLOCK_SIZE == 0


class _Adam4bitBase(_HeadroomOptimizer):
    """torchao's 4-bit Adam/AdamW (``torchao.optim.Adam4bit``, ``AdamW4bit``: its two 16-entry
    code tables, blocks of 128, f32 states where it does not quantise) over float32 or bfloat16
    parameters (one dtype a group), on CUDA (two launches a group) or CPU tensors (the host
    kernels, the same bits). ``bf16_stochastic_round=True`` stores a bfloat16 parameter's new
    value stochastically (the bits keyed by ``seed``, the parameter's position among the
    optimizer's and the step), as torchao's option of that name does; otherwise to nearest.
    Per parameter the state is ``step``, ``state1``/``state2`` (packed codes, two a byte, of half
    the parameter's length, or float32 moments of its shape) and ``absmax1``/``absmax2`` (one
    float32 scale per block of 128; absent for float32 moments): 1.06 bytes a parameter
    quantised. torchao's own state dicts (tensor subclasses) do not load."""

    _native_class = _native.Adam4bit
    _param_dtype = (torch.float32, torch.bfloat16)
    _device_type = ("cuda", "cpu")
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, *,
                 bf16_stochastic_round=False, seed=0):
        if weight_decay is None:
            weight_decay = 1e-2 if self._decoupled else 0.0
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        _check_seed(seed)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bf16_stochastic_round=bool(bf16_stochastic_round), seed=seed)
        super().__init__(params, defaults)

    @staticmethod
    def _step_value(step):
        return torch.tensor(float(step), dtype=torch.float32)

    def load_state_dict(self, state_dict):
        """Loads a state dict of this class: codes, scales and float32 moments keep their dtypes
        (torch's loader would cast them to the parameter's)."""
        keys = ("state1", "state2", "absmax1", "absmax2")
        _load_keeping_dtypes(self, state_dict, keys, super().load_state_dict)

    def _init_state(self, p, group):
        state = self.state[p]
        state["step"] = self._step_value(0)
        n = p.numel()
        if not _quantized_4bit(n):
            state["state1"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["state2"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return
        for key in ("state1", "state2"):
            state[key] = torch.zeros(n // 2, dtype=torch.uint8, device=p.device)
        for key in ("absmax1", "absmax2"):
            state[key] = torch.zeros(n // AO_BLOCK_SIZE, dtype=torch.float32, device=p.device)

    def _build(self, group, params, steps):
        if len({p.dtype for p in params}) > 1:
            raise ValueError(f"{self._who}: a parameter group mixes dtypes; give each its own group")
        def layout(p):
            n = p.numel()
            if not _quantized_4bit(n):
                return (torch.float32, p.shape), None
            return (torch.uint8, (n // 2,)), (n // AO_BLOCK_SIZE,)

        plan = _blockwise_plan(self, params, steps, layout)
        plan.lists["slots"] = _slots_of(self, params)
        return plan

    def _launch(self, group, plan, grads, stream, step, which, scaling):
        if not which:
            return
        n = len(plan.params)
        lists = plan.lists
        beta1, beta2 = group["betas"][:2]
        seed = int(group["seed"]) if group["bf16_stochastic_round"] else None
        self._kernel(plan.device).step(
            stream, step,
            (_lr(group), float(beta1), float(beta2), float(group["eps"]),
             float(group["weight_decay"])),
            self._decoupled, _DTYPE_NAMES[plan.params[0].dtype], seed,
            _pick(plan.signature[0], which, n), _pick(grads, which, n),
            _pick(lists["state1"], which, n), _pick(lists["state2"], which, n),
            _pick(lists["absmax1"], which, n), _pick(lists["absmax2"], which, n),
            _pick(plan.lens, which, n), _pick(lists["slots"], which, n),
            *scaling,
        )


class Adam4bit(_Adam4bitBase):
    """torchao's ``Adam4bit`` (L2 weight decay, default 0); see ``_Adam4bitBase``."""

    _who = "headroom.optim.Adam4bit"


class AdamW4bit(_Adam4bitBase):
    """torchao's ``AdamW4bit`` (decoupled weight decay, default 1e-2); see ``_Adam4bitBase``."""

    _who = "headroom.optim.AdamW4bit"
    _decoupled = True


class _Adam8bitBase(_HeadroomOptimizer):
    _native_class = _native.Adam8bit
    _default_decay = 0.0

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None,
                 min_8bit_size=MIN_8BIT_SIZE, *, bitsandbytes_arithmetic=True):
        if weight_decay is None:
            weight_decay = self._default_decay
        self._bnb_arithmetic = bool(bitsandbytes_arithmetic)
        if min_8bit_size != MIN_8BIT_SIZE:
            raise ValueError(f"{self._who}: only bitsandbytes' default min_8bit_size=4096 is supported")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._maps = {}
        super().__init__(params, defaults)

    @staticmethod
    def _step_value(step):
        return int(step)

    def _native_args(self):
        return (self._bnb_arithmetic,)

    def load_state_dict(self, state_dict):
        """Loads a state dict of this class or of ``bitsandbytes.optim.Adam8bit``/``AdamW8bit``
        (whose quantization tensors sit under ``__bnb_optimizer_quant_state__``). The 8-bit codes,
        maps and absmax keep their dtypes (torch's loader would cast them to the parameter's).
        Their sizes are checked at the next step."""
        state = {}
        for pid, saved in state_dict["state"].items():
            saved = dict(saved)
            saved.update(saved.pop(_BNB_WRAPPED, {}))
            state[pid] = saved
        flat = {"state": state, "param_groups": state_dict["param_groups"]}
        _load_keeping_dtypes(self, flat, _RAW_KEYS, super().load_state_dict)

    def _qmaps(self, device):
        maps = self._maps.get(device)
        if maps is None:
            signed, unsigned = _native.bnb_maps()
            maps = self._maps[device] = (
                torch.tensor(signed, dtype=torch.float32, device=device),
                torch.tensor(unsigned, dtype=torch.float32, device=device),
            )
        return maps

    def _init_state(self, p, group):
        state = self.state[p]
        state["step"] = 0
        if p.numel() < MIN_8BIT_SIZE:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        qmap1, qmap2 = self._qmaps(p.device)
        blocks = (p.numel() + BLOCK_SIZE - 1) // BLOCK_SIZE
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap1"] = qmap1
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap2"] = qmap2
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

    def _build(self, group, params, steps):
        def layout(p):
            # bitsandbytes' layout: f32 moments under 4096 elements, else u8 codes and one f32
            # absmax per 256-element block.
            if p.numel() < MIN_8BIT_SIZE:
                return (torch.float32, p.shape), None
            return (torch.uint8, p.shape), ((p.numel() + BLOCK_SIZE - 1) // BLOCK_SIZE,)

        return _blockwise_plan(self, params, steps, layout)

    def _launch(self, group, plan, grads, stream, step, which, scaling):
        if not which:
            return
        n = len(plan.params)
        lists = plan.lists
        beta1, beta2 = group["betas"][:2]
        self._kernel(plan.device).step(
            stream, step,
            (_lr(group), float(beta1), float(beta2), float(group["eps"]),
             float(group["weight_decay"])),
            _pick(plan.signature[0], which, n), _pick(grads, which, n),
            _pick(lists["state1"], which, n), _pick(lists["state2"], which, n),
            _pick(lists["absmax1"], which, n), _pick(lists["absmax2"], which, n),
            _pick(plan.lens, which, n),
            *scaling,
        )


class Adam8bit(_Adam8bitBase):
    """``bitsandbytes.optim.Adam8bit`` (blockwise, 256-element blocks, 32-bit state under 4096
    elements) and its state dict keys. By default its update runs bitsandbytes' own instructions
    (its library is built with fast math: approximate ``powf``, square root and reciprocals,
    denormals flushed), so parameters and states equal bitsandbytes' to the bit.
    ``bitsandbytes_arithmetic=False`` rounds every operation correctly instead: Adam's exact
    step, within 3e-5 relative of bitsandbytes' per step."""

    _who = "headroom.optim.Adam8bit"


class AdamW8bit(_Adam8bitBase):
    """``bitsandbytes.optim.AdamW8bit``: ``Adam8bit`` with weight decay 1e-2 by default."""

    _who = "headroom.optim.AdamW8bit"
    _default_decay = 1e-2


class _SharedWithOptimizer:
    """An attribute of a wrapper optimizer (``headroom.torch.InBackward``, ``MasterWeights``)
    that is its wrapped optimizer's (``param_groups``, ``state``): read and written there once
    ``_inner`` is set, the object's own before (what ``torch.optim.Optimizer.__init__``
    writes)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        inner = obj.__dict__.get("_inner")
        return obj.__dict__["_own_" + self.name] if inner is None else getattr(inner, self.name)

    def __set__(self, obj, value):
        inner = obj.__dict__.get("_inner")
        if inner is None:
            obj.__dict__["_own_" + self.name] = value
        else:
            setattr(inner, self.name, value)

_MASTER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class MasterWeights(torch.optim.Optimizer):
    """Float32 master copies of half-precision parameters (float16 or bfloat16), stepped by a
    ``headroom.optim`` optimizer of float32 parameters that ``make(masters)`` builds over them
    (one master per parameter, in order): ``step()`` widens each parameter's gradient into its
    master's, steps the inner optimizer and stores each stepped master back into its parameter,
    rounded to nearest (apex's O2, Rust amp's ``MasterWeights``): 4 bytes a parameter beside the
    half-precision model, the update's float32 precision kept. Float32 parameters are their own
    masters. ``param_groups`` and ``state`` are the inner optimizer's (schedulers work on this
    object); ``state_dict()`` holds the inner optimizer's and the masters (``master_weights``),
    and ``load_state_dict`` restores both and rounds the masters into the parameters. What
    raises: a parameter of another dtype (``TypeError``, at construction), ``make`` returning
    anything but a ``headroom.optim`` optimizer (``TypeError``), a parameter cast after
    construction or a gradient of another dtype than its parameter (``TypeError``, at the step,
    before anything is written), a state dict of other parameters (``ValueError``)."""

    param_groups = _SharedWithOptimizer()
    state = _SharedWithOptimizer()

    def __init__(self, params, make):
        params = list(params)
        for p in params:
            if not isinstance(p, torch.Tensor) or p.dtype not in _MASTER_DTYPES:
                raise TypeError(
                    "headroom.optim.MasterWeights: parameters must be float16, bfloat16 or "
                    f"float32 tensors, got {getattr(p, 'dtype', type(p).__name__)}"
                )
        masters = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())
                   for p in params]
        inner = make(masters)
        if not isinstance(inner, _HeadroomOptimizer):
            raise TypeError("headroom.optim.MasterWeights: make(masters) must return a "
                            f"headroom.optim optimizer, got {type(inner).__name__}")
        super().__init__([{"params": masters}], dict(inner.defaults))
        self._params, self._masters = params, masters
        self._dtypes = [p.dtype for p in params]
        self._inner = inner

    def zero_grad(self, set_to_none=True):
        for p, m in zip(self._params, self._masters):
            if set_to_none:
                p.grad = m.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, dtype in zip(self._params, self._dtypes):
            if p.dtype != dtype:
                raise TypeError(f"headroom.optim.MasterWeights: a parameter of dtype {p.dtype} "
                                f"was {dtype} at construction; the masters cannot follow a cast")
            if p.grad is not None and p.grad.dtype != p.dtype:
                raise TypeError(f"headroom.optim.MasterWeights: a gradient of dtype "
                                f"{p.grad.dtype} for a {p.dtype} parameter")
        for p, m in zip(self._params, self._masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        self._inner.step()
        for p, m in zip(self._params, self._masters):
            if m is not p and m.grad is not None:
                p.copy_(m)
                m.grad = None
        return loss

    def state_dict(self):
        return {"inner": self._inner.state_dict(),
                "master_weights": [m.detach().clone() for m in self._masters]}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        masters = state_dict["master_weights"]
        if len(masters) != len(self._masters) or any(
                a.shape != b.shape for a, b in zip(masters, self._masters)):
            raise ValueError("headroom.optim.MasterWeights: a state dict of other parameters "
                             f"({len(masters)} masters for {len(self._masters)})")
        self._inner.load_state_dict(state_dict["inner"])
        for p, m, saved in zip(self._params, self._masters, masters):
            m.copy_(saved)
            if m is not p:
                p.copy_(m)
