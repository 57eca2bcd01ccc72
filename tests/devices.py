"""The device the suite builds its tensors on: `pytest --device cuda` (default: cpu).

tests/conftest.py sets `DEVICE` from the option before any test module is imported, so module-level
inputs may read it. Tests draw their inputs on the CPU (a seeded CPU generator gives the same
numbers whatever the device) and move them with `on_device(...)`; the `device` fixture is the same
device. Inside a test (not at import), the test modules' own `torch.randn(...)`, `torch.zeros(...)`
and the other FACTORIES without `device=` do that by themselves (`inputs_on_device`, opened by
tests/conftest.py around every test that is not `cpu_only`). A test that cannot follow the option
(gloo processes, the CPU memory method) carries
`@pytest.mark.cpu_only("why")` and is skipped with that reason on any other device.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

DEVICE = torch.device("cpu")


def select(name: str) -> torch.device:
    """The device `--device name` names; ValueError (with the reason) when the suite cannot run there."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r} is not a torch device ({exc})") from None
    if device.type == "meta":
        raise ValueError("--device meta: meta tensors carry no values, and every test compares values")
    try:
        torch.ones(1, device=device).add(1).cpu()
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(f"--device {name!r} is not available here ({type(exc).__name__}: {exc})") from None
    return device


def on_device(obj: Any) -> Any:
    """Every tensor of a nested tuple / list / dict moved to `DEVICE` (other values as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(DEVICE)
    if isinstance(obj, tuple):
        return tuple(on_device(o) for o in obj)
    if isinstance(obj, list):
        return [on_device(o) for o in obj]
    if isinstance(obj, dict):
        return {k: on_device(v) for k, v in obj.items()}
    return obj


def stray_tensors(obj: Any, where: str, depth: int = 4) -> Iterator[str]:
    """Where (`where[...]`) a tensor off `DEVICE` sits in `obj`, looking into tuples, lists, dicts and
    namespaces down to `depth` levels."""
    if isinstance(obj, torch.Tensor):
        if obj.device != DEVICE:
            yield f"{where}: {obj.device}"
        return
    if depth == 0:
        return
    if isinstance(obj, types.SimpleNamespace):
        obj = vars(obj)
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from stray_tensors(value, f"{where}[{key!r}]", depth - 1)
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from stray_tensors(value, f"{where}[{i}]", depth - 1)


# The torch functions that make a tensor from nothing (no tensor input whose device they could follow).
FACTORIES = (
    "arange", "as_tensor", "empty", "empty_strided", "eye", "full", "linspace", "logspace", "normal",
    "ones", "rand", "randint", "randn", "randperm", "tensor", "zeros",
)  # fmt: skip


def _moved(factory: Any) -> Any:
    """`factory` drawing on the CPU (the same numbers on every device) and moving the result to `DEVICE`;
    an explicit `device=` (or `out=`) is obeyed as written. A leaf asked for (`requires_grad=True`)
    stays a leaf."""

    @functools.wraps(factory)
    def made(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs or "out" in kwargs:
            return factory(*args, **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        out = factory(*args, **kwargs).to(DEVICE)
        return out.requires_grad_(True) if requires_grad else out

    return made


@functools.cache
def _torch_moving() -> types.ModuleType:
    """A stand-in for the `torch` module: every attribute is torch's, except that the FACTORIES move
    what they make to `DEVICE` (read at each call)."""
    stand_in = types.ModuleType("torch")
    stand_in.__dict__.update(torch.__dict__)
    for name in FACTORIES:
        setattr(stand_in, name, _moved(getattr(torch, name)))
    return stand_in


@contextlib.contextmanager
def inputs_on_device(modules: Iterable[types.ModuleType]) -> Iterator[None]:
    """While it is open, the tensors that `modules` make with `torch.<factory>(...)` (no `device=`)
    are drawn on the CPU and moved to `DEVICE`: the test modules' own code follows `--device` without
    a `device=` at every call. Library code is untouched (it keeps its own `torch`), so a lossfx kernel
    that makes a tensor on the wrong device still fails."""
    stand_in = _torch_moving()
    swapped = [m for m in modules if m.__dict__.get("torch") is torch]
    for m in swapped:
        m.torch = stand_in  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in swapped:
            m.torch = torch  # type: ignore[attr-defined]
