"""The GPU benchmark: lossfx's paths timed at realistic shapes, then the GRPO step against peers.

    python -m pytest --device cuda -m gpu_check && python -m benchmarks.gpu --out /tmp/gpu   # the GPU check
    python -m benchmarks.gpu --quick                 # fewer shapes and repetitions
    python -m benchmarks.gpu --smoke                 # tiny shapes on the CPU (automatic without CUDA)

The accuracy checks live in the test suite (`pytest --device cuda -m gpu_check`: every path against
the float64 reference, docs/testing.md); this script only times. Sections (each prints its elapsed
time and stops starting new work past its budget):

1. **paths**: every path of the suite's call table (tests/call_table.py: the logits paths and the
   fused LM-head paths, the same calls the suite checks), eager, forward + backward to the logits
   (hidden states and head), against the dense torch formula the suite compares with (its
   baseline): median time (CUDA events) and peak memory above what existed before the call.
2. **bench**: one GRPO loss step `Σ c·log p(t)` from hidden states `[N, H]` and an LM head `[V, H]`
   (bf16, `c = −A/N`), forward + backward to `dhidden`, `dweight`, per provider (benchmarks/_linear_builders.py):
   time (CUDA events, warm-up, median of several calls) and peak memory (`max_memory_allocated`
   above what existed before the call; the returned gradients included). Peers that are not
   installed or have no kernel for the device are skipped with the reason.

Results: stdout; with `--out DIR` also `DIR/gpu.json` and `DIR/gpu.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lossfx", "inductor")
    )
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# the call table is the test suite's (tests/ is no package: its modules import each other by name)
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from call_table import LINEAR_PATHS, LOGITS_PATHS, TOKEN_PATHS, linear_torch, path_loss, token_torch
from torch import Tensor

from benchmarks import _linear_builders as builders
from benchmarks import measure
from lossfx._core.numerics import compute_dtype


@dataclasses.dataclass(frozen=True)
class Config:
    """Shapes and budgets of one run."""

    rows: int  # paths: logits [rows, vocab], hidden states [rows, hidden]
    vocab: int
    hidden: int
    topk_ids: int  # K of the distillation paths
    top_k: int
    top_p: float
    paths_reps: int
    paths_budget_s: float
    bench_shapes: tuple[tuple[int, int, int], ...]  # (N, H, V)
    bench_reps: int
    bench_budget_s: float


FULL = Config(4096, 151_936, 4096, 64, 50, 0.9, 5, 90.0,
              ((8192, 4096, 151_936), (16384, 4096, 151_936), (8192, 4096, 32_000), (16384, 4096, 32_000)),
              5, 130.0)  # fmt: skip
QUICK = Config(2048, 32_000, 1024, 16, 50, 0.9, 3, 60.0, ((8192, 4096, 151_936), (8192, 4096, 32_000)), 3, 80.0)
SMOKE = Config(16, 67, 16, 4, 20, 0.8, 1, 600.0, ((64, 16, 67),), 1, 600.0)
DTYPE = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Section 1: the suite's call table, timed
# ---------------------------------------------------------------------------------------------


def path_names() -> list[str]:
    """Every timed path: token and gather log-probs, the other logits paths, then the fused head's
    (`linear_` + its name)."""
    return [f"{name}_logprobs" for name in TOKEN_PATHS] + list(LOGITS_PATHS) + [f"linear_{n}" for n in LINEAR_PATHS]


def _logits_steps(name: str, cfg: Config, device: torch.device, gen: torch.Generator):
    """(lossfx step, torch step) of one logits path: forward + backward to the student logits."""
    path = LOGITS_PATHS[name]
    n, v, k = cfg.rows, cfg.vocab, cfg.topk_ids

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 3).to(DTYPE)

    x = randn(n, v)
    xt = randn(n, v) if path.teacher == "vocab" else randn(n, k) if path.teacher == "topk" else None
    aux = {
        "target": torch.randint(0, v, (n,), generator=gen, device=device),
        "topk_ids": torch.rand(n, v, generator=gen, device=device).topk(k, dim=-1).indices,  # distinct per row
        "cu": [0, n // 3, n],
        "top_k": cfg.top_k,
        "top_p": cfg.top_p,
    }
    cdtype = compute_dtype(DTYPE)

    def step(call, logits, teacher):
        def run():
            leaf = logits.detach().requires_grad_(True)
            outs = call(leaf, teacher)
            douts = [torch.ones_like(o) if o.requires_grad else None for o in outs]
            (grad,) = torch.autograd.grad(path_loss(outs, douts), leaf)
            return grad

        return run

    ours = step(lambda z, t: path.call(z, t, aux, None, 0, None), x, xt)
    dense = step(lambda z, t: path.torch(z, t, aux), x.to(cdtype), None if xt is None else xt.to(cdtype))
    return ours, dense


def _token_steps(name: str, cfg: Config, device: torch.device, gen: torch.Generator):
    """(lossfx step, torch step) of token or gather log-probs (with Σ p log p): forward + backward."""
    call = TOKEN_PATHS[name.removesuffix("_logprobs")]
    n, v, k = cfg.rows, cfg.vocab, cfg.topk_ids
    x = (torch.randn(n, v, generator=gen, device=device) * 3).to(DTYPE)
    ids = torch.randint(0, v, (n, k if name.startswith("gather") else 1), generator=gen, device=device)
    dout = torch.randn(ids.shape, generator=gen, device=device)
    dneg = torch.randn(n, generator=gen, device=device) if name.startswith("gather") else torch.zeros(n, device=device)

    def ours():
        leaf = x.detach().requires_grad_(True)
        return torch.autograd.grad(call(leaf, ids, dout, dneg, None, None)[2], leaf)

    return ours, lambda: token_torch(x, ids, dout, dneg)[2]


def _linear_steps(name: str, cfg: Config, device: torch.device, gen: torch.Generator):
    """(lossfx step, torch step) of one fused-head path: forward + backward to hidden and head."""
    call, entropy, k = LINEAR_PATHS[name.removeprefix("linear_")]
    n, v, hs = cfg.rows, cfg.vocab, cfg.hidden
    hidden = torch.randn(n, hs, generator=gen, device=device).to(DTYPE)
    weight = (torch.randn(v, hs, generator=gen, device=device) / hs**0.5 * 3).to(DTYPE)
    ids = torch.randint(0, v, (n, k), generator=gen, device=device)
    dout = torch.randn(n, k, generator=gen, device=device)
    dneg = torch.randn(n, generator=gen, device=device)

    def ours():
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        _, _, loss = call(h, w, ids, dout, dneg, None, None, 1.0, entropy)
        return torch.autograd.grad(loss, (h, w))

    def dense():
        return linear_torch(hidden, weight, ids, dout, dneg if entropy else torch.zeros_like(dneg), 1.0)[2:]

    return ours, dense


def _measure(step: Callable[[], Any], device: torch.device, reps: int) -> dict[str, Any]:
    """First call (seconds), median of `reps` warm calls (ms), peak memory above the start (CUDA)."""
    t0 = time.perf_counter()
    out = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    row: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 3)}
    del out
    times = [_timed(step, device) for _ in range(max(1, reps))]
    row["median_ms"] = round(1e3 * statistics.median(times), 3)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        row["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        del out
    return row


def run_paths(cfg: Config, device: torch.device, names: list[str], failures: list[str]) -> list[dict[str, Any]]:
    """Section 1: one row per path, lossfx and the dense torch formula side by side."""
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for i, name in enumerate(names):
        row: dict[str, Any] = {"path": name, "rows": cfg.rows, "vocab": cfg.vocab, "dtype": "bf16"}
        if name.startswith("linear_"):
            row["hidden"] = cfg.hidden
        rows.append(row)
        label = f"[paths] {name:>22}:"
        if time.monotonic() - start > cfg.paths_budget_s:
            row["skipped"] = "paths budget spent"
            print(f"{label} skipped ({row['skipped']})", flush=True)
            continue
        gen = torch.Generator(device=device).manual_seed(i)
        try:
            make = _linear_steps if name.startswith("linear_") else _logits_steps
            make = _token_steps if name.removesuffix("_logprobs") in TOKEN_PATHS else make
            ours, dense = make(name, cfg, device, gen)
            row["lossfx"] = _measure(ours, device, cfg.paths_reps)
            _free(device)
            row["torch"] = _measure(dense, device, cfg.paths_reps)
            row["time_vs_torch"] = round(row["lossfx"]["median_ms"] / row["torch"]["median_ms"], 3)
        except Exception as exc:  # a path that crashes at this shape: a failure, with its reason
            row["skipped"] = f"error: {type(exc).__name__}: {exc}"[:300]
            if "lossfx" not in row:
                failures.append(f"paths {name}: {row['skipped']}")
            print(f"{label} {row['skipped']}", flush=True)
            _free(device)
            continue
        print(
            f"{label} lossfx {row['lossfx']['median_ms']:9.2f} ms, torch {row['torch']['median_ms']:9.2f} ms",
            flush=True,
        )
        _free(device)
    print(f"[paths] {time.monotonic() - start:.1f} s", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Section 2: the GRPO step against the peers
# ---------------------------------------------------------------------------------------------

# provider -> (the shared builder's name, compiled by this script). Uncompiled first: when the
# budget runs out, the compiled rows (each a fresh compile) are the ones skipped.
BENCH_PROVIDERS = {
    "naive": ("naive", False),
    "lossfx-logits": ("lossfx-unfused", False),
    "lossfx-fused": ("lossfx-fused", False),
    "lossfx-objective": ("lossfx-objective", False),
    "liger-flce": ("liger-flce", False),
    "cce": ("cce", False),
    "trl-fused": ("trl-fused", False),
    "torch-linear-ce": ("torch-linear-ce", False),
    "naive-compiled": ("naive", True),
    "lossfx-logits-compiled": ("lossfx-unfused", True),
    "lossfx-fused-compiled": ("lossfx-fused", True),
    "lossfx-objective-compiled": ("lossfx-objective", True),
    "liger-grpo": ("liger-grpo", False),  # compiles its chunks itself
}
SEQUENCES = 8


def _timed(step: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one `step()` (CUDA events on a GPU)."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def bench_row(provider: str, n: int, hs: int, v: int, device: torch.device, reps: int) -> dict[str, Any]:
    """One GRPO step of `provider`: first call (compile included), median of `reps` warm calls after
    one warm-up, peak memory above what existed before the call (CUDA), loss and gradient norm."""
    name, compiled = BENCH_PROVIDERS[provider]
    torch._dynamo.reset()
    h, w, t, c = builders.grpo_inputs(n, hs, v, SEQUENCES, dtype=torch.bfloat16, device=device)
    fn = builders.objective_function(name, sequences=SEQUENCES, compiled=compiled)

    def step() -> tuple[Tensor, Tensor, Tensor]:
        loss, _ = fn(h, w, t, c)
        return (loss.detach(), *torch.autograd.grad(loss, (h, w)))

    t0 = time.perf_counter()
    loss, dh, dw = step()
    value = float(loss)  # waits for the device
    row: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 3), "loss": value}
    row["grad_norm"] = float(torch.cat([dh.float().flatten(), dw.float().flatten()]).norm())
    del loss, dh, dw
    if reps > 1:
        _timed(step, device)  # a second warm-up (allocator, autotuning)
    times = [_timed(step, device) for _ in range(max(1, reps))]
    row.update(median_ms=round(1e3 * statistics.median(times), 3), min_ms=round(1e3 * min(times), 3), reps=len(times))
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        grads = (n + v) * hs * 2  # dhidden + dweight in bf16, returned by the call and counted
        row.update(peak_mib=round(peak / 2**20, 1), beyond_grads_x_logits=round((peak - grads) / (n * v * 2), 3))
    return row


def run_bench(cfg: Config, device: torch.device, providers: list[str], failures: list[str]) -> list[dict[str, Any]]:
    """Section 2: one row per (shape, provider), in that order; skipped rows say why."""
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for n, hs, v in cfg.bench_shapes:
        base: dict[str, Any] | None = None
        for provider in providers:
            row: dict[str, Any] = {"tokens": n, "hidden": hs, "vocab": v, "dtype": "bf16", "provider": provider}
            rows.append(row)
            label = f"[bench] N={n} H={hs} V={v} {provider:>26}:"
            reason = builders.unavailable(BENCH_PROVIDERS[provider][0], device)
            if reason is None and time.monotonic() - start > cfg.bench_budget_s:
                reason = "bench budget spent"
            if reason is not None:
                row["skipped"] = reason
                print(f"{label} skipped ({reason})", flush=True)
                continue
            try:
                row.update(bench_row(provider, n, hs, v, device, cfg.bench_reps))
            except Exception as exc:  # a peer without a kernel for this case, or out of memory
                row["skipped"] = f"error: {type(exc).__name__}: {exc}"[:300]
                if provider.startswith("lossfx"):
                    failures.append(f"bench {provider} N={n} H={hs} V={v}: {row['skipped']}")
                print(f"{label} {row['skipped']}", flush=True)
                _free(device)
                continue
            if provider == "naive":
                base = row
            if base is not None:
                row["time_vs_naive"] = round(row["median_ms"] / base["median_ms"], 3)
                row["grad_norm_rel"] = abs(row["grad_norm"] - base["grad_norm"]) / base["grad_norm"]
            memory = f", peak {row['peak_mib']:.0f} MiB" if "peak_mib" in row else ""
            print(f"{label} {row['median_ms']:9.2f} ms (first call {row['first_call_s']:.1f} s){memory}", flush=True)
            _free(device)
    print(f"[bench] {time.monotonic() - start:.1f} s", flush=True)
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [
        f"Measured {env['date']} on {env['machine']}, torch {env['torch']}, lossfx {env['lossfx']}; peers: "
        + ", ".join(f"{k} {env[k]}" for k in ("trl", "liger-kernel", "cut-cross-entropy"))
        + f". Mode: {doc['mode']}.",
        "",
        "### lossfx's paths against the dense torch formula, bf16, eager, forward + backward",
        "",
        "| path | rows | V | lossfx ms | torch ms | ÷ torch | lossfx peak MiB | torch peak MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["paths"]:
        head = f"| {r['path']} | {r['rows']} | {r['vocab']} "
        if "skipped" in r:
            lines.append(head + f"| skipped: {r['skipped']} | | | | |")
            continue
        ours, dense = r["lossfx"], r["torch"]
        peaks = " | ".join("—" if "peak_mib" not in m else f"{m['peak_mib']:.0f}" for m in (ours, dense))
        lines.append(
            head + f"| {ours['median_ms']:.2f} | {dense['median_ms']:.2f} | {r['time_vs_torch']:.2f} | {peaks} |"
        )
    lines += [
        "",
        "### GRPO loss step, bf16, forward + backward",
        "",
        "| N | H | V | provider | median ms | ÷ naive | first call s | peak MiB | beyond grads × bf16 logits "
        "| grad norm rel. to naive |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["bench"]:
        head = f"| {r['tokens']} | {r['hidden']} | {r['vocab']} | {r['provider']} "
        if "skipped" in r:
            lines.append(head + f"| skipped: {r['skipped']} | | | | | |")
            continue

        def cell(key, fmt, r=r):
            return "—" if r.get(key) is None else format(r[key], fmt)

        lines.append(head + f"| {r['median_ms']:.2f} | {cell('time_vs_naive', '.2f')} | {r['first_call_s']:.1f} "
                     f"| {cell('peak_mib', '.0f')} | {cell('beyond_grads_x_logits', '.3f')} "
                     f"| {cell('grad_norm_rel', '.1e')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the default on the CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when present; "
                        "--device cpu --quick runs the quick shapes on the CPU")  # fmt: skip
    parser.add_argument("--sections", nargs="+", default=["paths", "bench"], choices=["paths", "bench"])
    parser.add_argument("--providers", nargs="+", default=list(BENCH_PROVIDERS), choices=list(BENCH_PROVIDERS))
    parser.add_argument("--paths", nargs="+", default=None, help="paths: these only (default: all)")
    parser.add_argument(
        "--shapes", nargs="+", default=None, metavar="NxHxV", help="bench shapes, e.g. 16384x4096x151936"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed calls per row (paths and bench)")
    parser.add_argument("--budget-paths", type=float, default=None, help="seconds before paths stop starting")
    parser.add_argument("--budget-bench", type=float, default=None, help="seconds before bench rows stop starting")
    parser.add_argument("--out", default=None, help="also write gpu.json and gpu.md there")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    if device.type == "cuda" and not cuda:
        parser.error("--device cuda: no CUDA device here")
    smoke = args.smoke or (device.type == "cpu" and not args.quick)
    cfg = SMOKE if smoke else QUICK if args.quick else FULL
    overrides = {"bench_reps": args.reps, "paths_reps": args.reps, "paths_budget_s": args.budget_paths,
                 "bench_budget_s": args.budget_bench}  # fmt: skip
    if args.shapes:
        try:
            overrides["bench_shapes"] = tuple(tuple(int(d) for d in shape.split("x")) for shape in args.shapes)
        except ValueError:
            parser.error(f"--shapes: NxHxV with integers, got {args.shapes}")
        if any(len(shape) != 3 or shape[0] % SEQUENCES for shape in overrides["bench_shapes"]):
            parser.error(f"--shapes: NxHxV with N a multiple of {SEQUENCES}, got {args.shapes}")
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    known = path_names()
    names = args.paths or known
    if set(names) - set(known):
        parser.error(f"--paths: unknown path(s) {sorted(set(names) - set(known))}; known: {known}")
    mode = ("smoke (tiny shapes)" if smoke else "quick" if args.quick else "full") + f", {device.type}"
    if not cuda and not args.smoke and not args.quick:
        print("no CUDA device: running the CPU smoke configuration", flush=True)
    env = {
        **measure.environment(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "cuda": torch.version.cuda,
        **{k: _version(k) for k in ("trl", "liger-kernel", "cut-cross-entropy", "triton")},
    }
    print(
        f"lossfx GPU benchmark, {mode}: {env['device']}, torch {env['torch']}, config {dataclasses.asdict(cfg)}",
        flush=True,
    )
    start = time.monotonic()
    failures: list[str] = []
    warnings.filterwarnings("ignore", message=r".*valid tokens have -inf in curr_logprobs")
    paths = run_paths(cfg, device, names, failures) if "paths" in args.sections else []
    bench = run_bench(cfg, device, args.providers, failures) if "bench" in args.sections else []
    doc = {"environment": env, "mode": mode, "config": dataclasses.asdict(cfg), "paths": paths, "bench": bench,
           "failures": failures, "elapsed_s": round(time.monotonic() - start, 1)}  # fmt: skip
    text = markdown(doc)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.json").write_text(json.dumps(doc, indent=1, default=str))
        (out / "gpu.md").write_text(text)
    print(f"total {doc['elapsed_s']:.1f} s; {len(failures)} failure(s)", flush=True)
    for failure in failures:
        print(f"FAILED: {failure}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
