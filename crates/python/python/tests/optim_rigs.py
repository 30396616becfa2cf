"""The rigs the optimizer misuse and in-backward tests run on: where a case runs (``cpu`` or
``cuda``), the optimizer classes and PyTorch's reference, and the helpers that step, compare and
expect errors.

On the ``cpu`` rig the optimizers' own Python (the checks, the launch plans, the caching) runs on
CPU tensors with their kernel replaced by a stand-in that looks every pointer it is handed up
among the live tensors it must belong to — the parameter with that address, its gradient, its
state — and fails the test (``OutOfBounds``) when one is anything else or its length differs
(there the GPU kernel would have read or written out of bounds), then runs torch's
single-tensor Adam on those tensors. On the ``cuda`` rig the real kernels run.

Not a test module (pytest collects ``test_*.py`` only); it needs torch and the ``headroom``
package.
"""

from torch_gate import need_gpu, skip, torch

if torch is not None:
    import torch.optim.adam as torch_adam

    import headroom.optim as hopt

MIN_8BIT = 4096
RIG_NAMES = ("cpu", "cuda")

# ---------------------------------------------------------------------------------------------
# The cpu rig's kernel stand-ins: pointers checked against live tensors, then torch's math.
# ---------------------------------------------------------------------------------------------


class OutOfBounds(AssertionError):
    """A pointer or length handed to the kernel that does not match the tensor it must be."""


def _live_params(opt):
    found = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None and p.numel() > 0:
                found.setdefault(p.data_ptr(), p)
    return found


def _expect(t, ptr, dtype, numel, what):
    if t is None:
        raise OutOfBounds(f"{what}: no such tensor, the kernel would touch memory at {ptr:#x}")
    if t.data_ptr() != ptr:
        raise OutOfBounds(f"{what}: pointer {ptr:#x} is not the tensor's ({t.data_ptr():#x})")
    if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
        raise OutOfBounds(
            f"{what}: the kernel would access {numel} {dtype} elements of a {t.dtype} tensor "
            f"of shape {tuple(t.shape)} (contiguous: {t.is_contiguous()})"
        )


class CheckedFusedAdam:
    """Stands in for ``_native.FusedAdam`` on CPU tensors."""

    def __init__(self, opt):
        self.opt = opt
        self.launches = []

    def step(self, stream, step, hyper, decoupled, maximize, params, grads, exp_avgs,
             exp_avg_sqs, max_exp_avg_sqs, lens, grad_scale=None, found_inf=None):
        assert stream == 0
        n = len(lens)
        lists = [params, grads, exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if max_exp_avg_sqs else [])
        assert all(len(x) == n for x in lists), "launch lists of different lengths"
        assert grad_scale is None and found_inf is None, "the cpu rig does not scale"
        live = _live_params(self.opt)
        ps, gs, ms, vs, maxs = [], [], [], [], []
        for i in range(n):
            p = live.get(params[i])
            _expect(p, params[i], torch.float32, lens[i], f"parameter {i}")
            _expect(p.grad, grads[i], torch.float32, lens[i], f"gradient {i}")
            state = self.opt.state[p]
            _expect(state.get("exp_avg"), exp_avgs[i], torch.float32, lens[i], f"exp_avg {i}")
            _expect(state.get("exp_avg_sq"), exp_avg_sqs[i], torch.float32, lens[i], f"exp_avg_sq {i}")
            if max_exp_avg_sqs:
                _expect(state.get("max_exp_avg_sq"), max_exp_avg_sqs[i], torch.float32, lens[i],
                        f"max_exp_avg_sq {i}")
                maxs.append(state["max_exp_avg_sq"])
            ps.append(p)
            gs.append(p.grad)
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
        if len(set(map(id, ps))) != len(ps):
            raise OutOfBounds("one parameter launched twice in one step")
        self.launches.append((step, [id(p) for p in ps]))
        lr, beta1, beta2, eps, weight_decay = hyper
        torch_adam.adam(
            ps, gs, ms, vs, maxs, [torch.tensor(float(step - 1)) for _ in ps],
            foreach=False, decoupled_weight_decay=decoupled, amsgrad=bool(max_exp_avg_sqs),
            beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
            maximize=maximize,
        )


class CheckedAdam8bit:
    """Stands in for ``_native.Adam8bit`` on CPU tensors: checks every pointer, steps nothing."""

    def __init__(self, opt):
        self.opt = opt
        self.launches = []

    def step(self, stream, step, hyper, params, grads, state1, state2, absmax1, absmax2, lens,
             grad_scale=None, found_inf=None):
        assert stream == 0
        n = len(lens)
        assert all(len(x) == n for x in (params, grads, state1, state2, absmax1, absmax2))
        live = _live_params(self.opt)
        for i in range(n):
            p = live.get(params[i])
            _expect(p, params[i], torch.float32, lens[i], f"parameter {i}")
            _expect(p.grad, grads[i], torch.float32, lens[i], f"gradient {i}")
            state = self.opt.state[p]
            small = lens[i] < MIN_8BIT
            code = torch.float32 if small else torch.uint8
            _expect(state.get("state1"), state1[i], code, lens[i], f"state1 {i}")
            _expect(state.get("state2"), state2[i], code, lens[i], f"state2 {i}")
            blocks = (lens[i] + 255) // 256
            for key, ptr in (("absmax1", absmax1[i]), ("absmax2", absmax2[i])):
                if small:
                    assert ptr == 0, f"{key} {i}: a pointer for a 32-bit state"
                else:
                    _expect(state.get(key), ptr, torch.float32, blocks, f"{key} {i}")
        self.launches.append((step, list(params)))


