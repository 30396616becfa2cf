"""The gate the torch test files here share: ``torch`` (``None`` when it is not installed),
``pytest`` (``None``: each file also runs as a plain script), ``REQUIRE_GPU``, ``skip`` and
``need_gpu``, ``main``, a file's entry as a script, and for files whose cases take a ``device``
(``"cpu"`` or ``"cuda"``): ``on_device`` and ``device_cases``.

Importing it without torch skips the importing module under pytest, and fails under
``HEADROOM_REQUIRE_GPU=1``; run as a script, the file itself says that nothing ran.
"""

import os

try:
    import pytest
except ImportError:  # run as a script without pytest
    pytest = None

REQUIRE_GPU = os.environ.get("HEADROOM_REQUIRE_GPU") == "1"


class Skipped(Exception):
    """A case that cannot run here (raised only when pytest is absent)."""


def skip(reason):
    if pytest is not None:
        pytest.skip(reason)
    raise Skipped(reason)


try:
    import torch
except ImportError:
    torch = None
    if REQUIRE_GPU:
        raise RuntimeError("HEADROOM_REQUIRE_GPU=1, but torch is not installed")
    if pytest is not None:
        pytest.skip("torch is not installed", allow_module_level=True)


def need_gpu():
    """Skips the case without a CUDA device (fails instead under ``HEADROOM_REQUIRE_GPU=1``)."""
    if torch is None or not torch.cuda.is_available():
        if REQUIRE_GPU:
            raise AssertionError("HEADROOM_REQUIRE_GPU=1, but CUDA is not available")
        skip("no CUDA device")


def run_cases(cases):
    """Runs ``(label, call)`` pairs without pytest, printing each outcome; 1 when any failed."""
    passed = failed = skipped = 0
    for label, call in cases:
        try:
            call()
        except Skipped as reason:
            skipped += 1
            print(f"SKIP {label}: {reason}")
        except Exception as error:  # noqa: BLE001
            failed += 1
            print(f"FAIL {label}: {type(error).__name__}: {error}")
        else:
            passed += 1
            print(f"ok   {label}")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


def main(path, cases):
    """A test file run as a script: nothing without torch (a failure under
    ``HEADROOM_REQUIRE_GPU=1``), pytest on ``path`` when installed, else ``run_cases(cases())``."""
    if torch is None:
        print("torch is not installed: nothing to run")
        return 1 if REQUIRE_GPU else 0
    if pytest is not None:
        return pytest.main([path, "-q"])
    return run_cases(cases())


DEVICES = ("cpu", "cuda")


def on_device(name):
    """The ``torch.device`` a case named ``name`` runs on (a ``"cuda"`` case skips without a
    GPU, as ``need_gpu`` says)."""
    if name == "cuda":
        need_gpu()
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_cases(namespace):
    """Every ``test_*`` function of ``namespace`` (a module's ``globals()``), once per device
    where it takes a ``device``: the ``cases`` ``main`` runs without pytest."""
    import functools
    import inspect

    res = []
    for name, fn in sorted(namespace.items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        if "device" in inspect.signature(fn).parameters:
            res.extend((f"{name}[{d}]", functools.partial(fn, d)) for d in DEVICES)
        else:
            res.append((name, fn))
    return res
