"""The call table of lossfx's public paths, and the accuracy rule they are checked by.

One place for both users: tests/test_magnitudes.py checks every path against the float64
reference with it (on any `pytest --device`), and benchmarks/gpu.py times the same calls.

`TOKEN_PATHS[name]`: `token_logprobs` and `gather_logprobs` (with `token_torch` their baseline).
`LOGITS_PATHS[name]`: a `LogitsPath` (lossfx's call on logits, the float64 truth from
`lossfx.reference`, the dense formula in torch ops, and the sizes the tolerance scales with).
`LINEAR_PATHS[name]`: `(call, uses the entropy, number of ids)` of a fused LM-head path, with
`linear_torch` its unfused baseline. The rule, element by element, for values and gradients:

    |lossfx − truth| <= 2·|torch − truth| + tol       (`assert_not_less_accurate`)

with `tol` a few roundings of the compute dtype relative to the size of the terms (`lp_sizes`,
`div_sizes`) and, for a gradient, the row floor `row_floor`. The constructions that make the
truth exact, and the derivation of each `tol`, are in tests/test_magnitudes.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import lossfx
from lossfx import reference
from lossfx._core.numerics import compute_dtype

F64 = torch.float64


def assert_not_less_accurate(actual, baseline, truth, *, tol, what):
    a, b, t = (v.detach().to(F64) for v in (actual, baseline, truth))
    assert not torch.isnan(a).any(), f"{what}: NaN"
    err_a, err_b = (a - t).abs(), (b - t).abs()
    bad = err_a > 2 * err_b + tol
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: less accurate than torch.log_softmax at {i}: lossfx {a[i].item()!r}, "
            f"torch {b[i].item()!r}, truth {t[i].item()!r} ({int(bad.sum())} entries)"
        )


# The token and gather paths: `call(x, ids, dout, dneg_h, group, chunk)` -> (log-probs `[N, K]`, Σ p log p
# `[N]` or None, the scalar to backpropagate); `token_torch` their baseline, backpropagated.
def _token_call(x, ids, dout, dneg_h, group, chunk):
    """-> (log-probs `[N, 1]`, None, the scalar loss to backpropagate)."""
    out = lossfx.token_logprobs(x, ids[:, 0], group=group, chunk_size=chunk)
    return out[:, None], None, (out * dout[:, 0].to(out.dtype)).sum()


def _gather_call(x, ids, dout, dneg_h, group, chunk):
    lp, neg_h = lossfx.gather_logprobs(x, ids, with_neg_entropy=True, group=group, chunk_size=chunk)
    return lp, neg_h, (lp * dout.to(lp.dtype)).sum() + (neg_h * dneg_h.to(lp.dtype)).sum()


TOKEN_PATHS = {"token": _token_call, "gather": _gather_call}


def token_torch(x, ids, dout, dneg_h):
    """`torch.log_softmax` on `x` upcast to lossfx's compute dtype; gradient in `x`'s dtype."""
    x = x.detach().clone().requires_grad_(True)
    lp_all = torch.log_softmax(x.to(compute_dtype(x.dtype)), dim=-1)
    lp = lp_all.gather(-1, ids)
    neg_h = torch.where(torch.isneginf(lp_all), 0.0, lp_all.exp() * lp_all).sum(-1)
    ((lp * dout.to(lp.dtype)).sum() + (neg_h * dneg_h.to(lp.dtype)).sum()).backward()
    return lp.detach(), neg_h.detach(), x.grad


def _lin_token(h, w, ids, dout, dneg, group, chunk, temperature, entropy):
    out = lossfx.linear_token_logprobs(
        h, w, ids[:, 0], group=group, chunk_size=chunk, temperature=temperature, return_neg_entropy=entropy
    )
    lp, neg_h = out if entropy else (out, None)
    loss = (lp * dout[:, 0].to(lp.dtype)).sum()
    return lp[:, None], neg_h, loss + (0 if neg_h is None else (neg_h * dneg.to(lp.dtype)).sum())


def _lin_gather(h, w, ids, dout, dneg, group, chunk, temperature, entropy):
    lp, neg_h = lossfx.linear_gather_logprobs(
        h, w, ids, with_neg_entropy=True, group=group, chunk_size=chunk, temperature=temperature
    )
    return lp, neg_h, (lp * dout.to(lp.dtype)).sum() + (neg_h * dneg.to(lp.dtype)).sum()


def _lin_next_token(h, w, ids, dout, dneg, group, chunk, temperature, entropy):
    input_ids = torch.cat([ids[:1, 0], ids[:-1, 0]])[None]  # [1, N]: position t scores ids[t, 0]
    lp, neg_h = lossfx.linear_next_token_logprobs(
        h[None], w, input_ids, group=group, chunk_size=chunk, temperature=temperature, return_neg_entropy=True
    )
    lp, neg_h = lp[0], neg_h[0]  # [N − 1]
    loss = (lp * dout[:-1, 0].to(lp.dtype)).sum() + (neg_h * dneg[:-1].to(lp.dtype)).sum()
    return lp[:, None], neg_h, loss


def _lin_objective(h, w, ids, dout, dneg, group, chunk, temperature, entropy):
    objective, lp, neg_h = lossfx.linear_logprob_objective(
        h, w, ids[:, 0], dout[:, 0].to(h.dtype), neg_entropy_weight=dneg.to(h.dtype), group=group,
        chunk_size=chunk, temperature=temperature,
    )  # fmt: skip
    return lp[:, None], neg_h, objective


LINEAR_PATHS = {
    "token": (_lin_token, False, 1),
    "token_entropy": (_lin_token, True, 1),
    "gather": (_lin_gather, True, 3),
    "next_token": (_lin_next_token, True, 1),
    "objective": (_lin_objective, True, 1),
}


def linear_torch(hidden, weight, ids, dout, dneg, temperature):
    """The unfused path in the inputs' dtype: logits materialised, `log_softmax` in the compute dtype."""
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    cdtype = compute_dtype(h.dtype)
    lp_all = torch.log_softmax((h @ w.T).to(cdtype) / temperature, dim=-1)
    lp, neg_h = lp_all.gather(-1, ids), (lp_all.exp() * lp_all).sum(-1)
    ((lp * dout.to(cdtype)).sum() + (neg_h * dneg.to(cdtype)).sum()).backward()
    return lp.detach(), neg_h.detach(), h.grad, w.grad


