"""Tests of top-k/top-p filtering (`lossfx.filtering`) and the filtered LOGPROB loss input.

Sections (conventions §9): 0 helpers/cases; 1 reference equivalence (thresholds, values and
gradients on 1, 2 and 4 rank threads, both threshold strategies, chunked or not); 3 properties
(hypothesis); 5 compile (aot_eager on every world size, one inductor case); 6 errors;
8 `prepare_loss_input` (the -inf rule, the unfiltered copy, `data` untouched, no NaN/inf).

Rank r sees the shard `z[..., r·Vl:(r+1)·Vl]` of the full logits; its output must equal the dense
float64 reference (`lossfx.reference.apply_top_k_top_p`, sort based) and the gradients of all
ranks, concatenated along V, the reference gradient. Shapes are chosen with `B·S` not divisible
by the world size.

Top-p decisions compare float64 masses with `top_p`; two correct implementations that sum in a
different order can only disagree when some mass lies within rounding of `top_p`, so the random
cases `assume` a margin of 1e-9 (exact ties are built in on purpose, and at the boundary too).
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from types import SimpleNamespace

import pytest
import strategies
import torch
from harness import compiled_for_rank, run_ranks
from hypothesis import assume, example, given
from hypothesis import strategies as st

import lossfx
from lossfx import reference
from lossfx._core.numerics import compute_dtype
from lossfx.filtering import check_filter_params

F64 = torch.float64
STRATEGIES = ["candidates", "bisection"]
TOL64 = {"atol": 1e-10, "rtol": 1e-10}

_filter_params = st.tuples(
    st.one_of(st.none(), st.integers(-2, 40)),
    st.one_of(st.just(1.0), st.just(1e-9), st.floats(0.01, 0.999)),
)

# ---------------------------------------------------------------------------------------------
# 0. Helpers and cases
# ---------------------------------------------------------------------------------------------


def make_logits(batch, seq, vocab, *, seed=0, ties=False, neg_inf=False, dtype=F64, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    if ties:
        z = torch.randint(0, 4, (batch, seq, vocab), generator=gen).to(F64)
    else:
        z = torch.randn(batch, seq, vocab, generator=gen, dtype=F64)
    z = z * scale
    if neg_inf:
        z = z.masked_fill(torch.rand(batch, seq, vocab, generator=gen) < 0.3, float("-inf"))
        z.view(-1, vocab)[0] = float("-inf")  # one row -inf everywhere
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    return z.to(dtype), target


def margin_ok(z: torch.Tensor, top_k, top_p: float, margin: float = 1e-9, ties: str = "together") -> bool:
    """True unless some row's mass above a distinct survivor value (under `ties="sorted"`: above
    any survivor, in the sort order) is within `margin` of top_p."""
    if top_p >= 1.0:
        return True
    z = z.to(F64).reshape(-1, z.shape[-1])
    _, keep_k = reference.apply_top_k_top_p(z, top_k, 1.0)
    zk = torch.where(keep_k, z, float("-inf"))
    q = reference.log_softmax(zk).exp()
    if ties == "sorted":
        order = torch.sort(zk, dim=-1, stable=True).indices.flip(-1)
        excl = torch.cumsum(q.gather(-1, order), dim=-1) - q.gather(-1, order)
        return bool(((excl - top_p).abs() >= margin).all()) and margin_ok(z, top_k, top_p, margin)
    for row_z, row_q in zip(zk, q, strict=True):
        for value in torch.unique(row_z):
            mass = row_q[row_z > value].sum()
            if abs(float(mass) - top_p) < margin:
                return False
    return True


def _shard(z, rank, world):
    vl = z.shape[-1] // world
    return z[..., rank * vl : (rank + 1) * vl]


def _rank_threshold(rank, world, group, z, top_k, top_p, chunk, strategy, ties="together"):
    shard = _shard(z, rank, world)
    return lossfx.top_k_top_p_threshold(
        shard, top_k=top_k, top_p=top_p, group=group, chunk_size=chunk, strategy=strategy, ties=ties
    )


def _rank_logprobs(rank, world, group, z, target, dout, top_k, top_p, chunk, strategy, backend, ties="together"):
    shard = _shard(z, rank, world).detach().clone().requires_grad_(True)

    def fn(x, t):
        return lossfx.filtered_token_logprobs(
            x, t, top_k=top_k, top_p=top_p, group=group, chunk_size=chunk, strategy=strategy, ties=ties
        )

    if backend is not None:
        key = ("filtered", world, top_k, top_p, chunk, strategy, ties, z.dtype)
        _, fn = compiled_for_rank(rank, key, fn, backend)
    out = fn(shard, target)
    (grad,) = torch.autograd.grad(out, shard, dout)
    return out.detach(), grad


def reference_logprobs(z, target, dout, top_k, top_p, ties="together"):
    z64 = z.to(F64).detach().requires_grad_(True)
    out = reference.filtered_token_logprobs(z64, target, top_k, top_p, ties)
    (grad,) = torch.autograd.grad(out, z64, dout.to(F64))
    return out.detach(), grad


def check_logprobs(
    z, target, top_k, top_p, world, *, chunk=None, strategy="auto", backend=None, tol=TOL64, ties="together"
):
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    dout = dout.to(compute_dtype(z.dtype))
    ref_out, ref_grad = reference_logprobs(z, target, dout, top_k, top_p, ties)
    results = run_ranks(world, _rank_logprobs, z, target, dout, top_k, top_p, chunk, strategy, backend, ties)
    for out, _ in results:
        torch.testing.assert_close(out.to(F64), ref_out, **tol)
    grad = torch.cat([g for _, g in results], dim=-1)
    assert grad.dtype == z.dtype
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.to(F64), ref_grad, **tol)


def check_threshold(z, top_k, top_p, world, *, chunk=None, strategy="auto", ties="together"):
    _, ref_keep = reference.apply_top_k_top_p(z, top_k, top_p, ties)
    found = run_ranks(world, _rank_threshold, z, top_k, top_p, chunk, strategy, ties)
    for result in found:
        tau, cut = (result, None) if ties == "together" else result
        torch.testing.assert_close(tau, found[0] if cut is None else found[0][0], rtol=0, atol=0)
        zc = z.to(tau.dtype)
        keep = zc >= tau.unsqueeze(-1)
        if cut is not None:
            ids = torch.arange(z.shape[-1])
            keep = (zc > tau.unsqueeze(-1)) | ((zc == tau.unsqueeze(-1)) & (ids >= cut.unsqueeze(-1)))
        assert torch.equal(keep, ref_keep), (keep, ref_keep, tau, cut)


# ---------------------------------------------------------------------------------------------
# 1. Reference equivalence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "top_k,top_p", [(3, 1.0), (None, 0.7), (5, 0.8), (2, 0.3), (40, 0.95), (1000, 0.9), (0, 0.5), (-1, 1e-9)]
)
def test_logprobs_match_reference(world, strategy, top_k, top_p):
    if strategy == "candidates" and (top_k is None or top_k <= 0):
        pytest.skip("the candidate strategy needs top-k")
    z, target = make_logits(3, 5, 8 * world, seed=world * 31 + (top_k or 0))  # B·S = 15
    assume_ok = margin_ok(z, top_k, top_p)
    assert assume_ok
    check_threshold(z, top_k, top_p, world, strategy=strategy)
    check_logprobs(z, target, top_k, top_p, world, strategy=strategy)
    check_logprobs(z, target, top_k, top_p, world, strategy=strategy, chunk=4)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ties_at_kth_value_and_top_p_boundary(world, strategy):
    # Row 0: top-k=2 hits a tie group of three at the 2nd value: all are kept.
    # Row 1: top-p=0.5: the mass strictly above the tied 1s is softmax(2) ≈ 0.47 < 0.5, so the
    #        whole tie group is kept although its first member already crosses 0.5.
    # Row 2: top-p after top-k with a tie group straddling both thresholds.
    rows = torch.tensor(
        [
            [5.0, 4.0, 1.0, 4.0, 0.0, 4.0, -1.0, 2.0],
            [2.0, 1.0, 0.0, 1.0, -3.0, 1.0, -2.0, 0.0],
            [3.0, 3.0, 1.0, 1.0, 1.0, 0.0, 1.0, 3.0],
        ],
        dtype=F64,
    )
    z = rows.repeat(1, world)[:, None, :]  # [3, 1, 8·R]: ties within and across shards
    target = torch.tensor([[3], [5], [6]])
    for top_k, top_p in [(2, 1.0), (None, 0.5), (4, 0.5), (5, 0.99), (3, 0.2)]:
        if strategy == "candidates" and top_k is None:
            continue
        assert margin_ok(z, top_k, top_p)
        check_threshold(z, top_k, top_p, world, strategy=strategy)
        check_logprobs(z, target, top_k, top_p, world, strategy=strategy)
    keep = reference.apply_top_k_top_p(rows, 2, 1.0)[1]
    assert keep[0].tolist() == [True, True, False, True, False, True, False, False]
    keep = reference.apply_top_k_top_p(rows, None, 0.5)[1]
    assert keep[1].tolist() == [True, True, False, True, False, True, False, False]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_extremes_top_k_ge_v_top_p_one_and_tiny(world):
    z, target = make_logits(3, 3, 4 * world, seed=3)  # B·S = 9
    plain = reference.token_logprobs(z, target)
    for top_k, top_p in [(4 * world, 1.0), (10**6, 1.0), (10**6, 0.9999999), (None, 1.0)]:
        assume_ok = margin_ok(z, top_k, top_p)
        assert assume_ok
        check_logprobs(z, target, top_k, top_p, world)
    # top_p → 0: only the row maximum survives (its log-prob is 0, everything else -inf)
    for strategy in STRATEGIES:
        out = run_ranks(world, _rank_logprobs, z, target, torch.ones(3, 3, dtype=F64), 7, 1e-12, None, strategy, None)
        expected = torch.where(target == z.argmax(-1), 0.0, float("-inf")).to(F64)
        torch.testing.assert_close(out[0][0], expected)
    # nothing filtered: the plain log-probs
    out = run_ranks(world, _rank_logprobs, z, target, torch.ones(3, 3, dtype=F64), None, 1.0, None, "auto", None)
    torch.testing.assert_close(out[0][0], plain, **TOL64)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rows_with_neg_inf(world, strategy):
    z, target = make_logits(2, 5, 6 * world, seed=11, neg_inf=True)  # row 0 is -inf everywhere
    z[1, 2, :] = float("-inf")
    z[1, 2, 0] = 1.5  # a single finite entry
    z[0, 1, 3] = float("-inf")
    target[0, 1] = 3  # a -inf target
    for top_k, top_p in [(3, 1.0), (2, 0.6), (None, 0.8), (50, 0.9)]:
        if strategy == "candidates" and top_k is None:
            continue
        assert margin_ok(z, top_k, top_p)
        check_threshold(z, top_k, top_p, world, strategy=strategy)
        check_logprobs(z, target, top_k, top_p, world, strategy=strategy, chunk=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2])
def test_low_precision_kept_set_exact(dtype, world):
    """fp32/bf16 logits: the kept set equals the float64 reference's on the same values."""
    z, target = make_logits(2, 7, 16 * world, seed=5, dtype=dtype, scale=3.0)
    z64 = z.to(F64)
    for strategy in STRATEGIES:
        for top_k, top_p in [(5, 0.9), (9, 0.5), (200, 0.75)]:
            assert margin_ok(z64, top_k, top_p)
            taus = run_ranks(world, _rank_threshold, z, top_k, top_p, None, strategy)
            keep = z.to(torch.float32) >= taus[0].unsqueeze(-1)
            assert torch.equal(keep, reference.apply_top_k_top_p(z64, top_k, top_p)[1])
            # values in fp32; the gradient comes back in the logits' dtype (bf16: 8 mantissa bits)
            tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 8e-3}
            check_logprobs(z, target, top_k, top_p, world, strategy=strategy, tol=tol, chunk=3)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_wide_rows_two_level_candidates(world, ties):
    """Rows wide enough for the two-level local top-k (groups of 64 columns, a partial group)
    and, with ties, for the eager pass over the rows whose tie group outgrows the candidates."""
    z, target = make_logits(1, 5, 1230 * world, seed=13 + world, ties=ties)  # Vl = 1230 = 19·64 + 14
    for top_k, top_p in [(3, 1.0), (5, 0.6), (1, 0.5)]:
        assert margin_ok(z, top_k, top_p)
        check_threshold(z, top_k, top_p, world, strategy="candidates")
        check_logprobs(z, target, top_k, top_p, world, strategy="candidates", chunk=2)


