"""Test-session set-up: one thread per op, a persistent Inductor cache, hypothesis profiles, `--device`."""

import os

# OpenMP spin-waiting starves the rank threads and gloo workers on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's on-disk cache is the only compile cache that survives between runs: keep it outside
# the checkout so a fresh clone on the same machine reuses it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lossfx", "inductor"))

import devices
import profiles  # noqa: F401  (registers and loads the hypothesis profiles)
import pytest
import torch

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="device the tests build their tensors on (default: cpu; e.g. cuda); tests marked cpu_only "
        "are skipped on any other device (docs/testing.md lists them)",
    )


def pytest_configure(config):
    try:
        devices.DEVICE = devices.select(config.getoption("--device"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_collection_modifyitems(config, items):
    if devices.DEVICE.type == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            why = marker.args[0] if marker.args else "CPU only"
            item.add_marker(pytest.mark.skip(reason=f"--device {devices.DEVICE}: {why}"))


@pytest.fixture
def device():
    """The device of `--device` (the same as `devices.DEVICE`)."""
    return devices.DEVICE


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts from a clean Dynamo state, so recompile counts are its own."""
    torch._dynamo.reset()
    yield


def pytest_sessionfinish(session, exitstatus):
    from harness import close_all

    close_all()
