"""Test-session set-up: one thread per op, a persistent Inductor cache, hypothesis profiles, `--device`."""

import os
import sys

# OpenMP spin-waiting starves the rank threads and gloo workers on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's on-disk cache is the only compile cache that survives between runs: keep it outside
# the checkout so a fresh clone on the same machine reuses it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lossfx", "inductor"))
# Inductor compiles in the calling process: its default pool of compile workers (one per core) costs
# each test process and gloo rank a torch import, which a 2-core machine pays for with the tests' own time.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

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


# Collection only, for tests/test_device_option.py: the suite collected with DEVICE = meta, each
# tensor a test module holds at import (globals, parametrize values) that is not there is reported.
AUDIT = "LOSSFX_TEST_DEVICE_AUDIT"


def pytest_configure(config):
    if os.environ.get(AUDIT) == "1":
        devices.DEVICE = torch.device("meta")
        return
    try:
        devices.DEVICE = devices.select(config.getoption("--device"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _audit(items):
    """Print one `DEVICE-AUDIT` line per tensor that a non-cpu_only test's module (or a helper module of
    this directory) holds at import, or gets as a parametrize value, off DEVICE."""
    following = [item for item in items if item.get_closest_marker("cpu_only") is None]
    modules = {id(item.module): item.module for item in following} | {id(m): m for m in _test_modules()}
    for module in modules.values():
        for name, value in vars(module).items():
            for where in devices.stray_tensors(value, f"{module.__name__}.{name}"):
                print(f"DEVICE-AUDIT {where}")
    for item in following:
        for name, value in getattr(getattr(item, "callspec", None), "params", {}).items():
            for where in devices.stray_tensors(value, f"{item.nodeid}[{name}]"):
                print(f"DEVICE-AUDIT {where}")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(AUDIT) == "1":
        _audit(items)
        return
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


TESTS = os.path.dirname(os.path.abspath(__file__))


_seen = {"count": -1, "modules": []}


def _test_modules():
    """The modules of this directory (test files and their helpers) imported so far, but this one and
    devices (recomputed only when a module was imported since: a scan costs a few ms)."""
    if len(sys.modules) != _seen["count"]:
        here = [m for m in list(sys.modules.values()) if os.path.dirname(getattr(m, "__file__", None) or "") == TESTS]
        _seen["modules"] = [m for m in here if m not in (devices, sys.modules[__name__])]
        _seen["count"] = len(sys.modules)
    return _seen["modules"]


@pytest.fixture(autouse=True)
def _inputs_on_device(request):
    """Inside every test that is not `cpu_only` (its fixtures included), the tensors the test modules
    make with `torch.<factory>(...)` are drawn on the CPU and moved to `--device` (devices.inputs_on_device)."""
    if request.node.get_closest_marker("cpu_only") is not None:
        yield
        return
    with devices.inputs_on_device(_test_modules()):
        yield


@pytest.fixture
def short_pool_timeout(monkeypatch):
    """A hang fails the test after 60 s instead of the harness's default 600 s (the rank checks'
    modules use it: `pytest.mark.usefixtures("short_pool_timeout")`)."""
    import harness

    monkeypatch.setattr(harness, "_TIMEOUT_S", 60.0)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Each test starts from a clean Dynamo state, so recompile counts are its own."""
    torch._dynamo.reset()
    yield


def pytest_sessionfinish(session, exitstatus):
    from harness import close_all

    close_all()