def test_non_contiguous_inputs():
    z, target = make_logits(4, 3, 10, seed=2)
    zt = z.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    assert not zt.is_contiguous()
    tt = target.t().contiguous().t()
    for strategy in STRATEGIES:
        x = zt.detach().clone().requires_grad_(True)
        x_nc = x.transpose(0, 1).contiguous().transpose(0, 1)
        out = lossfx.filtered_token_logprobs(x_nc, tt, top_k=4, top_p=0.8, strategy=strategy)
        ref = reference.filtered_token_logprobs(z, target, 4, 0.8)
        torch.testing.assert_close(out, ref, **TOL64)
    # a strided vocabulary view
    wide = torch.cat([z, z], dim=-1)[..., ::2]
    assert not wide.is_contiguous()
    tau = lossfx.top_k_top_p_threshold(wide, top_k=3, top_p=0.7)
    keep = reference.apply_top_k_top_p(wide, 3, 0.7)[1]
    assert torch.equal(wide >= tau[..., None], keep)


def test_apply_top_k_top_p_matches_reference_and_masks_grad():
    z, _ = make_logits(2, 3, 12, seed=4)
    x = z.clone().requires_grad_(True)
    filtered, keep = lossfx.apply_top_k_top_p(x, top_k=5, top_p=0.8)
    ref_filtered, ref_keep = reference.apply_top_k_top_p(z, 5, 0.8)
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(filtered, ref_filtered)
    (grad,) = torch.autograd.grad(torch.where(keep, filtered, 0.0).sum(), x)
    assert torch.equal(grad, keep.to(F64))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sorted_ties_rule_example(world, strategy):
    """decisions.md item 6: for p = [.5, .2, .2, .1], top_p = 0.6 the sort-order rule keeps {0, 2}
    (the larger id of the tied pair ranks higher); "together" keeps {0, 1, 2}."""
    z = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=F64).log().repeat(1, 1, 1)  # [1, 1, 4]
    z = torch.cat([z, z + 1.0], dim=1)  # [1, 2, 4]
    target = torch.tensor([[1, 2]])
    for ties, expected in [("sorted", [True, False, True, False]), ("together", [True, True, True, False])]:
        assert reference.apply_top_k_top_p(z[0, :1], None, 0.6, ties)[1][0].tolist() == expected
        check_threshold(z, 4, 0.6, world, strategy=strategy, ties=ties)
        check_logprobs(z, target, 4, 0.6, world, strategy=strategy, ties=ties)
        keep = lossfx.apply_top_k_top_p(z, top_k=4, top_p=0.6, ties=ties)[1]
        assert keep[0, 0].tolist() == expected
    out = lossfx.filtered_token_logprobs(z, target, top_p=0.6, ties="sorted")
    assert torch.isneginf(out[0, 0]) and torch.isfinite(out[0, 1])


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sorted_ties_cut_within_large_groups(world, strategy):
    """Tie groups wider than a shard, cut at the top-p boundary by id, across ranks; with top-k
    the boundary group is the group at the k-th value too."""
    gen = torch.Generator().manual_seed(world)
    z = torch.randint(0, 3, (4, 3, 10 * world), generator=gen).to(F64)
    target = torch.randint(0, 10 * world, (4, 3), generator=gen)
    for top_k, top_p in [(None, 0.4567), (3, 0.5123), (7, 0.3141), (12, 0.9), (50, 0.2718)]:
        if strategy == "candidates" and top_k is None:
            continue
        assert margin_ok(z, top_k, top_p, ties="sorted")
        check_threshold(z, top_k, top_p, world, strategy=strategy, ties="sorted")
        check_logprobs(z, target, top_k, top_p, world, strategy=strategy, ties="sorted", chunk=5)
    keep_sorted = reference.apply_top_k_top_p(z, None, 0.4567, "sorted")[1]
    keep_together = reference.apply_top_k_top_p(z, None, 0.4567)[1]
    assert (keep_sorted.sum(-1) < keep_together.sum(-1)).any()  # the rules differ on these rows


