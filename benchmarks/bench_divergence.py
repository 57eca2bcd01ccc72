"""Benchmark of the reverse KL to fixed teacher logits: lossfx against dense eager and compiled.

    python -m benchmarks.bench_divergence                    # [1, 2048, 151936] fp32 student+teacher
    python -m benchmarks.bench_divergence --quick --out /tmp/b   # tiny shape: a smoke run

Providers, measured side by side in one process, forward + backward (`torch.autograd.grad` of
`(kl * dout).sum()` with respect to the student, a fixed random `dout`):

    lossfx-eager     lossfx.reverse_kl_to_fixed (row-chunked streaming kernel)
    lossfx-compiled  the same under torch.compile(fullgraph=True, inductor)
    dense-eager      (p_s * (log_softmax(s) - log_softmax(t))).sum(-1) with plain autograd
    dense-compiled   the same dense code under torch.compile(fullgraph=True, inductor)

Reported: median and p20/p80 time, peak extra memory (bytes allocated above the inputs during
the call, a resident high-water mark in a fresh process, `benchmarks.rss`; it includes the returned
gradient, which alone is 1× the student logits), that peak as a multiple of the student logits' size, and compile time
(first call minus a warm call) for the compiled providers. Results: `<out>/divergence.{csv,json}`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lossfx", "inductor")
    )
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import lossfx
from benchmarks import measure, plots

DEFAULT_SHAPE = (1, 2048, 151_936)  # Qwen 2/3 vocabulary (benchmarks/cases.py "1x2048x151936")
QUICK_SHAPE = (2, 16, 257)


def dense_reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The dense baseline: what one writes without lossfx (fp32 compute)."""
    logp_s = student.float().log_softmax(-1)
    logp_t = teacher.float().log_softmax(-1)
    return (logp_s.exp() * (logp_s - logp_t)).sum(-1)


def lossfx_reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return lossfx.reverse_kl_to_fixed(student, teacher)


def _fwd_bwd(fn, student, teacher, dout):
    def run():
        out = fn(student, teacher)
        (grad,) = torch.autograd.grad(out, student, dout)
        return grad

    return run


PROVIDERS = {
    "lossfx-eager": lossfx_reverse_kl,
    "lossfx-compiled": torch.compile(lossfx_reverse_kl, fullgraph=True),
    "dense-eager": dense_reverse_kl,
    "dense-compiled": torch.compile(dense_reverse_kl, fullgraph=True),
}


def _inputs(shape: list[int], dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    student = (torch.randn(*shape, generator=g) * 2).to(getattr(torch, dtype)).requires_grad_()
    teacher = torch.randn(*shape, generator=g) * 2
    dout = torch.randn(*shape[:-1], generator=g)
    return student, teacher, dout


def build(provider: str, shape: list[int], dtype: str):
    """Zero-argument fwd+bwd of `provider` (the `benchmarks.rss` builder: inputs built here, seeded)."""
    return _fwd_bwd(PROVIDERS[provider], *_inputs(shape, dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, short timings (smoke run)")
    parser.add_argument("--shape", type=int, nargs=3, default=None, metavar=("B", "S", "V"))
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="student dtype (teacher fp32)"
    )
    parser.add_argument("--providers", default="lossfx-eager,lossfx-compiled,dense-eager,dense-compiled")
    parser.add_argument("--min-run-time", type=float, default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    shape = tuple(args.shape) if args.shape else (QUICK_SHAPE if args.quick else DEFAULT_SHAPE)
    min_run_time = args.min_run_time if args.min_run_time is not None else (0.05 if args.quick else 1.0)
    dtype = getattr(torch, args.dtype)

    student, teacher, dout = _inputs(list(shape), args.dtype)
    logits_bytes = student.numel() * student.element_size()
    providers = PROVIDERS
    rows = []
    env = measure.environment()
    reference_value = None
    for name in args.providers.split(","):
        run = _fwd_bwd(providers[name], student, teacher, dout)
        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        value = providers[name](student, teacher).detach()
        if reference_value is None:
            reference_value = value
        max_diff = float((value - reference_value).abs().max())
        timing = measure.time_call(run, min_run_time=min_run_time)
        peak = measure.peak_memory_bytes(
            "benchmarks.bench_divergence:build", {"provider": name, "shape": list(shape), "dtype": args.dtype}
        )
        row = {
            "op": "reverse_kl_to_fixed",
            "provider": name,
            "mode": "fwd+bwd",
            "shape": "x".join(map(str, shape)),
            "student_dtype": str(dtype).removeprefix("torch."),
            "teacher_dtype": "float32",
            **{k: round(v, 6) for k, v in timing.items()},
            "compile_s": round(first - timing["median_s"], 3) if "compiled" in name else 0.0,
            "peak_extra_bytes": peak,
            "peak_extra_x_logits": round(peak / logits_bytes, 3),
            "max_abs_diff_vs_first": max_diff,
            **env,
        }
        rows.append(row)
        print(
            f"{name:16s} median {timing['median_s']:.4f}s  "
            f"p20 {timing['p20_s']:.4f}  p80 {timing['p80_s']:.4f}  "
            f"peak extra {peak / 2**20:9.1f} MiB = {peak / logits_bytes:.3f}x logits  "
            f"compile {row['compile_s']:.1f}s  |Δ| {max_diff:.2e}",
            flush=True,
        )
    by_name = {r["provider"]: r for r in rows}
    if "dense-compiled" in by_name:
        for name in ("lossfx-eager", "lossfx-compiled"):
            if name in by_name:
                speedup = by_name["dense-compiled"]["median_s"] / by_name[name]["median_s"]
                by_name[name]["speedup_vs_dense_compiled"] = round(speedup, 3)
                print(f"{name}: {speedup:.2f}x the speed of dense-compiled")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / "divergence"
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    with open(f"{stem}.json", "w") as f:
        json.dump({"logits_bytes": logits_bytes, "results": rows}, f, indent=2)
    print(f"wrote {stem}.csv and {stem}.json")
    plots.redraw_for(stem)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
