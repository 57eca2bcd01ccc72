"""Several ranks in tests: rank threads (fast, in-process) and a gloo process pool (real backend).

`thread_world(R).run(fn, *args)` calls `fn(rank, R, group, *args)` on R persistent rank threads,
each inside its own threaded process group (`torch.testing._internal.distributed.multi_threaded_pg`),
and returns the list of per-rank results. The threads and their groups live for the whole test
session, so compiled code is not recompiled for every example (a new group would be a new guard).

`gloo_pool(R).run(fn, *args)` does the same in R persistent worker processes joined by a real gloo
process group. Arguments and results cross the pipe as numpy arrays (torch's own pickler moves
storages to shared memory, which is fragile); `fn` must be importable by name (a module-level
function of an importable module).

Both restart themselves after a failure, since a rank that raised may leave the others waiting
inside a collective.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_TIMEOUT_S = float(os.environ.get("LOSSFX_TEST_RANK_TIMEOUT", "600"))

# ---------------------------------------------------------------------------------------------
# Rank threads
# ---------------------------------------------------------------------------------------------

_threaded_installed = False
_thread_worlds: dict[int, ThreadWorld] = {}
_run_lock = threading.Lock()


def _install_threaded() -> None:
    global _threaded_installed
    if _threaded_installed:
        return
    from torch.testing._internal.distributed import multi_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    multi_threaded_pg._install_threaded_pg()
    _threaded_installed = True


class RankFailure(RuntimeError):
    """A rank raised; the message carries every failing rank's traceback."""


