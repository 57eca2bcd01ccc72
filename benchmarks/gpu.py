"""The prepared GPU check (issue 17): every path against the float64 reference, then the GRPO step against peers.

    python -m benchmarks.gpu --out /tmp/gpu          # CUDA: checks + timing table, < 5 min on one H200
    python -m benchmarks.gpu --quick                 # fewer shapes and repetitions (~2 min)
    python -m benchmarks.gpu --smoke                 # tiny shapes on the CPU (automatic without CUDA)
    python -m benchmarks.gpu --plant-error token_logprobs   # scale that path's outputs by 1 + 1e-2: must exit 1
    python -m benchmarks.gpu --device cpu --quick --sections checks --backend aot_eager   # quick checks, CPU

(`--paths`, `--dtypes`, `--seed`, `--providers`, `--shapes`, `--reps`, `--budget-*`: see `--help`
and benchmarks/README.md.)

Sections (each prints its elapsed time and stops starting new work past its budget):

1. **checks**: every public path, fp32 and bf16, eager and (a representative subset) compiled with
   `torch.compile(fullgraph=True)`, values and gradients against `lossfx.reference` on the same inputs
   in float64 (exact: the inputs are representable). The rule is the test suite's
   (tests/test_magnitudes.py): lossfx is never less accurate than plain torch on the same inputs,

       |lossfx − truth| <= 2·|torch − truth| + tol,

   where `torch` is the dense formula in torch ops on the inputs upcast to the compute dtype (fp32),
   and `tol` a few roundings of that dtype relative to the size of the terms (`8ε(log V + 1 + |lp|)`
   for a log-prob, `8ε` times the terms of `Σ p w` for a reduction, `8ε|g|·size` plus one rounding
   of the gradient's dtype for a gradient). Logits paths compare element by element. The fused
   head compares Frobenius norms per tensor: its logits come out of a matmul whose rounding (bf16
   output, summation order) neither the truth nor the baseline shares element by element, and a
   norm rule is what tests/test_magnitudes.py uses for random (not exactly constructed) inputs.
   A failed check makes the script exit with status 1.
2. **bench**: one GRPO loss step `Σ c·log p(t)` from hidden states `[N, H]` and an LM head `[V, H]`
   (bf16, `c = −A/N`), forward + backward to `dhidden`, `dweight`, per provider (benchmarks/_linear_builders.py):
   time (CUDA events, warm-up, median of several calls) and peak memory (`max_memory_allocated`
   above what existed before the call; the returned gradients included). Peers that are not
   installed or have no kernel for the device are skipped with the reason.

Results: stdout; with `--out DIR` also `DIR/gpu.json` and `DIR/gpu.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "lossfx", "inductor")
    )
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import Tensor

import lossfx
from benchmarks import _linear_builders as builders
from benchmarks import measure
from lossfx import reference

F64 = torch.float64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PLANT = 1e-2  # relative error planted by --plant-error
TOP_P_MARGIN = 1e-4  # rows whose kept set changes when top_p moves by this much are not compared


@dataclasses.dataclass(frozen=True)
class Config:
    """Shapes and budgets of one run."""

    batch: int  # logits paths: [batch, seq, vocab]
    seq: int
    vocab: int
    hidden: int  # fused paths: [batch·seq, hidden] × [vocab, hidden]
    top_k: int
    top_p: float
    topk_ids: int  # K of the distillation paths
    check_budget_s: float
    bench_shapes: tuple[tuple[int, int, int], ...]  # (N, H, V)
    bench_reps: int
    bench_budget_s: float
    backend: str
    compiled_dtypes: tuple[str, ...] = ("bf16", "fp32")  # the compiled checks' dtypes, in this order


FULL = Config(2, 512, 151_936, 2048, 50, 0.9, 64, 100.0,
              ((8192, 4096, 151_936), (16384, 4096, 151_936), (8192, 4096, 32_000), (16384, 4096, 32_000)),
              5, 130.0, "inductor")  # fmt: skip
QUICK = Config(2, 256, 32_000, 1024, 50, 0.9, 16, 60.0, ((8192, 4096, 151_936), (8192, 4096, 32_000)), 3, 80.0,
               "inductor")  # fmt: skip
SMOKE = Config(2, 8, 67, 16, 20, 0.8, 4, 600.0, ((64, 16, 67),), 1, 600.0, "aot_eager", ("bf16",))


# ---------------------------------------------------------------------------------------------
# Comparison against the float64 truth
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    """`actual` (lossfx), `baseline` (torch) and `truth` (float64) of one output or gradient.

    `rule`: "element" (every entry), "norm" (Frobenius norms) or "exact" (equal to the truth).
    `tol`: broadcastable to the tensors. `ignore`: entries left out (e.g. ambiguous top-p rows).
    """

    what: str
    actual: Tensor
    baseline: Tensor | None
    truth: Tensor
    tol: Tensor | float
    rule: str = "element"
    ignore: Tensor | None = None

    def worst(self) -> float:
        """max over entries of `|lossfx − truth| / (2·|torch − truth| + tol)` (norms for "norm");
        `inf` for a NaN, a shape mismatch or an infinity where the truth has none. Passes at <= 1."""
        a, t = self.actual.detach().to(F64), self.truth.detach().to(F64)
        if a.shape != t.shape or torch.isnan(a).any():
            return math.inf
        keep = torch.ones_like(t, dtype=torch.bool) if self.ignore is None else ~self.ignore.expand_as(t)
        if self.rule == "exact":
            return 0.0 if torch.equal(a[keep], t[keep]) else math.inf
        if not torch.equal(a.isinf() & keep, t.isinf() & keep):
            return math.inf
        finite = torch.isfinite(t) & keep
        b = torch.zeros_like(t) if self.baseline is None else self.baseline.detach().to(F64)
        err_a = torch.where(finite, a - t, 0).abs()
        err_b = torch.where(finite & torch.isfinite(b), b - t, 0).abs()
        tol = torch.where(finite, torch.as_tensor(self.tol, dtype=F64, device=t.device).expand_as(t), 0)
        if self.rule == "norm":
            return float(err_a.norm() / (2 * err_b.norm() + tol.norm()))
        bound = torch.where(finite, 2 * err_b + tol, 1.0)
        return float((err_a / bound).max()) if t.numel() else 0.0


def _finite(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _loss(outs, douts) -> Tensor:
    """`Σ g·o` over the finite entries of every output that has an upstream gradient."""
    return sum((_finite(o) * g.to(o.dtype)).sum() for o, g in zip(outs, douts, strict=True) if g is not None)


def _lp_size(truth: Tensor, vocab: int) -> Tensor:
    return math.log(vocab) + 1 + _finite(truth).abs()


def _reduction_sizes(lps: Tensor, lpt: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(value size `[...]`, gradient size per unit upstream `[..., V]`) of `Σ_v p_v w_v` (float64
    log-probs): the terms before they cancel, as in tests/test_magnitudes.py."""
    p = lps.exp()
    lps, lpt, w = _finite(lps), _finite(lpt), _finite(w)
    sizes = 1 + w.abs() + (p * w.abs()).sum(-1, keepdim=True) + lps.abs() + lpt.abs()
    return 1 + (p * (1 + lps.abs()) * sizes).sum(-1), p * (1 + lps.abs()) * sizes


