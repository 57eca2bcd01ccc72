"""Benchmark of the DISTILLATION branch (top-k distillation inputs): lossfx against dense baselines.

    python -m benchmarks.bench_distillation                  # [1, 2048, 151936] fp32, K = 64
    python -m benchmarks.bench_distillation --quick --out /tmp/b

Providers, side by side in one process, forward + backward (`torch.autograd.grad` of a weighted
sum of `student_topk_logprobs` and `H_all` with respect to the student logits):

    lossfx-eager     prepare_loss_input(DISTILLATION, zero_outside_topk=True, kl_type="reverse")
    lossfx-compiled  the same under torch.compile(fullgraph=True)
    dense-eager      lp = log_softmax(z.float()); lp.gather(ids), (lp.exp() * lp).sum(-1)
    dense-compiled   the same dense code under torch.compile(fullgraph=True)

Target (issue #6): peak extra memory at most 1.3x the student logits (the gradient alone is 1x).
Results: `<out>/distillation.{csv,json}`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lossfx", "inductor")
    )
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import lossfx
from benchmarks import measure

DEFAULT_SHAPE, QUICK_SHAPE = (1, 2048, 151_936), (2, 16, 257)
LOSS_FN = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True, kl_type="reverse")


def dense(logits, data):
    lp = logits.float().log_softmax(-1)
    student = lp.gather(-1, data["teacher_topk_indices"])[:, :-1]
    return student, (lp.exp() * lp).sum(-1)[:, :-1]


def with_lossfx(logits, data):
    out, _ = lossfx.prepare_loss_input(logits, data, LOSS_FN)
    return out["student_topk_logprobs"], out["H_all"]


PROVIDERS = ("lossfx-eager", "lossfx-compiled", "dense-eager", "dense-compiled")


def build(provider: str, shape: list[int], k: int, dtype: str):
    """Zero-argument fwd+bwd of `provider` (the `benchmarks.rss` builder: inputs built here, seeded)."""
    batch, seq, vocab = shape
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 2).to(getattr(torch, dtype)).requires_grad_()
    data = {
        "teacher_topk_logits": torch.randn(batch, seq, k, generator=gen),
        "teacher_topk_indices": torch.randint(0, vocab, (batch, seq, k), generator=gen),
    }
    g_student = torch.randn(batch, seq - 1, k, generator=gen)
    g_entropy = torch.randn(batch, seq - 1, generator=gen)
    fn = with_lossfx if provider.startswith("lossfx") else dense
    if provider.endswith("compiled"):
        fn = torch.compile(fn, fullgraph=True)

    def run():
        student, neg_entropy = fn(logits, data)
        loss = (student * g_student).sum() + (neg_entropy * g_entropy).sum()
        return torch.autograd.grad(loss, logits)[0]

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--min-run-time", type=float, default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    batch, seq, vocab = QUICK_SHAPE if args.quick else DEFAULT_SHAPE
    k = min(args.k, vocab)
    spec = {"shape": [batch, seq, vocab], "k": k, "dtype": args.dtype}
    providers = {name: ("benchmarks.bench_distillation:build", {"provider": name, **spec}) for name in args.providers}
    logits_bytes = batch * seq * vocab * getattr(torch, args.dtype).itemsize
    rows = measure.compare_providers(
        providers,
        logits_bytes=logits_bytes,
        min_run_time=args.min_run_time if args.min_run_time is not None else (0.05 if args.quick else 1.0),
        common={
            "op": "distillation",
            "mode": "fwd+bwd",
            "shape": f"{batch}x{seq}x{vocab}",
            "k": k,
            "dtype": args.dtype,
        },
        baseline="dense-compiled" if "dense-compiled" in providers else None,
    )
    measure.write_results(Path(args.out) / "distillation", rows, {"logits_bytes": logits_bytes, "target_peak_x": 1.3})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