def finite_or_zero(o):
    return torch.where(torch.isfinite(o), o, torch.zeros_like(o))


def path_loss(outs, douts):
    """`Σ g·o` over the finite entries of every differentiable output (`-inf` log-probs carry no gradient)."""
    return sum((finite_or_zero(o) * g.to(o.dtype)).sum() for o, g in zip(outs, douts, strict=True) if g is not None)


def lp_sizes(lp, log_v):
    return log_v + finite_or_zero(lp).abs()


def div_sizes(lps, lpt, w):
    """(value size `[N]`, gradient size per unit upstream `[N, V]`) of `Σ_v p_v w_v` (the section comment)."""
    p = lps.exp()
    lps, lpt, w = (finite_or_zero(v) for v in (lps, lpt, w))
    sizes = 1 + w.abs() + (p * w.abs()).sum(-1, keepdim=True) + lps.abs() + lpt.abs()
    return 1 + (p * (1 + lps.abs()) * sizes).sum(-1), p * (1 + lps.abs()) * sizes


def row_floor(truth_grad, cdtype):
    """`[N, 1]`: the absolute error every gradient entry of a row may carry, whatever its own size.

    An entry is a product of factors (`g·p_v·(w_v − Σ p w)` for a reduction) that an implementation
    forms in some order in the compute dtype; a partial product can be subnormal although the entry
    is not (`p_v ≈ 1e-42` times a teacher weight `w_v ≈ 3e8` gives an entry of 3e-34 with the 3 bits
    `p_v` had left). So the rule allows a few roundings at the scale of the row's largest entry
    (`4ε·max_v |dz_v|`, what `torch.testing`'s `atol` for the row would be), plus the smallest normal
    number of the compute dtype for rows whose every entry is subnormal. `torch.log_softmax` carries
    the same error where it forms the same subnormal, but not always where lossfx does
    (tests/test_magnitudes.py::test_tiny_gradient_entries_next_to_large_ones).
    """
    finfo = torch.finfo(cdtype)
    return 4 * finfo.eps * truth_grad.detach().abs().amax(-1, keepdim=True) + finfo.tiny


