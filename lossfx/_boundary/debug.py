"""Opt-in distributed debug mode: a timed cross-rank handshake before each public call.

Some disagreements between ranks cannot be caught by the cross-rank check (`consistency`): that
check is itself a collective over the call's group, so ranks that do not agree on *which* group
(one rank passes `group=g`, its peer none; two distinct group objects with the same ranks; a
`Replicate()` DTensor on one rank and a sharded one on the other) never meet in it, and the ranks
that entered it wait forever. Catching these needs a wait with a timeout, which is a
synchronisation point in every call: a price worth paying only while debugging. Hence a switch,
in the spirit of `TORCH_DISTRIBUTED_DEBUG`, read at call time:

* `LOSSFX_DISTRIBUTED_DEBUG=1` (or `true`, `on`, `yes`) turns it on; unset, empty, `0`, `false`,
  `off` or `no` leave it off;
* `LOSSFX_DISTRIBUTED_DEBUG_TIMEOUT` (seconds, default 300) bounds the wait for the peers.

When on, with `torch.distributed` initialised and a default group of more than one rank, every
outermost eager call of a public function that may run collectives (with a group or without)
first posts a compact description of itself to the default group's store and waits, up to the
timeout, for every rank's description of its call with the same sequence number. The description
(`_describe`): the function's name, and per argument that is a process group, a tensor, a DTensor or
`None` a short text and the ranks it ties this rank to (a group's ranks; the ranks of the mesh
dims a DTensor is not `Replicate()` on). Every rank then applies the same rules to the same
descriptions (`_judge`): every rank calls the same function, and every rank tied to a peer by an
argument describes that argument exactly as the peer does (the same group object, by its name;
the same placements on the same mesh). A disagreement raises `ValueError` on every rank, naming
each rank's description; a peer missing at the timeout raises `RuntimeError` on every rank that
arrived, naming the ranks that did not. No collective runs, so ranks that disagree about groups
still meet in the store.

The price, only when on: every rank of the default group must make the same sequence of
(outermost) lossfx calls, as `TORCH_DISTRIBUTED_DEBUG=DETAIL` requires of collectives; about five
store round trips per call. Off (the default), a call costs one environment lookup: no store
access, no collective. Under `torch.compile` the handshake is skipped (eager-only, a warning at
trace time; no graph break, no guard): a compiled call keeps its in-graph check.

The mode also checks one value that the default path trusts: the count of active rows that the
hidden-state front door defers for the fused kernel, so that it rides on the call's one host read
(`lossfx.linear_loss_input._rows_ahead`). On, the kernel reads its own count of its targets too
(one more read per kernel) and `check_deferred_count` raises `RuntimeError` if the two differ
(a wrong count would compute the wrong rows silently).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lossfx._core import host_reads as _host_reads

__all__ = ["ENV", "ENV_TIMEOUT", "before_call", "check_deferred_count", "enabled"]

ENV = "LOSSFX_DISTRIBUTED_DEBUG"
ENV_TIMEOUT = "LOSSFX_DISTRIBUTED_DEBUG_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_ON = {"1", "true", "on", "yes"}
_OFF = {"", "0", "false", "off", "no"}
_KEY = "lossfx/debug"  # the store keys' prefix


def enabled() -> bool:
    """Whether the debug mode is on (`LOSSFX_DISTRIBUTED_DEBUG`, read now)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON | _OFF:
        return value in _ON
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1/true/on/yes or 0/false/off/no")


def check_deferred_count(deferred: int, own: int) -> None:
    """The mode's cross-check of the fused kernel's count of active rows that the hidden-state front
    door deferred ahead of its one host read (`lossfx.linear_loss_input._rows_ahead`): equal to the
    count the kernel reads of its own targets (`_kernels.fused_linear.CheckedCount`, one more read)."""
    if deferred != own:
        raise RuntimeError(
            f"lossfx ({ENV}): the fused kernel was handed a count of {deferred} active rows, deferred by the "
            f"hidden-state front door, but its targets have {own} rows with an id that is not ignore_index; "
            "a wrong count computes the wrong rows. This is a lossfx bug: please report it with the call"
        )


