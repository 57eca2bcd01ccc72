"""One GRPO loss step inside TRL (issue 27): lossfx's fused head against stock TRL's, on CPU.

    python -m benchmarks.bench_trainer_step            # H ∈ {128, 512, 1024} × N ∈ {132, 528, 2048}, V = 151936
    python -m benchmarks.bench_trainer_step --quick    # H = 128, N = 132 only (about a minute)

The step is what `GRPOTrainer.compute_loss` + `backward` does past the backbone, from the last
hidden states `[B, T + 1, H]` (`B = 4` completions of `T = N / 4` tokens, fp32) and the LM head
`[V, H]`: the per-token log-probs and entropies of the `T` completion tokens, the on-policy GRPO
loss `−Σ exp(lp − lp.detach())·A·mask / Σ mask`, the entropy logged as a metric (its masked mean,
no gradient), and the backward to `dhidden`, `dweight`. The backbone is the same for both and left
out. Providers:

    stock    TRL's fused LM head as `add_fused_lm_head` runs it on a CPU (`_ChunkedLogProbFunction`
             over every position, TRL's tiles of 4096 × 32768, outputs log-probs and entropy)
    lossfx   `lossfx.integrations.trl.per_token_logps_and_entropies` (the `LossfxGRPOMixin` path)

Columns, lossfx ÷ stock: leaf aten ops of one step (profiler events with no aten op below them,
views and allocations included: deterministic), the median step time with 1 thread and with 2
threads while a spinning process keeps one core busy (the two providers alternate in one process;
noisy on a shared machine), and the peak resident memory of one step beyond what existed before
it, minus the returned `dhidden` + `dweight` (`benchmarks/rss.py`: a fresh process per figure).
Goals: ops ≤ 2×, time ≤ 1.0×, memory ≤ 0.1×. Results: `<out>/trainer_step.{csv,json,md}`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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

from benchmarks import measure, rss

VOCAB, COMPLETIONS, TEMPERATURE = 151_936, 4, 0.9
HIDDENS, TOKENS = (128, 512, 1024), (132, 528, 2048)
QUICK = {"hiddens": (128,), "tokens": (132,)}
PROVIDERS = ("stock", "lossfx")
GOALS = {"ops": 2.0, "time_1t": 1.0, "time_2t_busy": 1.0, "memory": 0.1}


def _inputs(tokens: int, hidden: int, vocab: int, seed: int = 0):
    b, t = COMPLETIONS, tokens // COMPLETIONS
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(b, t + 1, hidden, generator=gen) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    ids = torch.randint(0, vocab, (b, t + 1), generator=gen)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, -3:] = 0  # one completion ends early
    adv = torch.randn(b, generator=gen)
    return h, w, ids, mask, adv, t


def _stock(h, w, ids, mask, t):
    """`add_fused_lm_head`'s forward past the backbone on a CPU (`compact = False`), TRL's slices."""
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, _ChunkedLogProbFunction

    labels = torch.cat([torch.full_like(ids[:, :1], -100), ids[:, 1:].masked_fill(mask == 0, -100)], dim=1)
    hidden, labels = h[:, :-1], labels[:, 1:]
    keep = labels != -100
    out = _ChunkedLogProbFunction.apply(
        hidden.reshape(-1, hidden.size(-1)),
        w,
        None,
        labels.clamp(min=0).reshape(-1),
        TEMPERATURE,
        _CHUNKED_LOGPROB_CHUNK_SIZE,
        None,
        1.0,
        ("log_probs", "entropy"),
    )
    lp, ent = (x.view(keep.shape).masked_fill(~keep, 0) for x in out[:2])
    return lp[:, -t:], ent[:, -t:]


def _lossfx(h, w, ids, mask, t):
    from lossfx.integrations.trl import per_token_logps_and_entropies

    attention = torch.cat([torch.ones_like(ids[:, :1]), mask], dim=1)
    return per_token_logps_and_entropies(
        h, w, ids, attention, logits_to_keep=t, temperature=TEMPERATURE, compute_entropy=True
    )


def build(provider: str, tokens: int, hidden: int, vocab: int = VOCAB) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Zero-argument loss step of `provider` -> `(dhidden, dweight)` (the `benchmarks.rss` builder)."""
    h, w, ids, mask, adv, t = _inputs(tokens, hidden, vocab)
    logps_and_entropies = {"stock": _stock, "lossfx": _lossfx}[provider]

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = logps_and_entropies(h, w, ids, mask, t)
        m = mask.to(lp.dtype)
        ratio = torch.exp(lp - lp.detach())
        loss = (-(ratio * adv[:, None]) * m).sum() / m.sum().clamp(min=1.0)
        with torch.no_grad():
            _ = float((ent * m).sum() / m.sum())  # the logged entropy (TRL: masked mean, .item())
        return torch.autograd.grad(loss, (h, w))

    return step


