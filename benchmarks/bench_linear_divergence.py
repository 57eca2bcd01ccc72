"""OPD_FULL from hidden states (issue 26 item 4): `linear_divergence_to_teacher` against the logits path.

    python -m benchmarks.bench_linear_divergence                      # N=2048, H=512, V=32000, fp32
    python -m benchmarks.bench_linear_divergence --vocabs 32000 151936
    python -m benchmarks.bench_linear_divergence --quick --out /tmp/b  # tiny shapes: a smoke run

The teacher comes from hidden states (`teacher_hidden [N, H] @ teacher_weight [V, H]ᵀ`). Providers,
side by side in one run, each a forward + backward of `Σ g · KL(p_s ‖ p_t)` with respect to the
student's `hidden` and `weight` (fixed random `g`):

    fused-eager        lossfx.linear_divergence_to_teacher(h, W, teacher_hidden=th, teacher_weight=tw)
                       (reverse KL, cross-entropy and Σ p log p from one loop; only the KL reaches the loss)
    fused-compiled     the same under torch.compile(fullgraph=True)
    logits-compiled    the OPD_FULL logits path, compiled: student logits `h @ Wᵀ` materialised,
                       the teacher projected chunk by chunk (`divergence_to_projected_teacher`,
                       what `prepare_loss_input`'s OPD_FULL branch runs for a hidden-states payload)
    dense-compiled     both logits materialised: `reverse_kl_to_fixed(h @ Wᵀ, th @ twᵀ)`, compiled

Reported: median / p20 / p80 time (`measure.time_call`), time ÷ `logits-compiled` (target for
`fused-compiled` ≤ 1.6×), and the peak resident memory of one call in a fresh process
(`benchmarks.rss`) minus the returned `dhidden` and `dweight`, in units of one fp32 logits tensor
`N·V·4` (target ≤ 0.1×). Results: `<out>/linear_divergence.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache")
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import lossfx
from benchmarks import measure
from benchmarks.rss import peak_rss_extra_bytes

PROVIDERS = ("fused-eager", "fused-compiled", "logits-compiled", "dense-compiled")
BASELINE = "logits-compiled"
TIME_TARGET, MEMORY_TARGET = 1.6, 0.1
TOKENS, HIDDEN = 2048, 512


def _loss_function(provider: str) -> Any:
    def fused(h, w, th, tw, g):
        return (g * lossfx.linear_divergence_to_teacher(h, w, teacher_hidden=th, teacher_weight=tw).reverse_kl).sum()

    def logits(h, w, th, tw, g):
        from lossfx.divergence import divergence_to_projected_teacher

        return (g * divergence_to_projected_teacher("reverse_kl", h @ w.T, th, [tw])).sum()

    def dense(h, w, th, tw, g):
        return (g * lossfx.reverse_kl_to_fixed(h @ w.T, th @ tw.T)).sum()

    fn = {"fused": fused, "logits": logits, "dense": dense}[provider.split("-")[0]]
    return torch.compile(fn, fullgraph=True) if provider.endswith("compiled") else fn


def build(provider: str, tokens: int, hidden: int, vocab: int, seed: int = 0) -> Any:
    """The zero-argument callable of one forward + backward: returns `(dhidden, dweight)`."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    th = torch.randn(tokens, hidden, generator=gen)
    tw = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    g = torch.randn(tokens, generator=gen)
    loss_fn = _loss_function(provider)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.autograd.grad(loss_fn(h, w, th, tw, g), (h, w))

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32_000])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS))
    parser.add_argument("--min-run-time", type=float, default=2.0)
    parser.add_argument("--min-runs", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.vocabs, args.min_run_time = 64, 32, [1000], 0.1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for vocab in args.vocabs:
        logits_bytes = args.tokens * vocab * 4
        returned = (args.tokens + vocab) * args.hidden * 4  # dhidden + dweight, fp32
        for provider in args.providers:
            fn = build(provider, args.tokens, args.hidden, vocab)
            timing = measure.time_call(fn, min_run_time=args.min_run_time, min_runs=args.min_runs)
            row: dict[str, Any] = {"vocab": vocab, "provider": provider, **timing}
            if not args.no_memory:
                kwargs = {"provider": provider, "tokens": args.tokens, "hidden": args.hidden, "vocab": vocab}
                peak = peak_rss_extra_bytes("benchmarks.bench_linear_divergence:build", kwargs, threads=1)
                row["peak_beyond_grads_x_logits"] = (peak - returned) / logits_bytes
            rows.append(row)
            print(json.dumps(row), flush=True)
        base = next((r["median_s"] for r in rows if r["vocab"] == vocab and r["provider"] == BASELINE), None)
        for r in rows:
            if r["vocab"] == vocab and base:
                r["time_x_baseline"] = r["median_s"] / base
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "hidden": args.hidden,
        "load_1min": os.getloadavg()[0],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_divergence.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"N={args.tokens}, H={args.hidden}, fp32, {meta['threads']} thread(s), torch {meta['torch']}, "
        f"{meta['date']}, 1-min load {meta['load_1min']:.1f}",
        "",
        "| V | provider | median s | × logits-compiled | peak beyond grads (× fp32 logits) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['time_x_baseline']:.2f}" if "time_x_baseline" in r else "-"
        mem = f"{r['peak_beyond_grads_x_logits']:.3f}" if "peak_beyond_grads_x_logits" in r else "-"
        lines.append(f"| {r['vocab']} | {r['provider']} | {r['median_s']:.3f} | {ratio} | {mem} |")
    (out / "linear_divergence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