def _timeout() -> float:
    text = os.environ.get(ENV_TIMEOUT, "").strip()
    with contextlib.suppress(ValueError):  # (not a number: raised below, as a NaN, zero or negative one is)
        if not text or float(text) > 0:
            return float(text) if text else DEFAULT_TIMEOUT_S
    raise ValueError(f"{ENV_TIMEOUT}={text!r}: expected a number of seconds > 0")


def _warn_if_compiled_and_on() -> None:
    """Run for real at trace time (a constant of the graph): tell that compiled calls skip the handshake."""
    if enabled():
        warnings.warn(
            f"{ENV} is on, but a lossfx call is being compiled: the debug handshake runs in eager calls only "
            "(the compiled call keeps its in-graph cross-rank check). To debug a hang, run the same step "
            "eagerly (e.g. TORCH_COMPILE_DISABLE=1).",
            stacklevel=2,
        )


# What `torch.compiler.assume_constant_result` sets (see `_boundary.compile_errors`)
_warn_if_compiled_and_on._dynamo_marked_constant = True  # type: ignore[attr-defined]


def before_call(name: str, sig: inspect.Signature, roles: Any, args: tuple, kwargs: dict) -> None:
    """The hook at the top of a public function's boundary (`consistency.boundary`): the handshake
    when the mode is on, the call eager and outermost, the function one that runs collectives
    (`roles` declares a group) and the default group of several ranks. A call, not a wrapper: no
    frame is added (the boundary's warnings count their `stacklevel` past it)."""
    if _host_reads.tracing():
        _warn_if_compiled_and_on()
        return
    # no collective to hang in, or off (nothing else read); nested (the outer call was handshaken); nobody to wait for
    if not (roles.tp or roles.cp or roles.cp_from) or not enabled() or _host_reads.depth() or not _world_of_many():
        return
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as err:  # its own TypeError comes after the handshake; the peers learn of it now
        _handshake(name, {"call": f"{name} (with arguments that do not bind: {err})", "args": []})
        return
    bound.apply_defaults()
    _handshake(name, _describe(name, bound.arguments, roles))


def before_integration_call(name: str, arguments: Mapping[str, Any]) -> None:
    """The same handshake for an integration's call that runs collectives of its own before lossfx's
    boundary (TRL's option all-gather, its head's `full_tensor()`): `arguments` are the ones whose
    kind (group, DTensor placement, plain tensor) every tied rank must share. Off, compiled, or a
    world of one rank: nothing is read."""
    if _host_reads.tracing() or not enabled() or not _world_of_many():
        return
    _handshake(name, _describe(name, arguments))


def _world_of_many() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# ---------------------------------------------------------------------------------------------
# What a rank says about its call
# ---------------------------------------------------------------------------------------------


def _dtensor_text(x: Any) -> tuple[str, list[int]]:
    """A DTensor's placements on its mesh (`Shard(-1)` as `Shard(ndim - 1)`); tied to the ranks of
    the mesh dims it is not `Replicate()` on (those run collectives together; an all-`Replicate()`
    DTensor runs none)."""
    mesh, ndim = x.device_mesh, max(x.dim(), 1)
    groups = {d: mesh.get_group(d) for d, placement in enumerate(x.placements) if not placement.is_replicate()}
    tied = sorted({r for group in groups.values() for r in dist.get_process_group_ranks(group)})
    shown = ", ".join(f"Shard({p.dim % ndim})" if type(p).__name__ == "Shard" else repr(p) for p in x.placements)
    names = ", ".join(f"dim {d}: group {group.group_name!r}" for d, group in groups.items())
    text = f"a DTensor ({shown}) of shape {list(x.shape)} on mesh {mesh.mesh.tolist()}" + (
        f" ({names})" if names else ""
    )
    return text, tied if len(tied) > 1 else []


