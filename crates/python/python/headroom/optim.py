"""Headroom's fused, 8-bit and bfloat16 optimizers as ``torch.optim.Optimizer`` subclasses.

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

import operator
from itertools import repeat

import torch

from . import _native

__all__ = ["Adam", "AdamW", "AdamBf16", "AdamWBf16", "SGD", "Adam4bit", "AdamW4bit", "Adam8bit",
           "AdamW8bit", "MasterWeights"]

MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256
# bitsandbytes' state keys that keep their dtype, and the key its state_dict() nests them under.
_RAW_KEYS = ("state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"

# Unbound tensor methods, mapped over lists in the per-step comparisons.
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_device_index = torch.Tensor.get_device
_is_contiguous = torch.Tensor.is_contiguous
_dtype = operator.attrgetter("dtype")
_grad = operator.attrgetter("grad")


def _check_param(p, who, device_types=("cuda",), dtype=torch.float32):
    """Raises unless ``p`` is a contiguous tensor of ``dtype`` (or one of a tuple of dtypes) on a
    device of ``device_types``."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{who}: parameters must be tensors, got {type(p).__name__}")
    if p.device.type not in device_types:
        raise TypeError(
            f"{who}: a parameter on {p.device}; this optimizer steps "
            f"{' or '.join(t.upper() for t in device_types)} tensors (move the model to the GPU "
            "before creating the optimizer, and keep it there)"
        )
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if p.dtype not in allowed:
        raise TypeError(
            f"{who}: a parameter of dtype {p.dtype}; only {' or '.join(map(str, allowed))} is "
            "supported (a model cast after the optimizer was created, e.g. model.half(), cannot "
            "be stepped)"
        )
    if p.layout != torch.strided or not p.is_contiguous():
        raise ValueError(
            f"{who}: a non-contiguous parameter of shape {tuple(p.shape)}; make it contiguous "
            "(p.data = p.data.contiguous()) before stepping"
        )


def _check_grad(p, g, who):
    """Raises unless gradient ``g`` can be read as ``p``'s: float32, dense, contiguous, on
    ``p``'s device, with ``p``'s number of elements."""
    if g.layout != torch.strided:
        raise TypeError(f"{who}: {g.layout} gradients are not supported")
    if g.dtype != p.dtype:
        raise TypeError(
            f"{who}: a gradient of dtype {g.dtype} for a {p.dtype} parameter of shape "
            f"{tuple(p.shape)}; the kernel reads gradients of the parameter's dtype"
        )
    if g.device != p.device:
        raise ValueError(f"{who}: a gradient on {g.device} for a parameter on {p.device}")
    if g.numel() != p.numel():
        raise ValueError(
            f"{who}: a gradient of shape {tuple(g.shape)} for a parameter of shape "
            f"{tuple(p.shape)}"
        )
    if not g.is_contiguous():
        raise ValueError(
            f"{who}: a non-contiguous gradient of shape {tuple(g.shape)}; headroom steps raw "
            "device memory, so gradients must be contiguous"
        )


def _check_state(p, state, key, dtype, shape, who):
    """``state[key]``, checked to be a contiguous ``dtype`` tensor of ``shape`` on ``p``'s
    device (``ValueError``; ``TypeError`` for a non-tensor or another dtype)."""
    t = state.get(key)
    if t is None:
        raise ValueError(
            f"{who}: the state of a parameter of shape {tuple(p.shape)} has no {key!r} (a state "
            "dict of another optimizer, or edited by hand?)"
        )
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: state {key!r} is a {type(t).__name__}, not a tensor")
    if t.dtype != dtype:
        raise TypeError(
            f"{who}: state {key!r} of a parameter of shape {tuple(p.shape)} is {t.dtype}; "
            f"the kernel needs {dtype}"
        )
    if t.device != p.device:
        raise ValueError(
            f"{who}: state {key!r} is on {t.device}, its parameter on {p.device}; load the state "
            "dict after moving the model (Optimizer.load_state_dict moves it to the parameters)"
        )
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{who}: state {key!r} has shape {tuple(t.shape)}, its parameter needs "
            f"{tuple(shape)} (a state dict of another model, or parameters in another order?)"
        )
    if t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(f"{who}: state {key!r} of shape {tuple(t.shape)} is not contiguous")
    return t