@given(
    case=strategies.logits_cases(dtypes=(F64,), scales=(1.0, 30.0), worlds=(1, 2)),
    params=_filter_params,
    strategy=st.sampled_from(["auto", "bisection"]),
)
def test_property_sorted_ties_match_reference(case, params, strategy):
    top_k, top_p = params
    z, target = case.logits(), case.target()
    assume(margin_ok(z, top_k, top_p, ties="sorted"))
    check_threshold(z, top_k, top_p, case.world, chunk=case.chunk, strategy=strategy, ties="sorted")
    check_logprobs(z, target, top_k, top_p, case.world, chunk=case.chunk, strategy=strategy, ties="sorted")


# slow: by default the sorted tie cut compiles on 2 ranks in test_exact_boundary_compiled_aot_eager_world_2
# (candidates, aot_eager) and test_sorted_ties.py::test_sorted_ties_compiled (bisection)
@pytest.mark.slow
def test_sorted_ties_compiled_aot_eager_world_2():
    z = torch.randint(0, 3, (3, 3, 16), generator=torch.Generator().manual_seed(4)).to(F64)
    target = torch.randint(0, 16, (3, 3), generator=torch.Generator().manual_seed(5))
    assert margin_ok(z, 5, 0.4567, ties="sorted")
    check_logprobs(z, target, 5, 0.4567, 2, strategy="candidates", backend="aot_eager", ties="sorted")


# ---------------------------------------------------------------------------------------------
# 1b. Exact top-p boundaries (docs/filtering.md "Exact boundaries", proofs/filtering.md §3.3)
# ---------------------------------------------------------------------------------------------

# dyadic, decimal (their float64 values lie just below or above the decimal) and neighbours of
# exact fractions, where a rounded product or a rounded 1/t lands on the wrong side
BOUNDARY_TOP_P = [
    0.5,
    0.25,
    0.75,
    0.375,
    0.1,
    0.3,
    0.6,
    0.7,
    0.9,
    math.nextafter(1 / 3, 1.0),
    math.nextafter(0.5, 0.0),
    math.nextafter(0.5, 1.0),
]


