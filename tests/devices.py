"""The device the suite builds its tensors on: `pytest --device cuda` (default: cpu).

tests/conftest.py sets `DEVICE` from the option before any test module is imported, so module-level
inputs may read it. Tests draw their inputs on the CPU (a seeded CPU generator gives the same
numbers whatever the device) and move them with `on_device(...)`; the `device` fixture is the same
device. A test that cannot follow the option (gloo processes, the CPU memory method) carries
`@pytest.mark.cpu_only("why")` and is skipped with that reason on any other device.
"""

from __future__ import annotations

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
