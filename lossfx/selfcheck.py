"""Self-check: compile a tensor-parallel training step with lossfx on CPU and compare with the reference.

    python -m lossfx.selfcheck [--world-size 2] [--dtypes float64,float32] [--backend inductor]

Starts `world_size` gloo processes. Each holds a vocabulary shard `W_r [V/R, H]` of a tiny LM head
and compiles (`torch.compile(fullgraph=True)`) a training step:

    logits_r = hidden @ W_r.T                                    # [B, S, V/R]
    lp = prepare_loss_input(logits_r, data, loss_fn, rank, group)["next_token_logprobs"]
    loss = -(lp * mask).sum() / mask.sum();  loss.backward()     # dW_r, dhidden

The same step runs densely in float64 through `lossfx.reference` (full `W`), and the log-probs,
the loss and both gradients are compared. It prints one row per (dtype, rank) and exits non-zero
on any mismatch, a graph break, or an unexpected recompile.

The ranks meet over TCP on 127.0.0.1. Without a usable loopback network (e.g. a network
namespace whose `lo` is down) it exits with status 2 and says so at once, and a rendezvous that
does not complete fails after `--rendezvous-timeout` seconds (default 30) instead of torch's
30-minute default.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from types import SimpleNamespace

# Match the test-suite: one OpenMP thread per rank process keeps gloo workers from starving.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lossfx
from lossfx import reference

LOOPBACK = "127.0.0.1"
NO_NETWORK_EXIT = 2

# Tolerances against the float64 reference; fp32 bounds are ~100× fp32 epsilon at these sizes.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _problem(dtype: torch.dtype, seq: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch, hidden, vocab = 3, 16, 96
    h = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = (torch.rand(batch, seq, generator=gen) > 0.2).to(torch.float64)
    return h.to(dtype), w.to(dtype), ids, mask.to(dtype)


def _loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask[:, 1:].to(logprobs.dtype)
    return -(logprobs * m).sum() / m.sum().clamp_min(1)


def _reference(dtype: torch.dtype, seq: int) -> dict[str, torch.Tensor]:
    h, w, ids, mask = _problem(dtype, seq)
    h64 = h.to(torch.float64).requires_grad_()
    w64 = w.to(torch.float64).requires_grad_()
    loss_fn = SimpleNamespace(input_type="logprob")
    lp = reference.prepare_loss_input(h64 @ w64.T, {"input_ids": ids}, loss_fn)["next_token_logprobs"]
    loss = _loss(lp, mask)
    loss.backward()
    return {"logprobs": lp.detach(), "loss": loss.detach(), "dhidden": h64.grad, "dweight": w64.grad}


def _worker(
    rank: int, world: int, port: int, dtypes: list[str], backend: str, queue, rendezvous_s: float = 30.0
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{LOOPBACK}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=rendezvous_s),
        )
    except Exception as exc:  # report why, never retry for torch's default 30 minutes
        queue.put((rank, [], f"the gloo rendezvous on {LOOPBACK}:{port} failed within {rendezvous_s:g} s: {exc!r}"))
        return
    group = dist.group.WORLD
    from torch._dynamo.testing import CompileCounterWithBackend  # Dynamo (~2 s to import) only where ranks compile

    rows = []
    try:
        for name in dtypes:
            dtype = getattr(torch, name)
            counter = CompileCounterWithBackend(backend)
            loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)

            def step(hidden, weight, data, mask, loss_fn=loss_fn):
                out, _ = lossfx.prepare_loss_input(
                    hidden @ weight.T, data, loss_fn, vocab_parallel_rank=rank, vocab_parallel_group=group
                )
                lp = out["next_token_logprobs"]
                return lp, _loss(lp, mask)

            compiled = torch.compile(step, backend=counter, fullgraph=True)
            for seq in (12, 20, 28):  # the 2nd length may recompile once (dynamic), the 3rd must not
                h, w, ids, mask = _problem(dtype, seq)
                vl = w.shape[0] // world
                h = h.clone().requires_grad_()
                w_shard = w[rank * vl : (rank + 1) * vl].clone().requires_grad_()
                start = time.perf_counter()
                lp, loss = compiled(h, w_shard, {"input_ids": ids}, mask)
                loss.backward()
                seconds = time.perf_counter() - start
                ref = _reference(dtype, seq)
                # dhidden: each rank's contribution is the gradient through its own shard; the sum
                # over ranks (what a TP linear layer all-reduces) is the full gradient.
                dhidden = h.grad.to(torch.float64)
                dist.all_reduce(dhidden, group=group)
                errors = {
                    "logprobs": (lp.detach().double() - ref["logprobs"]).abs().max().item(),
                    "loss": (loss.detach().double() - ref["loss"]).abs().item(),
                    "dweight": (w_shard.grad.double() - ref["dweight"][rank * vl : (rank + 1) * vl]).abs().max().item(),
                    "dhidden": (dhidden - ref["dhidden"]).abs().max().item(),
                }
                rows.append((name, rank, seq, counter.frame_count, seconds, errors))
        queue.put((rank, rows, None))
    except Exception as exc:  # report, never hang the parent
        queue.put((rank, rows, f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_error(timeout_s: float = 5.0) -> str | None:
    """`None` if this process can open a TCP connection to itself on 127.0.0.1 within
    `timeout_s`, else the reason (the ranks of the self-check rendezvous there)."""
    try:
        with socket.socket() as server:
            server.bind((LOOPBACK, 0))
            server.listen(1)
            with socket.create_connection(server.getsockname()[:2], timeout=timeout_s):
                pass
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _collect(procs: list, queue, deadline_s: float) -> tuple[list, list[str]]:
    """Every rank's `(rows, error)`; a rank that dies without reporting, or no answer within
    `deadline_s`, is a failure (never a wait on a rank that is gone)."""
    results: list = []
    failures: list[str] = []
    pending = set(range(len(procs)))
    end = time.monotonic() + deadline_s
    while pending and time.monotonic() < end:
        try:
            rank, rows, error = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r in pending if procs[r].exitcode not in (None, 0)]
            for r in dead:
                failures.append(f"rank {r}: exited with status {procs[r].exitcode} without a result")
                pending.discard(r)
            continue
        pending.discard(rank)
        results.extend(rows)
        if error:
            failures.append(f"rank {rank}: {error}")
    failures += [f"rank {r}: no result within {deadline_s:g} s" for r in sorted(pending)]
    return results, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    parser.add_argument(
        "--rendezvous-timeout", type=float, default=30.0, help="seconds for the ranks to meet on 127.0.0.1"
    )
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for name in dtypes:
        if not isinstance(getattr(torch, name, None), torch.dtype):
            parser.error(f"--dtypes: unknown dtype {name!r}")
    if args.world_size < 1 or 96 % args.world_size:
        parser.error(f"--world-size must divide the vocabulary (96), got {args.world_size}")

    print(f"lossfx self-check: torch {torch.__version__}, {args.world_size} gloo ranks, backend={args.backend}")
    why = loopback_error()
    if why is not None:
        print(
            f"lossfx self-check: no loopback network: a TCP connection to {LOOPBACK} failed ({why}). The self-check "
            f"runs its {args.world_size} ranks as local processes that meet over gloo on {LOOPBACK}; bring the "
            "loopback interface up (`ip link set lo up`) or run it where one is available.\nSELF-CHECK FAILED",
            file=sys.stderr,
        )
        return NO_NETWORK_EXIT
    print("compiling a TP training step (first inductor compile takes ~20 s) ...", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, args.world_size, port, dtypes, args.backend, queue, args.rendezvous_timeout)
        )
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    results, failures = _collect(procs, queue, deadline_s=900.0)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():  # a rank stuck in a collective after another failed
            p.kill()

    header = f"{'dtype':9} {'rank':>4} {'S':>3} {'compiles':>8} {'step s':>7}  " + "  ".join(
        f"{k:>10}" for k in ("|Δ logprob|", "|Δ loss|", "|Δ dW|", "|Δ dh|")
    )
    print(header)
    print("-" * len(header))
    ok = not failures
    for name, rank, seq, compiles, seconds, errors in sorted(results):
        tol = TOLERANCE[getattr(torch, name)]
        bad = [k for k, v in errors.items() if not v <= tol]
        # one compile, plus at most one recompile when the sequence length first changes
        if compiles > 2:
            bad.append("recompiles")
        ok &= not bad
        cells = "  ".join(f"{v:>10.2e}" for v in errors.values())
        verdict = "FAIL " + ",".join(bad) if bad else "ok"
        print(f"{name:9} {rank:>4} {seq:>3} {compiles:>8} {seconds:>7.2f}  {cells}  {verdict}")
    for f in failures:
        print(f, file=sys.stderr)
    print(f"tolerances vs float64 reference: { {str(k).removeprefix('torch.'): v for k, v in TOLERANCE.items()} }")
    print("SELF-CHECK PASSED" if ok else "SELF-CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