def uniform_rows(vocab, sizes, *, fill, seed=0):
    """`[len(sizes), 1, vocab]` float64 rows, each with a tie group of `sizes[i]` entries at the row
    max (at random columns, so the group straddles shards) and the other columns at `fill`:
    "-inf", "underflow" (the max − 1e4: a float64 weight of exactly 0) or "below" (random values
    under the max: survivors only without top-k)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, t in enumerate(sizes):
        level = float(i % 3) - 1.0  # -1, 0 or 1
        if fill == "-inf":
            row = torch.full((vocab,), float("-inf"), dtype=F64)
        elif fill == "underflow":
            row = torch.full((vocab,), level - 1e4, dtype=F64)
        else:
            row = level - 0.25 - torch.randint(0, 8, (vocab,), generator=gen).to(F64) / 4
        row[torch.randperm(vocab, generator=gen)[:t]] = level
        rows.append(row)
    return torch.stack(rows)[:, None, :]


def exact_keep_count(top_p, t, ties):
    """The number of a uniform group of `t` that the rule keeps, in exact rational arithmetic: the
    j-th tied entry (by id, largest first) has the mass j / t above it under "sorted", 0 under
    "together"."""
    if ties == "together" or top_p >= 1.0:
        return t
    return sum(1 for j in range(t) if Fraction(j, t) < Fraction(top_p))


def assert_exact_group_kept(z, keep, top_p, ties):
    """Each row keeps `exact_keep_count` entries of its max group, the largest ids, and nothing else."""
    for row_z, row_keep in zip(z.reshape(-1, z.shape[-1]).to(F64), keep.reshape(-1, z.shape[-1]), strict=True):
        group = (row_z == row_z.max()).nonzero().view(-1)
        n = exact_keep_count(top_p, group.numel(), ties)
        expected = torch.zeros_like(row_keep)
        expected[group[group.numel() - n :]] = True
        assert torch.equal(row_keep, expected), (top_p, ties, group.numel(), int(row_keep.sum()), n)


@pytest.mark.parametrize("ties", ["sorted", "together"])
def test_reference_exact_boundary_uniform_rows(ties):
    """The reference on uniform rows (1..100 tokens, float64/fp32/bf16 values, with and without
    top-k renormalisation) keeps exactly the count of exact rational arithmetic:
    `apply_top_k_top_p(zeros(1, 10), top_p=0.5, ties="sorted")` keeps 5 (issue 16 item 2)."""
    assert int(reference.apply_top_k_top_p(torch.zeros(1, 10), None, 0.5, "sorted")[1].sum()) == 5
    sizes = [1, 2, 3, 5, 7, 9, 10, 18, 30, 33, 64, 100]
    for top_p in [*BOUNDARY_TOP_P, 1e-9, math.nextafter(1.0, 0.0)]:
        for fill, top_k in [("-inf", None), ("underflow", None), ("below", 1)]:
            z = uniform_rows(100, sizes, fill=fill, seed=len(fill))
            for dtype in (F64, torch.float32, torch.bfloat16):
                keep = reference.apply_top_k_top_p(z.to(dtype), top_k, top_p, ties)[1]
                assert_exact_group_kept(z, keep, top_p, ties)
    # decimal top_p is its float64 value: 0.9 lies above 9/10 (the 10th of 10 is kept), 0.3 below 3/10
    assert exact_keep_count(0.9, 10, "sorted") == 10 and exact_keep_count(0.3, 10, "sorted") == 3


def test_reference_one_more_token_breaks_the_tie_exactness():
    """A survivor below the tie group with a nonzero weight makes the row non-uniform: the mass
    above the (p·t)-th tied entry is then below top_p, and it is kept."""
    z = torch.zeros(1, 11, dtype=F64)
    z[0, 3] = -5.0  # weight e^-5: the mass above the 6th zero is 5 / (10 + e^-5) < 0.5
    assert int(reference.apply_top_k_top_p(z, None, 0.5, "sorted")[1].sum()) == 6
    z[0, 3] = -1e4  # weight 0 in float64: uniform again
    assert int(reference.apply_top_k_top_p(z, None, 0.5, "sorted")[1].sum()) == 5
    assert margin_ok(torch.tensor([[0.0] * 10 + [-5.0]]), None, 0.5, ties="sorted")
    for strategy in STRATEGIES:
        for value, kept in [(-5.0, 6), (-1e4, 5)]:
            z[0, 3] = value
            _, keep = lossfx.apply_top_k_top_p(
                z, top_k=11 if strategy == "candidates" else None, top_p=0.5, ties="sorted"
            )
            assert int(keep.sum()) == kept


# 4 ranks x bisection (64 unrolled steps per threshold) runs with -m slow; by default 4 ranks run
# the candidates strategy, and the bisection 1 and 2 ranks, every dtype.
@pytest.mark.parametrize(
    ("world", "strategy"),
    [(w, s) for w in (1, 2) for s in STRATEGIES]
    + [(4, "candidates"), pytest.param(4, "bisection", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_exact_boundary_kernels(world, strategy, dtype):
    """Uniform rows of several lengths (the rest -inf, underflowing, or cut by top-k), dyadic and
    decimal top_p, 1/2/4 ranks, both strategies, float64/fp32/bf16: the kept set is exact (equal
    to the reference and to exact rational arithmetic), values and gradients match the reference."""
    vocab = 12 * world
    sizes = [1, 2, 3, 5, 7, 10, 12, vocab]
    cases = [("below", 1), ("below", 3)] if strategy == "candidates" else [("-inf", None), ("underflow", None)]
    gen = torch.Generator().manual_seed(world)
    for fill, top_k in cases:
        sized = [t for t in sizes if top_k is None or t >= top_k]
        z = uniform_rows(vocab, sized, fill=fill, seed=world).to(dtype)
        target = torch.randint(0, vocab, (len(sized), 1), generator=gen)
        # values in fp32 and gradients in the logits' dtype (bf16: 8 mantissa bits)
        tol = {F64: TOL64, torch.float32: {"atol": 2e-6, "rtol": 2e-6}}.get(dtype, {"atol": 4e-3, "rtol": 8e-3})
        for top_p in BOUNDARY_TOP_P:
            for ties in ("sorted", "together"):
                _, keep = reference.apply_top_k_top_p(z, top_k, top_p, ties)
                assert_exact_group_kept(z, keep, top_p, ties)
                check_threshold(z, top_k, top_p, world, strategy=strategy, ties=ties)
            check_logprobs(z, target, top_k, top_p, world, strategy=strategy, ties="sorted", tol=tol, chunk=3)


@st.composite
def _boundary_top_p(draw, t):
    """A top_p at, or one float64 step beside, a fraction j/t (or anywhere in (0, 1))."""
    j = draw(st.integers(1, max(1, t - 1)))
    at = j / t if j < t else draw(st.floats(1e-6, 1.0, exclude_max=True))
    step = draw(st.sampled_from([None, 0.0, 1.0]))
    p = at if step is None else math.nextafter(at, step)
    assume(0.0 < p < 1.0)
    return p


@given(data=st.data(), t=st.integers(1, 40), extra=st.integers(0, 9), fill=st.sampled_from(["-inf", "underflow"]))
def test_property_exact_boundary_uniform_rows(data, t, extra, fill):
    """Uniform rows at random sizes, top_p at or beside j/t: kernels (both strategies) and reference
    keep exactly `⌈top_p·t⌉` under "sorted", the whole group under "together"."""
    top_p = data.draw(_boundary_top_p(t))
    z = uniform_rows(t + extra, [t], fill=fill, seed=t + extra)
    for ties in ("sorted", "together"):
        assert_exact_group_kept(z, reference.apply_top_k_top_p(z, None, top_p, ties)[1], top_p, ties)
        for top_k in (None, t):
            assert_exact_group_kept(z, lossfx.apply_top_k_top_p(z, top_k=top_k, top_p=top_p, ties=ties)[1], top_p, ties)


# each top_p is a compile per rank: 0.3 with -m slow (0.5 cuts groups of 3 and 5 inside, 10 and
# 16 exactly at ⌈p·t⌉ = p·t; the eager kernels meet both and random sizes in the property above)
@pytest.mark.parametrize("top_p", [0.5, pytest.param(0.3, marks=pytest.mark.slow)])
def test_exact_boundary_compiled_aot_eager_world_2(top_p):
    z = uniform_rows(16, [3, 5, 10, 16], fill="below", seed=3)
    target = torch.tensor([[0], [5], [9], [15]])
    check_logprobs(z, target, 2, top_p, 2, strategy="candidates", backend="aot_eager", ties="sorted")


def _torch_log_softmax_errors(z, keep, target, dout, ref_out, ref_grad):
    """`(value error, gradient error)` per row of `torch.log_softmax` on the filtered logits in
    their own compute dtype: the accuracy floor lossfx must reach (issue 10 item 1)."""
    cdtype = compute_dtype(z.dtype)
    x = z.to(cdtype).detach().requires_grad_(True)
    lp = torch.log_softmax(torch.where(keep, x, float("-inf")), dim=-1).gather(-1, target[..., None])[..., 0]
    (grad,) = torch.autograd.grad(lp, x, dout.to(cdtype))
    value_err = torch.where(torch.isfinite(ref_out), (lp.to(F64) - ref_out).abs(), 0.0)
    return value_err, (grad.to(F64) - ref_grad).abs().amax(-1)


@given(
    dtype=st.sampled_from([F64, torch.float32, torch.bfloat16]),
    exponent=st.floats(0.0, 1.0),
    sign=st.sampled_from([1.0, -1.0]),
    spread=st.sampled_from([0.3, 3.0, 30.0]),
    ties=st.booleans(),
    world=st.sampled_from([1, 2]),
    params=st.sampled_from([(3, 1.0), (None, 0.7), (4, 0.8), (40, 0.9)]),
    strategy=st.sampled_from(STRATEGIES),
    seed=st.integers(0, 2**20),
)
@example(
    dtype=F64,
    exponent=30 / 307,
    sign=1.0,
    spread=0.3,
    ties=True,
    world=2,
    params=(3, 1.0),
    strategy="candidates",
    seed=0,
)
@example(
    dtype=torch.float32,
    exponent=4 / 37,
    sign=1.0,
    spread=3.0,
    ties=False,
    world=1,
    params=(None, 0.7),
    strategy="bisection",
    seed=1,
)
def test_property_large_offsets_as_accurate_as_log_softmax(
    dtype, exponent, sign, spread, ties, world, params, strategy, seed
):
    """Logits `offset + base`, `|offset|` up to the dtype's range (the drawn `exponent` scales
    `log10(max) − 1`): the kept set is the reference's (thresholds exact at any magnitude), and
    values and gradients are never less accurate than `torch.log_softmax` on the filtered logits in
    the same compute dtype (the row max and the log-sum are kept apart)."""
    top_k, top_p = params
    if strategy == "candidates" and top_k is None:
        strategy = "bisection"
    offset = sign * 10.0 ** (exponent * (math.log10(torch.finfo(dtype).max) - 1))
    gen = torch.Generator().manual_seed(seed)
    vocab = 6 * world
    base = (
        torch.randint(0, 4, (2, 3, vocab), generator=gen).to(F64)
        if ties
        else torch.randn(2, 3, vocab, generator=gen, dtype=F64)
    )
    z = (offset + spread * base).to(dtype)
    target = torch.randint(0, vocab, (2, 3), generator=gen)
    assume(margin_ok(z, top_k, top_p, margin=1e-6))
    check_threshold(z, top_k, top_p, world, strategy=strategy)
    dout = torch.randn(2, 3, generator=gen, dtype=F64).to(compute_dtype(dtype))
    ref_out, ref_grad = reference_logprobs(z, target, dout, top_k, top_p)
    _, keep = reference.apply_top_k_top_p(z, top_k, top_p)
    floor_value, floor_grad = _torch_log_softmax_errors(z, keep, target, dout, ref_out, ref_grad)
    eps = torch.finfo(compute_dtype(dtype)).eps
    results = run_ranks(world, _rank_logprobs, z, target, dout, top_k, top_p, 2, strategy, None)
    for out, _ in results:
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref_out))
        err = torch.where(torch.isfinite(ref_out), (out.to(F64) - ref_out).abs(), 0.0)
        assert (err <= floor_value + 4 * eps * (1 + ref_out.abs().nan_to_num(posinf=0, neginf=0))).all(), (
            err,
            floor_value,
        )
    grad = torch.cat([g for _, g in results], dim=-1).to(F64)
    grad_eps = torch.finfo(dtype).eps if dtype == torch.bfloat16 else eps
    grad_err = (grad - ref_grad).abs().amax(-1)
    assert (grad_err <= floor_grad + 4 * grad_eps * dout.to(F64).abs()).all(), (grad_err, floor_grad)


def test_large_offset_examples_from_issue():
    """issue 10 item 1's cases, through the filtered path: `[1e30, 1e30, -1e30]` (float64) and
    `[1e4, 1e4, 1e4, -1e4]` (fp32)."""
    for strategy in STRATEGIES:
        z = torch.tensor([[1e30, 1e30, -1e30]], dtype=F64, requires_grad=True)
        lp = lossfx.filtered_token_logprobs(z, torch.tensor([0]), top_k=2, top_p=0.99, strategy=strategy)
        (grad,) = torch.autograd.grad(lp.sum(), z)
        torch.testing.assert_close(lp, torch.tensor([-math.log(2)], dtype=F64), **TOL64)
        torch.testing.assert_close(grad, torch.tensor([[0.5, -0.5, 0.0]], dtype=F64), **TOL64)
        x = torch.tensor([[1e4, 1e4, 1e4, -1e4]])
        lp = lossfx.filtered_token_logprobs(x, torch.tensor([0]), top_k=3, strategy=strategy)
        assert abs(float(lp) - float(torch.log_softmax(x, -1)[0, 0])) <= 1e-7


# ---------------------------------------------------------------------------------------------
# 3. Properties (hypothesis)
# ---------------------------------------------------------------------------------------------


@given(
    case=strategies.logits_cases(dtypes=(F64,), scales=(1e-3, 1.0, 30.0)),
    params=_filter_params,
    strategy=st.sampled_from(["auto", "bisection"]),
)
@example(case=strategies.example_cases(F64)[0], params=(1, 0.5), strategy="auto")
@example(case=strategies.example_cases(F64)[1], params=(None, 0.6), strategy="bisection")
@example(case=strategies.example_cases(F64)[2], params=(2, 0.4), strategy="auto")
@example(case=strategies.example_cases(F64)[2], params=(3, 0.4), strategy="bisection")
@example(case=strategies.example_cases(F64)[3], params=(100, 1e-09), strategy="auto")
def test_property_matches_reference(case, params, strategy):
    top_k, top_p = params
    z, target = case.logits(), case.target()
    assume(margin_ok(z, top_k, top_p))
    check_threshold(z, top_k, top_p, case.world, chunk=case.chunk, strategy=strategy)
    check_logprobs(z, target, top_k, top_p, case.world, chunk=case.chunk, strategy=strategy)


@given(
    vocab=st.integers(2, 24),
    seed=st.integers(0, 2**20),
    params=_filter_params,
    ties=st.booleans(),
)
def test_property_permutation_and_shift_invariance(vocab, seed, params, ties):
    """The order is by value only: permuting the vocabulary (with the target) or shifting every
    logit by a power of two changes nothing."""
    top_k, top_p = params
    z, target = make_logits(2, 3, vocab, seed=seed, ties=ties)
    assume(margin_ok(z, top_k, top_p, margin=1e-6))
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    inverse = torch.argsort(perm)
    out = lossfx.filtered_token_logprobs(z, target, top_k=top_k, top_p=top_p)
    out_perm = lossfx.filtered_token_logprobs(z[..., perm], inverse[target], top_k=top_k, top_p=top_p)
    torch.testing.assert_close(out, out_perm, **TOL64)
    out_shift = lossfx.filtered_token_logprobs(z + 8.0, target, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(out, out_shift, atol=1e-9, rtol=1e-9)
    # the kept set has positive mass; the filtered distribution sums to one
    tau = lossfx.top_k_top_p_threshold(z, top_k=top_k, top_p=top_p)
    kept = z >= tau[..., None]
    assert kept.any(-1).all()
    if top_k is not None and top_k > 0:
        assert (kept.sum(-1) >= min(top_k, vocab)).all() or top_p < 1.0


# ---------------------------------------------------------------------------------------------
# 5. Compile (fullgraph)
# ---------------------------------------------------------------------------------------------


# 1 rank (no collective in the graph) and 4 ranks with -m slow: 2 ranks compile here by default,
# 1 rank in test_compiled_graph_has_no_breaks / test_prepare_loss_input_compiled_aot_eager, 4 ranks run eagerly
# all slow: by default the candidates strategy compiles on 2 ranks under Inductor
# (test_compiled_inductor_world_2) and under aot_eager with the sorted tie rule
# (test_exact_boundary_compiled_aot_eager_world_2)
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_compiled_aot_eager_candidates(world):
    z, target = make_logits(3, 3, 6 * world, seed=world, ties=True)  # B·S = 9
    assert margin_ok(z, 4, 0.8)
    check_logprobs(z, target, 4, 0.8, world, strategy="candidates", backend="aot_eager")
    check_logprobs(z, target, 5, 1.0, world, strategy="candidates", backend="aot_eager")


def test_compiled_aot_eager_bisection_fp32():
    """The bisection unrolls 32 (fp32) or 64 (float64) steps: compiling it costs ~10-30 s, so the
    default run compiles it once (fp32, 2 ranks, top-p by bisection); float64 on 1, 2 and 4 ranks
    is in the slow variant below."""
    z, target = make_logits(3, 3, 12, seed=2, dtype=torch.float32)
    assert margin_ok(z, None, 0.7)
    check_logprobs(z, target, None, 0.7, 2, strategy="bisection", backend="aot_eager", tol={"atol": 2e-6, "rtol": 2e-6})


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_compiled_aot_eager_bisection_float64(world):
    z, target = make_logits(3, 3, 6 * world, seed=world, ties=True)  # B·S = 9
    assert margin_ok(z, None, 0.7)
    check_logprobs(z, target, None, 0.7, world, strategy="bisection", backend="aot_eager")


def test_compiled_inductor_world_2():
    z, target = make_logits(3, 3, 2 * 1230, seed=9, ties=True)  # wide rows: the two-level top-k
    assert margin_ok(z, 4, 0.8)
    check_logprobs(z, target, 4, 0.8, 2, strategy="candidates", backend="inductor")


@pytest.mark.parametrize("ties", ["together", "sorted"])
def test_next_token_filtered_logprobs_tie_rule(ties):
    # p = [.5, .2, .2, .1], top_p = 0.6: "sorted" keeps {0, 2}, "together" keeps {0, 1, 2}
    row = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64).log()
    z = row.repeat(1, 4, 1)  # [1, 4, 4]
    ids = torch.tensor([[0, 1, 2, 0]])  # scored: token 1 at t=0, token 2 at t=1, token 0 at t=2
    got = lossfx.next_token_filtered_logprobs(z, ids, top_p=0.6, ties=ties)
    want = reference.next_token_filtered_logprobs(z, ids, None, 0.6, ties)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert bool(torch.isneginf(got[0, 0])) == (ties == "sorted")  # token 1 dropped only by id order


def test_compiled_graph_has_no_breaks():
    z, target = make_logits(2, 3, 8, seed=1)

    def fn(x, t, mask):
        lp = lossfx.next_token_filtered_logprobs(x, t, top_k=3, top_p=0.9)
        return lossfx.mask_out_neg_inf_logprobs(lp, mask)

    explain = torch._dynamo.explain(fn)(z, target, torch.ones(2, 2))
    assert explain.graph_break_count == 0


# ---------------------------------------------------------------------------------------------
# 6. Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_k,top_p",
    [
        (None, 0.0),
        (None, -0.1),
        (None, 1.5),
        (None, float("nan")),
        (2.5, 1.0),
        ("3", 1.0),
        (True, 0.5),
        (None, "0.5"),
    ],
)
def test_bad_params_raise(top_k, top_p):
    z, target = make_logits(1, 2, 5)
    with pytest.raises(ValueError):
        check_filter_params(top_k, top_p)
    with pytest.raises(ValueError):
        lossfx.filtered_token_logprobs(z, target, top_k=top_k, top_p=top_p)
    with pytest.raises(ValueError):
        lossfx.top_k_top_p_threshold(z, top_k=top_k, top_p=top_p)
    with pytest.raises(ValueError):
        lossfx.TrainingSamplingParams(top_k=top_k, top_p=top_p)


def test_other_errors():
    z, target = make_logits(1, 2, 5)
    with pytest.raises(ValueError, match="strategy"):
        lossfx.filtered_token_logprobs(z, target, top_k=2, strategy="sort")
    with pytest.raises(ValueError, match="candidates"):
        lossfx.filtered_token_logprobs(z, target, top_p=0.5, strategy="candidates")
    with pytest.raises(ValueError):
        lossfx.filtered_token_logprobs(z, target[:, :1], top_k=2)
    with pytest.raises(ValueError):
        lossfx.filtered_token_logprobs(z, target + 5, top_k=2)
    with pytest.raises(TypeError):
        lossfx.filtered_token_logprobs(z.long(), target, top_k=2)
    with pytest.raises(ValueError):
        lossfx.filtered_token_logprobs(z, target, top_k=2, chunk_size=0)
    with pytest.raises(ValueError):
        lossfx.mask_out_neg_inf_logprobs(torch.zeros(2, 3), torch.ones(2, 2))


# ---------------------------------------------------------------------------------------------
# 8. prepare_loss_input: the -inf rule and the unfiltered copy
# ---------------------------------------------------------------------------------------------


def _loss_fn(kl=0.0):
    return SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB, reference_policy_kl_penalty=kl)


def _data(batch, seq, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=gen),
        "token_mask": (torch.rand(batch, seq, generator=gen) < 0.8).to(torch.float32),
        "sample_mask": torch.tensor([1.0] * (batch - 1) + [0.0]),
    }


def _rank_prepare(rank, world, group, z, data, kl, top_k, top_p, chunk, ties="together"):
    shard = _shard(z, rank, world).detach().clone().requires_grad_(True)
    own = dict(data)
    sp = lossfx.TrainingSamplingParams(top_k=top_k, top_p=top_p, ties=ties)
    out, returned = lossfx.prepare_loss_input(
        shard,
        own,
        _loss_fn(kl),
        vocab_parallel_rank=rank if group is not None else None,
        vocab_parallel_group=group,
        sampling_params=sp,
        chunk_size=chunk,
    )
    assert returned is own
    lp = out["next_token_logprobs"]
    loss = lp.sum()
    if "curr_logprobs_unfiltered" in own:
        loss = loss + 0.5 * own["curr_logprobs_unfiltered"].sum()
    (grad,) = torch.autograd.grad(loss, shard)
    extra = {k: v.detach() for k, v in own.items() if k not in data}
    return lp.detach(), grad, extra


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_prepare_loss_input_filtered(world, kl):
    batch, seq, vocab = 3, 5, 6 * world  # B·(S-1) = 12, B·S = 15
    z, _ = make_logits(batch, seq, vocab, seed=21, neg_inf=False)
    data = _data(batch, seq, vocab, seed=3)
    # force a filtered-out next token at a valid position, and one at a masked position
    data["input_ids"][0, 2] = int(z[0, 1].argmin())
    data["token_mask"][0, 2] = 1.0
    snapshot = {k: v.clone() for k, v in data.items()}
    top_k, top_p = 3, 0.8
    assert margin_ok(z[:, :-1], top_k, top_p)
    with warnings.catch_warnings(record=True) as caught:  # global: sees the rank threads' warnings
        warnings.simplefilter("always")
        results = run_ranks(world, _rank_prepare, z, data, kl, top_k, top_p, 2)
    messages = [str(w.message) for w in caught if "curr_logprobs" in str(w.message)]
    mask = (data["token_mask"] * data["sample_mask"][:, None])[:, 1:] != 0
    raw = reference.next_token_filtered_logprobs(z, data["input_ids"], top_k, top_p)
    count = f"{int((mask & ~torch.isfinite(raw)).sum())}/{int(mask.sum())} valid tokens"
    assert int((mask & ~torch.isfinite(raw)).sum()) > 0
    assert len(messages) == world and all(m.startswith(count) for m in messages), (messages, count)
    # data untouched (the ranks worked on copies of the mapping, the tensors are shared)
    for k, v in snapshot.items():
        assert torch.equal(data[k], v)
    z64 = z.detach().requires_grad_(True)
    ref, unfiltered = reference.prepare_filtered_logprob_input(z64, data, _loss_fn(kl), top_k, top_p)
    ref_loss = ref["next_token_logprobs"].sum() + (0.5 * unfiltered.sum() if unfiltered is not None else 0.0)
    (ref_grad,) = torch.autograd.grad(ref_loss, z64)
    grad = torch.cat([g for _, g, _ in results], dim=-1)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, ref_grad, **TOL64)
    for lp, _, extra in results:
        assert torch.isfinite(lp).all()
        torch.testing.assert_close(lp, ref["next_token_logprobs"], **TOL64)
        if kl:
            assert set(extra) == {"curr_logprobs_unfiltered"}
            torch.testing.assert_close(extra["curr_logprobs_unfiltered"], unfiltered, **TOL64)
        else:
            assert extra == {}


@pytest.mark.parametrize("world", [1, 2])
def test_prepare_loss_input_sorted_ties(world):
    """`TrainingSamplingParams(ties="sorted")` reaches the kernel through `prepare_loss_input`."""
    z = torch.randint(0, 3, (2, 5, 8 * world), generator=torch.Generator().manual_seed(6)).to(F64)
    data = _data(2, 5, 8 * world, seed=4)
    assert margin_ok(z[:, :-1], 6, 0.4567, ties="sorted")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_ranks(world, _rank_prepare, z, data, 0.0, 6, 0.4567, 2, "sorted")
    ref, _ = reference.prepare_filtered_logprob_input(z, data, _loss_fn(), 6, 0.4567, "sorted")
    together, _ = reference.prepare_filtered_logprob_input(z, data, _loss_fn(), 6, 0.4567)
    assert not torch.equal(ref["next_token_logprobs"], together["next_token_logprobs"])
    for lp, _, _ in results:
        torch.testing.assert_close(lp, ref["next_token_logprobs"], **TOL64)
    one_rule = r"ties must be one of \('together', 'sorted'\)"  # `lossfx.filtering.check_filter_params`, for both
    with pytest.raises(ValueError, match=one_rule + ", got 'random'"):
        lossfx.TrainingSamplingParams(top_p=0.5, ties="random")
    with pytest.raises(ValueError, match=one_rule + ", got 'stable'"):
        lossfx.filtered_token_logprobs(z[0], data["input_ids"][0], top_p=0.5, ties="stable")
    hidden = torch.eye(z.shape[-1], dtype=z.dtype)[:2]  # the fused twin: logits = hidden @ eye
    with pytest.raises(ValueError, match=one_rule + ", got 'first'"):
        lossfx.linear_filtered_token_logprobs(
            hidden, torch.eye(z.shape[-1], dtype=z.dtype), torch.tensor([0, 1]), top_p=0.5, ties="first"
        )


def test_prepare_loss_input_defaults_and_failures():
    z, target = make_logits(2, 4, 10, seed=5)
    data = {"input_ids": target}
    sp = lossfx.TrainingSamplingParams(top_k=2, top_p=0.9)
    with pytest.raises(ValueError, match="'token_mask'"):  # decisions.md §2.5: no default token_mask
        lossfx.prepare_loss_input(z, data, _loss_fn(), sampling_params=sp)
    assert set(data) == {"input_ids"}
    data = {"input_ids": target, "token_mask": torch.ones(2, 4), "sample_mask": torch.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = lossfx.prepare_loss_input(z, data, _loss_fn(), sampling_params=sp)
    lp = reference.next_token_filtered_logprobs(z, target, 2, 0.9)
    expected = torch.where(torch.isfinite(lp), lp, 0.0)  # masks of ones
    torch.testing.assert_close(out["next_token_logprobs"], expected, **TOL64)
    data = {"input_ids": target}
    # a failing call leaves data untouched
    bad = {"input_ids": target, "token_mask": torch.ones(2, 3), "sample_mask": torch.ones(2)}
    with pytest.raises(ValueError, match="token_mask"):
        lossfx.prepare_loss_input(z, bad, _loss_fn(kl=1.0), sampling_params=sp)
    assert set(bad) == {"input_ids", "token_mask", "sample_mask"}
    bad = {"input_ids": target, "token_mask": torch.ones(2, 4), "sample_mask": torch.ones(3)}
    with pytest.raises(ValueError, match="sample_mask"):
        lossfx.prepare_loss_input(z, bad, _loss_fn(kl=1.0), sampling_params=sp)
    assert set(bad) == {"input_ids", "token_mask", "sample_mask"}
    fused = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB, use_fused_linear_logprobs=True)
    with pytest.raises(ValueError, match="fused"):
        lossfx.prepare_loss_input(z[..., 0], data, fused, sampling_params=sp)


def test_mask_out_neg_inf_logprobs_warns_and_is_nan_free():
    lp = torch.tensor([[-1.0, float("-inf"), -2.0], [float("inf"), -0.5, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with pytest.warns(UserWarning, match="2/3 valid tokens"):
        out = lossfx.mask_out_neg_inf_logprobs(lp, mask, "curr_logprobs")
    assert torch.equal(out.detach(), torch.tensor([[-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    (grad,) = torch.autograd.grad(out.sum(), lp)
    assert torch.equal(grad, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(out, reference.mask_out_neg_inf_logprobs(lp, mask).float())
    # compiled: no warning, no graph break, same values
    compiled = torch.compile(lossfx.mask_out_neg_inf_logprobs, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(compiled(lp.detach(), mask), out.detach())


def test_prepare_loss_input_compiled_aot_eager():
    z, target = make_logits(2, 4, 10, seed=8)
    data = {"input_ids": target, "token_mask": torch.ones(2, 4), "sample_mask": torch.ones(2)}
    sp = lossfx.TrainingSamplingParams(top_k=3, top_p=0.9)

    loss_fn = _loss_fn()

    def fn(x):
        return lossfx.prepare_loss_input(x, dict(data), loss_fn, sampling_params=sp)[0]["next_token_logprobs"]

    x = z.clone().requires_grad_(True)
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    x2 = z.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out2 = fn(x2)
    (grad2,) = torch.autograd.grad(out2.sum(), x2)
    torch.testing.assert_close(out, out2, **TOL64)
    torch.testing.assert_close(grad, grad2, **TOL64)
    assert math.isfinite(float(grad.abs().sum()))


@pytest.mark.slow
@given(
    case=strategies.logits_cases(dtypes=(F64,), max_local_vocab=40, max_seq=12),
    params=_filter_params,
    strategy=st.sampled_from(["auto", "bisection"]),
)
def test_property_matches_reference_large(case, params, strategy):
    top_k, top_p = params
    z, target = case.logits(), case.target()
    assume(margin_ok(z, top_k, top_p))
    check_threshold(z, top_k, top_p, case.world, chunk=case.chunk, strategy=strategy)
    check_logprobs(z, target, top_k, top_p, case.world, chunk=case.chunk, strategy=strategy)


# ---------------------------------------------------------------------------------------------
# 7. Proof checks (proofs/filtering.md)
# ---------------------------------------------------------------------------------------------


def _rank_threshold_uneven(rank, world, group, z, top_k, top_p, ties):
    widths = [z.shape[-1] // world + (1 if r < z.shape[-1] % world else 0) for r in range(world)]
    start = sum(widths[:rank])
    shard = z[..., start : start + widths[rank]]  # a column slice: not contiguous
    out = lossfx.top_k_top_p_threshold(
        shard,
        top_k=top_k,
        top_p=top_p,
        group=group,
        chunk_rows=5,
        strategy="bisection",
        ties=ties,
        vocab_start=start,
        vocab_size=z.shape[-1],
    )
    return out if ties == "sorted" else (out,)


def _radix_cases():
    gen = torch.Generator().manual_seed(3)
    n, v = 12, 37
    yield torch.randn(n, v, generator=gen, dtype=F64) * 3  # distinct values
    yield torch.randint(0, 4, (n, v), generator=gen).to(F64)  # large tie groups
    z = torch.randn(n, v, generator=gen, dtype=F64) * 2
    yield z.masked_fill(torch.rand(n, v, generator=gen) < 0.4, float("-inf"))  # -inf entries
    uniform = torch.full((n, v), -2000.0, dtype=F64)  # uniform rows: one tie group, the rest weigh 0
    for row in range(n):
        uniform[row, : 1 + row % 10] = 1.5
    yield uniform
    yield torch.randn(n, v, generator=gen, dtype=F64) * 1e-30  # tiny values around ±0
    yield torch.round(torch.randn(n, v, generator=gen, dtype=F64) * 4) / 4 + 3e4  # large offset, ties


# 2 ranks: uneven (19 + 18); bf16 on 2 ranks and 3 ranks with -m slow (bf16 keys by default on 1 rank,
# the uneven shards by default in fp32)
@pytest.mark.parametrize(
    ("dtype", "world"),
    [
        (torch.float32, 1),
        (torch.bfloat16, 1),
        (torch.float32, 2),
        pytest.param(torch.bfloat16, 2, marks=pytest.mark.slow),
        pytest.param(torch.float32, 3, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, 3, marks=pytest.mark.slow),
    ],
)
def test_radix_top_p_decides_as_the_bisection(monkeypatch, dtype, world):
    """proofs/filtering.md §3.2: the 256-ary top-p search over fp32 keys (4 passes) returns the
    32-step bisection's threshold and id cut bit for bit: uneven TP shards, both tie rules, top-p
    after a large top-k (masked entries), ties, uniform rows, -inf entries, tiny values."""
    from lossfx._kernels import filtering

    bisection = filtering._top_p_by_bisection

    def halving(*args, **kwargs):
        return bisection(*args, **kwargs, radix=False)

    for z in _radix_cases():
        z = z.to(dtype)
        for top_k, top_p in [(None, 0.9), (None, 0.3), (None, 0.5), (7, 0.6), (None, 1e-9), (None, 0.999)]:
            for ties in ("together", "sorted"):
                args = (z, top_k, top_p, ties)
                radix = run_ranks(world, _rank_threshold_uneven, *args)
                with monkeypatch.context() as m:
                    m.setattr(filtering, "_top_p_by_bisection", halving)
                    halved = run_ranks(world, _rank_threshold_uneven, *args)
                for got, want in zip(radix, halved, strict=True):
                    for a, b in zip(got, want, strict=True):
                        assert a.dtype == b.dtype
                        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), (a, b)
                if world == 1:
                    check_threshold(z, top_k, top_p, 1, strategy="bisection", ties=ties, chunk=5)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_proof_keys_are_monotone(dtype):
    """§3.2: `key` is strictly increasing on canonical floats and `f = key⁻¹` inverts it."""
    from lossfx._kernels.filtering import _float_to_key, _floor_avg, _key_bits, _key_to_float

    info = torch.finfo(dtype)
    special = [
        -math.inf,
        -info.max,
        -1.5,
        -info.tiny,
        -info.tiny * info.eps,
        0.0,
        info.tiny * info.eps,
        info.tiny,
        1.0,
        info.max,
        math.inf,
    ]
    x = torch.cat([torch.tensor(special, dtype=dtype), torch.randn(500, dtype=dtype) * 10]).unique()  # sorted
    keys = _float_to_key(x)
    assert (keys[1:] > keys[:-1]).all()
    assert torch.equal(_key_to_float(keys, dtype), x)
    assert torch.equal(_float_to_key(torch.tensor([-0.0], dtype=dtype)), torch.tensor([0]))
    # every integer between two keys is a non-NaN float between them
    mids = _floor_avg(keys[:-1], keys[1:])  # no int64 overflow
    assert torch.equal(_floor_avg(keys[:-1], keys[1:], _key_bits(dtype)), mids)  # the 2-op form of narrow keys
    between = _key_to_float(mids, dtype)
    assert not torch.isnan(between).any()
    assert ((between >= x[:-1]) & (between <= x[1:])).all()


@given(seed=st.integers(0, 2**20), k=st.integers(1, 12), cuts=st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_proof_candidates_lemma(seed, k, cuts):
    """Lemma 2: the k largest of the union of per-shard top-min(k, Vl) (padded with -inf) are the
    row's k largest, also for uneven shards and ties."""
    gen = torch.Generator().manual_seed(seed)
    vocab = sum(cuts)
    z = torch.randint(0, 5, (3, vocab), generator=gen).to(F64)
    k = min(k, vocab)
    shards = torch.split(z, cuts, dim=-1)
    parts = []
    for shard in shards:
        top = torch.topk(shard, min(k, shard.shape[-1]), dim=-1).values
        parts.append(torch.cat([top, torch.full((3, k - top.shape[-1]), float("-inf"), dtype=F64)], dim=-1))
    union = torch.topk(torch.cat(parts, dim=-1), k, dim=-1).values
    assert torch.equal(union, torch.topk(z, k, dim=-1).values)