def _check_disjoint(tensors, what, who):
    """Raises ``ValueError`` when two of ``tensors`` share bytes (the kernel steps each buffer
    from its own threads; two parameters on one storage would race)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, t in enumerate(tensors)
        if t.numel() > 0
    )
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            a, b = tensors[i], tensors[j]
            raise ValueError(
                f"{who}: {what} of shapes {tuple(a.shape)} and {tuple(b.shape)} share memory "
                "(one tensor listed twice, or views of one storage); each needs its own"
            )


def _check_scaler_tensor(t, name, device, who):
    """``t.data_ptr()``, or None for None: a GradScaler's one-element float32 tensor on
    ``device``."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{who}: {name} must be float32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{who}: {name} is on {t.device}, the parameters on {device}")
    if t.numel() != 1:
        raise ValueError(f"{who}: {name} must have one element, got shape {tuple(t.shape)}")
    return t.data_ptr()


class _LaunchPlan:
    """One parameter group's launch lists: the device pointers of the parameters with gradients
    and of their states, built after every tensor was checked, with what they were built from
    (each parameter's data pointer, dtype, size, device and contiguity; the state tensors, kept
    alive by this plan, and their pointers) for the per-step comparison, and the step counts:
    each parameter's at the build plus the steps taken since (``taken``), launched as one
    launch per distinct count (``launches``: the count at the build and the parameters with it;
    empty parameters count their steps but have no memory to launch on)."""

    __slots__ = (
        "params", "device", "signature", "lens", "states", "state_ptrs", "lists", "steps",
        "taken", "launches", "grad_dtypes", "grad_devices", "amsgrad",
    )

    def __init__(self, params, lists, states, steps, amsgrad=False):
        self.params = params
        self.device = params[0].device
        self.signature = _signature(params)
        self.lens = self.signature[2]
        self.lists = lists
        self.states = states
        self.state_ptrs = list(map(_data_ptr, states))
        self.steps = steps
        self.taken = 0
        self.amsgrad = amsgrad
        launchable = [i for i, n in enumerate(self.lens) if n > 0]
        self.launches = [
            (base, [i for i in launchable if steps[i] == base]) for base in sorted(set(steps))
        ]
        self.grad_dtypes = list(self.signature[1])
        self.grad_devices = self.signature[3]

    def still_valid(self, params):
        """Whether ``params`` are the same objects, each still of the storage, dtype, size,
        device and layout the lists were built from, and the states' storage unmoved."""
        old = self.params
        return (
            len(old) == len(params)
            and all(map(operator.is_, old, params))
            and _signature(params) == self.signature
            and list(map(_data_ptr, self.states)) == self.state_ptrs
        )

    def grad_pointers(self, grads, who):
        """The gradients' data pointers, after checking each against its parameter."""
        try:
            ok = (
                list(map(_dtype, grads)) == self.grad_dtypes
                and list(map(_numel, grads)) == self.lens
                and list(map(_device_index, grads)) == self.grad_devices
                and all(map(_is_contiguous, grads))
            )
        except RuntimeError:
            ok = False
        if not ok:
            for p, g in zip(self.params, grads):
                _check_grad(p, g, who)
        return list(map(_data_ptr, grads))


def _signature(tensors):
    """Each tensor's data pointer, dtype, size, device index and contiguity, as five lists."""
    return (
        list(map(_data_ptr, tensors)),
        list(map(_dtype, tensors)),
        list(map(_numel, tensors)),
        list(map(_device_index, tensors)),
        list(map(_is_contiguous, tensors)),
    )


