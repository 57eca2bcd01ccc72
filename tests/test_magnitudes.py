"""Exact at any magnitude (issue 10, item 1): lossfx is never less accurate than `torch.log_softmax`.

A row shifted by a constant `c` has the same log-softmax, so the truth at offset `c` is the float64
result of the unshifted row. The cases are built so that this holds exactly: the offset `c` and
the row's spread `y` are multiples of one power of two `U` chosen so that `x = c + y` is
representable in the input dtype (float64, fp32 or bf16); then `x − c = y` exactly and the truth is
`reference.log_softmax(y)` in float64, with no extended precision needed. Offsets are drawn up to
a quarter of the dtype's largest value; at large offsets `U` exceeds the spread and a row becomes a
few exact levels `c, c − U, c − 2U` (the `[1e30, 1e30, −1e30]` kind of row, whose log-sum `log 2`
the old `z − (m + log s)` lost).

Every check is: `|lossfx − truth| ≤ 2·|torch − truth| + tol`, element by element, for values and
gradients, where `torch` is `torch.log_softmax` on the logits upcast to lossfx's compute dtype
(`torch.log_softmax` in bf16 itself would be a far weaker baseline), and `tol` a few ulps of the
compute dtype relative to the size of the result (plus one rounding of the gradient's dtype).
Eager on 1 and 2 ranks with chunking, compiled (`fullgraph=True`, inductor) on 1 and 2 ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from harness import compiled_for_rank, run_ranks
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lossfx
from lossfx import reference
from lossfx._numerics import compute_dtype

F64 = torch.float64
MANTISSA_BITS = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8}


@dataclass(frozen=True)
class OffsetCase:
    dtype: torch.dtype
    world: int
    rows: int
    local_vocab: int
    n_ids: int
    log2_offset: float  # |c| = 2**log2_offset (c = 0 when negative infinity)
    negative: bool
    scale: float  # spread of the unshifted row
    chunk: int | None
    seed: int

    @property
    def vocab(self) -> int:
        return self.world * self.local_vocab

    def build(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (x in dtype `[N, V]`, y float64 `[N, V]` with x = c + y exactly, ids `[N, K]`, dout `[N, K]`)."""
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.rows, self.vocab)
        c = 0.0 if self.log2_offset == -math.inf else (-1.0 if self.negative else 1.0) * 2.0**self.log2_offset
        top = abs(c) + 4 * self.scale  # bound on |x|
        unit = 2.0 ** (math.floor(math.log2(top)) + 2 - MANTISSA_BITS[self.dtype])  # x is a multiple of it
        if unit > self.scale:  # the spread is below one ulp of the offset: exact levels c, c − U, c − 2U
            y = unit * torch.randint(-2, 1, shape, generator=gen).to(F64)
        else:
            y = torch.randn(shape, generator=gen, dtype=F64).clamp(-4, 4) * self.scale
            y = torch.round(y / unit) * unit
        c = round(c / unit) * unit
        x64 = c + y  # exact: multiples of U, |x| < 2**p · U
        x = x64.to(self.dtype)
        assert torch.equal(x.to(F64), x64), "test construction: x = c + y must be exact in the dtype"
        assert torch.equal(x64 - c, y), "test construction: x − c must be exact in float64"
        ids = torch.randint(0, self.vocab, (self.rows, self.n_ids), generator=gen)
        dout = torch.randn(self.rows, self.n_ids, generator=gen, dtype=F64)
        return x, y, ids, dout


