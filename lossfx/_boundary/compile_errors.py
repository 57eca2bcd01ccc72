"""Argument errors that keep their type and message under `torch.compile(fullgraph=True)`.

Dynamo traces a `raise` symbolically: an exception that leaves the compiled function while it is
traced becomes `torch._dynamo.exc.Unsupported: Observed exception` (with `fullgraph=True`; without
it, a graph break, then the eager call raises the real exception). So a bad argument raised
`Unsupported` instead of the `ValueError` naming it. The boundary of every public function
(`lossfx._boundary.consistency.boundary`), while tracing, catches a `ValueError` / `TypeError` raised
inside it (Dynamo traces the `except`) and raises it again through `reraise_while_tracing` and
`raise_while_tracing`, a `torch.compiler.assume_constant_result`
function, which Dynamo runs for real at trace time; the exception it raises is a subclass of the
original type and of Dynamo's `UserError`, which Dynamo lets through unchanged (it appends the
user's stack to the message). Good input takes the `try` branch only: no graph break, no guard.
Eager calls go straight to the function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

__all__ = ["raise_while_tracing", "reraise_while_tracing"]

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


def reraise_while_tracing(err: Exception) -> NoReturn:
    """Raise `err` (a `ValueError` / `TypeError` caught while tracing) again, Dynamo-transparently."""
    raise_while_tracing(type(err).__name__ if isinstance(err, ValueError) else "TypeError", str(err))
    raise err  # not reached: Dynamo stops at the exception above
