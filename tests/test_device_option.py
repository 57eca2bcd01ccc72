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


def _collect(marker: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    files = ["tests/test_magnitudes.py", *(str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("tests/test_pure_*.py")))]
    command = [sys.executable, "-m", "pytest", "--co", "-q", "-m", marker, *files]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_gpu_check_subset_is_the_equivalence_tests_and_nothing_slow():
    """`-m gpu_check` (the GPU check) selects the pure kernels and the magnitude properties, compiled
    ones included, and no test of the slow tier (so the check keeps its 10-minute budget). The files
    that carry the marker only: collecting the whole suite twice would cost a minute here."""
    run = _collect("gpu_check")
    assert run.returncode == 0, run.stdout + run.stderr
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    files = {i.split("::")[0] for i in ids}
    assert {"tests/test_magnitudes.py", "tests/test_pure_logprobs.py", "tests/test_pure_fused_linear.py"} <= files
    assert any("compiled" in i for i in ids) and len(ids) > 100, ids
    slow = _collect("gpu_check and slow")
    assert slow.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, slow.stdout
