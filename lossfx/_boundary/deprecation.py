"""Names renamed so that they carry the sign of `Σ p log p` (the negative entropy), docs/decisions.md,
and keywords renamed to the package's naming rule (`renamed_keywords`, docs/design.md "Names").

The old name keeps its value and warns (FutureWarning) in eager mode only: under `torch.compile`
nothing is emitted, so the rename never breaks a graph.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from lossfx._core.host_reads import tracing

__all__ = ["renamed_keywords", "warn_renamed"]

F = TypeVar("F", bound=Callable[..., Any])


def _warn(message: str, stacklevel: int) -> None:
    """A FutureWarning in eager mode only (`stacklevel` counted from the caller)."""
    if not tracing():
        warnings.warn(message, FutureWarning, stacklevel=stacklevel + 1)


def _signed(old_name: str, new_name: str) -> str:
    return (
        f"{old_name} is deprecated: its value is Σ p log p, the NEGATIVE entropy (≤ 0); use {new_name} "
        "for the same value (the entropy is its negation)"
    )


def warn_renamed(old_name: str, new_name: str, stacklevel: int = 3) -> None:
    """FutureWarning (eager only) that `old_name`, whose value is `Σ p log p`, is now `new_name`."""
    _warn(_signed(old_name, new_name), stacklevel)


def renamed_keywords(*, signed: bool = False, **new_name_of: str) -> Callable[[F], F]:
    """Decorator: each keyword `old=` (given as `old="new"`) is passed on as `new=`, with a
    FutureWarning in eager mode (`signed`: `warn_renamed`'s, for a former name of `Σ p log p`). Both
    given: TypeError. Put it outside `_boundary.consistency.boundary`, so that the boundary (and its
    cross-rank check) sees the new name only."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def renamed(*args: Any, **kwargs: Any) -> Any:
            for old, new in new_name_of.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}: pass {new} only; {old} is its deprecated name")
                    moved = f"{fn.__name__}({old}=) is deprecated: the same argument is now {new}="
                    _warn(_signed(old, new) if signed else moved, 2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return renamed  # type: ignore[return-value]

    return wrap
