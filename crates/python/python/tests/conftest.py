"""pytest's shared hook for the suites here: a case that takes ``device`` runs once on ``"cpu"``
and once on ``"cuda"`` (``torch_gate.DEVICES``)."""

DEVICES = ("cpu", "cuda")


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)
