"""Benchmark of the LOGPROB path: lossfx against a naive dense baseline and one read pass.

    python -m benchmarks.run                      # the issue's two shapes, bf16 + fp32, ~10 min
    python -m benchmarks.run --quick --out /tmp/b # tiny shapes, eager only: a smoke run (seconds)

For every case (a `[B, S, V]` shape from `benchmarks.cases`) and dtype, all providers are measured
side by side in one process, one after the other:

    lossfx-eager      lossfx.next_token_logprobs
    lossfx-compiled   the same under torch.compile(fullgraph=True)
    naive-eager       torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
    naive-compiled    the same under torch.compile(fullgraph=True)
    read-pass         torch.amax(logits): one streaming read, the bandwidth floor of the forward
                      (eager, and compiled when compiled providers run; the faster is the floor)

in the modes `fwd` (a training forward: the logits require grad, so whatever is saved for backward
is allocated) and `fwd+bwd` (that forward, then `torch.autograd.grad` with a fixed upstream
gradient). Reported: median and p20/p80 time, peak extra memory (resident bytes above what existed
before the call, measured in a fresh process per figure by `benchmarks.rss`, so compiled code's
buffers count; the logits, ids and upstream gradient exist before and are not counted),
achieved GB/s on the bytes a streaming kernel must move (fwd: one read of the logits; fwd+bwd: two
reads and one write), compile time (first call, separately), and the ratios the issue targets.
Results go to `<out>/logprob.{csv,json,md,png}`. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _preparse_threads(argv: list[str]) -> int:
    """`--threads N` read before torch is imported, so OpenMP starts with N threads."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return 1


