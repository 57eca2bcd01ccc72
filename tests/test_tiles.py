"""The tile engine of hidden states × LM head (`lossfx/_core/tiles.py`): its merge, its sizes, and the
launch count of every fused path under the GPU policy (counted on `meta` tensors, no GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

from benchmarks.bench_launches import _paths, count
from lossfx._core import tiles as _tiles
from lossfx._core.chunking import CPU_POLICY, GPU_POLICY

F64 = torch.float64


@settings(max_examples=examples(30), deadline=None)
@given(parts=st.integers(1, 5), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 30.0, 1e4]))
def test_merge_stats_of_any_column_partition_is_the_whole_rows(parts, seed, scale):
    """`merge_stats` of per-part `(m, s, u)` gives the whole rows' max, `Σ exp(z − M)` and
    `Σ exp(z − M)(z − M)` (float64 reference: logsumexp and the softmax moment)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(6, 23, generator=gen, dtype=F64) * scale
    bounds = torch.linspace(0, 23, parts + 1).round().long().tolist()
    m, s, u = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        part = z[:, a:b]
        mp = part.amax(1) if b > a else torch.full((6,), float("-inf"), dtype=F64)
        x = part - mp[:, None]
        m.append(mp), s.append(x.exp().sum(1)), u.append((x.exp() * x).sum(1))
    big, total, moment = _tiles.merge_stats(torch.stack(m), torch.stack(s), torch.stack(u))
    assert moment is not None
    lse = torch.logsumexp(z, 1)
    torch.testing.assert_close(big + total.log(), lse, rtol=0, atol=1e-12 * scale)
    p = torch.softmax(z, 1)
    torch.testing.assert_close(moment / total - total.log(), (p * torch.log_softmax(z, 1)).sum(1), rtol=0, atol=1e-9)