@dataclass(frozen=True)
class LogitsPath:
    """One logits path.

    `call(x, xt, aux, group, rank, chunk)` -> outputs (this rank's shard `x`, the teacher `xt`: its
    shard when `teacher == "vocab"`, whole when `"topk"`, `None` otherwise); `truth(y, yt, aux)`
    -> the float64 outputs from `lossfx.reference`; `torch(xc, xtc, aux)` -> the same outputs in
    torch ops on the compute-dtype inputs; `sizes(y, yt, aux, log_v)` -> per output `(value size,
    gradient size per unit upstream [N, V] or [N, 1])`, `None` for an output without gradient.
    """

    call: object
    truth: object
    torch: object
    sizes: object
    teacher: str | None = None  # None, "vocab" (`[N, V]` sharded like the student) or "topk" (`[N, K]`)
    filtered: bool = False


def _filtered(kind):
    def filter_args(aux):
        return {"top_k": aux["top_k"]} if kind == "top_k" else {"top_p": aux["top_p"]}

    def call(x, xt, aux, group, rank, chunk):
        return (lossfx.filtered_token_logprobs(x, aux["target"], **filter_args(aux), group=group, chunk_size=chunk),)

    def truth(y, yt, aux):
        return (reference.filtered_token_logprobs(y, aux["target"], **filter_args(aux)),)

    def baseline(xc, xtc, aux):
        _, keep = reference.apply_top_k_top_p(xc.detach(), **filter_args(aux))  # the truth's set (see above)
        lp_all = xc.masked_fill(~keep, -math.inf).log_softmax(-1)
        return (lp_all.gather(-1, aux["target"][:, None])[:, 0],)

    def sizes(y, yt, aux, log_v):
        return [(lp_sizes(truth(y, yt, aux)[0], log_v), torch.ones_like(y[:, :1]))]

    return LogitsPath(call, truth, baseline, sizes, filtered=True)


def _reduction(kind):
    ref = {"entropy": reference.entropy, "cross_entropy": reference.cross_entropy_to_fixed}
    ref["reverse_kl"] = reference.reverse_kl_to_fixed
    fn = {"entropy": lossfx.entropy, "cross_entropy": lossfx.cross_entropy_to_fixed}
    fn["reverse_kl"] = lossfx.reverse_kl_to_fixed

    def weights(lps, lpt):
        return {"entropy": lps, "cross_entropy": -lpt, "reverse_kl": lps - lpt}[kind]

    def call(x, xt, aux, group, rank, chunk):
        args = (x,) if kind == "entropy" else (x, xt)
        return (fn[kind](*args, group=group, chunk_size=chunk),)

    def truth(y, yt, aux):
        return (ref[kind](y) if kind == "entropy" else ref[kind](y, yt),)

    def baseline(xc, xtc, aux):
        lps = xc.log_softmax(-1)
        lpt = torch.zeros_like(lps) if xtc is None else xtc.log_softmax(-1)
        w = weights(lps, lpt)
        return (torch.where(lps.exp() > 0, lps.exp() * finite_or_zero(w), 0).sum(-1),)

    def sizes(y, yt, aux, log_v):
        lps = reference.log_softmax(y)
        lpt = torch.zeros_like(lps) if yt is None else reference.log_softmax(yt)
        return [div_sizes(lps, lpt, weights(lps, lpt))]

    return LogitsPath(call, truth, baseline, sizes, teacher=None if kind == "entropy" else "vocab")


