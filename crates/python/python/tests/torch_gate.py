"""The gate the torch test files here share: ``torch`` (``None`` when it is not installed),
``pytest`` (``None``: each file also runs as a plain script), ``REQUIRE_GPU``, ``skip`` and
``need_gpu``.

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