def test_double_backward_is_refused():
    z, target = make_logits(2, 3, 8, seed=6)
    x = z.clone().requires_grad_(True)
    out = lossfx.filtered_token_logprobs(x, target, top_k=3, top_p=0.8)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_memory_contract_saved_bytes(strategy):
    """Saved for backward: the logits themselves (no copy), the target and two `[N]` vectors."""
    z, target = make_logits(4, 5, 300, seed=1, dtype=torch.float32)
    x = z.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lossfx.filtered_token_logprobs(x, target, top_k=7, top_p=0.9, strategy=strategy)
    big = [t for t in saved if t.numel() > 20]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()
    assert sum(t.numel() * t.element_size() for t in saved if t.numel() <= 20) <= 4 * 20 * 8


# ---------------------------------------------------------------------------------------------
# 9. Degenerate shapes and NaN rows (issue 10, items 2 and 3)
# ---------------------------------------------------------------------------------------------


def _rank_prepare_shape(rank, world, group, batch, seq, vocab, backend):
    z = torch.randn(batch, seq, vocab * world, dtype=F64, generator=torch.Generator().manual_seed(batch + seq))
    data = {"input_ids": torch.zeros(batch, seq, dtype=torch.long), "token_mask": torch.ones(batch, seq)}
    shard = _shard(z, rank, world).detach().clone().requires_grad_(True)
    sp = lossfx.TrainingSamplingParams(top_k=2, top_p=0.9)
    loss_fn = _loss_fn()

    def fn(x):
        tp_rank = rank if group is not None else None
        out, _ = lossfx.prepare_loss_input(
            x, dict(data), loss_fn, vocab_parallel_rank=tp_rank, vocab_parallel_group=group, sampling_params=sp
        )
        return out["next_token_logprobs"]

    if backend is not None:
        _, fn = compiled_for_rank(rank, ("prepare_shape", world, batch, seq), fn, backend)
    out = fn(shard)
    (grad,) = torch.autograd.grad(out.sum(), shard, allow_unused=True)
    return out.detach(), grad