@st.composite
def offset_cases(draw, dtypes=tuple(MANTISSA_BITS), worlds=(1, 2), chunked=True, fixed_shape=False):
    dtype = draw(st.sampled_from(dtypes))
    max_log2 = math.log2(torch.finfo(dtype).max) - 3
    log2_offset = draw(st.one_of(st.just(-math.inf), st.floats(0, max_log2), st.sampled_from([13.0, 30.0, 99.0])))
    rows = 3 if fixed_shape else draw(st.integers(1, 4))
    return OffsetCase(
        dtype=dtype,
        world=draw(st.sampled_from(worlds)),
        rows=rows,
        local_vocab=4 if fixed_shape else draw(st.integers(1, 6)),
        n_ids=2 if fixed_shape else draw(st.integers(1, 3)),
        log2_offset=log2_offset,
        negative=draw(st.booleans()),
        scale=draw(st.sampled_from([1e-3, 1.0, 30.0])),
        chunk=draw(st.sampled_from([None, 1, 2])) if chunked else None,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# The two examples of the issue: [1e30, 1e30, −1e30] in float64, [1e4]*3 + [−1e4] in fp32.
ISSUE_CASES = [
    OffsetCase(F64, 1, 1, 3, 1, math.log2(1e30), False, 1.0, None, 0),
    OffsetCase(torch.float32, 1, 1, 4, 1, 13.0, False, 1.0, None, 1),
    OffsetCase(torch.float32, 2, 2, 2, 2, 99.0, True, 1.0, 1, 2),
]


def _with_issue_examples(test):
    for case in reversed(ISSUE_CASES):
        test = example(case=case)(test)
    return test


# ---------------------------------------------------------------------------------------------
# Truth and baseline
# ---------------------------------------------------------------------------------------------


def _truth(y, ids, dout, dneg_h):
    """float64 (log-probs at ids, Σ p log p, d/dx of Σ dout·lp + dneg_h·H) of the unshifted row `y`."""
    y = y.clone().requires_grad_(True)
    lp, neg_h = reference.gather_logprobs(y, ids)
    ((lp * dout).sum() + (neg_h * dneg_h).sum()).backward()
    return lp.detach(), neg_h.detach(), y.grad


def _torch_baseline(x, ids, dout, dneg_h):
    """`torch.log_softmax` on `x` upcast to lossfx's compute dtype; gradient in `x`'s dtype."""
    x = x.detach().clone().requires_grad_(True)
    lp_all = torch.log_softmax(x.to(compute_dtype(x.dtype)), dim=-1)
    lp = lp_all.gather(-1, ids)
    neg_h = torch.where(torch.isneginf(lp_all), 0.0, lp_all.exp() * lp_all).sum(-1)
    ((lp * dout.to(lp.dtype)).sum() + (neg_h * dneg_h.to(lp.dtype)).sum()).backward()
    return lp.detach(), neg_h.detach(), x.grad


def _assert_not_less_accurate(actual, baseline, truth, *, tol, what):
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


def _check(case, outs, x, y, ids, dout, dneg_h):
    """outs: (log-probs `[N, K]`, Σ p log p `[N]` or None, dlogits `[N, V]` in x's dtype)."""
    lp, neg_h, grad = outs
    t_lp, t_neg_h, t_grad = _truth(y, ids, dout, dneg_h)
    b_lp, b_neg_h, b_grad = _torch_baseline(x, ids, dout, dneg_h)
    eps = torch.finfo(compute_dtype(case.dtype)).eps
    log_v = math.log(case.vocab) + 1
    tag = f"{case}"
    _assert_not_less_accurate(lp, b_lp, t_lp, tol=8 * eps * (log_v + t_lp.abs()), what=f"log-probs {tag}")
    if neg_h is not None:
        _assert_not_less_accurate(neg_h, b_neg_h, t_neg_h, tol=8 * eps * log_v, what=f"Σ p log p {tag}")
    assert grad.dtype == case.dtype
    # a few compute ulps of the upstream size, plus one rounding to the gradient's dtype
    upstream = dout.abs().sum(-1, keepdim=True) + dneg_h.abs()[:, None] * log_v
    tol = 8 * eps * upstream + torch.finfo(case.dtype).eps * t_grad.abs()
    _assert_not_less_accurate(grad, b_grad, t_grad, tol=tol, what=f"gradient {tag}")


# ---------------------------------------------------------------------------------------------
# Per-rank calls (eager or compiled)
# ---------------------------------------------------------------------------------------------


def _token_call(x, ids, dout, dneg_h, group, chunk):
    """-> (log-probs `[N, 1]`, None, the scalar loss to backpropagate)."""
    out = lossfx.token_logprobs(x, ids[:, 0], group=group, chunk_size=chunk)
    return out[:, None], None, (out * dout[:, 0].to(out.dtype)).sum()


def _gather_call(x, ids, dout, dneg_h, group, chunk):
    lp, neg_h = lossfx.gather_logprobs(x, ids, with_entropy=True, group=group, chunk_size=chunk)
    return lp, neg_h, (lp * dout.to(lp.dtype)).sum() + (neg_h * dneg_h.to(lp.dtype)).sum()


CALLS = {"token": _token_call, "gather": _gather_call}


def _rank_fn(rank, world, group, name, x, ids, dout, dneg_h, chunk, compiled):
    vl = x.shape[-1] // world
    shard = x[:, rank * vl : (rank + 1) * vl].detach().clone().requires_grad_(True)
    call = CALLS[name]
    frames = 0
    if compiled:

        def step(shard, ids, dout, dneg_h):
            return call(shard, ids, dout, dneg_h, group, None)

        counter, step = compiled_for_rank(rank, ("magnitudes", name, world, x.dtype), step)
        lp, neg_h, loss = step(shard, ids, dout, dneg_h)
        frames = counter.frame_count
    else:
        lp, neg_h, loss = call(shard, ids, dout, dneg_h, group, chunk)
    loss.backward()
    return lp.detach(), None if neg_h is None else neg_h.detach(), shard.grad, frames


def _run(case, name, compiled=False):
    x, y, ids, dout = case.build()
    if name == "token":
        dout = dout[:, :1]
    dneg_h = torch.randn(case.rows, dtype=F64, generator=torch.Generator().manual_seed(case.seed + 1))
    results = run_ranks(case.world, _rank_fn, name, x, ids[:, : dout.shape[1]], dout, dneg_h, case.chunk, compiled)
    lp, neg_h, _, _ = results[0]
    for other in results[1:]:
        assert torch.equal(other[0], lp), "ranks disagree on the replicated log-probs"
    grad = torch.cat([r[2] for r in results], dim=-1)
    _check(case, (lp, neg_h, grad), x, y, ids[:, : dout.shape[1]], dout, dneg_h if neg_h is not None else dneg_h * 0)
    return max(r[3] for r in results)


# ---------------------------------------------------------------------------------------------
# Eager: every dtype, 1 and 2 ranks, chunked
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(case=offset_cases())
@_with_issue_examples
def test_token_logprobs_never_less_accurate_than_log_softmax(case):
    _run(case, "token")


@settings(max_examples=40)
@given(case=offset_cases())
@_with_issue_examples
def test_gather_logprobs_never_less_accurate_than_log_softmax(case):
    _run(case, "gather")


def test_issue_examples_exactly():
    """The two reproductions of the issue, with their known truths."""
    z = torch.tensor([[1e30, 1e30, -1e30]], dtype=F64, requires_grad=True)
    lp = lossfx.token_logprobs(z, torch.tensor([0]))
    lp.sum().backward()
    torch.testing.assert_close(lp, torch.tensor([-math.log(2)], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(z.grad, torch.tensor([[0.5, -0.5, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    z32 = torch.tensor([[1e4, 1e4, 1e4, -1e4]])
    assert lossfx.token_logprobs(z32, torch.tensor([0])).item() == pytest.approx(-math.log(3), abs=2e-7)
    lp, neg_h = lossfx.gather_logprobs(z.detach(), torch.tensor([[0, 2]]), with_entropy=True)
    torch.testing.assert_close(lp, torch.tensor([[-math.log(2), -2e30]], dtype=F64), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(neg_h, torch.tensor([-math.log(2)], dtype=F64), rtol=0, atol=1e-15)
    # token_logprobs_with_lse keeps its API: the row log-sum-exp, shift + log_s rounded once
    _, lse = lossfx.token_logprobs_with_lse(z32, torch.tensor([0]))
    assert lse.item() == pytest.approx(1e4 + math.log(3), rel=1e-7)


# ---------------------------------------------------------------------------------------------
# Compiled (fullgraph, inductor): 1 and 2 ranks, fixed shapes so each dtype compiles once
# ---------------------------------------------------------------------------------------------


def _compiled_property(name, dtype, world):
    @settings(max_examples=8)
    @given(case=offset_cases(dtypes=(dtype,), worlds=(world,), chunked=False, fixed_shape=True))
    def prop(case):
        frames = _run(case, name, compiled=True)
        assert frames == 1, f"recompiled: {frames} frames for one shape and dtype"

    prop()


@pytest.mark.compile
@pytest.mark.parametrize(("name", "world"), [("token", 1), ("gather", 2)])
def test_compiled_never_less_accurate_than_log_softmax(name, world):
    _compiled_property(name, torch.float32, world)


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "dtype", "world"),
    [("token", torch.float32, 2), ("gather", torch.float32, 1)]
    + [(name, dtype, world) for name in ("token", "gather") for dtype in (F64, torch.bfloat16) for world in (1, 2)],
)
def test_compiled_never_less_accurate_than_log_softmax_more(name, dtype, world):
    _compiled_property(name, dtype, world)
