"""Peak extra memory of every lossfx path, eager and compiled, fp32 and bf16 (issue 10, "Done when").

    python -m benchmarks.bench_memory                    # the full table, ~20-40 min on 2 cores
    python -m benchmarks.bench_memory --quick --out /tmp/b   # tiny shape: a smoke run
    python -m benchmarks.bench_memory --paths filtered --dtypes bf16 --modes compiled

Every figure is measured in its own fresh process with `benchmarks.rss.peak_rss_extra_bytes`
(resident high-water mark above the inputs: counts Inductor's buffers, the returned gradient and
everything else), one figure after the other. A figure is one forward + backward
(`torch.autograd.grad` of a fixed random weighted sum of the outputs with respect to the student
logits; DRAFT, which has no gradient, is forward only), reported in units of the student logits'
bytes (their own dtype) against the issue's bound: 1.1x for the one-operand paths (the gradient
alone is 1x), 1.3x for the two-operand divergences. The default shape is `[1, 2048, 151936]`
(Qwen vocabulary); the eager bf16 filtered path is also measured at `[1, 12000, 151936]`.

A guard stops any figure whose process passes `--rss-limit-gib` resident (the row then reads
"> limit"), so a runaway path fails alone on a shared machine. Results: `<out>/<name>.{csv,json,md}`
(`--name`, default `memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache")  # shared by every fresh process
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import lossfx
from benchmarks import measure
from benchmarks.rss import peak_rss_extra_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("eager", "compiled")
DEFAULT_SHAPE = (1, 2048, 151_936)
LONG_SHAPE = (1, 12_000, 151_936)  # the eager bf16 filtered case of issue 10, item 8
QUICK_SHAPE = (1, 64, 4099)  # 1 MiB fp32: big enough that the gradient is its own mapping
TOP_K, TOP_P, DISTILL_K = 50, 0.9, 64
ONE_OPERAND_BOUND, TWO_OPERAND_BOUND = 1.1, 1.3


# path name -> (what is called, bound x logits, has a backward)
PATHS: dict[str, tuple[str, float, bool]] = {
    "logprob": ("prepare_loss_input(LOGPROB): next-token log-probs", ONE_OPERAND_BOUND, True),
    "filtered": (
        f"prepare_loss_input(LOGPROB, TrainingSamplingParams(top_k={TOP_K}, top_p={TOP_P}))",
        ONE_OPERAND_BOUND,
        True,
    ),
    "entropy": ("entropy(logits): Σ p log p per token", ONE_OPERAND_BOUND, True),
    "distillation": (
        f"prepare_loss_input(DISTILLATION, k={DISTILL_K}, zero_outside_topk=False): gather, no entropy",
        ONE_OPERAND_BOUND,
        True,
    ),
    "distillation+entropy": (
        f"prepare_loss_input(DISTILLATION, k={DISTILL_K}, zero_outside_topk=True, reverse): gather + H_all",
        ONE_OPERAND_BOUND,
        True,
    ),
    "reverse_kl": ("reverse_kl_to_fixed(student, teacher): two operands", TWO_OPERAND_BOUND, True),
    "cross_entropy": ("cross_entropy_to_fixed(student, teacher): two operands", TWO_OPERAND_BOUND, True),
    "draft": ("prepare_loss_input(DRAFT, d2t=None): forward only, output is a logits-sized copy", 1.1, False),
}


def _loss_fn(input_type: lossfx.LossInputType, **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(input_type=input_type, **fields)


def _path_function(path: str, shape: tuple[int, int, int], gen: torch.Generator) -> tuple[Callable, dict[str, Any]]:
    """`(fn, extra)`: `fn(logits, **extra)` returns the path's differentiable outputs (a tuple)."""
    batch, seq, vocab = shape
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    if path in ("logprob", "filtered"):
        sampling = lossfx.TrainingSamplingParams(top_k=TOP_K, top_p=TOP_P) if path == "filtered" else None
        data = {
            "input_ids": input_ids,
            "token_mask": torch.ones(batch, seq),
            "sample_mask": torch.ones(batch),
        }

        logprob_fn = _loss_fn(lossfx.LossInputType.LOGPROB)

        def logprob(logits, data):
            out, _ = lossfx.prepare_loss_input(logits, data, logprob_fn, sampling_params=sampling)
            return (out["next_token_logprobs"],)

        return logprob, {"data": data}
    if path == "entropy":
        return (lambda logits: (lossfx.neg_entropy(logits),)), {}
    if path.startswith("distillation"):
        k = min(DISTILL_K, vocab)
        data = {
            "teacher_topk_logits": torch.randn(batch, seq, k, generator=gen),
            "teacher_topk_indices": torch.randint(0, vocab, (batch, seq, k), generator=gen),
        }
        loss_fn = _loss_fn(
            lossfx.LossInputType.DISTILLATION, zero_outside_topk=path.endswith("entropy"), kl_type="reverse"
        )

        def distillation(logits, data):
            out, _ = lossfx.prepare_loss_input(logits, data, loss_fn)
            return tuple(out[key] for key in ("student_topk_logprobs", "H_all") if out[key] is not None)

        return distillation, {"data": data}
    if path in ("reverse_kl", "cross_entropy"):
        kernel = lossfx.reverse_kl_to_fixed if path == "reverse_kl" else lossfx.cross_entropy_to_fixed
        return (lambda logits, teacher: (kernel(logits, teacher),)), {}
    if path == "draft":
        data = {"student_logits": torch.zeros(()), "token_mask": torch.ones(batch, seq)}

        draft_fn = _loss_fn(lossfx.LossInputType.DRAFT)

        def draft(logits, data):
            out, _ = lossfx.prepare_loss_input(logits, data, draft_fn)
            return (out["teacher_logits"],)

        return draft, {"data": data}
    raise KeyError(f"unknown path {path!r}; known: {', '.join(PATHS)}")


