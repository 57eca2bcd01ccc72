"""Cost of the cross-rank consistency check (`lossfx/_consistency.py`) on a real gloo group.

    python -m benchmarks.bench_consistency            # 2 processes over gloo on 127.0.0.1
    python -m benchmarks.bench_consistency --world 4 --iters 400

Per call, on every rank (medians over `--iters` calls, check-on and check-off calls interleaved so
both see the same machine load):

- `gather`: one all-gather of the `[256]` int64 signature alone (the collective the check adds),
  and for scale the `[3, B·S]` statistics all-gather the log-prob kernel runs anyway;
- the check's Python work alone (encode the arguments, compare; no collective);
- `check`: the whole check of a `prepare_loss_input` call (build the signature from the
  arguments, the all-gather, the comparison);
- `prepare_loss_input` (`LOGPROB`, forward, tensor parallel over the group) with the check on and
  off, at a tiny shape (where the fixed cost shows) and a moderate one.

Prints a markdown table (rank 0's numbers).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from types import SimpleNamespace


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _times(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _stats_us(times: list[float]) -> tuple[float, float]:
    """(median, 10th percentile) in µs: the percentile is the less load-sensitive of the two."""
    ordered = sorted(times)
    return statistics.median(ordered) * 1e6, ordered[len(ordered) // 10] * 1e6


def _worker(rank: int, world: int, port: int, iters: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    warnings.simplefilter("ignore")  # random ids outside the top-k: the -inf masking warning
    import torch
    import torch.distributed as dist

    import lossfx
    from lossfx import _consistency
    from lossfx._distributed import all_gather_stack

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    rows = []

    sig = torch.zeros(_consistency.SIGNATURE_LEN, dtype=torch.int64)
    for _ in range(50):
        _consistency._gather(sig, group)
    rows.append(
        ("gather: one [256] int64 all-gather", _stats_us(_times(lambda: _consistency._gather(sig, group), iters)), None)
    )

    for batch, seq, vocab in [(2, 16, 64 * world), (4, 512, 4096 * world)]:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(batch, seq, vocab // world, generator=gen)
        data = {"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen)}
        sp = lossfx.TrainingSamplingParams(top_k=50, top_p=0.9)
        kwargs = {"vocab_parallel_rank": rank, "vocab_parallel_group": group, "sampling_params": sp}
        arguments = {"logits": logits, "data": data, "loss_fn": loss_fn, **kwargs}

        def check(arguments=arguments):
            _consistency._scope.widths = {}
            _consistency._check("prepare_loss_input", arguments, "auto", "vocab_parallel_group", None)

        def call(logits=logits, data=data, kwargs=kwargs):
            lossfx.prepare_loss_input(logits, data, loss_fn, **kwargs)

        def local(arguments=arguments):  # the check's Python work: signature, and the comparison
            sig, labels = _consistency._signature("prepare_loss_input", arguments)
            own = sig.tolist()
            sigs = [own] * world
            _consistency._first_disagreement(sigs, own, labels, per_rank_header=True)
            _consistency._tiling_error(sigs, "auto")

        stats = torch.zeros(3, batch * seq)

        def kernel_gather(stats=stats):  # for scale: the [3, N] all-gather every log-prob call runs
            all_gather_stack(stats, group)

        for _ in range(5):
            check()
            call()
        label = f"the check's Python work alone (no collective), [{batch}, {seq}, {vocab}]"
        rows.append((label, _stats_us(_times(local, iters)), None))
        label = f"for scale: the kernel's own [3, B·S] fp32 statistics all-gather, [{batch}, {seq}, {vocab}]"
        rows.append((label, _stats_us(_times(kernel_gather, iters)), None))
        label = f"check of a prepare_loss_input call, [{batch}, {seq}, {vocab}]"
        rows.append((label, _stats_us(_times(check, iters)), None))
        on, off = [], []
        for i in range(iters):
            enabled = i % 2 == 0
            lossfx.set_consistency_checks(enabled)
            start = time.perf_counter()
            call()
            (on if enabled else off).append(time.perf_counter() - start)
        lossfx.set_consistency_checks(True)
        label = f"prepare_loss_input LOGPROB top-k 50 top-p 0.9 fwd, [{batch}, {seq}, {vocab}]"
        rows.append((label, _stats_us(on), _stats_us(off)))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args.iters, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"world {args.world} (gloo, 127.0.0.1, 1 thread per rank), median of {args.iters} calls, rank 0\n")
    print("| what | median µs (check on) | p10 µs | median µs, check off | p10 µs | added (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, (med, p10), off in rows:
        if off is None:
            print(f"| {label} | {med:.0f} | {p10:.0f} | | | |")
        else:
            added = f"{med - off[0]:+.0f} ({(med - off[0]) / off[0]:+.1%})"
            print(f"| {label} | {med:.0f} | {p10:.0f} | {off[0]:.0f} | {off[1]:.0f} | {added} |")


if __name__ == "__main__":
    main()
