"""Peak memory that every allocation counts in, compiled code included: a resident high-water mark.

The profiler's CPU allocation events (`measure.peak_extra_bytes`) only see allocations made through
ATen's allocator hooks; Inductor's CPU kernels allocate their buffers in ways those events miss, so a
compiled call can read as 0 bytes. The kernel's resident-set high-water mark misses nothing:

1. each figure is measured in a **fresh process** (`python -m benchmarks.rss`), so no earlier case's
   freed-but-kept heap pages or cached buffers are in the figure;
2. glibc's `MALLOC_MMAP_THRESHOLD_` is set low (64 KiB) before that process starts, so every large
   buffer is its own `mmap` and goes back to the kernel when freed (no pages parked in the heap);
3. the callable runs once (warm-up: compile, first-touch of caches) and its result is dropped;
4. writing `5` to `/proc/self/clear_refs` resets `VmHWM` to the current `VmRSS`; the callable runs
   again; the figure is `VmHWM − VmRSS` read just before that run: every byte that was resident at
   the peak beyond what existed before the call (the inputs), the returned result included.

Linux only (it reads `/proc/self/status`). A builder is `"module:function"`: `function(**kwargs)`
builds the inputs and returns the zero-argument callable to measure.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MMAP_THRESHOLD = 65536


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _measure_here(builder: str, kwargs: dict[str, Any]) -> dict[str, int]:
    import importlib

    module, function = builder.split(":")
    run = getattr(importlib.import_module(module), function)(**kwargs)
    result = run()  # warm-up: compiles, touches every page the call will use
    del result
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    result = run()
    peak = _status_kib("VmHWM")
    del result
    return {"rss_before_bytes": before * 1024, "peak_extra_bytes": (peak - before) * 1024}


def run_module_fresh(module_args: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """`python -m <module_args>` in a fresh process; returns the JSON object on its last output line.

    `env` is laid over `os.environ`. `PYTHONPATH` is the caller's first (so `PYTHONPATH=/snapshot:...`
    chooses which lossfx is measured), then this repository, so `benchmarks` is always importable.
    """
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths.append(str(Path(__file__).resolve().parent.parent))
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-m", *module_args], env=full_env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_rss_extra_bytes(builder: str, kwargs: dict[str, Any] | None = None, *, threads: int = 1) -> int:
    """Peak resident bytes of one call above what existed before it, measured in a fresh process.

    `builder` is `"module:function"`; `function(**kwargs)` (JSON-serialisable kwargs) builds the
    inputs and returns the callable to measure. See the module docstring for the method.
    """
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": str(threads)}
    result = run_module_fresh(
        ["benchmarks.rss", builder, json.dumps(kwargs or {})], env, f"peak measurement of {builder}({kwargs})"
    )
    return int(result["peak_extra_bytes"])


if __name__ == "__main__":
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(json.dumps(_measure_here(sys.argv[1], json.loads(sys.argv[2]))))
