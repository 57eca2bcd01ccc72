"""Providers timed in interleaved rounds in one process: ratios that survive a loaded machine.

    python -m benchmarks.bench_interleaved --vocab 151936 --rounds 5 \\
        --providers naive-compiled lossfx-objective lossfx-objective-compiled cce-compiled torch-linear-ce

`bench_grpo` and `bench_linear` time one provider after the other (a block of calls each), so a
change of load between blocks moves one provider's time and not the other's. Here every provider's
step (`bench_grpo.build` by default; `--module benchmarks.bench_linear` for the fused-head
benchmark, with `--dtype`) is built and warmed (compiled) first, then each round calls every
provider once, in an order rotated by one per round. Reported per provider: median wall time and
median thread CPU time (`time.thread_time`, one thread: the work done, not the time spent waiting
for a core), and the median over rounds of the per-round ratio to the baseline (the first
provider), for both clocks. Memory is not measured here (it needs a fresh process per figure: the
benchmark scripts do that). Results: `<out>/<name>.json` and `.md`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache")
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import measure


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--module", default="benchmarks.bench_grpo", help="a module with build(provider, ...)")
    parser.add_argument("--providers", nargs="+", required=True, help="the first is the baseline")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", default=None, help="passed to build() when given (bench_linear: fp32, bf16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="interleaved")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    module = importlib.import_module(args.module)
    extra = {} if args.dtype is None else {"dtype": args.dtype}
    steps = {}
    loads = [("start", _load())]
    for provider in args.providers:
        torch._dynamo.reset()
        steps[provider] = module.build(provider, tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, **extra)
        start = time.perf_counter()
        steps[provider]()  # warm-up: compiles
        print(f"built and warmed {provider} ({time.perf_counter() - start:.1f} s)", flush=True)

    def save(done: int) -> None:
        base = names[0]
        rows: list[dict[str, Any]] = []
        for p in names:
            rows.append(
                {
                    "provider": p,
                    "tokens": args.tokens,
                    "hidden": args.hidden,
                    "vocab": args.vocab,
                    "dtype": args.dtype or "fp32",
                    "wall_median_ms": round(1e3 * statistics.median(wall[p]), 1),
                    "cpu_median_ms": round(1e3 * statistics.median(cpu[p]), 1),
                    "wall_vs_base": round(statistics.median(a / b for a, b in zip(wall[p], wall[base])), 3),
                    "wall_vs_base_min": round(min(a / b for a, b in zip(wall[p], wall[base])), 3),
                    "wall_vs_base_max": round(max(a / b for a, b in zip(wall[p], wall[base])), 3),
                    "cpu_vs_base": round(statistics.median(a / b for a, b in zip(cpu[p], cpu[base])), 3),
                    "cpu_vs_base_min": round(min(a / b for a, b in zip(cpu[p], cpu[base])), 3),
                    "cpu_vs_base_max": round(max(a / b for a, b in zip(cpu[p], cpu[base])), 3),
                    "wall_s": [round(x, 3) for x in wall[p]],
                    "cpu_s": [round(x, 3) for x in cpu[p]],
                }
            )
        env = {**measure.environment(), "module": args.module, "rounds": done, "load_average": loads}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1) + "\n")
        lines = [
            f"Measured {env['date']} on {env['machine']} (CPU {env.get('cpu_model') or 'unknown'}), torch "
            f"{env['torch']}; {args.module} steps, N = {args.tokens}, H = {args.hidden}, V = {args.vocab}, "
            f"{done} interleaved rounds; load average (1, 5, 15 min) at start {loads[0][1]}, at end {loads[-1][1]}.",
            "",
            f"| provider | wall median ms | ÷ {base} (median [min, max] of rounds) | thread CPU median ms "
            f"| ÷ {base} (median [min, max]) |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['provider']} | {r['wall_median_ms']:.0f} | {r['wall_vs_base']:.3f} "
                f"[{r['wall_vs_base_min']:.3f}, {r['wall_vs_base_max']:.3f}] | {r['cpu_median_ms']:.0f} "
                f"| {r['cpu_vs_base']:.3f} [{r['cpu_vs_base_min']:.3f}, {r['cpu_vs_base_max']:.3f}] |"
            )
        (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
        if done == args.rounds:
            print("\n".join(lines))

    wall: dict[str, list[float]] = {p: [] for p in steps}
    cpu: dict[str, list[float]] = {p: [] for p in steps}
    names = list(steps)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for provider in order:
            w0, c0 = time.perf_counter(), time.thread_time()
            steps[provider]()
            wall[provider].append(time.perf_counter() - w0)
            cpu[provider].append(time.thread_time() - c0)
        loads.append((f"round {r + 1}", _load()))
        print(
            f"round {r + 1}: "
            + ", ".join(f"{p} {wall[p][-1]:.2f}/{cpu[p][-1]:.2f} s" for p in names)
            + f"  (wall/cpu; load {loads[-1][1]})",
            flush=True,
        )
        save(r + 1)  # after every round: a run cut short keeps its rounds
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