def _pad_to(x: Tensor, shape: torch.Size) -> Tensor:
    """Zero-pad `x` at the end of each dim to `shape` (outputs of `S − 1` positions against `S` rows)."""
    pad: list[int] = []
    for have, want in zip(reversed(x.shape), reversed(shape), strict=True):
        pad += [0, want - have]
    return torch.nn.functional.pad(x, pad)


# ---------------------------------------------------------------------------------------------
# The logits paths: one runner, one spec per path
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LogitsPath:
    """`call(x, aux)` -> lossfx's outputs (`x` the student logits; plain tensors only);
    `truth(x64, aux)` -> the float64 outputs (`lossfx.reference`); `torch(xc, aux)` -> the dense
    formula on the compute-dtype logits; `sizes(x64, aux, truth)` -> per output `(value size,
    gradient size per unit upstream [..., V or 1])`, the gradient size `None` for an output without
    gradient, the value size `None` for an output compared exactly; `ignore(aux)` -> rows left out."""

    call: Callable[..., tuple[Tensor, ...]]
    truth: Callable[..., tuple[Tensor, ...]]
    torch: Callable[..., tuple[Tensor, ...]]
    sizes: Callable[..., list[tuple[Tensor | None, Tensor | None]]]
    compiled: bool = False  # also checked under torch.compile(fullgraph=True)
    ignore: Callable[..., Tensor | None] = lambda aux: None  # [B, S] rows of the logits left out
    layout: str = "same"  # how output rows map to the logits' [B, S] rows (`to_rows`)


def to_rows(t: Tensor, shape: torch.Size, layout: str) -> Tensor:
    """`[*rows, last]` in an output's row layout -> `[B, S, last]` in the logits' rows (zeros where
    no output row is): "same" `[B, S]`, "rows" `[B·S]`, "shift" `[B, S − 1]`, "packed" `[1, B·S − 1]`."""
    b, s = shape[0], shape[1]
    if layout == "rows":
        return t.reshape(b, s, t.shape[-1])
    if layout == "shift":
        return _pad_to(t, torch.Size((b, s, t.shape[-1])))
    if layout == "packed":
        return _pad_to(t.reshape(-1, t.shape[-1]), torch.Size((b * s, t.shape[-1]))).view(b, s, -1)
    return t


def _lp_sizes(vocab: int):
    """Sizes of log-prob outputs (one per row, no K axis): `log V + 1 + |lp|`, gradient size 1 per row."""

    def sizes(x64, aux, truth):
        return [(_lp_size(t, vocab), torch.ones_like(t)[..., None]) for t in truth]

    return sizes


def _keep_ambiguous(x64: Tensor, top_k: int | None, top_p: float) -> Tensor:
    """`[...]` rows whose kept set (top-k, then top-p) changes when `top_p` moves by the margin."""
    _, lo = reference.apply_top_k_top_p(x64, top_k=top_k, top_p=max(top_p - TOP_P_MARGIN, 1e-6))
    _, hi = reference.apply_top_k_top_p(x64, top_k=top_k, top_p=min(top_p + TOP_P_MARGIN, 1.0))
    return (lo != hi).any(-1)