if __name__ == "__main__":
    os.environ["OMP_NUM_THREADS"] = str(_preparse_threads(sys.argv[1:]))
    # Inductor's on-disk cache is the only compile cache that survives between runs.
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lossfx", "inductor")
    )
    if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks` importable
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import lossfx  # noqa: E402
from benchmarks import measure, plots  # noqa: E402
from benchmarks.cases import DEFAULT_CASES, QUICK_CASES, Case, get_case  # noqa: E402

READ_PASS = ("read-pass", "read-pass-compiled")
PROVIDERS = ("lossfx-eager", "lossfx-compiled", "naive-eager", "naive-compiled")
EAGER_PROVIDERS = ("lossfx-eager", "naive-eager")
MODES = ("fwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, "fp64": torch.float64}

# Targets of issue 2 ("Done when"), as (description, provider, mode, ratio column, bound).
TARGETS = (
    ("compiled fwd+bwd time <= naive compiled", "lossfx-compiled", "fwd+bwd", "time_vs_naive", 1.0),
    ("compiled fwd+bwd peak <= 0.6x naive compiled", "lossfx-compiled", "fwd+bwd", "peak_vs_naive", 0.6),
    ("eager fwd+bwd time < naive eager", "lossfx-eager", "fwd+bwd", "time_vs_naive", 1.0),
    ("eager fwd+bwd peak <= 0.5x naive eager", "lossfx-eager", "fwd+bwd", "peak_vs_naive", 0.5),
    ("compiled fwd <= 1.5x one read pass", "lossfx-compiled", "fwd", "time_vs_read_pass", 1.5),
)

CSV_FIELDS = (
    "case", "batch", "seq", "vocab", "dtype", "provider", "mode",
    "median_ms", "p20_ms", "p80_ms", "peak_extra_mb", "logits_mb", "peak_vs_logits",
    "gbps", "compile_s", "time_vs_naive", "peak_vs_naive", "time_vs_read_pass",
)  # fmt: skip


def lossfx_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The LOGPROB path under test: `[B, S, V]`, `[B, S]` -> `[B, S-1]`."""
    return lossfx.next_token_logprobs(logits, input_ids)


def naive_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The naive dense baseline: fp32 log_softmax of the whole tensor, then gather."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, S, V] fp32
    return logp[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, S-1]


def _callables(
    provider: str, logits: torch.Tensor, input_ids: torch.Tensor, grad_out: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    fn = lossfx_logprobs if provider.startswith("lossfx") else naive_logprobs
    if provider.endswith("compiled"):
        fn = torch.compile(fn, fullgraph=True)

    def fwd() -> torch.Tensor:
        return fn(logits, input_ids)

    def fwd_bwd() -> torch.Tensor:
        return torch.autograd.grad(fn(logits, input_ids), logits, grad_out)[0]

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _moved_bytes(case: Case, dtype: torch.dtype, mode: str) -> int:
    """Bytes a streaming kernel must move: fwd one read; fwd+bwd two reads and one write."""
    return case.logits_bytes(dtype) * (1 if mode == "fwd" else 3)


def _inputs(case: Case, dtype_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logits [B, S, V] requiring grad, input_ids [B, S], grad_out [B, S-1])`, seeded."""
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(case.batch, case.seq, case.vocab, generator=gen)).to(DTYPES[dtype_name])
    logits.requires_grad_(True)
    input_ids = torch.randint(0, case.vocab, (case.batch, case.seq), generator=gen)
    grad_out = torch.randn(case.batch, max(case.seq - 1, 0), generator=gen)  # the compute dtype
    return logits, input_ids, grad_out


def build_call(case: str, dtype: str, provider: str, mode: str) -> Callable[[], Any]:
    """The zero-argument call of one measurement (the `benchmarks.rss` builder: inputs built here)."""
    logits, input_ids, grad_out = _inputs(get_case(case), dtype)
    return _callables(provider, logits, input_ids, grad_out)[mode]


def bench_case(
    case: Case,
    dtype_name: str,
    providers: tuple[str, ...],
    modes: tuple[str, ...],
    min_run_time: float,
    min_runs: int = 1,
    fresh: bool = True,
) -> list[dict[str, Any]]:
    """All providers and modes for one shape and dtype, side by side; one row each.

    Times are taken in this process; each peak in a fresh one (`measure.peak_memory_bytes`; `fresh`
    False: in this process, `--quick` with eager providers only).
    """
    dtype = DTYPES[dtype_name]
    logits, input_ids, grad_out = _inputs(case, dtype_name)
    logits_mb = case.logits_bytes(dtype) / 2**20
    base = {"case": case.name, "batch": case.batch, "seq": case.seq, "vocab": case.vocab, "dtype": dtype_name}
    rows = []

    # The read-pass floor: the faster of the eager and the compiled max-reduction over the logits.
    read_times = {}
    for name, compiled in (("read-pass", False), ("read-pass-compiled", True)):
        if compiled and not any(p.endswith("compiled") for p in providers):
            continue
        torch._dynamo.reset()
        read_times[name] = measure.read_pass_seconds(logits.detach(), min_run_time=min_run_time, compiled=compiled)
    read_s = min(read_times.values())
    for name, seconds in read_times.items():
        rows.append(
            {
                **base, "provider": name, "mode": "fwd", "median_ms": 1e3 * seconds,
                "logits_mb": logits_mb, "gbps": case.logits_bytes(dtype) / seconds / 1e9,
                "time_vs_read_pass": seconds / read_s,
            }
        )  # fmt: skip
    for provider in providers:
        fns = _callables(provider, logits, input_ids, grad_out)
        compile_s = None
        if provider.endswith("compiled"):
            torch._dynamo.reset()  # an honest cold compile per case (Inductor's disk cache may hit)
            t0 = time.perf_counter()
            fns["fwd+bwd"]()  # compiles the forward and the backward graph
            compile_s = time.perf_counter() - t0
        for mode in modes:
            t = measure.time_call(fns[mode], min_run_time=min_run_time, min_runs=min_runs)
            spec = {"case": case.name, "dtype": dtype_name, "provider": provider, "mode": mode}
            peak = measure.peak_memory_bytes("benchmarks.run:build_call", spec, fresh=fresh)
            rows.append(
                {
                    **base, "provider": provider, "mode": mode,
                    "median_ms": 1e3 * t["median_s"], "p20_ms": 1e3 * t["p20_s"], "p80_ms": 1e3 * t["p80_s"],
                    "peak_extra_mb": peak / 2**20, "logits_mb": logits_mb, "peak_vs_logits": peak / 2**20 / logits_mb,
                    "gbps": _moved_bytes(case, dtype, mode) / t["median_s"] / 1e9, "compile_s": compile_s,
                    "time_vs_read_pass": t["median_s"] / read_s,
                }
            )  # fmt: skip
            print(_progress(rows[-1]), flush=True)
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """lossfx / naive time and peak memory, eager against eager, compiled against compiled."""
    index = {(r["provider"], r["mode"]): r for r in rows}
    for r in rows:
        if not r["provider"].startswith("lossfx"):
            continue
        naive = index.get((r["provider"].replace("lossfx", "naive"), r["mode"]))
        if naive is None:
            continue
        r["time_vs_naive"] = r["median_ms"] / naive["median_ms"]
        r["peak_vs_naive"] = r["peak_extra_mb"] / naive["peak_extra_mb"] if naive["peak_extra_mb"] else None


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per (case, dtype): measured ratio, bound, met or not."""
    out = []
    for r in rows:
        for desc, provider, mode, column, bound in TARGETS:
            if r["provider"] != provider or r["mode"] != mode or r.get(column) is None:
                continue
            value = r[column]
            met = value < bound if column == "time_vs_naive" and provider.endswith("eager") else value <= bound
            out.append(
                {"case": r["case"], "dtype": r["dtype"], "target": desc, "value": value, "bound": bound, "met": met}
            )
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or value == "":
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _progress(r: dict[str, Any]) -> str:
    return (
        f"{r['case']:>15} {r['dtype']:>4} {r['provider']:>15} {r['mode']:>7}: {r['median_ms']:9.2f} ms "
        f"[{r['p20_ms']:.2f}, {r['p80_ms']:.2f}]  peak +{r['peak_extra_mb']:8.1f} MiB  {r['gbps']:5.2f} GB/s"
        + (f"  compile {r['compile_s']:.1f} s" if r.get("compile_s") is not None else "")
    )


