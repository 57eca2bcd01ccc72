"""Kernel-launching aten ops per forward + backward of every fused hidden × LM-head path (issue 17).

    python -m benchmarks.bench_launches                     # [1, 16384, 151936] under the GPU policy
    python -m benchmarks.bench_launches --tokens 2048 --vocab 32000 --policy cpu

On a GPU every eager op is a kernel launch (~5 µs), so the count of launching ops bounds a step's
launch overhead. It is counted here without a GPU and without the arithmetic: the tensors live on
the `meta` device (shapes, no values), the device policy is forced with `chunk_policy`, and a
`TorchDispatchMode` counts every aten op that reaches it, inside the tile engine's custom ops too
(their bodies are re-entered under the mode). The per-tile arithmetic is counted eager, op by op,
also where the policy compiles it (`compile_tiles`: on `meta` tensors it runs eagerly), so the
count is an upper bound: compiled, each tile's arithmetic is one or two kernels. Not counted: views
and other aliasing ops (`view`, `slice`, `select`, `t`, `expand`, ...), allocations without a fill
(`empty*`), `detach`, and the custom ops themselves (their bodies are). The matmuls count. The
count does not depend on `H` (the tile shapes depend on `H` only through bf16/fp16 weights, and
then only once `H > tile_bytes / (4 · max_block)`): `--hidden` shows it.

Results: the table on stdout and `<out>/launches.{json,md}` with `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

import lossfx
from lossfx._core.chunking import CPU_POLICY, GPU_POLICY, ChunkPolicy, chunk_policy
from lossfx.divergence import divergence_to_projected_teacher
from lossfx.opd_full import OnPolicyDistillationFullConfig

# ops that launch nothing: allocation without a fill, autograd bookkeeping, metadata
K_DISTILL = 64  # teacher top-k of the front door's DISTILLATION (as `bench_ops`)
_SILENT = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh"}


def _launches(func: Any) -> bool:
    schema = func._schema
    if schema.name.split("::")[0] != "aten" or func.__name__.split(".")[0] in _SILENT:
        return False
    returns = schema.returns
    view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return not view


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel-launching aten ops run under it (`counts`: op name -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name.startswith("lossfx::"):  # an opaque tile loop: count its body
            body = OPDEFS[func._schema.name]._init_fn
            with self:
                return body(*args, **kwargs)
        if _launches(func):
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _inputs(tokens: int, hidden: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    gen = {"device": device}
    return {
        "hidden": torch.randn(tokens, hidden, **gen),
        "weight": torch.randn(vocab, hidden, **gen),
        "target": torch.zeros(tokens, dtype=torch.int64, **gen),
        "ids": torch.zeros(tokens, 2, dtype=torch.int64, **gen),
        "coef": torch.ones(tokens, **gen),
        "student": torch.randn(tokens, vocab, **gen),
        "topk_logits": torch.randn(1, tokens, K_DISTILL, **gen),
        "topk_ids": torch.zeros(1, tokens, K_DISTILL, dtype=torch.int64, **gen),
        "draft_logits": torch.randn(1, tokens, vocab // 4, **gen),
        "d2t": torch.zeros(vocab // 4, dtype=torch.int64, **gen),
        "teacher_logits": torch.randn(1, tokens, vocab, **gen),
        "teacher_hidden": torch.randn(1, tokens, hidden, **gen),
        "teacher_index": torch.zeros(1, dtype=torch.int64, **gen),
        "teacher_weight": torch.randn(vocab, hidden, **gen),
    }


def _paths() -> dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    """Each path's forward and backward: a scalar to call `.backward()` on, from leaf inputs."""

    def projected(kind: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        return lambda x: divergence_to_projected_teacher(kind, x["student"], x["hidden"], [x["weight"]]).sum()

    return {
        "linear_token_logprobs": lambda x: lossfx.linear_token_logprobs(x["hidden"], x["weight"], x["target"]).sum(),
        "linear_token_logprobs (+ neg_entropy)": lambda x: sum(
            y.sum()
            for y in lossfx.linear_token_logprobs(x["hidden"], x["weight"], x["target"], return_neg_entropy=True)
        ),
        "linear_gather_logprobs (K = 2)": lambda x: lossfx.linear_gather_logprobs(x["hidden"], x["weight"], x["ids"])[
            0
        ].sum(),
        "linear_next_token_logprobs": lambda x: lossfx.linear_next_token_logprobs(
            x["hidden"][None], x["weight"], x["target"][None]
        ).sum(),
        "linear_logprob_objective": lambda x: lossfx.linear_logprob_objective(
            x["hidden"], x["weight"], x["target"], x["coef"]
        )[0],
        "linear_logprob_objective (+ entropy)": lambda x: lossfx.linear_logprob_objective(
            x["hidden"], x["weight"], x["target"], x["coef"], neg_entropy_weight=x["coef"]
        )[0],
        "projected teacher, cross_entropy": projected("cross_entropy"),
        "projected teacher, reverse_kl": projected("reverse_kl"),
    }


def _front_door(loss_fn: Any, sampling_params: Any = None, **columns: str) -> Callable[[dict[str, torch.Tensor]], Any]:
    """`prepare_linear_loss_input` on `[1, N, H]` hidden states: the sum of its differentiable outputs."""

    def call(x: dict[str, torch.Tensor]) -> torch.Tensor:
        data = {"input_ids": x["target"][None], "token_mask": x["coef"][None], **{k: x[v] for k, v in columns.items()}}
        heads = {0: x["teacher_weight"]} if "teacher_full_hidden_states" in data else None
        out, _ = lossfx.prepare_linear_loss_input(
            x["hidden"][None],
            x["weight"],
            data,
            loss_fn,
            sampling_params=sampling_params,
            d2t=x.get("d2t"),
            teacher_output_layer_weight_by_index=heads,
        )
        grads = [v for v in out.values() if isinstance(v, torch.Tensor) and v.requires_grad]
        total = sum(v.float().sum() for v in grads)
        if not grads:  # DRAFT: detached targets (no backward); a zero-gradient leaf keeps `.backward()` valid
            total = (x["hidden"] * 0).sum() + sum(v.float().sum() for v in out.values() if isinstance(v, torch.Tensor))
        return total

    return call


def issue26_paths() -> dict[str, Callable[[dict[str, torch.Tensor]], Any]]:
    """Issue 26's kernels and every branch of the hidden-state front door."""
    logprob = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    distill = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True)
    top_kp = lossfx.TrainingSamplingParams(top_k=50, top_p=0.9)
    top_p = lossfx.TrainingSamplingParams(top_p=0.9)

    def opd_full(payload: str) -> SimpleNamespace:
        config = OnPolicyDistillationFullConfig(enabled=True, teacher_payload=payload)
        return SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=config)

    def filtered(**kw: Any) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        return lambda x: lossfx.linear_filtered_token_logprobs(x["hidden"], x["weight"], x["target"], **kw).sum()

    def divergence(x: dict[str, torch.Tensor]) -> torch.Tensor:
        out = lossfx.linear_divergence_to_teacher(x["hidden"], x["weight"], teacher_logits=x["student"].detach())
        return sum(y.sum() for y in out)

    return {
        "linear_filtered_token_logprobs top-k 50, top-p 0.9": filtered(top_k=50, top_p=0.9),
        "linear_filtered_token_logprobs top-p 0.9": filtered(top_p=0.9),
        "linear_divergence_to_teacher (teacher logits)": divergence,
        "prepare_linear_loss_input LOGPROB": _front_door(logprob),
        "prepare_linear_loss_input LOGPROB top-k 50, top-p 0.9": _front_door(logprob, top_kp),
        "prepare_linear_loss_input LOGPROB top-p 0.9": _front_door(logprob, top_p),
        f"prepare_linear_loss_input DISTILLATION (K = {K_DISTILL})": _front_door(
            distill, teacher_topk_logits="topk_logits", teacher_topk_indices="topk_ids"
        ),
        "prepare_linear_loss_input OPD_FULL (teacher logits)": _front_door(
            opd_full("logits"), teacher_full_logits="teacher_logits"
        ),
        "prepare_linear_loss_input OPD_FULL (teacher hidden states)": _front_door(
            opd_full("hidden_states"),
            teacher_full_hidden_states="teacher_hidden",
            opd_full_teacher_index="teacher_index",
        ),
        "prepare_linear_loss_input DRAFT (targets: no backward)": _front_door(
            SimpleNamespace(input_type=lossfx.LossInputType.DRAFT), student_logits="draft_logits"
        ),
    }


