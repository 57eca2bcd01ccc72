"""One GRPO loss step (issue 18): lossfx's fused head against TRL's, Liger's, Cut Cross-Entropy's and torch's.

    python -m benchmarks.bench_grpo                          # N=2048, H=512, V=32000 and 151936, fp32, 1 thread
    python -m benchmarks.bench_grpo --quick --out /tmp/b     # tiny shapes: a smoke run

The step is the on-policy GRPO loss of `B = 8` completions of `T = N/B` tokens from hidden states
`[N, H]` and an LM head `[V, H]` (fp32), forward and backward to `dhidden`, `dweight`:

    loss = Σ_n c_n · log p(t_n),   c_n = −A_b(n) · mask_n / Σ mask     (ratio 1: on-policy, DAPO norm)

plus the per-token entropy `−Σ p log p` as a metric (no gradient) where the provider computes it.
Providers, side by side in one run (the `entropy` column says which give the entropy):

    naive-compiled       log_softmax(h @ Wᵀ) gather + entropy under torch.compile(fullgraph=True)  (the baseline)
    lossfx-fused         lossfx.linear_token_logprobs(h, W, t, return_neg_entropy=True), eager
    lossfx-fused-compiled  the same under torch.compile(fullgraph=True)
    lossfx-objective     lossfx.linear_logprob_objective(h, W, t, c, neg_entropy_weight=0): gradients in the forward
    lossfx-objective-compiled  the same under torch.compile(fullgraph=True)
    trl-fused            TRL's fused LM head (trl.kernels.ChunkedLogProbFunction, its CPU path, TRL's chunk size)
    liger-grpo           liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (chunked, torch.compile'd chunks)
    cce-compiled         cut_cross_entropy.linear_cross_entropy(impl="torch_compile"), log-prob = −CE
    torch-linear-ce      torch.nn.functional.linear_cross_entropy (torch ≥ 2.13), log-prob = −CE

Reported per provider: median [p20, p80] ms (`measure.time_call`), time ÷ `naive-compiled`, peak
extra memory (resident high-water mark in a fresh process, `benchmarks/rss.py`) minus the returned
`dhidden` + `dweight`, in units of the fp32 logits `N·V·4` (goal: ≤ 0.1×), and the loss and gradient
norm relative to the baseline's (each provider computes the same loss: a check, not a timing; Liger
returns the ratio form `−Σ A·r / N` with `r = 1`, another value with the same gradient, so only its
gradient norm is compared).
Results: `<out>/grpo.{csv,json,md}`, with date, machine and versions. Missing packages skip their
providers (listed as skipped).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache")
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import _linear_builders as builders
from benchmarks import measure

TOKENS, HIDDEN, VOCABS, SEQUENCES = 2048, 512, (32_000, 151_936), 8
QUICK = {"tokens": 64, "hidden": 32, "vocabs": (1000,)}
BASELINE = "naive-compiled"
PROVIDERS = (
    BASELINE,
    "lossfx-fused",
    "lossfx-fused-compiled",
    "lossfx-objective",
    "lossfx-objective-compiled",
    "trl-fused",
    "liger-grpo",
    "cce-compiled",
    "torch-linear-ce",
)
WITH_ENTROPY = {BASELINE, "trl-fused", *(p for p in PROVIDERS if p.startswith("lossfx"))}
MEMORY_GOAL = 0.1
# provider -> (the shared builder's name, whether this script wraps it in torch.compile)
_SHARED = {
    BASELINE: ("naive", True),
    "lossfx-fused": ("lossfx-fused", False),
    "lossfx-fused-compiled": ("lossfx-fused", True),
    "lossfx-objective": ("lossfx-objective", False),
    "lossfx-objective-compiled": ("lossfx-objective", True),
    "trl-fused": ("trl-fused", False),
    "liger-grpo": ("liger-grpo", False),
    "cce-compiled": ("cce", False),  # compiled inside Cut Cross-Entropy (impl="torch_compile" on CPU)
    "torch-linear-ce": ("torch-linear-ce", False),
}


def available(provider: str) -> bool:
    return builders.unavailable(_SHARED[provider][0]) is None


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "not installed"


def loss_function(provider: str, sequences: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """`fn(h, w, t, c) -> (loss, entropy or None)` of `provider` (`benchmarks._linear_builders`)."""
    if provider not in _SHARED:
        raise KeyError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    name, compiled = _SHARED[provider]
    return builders.objective_function(name, sequences=sequences, entropy=provider in WITH_ENTROPY, compiled=compiled)


def _inputs(tokens: int, hidden: int, vocab: int, sequences: int):
    return builders.grpo_inputs(tokens, hidden, vocab, sequences)


def build(
    provider: str, tokens: int, hidden: int, vocab: int, sequences: int = SEQUENCES
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Zero-argument GRPO loss step of `provider`, returning `(dhidden, dweight)` (the `benchmarks.rss` builder)."""
    h, w, t, c = _inputs(tokens, hidden, vocab, sequences)
    fn = loss_function(provider, sequences)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        loss, _ = fn(h, w, t, c)
        dh, dw = torch.autograd.grad(loss, (h, w))
        return dh, dw

    return step


def _check_values(provider: str, tokens: int, hidden: int, vocab: int) -> dict[str, float]:
    """The loss, the gradients' norm and the mean entropy of one step (for the cross-provider check)."""
    h, w, t, c = _inputs(tokens, hidden, vocab, SEQUENCES)
    loss, entropy = loss_function(provider, SEQUENCES)(h, w, t, c)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(torch.cat([dh.flatten(), dw.flatten()]).norm()),
        "entropy_mean": float("nan") if entropy is None else float(entropy.mean()),
    }