def build(path: str, shape: list[int], dtype: str, mode: str, rss_limit_bytes: int | None = None) -> Callable[[], Any]:
    """The zero-argument fwd(+bwd) call of `path` (the `benchmarks.rss` builder; inputs built here)."""
    if rss_limit_bytes is not None:
        measure.guard_resident_memory(rss_limit_bytes)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batch, seq, vocab = shape
    logits = measure.random_logits((batch, seq, vocab), DTYPES[dtype], seed=0, scale=3.0)
    fn, extra = _path_function(path, (batch, seq, vocab), gen)
    if path in ("reverse_kl", "cross_entropy"):
        extra["teacher"] = measure.random_logits((batch, seq, vocab), DTYPES[dtype], seed=2, scale=3.0)
    if mode == "compiled":
        fn = torch.compile(fn, fullgraph=True)
    if path in ("logprob", "filtered"):
        # half the scored tokens are the row's argmax, so most filtered log-probs are finite
        best = logits[:, :-1].argmax(-1)
        pick = torch.rand(best.shape, generator=gen) < 0.5
        ids = extra["data"]["input_ids"]
        ids[:, 1:] = torch.where(pick, best, ids[:, 1:])
    if not PATHS[path][2]:
        return lambda: fn(logits, **extra)
    logits.requires_grad_(True)
    upstream: list[torch.Tensor] = []

    def fwd_bwd() -> torch.Tensor:
        outputs = fn(logits, **extra)
        if not upstream:  # fixed random weights, made once (in the warm-up call)
            upstream.extend(torch.randn(o.shape, generator=gen) for o in outputs)
        # -inf log-probs (filtered out) get no weight: their gradient is zero either way
        loss = sum((torch.where(o.isfinite(), o.float(), 0.0) * w).sum() for o, w in zip(outputs, upstream))
        return torch.autograd.grad(loss, logits)[0]

    return fwd_bwd


def figures(
    paths: list[str], dtypes: list[str], modes: list[str], shape: tuple[int, int, int], long_shape: bool
) -> list[dict[str, Any]]:
    """The table's rows to measure, in order (the long filtered case last)."""
    rows = [{"path": p, "dtype": d, "mode": m, "shape": list(shape)} for p in paths for d in dtypes for m in modes]
    if long_shape and "filtered" in paths:
        rows.append({"path": "filtered", "dtype": "bf16", "mode": "eager", "shape": list(LONG_SHAPE)})
    return rows


def measure_figure(spec: dict[str, Any], rss_limit_bytes: int) -> dict[str, Any]:
    """One row: the peak of `spec` in a fresh process, its ratio to the logits and the bound."""
    batch, seq, vocab = spec["shape"]
    logits_bytes = batch * seq * vocab * DTYPES[spec["dtype"]].itemsize
    what, bound, _ = PATHS[spec["path"]]
    start = time.perf_counter()
    try:
        peak: int | None = peak_rss_extra_bytes(
            "benchmarks.bench_memory:build", {**spec, "rss_limit_bytes": rss_limit_bytes}
        )
        note = ""
    except RuntimeError as err:
        peak = None
        limited = measure.RSS_LIMIT_MESSAGE in str(err)
        detail = " ".join(str(err).split())[-300:].replace("|", "/")
        note = f"stopped: resident set > {rss_limit_bytes / 2**30:.0f} GiB" if limited else f"failed: {detail}"
    ratio = None if peak is None else peak / logits_bytes
    return {
        "path": spec["path"],
        "dtype": spec["dtype"],
        "mode": spec["mode"],
        "shape": "x".join(map(str, spec["shape"])),
        "what": what,
        "peak_extra_mib": None if peak is None else round(peak / 2**20, 1),
        "logits_mib": round(logits_bytes / 2**20, 1),
        "peak_x_logits": None if ratio is None else round(ratio, 3),
        "bound_x_logits": bound,
        "pass": ratio is not None and ratio <= bound,
        "note": note,
        "seconds": round(time.perf_counter() - start, 1),
    }


