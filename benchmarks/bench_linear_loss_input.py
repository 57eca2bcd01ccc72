"""The hidden-state front door (issue 26): `prepare_linear_loss_input` against `prepare_loss_input(h @ W.T)`.

    python -m benchmarks.bench_linear_loss_input                        # N=2048, H=512, V=32000, fp32
    python -m benchmarks.bench_linear_loss_input --quick --out /tmp/b    # tiny shapes: a smoke run
    python -m benchmarks.bench_linear_loss_input --vocab 151936 --no-memory

Per branch (`logprob`: unfiltered LOGPROB; `distillation`: DISTILLATION with `zero_outside_topk`
and `H_all`, K = 64 teacher ids; `draft`: DRAFT, a draft vocabulary of `V/4` ids; `opd_hidden` /
`opd_logits`: OPD_FULL's reverse KL against a teacher given as hidden states `[N, H]` with a
teacher head `[V, H]`, or as full fp32 logits `[N, V]` (an input, not counted)), side by side
in one run, each a forward + backward of `Σ g · outputs` with respect to `hidden` and `weight`
(DRAFT's teacher logits are detached: forward only):

    linear-eager      lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn)
    linear-compiled   the same under torch.compile(fullgraph=True)
    logits-compiled   lossfx.prepare_loss_input(hidden @ weight.T, data, loss_fn) under torch.compile(fullgraph=True)

Reported: median time (`measure.time_call`), time ÷ `logits-compiled`, and the peak resident
memory beyond the inputs (a fresh process each, `benchmarks.rss`) less what the call returns (the
gradients and the outputs), in units of one fp32 logits tensor `N·V·4` (target ≤ 0.1×).
Results: `<out>/linear_loss_input.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import lossfx
from benchmarks.measure import time_call
from benchmarks.rss import peak_rss_extra_bytes

BRANCHES = ("logprob", "distillation", "draft", "opd_hidden", "opd_logits")
PROVIDERS = ("linear-eager", "linear-compiled", "logits-compiled")
TOPK = 64


def _inputs(branch: str, n: int, hidden_size: int, vocab: int, dtype: str = "float32") -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    h = (torch.randn(1, n, hidden_size, generator=gen) / hidden_size**0.5).to(dt).requires_grad_(True)
    w = torch.randn(vocab, hidden_size, generator=gen).to(dt).requires_grad_(True)
    kwargs: dict[str, Any] = {}
    if branch == "logprob":
        data: dict[str, Any] = {"input_ids": torch.randint(0, vocab, (1, n), generator=gen)}
        loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    elif branch == "distillation":
        data = {
            "teacher_topk_logits": torch.randn(1, n, TOPK, generator=gen).to(dt),
            "teacher_topk_indices": torch.randint(0, vocab, (1, n, TOPK), generator=gen),
        }
        loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True)
    elif branch.startswith("opd"):
        data, loss_fn, kwargs = _opd_inputs(branch, gen, n, hidden_size, vocab)
        data["input_ids"] = torch.randint(0, vocab, (1, n), generator=gen)
    else:
        draft = vocab // 4
        data = {"token_mask": torch.ones(1, n), "student_logits": torch.randn(1, n, draft, generator=gen).to(dt)}
        loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)
        kwargs["d2t"] = torch.randint(0, vocab - draft, (draft,), generator=gen).sort().values
    return h, w, data, loss_fn, kwargs


def _opd_inputs(branch: str, gen: torch.Generator, n: int, hidden_size: int, vocab: int) -> tuple[Any, ...]:
    """OPD_FULL's teacher payload (hidden states and one teacher head, or fp32 logits) and config."""
    from lossfx.opd_full import OnPolicyDistillationFullConfig

    payload = "hidden_states" if branch == "opd_hidden" else "logits"
    cfg = OnPolicyDistillationFullConfig(enabled=True, teacher_payload=payload)
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=cfg)
    if payload == "logits":
        return {"teacher_full_logits": torch.randn(1, n, vocab, generator=gen)}, loss_fn, {}
    teacher = {0: torch.randn(vocab, hidden_size, generator=gen)}
    data = {"teacher_full_hidden_states": torch.randn(1, n, hidden_size, generator=gen) / hidden_size**0.5}
    return data, loss_fn, {"teacher_output_layer_weight_by_index": teacher}


KEYS = {
    "opd_hidden": ("opd_full_divergence",),
    "opd_logits": ("opd_full_divergence",),
    "logprob": ("next_token_logprobs",),
    "distillation": ("student_topk_logprobs", "H_all"),
    "draft": ("teacher_logits",),
}


def _outputs(out: dict[str, Any], branch: str) -> list[torch.Tensor]:
    return [out[k] for k in KEYS[branch]]


