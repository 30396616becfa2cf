"""What every optimizer of ``headroom.optim`` stands on: the checks that precede any launch
(parameters, gradients, states, scaling tensors, overlaps), the launch plan a group's pointers are
kept in, ``_HeadroomOptimizer`` (state, steps, plans, the step driver) and the small pieces the
optimizers share. ``headroom.optim``'s documentation says what raises and why.

This module sits on torch; it knows no update rule and no kernel.
"""

import operator
from itertools import repeat

import torch

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
                self._init_state(p, group)
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


#: torch dtypes by the names the native kernels take.
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
