"""Cost of the cross-rank consistency check (`lossfx/_boundary/consistency.py`) on a real gloo group.

    python -m benchmarks.bench_consistency            # 2 processes over gloo on 127.0.0.1
    python -m benchmarks.bench_consistency --world 4 --iters 400
    python -m benchmarks.bench_consistency --compiled-only --iters 100   # the compiled [4, 512, 8192] row

Per call, on every rank (medians over `--iters` calls; the whole-call rows time check-on and
check-off calls in pairs, in alternating order, each after a barrier so that no call absorbs the
rank skew left by the previous one, and report the median of the paired differences with a 95 %
distribution-free band, per rank):

- `gather`: one all-gather of the `[256]` int64 signature alone (the collective the check adds),
  and for scale the `[3, B·S]` statistics all-gather the log-prob kernel runs anyway;
- the check's Python work alone (encode the arguments, compare; no collective);
- `check`: the whole check of a `prepare_loss_input` call (build the signature from the
  arguments, the all-gather, the comparison);
- `prepare_loss_input` (`LOGPROB`, forward, tensor parallel over the group) with the check on and
  off (the entry point's `_lossfx_unchecked`: the same view and body, no check; there is no
  switch), at a tiny shape (where the fixed cost shows) and `[4, 512, 8192]`, eager and compiled
  (inductor, `fullgraph=True`; the check-off graph traces the body alone).

Prints a markdown table (rank 0's times; the paired differences of every rank, of wall time and
of the calling thread's CPU time: their gap is time spent blocked, waiting for the other rank or
for a wake-up, rather than work the check adds).
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


def _median_band(values: list[float]) -> tuple[float, float, float]:
    """`(median, low, high)`: a distribution-free 95 % confidence band of the median (the order
    statistics `n/2 ∓ 0.98·√n`, binomial with p = 1/2)."""
    ordered = sorted(values)
    n = len(ordered)
    half = int(0.98 * n**0.5) + 1
    return statistics.median(ordered), ordered[max(0, n // 2 - half)], ordered[min(n - 1, (n - 1) // 2 + half)]


def _interleaved(on, off, iters: int, barrier=None) -> tuple[tuple[float, float], tuple[float, float], tuple, tuple]:
    """`(stats of on, stats of off, paired, paired_cpu)`: per iteration one call of each, in
    alternating order (on, off, off, on, ...) so both see the same load and neither always runs
    first; `barrier()` before each timed call lines the ranks up, so a call does not absorb the
    skew the previous one left (the check's all-gather is the call's first collective: it would
    wait for the slowest rank). `paired`: the median of the per-iteration differences `on − off`
    of wall time in µs and its 95 % band; `paired_cpu`: the same of this thread's CPU time
    (`time.thread_time`: the work the check adds, without the time spent blocked in a wait)."""
    times: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    for i in range(iters):
        for j in (0, 1) if i % 2 == 0 else (1, 0):
            if barrier is not None:
                barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            (on, off)[j]()
            times[j].append(time.perf_counter() - start)
            cpu[j].append(time.thread_time() - start_cpu)
    diffs = [(a - b) * 1e6 for a, b in zip(*times, strict=True)]
    cpu_diffs = [(a - b) * 1e6 for a, b in zip(*cpu, strict=True)]
    return _stats_us(times[0]), _stats_us(times[1]), _median_band(diffs), _median_band(cpu_diffs)


def _compiled_row(rows, batch, seq, vocab, logits, data, kwargs, loss_fn, unchecked, iters, barrier) -> None:
    """The compiled (inductor, `fullgraph=True`) call with the check in its graph and without."""
    import torch

    import lossfx
    from lossfx._boundary import consistency as _consistency

    def call_step(fn, z, ids, kwargs=kwargs, mask=data["token_mask"]):
        return fn(z, {"input_ids": ids, "token_mask": mask}, loss_fn, **kwargs)[0]["next_token_logprobs"]

    entry = lossfx.prepare_loss_input
    on = torch.compile(lambda z, ids, entry=entry: call_step(entry, z, ids), fullgraph=True)
    off = torch.compile(lambda z, ids, entry=unchecked: call_step(entry, z, ids), fullgraph=True)
    ids = data["input_ids"]

    def run_on(z=logits, ids=ids, on=on):
        on(z, ids)

    def run_off(z=logits, ids=ids, off=off):
        _consistency._traced_depth[0] = 1  # traced as if nested: no check in this graph
        try:
            off(z, ids)
        finally:
            _consistency._traced_depth[0] = 0

    for _ in range(3):
        run_on()
        run_off()
    label = f"compiled (inductor) prepare_loss_input LOGPROB top-k 50 top-p 0.9 fwd, [{batch}, {seq}, {vocab}]"
    rows.append((label, *_interleaved(run_on, run_off, iters, barrier)))


def _worker(rank: int, world: int, port: int, iters: int, queue, compiled_only: bool = False) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    warnings.simplefilter("ignore")  # random ids outside the top-k: the -inf masking warning
    import torch
    import torch.distributed as dist

    import lossfx
    from lossfx._boundary import consistency as _consistency
    from lossfx._core.distributed import all_gather_stack

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    rows = []

    sig = torch.zeros(_consistency.SIGNATURE_LEN, dtype=torch.int64)
    gather = lambda: _consistency._gather_on_device(sig, group).tolist()  # noqa: E731  # one all-gather, one host read
    for _ in range(50):
        gather()
    rows.append(("gather: one [256] int64 all-gather", _stats_us(_times(gather, iters)), None))

    def barrier() -> None:
        dist.barrier(group)

    roles = lossfx.prepare_loss_input._lossfx_roles  # the parameters' parts, declared with the function
    shapes = [(2, 16, 64 * world), (4, 512, 4096 * world)]
    for batch, seq, vocab in shapes[1:] if compiled_only else shapes:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(batch, seq, vocab // world, generator=gen)
        data = {"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen), "token_mask": torch.ones(batch, seq)}
        sp = lossfx.TrainingSamplingParams(top_k=50, top_p=0.9)
        kwargs = {"vocab_parallel_rank": rank, "vocab_parallel_group": group, "sampling_params": sp}
        arguments = {"logits": logits, "data": data, "loss_fn": loss_fn, **kwargs}

        def check(arguments=arguments):
            _consistency._check("prepare_loss_input", arguments, "auto", roles)

        def call(logits=logits, data=data, kwargs=kwargs):
            lossfx.prepare_loss_input(logits, data, loss_fn, **kwargs)

        def local(arguments=arguments):  # the check's Python work: signature, assertions, the one judgement
            sig, fields = _consistency._signature("prepare_loss_input", arguments, roles=roles)
            _, how = _consistency._assertions(tuple(fields.owners), tuple(fields.tp_only), True, "auto", "")
            values = sig.expand(world, -1).reshape(-1).tolist()  # as gathered, read in the one host read
            _consistency._judged(torch.tensor(values).view(world, -1), how)[0].numpy()  # judged on the host copy

        stats = torch.zeros(3, batch * seq)

        def kernel_gather(stats=stats):  # for scale: the [3, N] all-gather every log-prob call runs
            all_gather_stack(stats, group)

        if compiled_only:
            unchecked = lossfx.prepare_loss_input._lossfx_unchecked
            _compiled_row(rows, batch, seq, vocab, logits, data, kwargs, loss_fn, unchecked, iters, barrier)
            continue
        for _ in range(5):
            check()
            call()
        label = f"the check's Python work alone (no collective), [{batch}, {seq}, {vocab}]"
        rows.append((label, _stats_us(_times(local, iters)), None))
        label = f"for scale: the kernel's own [3, B·S] fp32 statistics all-gather, [{batch}, {seq}, {vocab}]"
        rows.append((label, _stats_us(_times(kernel_gather, iters)), None))
        label = f"check of a prepare_loss_input call, [{batch}, {seq}, {vocab}]"
        rows.append((label, _stats_us(_times(check, iters)), None))
        unchecked = lossfx.prepare_loss_input._lossfx_unchecked  # the entry point without its check

        def call_unchecked(logits=logits, data=data, kwargs=kwargs, unchecked=unchecked):
            unchecked(logits, data, loss_fn, **kwargs)

        label = f"prepare_loss_input LOGPROB top-k 50 top-p 0.9 fwd, [{batch}, {seq}, {vocab}]"
        rows.append((label, *_interleaved(call, call_unchecked, iters, barrier)))
        if batch * seq >= 2048:  # compiled (inductor, fullgraph): the check is in the graph
            _compiled_row(rows, batch, seq, vocab, logits, data, kwargs, loss_fn, unchecked, iters, barrier)
    queue.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--compiled-only", action="store_true", help="only the compiled [4, 512, 8192] row")
    args = parser.parse_args()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    worker_args = (args.world, port, args.iters, queue, args.compiled_only)
    procs = [ctx.Process(target=_worker, args=(r, *worker_args)) for r in range(args.world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    print(f"world {args.world} (gloo, 127.0.0.1, 1 thread per rank), {args.iters} calls each; rank 0, then")
    print("the paired differences of every rank (barrier before each timed call, on/off order alternating)\n")
    added_header = "added: median of paired on − off, µs [95 % band]"
    cpu_header = "of which this thread's CPU time, µs [95 % band]"
    print(f"| what | median µs (check on) | p10 µs | median µs, check off | p10 µs | {added_header} | {cpu_header} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, (med, p10), *rest in per_rank[0]:
        if not rest or rest[0] is None:
            print(f"| {label} | {med:.0f} | {p10:.0f} | | | | |")
            continue
        off = rest[0]
        added = [f"r{r}: {_band(per_rank[r], label)}" for r in sorted(per_rank)]
        cpu = [f"r{r}: {_band(per_rank[r], label, cpu=True)}" for r in sorted(per_rank)]
        times = f"{med:.0f} | {p10:.0f} | {off[0]:.0f} | {off[1]:.0f}"
        print(f"| {label} | {times} | {'; '.join(added)} | {'; '.join(cpu)} |")


def _band(rows, label: str, cpu: bool = False) -> str:
    """`+d µs [lo, hi] (+x % [lo %, hi %])` of the paired differences (wall, or with `cpu` this
    thread's CPU time) of the row `label`, relative to that rank's median check-off wall time."""
    for row_label, _, *rest in rows:
        if row_label == label:
            off, wall, thread = rest
            d, lo, hi = thread if cpu else wall
            return f"{d:+.0f} [{lo:+.0f}, {hi:+.0f}] ({d / off[0]:+.1%} [{lo / off[0]:+.1%}, {hi / off[0]:+.1%}])"
    return "?"


if __name__ == "__main__":
    main()