# compiled: 2 ranks cover the collectives, 1 rank runs eagerly (compile time); B = 0 compiled is
# in the slow run (S = 1 compiled and B = 0 eager on 1 and 2 ranks run by default)
@pytest.mark.parametrize(
    ("world", "backend", "batch", "seq"),
    [(w, None, b, s) for w in (1, 2) for b, s in [(0, 4), (2, 1)]]
    + [(2, "aot_eager", 2, 1), pytest.param(2, "aot_eager", 0, 4, marks=pytest.mark.slow)],
)
def test_empty_rows_give_empty_results(world, backend, batch, seq):
    """decisions.md §2.9: `B = 0` or `S = 1` (no next-token position) returns `[B, S-1]` results."""
    for strategy in STRATEGIES:
        for shape in [(0, 7 * world), (3, 0, 7 * world)]:
            x = torch.randn(shape, dtype=F64, requires_grad=True)
            t = torch.zeros(shape[:-1], dtype=torch.long)
            out = lossfx.filtered_token_logprobs(x, t, top_k=2, top_p=0.5, strategy=strategy)
            assert out.shape == shape[:-1]
            (grad,) = torch.autograd.grad(out.sum(), x)
            assert grad.shape == shape
            assert lossfx.top_k_top_p_threshold(x, top_k=2, strategy=strategy).shape == shape[:-1]
            assert lossfx.apply_top_k_top_p(x, top_k=2, top_p=0.5)[1].shape == shape
    results = run_ranks(world, _rank_prepare_shape, batch, seq, 7, backend)
    for out, grad in results:
        assert out.shape == (batch, seq - 1)
        assert grad is None or (grad.shape == (batch, seq, 7) and not grad.any())


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_row_stays_nan_and_confined(world, strategy):
    """A row holding a NaN gives a NaN log-prob and a NaN gradient in every column (as
    `torch.log_softmax` of the unfiltered row would), on every rank; every other row is exact.
    Never `-inf` (which `prepare_loss_input` would report as a filter mismatch)."""
    z, target = make_logits(2, 4, 6 * world, seed=17)
    z[0, 1, 2] = float("nan")
    z[1, 3, 5 * world] = float("nan")  # on the last rank's shard
    for top_k, top_p in [(None, 0.8), (3, 0.8), (3, 1.0), (40, 0.5)]:
        if strategy == "candidates" and top_k is None:
            continue
        ref_out, ref_grad = reference_logprobs(z, target, torch.ones(2, 4, dtype=F64), top_k, top_p)
        nan_rows = torch.isnan(z).any(-1)
        assert torch.isnan(ref_out).eq(nan_rows).all()
        ones = torch.ones(2, 4, dtype=F64)
        results = run_ranks(world, _rank_logprobs, z, target, ones, top_k, top_p, 3, strategy, None)
        for out, _ in results:
            torch.testing.assert_close(out, ref_out, equal_nan=True, **TOL64)
        grad = torch.cat([g for _, g in results], dim=-1)
        torch.testing.assert_close(grad, ref_grad, equal_nan=True, **TOL64)
        assert grad[nan_rows].isnan().all() and torch.isfinite(grad[~nan_rows]).all()
        taus = run_ranks(world, _rank_threshold, z, top_k, top_p, None, strategy)
        assert torch.isnan(taus[0]).eq(nan_rows).all()