def _distillation(zero_outside_topk):
    def call(x, xt, aux, group, rank, chunk):
        s, t, h = lossfx.distillation_topk_logprobs(
            x[None], xt[None], aux["topk_ids"][None], zero_outside_topk=zero_outside_topk,
            calculate_entropy=True, vocab_parallel_group=group, chunk_size=chunk,
        )  # fmt: skip
        return (s[0], t[0]) + (() if h is None else (h[0],))

    def truth(y, yt, aux):
        s, t, h = reference.distillation_topk_logprobs(
            y[None], yt[None], aux["topk_ids"][None], zero_outside_topk, True
        )
        return (s[0], t[0]) + (() if h is None else (h[0],))

    def baseline(xc, xtc, aux):
        ids = aux["topk_ids"]
        lp = xc.log_softmax(-1)
        s = lp.gather(-1, ids) if zero_outside_topk else xc.gather(-1, ids).log_softmax(-1)
        outs = (s[:-1], xtc.log_softmax(-1)[:-1])
        return (*outs, (lp.exp() * lp).sum(-1)[:-1]) if zero_outside_topk else outs

    def sizes(y, yt, aux, log_v):
        outs = truth(y, yt, aux)
        lp_size = (lp_sizes(outs[0], log_v), torch.ones_like(y[:-1, :1]))
        teacher = (lp_sizes(outs[1], log_v), None)
        if not zero_outside_topk:
            return [lp_size, teacher]
        lps = reference.log_softmax(y[:-1])
        return [lp_size, teacher, div_sizes(lps, torch.zeros_like(lps), lps)]

    return LogitsPath(call, truth, baseline, sizes, teacher="topk")


LOGPROB_LOSS = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)


def _next_token_ids(aux):
    return aux["target"][None]  # [1, N]: position t scores target[t + 1]


def _next_token_call(x, xt, aux, group, rank, chunk):
    out, _ = lossfx.prepare_loss_input(
        x[None], {"input_ids": _next_token_ids(aux)}, LOGPROB_LOSS, vocab_parallel_group=group,
        vocab_parallel_rank=None if group is None else rank, chunk_size=chunk,
    )  # fmt: skip
    return (out["next_token_logprobs"][0],)


def _next_token_truth(y, yt, aux):
    return (reference.next_token_logprobs(y[None], _next_token_ids(aux))[0],)


def _next_token_torch(xc, xtc, aux):
    return (xc[:-1].log_softmax(-1).gather(-1, aux["target"][1:, None])[:, 0],)


def _packed_ids(aux):
    return aux["target"][None]  # [1, T]: packed, each sequence scores its own next token


def _packed_call(x, xt, aux, group, rank, chunk):
    data = {"input_ids": _packed_ids(aux), "cu_seqlens": torch.tensor(aux["cu"], device=x.device)}
    out, _ = lossfx.prepare_packed_loss_input(
        x[None], data, LOGPROB_LOSS, aux["cu"], aux["cu"], vocab_parallel_group=group,
        vocab_parallel_rank=None if group is None else rank, chunk_size=chunk,
    )  # fmt: skip
    return (out["next_token_logprobs"][0],)


def _packed_truth(y, yt, aux):
    return (reference.packed_next_token_logprobs(y[None], _packed_ids(aux), aux["cu"], aux["cu"], prepacked=True)[0],)


def _packed_torch(xc, xtc, aux):
    target = torch.cat([aux["target"][1:], aux["target"][:1]])
    lp = xc.log_softmax(-1).gather(-1, target[:, None])[:, 0]
    last = torch.zeros_like(lp, dtype=torch.bool)
    last[torch.tensor(aux["cu"][1:], device=lp.device) - 1] = True  # each sequence's last slot has no next token: 0
    return (torch.where(last, 0, lp)[:-1],)


def _lp_path_sizes(truth):
    def sizes(y, yt, aux, log_v):
        return [(lp_sizes(truth(y, yt, aux)[0], log_v), torch.ones_like(y[:-1, :1]))]

    return sizes


LOGITS_PATHS = {
    "filtered_top_k": _filtered("top_k"),
    "filtered_top_p": _filtered("top_p"),
    "entropy": _reduction("entropy"),
    "cross_entropy": _reduction("cross_entropy"),
    "reverse_kl": _reduction("reverse_kl"),
    "distillation": _distillation(zero_outside_topk=True),
    "distillation_in_topk": _distillation(zero_outside_topk=False),
    "next_token": LogitsPath(_next_token_call, _next_token_truth, _next_token_torch, _lp_path_sizes(_next_token_truth)),
    "packed": LogitsPath(_packed_call, _packed_truth, _packed_torch, _lp_path_sizes(_packed_truth)),
}
