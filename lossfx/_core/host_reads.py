"""Read once: the device→host reads of one public call, batched into one transfer.

A host read (`bool(t)`, `t.item()`, `t.tolist()`, `t.nonzero()`) waits for the device stream.
The boundary of a public call needs a few: the range checks of its ids (a count of bad entries),
the cross-rank check (the gathered signatures), the fused functions' count of active rows. Inside
the outermost public call (`outermost`) each of them is `defer`red: a small device tensor and a
handler for its values. `settle` reads every deferred tensor with ONE `tolist()` of their
concatenation, then runs the handlers in the order they were deferred (the first that raises
wins). It runs before the call's first collective (`lossfx._core.distributed`), where a kernel needs
a value on the host (`read_now`: read with the deferred ones), and when the call returns or
raises. Outside a public call (or while `torch.compile`
traces: nothing is deferred there) `defer` reads at once. A check that already ran in this call
(the same ids, the same range: nested public calls re-check what the outer one checked) is
skipped (`seen`). Dense equivalent: `for t, handler in deferred: handler(t.tolist())`.

Values that are only reported, never needed to go on (a warning's count), do not wait even for
that read: `when_landed` queues their copy to the host behind the kernels (`non_blocking`, into
pinned memory on CUDA, a device event recorded after it) and runs the handler at the first `poll`
after the event completed: at once if it has, else at the next public call's entry or exit or the
next `settle` in this thread (`poll(wait=True)` waits). CPU values are on the host already: their
handler runs at once, along the same path (no copy, no event), and the landed buffer is read as
host memory (`Tensor.numpy`), which no device op does.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch._guards
from torch import Tensor

__all__ = [
    "defer",
    "defer_traced",
    "depth",
    "end_traced",
    "nested",
    "outermost",
    "poll",
    "read_now",
    "seen",
    "settle",
    "settle_before",
    "tracing",
    "when_landed",
]

Handler = Callable[[list[int]], None]
_state = threading.local()  # .depth: public calls entered; .pending: [(tensor, handler)] or None (read at once)
# .landing: [(host buffer, event or None, handler)], copies to the host in flight (`when_landed`)
# what the code being traced deferred to its first collective (`defer_traced`); a module list, not
# `_state`: only traced code changes it (symbolically: Dynamo replays the final, empty, list)
_traced_pending: list[Callable[[Tensor | None], Tensor | None]] = []
# the token of the traced call's emitted assertions, read by each of its later collectives (`settle_before`);
# emptied when the call's trace ends (`end_traced`)
_traced_token: list[Tensor] = []


def tracing() -> bool:
    """Whether THIS thread's code is being traced (`torch.compile`, `torch.export`), not run.

    `torch.compiler.is_compiling()` alone is not that: in torch 2.13 it reads a process-wide flag,
    True while ANY thread compiles, so an eager call in another thread (a rank thread, a trainer
    beside a compiling thread) took the traced branches: no host reads and no range checks, the
    uniform shard layout assumed (log-probs off by nats with uneven shards), other chunks and so
    other collectives than its peers. Dynamo folds `is_dynamo_compiling()` to True in the code it
    traces (it is False when run); another tracer (non-strict export) is this thread's when this
    thread has a tracing context.
    """
    if torch.compiler.is_dynamo_compiling():
        return True
    return torch.compiler.is_compiling() and torch._guards.TracingContext.try_get() is not None


def depth() -> int:
    """How many public calls this thread is inside (0: none, 1: the outermost, >1: nested)."""
    if tracing():
        return 0
    return getattr(_state, "depth", 0)


def defer(values: Tensor, handler: Handler) -> None:
    """Call `handler(values.reshape(-1).tolist())`, now or at the next `settle` of this call."""
    pending = None if tracing() else getattr(_state, "pending", None)
    if pending is None:
        handler(values.reshape(-1).tolist())
    else:
        pending.append((values, handler))


def defer_traced(emit: Callable[[Tensor | None], Tensor | None]) -> None:
    """While tracing: call `emit(before)` at the next `settle_before(before)` of the traced call
    (`before` the input of its first collective), or `emit(None)` at its `end_traced` when it
    runs no collective, instead of now; otherwise `emit(None)` at once. `emit` returns a
    0-d bool `False` computed after its assertions (or `None`): the collective's input is made to
    depend on it, so no compiler pass can move the collective above them. The compiled
    cross-rank check defers its wait and assertions so: its all-gather is issued first and flies
    while the kernel computes the input of its first collective."""
    if tracing():
        _traced_pending.append(emit)
    else:
        emit(None)


def when_landed(values: Tensor, handler: Handler) -> None:
    """Call `handler(values.reshape(-1).tolist())` once the values are on the host, without
    waiting for the device: the copy is queued behind the kernels that compute `values`, and the
    handler runs at the first `poll` after it landed (CPU values: at once). For reports only (a
    warning): an error that must stop the call belongs in `defer`. Eager only."""
    flat = values.detach().reshape(-1).to(torch.int64)
    event: torch.Event | None = None
    host = flat
    if flat.device.type != "cpu":
        host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=flat.device.type == "cuda")
        host.copy_(flat, non_blocking=True)  # pageable memory (other devices): the copy waits
        event = torch.Event(device=flat.device)
        event.record()
    if getattr(_state, "landing", None) is None:
        _state.landing = []
    _state.landing.append((host, event, handler))
    poll()


def poll(wait: bool = False) -> None:
    """Run, in order, the `when_landed` handlers whose copies have landed (`wait`: all of them,
    waiting for their events). Reads host memory only: no device→host synchronisation unless
    `wait`."""
    landing = getattr(_state, "landing", None)
    while landing:
        host, event, handler = landing[0]
        if event is not None and not event.query():
            if not wait:
                return
            event.synchronize()
        landing.pop(0)
        handler(host.numpy().tolist())  # host memory: the copy has landed


@atexit.register
def _poll_at_exit() -> None:
    """A warning whose copy is still in flight when the program ends (this thread made no later
    lossfx call) is shown then, not lost."""
    with contextlib.suppress(RuntimeError):  # a device already torn down
        poll(wait=True)


def seen(key: object) -> bool:
    """Whether a check with this `key` already ran (or is deferred) in this outermost call;
    records it. Outside a public call: always False."""
    keys = None if tracing() else getattr(_state, "keys", None)
    if keys is None:
        return False
    if key in keys:
        return True
    keys.add(key)
    return False


def read_now(values: Tensor) -> list[int]:
    """`values.reshape(-1).tolist()` (as int64), read together with the deferred checks (one read)."""
    out: list[int] = []
    defer(values, out.extend)
    settle()
    return out


def settle() -> None:
    """Read every deferred tensor in one transfer and run their handlers (in order); `poll`.
    While tracing: emit what `defer_traced` deferred (into the graph, in order)."""
    if tracing():  # nothing is read while tracing
        while _traced_pending:
            _traced_pending.pop(0)(None)
        return
    poll()
    pending = getattr(_state, "pending", None)
    if not pending:
        return
    _state.pending = []  # later checks wait for the next settle of this call
    device = next((t.device for t, _ in pending if t.device.type != "cpu"), torch.device("cpu"))
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.int64) for t, _ in pending])
    values: list[int] = flat.tolist()  # the one host read
    start = 0
    for t, handler in pending:
        handler(values[start : start + t.numel()])
        start += t.numel()


def settle_before(x: Tensor) -> Tensor:
    """`settle()` before a collective that sends `x`; returns the tensor to send. Eagerly `x`.
    While tracing, what `defer_traced` deferred is emitted at the call's first collective, reading
    `x`, and this and every later collective of the traced call sends `where(token, 0, x)` (bit
    for bit `x`, differentiable) instead: a data dependency on the deferred assertions' token,
    so no compiler order can run any of the call's collectives before them."""
    if not tracing():
        settle()
        return x
    while _traced_pending:  # each reads the token of those before it: the cross-rank check's assertions first
        done = _traced_pending.pop(0)(torch.where(_traced_token[0], x.new_zeros(()), x) if _traced_token else x)
        if done is not None:
            _traced_token[:] = [done if not _traced_token else _traced_token[0] | done]
    return torch.where(_traced_token[0], x.new_zeros(()), x) if _traced_token else x


def end_traced() -> None:
    """At the end of an outermost traced call: emit what is still deferred (the call ran no
    collective) and forget the token (a later call's collectives read their own)."""
    settle()
    _traced_token.clear()


@contextlib.contextmanager
def outermost() -> Iterator[None]:
    """The scope of an outermost public call: defers until the first `settle`, settles on exit.
    On an exception the deferred checks run first: an error they find (the cause, the same on
    every rank for the cross-rank check) replaces the one it provoked. Polls on entry and exit."""
    poll()
    _state.depth, _state.pending, _state.keys = 1, [], set()
    try:
        yield
        settle()
    except Exception:
        settle()
        raise
    finally:
        _state.depth, _state.pending, _state.keys = 0, None, None
        poll()


@contextlib.contextmanager
def nested() -> Iterator[None]:
    """The scope of a public call made inside another one."""
    _state.depth = depth() + 1
    try:
        yield
    finally:
        _state.depth -= 1
