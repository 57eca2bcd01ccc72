"""Fused LM head (issue 9): log-probs from hidden states against unfused paths and Cut Cross-Entropy.

    python -m benchmarks.bench_linear                       # N=2048, H=512, V=32000 and 151936, fp32+bf16
    python -m benchmarks.bench_linear --quick --out /tmp/b  # tiny shapes: a smoke run
    python -m benchmarks.bench_linear --vocabs 32000 --dtypes fp32 --no-compile-time

CPU-sized: N = 2048 tokens and H = 512 are far below a real model's (H = 3584-8192); the ratios,
not the absolute times, are the result. Providers, side by side in one run, each a forward +
backward of `Σ g · logprob` with respect to `hidden` and `weight` (fixed random `g`):

    linear-eager      lossfx.linear_token_logprobs(hidden, weight, target)   [if lossfx has it]
    linear-compiled   the same under torch.compile(fullgraph=True)           [if lossfx has it]
    objective-eager   lossfx.linear_logprob_objective(hidden, weight, target, g): the same Σ g · logprob
                      with the gradients formed in the forward (three matmuls)  [if lossfx has it]
    objective-compiled  the same under torch.compile(fullgraph=True)         [if lossfx has it]
    unfused-compiled  lossfx.token_logprobs(hidden @ weight.T, target) under torch.compile(fullgraph=True)
    naive-compiled    log_softmax((hidden @ weight.T).float()).gather(target) under torch.compile(fullgraph=True)
    cce-compiled      −cut_cross_entropy.linear_cross_entropy(hidden, weight, target, impl="torch_compile",
                      reduction="none") (its own torch.compile; CE = −log-prob per token) [if installed]

Reported: median, p20, p80 time (`measure.time_call`); peak extra memory (resident high-water mark
in a fresh process, `benchmarks.rss`) minus the `dhidden` and `dweight` every method returns, in
units of the fp32 logits' bytes `N·V·4` (target ≤ 0.1×); time ÷ `unfused-compiled` (target for
`linear-compiled` ≤ 1.4×). Then the compile time of a compiled training step of
`linear_token_logprobs` at 4 and at 64 chunks (`chunk_size = N/4`, `N/64`), each in a fresh
process with an empty Inductor cache (target: 64 chunks ≤ 1.5× the 4-chunk time).

To measure a lossfx that is not installed here (e.g. another branch), put it first on the path:
`PYTHONPATH=/path/to/snapshot:$PWD python -m benchmarks.bench_linear` run from a directory
without a `lossfx/` of its own (`python -m` puts the working directory first on `sys.path`).
Results: `<out>/linear.{csv,json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache")
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import lossfx
from benchmarks import _linear_builders as builders
from benchmarks import measure
from benchmarks.rss import run_module_fresh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOKENS, HIDDEN, VOCABS = 2048, 512, (32_000, 151_936)
QUICK = {"tokens": 64, "hidden": 32, "vocabs": (1000,)}
PROVIDERS = (
    "linear-eager",
    "linear-compiled",
    "objective-eager",
    "objective-compiled",
    "unfused-compiled",
    "naive-compiled",
    "cce-compiled",
)
BASELINE = "unfused-compiled"
MEMORY_TARGET, TIME_TARGET, COMPILE_TARGET = 0.1, 1.4, 1.5


def has_linear() -> bool:
    """Whether the lossfx on the path has the fused LM-head path."""
    return hasattr(lossfx, "linear_token_logprobs")


def available(provider: str) -> bool:
    if provider.startswith("linear"):
        return has_linear()
    if provider.startswith("objective"):
        return hasattr(lossfx, "linear_logprob_objective")
    if provider.startswith("cce"):
        return builders.unavailable("cce") is None
    return True


# provider -> the shared builder's name (`benchmarks._linear_builders`)
_SHARED = {"linear": "lossfx-fused", "unfused": "lossfx-unfused", "naive": "naive", "cce": "cce"}


def provider_function(provider: str, chunk_size: int | None = None) -> Callable[..., torch.Tensor]:
    """`fn(hidden [N, H], weight [V, H], target [N]) -> logprobs [N]` of `provider` (the objective
    providers: `fn(hidden, weight, target, g [N]) -> Σ g · logprobs`)."""
    if provider not in PROVIDERS:
        raise KeyError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    kind, _, mode = provider.partition("-")
    compiled = mode == "compiled" and kind != "cce"  # Cut Cross-Entropy compiles inside
    if kind == "objective":
        objective = builders.objective_function("lossfx-objective", compiled=compiled, chunk_size=chunk_size)
        return lambda h, w, t, g: objective(h, w, t, g)[0]
    logprob = builders.logprob_function(_SHARED[kind], compiled=compiled, chunk_size=chunk_size)
    return lambda h, w, t: logprob(h, w, t)[0]


def build(
    provider: str, tokens: int, hidden: int, vocab: int, dtype: str, chunk_size: int | None = None
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Zero-argument fwd+bwd of `provider`, returning `(dhidden, dweight)` (the `benchmarks.rss` builder)."""
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=gen)).to(DTYPES[dtype]).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 3).to(DTYPES[dtype]).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    g = torch.randn(tokens, generator=gen)
    fn = provider_function(provider, chunk_size)

    def fwd_bwd() -> tuple[torch.Tensor, torch.Tensor]:
        if provider.startswith("objective"):
            loss = fn(h, w, target, g)
        else:
            loss = (fn(h, w, target).float() * g).sum()
        dh, dw = torch.autograd.grad(loss, (h, w))
        return dh, dw

    return fwd_bwd