class _HeadroomOptimizer(torch.optim.Optimizer):
    """What both families share: parameter checks, per-group launch plans cached between steps
    (rebuilt, every tensor checked again, when a parameter, a gradient set or a state changes),
    step counts kept as Python ints and written to ``state['step']`` when a state dict is
    taken."""

    _who = "headroom.optim"
    # The device types parameters may be on (the kernels are CUDA's) and their dtype.
    _device_type = ("cuda",)
    _param_dtype = torch.float32

    def __init__(self, params, defaults):
        self._kernels = {}
        self._plans = {}
        # The headroom.torch.InBackward that steps this optimizer, while one does.
        self._stepped_in_backward = None
        super().__init__(params, defaults)
        self.register_state_dict_pre_hook(lambda opt: opt._sync_steps())
        self.register_load_state_dict_post_hook(lambda opt: opt._plans.clear())

    def add_param_group(self, param_group):
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            _check_param(p, self._who, self._device_type, self._param_dtype)
        super().add_param_group(param_group)

    def _kernel(self, device):
        if device.type == "cpu":
            kernel = self._kernels.get("cpu")
            if kernel is None:
                kernel = self._kernels["cpu"] = self._native_class(None, *self._native_args())
            return kernel
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = self._kernels.get(index)
        if kernel is None:
            kernel = self._kernels[index] = self._native_class(index, *self._native_args())
        return kernel

    def _stream(self, device):
        """The raw handle of the stream the kernels would run on (must be 0, the default; 0 on
        the CPU)."""
        if device.type == "cpu":
            return 0
        stream = torch.cuda.current_stream(device).cuda_stream
        if stream != 0:
            raise ValueError(
                "headroom optimizers step on torch's default stream; call step() outside "
                "`with torch.cuda.stream(...)` (or synchronise that stream with the default "
                "one first)"
            )
        return stream

    def _native_args(self):
        return ()

    def _sync_steps(self):
        for plan in self._plans.values():
            for p, step in zip(plan.params, plan.steps):
                self.state[p]["step"] = self._step_value(step + plan.taken)

    def _plan(self, key, group, params):
        """The launch plan for ``params`` of ``group`` under ``key`` (the group's index for
        ``step()``, the group's index and the bucket's parameters for a bucket stepped inside
        backward): the cached one while nothing it was built from changed, else a new one, every
        parameter and state checked. A new plan first writes every plan's step counts to the
        state and drops the cached plans that share a parameter with it, so each parameter's
        count lives in one plan."""
        plan = self._plans.get(key)
        if plan is not None and plan.still_valid(params) and self._plan_matches_group(plan, group):
            return plan
        self._sync_steps()
        ids = set(map(id, params))
        self._plans = {
            k: other for k, other in self._plans.items()
            if k != key and ids.isdisjoint(map(id, other.params))
        }
        for p in params:
            _check_param(p, self._who, self._device_type, self._param_dtype)
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError(f"{self._who}: a parameter group spans several devices")
        for p in params:
            if len(self.state[p]) == 0:
                self._init_state(p)
        steps = [self._saved_step(p) for p in params]
        plan = self._build(group, params, steps)
        _check_disjoint(params + plan.states, "parameters or states", self._who)
        self._plans[key] = plan
        return plan

    def _plan_matches_group(self, plan, group):
        return True

    def _saved_step(self, p):
        step = self.state[p].get("step")
        if step is None:
            raise ValueError(
                f"{self._who}: the state of a parameter of shape {tuple(p.shape)} has no 'step' "
                "(a state dict of another optimizer, or edited by hand?)"
            )
        return int(step)

    @torch.no_grad()
    def step(self, closure=None, grad_scale=None, found_inf=None):
        """One step of every parameter with a gradient. ``grad_scale``/``found_inf``: a
        GradScaler's one-element float32 device tensors, read in the kernel (divide by the
        scale; write nothing when the flag is non-zero, though the step is counted:
        ``torch.amp.GradScaler.step`` never passes them, it skips ``step()`` itself).
        ``Adam``/``AdamW`` leave the gradients divided by the scale, as torch's fused step does.
        Every check runs before the first launch: a step that raises changes nothing. An
        optimizer handed to ``headroom.torch.optimizer_in_backward`` steps inside backward, so
        this raises ``RuntimeError`` until that registration is removed."""
        if self._stepped_in_backward is not None:
            raise RuntimeError(
                f"{self._who}: this optimizer steps inside backward "
                "(headroom.torch.optimizer_in_backward); step the object that call returned (its "
                "step() does nothing, the updates already happened), or call its remove() first"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets = [(index, group, list(group["params"])) for index, group in enumerate(self.param_groups)]
        self._step_buckets(buckets, grad_scale, found_inf)
        return loss

    def _step_buckets(self, buckets, grad_scale=None, found_inf=None):
        """Steps each ``(key, group, params)`` of ``buckets`` (the parameters with a gradient
        among ``params``), all checked before the first launch. Returns the plans launched."""
        launches = []
        for key, group, params in buckets:
            grad_tensors = list(map(_grad, params))
            if not all(map(operator.is_not, grad_tensors, repeat(None))):
                params = [p for p, g in zip(params, grad_tensors) if g is not None]
                grad_tensors = [g for g in grad_tensors if g is not None]
            if not params:
                continue
            plan = self._plan(key, group, params)
            grads = plan.grad_pointers(grad_tensors, self._who)
            if grad_scale is not None:
                # The scale is divided out of the gradients in place: no two may share memory.
                _check_disjoint(grad_tensors, "gradients", self._who)
            stream = self._stream(plan.device)
            scaling = (
                _check_scaler_tensor(grad_scale, "grad_scale", plan.device, self._who),
                _check_scaler_tensor(found_inf, "found_inf", plan.device, self._who),
            )
            launches.append((group, plan, grads, stream, scaling))
        for group, plan, grads, stream, scaling in launches:
            taken = plan.taken + 1
            for base, which in plan.launches:
                self._launch(group, plan, grads, stream, base + taken, which, scaling)
            plan.taken = taken
        return [plan for _, plan, _, _, _ in launches]


def _load_keeping_dtypes(optimizer, state_dict, keys, load):
    """``load`` (torch's ``load_state_dict``) on ``state_dict`` with the state entries under
    ``keys`` held out, then put back with their own dtypes (torch's loader casts floating state
    to the parameter's dtype) on their parameter's device; the launch plans are dropped."""
    state, held = {}, {}
    for pid, saved in state_dict["state"].items():
        saved = dict(saved)
        held[pid] = {k: saved.pop(k) for k in keys if k in saved}
        state[pid] = saved
    load({"state": state, "param_groups": state_dict["param_groups"]})
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, p in zip(saved_ids, params):
        for key, value in held.get(pid, {}).items():
            optimizer.state[p][key] = value.to(p.device, copy=True)
    optimizer._plans.clear()


def _blockwise_plan(opt, params, steps, layout):
    """The launch plan of a block-wise optimizer: per parameter ``state1``/``state2`` checked as
    ``layout(p)``'s first (dtype, shape) and ``absmax1``/``absmax2`` as f32 of its second shape,
    or absent (address 0) where that is ``None``."""
    lists = {key: [] for key in ("state1", "state2", "absmax1", "absmax2")}
    states = []
    for p in params:
        state = opt.state[p]
        (dtype, shape), scales = layout(p)
        for key in ("state1", "state2"):
            t = _check_state(p, state, key, dtype, shape, opt._who)
            lists[key].append(t.data_ptr())
            states.append(t)
        for key in ("absmax1", "absmax2"):
            if scales is None:
                lists[key].append(0)
                continue
            t = _check_state(p, state, key, torch.float32, scales, opt._who)
            lists[key].append(t.data_ptr())
            states.append(t)
    return _LaunchPlan(params, lists, states, steps)


def _check_seed(seed):
    """Raises unless ``seed`` keys the rounding bits (an int of 64 bits)."""
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed!r}: give an int from 0 to 2**64 - 1")


