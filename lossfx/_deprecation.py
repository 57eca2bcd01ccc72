"""Names renamed so that they carry the sign of `Σ p log p` (the negative entropy), docs/decisions.md.

The old name keeps its value and warns (FutureWarning) in eager mode only: under `torch.compile`
nothing is emitted, so the rename never breaks a graph.
"""

from __future__ import annotations

import warnings
from typing import Any

from lossfx._host_reads import tracing

__all__ = ["renamed_keyword", "warn_renamed"]


def warn_renamed(old_name: str, new_name: str, stacklevel: int = 3) -> None:
    """FutureWarning (eager only) that `old_name`, whose value is `Σ p log p`, is now `new_name`."""
    if not tracing():
        warnings.warn(
            f"{old_name} is deprecated: its value is Σ p log p, the NEGATIVE entropy (≤ 0); use {new_name} "
            "for the same value (the entropy is its negation)",
            FutureWarning,
            stacklevel=stacklevel,
        )


def renamed_keyword(new_name: str, new: Any, old_name: str, old: Any) -> Any:
    """The value of a renamed keyword: `old` (deprecated, same meaning) when given, with
    `warn_renamed`; `new` otherwise. Both given: TypeError."""
    if old is None:
        return new
    if new is not None and new is not False:
        raise TypeError(f"pass {new_name} only; {old_name} is its deprecated name")
    warn_renamed(old_name, new_name, stacklevel=4)
    return old
