"""Headroom's fused and 8-bit optimizers as ``torch.optim.Optimizer`` subclasses.

``Adam``, ``AdamW`` (fused: one kernel launch per step for every parameter, in the arithmetic of
PyTorch's own ``fused=True`` kernel, so the same bits; Adam's L2 weight decay within a few ulps)
and ``Adam8bit``,
``AdamW8bit`` (bitsandbytes' blockwise 8-bit Adam within 3e-5 a step, or with its own fast-math
instructions; its state dicts load both ways)
run Headroom's CUDA kernels on the parameters' and gradients' own device memory, on torch's
default stream, and keep their state in torch tensors under PyTorch's (or bitsandbytes') keys,
so ``state_dict()``, LR schedulers and ``torch.amp.GradScaler`` work as usual.

Parameters must be contiguous float32 CUDA tensors; anything else raises at construction
(``TypeError`` for a device or dtype, ``ValueError`` for a layout). ``step()`` must run on
torch's default stream (a ``ValueError`` otherwise).
"""

import torch

from . import _native

__all__ = ["Adam", "AdamW", "Adam8bit", "AdamW8bit"]

MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256
# bitsandbytes' state keys that keep their dtype, and the key its state_dict() nests them under.
_RAW_KEYS = ("state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"


def _check_param(p, who):
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{who}: parameters must be tensors, got {type(p).__name__}")
    if p.device.type != "cuda":
        raise TypeError(
            f"{who}: a parameter on {p.device}; headroom optimizers step CUDA tensors "
            "(move the model to the GPU before creating the optimizer)"
        )
    if p.dtype != torch.float32:
        raise TypeError(f"{who}: a parameter of dtype {p.dtype}; only torch.float32 is supported")
    if p.is_sparse or not p.is_contiguous():
        raise ValueError(
            f"{who}: a non-contiguous parameter of shape {tuple(p.shape)}; make it contiguous "
            "(p.data = p.data.contiguous()) before creating the optimizer"
        )


def _check_grad(p, g, who):
    if g.is_sparse:
        raise TypeError(f"{who}: sparse gradients are not supported")
    if not g.is_contiguous():
        raise ValueError(
            f"{who}: a non-contiguous gradient of shape {tuple(g.shape)}; headroom steps raw "
            "device memory, so gradients must be contiguous"
        )


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream


def _scaling(grad_scale, found_inf):
    return (
        None if grad_scale is None else grad_scale.data_ptr(),
        None if found_inf is None else found_inf.data_ptr(),
    )


class _HeadroomOptimizer(torch.optim.Optimizer):
    """What both families share: parameter checks, per-group launch lists cached between
    steps (rebuilt when the set of parameters with gradients changes), step counts kept as
    Python ints and written to ``state['step']`` when a state dict is taken."""

    _who = "headroom.optim"

    def __init__(self, params, defaults):
        self._kernels = {}
        self._groups = {}
        super().__init__(params, defaults)
        self.register_state_dict_pre_hook(lambda opt: opt._sync_steps())
        self.register_load_state_dict_post_hook(lambda opt: opt._groups.clear())

    def add_param_group(self, param_group):
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            _check_param(p, self._who)
        super().add_param_group(param_group)

    def _kernel(self, device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = self._kernels.get(index)
        if kernel is None:
            kernel = self._kernels[index] = self._native_class(index, *self._native_args())
        return kernel

    def _native_args(self):
        return ()

    def _sync_steps(self):
        for cache in self._groups.values():
            for p, step in zip(cache["params"], cache["steps"]):
                self.state[p]["step"] = self._step_value(step)

    def _cache(self, index, params):
        cache = self._groups.get(index)
        if cache is not None and cache["params"] == params:
            return cache
        self._sync_steps()
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError(f"{self._who}: a parameter group spans several devices")
        for p in params:
            if len(self.state[p]) == 0:
                self._init_state(p)
        cache = self._build(params)
        cache["params"] = params
        cache["device"] = device
        cache["steps"] = [int(self.state[p]["step"]) for p in params]
        self._groups[index] = cache
        return cache

    @torch.no_grad()
    def step(self, closure=None, grad_scale=None, found_inf=None):
        """One step of every parameter with a gradient. ``grad_scale``/``found_inf``: a
        GradScaler's device tensors, read in the kernel (divide by the scale; write nothing when
        the flag is non-zero, though the step is counted: ``torch.amp.GradScaler.step`` never
        passes them, it skips ``step()`` itself). ``Adam``/``AdamW`` leave the gradients divided
        by the scale, as torch's fused step does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            cache = self._cache(index, params)
            grads = []
            for p in params:
                g = p.grad
                if not g.is_contiguous() or g.is_sparse:
                    _check_grad(p, g, self._who)
                grads.append(g.data_ptr())
            steps = cache["steps"]
            for i in range(len(steps)):
                steps[i] += 1
            first = steps[0]
            if all(s == first for s in steps):
                self._launch(group, cache, grads, first, range(len(params)), grad_scale, found_inf)
            else:
                for value in sorted(set(steps)):
                    which = [i for i, s in enumerate(steps) if s == value]
                    self._launch(group, cache, grads, value, which, grad_scale, found_inf)
        return loss


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

    def _init_state(self, p):
        state = self.state[p]
        state["step"] = self._step_value(0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _build(self, params):
        states = [self.state[p] for p in params]
        return {
            "p": [p.data_ptr() for p in params],
            "m": [s["exp_avg"].data_ptr() for s in states],
            "v": [s["exp_avg_sq"].data_ptr() for s in states],
            "states": states,
            "lens": [p.numel() for p in params],
        }

    def _launch(self, group, cache, grads, step, which, grad_scale, found_inf):
        max_sq = None
        if group["amsgrad"]:
            for s, p in zip(cache["states"], cache["params"]):
                if "max_exp_avg_sq" not in s:
                    s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            max_sq = [s["max_exp_avg_sq"].data_ptr() for s in cache["states"]]
        pick = (lambda xs: xs) if len(which) == len(grads) else (lambda xs: [xs[i] for i in which])
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        lr = float(lr) if not isinstance(lr, torch.Tensor) else lr.item()
        self._kernel(cache["device"]).step(
            _stream(cache["device"]), step,
            (lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])),
            self._decoupled, bool(group["maximize"]),
            pick(cache["p"]), pick(grads), pick(cache["m"]), pick(cache["v"]),
            None if max_sq is None else pick(max_sq), pick(cache["lens"]),
            *_scaling(grad_scale, found_inf),
        )


class Adam(_FusedAdam):
    """``torch.optim.Adam(fused=True)``'s update (L2 weight decay) in one Headroom launch, with
    its kernel's arithmetic (float hyperparameters, fma moments): the same bits without weight
    decay; with it, within a few ulps (the L2 term is not yet reproduced to the bit)."""

    _who = "headroom.optim.Adam"


class AdamW(_FusedAdam):
    """``torch.optim.AdamW(fused=True)``'s update (decoupled weight decay) in one Headroom launch,
    with its kernel's arithmetic: the same bits."""

    _who = "headroom.optim.AdamW"
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
        maps and absmax keep their dtypes (torch's loader would cast them to the parameter's)."""
        state, held = {}, {}
        for pid, saved in state_dict["state"].items():
            saved = dict(saved)
            saved.update(saved.pop(_BNB_WRAPPED, {}))
            held[pid] = {k: saved.pop(k) for k in _RAW_KEYS if k in saved}
            state[pid] = saved
        super().load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in held.get(pid, {}).items():
                self.state[p][key] = value.to(p.device, copy=True)
        self._groups.clear()

    def _qmaps(self, device):
        maps = self._maps.get(device)
        if maps is None:
            signed, unsigned = _native.bnb_maps()
            maps = self._maps[device] = (
                torch.tensor(signed, dtype=torch.float32, device=device),
                torch.tensor(unsigned, dtype=torch.float32, device=device),
            )
        return maps

    def _init_state(self, p):
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

    def _build(self, params):
        states = [self.state[p] for p in params]
        for p, s in zip(params, states):
            small = p.numel() < MIN_8BIT_SIZE
            want = torch.float32 if small else torch.uint8
            for key in ("state1", "state2"):
                t = s[key]
                if t.dtype != want or t.device != p.device or not t.is_contiguous() or t.numel() != p.numel():
                    raise ValueError(
                        f"{self._who}: state {key!r} of a parameter of {p.numel()} elements is "
                        f"{t.dtype} {tuple(t.shape)} on {t.device}; bitsandbytes' layout needs "
                        f"{want} with one entry per element on the parameter's device"
                    )
        return {
            "p": [p.data_ptr() for p in params],
            "s1": [s["state1"].data_ptr() for s in states],
            "s2": [s["state2"].data_ptr() for s in states],
            "a1": [s["absmax1"].data_ptr() if "absmax1" in s else 0 for s in states],
            "a2": [s["absmax2"].data_ptr() if "absmax2" in s else 0 for s in states],
            "lens": [p.numel() for p in params],
        }

    def _launch(self, group, cache, grads, step, which, grad_scale, found_inf):
        pick = (lambda xs: xs) if len(which) == len(grads) else (lambda xs: [xs[i] for i in which])
        beta1, beta2 = group["betas"][:2]
        lr = group["lr"]
        lr = float(lr) if not isinstance(lr, torch.Tensor) else lr.item()
        self._kernel(cache["device"]).step(
            _stream(cache["device"]), step,
            (lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])),
            pick(cache["p"]), pick(grads), pick(cache["s1"]), pick(cache["s2"]),
            pick(cache["a1"]), pick(cache["a2"]), pick(cache["lens"]),
            *_scaling(grad_scale, found_inf),
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