def test_nan_row_is_not_a_filter_mismatch():
    """issue 10 item 3, end to end: through `prepare_loss_input` a NaN row stays NaN at its own
    position (no "policy top-k/top-p mismatch" warning, no silent 0), a `-inf` one becomes 0 with the
    warning, every other position equals the reference."""
    z, target = make_logits(1, 5, 12, seed=23)
    target[:, 1:] = z[:, :-1].argmax(-1)  # every scored token is its row's argmax: kept by any filter
    z[0, 1, 4] = float("nan")  # the row scoring target[0, 2]
    data = {"input_ids": target, "token_mask": torch.ones(1, 5)}
    sp = lossfx.TrainingSamplingParams(top_p=0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN row is no mismatch: nothing to warn about
        out = lossfx.prepare_loss_input(z, dict(data), _loss_fn(), sampling_params=sp)[0]["next_token_logprobs"]
    raw = reference.next_token_filtered_logprobs(z, target, None, 0.8)
    want = reference.mask_out_neg_inf_logprobs(raw, data["token_mask"][:, 1:])
    assert torch.isnan(out[0, 1]) and torch.isnan(out).sum() == 1
    torch.testing.assert_close(out, want, equal_nan=True, **TOL64)
    lp = torch.tensor([[float("nan"), float("-inf"), -1.0]])
    with pytest.warns(UserWarning, match="1/3 valid tokens"):
        masked = lossfx.mask_out_neg_inf_logprobs(lp, torch.ones(1, 3))
    torch.testing.assert_close(masked, torch.tensor([[float("nan"), 0.0, -1.0]]), equal_nan=True)


# ---------------------------------------------------------------------------------------------
# 10. Memory bounds (issue 10, items 8 and 9)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter: ~20 s on the shared 2-core machine
@pytest.mark.cpu_only("the CPU memory method: resident high-water mark of a fresh process (benchmarks/rss.py)")
def test_eager_forward_temporaries_stay_within_one_chunk(monkeypatch):
    """issue 10 item 8: the rows whose ties at the k-th value outgrow the local candidates are
    counted a chunk at a time, never gathered whole (resident high-water mark, fresh process)."""
    import os

    from benchmarks.rss import peak_rss_extra_bytes

    rows, vocab, chunk = 512, 32768, 16
    z = (torch.randn(64, vocab, generator=torch.Generator().manual_seed(0)) * 2.0).to(torch.bfloat16)
    local = torch.topk(z.float(), 51, dim=-1).values
    assert (local[:, -1] == local[:, -2]).float().mean() > 0.5  # most rows take the counting pass
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", tests_dir + os.pathsep + os.environ.get("PYTHONPATH", ""))
    peak = peak_rss_extra_bytes("filtering_rss:filtered_forward", {"rows": rows, "vocab": vocab, "chunk": chunk})
    logits_bytes = rows * vocab * 2
    assert peak < 0.25 * logits_bytes, (peak, logits_bytes)


@pytest.mark.parametrize("ties", ["together", pytest.param("sorted", marks=pytest.mark.slow)])
def test_compiled_backward_saves_the_logits_not_an_fp32_copy(ties):
    """issue 10 item 9: under torch.compile (Inductor's decompositions and min-cut partitioner),
    what the forward saves for the backward holds no `[N, Vl]` tensor but the bf16 logits."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    saved = []

    def bw_compiler(gm, example_inputs):
        saved.extend((n.meta["val"].dtype, tuple(n.meta["val"].shape)) for n in gm.graph.nodes if n.op == "placeholder")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=bw_compiler,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    z, target = make_logits(1, 8, 4096, seed=3, dtype=torch.bfloat16, scale=2.0)

    def fn(x, t):
        return lossfx.filtered_token_logprobs(x, t, top_k=50, top_p=0.9, ties=ties)

    x = z.clone().requires_grad_(True)
    out = torch.compile(fn, backend=backend, fullgraph=True)(x, target)
    out.sum().backward()
    wide = [(dtype, shape) for dtype, shape in saved if math.prod(shape) >= 8 * 4096]
    assert wide and all(dtype == torch.bfloat16 for dtype, _ in wide), saved
