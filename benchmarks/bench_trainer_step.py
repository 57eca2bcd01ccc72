"""One GRPO loss step inside TRL (issue 27): lossfx's fused head against stock TRL's, on CPU.

    python -m benchmarks.bench_trainer_step            # H ∈ {128, 512, 1024} × N ∈ {132, 528, 2048}, V = 151936
    python -m benchmarks.bench_trainer_step --quick    # H = 128, N = 132 only (about a minute)
    python -m benchmarks.bench_trainer_step --filtered --quick   # the sampler's top-k 50 / top-p 0.9 (below)

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

`--filtered` (issue 26): the rollouts were sampled with top-k 50 / top-p 0.9 and the step scores
the completions under that filter (`lossfx_filtered_logprobs=True`), the entropies unfiltered.
The completion tokens are each position's argmax (inside any filter, as a sampled token is).
Providers, side by side: `stock` (TRL's unfiltered fused head above, for scale: stock TRL has no
filtered scoring), `logits` (the `[B, T+1, V]` logits, `lossfx.next_token_logprobs(...,
sampling_params=...)` and the entropies from the same logits: the integration's path before the
fused one) and `lossfx` (`per_token_logps_and_entropies(..., sampling_params=...)`: the fused
filtered kernel plus the fused unfiltered one for the entropies). Columns: leaf ops, median
1-thread time, memory beyond the gradients; ratios lossfx ÷ logits and lossfx ÷ stock. Results:
`<out>/trainer_step_filtered.{csv,json,md}`.
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
FILTERED_PROVIDERS = ("stock", "logits_filtered", "lossfx_filtered")
TOP_K, TOP_P = 50, 0.9  # --filtered: the sampler's filter
GOALS = {"ops": 2.0, "time_1t": 1.0, "time_2t_busy": 1.0, "memory": 0.1}


def _inputs(tokens: int, hidden: int, vocab: int, seed: int = 0, greedy: bool = False):
    b, t = COMPLETIONS, tokens // COMPLETIONS
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(b, t + 1, hidden, generator=gen) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_()
    ids = torch.randint(0, vocab, (b, t + 1), generator=gen)
    if greedy:  # each completion token is its position's argmax: inside any top-k/top-p filter
        with torch.no_grad():
            ids[:, 1:] = torch.stack([(h[i, :-1] @ w.T).argmax(-1) for i in range(b)])
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


def _sampling():
    from lossfx import TrainingSamplingParams

    return TrainingSamplingParams(top_k=TOP_K, top_p=TOP_P)


def _logits_filtered(h, w, ids, mask, t):
    """The logits path: `[B, T+1, V]` logits, the filtered log-probs and the unfiltered entropies."""
    from lossfx import next_token_logprobs

    z = (h @ w.T) / TEMPERATURE
    lp = next_token_logprobs(z, ids, sampling_params=_sampling())
    full = z[:, :-1].log_softmax(-1)
    ent = -(full.exp() * full).sum(-1)
    keep = mask != 0
    return lp.masked_fill(~keep, 0), ent.masked_fill(~keep, 0)


def _lossfx_filtered(h, w, ids, mask, t):
    from lossfx.integrations.trl import per_token_logps_and_entropies

    attention = torch.cat([torch.ones_like(ids[:, :1]), mask], dim=1)
    return per_token_logps_and_entropies(
        h, w, ids, attention, logits_to_keep=t, temperature=TEMPERATURE, compute_entropy=True,
        sampling_params=_sampling(),
    )  # fmt: skip


_STEPS = {"stock": _stock, "lossfx": _lossfx, "logits_filtered": _logits_filtered, "lossfx_filtered": _lossfx_filtered}


def build(
    provider: str, tokens: int, hidden: int, vocab: int = VOCAB, greedy: bool = False
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Zero-argument loss step of `provider` -> `(dhidden, dweight)` (the `benchmarks.rss` builder);
    `greedy`: the completion tokens are the argmax ones (`--filtered`)."""
    h, w, ids, mask, adv, t = _inputs(tokens, hidden, vocab, greedy=greedy)
    logps_and_entropies = _STEPS[provider]

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