def measure_provider(
    provider: str, tokens: int, hidden: int, vocab: int, dtype: str, min_runs: int, min_run_time: float
) -> dict[str, Any]:
    """One row: time in this process, peak memory in a fresh one, both relative to the fp32 logits."""
    kwargs = {"provider": provider, "tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": dtype}
    run = build(**kwargs)
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    timing = measure.time_call(run, min_run_time=min_run_time, min_runs=min_runs)
    del run
    peak = measure.peak_memory_bytes("benchmarks.bench_linear:build", kwargs)
    itemsize = DTYPES[dtype].itemsize
    grads = (tokens + vocab) * hidden * itemsize  # dhidden + dweight, in the inputs' dtype
    return builders.result_row(provider, tokens, hidden, vocab, dtype, timing, first, peak, grads)


def _compile_time_here(tokens: int, hidden: int, vocab: int, chunks: int) -> dict[str, float]:
    """Seconds of the first (compiling) and of a warm compiled training step at `chunks` chunks."""
    run = build("linear-compiled", tokens, hidden, vocab, "fp32", chunk_size=-(-tokens // chunks))
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    start = time.perf_counter()
    run()
    warm = time.perf_counter() - start
    return {"first_s": first, "warm_s": warm, "compile_s": first - warm}


def compile_time(tokens: int, hidden: int, vocab: int, chunks: int) -> dict[str, float]:
    """`_compile_time_here` in a fresh process with an empty Inductor cache (a cold compile)."""
    with tempfile.TemporaryDirectory(prefix="lossfx-compile-") as cache:
        args = json.dumps([tokens, hidden, vocab, chunks])
        env = {"TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        return run_module_fresh(
            ["benchmarks.bench_linear", "--compile-time-child", args], env, "compile-time measurement"
        )


def markdown(rows: list[dict[str, Any]], compile_rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        f"Measured {env['date']} on {env['machine']} (host `{env['host']}`), torch {env['torch']}, "
        f"lossfx {env['lossfx']} from `{env['lossfx_path']}`, cut-cross-entropy {env['cce']}. "
        f"CPU: {env.get('cpu_model') or 'unknown'}. CPU-sized shapes; the load on the machine during the "
        "run is stated in benchmarks/README.md.",
        "",
        "| N | H | V | dtype | provider | median ms [p20, p80] | ÷ unfused | peak extra MiB | − grads MiB "
        "| beyond grads × fp32 logits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['time_vs_unfused']:.2f}" if r.get("time_vs_unfused") is not None else ""
        lines.append(
            f"| {r['tokens']} | {r['hidden']} | {r['vocab']} | {r['dtype']} | {r['provider']} "
            f"| {r['median_ms']:.0f} [{r['p20_ms']:.0f}, {r['p80_ms']:.0f}] | {ratio} | {r['peak_extra_mib']:.1f} "
            f"| {r['grads_mib']:.1f} | {r['beyond_grads_x_logits']:.3f} |"
        )
    if compile_rows:
        lines += ["", "| chunks | first call s | warm call s | compile s |", "|---|---|---|---|"]
        lines += [
            f"| {c['chunks']} | {c['first_s']:.1f} | {c['warm_s']:.2f} | {c['compile_s']:.1f} |" for c in compile_rows
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vocabs", nargs="+", type=int, default=None)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--min-runs", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.0)
    parser.add_argument("--no-compile-time", action="store_true")
    parser.add_argument("--compile-time-only", action="store_true", help="only the 4- vs 64-chunk compile times")
    parser.add_argument("--name", default="linear", help="result file stem")
    parser.add_argument("--compile-time-child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    if args.compile_time_child:
        print(json.dumps(_compile_time_here(*json.loads(args.compile_time_child))))
        return 0
    tokens, hidden = (QUICK["tokens"], QUICK["hidden"]) if args.quick else (TOKENS, HIDDEN)
    vocabs = args.vocabs or (QUICK["vocabs"] if args.quick else VOCABS)
    providers = [p for p in args.providers if available(p)]
    skipped = [p for p in args.providers if not available(p)]
    if skipped:
        print(f"skipped (not available here): {', '.join(skipped)}", flush=True)
    env = {
        **measure.environment(),
        "lossfx_path": str(Path(lossfx.__file__).resolve().parent),
        "cce": _cce_version(),
        "memory_method": measure.MEMORY_METHOD,
    }
    rows: list[dict[str, Any]] = []
    compile_rows: list[dict[str, Any]] = []
    stem = Path(args.out) / args.name

    def save() -> None:
        meta = {"environment": env, "skipped": skipped, "compile_time": compile_rows, "targets": _targets()}
        measure.write_results(stem, rows, meta, quiet=True)
        (stem.parent / f"{stem.name}.md").write_text(markdown(rows, compile_rows, env))

    for vocab in [] if args.compile_time_only else vocabs:
        for dtype in args.dtypes:
            group = []
            for provider in providers:
                torch._dynamo.reset()
                row = measure_provider(provider, tokens, hidden, vocab, dtype, args.min_runs, args.min_run_time)
                group.append(row)
                print(
                    f"V={vocab:>6} {dtype} {provider:>17}: {row['median_ms']:9.1f} ms "
                    f"[{row['p20_ms']:.1f}, {row['p80_ms']:.1f}]  peak +{row['peak_extra_mib']:.1f} MiB, "
                    f"beyond grads {row['beyond_grads_x_logits']:.3f}x fp32 logits",
                    flush=True,
                )
            base = next((r for r in group if r["provider"] == BASELINE), None)
            for row in group:
                row["time_vs_unfused"] = round(row["median_ms"] / base["median_ms"], 3) if base else None
            rows += group
            save()
    if not args.no_compile_time and has_linear():
        for chunks in (4, 64):
            result = compile_time(tokens, hidden, vocabs[0], chunks)
            compile_rows.append({"chunks": chunks, "tokens": tokens, "hidden": hidden, "vocab": vocabs[0], **result})
            print(f"compiled training step, {chunks} chunks: compile {result['compile_s']:.1f} s", flush=True)
            save()
    save()
    print(markdown(rows, compile_rows, env))
    return 0


def _targets() -> dict[str, str]:
    return {
        "memory": f"linear-* peak extra beyond dhidden/dweight <= {MEMORY_TARGET} x fp32 logits",
        "time": f"linear-compiled median <= {TIME_TARGET} x {BASELINE}",
        "compile": f"compile time at 64 chunks <= {COMPILE_TARGET} x at 4 chunks",
    }


def _cce_version() -> str:
    try:
        from importlib.metadata import version

        return version("cut-cross-entropy")
    except Exception:
        return "not installed"


if __name__ == "__main__":
    raise SystemExit(main())