def _slots_of(optimizer, params):
    """Each of ``params``' position among ``optimizer``'s parameters (in the order they were
    given), which keys its stochastic rounding's stream: taken when a launch plan is built."""
    position = {id(p): i for i, p in
                enumerate(p for group in optimizer.param_groups for p in group["params"])}
    return [position[id(p)] for p in params]


def _pick(values, which, n):
    return values if len(which) == n else [values[i] for i in which]


def _lr(group):
    lr = group["lr"]
    return float(lr) if not isinstance(lr, torch.Tensor) else lr.item()


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
                checked[key].append(_check_state(p, state, key, torch.float32, p.shape, self._who))
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
            *self._slot_args(plan, which, n), *scaling,
        )

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
    kept on average instead of lost. On CUDA tensors one launch for every parameter; on CPU
    tensors the same arithmetic on the host (the same bits). The random bits are counter-based:
    parameter ``i`` (its position among the optimizer's parameters, in the order they were
    given) at step ``t`` draws from a stream keyed by ``seed``, ``i`` and ``t``, so a run is
    reproducible and a state dict continues it. The state: ``step`` (a float32 tensor, as
    torch's), ``exp_avg`` and ``exp_avg_sq`` (and with ``amsgrad`` ``max_exp_avg_sq``) in
    float32, of the parameter's shape. The arithmetic is the optimizer's own fused one
    (``torch.optim.Adam``'s single-tensor formula in float32), not torch's fused kernel's."""

    _native_class = _native.AdamStochastic
    _param_dtype = torch.bfloat16
    _device_type = ("cuda", "cpu")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None,
                 amsgrad=False, *, maximize=False, seed=0):
        _check_seed(seed)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize)
        for group in self.param_groups:
            group.setdefault("seed", seed)

    def _init_state(self, p):
        state = self.state[p]
        state["step"] = self._step_value(0)
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _build(self, group, params, steps):
        if group["amsgrad"]:
            for p in params:
                state = self.state[p]
                if "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32,
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


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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

    def _init_state(self, p):
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

    def _init_state(self, p):
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