def measure_filtered(tokens: int, hidden: int, runs: int) -> dict[str, Any]:
    """`--filtered`: leaf ops, 1-thread median time and memory beyond the gradients of each of
    `FILTERED_PROVIDERS`, side by side in one process (memory: a fresh process per figure)."""
    steps = {p: build(p, tokens, hidden, greedy=True) for p in FILTERED_PROVIDERS}
    torch.set_num_threads(1)
    ops = {p: leaf_ops(s) for p, s in steps.items()}
    t1 = alternate_times(steps, 1, runs)
    grads = (COMPLETIONS * (tokens // COMPLETIONS + 1) + VOCAB) * hidden * 4
    mem = {
        p: rss.peak_rss_extra_bytes("benchmarks.bench_trainer_step:build", {"provider": p, "tokens": tokens,
                                                                            "hidden": hidden, "greedy": True}) - grads
        for p in FILTERED_PROVIDERS
    }  # fmt: skip
    row: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "vocab": VOCAB, "top_k": TOP_K, "top_p": TOP_P}
    for p in FILTERED_PROVIDERS:
        row |= {f"{p}_ops": ops[p], f"{p}_s_1t": round(t1[p], 4), f"{p}_mib_beyond_grads": round(mem[p] / 2**20, 2)}
    for base in ("logits_filtered", "stock"):
        row |= {
            f"time_1t_vs_{base}": round(t1["lossfx_filtered"] / t1[base], 3),
            f"memory_vs_{base}": round(mem["lossfx_filtered"] / max(1, mem[base]), 4),
        }
    return row


def markdown_filtered(rows: list[dict[str, Any]], env: dict[str, Any], wall_s: float, command: str) -> str:
    lines = [
        f"Measured {env['date']} on {env['machine']} (CPU {env.get('cpu_model') or 'unknown'}), torch "
        f"{env['torch']}, trl {env['trl']}, 1-minute load average {env['load_1min']:.1f} at the start; "
        f"`{command}` took {wall_s:.0f} s. One GRPO loss step past the backbone scoring the sampler's "
        f"top-k {TOP_K} / top-p {TOP_P} (entropies unfiltered), fp32, V = {VOCAB}, {COMPLETIONS} completions "
        "of N/4 tokens; stock = TRL's unfiltered fused head (for scale), logits = the `[B, T+1, V]` logits "
        "path, lossfx = the fused filtered path.",
        "",
        "| H | N | leaf ops lossfx / logits / stock | s, 1 thread lossfx / logits / stock | ÷ logits | ÷ stock "
        "| MiB beyond grads lossfx / logits / stock | ÷ logits | ÷ stock |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hidden']} | {r['tokens']} "
            f"| {r['lossfx_filtered_ops']} / {r['logits_filtered_ops']} / {r['stock_ops']} "
            f"| {r['lossfx_filtered_s_1t']:.3f} / {r['logits_filtered_s_1t']:.3f} / {r['stock_s_1t']:.3f} "
            f"| {r['time_1t_vs_logits_filtered']:.2f} | {r['time_1t_vs_stock']:.2f} "
            f"| {r['lossfx_filtered_mib_beyond_grads']:.1f} / {r['logits_filtered_mib_beyond_grads']:.1f} / "
            f"{r['stock_mib_beyond_grads']:.1f} | {r['memory_vs_logits_filtered']:.3f} | {r['memory_vs_stock']:.3f} |"
        )
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--filtered", action="store_true", help="score under the sampler's top-k/top-p (issue 26)")
    parser.add_argument("--name", default=None, help="results stem (trainer_step, or trainer_step_filtered)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    hiddens = args.hiddens or (QUICK["hiddens"] if args.quick else HIDDENS)
    tokens = args.tokens or (QUICK["tokens"] if args.quick else TOKENS)
    from importlib.metadata import version

    env = {**measure.environment(), "trl": version("trl"), "load_1min": os.getloadavg()[0]}
    command = "python -m benchmarks.bench_trainer_step " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = Path(args.out) / (args.name or ("trainer_step_filtered" if args.filtered else "trainer_step"))
    measure_one, table = (measure_filtered, markdown_filtered) if args.filtered else (measure_shape, markdown)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for hidden in hiddens:
        for n in tokens:
            row = measure_one(n, hidden, args.runs)
            rows.append(row)
            print(row, flush=True)
            wall = time.perf_counter() - start
            meta = {"environment": env, "goals": GOALS, "command": command, "wall_s": round(wall, 1)}
            measure.write_results(stem, rows, meta, quiet=True)
            (stem.parent / f"{stem.name}.md").write_text(table(rows, env, wall, command))
    print(table(rows, env, time.perf_counter() - start, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