def logits_paths(cfg: Config) -> dict[str, LogitsPath]:
    v, top_k, top_p = cfg.vocab, cfg.top_k, cfg.top_p
    paths: dict[str, LogitsPath] = {}
    logprob = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)

    # token_logprobs, gather_logprobs: [N, V] rows
    paths["token_logprobs"] = LogitsPath(
        call=lambda x, a: (lossfx.token_logprobs(x.flatten(0, 1), a["target"]),),
        truth=lambda x, a: (reference.token_logprobs(x.flatten(0, 1), a["target"]),),
        torch=lambda x, a: (x.flatten(0, 1).log_softmax(-1).gather(-1, a["target"][:, None])[:, 0],),
        sizes=_lp_sizes(v),
        compiled=True,
        layout="rows",
    )

    def gather_torch(x, a):
        lp = x.log_softmax(-1)
        return lp.gather(-1, a["ids"]), (lp.exp() * lp).sum(-1)

    def gather_sizes(x64, a, t):
        lps = reference.log_softmax(x64)
        return [(_lp_size(t[0], v), torch.ones_like(x64[..., :1])), _reduction_sizes(lps, torch.zeros_like(lps), lps)]

    paths["gather_logprobs"] = LogitsPath(
        call=lambda x, a: lossfx.gather_logprobs(x, a["ids"], with_neg_entropy=True),
        truth=lambda x, a: reference.gather_logprobs(x, a["ids"]),
        torch=gather_torch,
        sizes=gather_sizes,
    )

    # filtered top-k + top-p
    def filtered_torch(x, a):
        keep = a["keep"]
        rows = x.flatten(0, 1).masked_fill(~keep, -math.inf).log_softmax(-1)
        return (rows.gather(-1, a["filtered_target"][:, None])[:, 0],)

    paths["filtered_token_logprobs"] = LogitsPath(
        call=lambda x, a: (
            lossfx.filtered_token_logprobs(x.flatten(0, 1), a["filtered_target"], top_k=top_k, top_p=top_p),
        ),
        truth=lambda x, a: (
            reference.filtered_token_logprobs(x.flatten(0, 1), a["filtered_target"], top_k=top_k, top_p=top_p),
        ),
        torch=filtered_torch,
        sizes=_lp_sizes(v),
        ignore=lambda a: a["ambiguous"],
        layout="rows",
    )

    # full-vocabulary reductions
    def reduction(kind: str) -> LogitsPath:
        fns = {"neg_entropy": lossfx.neg_entropy, "reverse_kl_to_fixed": lossfx.reverse_kl_to_fixed,
               "cross_entropy_to_fixed": lossfx.cross_entropy_to_fixed}  # fmt: skip
        refs = {"neg_entropy": reference.neg_entropy, "reverse_kl_to_fixed": reference.reverse_kl_to_fixed,
                "cross_entropy_to_fixed": reference.cross_entropy_to_fixed}  # fmt: skip

        def weights(lps, lpt):
            return {"neg_entropy": lps, "cross_entropy_to_fixed": -lpt, "reverse_kl_to_fixed": lps - lpt}[kind]

        def args(x, a):
            return (x,) if kind == "neg_entropy" else (x, a["teacher"])

        def baseline(x, a):
            lps = x.log_softmax(-1)
            lpt = torch.zeros_like(lps) if kind == "neg_entropy" else a["teacher"].to(x.dtype).log_softmax(-1)
            return (torch.where(lps.exp() > 0, lps.exp() * _finite(weights(lps, lpt)), 0).sum(-1),)

        def sizes(x64, a, t):
            lps = reference.log_softmax(x64)
            lpt = torch.zeros_like(lps) if kind == "neg_entropy" else reference.log_softmax(a["teacher"].to(F64))
            return [_reduction_sizes(lps, lpt, weights(lps, lpt))]

        return LogitsPath(
            call=lambda x, a: (fns[kind](*args(x, a)),),
            truth=lambda x, a: (refs[kind](*args(x, a)),),
            torch=baseline,
            sizes=sizes,
            compiled=kind == "reverse_kl_to_fixed",
        )

    for kind in ("neg_entropy", "reverse_kl_to_fixed", "cross_entropy_to_fixed"):
        paths[kind] = reduction(kind)

    # top-k distillation (zero_outside_topk=True, with entropy) and the DISTILLATION branch (False)
    def distill_torch(zero_outside: bool):
        def fn(x, a):
            ids = a["topk_ids"]
            lp = x.log_softmax(-1)
            s = lp.gather(-1, ids) if zero_outside else x.gather(-1, ids).log_softmax(-1)
            outs = (s[:, :-1], a["teacher_topk"].to(x.dtype).log_softmax(-1)[:, :-1])
            return (*outs, (lp.exp() * lp).sum(-1)[:, :-1]) if zero_outside else outs

        return fn

    def distill_sizes(zero_outside: bool):
        def fn(x64, a, t):
            out = [(_lp_size(t[0], v), torch.ones_like(t[0][..., :1])), (_lp_size(t[1], v), None)]
            if zero_outside:
                lps = reference.log_softmax(x64[:, :-1])
                out.append(_reduction_sizes(lps, torch.zeros_like(lps), lps))
            return out

        return fn

    paths["distillation_topk_logprobs"] = LogitsPath(
        call=lambda x, a: _drop_none(lossfx.distillation_topk_logprobs(
            x, a["teacher_topk"], a["topk_ids"], zero_outside_topk=True, calculate_entropy=True)),
        truth=lambda x, a: _drop_none(reference.distillation_topk_logprobs(
            x, a["teacher_topk"], a["topk_ids"], True, True)),
        torch=distill_torch(True),
        sizes=distill_sizes(True),
        layout="shift",
    )  # fmt: skip
    distillation = SimpleNamespace(
        input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=False, kl_type="forward"
    )
    keys = ("student_topk_logprobs", "teacher_topk_logprobs")

    def distillation_call(x, a):
        data = {"teacher_topk_logits": a["teacher_topk"], "teacher_topk_indices": a["topk_ids"]}
        out, _ = lossfx.prepare_loss_input(x, data, distillation)
        return tuple(out[key] for key in keys)

    def distillation_truth(x, a):
        data = {"teacher_topk_logits": a["teacher_topk"], "teacher_topk_indices": a["topk_ids"]}
        out = reference.prepare_distillation_input(x, data, distillation)
        return tuple(out[key] for key in keys)

    paths["prepare_loss_input[DISTILLATION]"] = LogitsPath(
        distillation_call,
        distillation_truth,
        distill_torch(False),
        distill_sizes(False),
        compiled=True,
        layout="shift",
    )

    # LOGPROB with the rollout's filter (and a token mask)
    params = lossfx.TrainingSamplingParams(top_k=top_k, top_p=top_p)

    def filtered_logprob_call(x, a):
        data = {"input_ids": a["filtered_input_ids"], "token_mask": a["token_mask"]}
        return (lossfx.prepare_loss_input(x, data, logprob, sampling_params=params)[0]["next_token_logprobs"],)

    def filtered_logprob_truth(x, a):
        data = {"input_ids": a["filtered_input_ids"], "token_mask": a["token_mask"]}
        return (reference.prepare_filtered_logprob_input(x, data, logprob, top_k, top_p)[0]["next_token_logprobs"],)

    def filtered_logprob_torch(x, a):
        keep = a["keep"].view(x.shape)[:, :-1]
        lp = x[:, :-1].masked_fill(~keep, -math.inf).log_softmax(-1)
        lp = lp.gather(-1, a["filtered_input_ids"][:, 1:, None])[..., 0]
        return (torch.where((a["token_mask"][:, 1:] > 0) & torch.isfinite(lp), lp, 0),)

    paths["prepare_loss_input[LOGPROB+filter]"] = LogitsPath(
        filtered_logprob_call, filtered_logprob_truth, filtered_logprob_torch,
        _lp_sizes(v), compiled=True, ignore=lambda a: a["ambiguous"], layout="shift",
    )  # fmt: skip

    # DRAFT: the shifted teacher logits in the draft vocabulary (a copy: compared exactly, no gradient)
    draft = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)

    def draft_call(x, a):
        data = {"token_mask": a["token_mask"], "student_logits": a["student_draft"]}
        out, _ = lossfx.prepare_loss_input(x, data, draft, d2t=a["d2t"])
        return out["teacher_logits"], out["token_mask"]

    def draft_truth(x, a):
        # the truth on the CPU (float64 copies; nothing to round)
        data = {"token_mask": a["token_mask"].cpu(), "student_logits": a["student_draft"].cpu()}
        out = reference.prepare_draft_input(x.cpu(), data, a["d2t"].cpu())
        return out["teacher_logits"].to(x.device), out["token_mask"].to(x.device)

    paths["prepare_loss_input[DRAFT]"] = LogitsPath(
        draft_call, draft_truth, lambda x, a: (None, None), lambda x, a, t: [(None, None), (None, None)]
    )

    # OPD_FULL from a logits payload, with the decomposition metrics
    opd = SimpleNamespace(
        input_type=lossfx.LossInputType.OPD_FULL, reference_policy_kl_penalty=0.0,
        opd_full=lossfx.OnPolicyDistillationFullConfig(enabled=True, teacher_payload="logits",
                                                       validate_decomposition=True),
    )  # fmt: skip
    opd_keys = ("opd_full_divergence", "opd_full_entropy", "opd_full_cross_entropy")

    def opd_call(x, a):
        data = {"input_ids": a["input_ids"], "token_mask": a["token_mask"], "teacher_full_logits": a["teacher"]}
        out, _ = lossfx.prepare_loss_input(x, data, opd)
        return tuple(out[key] for key in opd_keys)

    def opd_truth(x, a):
        out = reference.opd_full_loss_input(x, a["teacher"].to(F64), a["input_ids"], validate_decomposition=True)
        return tuple(out[key] for key in opd_keys)

    def opd_torch(x, a):
        lps, lpt = x[:, :-1].log_softmax(-1), a["teacher"][:, :-1].to(x.dtype).log_softmax(-1)
        p = lps.exp()
        return (p * (lps - lpt)).sum(-1), (p * lps).sum(-1), -(p * lpt).sum(-1)

    def opd_sizes(x64, a, t):
        lps = reference.log_softmax(x64[:, :-1])
        lpt = reference.log_softmax(a["teacher"][:, :-1].to(F64))
        kl = _reduction_sizes(lps, lpt, lps - lpt)
        return [kl, (_reduction_sizes(lps, lpt, lps)[0], None), (_reduction_sizes(lps, lpt, -lpt)[0], None)]

    paths["prepare_loss_input[OPD_FULL]"] = LogitsPath(opd_call, opd_truth, opd_torch, opd_sizes, layout="shift")

    # packed sequences: [1, T, V] rows, three sequences
    def packed_call(x, a):
        data = {"input_ids": a["packed_ids"], "cu_seqlens": a["cu_tensor"]}
        out, _ = lossfx.prepare_packed_loss_input(x.flatten(0, 1)[None], data, logprob, a["cu"], a["cu"])
        return (out["next_token_logprobs"],)

    def packed_truth(x, a):
        return (reference.packed_next_token_logprobs(x.flatten(0, 1)[None], a["packed_ids"], a["cu"], a["cu"],
                                                     prepacked=True),)  # fmt: skip

    def packed_torch(x, a):
        ids = a["packed_ids"][0]
        lp = x.flatten(0, 1)[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        ends = torch.zeros_like(lp, dtype=torch.bool)
        ends[torch.tensor(a["cu"][1:-1], device=lp.device) - 1] = True  # a sequence's last slot: 0
        return (torch.where(ends, 0, lp)[None],)

    paths["prepare_packed_loss_input"] = LogitsPath(
        packed_call, packed_truth, packed_torch, _lp_sizes(v), layout="packed"
    )
    return paths


def _drop_none(outs):
    return tuple(o for o in outs if o is not None)


def logits_aux(cfg: Config, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> tuple[Tensor, dict]:
    """Student logits `[B, S, V]` in `dtype` and the other inputs of every logits path (seeded, CPU-drawn)."""
    b, s, v, k = cfg.batch, cfg.seq, cfg.vocab, cfg.topk_ids

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * 3).to(dtype)

    x = randn(b, s, v)
    n = b * s
    cut = [0, n // 3, 2 * n // 3 + 1, n]
    d = max(2, v // 4)
    aux: dict[str, Any] = {
        "target": torch.randint(0, v, (n,), generator=gen),
        "ids": torch.randint(0, v, (b, s, k), generator=gen),
        "topk_ids": torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)]).view(b, s, k),
        "teacher": randn(b, s, v),
        "teacher_topk": randn(b, s, k),
        "input_ids": torch.randint(0, v, (b, s), generator=gen),
        "token_mask": (torch.rand(b, s, generator=gen) > 0.2).float(),
        "student_draft": torch.randn(b, s, d, generator=gen),
        "d2t": torch.sort(torch.randint(0, v - d + 1, (d,), generator=gen)).values,  # draft i -> i + d2t[i] < V
        "packed_ids": torch.randint(0, v, (1, n), generator=gen),
        "cu": cut,
        "cu_tensor": torch.tensor(cut),
    }
    aux = {key: val.to(device) if isinstance(val, Tensor) else val for key, val in aux.items()}
    x64 = x.to(device=device, dtype=F64)  # the truth's kept sets, on the device (a sort of [N, V])
    aux["keep"] = reference.apply_top_k_top_p(x64.flatten(0, 1), top_k=cfg.top_k, top_p=cfg.top_p)[1]
    aux["ambiguous"] = _keep_ambiguous(x64, cfg.top_k, cfg.top_p)
    del x64
    # the filtered paths score tokens sampled from the kept set (as a rollout does), one in eight anywhere
    sampled = torch.multinomial(aux["keep"].cpu().double(), 1, generator=gen)[:, 0]
    anywhere = torch.rand(n, generator=gen) < 1 / 8
    target = torch.where(anywhere, aux["target"].cpu(), sampled)
    aux["filtered_target"] = target.to(device)
    aux["filtered_input_ids"] = torch.cat([aux["input_ids"][:, :1], aux["filtered_target"].view(b, s)[:, :-1]], 1)
    return x.to(device), aux


