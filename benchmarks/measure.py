"""Timing and peak-memory measurement shared by every benchmark script (CPU and CUDA)."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
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
