"""The one (max, Σexp) merge (`lossfx._core.numerics.merge`): its `-inf`, `+inf` and NaN rows.

proofs/logprobs.md §3.1: an all `-inf` part adds exactly nothing; an all `-inf` row is
`(shift, S, U) = (0, 0, 0)` and merges again exactly; a row with a NaN or `+inf` logit has a NaN
shift and a NaN `log S`, `lse` and `U / S`, as `torch.log_softmax` makes that row. Checked on
random partitions of rows into parts (vocabulary blocks), merged once, and merged in two levels
(blocks, then ranks), against the dense float64 row.
"""

from __future__ import annotations

import math

import pytest
import torch

from lossfx._core import numerics, tiles

F64 = torch.float64


def _rows(seed: int, n_rows: int = 7, vocab: int = 12) -> torch.Tensor:
    """`[n_rows, vocab]` float64 rows: finite; `-inf` on some columns; `-inf` on columns [0, 6)
    (a whole part in the splits below); all `-inf`; a NaN; a `+inf`; finite but far below 0 (so
    a shift of 0 in place of the `-inf` part's max would lose its mass)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n_rows, vocab, generator=gen, dtype=F64) * 3
    z[1, torch.randperm(vocab, generator=gen)[:4]] = -math.inf
    z[2, :6] = -math.inf
    z[3] = -math.inf
    z[4, int(torch.randint(vocab, (1,), generator=gen))] = math.nan
    z[5, int(torch.randint(vocab, (1,), generator=gen))] = math.inf
    z[6] = z[6] - 1000.0
    z[6, :6] = -math.inf
    return z


def _parts(z: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-part `(m, s, u)` `[R, N]` of the columns `[bounds[r], bounds[r + 1])`, as the kernels
    compute them: about the part's own max, shifted by 0 where that max is not finite."""
    ms, ss, us = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        part = z[:, a:b]
        m = part.amax(dim=-1)
        x = part - numerics.finite_or_zero(m)[:, None]
        e = torch.exp(x)
        ms.append(m)
        ss.append(e.sum(dim=-1))
        us.append(torch.where(e > 0, e * x, 0.0).sum(dim=-1))  # 0·log 0 = 0
    return torch.stack(ms), torch.stack(ss), torch.stack(us)


def _check_row_semantics(z: torch.Tensor, shift: torch.Tensor, total: torch.Tensor, moment: torch.Tensor) -> None:
    nan_row = z.isnan().any(-1) | z.isposinf().any(-1)
    dead = z.isneginf().all(-1)
    # 3. a NaN or +inf logit: NaN shift, NaN log S, NaN Σ p log p (U / S − log S)
    assert torch.equal(shift.isnan(), nan_row)
    assert torch.equal(total.isnan(), nan_row)
    neg_entropy = moment / total - torch.log(total)
    assert neg_entropy[nan_row].isnan().all()
    # 2. an all -inf row: shift 0, S = 0, U = 0
    assert torch.equal(shift[dead], torch.zeros_like(shift[dead]))
    assert torch.equal(total[dead], torch.zeros_like(total[dead]))
    assert torch.equal(moment[dead], torch.zeros_like(moment[dead]))
    # 1. the finite rows: the dense lse and Σ p log p, whatever their -inf parts
    live = ~nan_row & ~dead
    lse = shift + torch.log(total)
    torch.testing.assert_close(lse[live], torch.logsumexp(z[live], -1), rtol=0, atol=1e-12)
    lp = torch.log_softmax(z[live], -1)
    want = torch.where(lp.isneginf(), 0.0, lp.exp() * lp).sum(-1)
    torch.testing.assert_close(neg_entropy[live], want, rtol=0, atol=1e-12)
    assert lse[live].isfinite().all() and neg_entropy[live].isfinite().all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bounds", [[0, 12], [0, 6, 12], [0, 3, 6, 9, 12], [0, 6, 7, 12]])
def test_one_level_merge(seed, bounds):
    z = _rows(seed)
    m, s, u = _parts(z, bounds)
    merged = numerics.merge(m, s)
    moment = numerics.merge_moment(merged, s, u)
    _check_row_semantics(z, merged.shift, merged.total, moment)
    # an all -inf part has weight exactly 0
    assert torch.equal(merged.weight[m.isneginf()], torch.zeros_like(merged.weight[m.isneginf()]))
    # merge_max_logsum and merge_stats are the same merge
    shift, log_s = numerics.merge_max_logsum(m, s)
    torch.testing.assert_close(shift, merged.shift, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(log_s, torch.log(merged.total), rtol=0, atol=0, equal_nan=True)
    big, total, moment2 = tiles.merge_stats(m, s, u)
    assert tiles.merge_stats is numerics.merge_stats  # one spelling, re-exported by the tile engine
    torch.testing.assert_close(big, m.amax(0), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(total, merged.total, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(moment2, moment, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("seed", range(4))
def test_two_level_merge_blocks_then_ranks(seed):
    """Blocks merged per rank (`merge_stats`: `M` as is), then the ranks' parts merged again: an
    all `-inf` rank part `(-inf, 0, 0)` beside a finite part at `-1000` keeps that part's mass."""
    z = _rows(seed)
    per_rank = []
    for cols in ((0, 3, 6), (6, 9, 12)):  # rank 0: columns [0, 6) in 2 blocks; rank 1: [6, 12)
        m, s, u = _parts(z, list(cols))
        per_rank.append(tiles.merge_stats(m, s, u))
    m, s, u = (torch.stack(x) for x in zip(*per_rank, strict=True))
    merged = numerics.merge(m, s)
    _check_row_semantics(z, merged.shift, merged.total, numerics.merge_moment(merged, s, u))


def test_no_nan_where_every_part_is_neg_inf_or_underflows():
    """`0 · (±inf)` of a weight-0 part never reaches the result: an all `-inf` part (`δ = -inf`),
    and a part whose mass underflows with `u = +inf` (a divergence's teacher `-inf` there)."""
    m = torch.tensor([[0.0], [-math.inf], [-2000.0]], dtype=F64)
    s = torch.tensor([[2.0], [0.0], [1.0]], dtype=F64)
    u = torch.tensor([[-0.5], [0.0], [math.inf]], dtype=F64)
    merged = numerics.merge(m, s)
    assert merged.weight[1:].eq(0).all()
    assert numerics.merge_moment(merged, s, u).item() == -0.5
    assert merged.total.item() == 2.0