def measure_provider(
    provider: str, tokens: int, hidden: int, vocab: int, min_runs: int, min_run_time: float, fresh: bool = True
) -> dict[str, Any]:
    kwargs = {"provider": provider, "tokens": tokens, "hidden": hidden, "vocab": vocab}
    values = _check_values(provider, tokens, hidden, vocab)
    run = build(**kwargs)
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    timing = measure.time_call(run, min_run_time=min_run_time, min_runs=min_runs)
    del run
    peak = measure.peak_memory_bytes("benchmarks.bench_grpo:build", kwargs, fresh=fresh)
    grads = (tokens + vocab) * hidden * 4
    row = builders.result_row(provider, tokens, hidden, vocab, "fp32", timing, first, peak, grads)
    return {**row, "entropy": provider in WITH_ENTROPY, **values}


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], skipped: list[str]) -> str:
    lines = [
        f"Measured {env['date']} on {env['machine']} (host `{env['host']}`, CPU {env.get('cpu_model') or 'unknown'}), "
        f"torch {env['torch']}, lossfx {env['lossfx']}, trl {env['trl']}, liger-kernel {env['liger']}, "
        f"cut-cross-entropy {env['cce']}. One GRPO loss step, fp32, forward + backward; memory: "
        f"{env['memory_method']}." + (f" Skipped (not installed): {', '.join(skipped)}." if skipped else ""),
        "",
        "| N | H | V | provider | entropy | median ms [p20, p80] | ÷ naive compiled | peak extra MiB "
        "| beyond grads × fp32 logits | loss, grad norm rel. to naive |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if r.get("time_vs_naive") is None else f"{r['time_vs_naive']:.2f}"
        loss_rel = "—" if r.get("loss_rel") is None else f"{r['loss_rel']:.1e}"
        check = "" if r.get("grad_norm_rel") is None else f"{loss_rel}, {r['grad_norm_rel']:.1e}"
        lines.append(
            f"| {r['tokens']} | {r['hidden']} | {r['vocab']} | {r['provider']} | {'yes' if r['entropy'] else 'no'} "
            f"| {r['median_ms']:.0f} [{r['p20_ms']:.0f}, {r['p80_ms']:.0f}] | {ratio} | {r['peak_extra_mib']:.1f} "
            f"| {r['beyond_grads_x_logits']:.3f} | {check} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, eager peaks by the profiler in this process (a smoke run)"
    )
    parser.add_argument("--vocabs", nargs="+", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help=f"N (default {TOKENS}; a multiple of {SEQUENCES})")
    parser.add_argument("--hidden", type=int, default=None, help=f"H (default {HIDDEN})")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--min-runs", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.0)
    parser.add_argument("--name", default="grpo", help="result file stem")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    tokens, hidden = (QUICK["tokens"], QUICK["hidden"]) if args.quick else (TOKENS, HIDDEN)
    tokens, hidden = args.tokens or tokens, args.hidden or hidden
    if tokens % SEQUENCES:
        parser.error(f"--tokens must be a multiple of the {SEQUENCES} sequences, got {tokens}")
    vocabs = args.vocabs or (QUICK["vocabs"] if args.quick else VOCABS)
    providers = [p for p in args.providers if available(p)]
    skipped = [p for p in args.providers if not available(p)]
    if skipped:
        print(f"skipped (not available here): {', '.join(skipped)}", flush=True)
    fresh = not args.quick or any(p.endswith("compiled") for p in providers)  # a smoke run: no process per peak
    env = {
        **measure.environment(),
        "trl": _version("trl"),
        "liger": _version("liger-kernel"),
        "cce": _version("cut-cross-entropy"),
        "memory_method": measure.MEMORY_METHOD if fresh else "the profiler's allocation events, in this process",
    }
    rows: list[dict[str, Any]] = []
    stem = Path(args.out) / args.name
    meta = {"environment": env, "skipped": skipped, "goal": f"beyond grads <= {MEMORY_GOAL} x fp32 logits"}
    for vocab in vocabs:
        group = []
        for provider in providers:
            torch._dynamo.reset()
            row = measure_provider(provider, tokens, hidden, vocab, args.min_runs, args.min_run_time, fresh)
            group.append(row)
            print(
                f"V={vocab:>6} {provider:>25}: {row['median_ms']:9.1f} ms [{row['p20_ms']:.1f}, {row['p80_ms']:.1f}]  "
                f"peak +{row['peak_extra_mib']:.1f} MiB, beyond grads {row['beyond_grads_x_logits']:.3f}x fp32 logits",
                flush=True,
            )
        base = next((r for r in group if r["provider"] == BASELINE), None)
        for row in group:
            row["time_vs_naive"] = round(row["median_ms"] / base["median_ms"], 3) if base else None
            # Liger returns the ratio form −Σ A·r/N (r = 1 on-policy): another value, the same gradient
            same_value = base is not None and row["provider"] != "liger-grpo"
            row["loss_rel"] = abs(row["loss"] - base["loss"]) / abs(base["loss"]) if same_value else None
            row["grad_norm_rel"] = abs(row["grad_norm"] - base["grad_norm"]) / base["grad_norm"] if base else None
        rows += group
        measure.write_results(stem, rows, meta, quiet=True)
        (stem.parent / f"{stem.name}.md").write_text(markdown(rows, env, skipped))
    measure.write_results(stem, rows, meta, quiet=True)
    (stem.parent / f"{stem.name}.md").write_text(markdown(rows, env, skipped))
    print(markdown(rows, env, skipped))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