def profiler_discrepancy(paths: list[str], dtype: str, shape: tuple[int, int, int]) -> list[dict[str, Any]]:
    """The same figures by the profiler's allocation events (this process) and by `rss.py` (fresh ones).

    Shows why published figures use the resident high-water mark: the profiler misses compiled
    code's buffers (README "Memory method").
    """
    out = []
    for path in paths:
        for mode in MODES:
            spec = {"path": path, "dtype": dtype, "mode": mode, "shape": list(shape)}
            run = build(**spec)
            run()  # warm-up (compiles)
            profiler = measure.peak_extra_bytes(run)
            del run
            rss = peak_rss_extra_bytes("benchmarks.bench_memory:build", spec)
            logits_bytes = shape[0] * shape[1] * shape[2] * DTYPES[dtype].itemsize
            out.append(
                {
                    **spec,
                    "profiler_x_logits": round(profiler / logits_bytes, 3),
                    "rss_x_logits": round(rss / logits_bytes, 3),
                }
            )
            print(json.dumps(out[-1]), flush=True)
    return out


def markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        f"Measured {env['date']} on {env['machine']} (host `{env['host']}`), torch {env['torch']}, "
        f"Python {env['python']}, lossfx {env['lossfx']}; one fresh process per figure, resident "
        "high-water mark above the inputs (`benchmarks/rss.py`), forward + backward.",
        "",
        "| path | dtype | mode | shape | peak extra MiB | × logits | bound | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak_extra_mib']:.1f}" if r["peak_extra_mib"] is not None else r["note"]
        ratio = f"{r['peak_x_logits']:.2f}" if r["peak_x_logits"] is not None else "—"
        lines.append(
            f"| {r['path']} | {r['dtype']} | {r['mode']} | {r['shape']} | {peak} | {ratio} "
            f"| ≤ {r['bound_x_logits']} | {'yes' if r['pass'] else '**no**'} |"
        )
    lines += ["", "Paths:", ""] + [f"- `{name}`: {what}" for name, (what, _, _) in PATHS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"shape {QUICK_SHAPE}, no long case: a smoke run")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--no-long", action="store_true", help=f"skip the eager bf16 filtered {LONG_SHAPE} case")
    parser.add_argument("--long-only", action="store_true", help=f"only the eager bf16 filtered {LONG_SHAPE} case")
    parser.add_argument(
        "--merge", nargs="+", metavar="STEM", help="combine finished result files <out>/STEM.json into <out>/<name>"
    )
    parser.add_argument(
        "--compare-profiler", action="store_true", help="--paths by the profiler and by rss.py, at [4, 512, 32000]"
    )
    parser.add_argument("--rss-limit-gib", type=float, default=12.0, help="stop a figure past this resident size")
    parser.add_argument("--name", default="memory", help="result file stem")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    stem = Path(args.out) / args.name
    if args.merge:  # parts measured by separate runs (e.g. in parallel): one table
        docs = [json.loads((Path(args.out) / f"{part}.json").read_text()) for part in args.merge]
        rows = [row for doc in docs for row in doc["results"]]
        env = docs[0]["environment"]
        measure.write_results(stem, rows, {"environment": env, "method": docs[0]["method"], "parts": args.merge})
        (stem.parent / f"{stem.name}.md").write_text(markdown(rows, env))
        print(markdown(rows, env))
        return 0
    if args.compare_profiler:
        rows = profiler_discrepancy(args.paths, args.dtypes[0], QUICK_SHAPE if args.quick else (4, 512, 32_000))
        measure.write_results(stem, rows, {"environment": measure.environment()})
        return 0
    shape = QUICK_SHAPE if args.quick else DEFAULT_SHAPE
    specs = figures(args.paths, args.dtypes, args.modes, shape, long_shape=not (args.quick or args.no_long))
    if args.long_only:
        specs = [s for s in specs if s["shape"] == list(LONG_SHAPE)]
    env = measure.environment()
    rows = []
    for spec in specs:
        rows.append(measure_figure(spec, int(args.rss_limit_gib * 2**30)))
        r = rows[-1]
        ratio = f"{r['peak_x_logits']:.2f}x" if r["peak_x_logits"] is not None else r["note"]
        print(
            f"{r['path']:>20} {r['dtype']} {r['mode']:>8} {r['shape']:>14}: {ratio} logits "
            f"(bound {r['bound_x_logits']}) {'pass' if r['pass'] else 'FAIL'}  [{r['seconds']} s]",
            flush=True,
        )
        measure.write_results(stem, rows, {"environment": env, "method": measure.MEMORY_METHOD}, quiet=True)
        (stem.parent / f"{stem.name}.md").write_text(markdown(rows, env))
    print(markdown(rows, env))
    print(f"wrote {stem}.csv, {stem}.json and {stem}.md")
    print(json.dumps({"passed": sum(r["pass"] for r in rows), "figures": len(rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
