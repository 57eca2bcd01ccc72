"""Timing and peak-memory measurement shared by every benchmark script (CPU and CUDA)."""

from __future__ import annotations

import csv
import gc
import importlib
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import benchmark as tbench

from benchmarks import plots
from benchmarks.rss import peak_rss_extra_bytes

MEMORY_METHOD = (
    "CUDA max_memory_allocated" if torch.cuda.is_available() else "resident high-water mark, fresh process (rss.py)"
)
RSS_LIMIT_EXIT = 86  # exit status of a process stopped by `guard_resident_memory`
RSS_LIMIT_MESSAGE = "resident set exceeded the guard limit of"  # printed before that exit, then the bytes


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
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) >= 2 else [times[0]] * 4
    return {"median_s": statistics.median(times), "p20_s": q[0], "p80_s": q[3]}


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes the *profiler* sees `fn()` allocate; on CPU **blind to compiled code**: do not publish.

    Kept only to document the discrepancy (benchmarks/README.md). On CPU the profiler's allocation
    events are replayed in order and the running total's maximum is taken; Inductor's CPU buffers
    never appear in those events, so a compiled call reads as (nearly) 0 bytes. Published figures use
    `benchmarks.rss.peak_rss_extra_bytes` (a resident high-water mark in a fresh process) on CPU.
    On CUDA this is `max_memory_allocated` minus the starting allocation (which does count compiled code).
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


def load_builder(builder: str) -> Callable[..., Callable[[], Any]]:
    """The function named by `"module:function"` (the form `benchmarks.rss` takes)."""
    module, function = builder.split(":")
    return getattr(importlib.import_module(module), function)


def peak_memory_bytes(builder: str, kwargs: dict[str, Any], *, fresh: bool = True) -> int:
    """Peak extra bytes of one call of `builder(**kwargs)()`: the method every published figure uses.

    CPU: `benchmarks.rss.peak_rss_extra_bytes` (resident high-water mark in a fresh process; counts
    Inductor's buffers). CUDA: the allocator's peak in this process (`peak_extra_bytes`).
    `fresh=False` (the smoke runs, `--quick` with eager providers only): the profiler's figure in this
    process (`peak_extra_bytes`, no warm-up), which saves an interpreter and a torch import (~4 s of
    CPU) per figure; blind to compiled code, never published.
    """
    if torch.cuda.is_available() or not fresh:
        return peak_extra_bytes(load_builder(builder)(**kwargs))
    return peak_rss_extra_bytes(builder, kwargs)


def random_logits(
    shape: tuple[int, ...], dtype: torch.dtype, *, seed: int, scale: float = 1.0, rows_per_step: int = 256
) -> torch.Tensor:
    """`scale * randn(shape)` in `dtype`, filled a few rows at a time (no fp32 copy of a bf16 tensor)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1, shape[-1])
    for start in range(0, flat.shape[0], rows_per_step):
        rows = flat[start : start + rows_per_step]
        rows.copy_(torch.randn(rows.shape, generator=gen).mul_(scale))
    return out


def guard_resident_memory(limit_bytes: int, *, interval_s: float = 0.005) -> None:
    """Exit this process (status 86) as soon as its resident set exceeds `limit_bytes`.

    A daemon thread polls `/proc/self/status`; a runaway case on a shared machine then fails
    alone, quickly, instead of pushing the machine into the OOM killer. Linux only.
    """

    def watch() -> None:
        while True:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:") and int(line.split()[1]) * 1024 > limit_bytes:
                    os.write(2, f"{RSS_LIMIT_MESSAGE} {limit_bytes}\n".encode())
                    os._exit(RSS_LIMIT_EXIT)
            time.sleep(interval_s)

    threading.Thread(target=watch, daemon=True).start()


def read_pass_seconds(x: torch.Tensor, *, min_run_time: float = 1.0, compiled: bool = False) -> float:
    """Median time of one streaming read of `x` (a max-reduction: ~1 load per element).

    `compiled=True` times the same reduction under `torch.compile` (Inductor's loop can be faster
    than the eager kernel, notably for bf16); the first, compiling call is not timed.
    """
    fn = torch.compile(torch.amax, fullgraph=True) if compiled else torch.amax
    return time_call(lambda: fn(x), min_run_time=min_run_time)["median_s"]


def cpu_model() -> str:
    """The CPU's model name (Linux), else ""."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def environment() -> dict[str, str]:
    """Date, machine and versions to publish beside every result."""
    import lossfx

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "machine": f"{platform.machine()} {device}, {torch.get_num_threads()} threads",
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lossfx": lossfx.__version__,
    }


def compare_providers(
    providers: dict[str, tuple[str, dict[str, Any]]],
    *,
    logits_bytes: int,
    min_run_time: float,
    common: dict[str, Any],
    baseline: str | None = None,
) -> list[dict[str, Any]]:
    """Time and measure each provider side by side, in the given order.

    A provider is `(builder, kwargs)`: `"module:function"` whose `function(**kwargs)` builds the
    inputs and returns the zero-argument callable to measure. It is built here for timing
    (`time_call`, plus the compile/first-call overhead), dropped, and its peak extra memory is
    measured in a fresh process (`peak_memory_bytes`), also as a multiple of `logits_bytes`. Rows
    also hold `common` fields and the environment; with `baseline`, `speedup_vs_<baseline>` too.
    """
    env = environment()
    rows = []
    for name, (builder, kwargs) in providers.items():
        run = load_builder(builder)(**kwargs)
        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        timing = time_call(run, min_run_time=min_run_time)
        del run
        gc.collect()
        peak = peak_memory_bytes(builder, kwargs)
        row = {
            **common,
            "provider": name,
            **{k: round(v, 6) for k, v in timing.items()},
            "first_call_overhead_s": round(max(first - timing["median_s"], 0.0), 3),
            "peak_extra_bytes": peak,
            "peak_extra_x_logits": round(peak / logits_bytes, 3),
            "memory_method": MEMORY_METHOD,
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


def write_results(stem: Path, rows: list[dict[str, Any]], meta: dict[str, Any], *, quiet: bool = False) -> None:
    """Write `rows` to `<stem>.csv` and `{**meta, "results": rows}` to `<stem>.json`."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    with open(f"{stem}.json", "w") as f:
        json.dump({**meta, "results": rows}, f, indent=2)
    if not quiet:
        print(f"wrote {stem}.csv and {stem}.json")
    plots.redraw_for(stem)  # the plots that read this file, beside it (only with matplotlib installed)