@settings(max_examples=examples(30), deadline=None)
@given(parts=st.integers(2, 5), dead=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_merge_stats_with_neg_inf_parts(parts, dead, seed):
    """proofs/fused_linear.md §10: parts whose columns are all `-inf` (`(-inf, 0, 0)`) add nothing,
    in any order, folded pairwise (as the vocabulary blocks are) or all at once (as the ranks
    are); a row whose parts are all `-inf` stays `(-inf, 0, 0)`, with no NaN."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(4, 5 * parts, generator=gen, dtype=F64) * 3
    killed = torch.randperm(parts, generator=gen)[: min(dead, parts - 1)]
    for k in killed.tolist():
        z[:2, 5 * k : 5 * k + 5] = float("-inf")  # rows 0-1: some parts all -inf
    z[3] = float("-inf")  # row 3: every part
    m, s, u = [], [], []
    for k in range(parts):
        part = z[:, 5 * k : 5 * k + 5]
        mp = part.amax(1)
        x = part - torch.where(mp.isfinite(), mp, 0.0)[:, None]
        e = x.exp()
        m.append(mp), s.append(e.sum(1)), u.append(torch.where(e > 0, e * x, 0.0).sum(1))
    m, s, u = torch.stack(m), torch.stack(s), torch.stack(u)
    big, total, moment = _tiles.merge_stats(m, s, u)
    folded = (m[0], s[0], u[0])
    for k in range(1, parts):  # the vocabulary blocks' pairwise fold
        pair = [torch.stack([a, b]) for a, b in zip(folded, (m[k], s[k], u[k]), strict=True)]
        folded = _tiles.merge_stats(*pair)
    for got in ((big, total, moment), folded):
        assert got[2] is not None and not any(t.isnan().any() for t in got)
        live = slice(0, 3)
        lse = torch.logsumexp(z[live], 1)
        shift = got[0][live]
        torch.testing.assert_close(shift + got[1][live].log(), lse, rtol=0, atol=1e-12)
        lp = torch.log_softmax(z[live], 1)
        want = torch.where(lp.isneginf(), 0.0, lp.exp() * lp).sum(1)
        torch.testing.assert_close(got[2][live] / got[1][live] - got[1][live].log(), want, rtol=0, atol=1e-12)
        assert got[0][3] == float("-inf") and got[1][3] == 0 and got[2][3] == 0


def test_cpu_policy_keeps_the_fused_tile_sizes():
    """CPU: `[C, Cv]` tiles near `tile_bytes` with `Cv <= max_block`; bf16 weights bound `Cv` by the
    `[Cv, H]` fp32 accumulator; rows-outside chunks `min(N/16, chunk_bytes / row bytes)`, >= 16."""
    p = CPU_POLICY
    assert _tiles.tile_shape(151936, 512, torch.float32, p) == (p.max_block, p.tile_bytes // (p.max_block * 4))
    assert _tiles.tile_shape(100, 512, torch.float32, p) == (100, p.tile_bytes // (100 * 4))
    assert _tiles.tile_shape(151936, 4096, torch.bfloat16, p)[0] == p.tile_bytes // (4096 * 4)
    assert _tiles.chunk_rows_for(2048, 151936, torch.float32, p) == 2048 // 16
    assert _tiles.chunk_rows_for(1 << 20, 151936, torch.bfloat16, p) == p.chunk_bytes // (151936 * 4)
    assert _tiles.chunk_rows_for(40, 1000, F64, p) == _tiles.MIN_CHUNK_ROWS


# [1, 16384, 151936] scaled down 16x in N and V, the policy's budgets 256x (tiles are [rows, V]) and
# max_block 16x: the same tile and chunk counts as the full shape under GPU_POLICY (10 row chunks of
# one vocabulary block; 16 rows-outside chunks), so the same op counts (benchmarks/bench_launches.py
# prints the full-shape table: 280 to 718 launching ops per fwd+bwd).
_SCALED = dataclasses.replace(
    GPU_POLICY,
    tile_bytes=GPU_POLICY.tile_bytes // 256,
    chunk_bytes=GPU_POLICY.chunk_bytes // 256,
    max_block=GPU_POLICY.max_block // 16,
)


@pytest.mark.parametrize("path", list(_paths()))
def test_every_fused_path_launches_under_1000_ops_per_step_on_a_gpu(path):
    """Kernel-launching aten ops of one forward + backward (views and allocations excluded), with
    the tile loops' bodies counted; independent of H."""
    counts = [sum(count(path, 16384 // 16, hidden, 151936 // 16, _SCALED).values()) for hidden in (8, 40)]
    assert counts[0] == counts[1], counts
    assert counts[0] < 1000, counts
    # cache-sized tiles (the former CPU policy) need more: the bound is about the policy's tile sizes
    cache_sized = dataclasses.replace(CPU_POLICY, tile_bytes=4 << 20, max_block=2048)
    assert sum(count(path, 1024, 8, 9496, cache_sized).values()) >= counts[0]


def test_compiled_tile_bodies_match_the_reference_and_compile_once_per_tile_shape():
    """`compile_tiles` (the GPU policy's choice, forced here on CPU): the fused path's per-tile
    arithmetic runs as Inductor-compiled bodies on the full `[C, Cv]` tiles, with the float64
    reference's values and gradients; a second call, and a call with another N whose full tiles
    have the same shape, compile nothing more (the ragged tiles run the eager body)."""
    from torch._dynamo.utils import counters

    import lossfx
    from lossfx import reference
    from lossfx._core.chunking import chunk_policy

    policy = dataclasses.replace(CPU_POLICY, max_block=5, compile_tiles=True)
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(12, 6, generator=gen, dtype=F64), torch.randn(12, generator=gen, dtype=F64)
    opts = {"temperature": 0.8, "softcap": 3.0, "logit_scale": 1.5}

    def step(n):
        hidden = torch.randn(n, 6, generator=gen, dtype=F64)
        target = torch.randint(0, 12, (n,), generator=gen)
        g, e = torch.randn(n, generator=gen, dtype=F64), torch.randn(n, generator=gen, dtype=F64)
        results = []
        for fn in (lossfx.linear_token_logprobs, reference.linear_token_logprobs):
            h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
            if fn is reference.linear_token_logprobs:
                lp, ne = fn(h, w, target, 0.8, bias=b, logit_scale=1.5, softcap=3.0)
                torch.autograd.backward([lp, ne], [g, e])
            else:
                with chunk_policy(policy):  # read by the forward's and the backward's loops
                    lp, ne = fn(h, w, target, bias=b, chunk_size=4, return_neg_entropy=True, **opts)
                    torch.autograd.backward([lp, ne], [g, e])
            results.append((lp, ne, h.grad, w.grad, b.grad))
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    before = counters["stats"]["unique_graphs"]
    step(10)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled - before == 2  # the forward's and the backward's tile bodies, once each
    step(10)
    step(14)  # full tiles [4, 5] again: ragged rows and the last block of 2 columns run eagerly
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize(
    ("head_dtype", "logits_dtype"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32)],
)
def test_projected_teacher_rounds_each_product_to_logits_dtype(head_dtype, logits_dtype):
    """The engine's projection of a teacher (`round_to`): the same teacher logits as
    `project_onto_lm_head` (the product in `promote_types(head, logits_dtype)`, rounded to
    `logits_dtype`), so the same divergence and student gradient as with those logits given (to a
    few fp32 ulps: the BLAS may sum a 3-row chunk's products in another order than all rows')."""
    from lossfx import reverse_kl_to_fixed
    from lossfx.divergence import divergence_to_projected_teacher, project_onto_lm_head

    gen = torch.Generator().manual_seed(9)
    student = torch.randn(2, 7, 40, generator=gen).requires_grad_()
    hidden = torch.randn(2, 7, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen).to(head_dtype)
    out = divergence_to_projected_teacher(
        "reverse_kl", student, hidden, [weight], chunk_size=3, logits_dtype=logits_dtype
    )
    (grad,) = torch.autograd.grad(out.sum(), student)
    teacher = project_onto_lm_head(hidden, weight, logits_dtype)
    s = student.detach().requires_grad_()
    want = reverse_kl_to_fixed(s, teacher, chunk_size=3)
    (want_grad,) = torch.autograd.grad(want.sum(), s)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-6)