def _entry(value: Any) -> tuple[str, list[int]] | None:
    """`(text, tied ranks)` of an argument the handshake compares, or None (the boundary's check compares it)."""
    if isinstance(value, dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(value)
        return f"process group {value.group_name!r} of ranks {ranks}", ranks if len(ranks) > 1 else []
    if type(value).__name__ == "DTensor":
        return _dtensor_text(value)
    if isinstance(value, Tensor):
        return "a plain tensor", []
    return ("None", []) if value is None else None


def _describe(name: str, arguments: Mapping[str, Any], roles: Any = None) -> dict[str, Any]:
    """This rank's call as the handshake compares it: `{"call": text, "args": [[label, text, tied], ...]}`;
    of a mapping argument (`data`), the DTensor columns the call reads (`Roles.reads`; all of them
    when the function that names them raises on this call, which the boundary reports after the
    handshake). `roles`: the function's `Roles` (a sharder `cp_from` stands for its `cp_group`)."""
    entries = []
    for arg, value in arguments.items():
        if roles is not None and arg == roles.cp_from and value is not None:
            arg, value = f"{arg}.cp_group", getattr(value, "cp_group", None)
        entry = _entry(value)
        if entry is not None:
            entries.append([arg, *entry])
        elif isinstance(value, Mapping):  # a plain column has no placement
            read: Any = value  # every key (also when the function naming them raises)
            if roles is not None and roles.reads and roles.reads[0] == arg:
                with contextlib.suppress(Exception):
                    read = roles.reads[1](arguments)
            dtensors = [(key, item) for key, item in value.items() if type(item).__name__ == "DTensor" and key in read]
            entries += [[f"{arg}[{key!r}]", *_dtensor_text(item)] for key, item in dtensors]
    return {"call": name, "args": entries}


# ---------------------------------------------------------------------------------------------
# The exchange and the rules
# ---------------------------------------------------------------------------------------------


def _handshake(name: str, description: dict[str, Any]) -> None:
    """Post `description` to the default group's store, wait (timed) for every rank's, judge them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    timeout = _timeout()
    n = store.add(f"{_KEY}/count/{rank}", 1)  # this rank's call number (in the store: a new group starts at 1)
    keys = [f"{_KEY}/{n}/{r}" for r in range(world)]  # each rank's description of its call n
    store.set(keys[rank], json.dumps(description))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as err:  # DistStoreError: some rank did not post its call number n in time
        missing = [r for r in range(world) if not store.check([keys[r]])]
        raise RuntimeError(
            f"lossfx.{name} ({ENV}): rank(s) {missing or '?'} of the {world} ranks did not reach lossfx call "
            f"#{n} within {timeout:g} s (rank {rank} did). Every rank must make the same sequence of lossfx calls "
            f"while {ENV} is on; a rank that called something else, stopped, or runs without {ENV} never "
            f"arrives. ({type(err).__name__}: {err})"
        ) from None
    described = [json.loads(v) for v in store.multi_get(keys)]
    if n > 1:  # every rank has read call n - 1 (each posted n after reading it): drop this rank's
        with contextlib.suppress(RuntimeError):
            store.delete_key(f"{_KEY}/{n - 1}/{rank}")
    problem = _judge(described)
    if problem is not None:
        raise ValueError(
            f"lossfx.{name} ({ENV}, call #{n}): {problem}. Without the debug mode this call waits forever in a "
            "collective that some ranks never enter (raised on every rank by the debug handshake; see docs/dtensor.md)"
        )


def _judge(described: list[dict[str, Any]]) -> str | None:
    """The first disagreement among the ranks' descriptions (the same text on every rank), or None."""
    calls = [d["call"] for d in described]
    if len(set(calls)) > 1:
        return f"the ranks make different calls ({', '.join(f'rank {r}: {c}' for r, c in enumerate(calls))})"
    texts = [{label: text for label, text, _ in d["args"]} for d in described]
    for rank, d in enumerate(described):
        for label, text, tied in d["args"]:
            if any(texts[r].get(label) != text for r in tied if r < len(described)):
                ranks = sorted({rank, *tied})
                seen = [texts[r].get(label, "no such argument") for r in ranks]
                shown = ", ".join(f"rank {r}: {t}" for r, t in zip(ranks, seen, strict=True))
                return f"the ranks tied by {label} describe it differently ({shown}){_hint(seen)}"
    return None


def _hint(seen: list[str]) -> str:
    """What to do about one argument the ranks describe as `seen`."""
    groups = [t.partition(" of ranks ")[2] for t in seen if t.startswith("process group ")]
    if len(groups) == len(seen) and len(set(groups)) == 1:
        return "; two distinct process group objects with the same ranks: pass the same group object on every rank"
    if any(t.startswith("a DTensor") for t in seen):
        return "; pass the same kind of argument (plain, or a DTensor of one placement) on every rank of the mesh"
    return "; pass the same group (or none) on every rank of it"
