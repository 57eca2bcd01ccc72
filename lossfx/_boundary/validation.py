"""Argument checks shared by every public function.

Static properties (types, shapes, dtypes, plain arguments) are checked always. Checks that read
tensor values run in eager mode; while `torch.compile` traces, the id range check becomes an
in-graph assertion (no graph break, no host read); the docs say which checks those are. They are also skipped for
tensors on the `meta` device, which have shapes but no values: shape-only tracing on `meta` runs
every static check and returns `meta` results of the right shapes.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Literal, overload

import torch
from torch import Tensor

from lossfx._core import host_reads as _host_reads
from lossfx._core.distributed import ProcessGroup, group_rank, group_size
from lossfx._core.host_reads import tracing

__all__ = [
    "check_floating",
    "check_group",
    "check_group_rank",
    "check_ids_in_range",
    "check_integer_ids",
    "check_positive_float",
    "check_positive_int",
    "check_tensor",
    "values_checkable",
]


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


@overload
def check_positive_float(name: str, value: object, *, allow_none: Literal[False] = False) -> float: ...
@overload
def check_positive_float(name: str, value: object, *, allow_none: bool) -> float | None: ...
def check_positive_float(name: str, value: object, *, allow_none: bool = False) -> float | None:
    """`value` as a float: `TypeError` unless a real number (not a bool), `ValueError` unless finite
    and > 0 (temperature, logit scale, soft-cap: the one check of each, wherever it is taken)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number{' or None' if allow_none else ''}, got {value!r}")
    number = float(value)
    if not 0.0 < number < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def values_checkable(*tensors: object) -> bool:
    """True when value-dependent checks may run: eager mode (not while compiling), and none of
    `tensors` is on the `meta` device (shapes without values)."""
    return not tracing() and not any(isinstance(t, Tensor) and t.is_meta for t in tensors)


def _range_key(ids: Tensor, low: int, high: object) -> tuple[object, ...]:
    return ("ids in range", ids.data_ptr(), ids.dtype, tuple(ids.shape), ids.stride(), low, high)


def check_ids_in_range(
    name: str, ids: Tensor, high: int | Callable[[], int], *, low: int = 0, column_offset: int = 0
) -> None:
    """Raise `ValueError` listing (up to 5) entries of `ids` outside `[low, high)`.

    Positions are reported in the caller's coordinates: `column_offset` is added to the last index
    (for a check of `x[..., 1:]` pass 1, so the positions name entries of `x`). The count of bad
    entries is read with the call's other host reads (`_core.host_reads.defer`); the details only on
    the error path. A check of the same ids and range earlier in the call is not repeated.
    `high` may be a function, called when the values are read (a vocabulary size that the
    call's cross-rank check reports, `_boundary.consistency.ShardWidths.size_when_read`): the ids' min and max
    are read, not a count. Traced: an in-graph assertion (`RuntimeError`, no positions shown: that
    would be a host read) with the cross-rank check's, before the call's first collective.
    """
    if tracing() and not ids.is_meta:
        top = high() if callable(high) else high
        ok = ((ids >= low) & (ids < top)).all()
        message = (
            f"lossfx: {name} must lie in [{low}, {top}); some entries do not (compiled: the positions and values "
            "are not shown; the same call run eagerly shows them)"
        )
        _host_reads.defer_traced(lambda before: assert_in_graph(ok, message, before))
        return
    if not values_checkable(ids) or ids.numel() == 0:
        return
    if _host_reads.seen(_range_key(ids, low, "V of the call" if callable(high) else high)):
        return

    def raise_if_bad(extremes: list[int]) -> None:
        top = high() if callable(high) else high
        if callable(high):
            _host_reads.seen(_range_key(ids, low, top))  # a later check against the value is done
        if extremes[0] < low or extremes[1] >= top:
            bad = (ids < low) | (ids >= top)
            index = bad.nonzero()[:5]
            if column_offset and index.shape[-1]:
                index[:, -1] += column_offset
            raise ValueError(
                f"{name} must lie in [{low}, {top}); {int(bad.sum())} entries do not, e.g. values "
                f"{ids[bad][:5].tolist()} at positions {index.tolist()}"
            )

    flat = ids.reshape(-1)
    _host_reads.defer(torch.stack([flat.min(), flat.max()]).to(torch.int64), raise_if_bad)


def assert_in_graph(ok: Tensor, messages: str | list[str], before: Tensor | None) -> Tensor | None:
    """Traced: assert each entry of the bool `ok` (0-d with one message, or `[n]` with `n`) in
    the graph, inside `lossfx::assert_agreement` (whose token the collective that sends `before`
    reads, `_core.host_reads.settle_before`), or plainly when no collective follows (`before` is
    None: returns None)."""
    oks, texts = ok.reshape(-1), [messages] if isinstance(messages, str) else messages
    if before is None:
        for one, text in zip(oks.unbind(0), texts, strict=True):
            torch._assert_async(one, text)
        return None
    return torch.ops.lossfx.assert_agreement(before.detach(), oks, _SEPARATOR.join(texts))


_SEPARATOR = "\x1f"  # between the messages of `_assert_agreement` (a custom op takes one string)


@torch.library.custom_op("lossfx::assert_agreement", mutates_args=())
def _assert_agreement(before: Tensor, agree: Tensor, messages: str) -> Tensor:
    """`_assert_async(agree[g], messages[g])` for each entry `g` (each group of the compiled
    cross-rank check, a range check), then a 0-d `False` (the token): the collective that sends
    `before` is made to read the token (`_core.host_reads.settle_before`), so it runs after the
    assertions in any order a compiler picks (a plain `_assert_async` has no output: Inductor's
    scheduler placed one after the kernel's all-gather). `before` is only read for order: the
    compiled graph computes it (the kernel's first local pass) first, and the check's round trip
    flies meanwhile. Opaque: no compiler pass moves or drops it. ~1 µs per entry on the CPU (one
    `unbind`, no host read)."""
    for ok, message in zip(agree.unbind(0), messages.split(_SEPARATOR), strict=True):
        torch._assert_async(ok, message)
    return torch.zeros((), dtype=torch.bool, device=before.device)


@_assert_agreement.register_fake
def _(before: Tensor, agree: Tensor, messages: str) -> Tensor:
    return torch.empty((), dtype=torch.bool, device=before.device)


def check_group(name: str, group: object) -> None:
    """Raise `TypeError` naming `name` unless `group` is a `ProcessGroup` or `None`."""
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup or None, got {group!r} ({type(group).__name__}); "
            "pass the group object (e.g. device_mesh.get_group('tp')), not its name"
        )


def check_group_rank(rank_arg: str, rank: object, group_arg: str, group: ProcessGroup | None) -> int:
    """Validate a rank argument (`rank_arg`, e.g. NeMo's `vocab_parallel_rank`) against a non-`None`
    group (`group_arg`) and return it; the messages name both arguments.

    Raises:
        ValueError: a group without a rank, or a rank that is not this process's rank in it.
        TypeError: a group that is not a `ProcessGroup`, a non-int rank.
    """
    if rank is None:
        raise ValueError(f"{rank_arg} must be provided when {group_arg} is provided")
    check_group(group_arg, group)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{rank_arg} must be an int, got {rank!r}")
    actual = group_rank(group)
    if rank != actual:
        raise ValueError(
            f"{rank_arg}={rank} disagrees with the rank {actual} of {group_arg} (size {group_size(group)})"
        )
    return actual