class ThreadWorld:
    """R rank threads, each holding `dist.group.WORLD` of a threaded process group of size R."""

    def __init__(self, world_size: int):
        _install_threaded()
        self.world_size = world_size
        self.broken = False
        self._inboxes: list[queue.Queue] = [queue.Queue() for _ in range(world_size)]
        self._outbox: queue.Queue = queue.Queue()
        store = dist.HashStore()
        self._threads = [
            threading.Thread(target=self._loop, args=(rank, store), daemon=True, name=f"rank{rank}/{world_size}")
            for rank in range(world_size)
        ]
        for thread in self._threads:
            thread.start()
        for _ in range(world_size):
            rank, ok, payload = self._outbox.get(timeout=_TIMEOUT_S)
            if not ok:
                raise RankFailure(f"rank {rank} failed to start:\n{payload}")

    def _loop(self, rank: int, store: Any) -> None:
        try:
            torch.set_num_threads(1)
            dist.init_process_group("threaded", rank=rank, world_size=self.world_size, store=store)
            group = dist.group.WORLD
            # torch._dynamo.config is thread-local: raise the recompile limit in each rank thread.
            torch._dynamo.config.recompile_limit = 64
            torch._dynamo.config.accumulated_recompile_limit = 4096
            self._outbox.put((rank, True, None))
        except BaseException:
            self._outbox.put((rank, False, traceback.format_exc()))
            return
        while True:
            job = self._inboxes[rank].get()
            if job is None:
                return
            fn, args, kwargs = job
            try:
                self._outbox.put((rank, True, fn(rank, self.world_size, group, *args, **kwargs)))
            except BaseException as exc:
                self._outbox.put((rank, False, traceback.format_exc()))
                from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

                ProcessLocalGroup.exception_handle(exc)  # wake ranks blocked in a collective
                if not isinstance(exc, Exception):
                    return

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`[fn(rank, R, group, *args, **kwargs) for rank in range(R)]`, run concurrently."""
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, payload = self._outbox.get(timeout=_TIMEOUT_S)
            except queue.Empty:
                self.broken = True
                raise RankFailure(f"ranks did not answer within {_TIMEOUT_S} s") from None
            if ok:
                results[rank] = payload
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
        if failures:
            self.broken = True
            raise RankFailure("\n".join(sorted(failures)))
        return results


def thread_world(world_size: int) -> ThreadWorld:
    """The session's persistent `ThreadWorld` of this size (rebuilt after a failure)."""
    world = _thread_worlds.get(world_size)
    if world is None or world.broken:
        if world is not None:
            from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

            ProcessLocalGroup.reset()
        world = _thread_worlds[world_size] = ThreadWorld(world_size)
    return world


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, R, group, ...)` on R rank threads; world size 1 runs inline with `group=None`."""
    if world_size == 1:
        return [fn(0, 1, None, *args, **kwargs)]
    with _run_lock:
        return thread_world(world_size).run(fn, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Gloo process pool
# ---------------------------------------------------------------------------------------------


def to_wire(obj: Any) -> Any:
    """Replace every tensor in a nested structure by a numpy-backed record (bf16 goes as fp32)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        wire_dtype = torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype
        return ("__tensor__", str(t.dtype).removeprefix("torch."), t.to(wire_dtype).contiguous().numpy().copy())
    if isinstance(obj, tuple):
        return tuple(to_wire(o) for o in obj)
    if isinstance(obj, list):
        return [to_wire(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    return obj


def from_wire(obj: Any) -> Any:
    """Inverse of `to_wire`."""
    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "__tensor__":
        return torch.from_numpy(np.array(obj[2], copy=True)).to(getattr(torch, obj[1]))
    if isinstance(obj, tuple):
        return tuple(from_wire(o) for o in obj)
    if isinstance(obj, list):
        return [from_wire(o) for o in obj]
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    return obj


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world_size: int, port: int, conn: Any, paths: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path[:0] = [p for p in paths if p not in sys.path]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    torch._dynamo.config.recompile_limit = 64
    while True:
        job = conn.recv()
        if job is None:
            break
        module, name, args, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            result = fn(rank, world_size, group, *from_wire(args), **from_wire(kwargs))
            conn.send((True, to_wire(result)))
        except BaseException:
            conn.send((False, traceback.format_exc()))
            break
    dist.destroy_process_group()


PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "torch._inductor.compile_fx"]


class GlooPool:
    """R worker processes joined by one gloo process group; `run` is like `ThreadWorld.run`."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("forkserver")
        # Imported once in the fork server, not again in each new pool's ranks: a pool restarted after a
        # hang or a failing rank answers its first compiled call in ~2 s instead of ~4-7 s.
        ctx.set_forkserver_preload(PRELOAD)
        self.world_size = world_size
        self.broken = False
        port = _free_port()
        paths = [p for p in sys.path if p]
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_gloo_worker, args=(rank, world_size, port, child, paths), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        results, problems = self.answers(fn, args, kwargs)
        if problems:
            raise RankFailure("\n".join(f"--- rank {r} ---\n{p}" for r, p in problems.items()))
        return results

    def answers(
        self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, timeout: float | None = None
    ) -> tuple[list[Any], dict[int, str]]:
        """`(answers, problems)` of `fn(rank, R, group, *args, **kwargs)` on every rank within
        `timeout` seconds in all: `answers` in rank order (the ranks that answered), `problems`
        `{rank: "hang" (no answer in time), "died" (its process ended) or its traceback}`. With a
        problem the pool is closed (joined, what is left killed): the next run gets a fresh one."""
        timeout = _TIMEOUT_S if timeout is None else timeout
        job = (fn.__module__, fn.__qualname__, to_wire(args), to_wire(kwargs or {}))
        for conn in self._conns:
            conn.send(job)
        deadline = time.monotonic() + timeout
        answers, problems = [], {}
        for rank, conn in enumerate(self._conns):
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    problems[rank] = "hang"
                    continue
                ok, payload = conn.recv()
            except (EOFError, OSError):
                problems[rank] = "died"
                continue
            if ok:
                answers.append(from_wire(payload))
            else:
                problems[rank] = payload
        if problems:
            self.close()
        return answers, problems

    def close(self) -> None:
        self.broken = True
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


_gloo_pools: dict[int, GlooPool] = {}


def gloo_pool(world_size: int) -> GlooPool:
    """The session's persistent gloo pool of this size (restarted after a failure).

    Skips the calling test under `pytest --device` other than cpu: the workers exchange CPU tensors
    through a pipe and reduce them with gloo's CPU collectives, so they cannot follow the option.
    """
    import devices

    if devices.DEVICE.type != "cpu":
        import pytest

        pytest.skip(f"--device {devices.DEVICE}: gloo worker processes exchange and reduce CPU tensors")
    pool = _gloo_pools.get(world_size)
    if pool is None or pool.broken:
        pool = _gloo_pools[world_size] = GlooPool(world_size)
    return pool


def answers_in_time(fn: Callable[..., Any], *args: Any, timeout: float, world: int = 2) -> list[Any]:
    """Every rank's `fn(rank, R, group, *args)` on the gloo pool; fails the calling test on a hang
    (no answer within `timeout` seconds), a dead rank or a rank that raised."""
    answers, problems = gloo_pool(world).answers(fn, args, timeout=timeout)
    if problems:
        import pytest

        shown = {r: f"hang: no answer within {timeout:.0f} s" if p == "hang" else p for r, p in problems.items()}
        pytest.fail(f"{fn.__name__}{args}: {shown}")
    return answers


def close_all() -> None:
    for pool in _gloo_pools.values():
        pool.close()
    _gloo_pools.clear()


# ---------------------------------------------------------------------------------------------
# Compiled functions per rank
# ---------------------------------------------------------------------------------------------

_compiled: dict[tuple, tuple[Any, Callable[..., Any]]] = {}
_compiled_lock = threading.Lock()


def compiled_for_rank(rank: int, key: Any, fn: Callable[..., Any], backend: str = "inductor"):
    """`(counter, torch.compile(fn, fullgraph=True))` cached per `(rank, key, backend)`.

    Each rank thread must own its compiled function and backend object: Dynamo's cache is keyed
    by the backend, and rank threads sharing one would share graphs in which another rank's
    constants (its rank, its vocabulary offset) are baked. `counter.frame_count` counts compiles.
    """
    from torch._dynamo.testing import CompileCounterWithBackend

    with _compiled_lock:
        entry = _compiled.get((rank, key, backend))
        if entry is None:
            counter = CompileCounterWithBackend(backend)
            entry = _compiled[(rank, key, backend)] = (counter, torch.compile(fn, backend=counter, fullgraph=True))
        return entry


# ---------------------------------------------------------------------------------------------
# Tensor x context parallel sub-groups
# ---------------------------------------------------------------------------------------------

_mesh_local = threading.local()


def mesh_groups(rank: int, world: int, group: Any, tp: int) -> tuple[Any, int, Any, int]:
    """Split a world of `tp · cp` ranks into TP groups (consecutive ranks) and CP groups.

    Returns `(tp_group, tp_rank, cp_group, cp_rank)`; a size-1 dimension gets `None` and rank 0.
    Every rank of the world must call it with the same `tp` (sub-groups are created collectively,
    once per rank thread or process, and cached).
    """
    if world % tp:
        raise ValueError(f"tp={tp} does not divide world={world}")
    cp = world // tp
    if tp == world:
        return group, rank, None, 0
    if tp == 1:
        return None, 0, group, rank
    cache = getattr(_mesh_local, "groups", None)
    if cache is None:
        cache = _mesh_local.groups = {}
    key = (world, tp)
    if key not in cache:
        tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
        cp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
        cache[key] = (tp_groups, cp_groups)
    tp_groups, cp_groups = cache[key]
    return tp_groups[rank // tp], rank % tp, cp_groups[rank % tp], rank // tp


# ---------------------------------------------------------------------------------------------
# gradcheck of a function of a sharded input
# ---------------------------------------------------------------------------------------------


def sharded_gradcheck(
    fn: Callable[[torch.Tensor], Any],
    shard: torch.Tensor,
    *,
    rank: int,
    world: int,
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-4,
) -> bool:
    """Float64 gradcheck of `fn(shard)` whose value depends on every rank's shard.

    `torch.autograd.gradcheck` run on every rank at once would perturb all shards together, so
    its numerical Jacobian would mix the ranks. Here the ranks take turns: for each element of
    each rank's shard, only its owner perturbs it, while every rank calls `fn` (and so every
    collective) in lockstep. The analytic rows come from autograd on this rank's shard (the
    replicated-output convention: a rank's gradient is its own shard's). Each rank checks its own
    columns of the Jacobian; raises `AssertionError` on a mismatch, else returns True.
    """

    def flat(out: Any) -> torch.Tensor:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return torch.cat([o.reshape(-1) for o in outs if o is not None])

    base = shard.detach().to(torch.float64)
    n_out = flat(fn(base.clone())).numel()
    numeric = torch.zeros(n_out, base.numel(), dtype=torch.float64)
    for owner in range(world):
        for i in range(base.numel()):
            plus, minus = base.clone(), base.clone()
            if rank == owner:
                plus.view(-1)[i] += eps
                minus.view(-1)[i] -= eps
            column = (flat(fn(plus)) - flat(fn(minus))) / (2 * eps)
            if rank == owner:
                numeric[:, i] = column
    analytic = torch.zeros_like(numeric)
    for o in range(n_out):
        x = base.clone().requires_grad_()
        (grad,) = torch.autograd.grad(flat(fn(x))[o], x, allow_unused=True)
        if grad is not None:
            analytic[o] = grad.reshape(-1)
    torch.testing.assert_close(analytic, numeric, atol=atol, rtol=rtol)
    return True


def shard_rows(x, rank, world):
    """Rows `[r·N/R, (r+1)·N/R)` of the flattened leading dims of `x [..., H]` -> `[N/R, H]`."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0] // world
    return flat[rank * n : (rank + 1) * n]


def assert_every_rank_raises(messages: list[str | None], parts: Iterable[str]) -> None:
    """Each rank's error message (`None`: it did not raise) exists, holds every one of `parts`,
    and is the same on every rank (ranks that disagree get one error, everywhere)."""
    parts = list(parts)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        for part in parts:
            assert part in message, (rank, message)
    assert all(m == messages[0] for m in messages), "every rank raises the same error"


def value_error(call: Callable[[], Any]) -> tuple[str | None, float]:
    """`(the ValueError message of call(), or None; the seconds it took)`."""
    start = time.perf_counter()
    try:
        call()
    except ValueError as err:
        return str(err), time.perf_counter() - start
    return None, time.perf_counter() - start


def value_error_messages(calls: dict[str, Callable[[], Any]]) -> dict[str, str]:
    """`{name: the ValueError message of calls[name](), or "no error"}`, every call made."""
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


# ---------------------------------------------------------------------------------------------
# Checks shared by the boundary's tests (the fused front doors, DTensor heads, the rank checks)
# ---------------------------------------------------------------------------------------------

_F64 = torch.float64
_meshes: dict[tuple, Any] = {}


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    """This process's CPU `DeviceMesh` of `shape` (created collectively once, then cached)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), names)
    if key not in _meshes:
        _meshes[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _meshes[key]


def uneven_widths(vocab: int, world: int) -> list[int]:
    """Uneven shard widths summing to `vocab` (rank order; rank 0 takes the remainder)."""
    base = [vocab // world] * world
    base[0] += vocab - sum(base)
    return base


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, head: dict) -> torch.Tensor:
    """`c · tanh(s · (hidden @ W.T + b) / c) / T` in the inputs' dtype (`head`: softcap c,
    logit_scale s, temperature T): the logits path's input for a fused call with those options."""
    c, s, t = head["softcap"], head["logit_scale"], head["temperature"]
    return c * torch.tanh(s * (hidden @ weight.T + bias) / c) / t


def leaves(dtype: torch.dtype, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Fresh leaves of `xs` in `dtype` that require grad."""
    return [x.detach().to(dtype).requires_grad_(True) for x in xs]


def cotangents(out: dict, seed: int = 1) -> dict:
    """A seeded float64 cotangent for each output of `out` that requires grad (sorted by key)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=gen, dtype=_F64)
        for k, v in sorted(out.items())
        if isinstance(v, torch.Tensor) and v.requires_grad
    }


def grads(out: dict, cot: dict, inputs: Any, scale: float = 1.0, allow_unused: bool = False) -> tuple:
    """The gradients of `Σ_k <out[k], cot[k]> / scale` (in float64) with respect to `inputs`."""
    loss = sum((out[k].to(_F64) * g).sum() for k, g in cot.items()) / scale
    return torch.autograd.grad(loss, inputs, allow_unused=allow_unused)


def assert_dicts(got: dict, want: dict, tol: dict, what: str, dtypes: bool = True, requires_grad: bool = False) -> None:
    """The same keys, `None` where `want` has `None`, values within `tol`; with `dtypes` the same
    dtypes (and, with `requires_grad` too, the same `requires_grad`)."""
    assert set(got) == set(want), (what, set(got), set(want))
    for k in want:
        if want[k] is None:
            assert got[k] is None, (what, k)
            continue
        if dtypes:
            assert got[k].dtype == want[k].dtype, (what, k, got[k].dtype, want[k].dtype)
            if requires_grad:
                assert got[k].requires_grad == want[k].requires_grad, (what, k)
        torch.testing.assert_close(got[k].to(_F64), want[k].to(_F64), **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


def assert_head_grads(results: list, want: tuple, mode: str, tol: dict) -> None:
    """Every rank's `(dhidden, dweight, dbias)` (`results[rank][1]`) against the one-process
    float64 `want`. `mode` "tp" (the head split in rows): each rank's dhidden is the full one and
    the rows' gradients concatenate to the full ones; otherwise (the sequence load-balanced over
    the ranks, `reference.cp_shard`): dhidden is the rank's shard and the head's gradients sum."""
    from lossfx import reference

    dh, dw, db = want
    if mode == "tp":
        for rank, (_, (gh, _, _)) in enumerate(results):
            torch.testing.assert_close(gh.to(_F64), dh, **tol, msg=lambda m, r=rank: f"tp r{r} dhidden: {m}")
        torch.testing.assert_close(torch.cat([r[1][1] for r in results]).to(_F64), dw, **tol)
        torch.testing.assert_close(torch.cat([r[1][2] for r in results]).to(_F64), db, **tol)
    else:
        for rank, (_, (gh, _, _)) in enumerate(results):
            shard = reference.cp_shard(dh, rank, len(results))
            torch.testing.assert_close(gh.to(_F64), shard, **tol, msg=lambda m, r=rank: f"cp r{r} dhidden: {m}")
        torch.testing.assert_close(sum(r[1][1] for r in results).to(_F64), dw, **tol)
        torch.testing.assert_close(sum(r[1][2] for r in results).to(_F64), db, **tol)


def as_tuple(out: Any) -> tuple:
    """`out` if it is a tuple, else `(out,)`."""
    return out if isinstance(out, tuple) else (out,)


def assert_fused_call_exact(
    values: list[torch.Tensor], row_grads: list[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor, target
) -> None:
    """Each rank's `linear_token_logprobs(hidden, its rows of weight, target)` equals the float64
    reference (to 1e-10) and the rows' gradients of the summed log-probs concatenate (in rank order)
    to the reference's weight gradient: the rank checks' consistent call after a disagreement."""
    from lossfx import reference

    weight = weight.clone().requires_grad_()
    ref = reference.linear_token_logprobs(hidden, weight, target)[0]
    ref.sum().backward()
    for after in values:
        torch.testing.assert_close(after, ref.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.cat(row_grads), weight.grad, rtol=0, atol=1e-10)


def split_head_call(mode: str, rank: int, world: int, group: Any, hidden, weight, bias) -> tuple[Any, ...]:
    """This rank's `(hidden, weight, bias, head rows, group keywords)` of a fused front-door call
    (`prepare_linear_loss_input`; tests/test_docstrings.py finds its `cp_sharder=` here):
    `mode` "tp" (the head split in `uneven_widths` rows, hidden replicated), "cp" (the sequence
    load-balanced over the world, `context_parallel_group=`) or "sharder" (the same layout through
    `cp_sharder=LoadBalancedLayout`). `head rows` is the rank's row slice (all rows off "tp")."""
    import lossfx
    from lossfx import reference

    if mode == "tp":
        widths = uneven_widths(weight.shape[0], world)
        rows = slice(sum(widths[:rank]), sum(widths[: rank + 1]))
        return hidden, weight[rows], bias[rows], rows, {"vocab_parallel_group": group, "vocab_parallel_rank": rank}
    layout = {"context_parallel_group": group}
    if mode != "cp":
        layout = {"cp_sharder": lossfx.sequence_layout.LoadBalancedLayout(group)}
    return reference.cp_shard(hidden, rank, world), weight, bias, slice(None), layout