def _cpu_class(base, stand_in):
    class OnCpu(base):
        _device_type = ("cpu",)

        def _kernel(self, device):
            kernel = self._kernels.get("cpu")
            if kernel is None:
                kernel = self._kernels["cpu"] = stand_in(self)
            return kernel

        def _stream(self, device):
            return 0

    OnCpu.__name__ = base.__name__
    return OnCpu


class Rig:
    """Where a case runs: the device, the optimizer classes and the reference."""

    def __init__(self, name):
        self.name = name
        if name == "cuda":
            need_gpu()
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.AdamW, self.Adam = hopt.AdamW, hopt.Adam
            self.Adam8bit, self.AdamW8bit = hopt.Adam8bit, hopt.AdamW8bit
        else:
            self.device = torch.device("cpu")
            self.AdamW = _cpu_class(hopt.AdamW, CheckedFusedAdam)
            self.Adam = _cpu_class(hopt.Adam, CheckedFusedAdam)
            self.Adam8bit = _cpu_class(hopt.Adam8bit, CheckedAdam8bit)
            self.AdamW8bit = _cpu_class(hopt.AdamW8bit, CheckedAdam8bit)

    def reference(self, kind, params, **kw):
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        if self.name == "cuda":
            return cls(params, fused=True, **kw)
        return cls(params, foreach=False, **kw)

    def ours(self, kind, params, **kw):
        return (self.AdamW if kind == "adamw" else self.Adam)(params, **kw)

    def tensor(self, *shape, seed=0, dtype=None):
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(*shape, generator=g)
        return t.to(self.device, dtype or torch.float32)

    def params(self, shapes, seed=0):
        return [torch.nn.Parameter(self.tensor(*s, seed=seed + i)) for i, s in enumerate(shapes)]

    def sync(self):
        if self.name == "cuda":
            torch.cuda.synchronize()


def rig_for(rig_name):
    if torch is None:
        skip("torch is not installed")
    return Rig(rig_name)


class Pair:
    """A headroom optimizer and a torch reference over two copies of the same parameters."""

    def __init__(self, rig, shapes, kind="adamw", seed=0, **kw):
        self.rig = rig
        self.ours_params = rig.params(shapes, seed)
        self.ref_params = [torch.nn.Parameter(p.detach().clone()) for p in self.ours_params]
        kw.setdefault("lr", 1e-2)
        self.ours = rig.ours(kind, self.ours_params, **kw)
        self.ref = rig.reference(kind, self.ref_params, **kw)

    def grads(self, which, seed):
        for i, (a, b) in enumerate(zip(self.ours_params, self.ref_params)):
            if i in which:
                g = self.rig.tensor(*a.shape, seed=1000 * seed + i)
                a.grad, b.grad = g.clone(), g.clone()
            else:
                a.grad = b.grad = None

    def step(self):
        self.ours.step()
        self.ref.step()
        self.rig.sync()

    def assert_equal(self):
        for i, (a, b) in enumerate(zip(self.ours_params, self.ref_params)):
            assert a.dtype == b.dtype and a.shape == b.shape, i
            assert torch.equal(a.detach(), b.detach()), f"parameter {i} differs from torch's"


def snapshot(params):
    return [p.detach().clone() for p in params]


def adamw_with_unit_grad(rig_name, shape):
    """The rig, one parameter of `shape` and an AdamW over it, the gradient all ones."""
    rig = rig_for(rig_name)
    p = rig.params([shape])[0]
    opt = rig.AdamW([p])
    p.grad = torch.ones_like(p)
    return rig, p, opt


def assert_unchanged(params, before):
    for i, (p, b) in enumerate(zip(params, before)):
        assert torch.equal(p.detach().to(b.dtype), b), f"parameter {i} changed by a step that raised"


def assert_step_refused(rig, opt, params, exc, *words):
    """``opt.step()`` raises ``exc`` (its message naming ``words``) and leaves ``params`` as they
    were, once the device has finished."""
    before = snapshot(params)
    raises(exc, opt.step, *words)
    rig.sync()
    assert_unchanged(params, before)


def raises(exc, fn, *words):
    try:
        fn()
    except exc as error:
        text = str(error)
        for word in words:
            assert word in text, f"{word!r} not in {text!r}"
        return error
    except OutOfBounds:
        raise
    except Exception as error:  # noqa: BLE001
        raise AssertionError(f"expected {exc.__name__}, got {type(error).__name__}: {error}")
    raise AssertionError(f"expected {exc.__name__}, nothing raised")


def set_grad_any_dtype(p, g):
    """``p.grad = g`` for a ``g`` of another dtype (PyTorch 2.11's ``grad_dtype``; earlier, the
    ``.data`` detour)."""
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None
        p.grad = g
        return
    data = p.data
    p.data = torch.empty_like(data, dtype=g.dtype)
    p.grad = g
    p.data = data