def markdown_table(rows: list[dict[str, Any]], targets: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The result table of README.md: times, memory, ratios, then the targets."""
    lines = [
        f"Measured {env['date']} on {env['machine']} ({env.get('cpu_model') or 'unknown CPU'}, "
        f"{env.get('cpu_count', '?')} cores; host `{env['host']}`), torch {env['torch']}, "
        f"Python {env['python']}, lossfx {env['lossfx']}, OMP_NUM_THREADS={env['omp_num_threads']}.",
        "",
        "| case | dtype | provider | mode | median ms [p20, p80] | GB/s | peak extra MiB (× logits) "
        "| lossfx/naive time | lossfx/naive peak | / read pass | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spread = f" [{r['p20_ms']:.1f}, {r['p80_ms']:.1f}]" if r.get("p20_ms") is not None else ""
        peak = f"{r['peak_extra_mb']:.1f} ({r['peak_vs_logits']:.2f}×)" if r.get("peak_extra_mb") is not None else ""
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['provider']} | {r['mode']} | {r['median_ms']:.1f}{spread} "
            f"| {r['gbps']:.2f} | {peak} | {_fmt(r.get('time_vs_naive'))} | {_fmt(r.get('peak_vs_naive'))} "
            f"| {_fmt(r.get('time_vs_read_pass'))} | {_fmt(r.get('compile_s'), 1)} |"
        )
    lines += ["", "| case | dtype | target | measured | bound | met |", "|---|---|---|---|---|---|"]
    for t in targets:
        lines.append(
            f"| {t['case']} | {t['dtype']} | {t['target']} | {t['value']:.2f} | {t['bound']} "
            f"| {'yes' if t['met'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, env: dict[str, Any] | None = None) -> bool:
    """Bar charts of median time and peak extra memory per (case, dtype), the run's date and machine
    (`env`, the JSON's `environment`) in the title; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'lossfx[bench]')", file=sys.stderr)
        return False
    groups = list(dict.fromkeys((r["case"], r["dtype"]) for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    modes = [m for m in MODES if any(r["mode"] == m and r["provider"] not in READ_PASS for r in rows)]
    width = 0.8 / max(1, len(providers))
    for col, (case, dtype) in enumerate(groups):
        sub = {(r["provider"], r["mode"]): r for r in rows if (r["case"], r["dtype"]) == (case, dtype)}
        panels = (("median_ms", "median time (ms)"), ("peak_extra_mb", "peak extra (MiB)"))
        for row_i, (key, label) in enumerate(panels):
            ax = axes[row_i][col]
            for k, provider in enumerate(providers):
                vals = [sub.get((provider, m), {}).get(key) or 0.0 for m in modes]
                ax.bar([i + k * width for i in range(len(modes))], vals, width, label=provider)
            floor = [sub[(p, "fwd")]["median_ms"] for p in READ_PASS if (p, "fwd") in sub]
            if key == "median_ms" and floor:
                ax.axhline(min(floor), color="k", ls="--", lw=1, label="one read pass")
            ax.set_xticks([i + width * (len(providers) - 1) / 2 for i in range(len(modes))], modes)
            ax.set_title(f"{case} {dtype}", fontsize=9)
            ax.set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    title = "LOGPROB: lossfx vs naive log_softmax+gather (CPU, side by side in one run)"
    if env:
        title += (
            f"\nmeasured {str(env.get('date', '?'))[:10]} on {env.get('cpu_model', env.get('machine', '?'))}, "
            f"{env.get('machine', '')}, torch {env.get('torch', '?')}"
        )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(rows: list[dict[str, Any]], env: dict[str, Any], config: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    targets = check_targets(rows)
    with open(out / "logprob.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    doc = {"environment": env, "config": config, "rows": rows, "targets": targets}
    (out / "logprob.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "logprob.md").write_text(markdown_table(rows, targets, env))
    if config.get("plot", True):
        plots.redraw_for(out / "logprob")  # logprob.png (`plot`) and the per-branch plot


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cases", nargs="+", help=f"case names from benchmarks/cases.py (default: {' '.join(DEFAULT_CASES)})"
    )
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all (eager only with --quick)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--min-run-time", type=float, default=1.0, help="seconds per timing (blocked_autorange)")
    p.add_argument("--min-runs", type=int, default=5, help="at least this many timed calls per timing")
    p.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads (default 1)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--render", action="store_true", help="only re-render <out>/logprob.{md,png} from its JSON")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes, eager, short timings, eager peaks by the profiler in this process: a smoke run",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.cases = args.cases or list(QUICK_CASES)
        args.providers = args.providers or list(EAGER_PROVIDERS)
        args.min_run_time = min(args.min_run_time, 0.01)
        args.min_runs = 1
    args.cases = args.cases or list(DEFAULT_CASES)
    args.providers = tuple(args.providers or PROVIDERS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:  # re-render the table and the plot of a finished run
        doc = json.loads((args.out / "logprob.json").read_text())
        (args.out / "logprob.md").write_text(markdown_table(doc["rows"], doc["targets"], doc["environment"]))
        if not args.no_plot:
            plot(doc["rows"], args.out / "logprob.png", doc.get("environment"))
        return 0
    torch.set_num_threads(args.threads)
    cases = [get_case(name) for name in args.cases]
    fresh = not args.quick or any(p.endswith("compiled") for p in args.providers)  # a smoke run: no process per peak
    env = {
        **measure.environment(),
        "cpu_count": str(os.cpu_count()),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
    }
    config = {
        "cases": args.cases, "dtypes": args.dtypes, "modes": args.modes, "providers": list(args.providers),
        "min_run_time_s": args.min_run_time,
        "min_runs": args.min_runs,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "plot": not args.no_plot,
        "fresh_peaks": fresh,
    }  # fmt: skip
    print(f"# {env}", flush=True)
    rows: list[dict[str, Any]] = []
    for case in cases:
        for dtype_name in args.dtypes:
            rows += bench_case(
                case, dtype_name, args.providers, tuple(args.modes), args.min_run_time, args.min_runs, fresh
            )
            write_results(rows, env, config, args.out)  # after each group: a cut-short run keeps its rows
    print(markdown_table(rows, check_targets(rows), env))
    print(f"results written to {args.out}/logprob.{{csv,json,md{'' if args.no_plot else ',png'}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