# ---------------------------------------------------------------------------------------------
# The fused head: hidden states × LM head
# ---------------------------------------------------------------------------------------------


def _unfused(h, w, cdtype):
    return (h @ w.T).to(cdtype)


FUSED_PATHS = ("linear_token_logprobs", "linear_gather_logprobs", "linear_next_token_logprobs",
               "linear_logprob_objective")  # fmt: skip
FUSED_COMPILED = {"linear_token_logprobs", "linear_logprob_objective"}


def fused_check(name: str, cfg: Config, device, dtype, gen, wrap) -> list[Comparison]:
    """One fused-head path: values and `dhidden`, `dweight` against the float64 truth (norm rule)."""
    b, s, v, hs, k = cfg.batch, cfg.seq, cfg.vocab, cfg.hidden, cfg.topk_ids
    n = b * s
    h0 = torch.randn(n, hs, generator=gen).to(dtype)
    w0 = (torch.randn(v, hs, generator=gen) / hs**0.5 * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    ids = torch.randint(0, v, (n, k), generator=gen)
    # upstream gradients / coefficients representable in the dtype: the objective takes them in it
    dout = torch.randn(n, k, generator=gen).to(dtype).to(F64)
    dneg = torch.randn(n, generator=gen).to(dtype).to(F64)
    h0, w0, target, ids, dout, dneg = (t.to(device) for t in (h0, w0, target, ids, dout, dneg))
    cdtype = torch.float32 if dtype != F64 else F64
    seq_shape = name == "linear_next_token_logprobs"

    def lossfx_call(h, w, target, ids, dout, dneg):
        """-> (outputs, the scalar to backpropagate)."""
        if name == "linear_token_logprobs":
            lp, neg = lossfx.linear_token_logprobs(h, w, target, return_neg_entropy=True)
        elif name == "linear_gather_logprobs":
            lp, neg = lossfx.linear_gather_logprobs(h, w, ids, with_neg_entropy=True)
        elif name == "linear_next_token_logprobs":
            lp, neg = lossfx.linear_next_token_logprobs(h.view(b, s, -1), w, target.view(b, s),
                                                        return_neg_entropy=True)  # fmt: skip
        else:
            obj, lp, neg = lossfx.linear_logprob_objective(h, w, target, dout[:, 0].to(h.dtype),
                                                           neg_entropy_weight=dneg.to(h.dtype))  # fmt: skip
            return (obj, lp, neg), obj
        return (lp, neg), _loss((lp, neg), _upstream(lp, neg))

    def _upstream(lp, neg):
        if name == "linear_gather_logprobs":
            return dout, dneg
        if seq_shape:
            return dout[:, 0].view(b, s)[:, :-1], dneg.view(b, s)[:, :-1]
        return dout[:, 0], dneg

    def truth_call(h, w, *_):
        if name == "linear_token_logprobs":
            lp, neg = reference.linear_token_logprobs(h, w, target)
        elif name == "linear_gather_logprobs":
            lp, neg = reference.linear_gather_logprobs(h, w, ids)
        elif name == "linear_next_token_logprobs":
            lp, neg = reference.linear_next_token_logprobs(h.view(b, s, -1), w, target.view(b, s))
        else:
            obj, lp, neg = reference.linear_logprob_objective(h, w, target, dout[:, 0], dneg)
            return (obj, lp, neg), obj
        return (lp, neg), _loss((lp, neg), _upstream(lp, neg))

    def torch_call(h, w, *_):
        z = _unfused(h, w, cdtype)
        if seq_shape:
            z = z.view(b, s, -1)[:, :-1]
        logp = z.log_softmax(-1)
        neg = (logp.exp() * logp).sum(-1)
        if name == "linear_gather_logprobs":
            lp = logp.gather(-1, ids)
        elif seq_shape:
            lp = logp.gather(-1, target.view(b, s)[:, 1:, None])[..., 0]
        else:
            lp = logp.gather(-1, target[:, None])[:, 0]
        if name == "linear_logprob_objective":
            obj = (lp * dout[:, 0].to(cdtype)).sum() + (neg * dneg.to(cdtype)).sum()
            return (obj, lp, neg), obj
        return (lp, neg), _loss((lp, neg), _upstream(lp, neg))

    results = []
    for fn, leaf_dtype in ((wrap(lossfx_call), dtype), (truth_call, F64), (torch_call, dtype)):
        h = h0.to(leaf_dtype).requires_grad_(True)
        w = w0.to(leaf_dtype).requires_grad_(True)
        outs, loss = fn(h, w, target, ids, dout, dneg)
        dh, dw = torch.autograd.grad(loss, (h, w))
        results.append(([o.detach() for o in outs], dh, dw))
    (outs, dh, dw), (t_outs, t_dh, t_dw), (b_outs, b_dh, b_dw) = results
    eps, eps_in = torch.finfo(cdtype).eps, torch.finfo(dtype).eps
    log_v = math.log(v) + 1
    comps = []
    for i, (a, t, bl) in enumerate(zip(outs, t_outs, b_outs, strict=True)):
        if name == "linear_logprob_objective" and i == 0:
            size = dout[:, 0].abs() @ (log_v + t_outs[1].abs()) + dneg.abs().sum() * log_v
            what = "objective"
        else:
            is_lp = i == (1 if name == "linear_logprob_objective" else 0)
            size = log_v + t.abs() if is_lp else torch.full_like(t, log_v)
            what = "log-probs" if is_lp else "Σ p log p"
        comps.append(Comparison(what, a, bl, t, 8 * eps * size, "norm"))
    for what, a, bl, t in (("dhidden", dh, b_dh, t_dh), ("dweight", dw, b_dw, t_dw)):
        if a.dtype != dtype:
            comps.append(Comparison(f"{what} dtype {a.dtype}", a, bl, t, 0.0, "exact"))
        comps.append(Comparison(what, a, bl, t, (8 * eps + eps_in) * t.abs(), "norm"))
    return comps


# ---------------------------------------------------------------------------------------------
# Section 1: checks
# ---------------------------------------------------------------------------------------------


def _planted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with every floating tensor it returns scaled by `1 + PLANT` (a deliberate error)."""

    def scale(o):
        if isinstance(o, Tensor) and o.is_floating_point():
            return o * (1 + PLANT)
        if isinstance(o, (tuple, list)):
            return type(o)(scale(x) for x in o)
        return o

    return lambda *args: scale(fn(*args))


def logits_check(path: LogitsPath, x: Tensor, aux: dict, fn: Callable[..., Any], seed: int = 0) -> list[Comparison]:
    """Run `fn` (lossfx's call, maybe compiled / planted) and compare outputs and `dlogits` with the truth."""
    tensors = {key: val for key, val in aux.items() if isinstance(val, Tensor)}
    consts = {key: val for key, val in aux.items() if not isinstance(val, Tensor)}
    xa = x.detach().clone().requires_grad_(True)
    outs = fn(xa, tensors, consts)
    x64 = x.detach().to(F64).requires_grad_(True)
    t_outs = path.truth(x64, aux)
    sizes = path.sizes(x64.detach(), aux, [t.detach() for t in t_outs])
    gen = torch.Generator().manual_seed(seed + 1)
    douts = [None if g is None else torch.randn(t.shape, generator=gen, dtype=F64).to(x.device).clamp(-3, 3)
             for t, (_, g) in zip(t_outs, sizes, strict=True)]  # fmt: skip
    cdtype = torch.float32 if x.dtype != F64 else F64
    xb = x.detach().clone().requires_grad_(True)
    b_outs = path.torch(xb.to(cdtype), aux)
    has_grad = any(g is not None for g in douts)
    if has_grad:
        _loss(outs, douts).backward()
        _loss(t_outs, douts).backward()
        _loss(b_outs, douts).backward()
    ignore = path.ignore(aux)  # [B, S] or None
    eps, eps_in = torch.finfo(cdtype).eps, torch.finfo(x.dtype).eps
    comps = []
    grad_tol = eps_in * (x64.grad.abs() if has_grad else 0) + torch.finfo(cdtype).tiny
    for i, (a, t, bl, (size, grad_size)) in enumerate(zip(outs, t_outs, b_outs, sizes, strict=True)):
        out_ignore = None
        if ignore is not None:  # the output's rows of the ignored logits rows ([B, S] -> the output's layout)
            rows = {"same": ignore, "rows": ignore.flatten(), "shift": ignore[:, :-1],
                    "packed": ignore.flatten()[None, :-1]}[path.layout]  # fmt: skip
            out_ignore = rows.view(*rows.shape, *[1] * (t.dim() - rows.dim()))
        if size is None:
            comps.append(Comparison(f"output {i}", a, None, t, 0.0, "exact", out_ignore))
            continue
        comps.append(Comparison(f"output {i}", a, bl, t, 8 * eps * size, "element", out_ignore))
        if grad_size is not None:
            g = douts[i].abs()
            g = g.sum(-1) if g.dim() == grad_size.dim() else g  # a K axis: the row's total upstream
            grad_tol = grad_tol + to_rows(8 * eps * g[..., None] * grad_size, x.shape, path.layout)
    if has_grad:
        grad_ignore = None if ignore is None else ignore[..., None]
        comps.append(Comparison("gradient", xa.grad, xb.grad, x64.grad, grad_tol, "element", grad_ignore))
        if xa.grad is not None and xa.grad.dtype != x.dtype:
            comps.append(Comparison(f"gradient dtype {xa.grad.dtype}", xa.grad, None, x64.grad, 0.0, "exact"))
    return comps


def check_names(cfg: Config) -> list[str]:
    return [*logits_paths(cfg), *FUSED_PATHS]


def run_checks(
    cfg: Config,
    device: torch.device,
    record: Callable[..., None],
    *,
    names: list[str],
    dtypes: list[str],
    plant: set[str],
    seed: int = 0,
) -> None:
    """Section 1: the paths `names` in `dtypes`, eager first (bf16 first), then the compiled subset
    in `cfg.compiled_dtypes` (bf16 first), so that a spent budget cuts compiled fp32 first."""
    start = time.monotonic()
    paths = logits_paths(cfg)
    order = sorted(dtypes, key=lambda d: d != "bf16")
    plan = [(name, d, "eager") for d in order for name in names]
    plan += [
        (name, d, "compiled")
        for d in cfg.compiled_dtypes
        if d in dtypes
        for name in names
        if (paths[name].compiled if name in paths else name in FUSED_COMPILED)
    ]
    inputs: dict[str, tuple[Tensor, dict]] = {}
    for name, dtype_name, mode in plan:
        if time.monotonic() - start > cfg.check_budget_s:
            record(name, dtype_name, mode, None, "skipped: check budget spent", 0.0)
            continue
        if dtype_name not in inputs:
            inputs[dtype_name] = logits_aux(cfg, device, DTYPES[dtype_name], torch.Generator().manual_seed(seed))
        x, aux = inputs[dtype_name]
        t0 = time.monotonic()
        ratios: dict[str, float] = {}
        try:
            comps = _one_check(name, mode, paths, cfg, x, aux, device, DTYPES[dtype_name], name in plant, seed)
            ratios = {c.what: c.worst() for c in comps}
            worst = max(ratios, key=lambda what: ratios[what])
            ratio = ratios[worst]
            note = f"worst {worst}: {ratio:.3g}"
            if name in paths and paths[name].ignore(aux) is not None:
                note += f"; {int(paths[name].ignore(aux).sum())} of {aux['ambiguous'].numel()} rows top-p-ambiguous"
        except Exception as exc:  # a crash is a failed check, with its reason
            ratio, note = math.inf, f"error: {type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        record(name, dtype_name, mode, ratio, note, time.monotonic() - t0, ratios)
    print(f"[checks] {time.monotonic() - start:.1f} s", flush=True)


def _one_check(name, mode, paths, cfg, x, aux, device, dtype, plant: bool, seed: int) -> list[Comparison]:
    def wrap(fn):
        if mode == "compiled":
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True, backend=cfg.backend)
        return _planted(fn) if plant else fn

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    if name in paths:
        path = paths[name]
        call = wrap(lambda xa, tensors, consts: path.call(xa, {**consts, **tensors}))
        return logits_check(path, x, aux, call, seed)
    return fused_check(name, cfg, device, dtype, gen, wrap)


# ---------------------------------------------------------------------------------------------
# Section 2: the GRPO step against the peers
# ---------------------------------------------------------------------------------------------

# provider -> (the shared builder's name, compiled by this script). Uncompiled first: when the
# budget runs out, the compiled rows (each a fresh compile) are the ones skipped.
BENCH_PROVIDERS = {
    "naive": ("naive", False),
    "lossfx-logits": ("lossfx-unfused", False),
    "lossfx-fused": ("lossfx-fused", False),
    "lossfx-objective": ("lossfx-objective", False),
    "liger-flce": ("liger-flce", False),
    "cce": ("cce", False),
    "trl-fused": ("trl-fused", False),
    "torch-linear-ce": ("torch-linear-ce", False),
    "naive-compiled": ("naive", True),
    "lossfx-logits-compiled": ("lossfx-unfused", True),
    "lossfx-fused-compiled": ("lossfx-fused", True),
    "lossfx-objective-compiled": ("lossfx-objective", True),
    "liger-grpo": ("liger-grpo", False),  # compiles its chunks itself
}
SEQUENCES = 8


def _timed(step: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one `step()` (CUDA events on a GPU)."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def bench_row(provider: str, n: int, hs: int, v: int, device: torch.device, reps: int) -> dict[str, Any]:
    """One GRPO step of `provider`: first call (compile included), median of `reps` warm calls after
    one warm-up, peak memory above what existed before the call (CUDA), loss and gradient norm."""
    name, compiled = BENCH_PROVIDERS[provider]
    torch._dynamo.reset()
    h, w, t, c = builders.grpo_inputs(n, hs, v, SEQUENCES, dtype=torch.bfloat16, device=device)
    fn = builders.objective_function(name, sequences=SEQUENCES, compiled=compiled)

    def step() -> tuple[Tensor, Tensor, Tensor]:
        loss, _ = fn(h, w, t, c)
        return (loss.detach(), *torch.autograd.grad(loss, (h, w)))

    t0 = time.perf_counter()
    loss, dh, dw = step()
    value = float(loss)  # waits for the device
    row: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 3), "loss": value}
    row["grad_norm"] = float(torch.cat([dh.float().flatten(), dw.float().flatten()]).norm())
    del loss, dh, dw
    if reps > 1:
        _timed(step, device)  # a second warm-up (allocator, autotuning)
    times = [_timed(step, device) for _ in range(max(1, reps))]
    row.update(median_ms=round(1e3 * statistics.median(times), 3), min_ms=round(1e3 * min(times), 3), reps=len(times))
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        grads = (n + v) * hs * 2  # dhidden + dweight in bf16, returned by the call and counted
        row.update(peak_mib=round(peak / 2**20, 1), beyond_grads_x_logits=round((peak - grads) / (n * v * 2), 3))
    return row