def count(
    path: str, tokens: int, hidden: int, vocab: int, policy: ChunkPolicy, dtype: torch.dtype = torch.float32
) -> Counter[str]:
    """Launching ops of one forward + backward of `path` (meta tensors, `policy` forced)."""
    x = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _inputs(tokens, hidden, vocab, "meta").items()}
    for name in ("hidden", "weight", "student"):
        x[name].requires_grad_()
    fn = {**_paths(), **issue26_paths()}[path]
    with chunk_policy(policy), LaunchCounter() as counter:
        fn(x).backward()
    return counter.counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--policy", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    policy = GPU_POLICY if args.policy == "gpu" else CPU_POLICY
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    rows = []
    for path in [*_paths(), *issue26_paths()]:
        totals = [sum(count(path, args.tokens, h, args.vocab, policy, dtype).values()) for h in args.hidden]
        rows.append({"path": path, **{f"H={h}": t for h, t in zip(args.hidden, totals, strict=True)}})
    head = f"[1, {args.tokens}, {args.vocab}] {args.dtype}, {args.policy.upper()} policy, fwd+bwd launching aten ops"
    cols = [f"H={h}" for h in args.hidden]
    lines = [f"| path | {' | '.join(cols)} |", "|---|" + "---|" * len(cols)]
    lines += [f"| {r['path']} | {' | '.join(str(r[c]) for c in cols)} |" for r in rows]
    print(head)
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "launches.json").write_text(
            json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
        )
        (args.out / "launches.md").write_text(head + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