def leaf_ops(step: Callable[[], Any]) -> int:
    """Aten ops of one `step()` with no aten op below them in the profiler's tree (after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children))


def _busy_core() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def alternate_times(steps: dict[str, Callable[[], Any]], threads: int, runs: int) -> dict[str, float]:
    """Median seconds per step of each provider, the providers alternating, `threads` threads."""
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {p: [] for p in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(runs):
        for provider, step in steps.items():
            start = time.perf_counter()
            step()
            times[provider].append(time.perf_counter() - start)
    torch.set_num_threads(1)
    return {p: statistics.median(ts) for p, ts in times.items()}


def measure_shape(tokens: int, hidden: int, runs: int) -> dict[str, Any]:
    steps = {p: build(p, tokens, hidden) for p in PROVIDERS}
    torch.set_num_threads(1)
    ops = {p: leaf_ops(s) for p, s in steps.items()}
    t1 = alternate_times(steps, 1, runs)
    busy = _busy_core()
    try:
        t2 = alternate_times(steps, 2, runs)
    finally:
        busy.kill()
        busy.wait()
    grads = (COMPLETIONS * (tokens // COMPLETIONS + 1) + VOCAB) * hidden * 4
    mem = {
        p: rss.peak_rss_extra_bytes("benchmarks.bench_trainer_step:build", {"provider": p, "tokens": tokens,
                                                                            "hidden": hidden}) - grads
        for p in PROVIDERS
    }  # fmt: skip
    row: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "vocab": VOCAB}
    for p in PROVIDERS:
        row |= {f"{p}_ops": ops[p], f"{p}_s_1t": round(t1[p], 4), f"{p}_s_2t_busy": round(t2[p], 4),
                f"{p}_mib_beyond_grads": round(mem[p] / 2**20, 2)}  # fmt: skip
    row |= {
        "ops_ratio": round(ops["lossfx"] / ops["stock"], 3),
        "time_1t_ratio": round(t1["lossfx"] / t1["stock"], 3),
        "time_2t_busy_ratio": round(t2["lossfx"] / t2["stock"], 3),
        "memory_ratio": round(mem["lossfx"] / max(1, mem["stock"]), 4),
    }
    return row


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], wall_s: float, command: str) -> str:
    lines = [
        f"Measured {env['date']} on {env['machine']} (CPU {env.get('cpu_model') or 'unknown'}), torch "
        f"{env['torch']}, trl {env['trl']}; `{command}` took {wall_s:.0f} s. One GRPO loss step past the "
        f"backbone, fp32, V = {VOCAB}, {COMPLETIONS} completions of N/{COMPLETIONS} tokens; lossfx ÷ stock TRL "
        f"(goals: ops ≤ {GOALS['ops']}×, time ≤ {GOALS['time_1t']}×, memory ≤ {GOALS['memory']}×).",
        "",
        "| H | N | leaf ops lossfx / stock | ÷ | s, 1 thread lossfx / stock | ÷ | s, 2 threads + busy core "
        "| ÷ | MiB beyond grads lossfx / stock | ÷ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hidden']} | {r['tokens']} | {r['lossfx_ops']} / {r['stock_ops']} | {r['ops_ratio']:.2f} "
            f"| {r['lossfx_s_1t']:.3f} / {r['stock_s_1t']:.3f} | {r['time_1t_ratio']:.2f} "
            f"| {r['lossfx_s_2t_busy']:.3f} / {r['stock_s_2t_busy']:.3f} | {r['time_2t_busy_ratio']:.2f} "
            f"| {r['lossfx_mib_beyond_grads']:.1f} / {r['stock_mib_beyond_grads']:.1f} | {r['memory_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="H = 128, N = 132 only")
    parser.add_argument("--hiddens", nargs="+", type=int, default=None)
    parser.add_argument("--tokens", nargs="+", type=int, default=None, help=f"multiples of {COMPLETIONS}")
    parser.add_argument("--runs", type=int, default=5, help="timed steps per provider and thread setting")
    parser.add_argument("--name", default="trainer_step")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    hiddens = args.hiddens or (QUICK["hiddens"] if args.quick else HIDDENS)
    tokens = args.tokens or (QUICK["tokens"] if args.quick else TOKENS)
    from importlib.metadata import version

    env = {**measure.environment(), "trl": version("trl"), "load_1min": os.getloadavg()[0]}
    command = "python -m benchmarks.bench_trainer_step " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = Path(args.out) / args.name
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for hidden in hiddens:
        for n in tokens:
            row = measure_shape(n, hidden, args.runs)
            rows.append(row)
            print(row, flush=True)
            wall = time.perf_counter() - start
            meta = {"environment": env, "goals": GOALS, "command": command, "wall_s": round(wall, 1)}
            measure.write_results(stem, rows, meta, quiet=True)
            (stem.parent / f"{stem.name}.md").write_text(markdown(rows, env, wall, command))
    print(markdown(rows, env, time.perf_counter() - start, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