def run_bench(cfg: Config, device: torch.device, providers: list[str], failures: list[str]) -> list[dict[str, Any]]:
    """Section 2: one row per (shape, provider), in that order; skipped rows say why."""
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for n, hs, v in cfg.bench_shapes:
        base: dict[str, Any] | None = None
        for provider in providers:
            row: dict[str, Any] = {"tokens": n, "hidden": hs, "vocab": v, "dtype": "bf16", "provider": provider}
            rows.append(row)
            label = f"[bench] N={n} H={hs} V={v} {provider:>26}:"
            reason = builders.unavailable(BENCH_PROVIDERS[provider][0], device)
            if reason is None and time.monotonic() - start > cfg.bench_budget_s:
                reason = "bench budget spent"
            if reason is not None:
                row["skipped"] = reason
                print(f"{label} skipped ({reason})", flush=True)
                continue
            try:
                row.update(bench_row(provider, n, hs, v, device, cfg.bench_reps))
            except Exception as exc:  # a peer without a kernel for this case, or out of memory
                row["skipped"] = f"error: {type(exc).__name__}: {exc}"[:300]
                if provider.startswith("lossfx"):
                    failures.append(f"bench {provider} N={n} H={hs} V={v}: {row['skipped']}")
                print(f"{label} {row['skipped']}", flush=True)
                _free(device)
                continue
            if provider == "naive":
                base = row
            if base is not None:
                row["time_vs_naive"] = round(row["median_ms"] / base["median_ms"], 3)
                row["grad_norm_rel"] = abs(row["grad_norm"] - base["grad_norm"]) / base["grad_norm"]
            memory = f", peak {row['peak_mib']:.0f} MiB" if "peak_mib" in row else ""
            print(f"{label} {row['median_ms']:9.2f} ms (first call {row['first_call_s']:.1f} s){memory}", flush=True)
            _free(device)
    print(f"[bench] {time.monotonic() - start:.1f} s", flush=True)
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [
        f"Measured {env['date']} on {env['machine']}, torch {env['torch']}, lossfx {env['lossfx']}; peers: "
        + ", ".join(f"{k} {env[k]}" for k in ("trl", "liger-kernel", "cut-cross-entropy"))
        + f". Mode: {doc['mode']}.",
        "",
        "### Checks against the float64 reference (passes at worst ratio ≤ 1)",
        "",
        "| path | dtype | mode | worst ratio | pass | note |",
        "|---|---|---|---:|---|---|",
    ]
    for r in doc["checks"]:
        ratio = "—" if r["worst"] is None else f"{r['worst']:.3g}"
        ok = "—" if r["pass"] is None else ("yes" if r["pass"] else "**no**")
        lines.append(f"| {r['path']} | {r['dtype']} | {r['mode']} | {ratio} | {ok} | {r['note']} |")
    lines += [
        "",
        "### GRPO loss step, bf16, forward + backward",
        "",
        "| N | H | V | provider | median ms | ÷ naive | first call s | peak MiB | beyond grads × bf16 logits "
        "| grad norm rel. to naive |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["bench"]:
        head = f"| {r['tokens']} | {r['hidden']} | {r['vocab']} | {r['provider']} "
        if "skipped" in r:
            lines.append(head + f"| skipped: {r['skipped']} | | | | | |")
            continue

        def cell(key, fmt, r=r):
            return "—" if r.get(key) is None else format(r[key], fmt)

        lines.append(head + f"| {r['median_ms']:.2f} | {cell('time_vs_naive', '.2f')} | {r['first_call_s']:.1f} "
                     f"| {cell('peak_mib', '.0f')} | {cell('beyond_grads_x_logits', '.3f')} "
                     f"| {cell('grad_norm_rel', '.1e')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the default on the CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when present; "
                        "--device cpu --quick runs the quick shapes on the CPU")  # fmt: skip
    parser.add_argument("--sections", nargs="+", default=["checks", "bench"], choices=["checks", "bench"])
    parser.add_argument("--providers", nargs="+", default=list(BENCH_PROVIDERS), choices=list(BENCH_PROVIDERS))
    parser.add_argument("--paths", nargs="+", default=None, help="checks: these paths only (default: all)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="checks' dtypes")
    parser.add_argument(
        "--shapes", nargs="+", default=None, metavar="NxHxV", help="bench shapes, e.g. 16384x4096x151936"
    )
    parser.add_argument("--reps", type=int, default=None, help="bench: timed calls per row")
    parser.add_argument("--budget-checks", type=float, default=None, help="seconds before checks stop starting")
    parser.add_argument("--budget-bench", type=float, default=None, help="seconds before bench rows stop starting")
    parser.add_argument("--backend", default=None, help="torch.compile backend of the checks (default: inductor; "
                        "aot_eager in --smoke)")  # fmt: skip
    plant_help = f"scale these paths' outputs by 1 + {PLANT} (a planted error): the run must fail"
    parser.add_argument("--plant-error", nargs="+", default=[], metavar="PATH", help=plant_help)
    parser.add_argument("--seed", type=int, default=0, help="checks: seed of the random inputs")
    parser.add_argument("--out", default=None, help="also write gpu.json and gpu.md there")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    if device.type == "cuda" and not cuda:
        parser.error("--device cuda: no CUDA device here")
    smoke = args.smoke or (device.type == "cpu" and not args.quick)
    cfg = SMOKE if smoke else QUICK if args.quick else FULL
    overrides = {"backend": args.backend, "bench_reps": args.reps, "check_budget_s": args.budget_checks,
                 "bench_budget_s": args.budget_bench}  # fmt: skip
    if args.shapes:
        try:
            overrides["bench_shapes"] = tuple(tuple(int(d) for d in shape.split("x")) for shape in args.shapes)
        except ValueError:
            parser.error(f"--shapes: NxHxV with integers, got {args.shapes}")
        if any(len(shape) != 3 or shape[0] % SEQUENCES for shape in overrides["bench_shapes"]):
            parser.error(f"--shapes: NxHxV with N a multiple of {SEQUENCES}, got {args.shapes}")
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    known = check_names(cfg)
    names = args.paths or known
    for flag, given in (("--paths", names), ("--plant-error", args.plant_error)):
        if set(given) - set(known):
            parser.error(f"{flag}: unknown path(s) {sorted(set(given) - set(known))}; known: {known}")
    if set(args.plant_error) - set(names):
        parser.error(f"--plant-error: {sorted(set(args.plant_error) - set(names))} not among the checked --paths")
    mode = ("smoke (tiny shapes)" if smoke else "quick" if args.quick else "full") + f", {device.type}"
    if not cuda and not args.smoke and not args.quick:
        print("no CUDA device: running the CPU smoke configuration", flush=True)
    env = {
        **measure.environment(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "cuda": torch.version.cuda,
        **{k: _version(k) for k in ("trl", "liger-kernel", "cut-cross-entropy", "triton")},
    }
    print(
        f"lossfx GPU check, {mode}: {env['device']}, torch {env['torch']}, config {dataclasses.asdict(cfg)}", flush=True
    )
    start = time.monotonic()
    checks: list[dict[str, Any]] = []
    failures: list[str] = []

    def record(path, dtype, mode_, worst, note, seconds, ratios=None):
        ok = None if worst is None else bool(worst <= 1.0)
        checks.append({"path": path, "dtype": dtype, "mode": mode_, "worst": worst, "pass": ok, "note": note,
                       "seconds": round(seconds, 2), "ratios": ratios or {}})  # fmt: skip
        if ok is False:
            failures.append(f"check {path} {dtype} {mode_}: {note}")
        status = "skip" if ok is None else "ok  " if ok else "FAIL"
        print(f"[checks] {status} {path:>36} {dtype} {mode_:>8}  {note}  ({seconds:.1f} s)", flush=True)

    # the filtered checks score some filtered-out tokens on purpose: lossfx's warning about them is expected
    warnings.filterwarnings("ignore", message=r".*valid tokens have -inf in curr_logprobs")
    if "checks" in args.sections:
        run_checks(cfg, device, record, names=names, dtypes=args.dtypes, plant=set(args.plant_error), seed=args.seed)
    bench = run_bench(cfg, device, args.providers, failures) if "bench" in args.sections else []
    doc = {"environment": env, "mode": mode, "config": dataclasses.asdict(cfg), "checks": checks, "bench": bench,
           "failures": failures, "elapsed_s": round(time.monotonic() - start, 1)}  # fmt: skip
    text = markdown(doc)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.json").write_text(json.dumps(doc, indent=1, default=str))
        (out / "gpu.md").write_text(text)
    print(f"total {doc['elapsed_s']:.1f} s; {len(failures)} failure(s)", flush=True)
    for failure in failures:
        print(f"FAILED: {failure}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
