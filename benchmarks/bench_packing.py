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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--min-run-time", type=float, default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    vocab, total, n_seqs = (257, 64, 3) if args.quick else (151_936, 2048, 8)
    gen = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(total - 1, generator=gen)[: n_seqs - 1].add(1).tolist())
    cu = [0, *cuts, total]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    width = max(lengths)
    input_ids = torch.randint(0, vocab, (n_seqs, width), generator=gen)
    logits = (torch.randn(1, total, vocab, generator=gen) * 2).to(getattr(torch, args.dtype)).requires_grad_()
    cu_tensor = torch.tensor(cu)
    dout = torch.randn(n_seqs, width - 1, generator=gen)

    def packed(logits, input_ids, cu):
        out, _ = lossfx.prepare_packed_loss_input(logits, {"input_ids": input_ids}, LOSS_FN, cu, cu)
        return out["next_token_logprobs"]

    def unpack_then_unpacked(logits, input_ids, cu):
        rows = [
            torch.nn.functional.pad(logits[0, start:end], (0, 0, 0, width - (end - start)))
            for start, end in zip(cu[:-1], cu[1:])
        ]
        out, _ = lossfx.prepare_loss_input(torch.stack(rows), {"input_ids": input_ids}, LOSS_FN)
        return out["next_token_logprobs"]

    def fwd_bwd(fn, layout):
        return lambda: torch.autograd.grad((fn(logits, input_ids, layout) * dout).sum(), logits)[0]

    providers = {
        "packed-eager": fwd_bwd(packed, cu_tensor),
        "packed-compiled": fwd_bwd(torch.compile(packed, fullgraph=True), cu_tensor),
        "unpack-then-unpacked-eager": fwd_bwd(unpack_then_unpacked, cu),
        "unpack-then-unpacked-compiled": fwd_bwd(torch.compile(unpack_then_unpacked, fullgraph=True), cu),
    }
    logits_bytes = logits.numel() * logits.element_size()
    rows = measure.compare_providers(
        providers,
        logits_bytes=logits_bytes,
        min_run_time=args.min_run_time if args.min_run_time is not None else (0.05 if args.quick else 1.0),
        common={
            "op": "packed_logprob",
            "mode": "fwd+bwd",
            "shape": f"1x{total}x{vocab}",
            "sequences": n_seqs,
            "dtype": args.dtype,
        },
        baseline="unpack-then-unpacked-eager",
    )
    measure.write_results(Path(args.out) / "packing", rows, {"logits_bytes": logits_bytes, "cu_seqlens": cu})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