def build(
    branch: str = "logprob",
    provider: str = "linear-eager",
    n: int = 2048,
    hidden_size: int = 512,
    vocab: int = 32000,
    chunk_size: int | None = None,
    dtype: str = "float32",
) -> Callable[[], Any]:
    """A `benchmarks.rss` builder: one forward + backward of `provider` on `branch`; returns what
    the call hands back (the gradients, or DRAFT's teacher logits)."""
    h, w, data, loss_fn, kwargs = _inputs(branch, n, hidden_size, vocab, dtype)
    linear_kwargs = {**kwargs, "chunk_size": chunk_size}

    def linear(h: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        return _outputs(lossfx.prepare_linear_loss_input(h, w, data, loss_fn, **linear_kwargs)[0], branch)

    def logits(h: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        return _outputs(lossfx.prepare_loss_input(h @ w.T, data, loss_fn, **kwargs)[0], branch)

    fn = linear if provider.startswith("linear") else logits
    if provider.endswith("compiled"):
        fn = torch.compile(fn, fullgraph=True)

    def run() -> Any:
        outs = fn(h, w)
        if branch == "draft":  # detached targets: nothing to differentiate
            return outs
        loss = sum(o.sum() * (i + 1) for i, o in enumerate(outs))
        return torch.autograd.grad(loss, (h, w))

    return run


def _interleaved(branch: str, n: int, hidden_size: int, vocab: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds per provider over `rounds` rounds of one call each, the providers in turn
    (after one warm-up call each): a load that drifts over the run weighs on every provider alike."""
    runs = {p: build(branch, p, n, hidden_size, vocab) for p in PROVIDERS}
    for run in runs.values():
        run()  # warm-up, compile
    samples: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for _ in range(rounds):
        for provider, run in runs.items():
            start = time.perf_counter()
            run()
            samples[provider].append(time.perf_counter() - start)
    return {p: {"median_s": statistics.median(t)} for p, t in samples.items()}


def _returned_bytes(branch: str, n: int, hidden_size: int, vocab: int, itemsize: int = 4) -> int:
    if branch == "draft":
        return n * (vocab // 4) * itemsize  # the teacher logits [N, D]
    return (n * hidden_size + vocab * hidden_size) * itemsize  # dhidden, dweight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory figures")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per provider (>= 1 call)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--branches", nargs="+", default=list(BRANCHES), choices=BRANCHES, help="a subset of the branches"
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help="time the providers interleaved, this many rounds (a loaded machine)"
    )
    args = parser.parse_args()
    n, hidden_size, vocab = (64, 32, 512) if args.quick else (args.n, args.hidden, args.vocab)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logits_bytes = n * vocab * 4
    rows = []
    for branch in args.branches:
        if args.rounds:
            times = _interleaved(branch, n, hidden_size, vocab, args.rounds)
        else:
            times = {}
            for provider in PROVIDERS:
                times[provider] = time_call(build(branch, provider, n, hidden_size, vocab), min_run_time=args.min_time)
        for provider in PROVIDERS:
            row: dict[str, Any] = {
                "branch": branch,
                "provider": provider,
                "median_ms": round(1e3 * times[provider]["median_s"], 1),
                "x_logits_compiled": round(times[provider]["median_s"] / times["logits-compiled"]["median_s"], 2),
            }
            if not args.no_memory:
                kwargs = {"branch": branch, "provider": provider, "n": n, "hidden_size": hidden_size, "vocab": vocab}
                peak = peak_rss_extra_bytes("benchmarks.bench_linear_loss_input:build", kwargs)
                beyond = peak - _returned_bytes(branch, n, hidden_size, vocab)
                row.update(
                    peak_extra_mib=round(peak / 2**20, 1), beyond_returned_x_logits=round(beyond / logits_bytes, 3)
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape": {"N": n, "H": hidden_size, "V": vocab, "dtype": "float32"},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_loss_input.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    head = "| branch | provider | median ms | ÷ logits-compiled | peak extra MiB | beyond returned ÷ fp32 logits |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['branch']} | {r['provider']} | {r['median_ms']} | {r['x_logits_compiled']} | "
            f"{r.get('peak_extra_mib', '')} | {r.get('beyond_returned_x_logits', '')} |"
        )
    (out / "linear_loss_input.md").write_text(json.dumps(meta) + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


def cpu_times(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """`{name: min CPU seconds}` of the callables, run side by side (warm-up, then `rounds` rounds of
    one call each in turn): process CPU time, one thread, so a descheduled thread's wait on a loaded
    machine does not count (a shared cache still does)."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - start)
    return best


def extended(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.bench_linear_loss_input --extended [--vocab V] [--dtype bfloat16] [--branches ...]`:
    per branch, the three providers' minimum CPU time side by side (`cpu_times`) and the linear
    providers' memory (fresh processes; the logits path's is the main table's), appended one JSON
    row per branch to `<out>/linear_loss_input_extended.jsonl`."""
    parser = argparse.ArgumentParser(description=extended.__doc__.splitlines()[0])
    parser.add_argument("--extended", action="store_true")
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--branches", nargs="+", default=list(BRANCHES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, hidden_size, vocab = args.n, args.hidden, args.vocab
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "linear_loss_input_extended.jsonl"
    for branch in args.branches:
        row: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "load_avg_1min": os.getloadavg()[0],
            **{"branch": branch, "N": n, "H": hidden_size, "V": vocab, "dtype": args.dtype},
        }
        if not args.no_time:
            kw = {"n": n, "hidden_size": hidden_size, "vocab": vocab, "dtype": args.dtype}
            best = cpu_times({p: build(branch, p, **kw) for p in PROVIDERS}, args.rounds)
            row["cpu_s"] = {p: round(t, 2) for p, t in best.items()}
            row["x_logits_compiled"] = {p: round(t / best["logits-compiled"], 2) for p, t in best.items()}
        if not args.no_memory:
            for provider in ("linear-eager", "linear-compiled"):
                kw = {"branch": branch, "provider": provider, "n": n, "hidden_size": hidden_size, "vocab": vocab}
                peak = peak_rss_extra_bytes("benchmarks.bench_linear_loss_input:build", {**kw, "dtype": args.dtype})
                beyond = peak - _returned_bytes(branch, n, hidden_size, vocab, itemsize)
                row[f"beyond_returned_x_logits/{provider}"] = round(beyond / (n * vocab * 4), 3)
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    import sys

    if "--extended" in sys.argv:
        extended()
    else:
        main()
