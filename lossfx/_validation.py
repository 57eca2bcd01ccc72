"""Argument checks shared by every public function.

Static properties (types, shapes, dtypes, plain arguments) are checked always. Checks that read
tensor values (ids in range) run in eager mode only and are skipped while `torch.compile` traces,
so they never cause a graph break; the docs say which checks those are. They are also skipped for
tensors on the `meta` device, which have shapes but no values: shape-only tracing on `meta` runs
every static check and returns `meta` results of the right shapes.
"""

from __future__ import annotations

import numbers
from typing import Literal, overload

import torch
from torch import Tensor


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_floating(name: str, x: object) -> Tensor:
    x = check_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_integer_ids(name: str, x: object) -> Tensor:
    x = check_tensor(name, x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype}")
    return x


@overload
def check_positive_int(name: str, value: object, *, allow_none: Literal[False]) -> int: ...
@overload
def check_positive_int(name: str, value: object, *, allow_none: bool = True) -> int | None: ...
def check_positive_int(name: str, value: object, *, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def values_checkable(*tensors: object) -> bool:
    """True when value-dependent checks may run: eager mode (not while compiling), and none of
    `tensors` is on the `meta` device (shapes without values)."""
    if torch.compiler.is_compiling():
        return False
    return not any(isinstance(t, Tensor) and t.is_meta for t in tensors)


def check_ids_in_range(name: str, ids: Tensor, high: int, *, low: int = 0, column_offset: int = 0) -> None:
    """Raise `ValueError` listing (up to 5) entries of `ids` outside `[low, high)`. Eager only.

    Positions are reported in the caller's coordinates: `column_offset` is added to the last index
    (for a check of `x[..., 1:]` pass 1, so the positions name entries of `x`).
    """
    if not values_checkable(ids) or ids.numel() == 0:
        return
    bad = (ids < low) | (ids >= high)
    if bool(bad.any()):
        index = bad.nonzero()[:5]
        if column_offset and index.shape[-1]:
            index[:, -1] += column_offset
        where = index.tolist()
        values = ids[bad][:5].tolist()
        count = int(bad.sum())
        raise ValueError(
            f"{name} must lie in [{low}, {high}); {count} entries do not, e.g. values {values} at positions {where}"
        )


def check_same_leading_shape(name_a: str, a: Tensor, name_b: str, b: Tensor, ndim: int) -> None:
    """Raise `ValueError` unless `a.shape[:ndim] == b.shape[:ndim]`."""
    if tuple(a.shape[:ndim]) != tuple(b.shape[:ndim]):
        raise ValueError(
            f"{name_a} and {name_b} must agree on their first {ndim} dims; got {name_a}.shape="
            f"{tuple(a.shape)} and {name_b}.shape={tuple(b.shape)}"
        )
