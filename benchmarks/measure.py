"""Timing and peak-memory measurement shared by every benchmark script (CPU and CUDA)."""

from __future__ import annotations

import csv
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark as tbench


def time_call(fn: Callable[[], Any], *, min_run_time: float = 1.0, min_runs: int = 1) -> dict[str, float]:
    """Median, p20 and p80 seconds of `fn()` (warm), via `torch.utils.benchmark.Timer`.

    `min_runs`: at least this many timed calls (slow calls would otherwise give one sample).
    """
    fn()  # warm-up (and compile, for compiled callables)
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time)
    times = list(m.times)
    while len(times) < min_runs:
        times += timer.timeit(number=1).times
    times.sort()
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return {"median_s": statistics.median(times), "p20_s": q[0], "p80_s": q[3]}


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated by `fn()` above what was allocated before it (exact on CPU and CUDA).

    On CUDA this is `max_memory_allocated` minus the starting allocation. On CPU the profiler's
    allocation events are replayed in order and the running total's maximum is taken.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def read_pass_seconds(x: torch.Tensor, *, min_run_time: float = 1.0, compiled: bool = False) -> float:
    """Median time of one streaming read of `x` (a max-reduction: ~1 load per element).

    `compiled=True` times the same reduction under `torch.compile` (Inductor's loop can be faster
    than the eager kernel, notably for bf16); the first, compiling call is not timed.
    """
    fn = torch.compile(torch.amax, fullgraph=True) if compiled else torch.amax
    return time_call(lambda: fn(x), min_run_time=min_run_time)["median_s"]


def environment() -> dict[str, str]:
    """Date, machine and versions to publish beside every result."""
    import lossfx

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "machine": f"{platform.machine()} {device}, {torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lossfx": lossfx.__version__,
    }


def compare_providers(
    providers: dict[str, Callable[[], Any]],
    *,
    logits_bytes: int,
    min_run_time: float,
    common: dict[str, Any],
    baseline: str | None = None,
) -> list[dict[str, Any]]:
    """Time and measure each provider's `run()` side by side, in the given order.

    Each row holds the timing (`time_call`), the compile/first-call overhead, the peak extra bytes
    (`peak_extra_bytes`) and that peak as a multiple of `logits_bytes`, plus `common` fields and
    the environment. With `baseline`, every row also gets `speedup_vs_<baseline>`.
    """
    env = environment()
    rows = []
    for name, run in providers.items():
        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        timing = time_call(run, min_run_time=min_run_time)
        peak = peak_extra_bytes(run)
        row = {
            **common,
            "provider": name,
            **{k: round(v, 6) for k, v in timing.items()},
            "first_call_overhead_s": round(max(first - timing["median_s"], 0.0), 3),
            "peak_extra_bytes": peak,
            "peak_extra_x_logits": round(peak / logits_bytes, 3),
            **env,
        }
        rows.append(row)
        print(
            f"{name:22s} median {timing['median_s']:.4f}s  p20 {timing['p20_s']:.4f}  p80 {timing['p80_s']:.4f}  "
            f"peak extra {peak / 2**20:9.1f} MiB = {peak / logits_bytes:.3f}x logits",
            flush=True,
        )
    if baseline is not None:
        base = next(r for r in rows if r["provider"] == baseline)["median_s"]
        for row in rows:
            row[f"speedup_vs_{baseline}"] = round(base / row["median_s"], 3)
            print(f"{row['provider']:22s} {base / row['median_s']:.2f}x the speed of {baseline}")
    return rows


def write_results(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write `rows` to `<stem>.csv` and `{**meta, "results": rows}` to `<stem>.json`."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    with open(f"{stem}.json", "w") as f:
        json.dump({**meta, "results": rows}, f, indent=2)
    print(f"wrote {stem}.csv and {stem}.json")
