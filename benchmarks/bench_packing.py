"""Benchmark of packed next-token log-probs against unpacking, then the unpacked path.

    python -m benchmarks.bench_packing                        # 8 sequences packed in T = 2048, V = 151936
    python -m benchmarks.bench_packing --quick --out /tmp/b

Providers, side by side in one process, forward + backward with respect to the packed logits:

    packed-eager / packed-compiled        prepare_packed_loss_input(LOGPROB) on the packed row
    unpack-then-unpacked-eager / -compiled  copy every sequence into a padded [B, S, V] tensor, then
                                            prepare_loss_input(LOGPROB) (what one does without it)

Results: `<out>/packing.{csv,json}`.
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

LOSS_FN = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)


PROVIDERS = ("packed-eager", "packed-compiled", "unpack-then-unpacked-eager", "unpack-then-unpacked-compiled")


def _layout(quick: bool) -> tuple[int, int, list[int]]:
    """`(vocab, total, cu_seqlens)` of the packed row (seeded)."""
    vocab, total, n_seqs = (257, 64, 3) if quick else (151_936, 2048, 8)
    gen = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(total - 1, generator=gen)[: n_seqs - 1].add(1).tolist())
    return vocab, total, [0, *cuts, total]


def packed(logits, input_ids, cu):
    out, _ = lossfx.prepare_packed_loss_input(logits, {"input_ids": input_ids}, LOSS_FN, cu, cu)
    return out["next_token_logprobs"]


def unpack_then_unpacked(logits, input_ids, cu):
    width = input_ids.shape[1]
    rows = [
        torch.nn.functional.pad(logits[0, start:end], (0, 0, 0, width - (end - start)))
        for start, end in zip(cu[:-1], cu[1:])
    ]
    out, _ = lossfx.prepare_loss_input(torch.stack(rows), {"input_ids": input_ids}, LOSS_FN)
    return out["next_token_logprobs"]


def build(provider: str, quick: bool, dtype: str):
    """Zero-argument fwd+bwd of `provider` (the `benchmarks.rss` builder: inputs built here, seeded)."""
    vocab, total, cu = _layout(quick)
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=gen)
    logits = (torch.randn(1, total, vocab, generator=gen) * 2).to(getattr(torch, dtype)).requires_grad_()
    dout = torch.randn(len(lengths), max(lengths) - 1, generator=gen)
    fn = packed if provider.startswith("packed") else unpack_then_unpacked
    layout = torch.tensor(cu) if provider.startswith("packed") else cu
    if provider.endswith("compiled"):
        fn = torch.compile(fn, fullgraph=True)
    return lambda: torch.autograd.grad((fn(logits, input_ids, layout) * dout).sum(), logits)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--min-run-time", type=float, default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    vocab, total, cu = _layout(args.quick)
    providers = {
        name: ("benchmarks.bench_packing:build", {"provider": name, "quick": args.quick, "dtype": args.dtype})
        for name in args.providers
    }
    logits_bytes = total * vocab * getattr(torch, args.dtype).itemsize
    baseline = "unpack-then-unpacked-eager"
    rows = measure.compare_providers(
        providers,
        logits_bytes=logits_bytes,
        min_run_time=args.min_run_time if args.min_run_time is not None else (0.05 if args.quick else 1.0),
        common={
            "op": "packed_logprob",
            "mode": "fwd+bwd",
            "shape": f"1x{total}x{vocab}",
            "sequences": len(cu) - 1,
            "dtype": args.dtype,
        },
        baseline=baseline if baseline in providers else None,
    )
    measure.write_results(Path(args.out) / "packing", rows, {"logits_bytes": logits_bytes, "cu_seqlens": cu})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
