"""`pytest --device NAME` reaches the tests (tests/devices.py), and a device the suite cannot use is
refused at start-up with a clear message."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
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


# ---------------------------------------------------------------------------------------------
# Every test follows the option unless it is cpu_only: what a test module makes inside a test is
# moved by the stand-in `torch` (devices.inputs_on_device), what it makes at import is moved by hand.
# ---------------------------------------------------------------------------------------------


def test_inside_a_test_this_module_makes_its_tensors_on_the_device(device):
    assert torch is not sys.modules["torch"] and torch.Tensor is sys.modules["torch"].Tensor
    made = [torch.randn(2), torch.zeros(2, dtype=torch.int64), torch.tensor([1.0]), torch.arange(3)]
    assert {t.device for t in made} == {device}


@pytest.mark.cpu_only("checks that a cpu_only test keeps the real torch module")
def test_a_cpu_only_test_keeps_torch_as_it_is():
    assert torch is sys.modules["torch"]


def test_the_stand_in_draws_on_the_cpu_moves_keeps_leaves_and_obeys_an_explicit_device(monkeypatch):
    """On `meta` (a device that is not the CPU, with no values): the factories' results land there,
    a `requires_grad=True` result is still a leaf, an explicit `device=` is kept; drawn with the same
    seed, the CPU numbers are those of plain torch. Modules outside the list keep their torch."""
    real = sys.modules["torch"]
    module = types.ModuleType("a_test_module")
    module.torch = real
    exec(  # a test module's code: it names no device
        "def make(seed):\n"
        "    g = torch.Generator().manual_seed(seed)\n"
        "    return torch.randn(3, generator=g), torch.ones(2, requires_grad=True), torch.zeros(1, device='cpu')\n",
        module.__dict__,
    )
    other = types.ModuleType("library")
    other.torch = real
    monkeypatch.setattr(devices, "DEVICE", real.device("meta"))
    with devices.inputs_on_device([module]):
        drawn, leaf, kept = module.make(3)
        assert other.torch is real and module.torch is not real
    assert module.torch is real
    assert (drawn.device.type, leaf.device.type, kept.device.type) == ("meta", "meta", "cpu")
    assert leaf.is_leaf and leaf.requires_grad
    monkeypatch.setattr(devices, "DEVICE", real.device("cpu"))
    with devices.inputs_on_device([module]):
        drawn = module.make(3)[0]
    assert real.equal(drawn, real.randn(3, generator=real.Generator().manual_seed(3)))


def _import_time_strays(path: Path) -> list[str]:
    """`torch.<factory>(...)` calls (no `device=`) that run when `path` is imported (module level,
    decorators, parametrize values, default arguments) and are not inside `on_device(...)` or
    `.to(DEVICE)`; and factories imported by name (`from torch import randn`), which the stand-in
    cannot replace."""
    strays: list[str] = []

    def visit(node: ast.AST, moved: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            evaluated_now = [*getattr(node, "decorator_list", []), *node.args.defaults]
            for child in [*evaluated_now, *(d for d in node.args.kw_defaults if d is not None)]:
                visit(child, moved)
            return  # the body runs inside a test, where the stand-in moves what it makes
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            strays.extend(
                [
                    f"{path.name}:{node.lineno} from torch import {a.name}"
                    for a in node.names
                    if a.name in devices.FACTORIES
                ]
            )
        if isinstance(node, ast.Call):
            f = node.func
            to_device = isinstance(f, ast.Attribute) and f.attr == "to" and any(
                isinstance(a, ast.Name) and a.id == "DEVICE" for a in node.args
            )  # fmt: skip
            moved = moved or to_device or (isinstance(f, ast.Name) and f.id == "on_device")
            named = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch"
            if not moved and named and f.attr in devices.FACTORIES:
                if not any(k.arg == "device" for k in node.keywords):
                    strays.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, moved)

    visit(ast.parse(path.read_text()), False)
    return strays


def test_no_test_module_makes_a_tensor_off_the_device_at_import():
    """The stand-in works inside tests only: a tensor a module makes at import (a constant, a
    parametrize value) must be moved by hand. Checked on the source of every module of tests/."""
    paths = [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name != "device_audit_planted.py"]
    strays = [s for path in paths for s in _import_time_strays(path)]
    assert strays == []


def test_the_import_time_check_catches_a_stray(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "import torch\nfrom devices import DEVICE, on_device\nfrom torch import zeros\n"
        "A = torch.randn(2)\nB = torch.randn(2).to(DEVICE)\nC = on_device([torch.ones(1)])\n"
        "D = torch.ones(1, device=DEVICE)\n\n"
        "@pytest.mark.parametrize('x', [torch.tensor(1.0)])\ndef test_x(x, y=torch.zeros(1)):\n    torch.randn(3)\n"
    )
    assert _import_time_strays(planted) == [
        "test_planted.py:3 from torch import zeros",
        "test_planted.py:4 torch.randn(2)",
        "test_planted.py:9 torch.tensor(1.0)",
        "test_planted.py:10 torch.zeros(1)",
    ]


@pytest.mark.slow
def test_collected_on_meta_no_test_holds_a_tensor_off_the_device():
    """The whole of tests/ collected with DEVICE = meta (conftest's audit mode): every tensor a
    non-cpu_only test's module holds at import, or gets as a parametrize value, is on meta; the
    planted module (tests/device_audit_planted.py: one stray constant, one stray parametrize value)
    is reported, so the audit can fail. Slow: it collects the whole suite (~20-45 s here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", conftest_audit(): "1"}
    files = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))]
    command = [sys.executable, "-m", "pytest", "--co", "-q", "-m", ""]
    run = subprocess.run(
        [*command, *files, "tests/device_audit_planted.py"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    strays = sorted(line for line in run.stdout.splitlines() if line.startswith("DEVICE-AUDIT"))
    assert strays == [
        "DEVICE-AUDIT device_audit_planted.STRAY: cpu",
        "DEVICE-AUDIT tests/device_audit_planted.py::test_planted[x0][x]: cpu",
    ], strays


def conftest_audit() -> str:
    import conftest

    return conftest.AUDIT
