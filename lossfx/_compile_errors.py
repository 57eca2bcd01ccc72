"""Argument errors that keep their type and message under `torch.compile(fullgraph=True)`.

Dynamo traces a `raise` symbolically: an exception that leaves the compiled function while it is
traced becomes `torch._dynamo.exc.Unsupported: Observed exception` (with `fullgraph=True`; without
it, a graph break, then the eager call raises the real exception). So a bad argument raised
`Unsupported` instead of the `ValueError` naming it. `keep_errors_under_compile` wraps a public
function: while tracing, a `ValueError` / `TypeError` raised inside it is caught (Dynamo traces the
`except`) and raised again from `raise_while_tracing`, a `torch.compiler.assume_constant_result`
function, which Dynamo runs for real at trace time; the exception it raises is a subclass of the
original type and of Dynamo's `UserError`, which Dynamo lets through unchanged (it appends the
user's stack to the message). Good input takes the `try` branch only: no graph break, no guard.
Eager calls go straight to the function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch

__all__ = ["keep_errors_under_compile", "raise_while_tracing"]

F = TypeVar("F", bound=Callable[..., Any])
_classes: dict[str, type] = {}


def _traced_error(kind: str) -> type:
    """`ValueError` / `TypeError` that Dynamo passes through (built on first use: it imports
    `torch._dynamo`, which is loaded anyway while tracing)."""
    cls = _classes.get(kind)
    if cls is None:
        from torch._dynamo.exc import UserError, UserErrorType

        def __init__(self: Any, message: str) -> None:
            UserError.__init__(self, UserErrorType.INVALID_INPUT, message)

        base = ValueError if kind == "ValueError" else TypeError
        cls = _classes[kind] = type(kind, (base, UserError), {"__init__": __init__, "__module__": "lossfx"})
    return cls


def raise_while_tracing(kind: str, message: str) -> bool:
    """Raise `kind` (`"ValueError"` or `"TypeError"`) with `message` from real Python at trace time."""
    raise _traced_error(kind)(message)


# What `torch.compiler.assume_constant_result` does (torch 2.0 to 2.13), without importing
# torch._dynamo with lossfx (~0.3 s); tests/test_compile_errors.py pins the behaviour.
raise_while_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _reraise(err: Exception) -> NoReturn:
    raise_while_tracing(type(err).__name__ if isinstance(err, ValueError) else "TypeError", str(err))
    raise err  # not reached: Dynamo stops at the exception above


def keep_errors_under_compile(fn: F) -> F:
    """Make `fn`'s `ValueError` / `TypeError` surface as such under `torch.compile(fullgraph=True)`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as err:
            _reraise(err)

    return wrapper  # type: ignore[return-value]
