"""`pytest --device NAME` reaches the tests (tests/devices.py), and a device the suite cannot use is
refused at start-up with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import devices
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_the_fixture_and_the_module_hold_the_option(request, device):
    assert device == devices.DEVICE == torch.device(request.config.getoption("--device"))
    x = devices.on_device({"a": [torch.zeros(2)], "b": (torch.ones(1), 3)})
    assert x["a"][0].device.type == x["b"][0].device.type == device.type and x["b"][1] == 3


@pytest.mark.parametrize(
    ("name", "message"),
    [("meta", "--device meta: meta tensors carry no values"), ("bogus", "--device 'bogus' is not a torch device")]
    + ([] if torch.cuda.is_available() else [("cuda", "--device 'cuda' is not available here")]),
)
def test_a_device_the_suite_cannot_use_is_refused(name, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        devices.select(name)


def test_the_refusal_stops_pytest_at_start_up():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "--device", "meta", "tests/test_device_option.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "ERROR: --device meta: meta tensors carry no values" in run.stderr, run.stderr


def test_cpu_only_tests_are_skipped_on_another_device(pytestconfig):
    """The collection hook skips `cpu_only` tests, with their reason, when --device is not cpu."""
    import conftest

    item = type("Item", (), {})()
    item.markers = []
    item.get_closest_marker = lambda name: pytest.mark.cpu_only("needs gloo").mark if name == "cpu_only" else None
    item.add_marker = item.markers.append
    saved = devices.DEVICE
    try:
        devices.DEVICE = torch.device("meta")  # any device other than the CPU
        conftest.pytest_collection_modifyitems(pytestconfig, [item])
    finally:
        devices.DEVICE = saved
    assert [m.kwargs.get("reason") for m in (getattr(m, "mark", m) for m in item.markers)] == [
        "--device meta: needs gloo"
    ]
