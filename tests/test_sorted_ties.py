"""The id cut of top-p's `ties="sorted"` rule, found without a host read and without a search
over the ids (proofs/filtering.md §1, Lemma 1s, "Finding t*").

Every rank counts its entries tied at `τ`; one all-gather of the counts (and each rank's first id)
tells each rank how many of its ties the rule keeps; one local pass finds its cut; the threshold
function's global cut is one all-reduce (min). Checked here against the sort-based float64
reference (`lossfx.reference`): the kept set, the returned `id_cut` (the n-th largest tied id,
which the old id bisection returned too: the least kept id at `τ`, 0 for a row without ties or
holding a NaN), the filtered log-probs and their gradients, on 1, 2 and 4 rank threads, with
equal, uneven and out-of-rank-order vocabulary shards, both strategies, float64 and bf16 logits
with heavy ties (integer values, all-equal rows, `−∞` columns, tie groups straddling every
shard), eager and compiled. The host-read count is in `tests/test_host_reads.py`.
"""

from __future__ import annotations

import pytest
import torch
from harness import compiled_for_rank, run_ranks

import lossfx
from lossfx import reference
from lossfx._core.numerics import compute_dtype

F64 = torch.float64
# (top_k, top_p, strategy): top-p alone (bisection), top-k then top-p by both strategies
PARAMS = [
    (None, 0.4567, "bisection"),
    (None, 0.5, "bisection"),
    (6, 0.5123, "candidates"),
    (6, 0.5123, "bisection"),
    (20, 0.8, "candidates"),
    (3, 0.3141, "candidates"),
]


def spans(world: int, vocab: int, layout: str) -> list[tuple[int, int]]:
    """`(start, width)` per rank: `even` (rank order, equal widths: `vocab % world == 0`),
    `uneven` (rank order, the first ranks one wider), `reversed` (uneven, rank r holds the
    (R−1−r)-th block: explicit `vocab_start`s not in rank order)."""
    widths = [vocab // world + (1 if r < vocab % world else 0) for r in range(world)]
    assert layout != "even" or len(set(widths)) == 1
    starts = [sum(widths[:r]) for r in range(world)]
    blocks = list(zip(starts, widths, strict=True))
    return blocks[::-1] if layout == "reversed" else blocks


def tied_logits(vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`[3, 4, vocab]` logits, every row full of ties (integer values, exact in bf16 too): random
    integers, all-equal rows, `−∞` columns, an all-`−∞` row, a tie group at the max on every
    fifth column (straddling every shard), a wide tie group below a few larger values, and
    for bf16 rows of normal values rounded to bf16 (ties by rounding)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randint(0, 4, (12, vocab), generator=gen).to(F64)
    z[3] = 0.0  # all equal
    z[4] = -2.5  # all equal, another level
    z[5] = z[5].masked_fill(torch.rand(vocab, generator=gen) < 0.3, float("-inf"))
    z[6] = float("-inf")
    z[7] = torch.randint(-3, 0, (vocab,), generator=gen).to(F64)
    z[7, ::5] = 1.0  # the max group, on every fifth column
    z[8] = 0.0
    z[8, torch.randperm(vocab, generator=gen)[:3]] = 2.0  # a wide group at 0 below three 2s
    z[9] = torch.randint(0, 2, (vocab,), generator=gen).to(F64) * 3.0  # two groups
    if dtype == torch.bfloat16:
        z[10:] = (torch.randn(2, vocab, generator=gen, dtype=F64) * 0.5).to(torch.bfloat16).to(F64)
    return z.view(3, 4, vocab).to(dtype)


def expected_cut(z: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(τ, id_cut)` from the reference's kept set: `τ` the least kept value, `id_cut` the least
    kept id among the entries equal to `τ` (0 where no entry is kept or a NaN is held)."""
    zf = z.to(compute_dtype(z.dtype))
    tau = torch.where(keep, zf, float("inf")).amin(dim=-1)
    ids = torch.arange(z.shape[-1])
    at_tau = keep & (zf == tau[..., None])
    cut = torch.where(at_tau, ids, z.shape[-1]).amin(dim=-1)
    nan_rows = torch.isnan(zf).any(dim=-1)  # they keep nothing: τ = NaN
    return torch.where(nan_rows, float("nan"), tau), torch.where(cut == z.shape[-1], 0, cut)


def sorted_margin(z: torch.Tensor, top_k, top_p: float) -> float:
    """Least distance to `top_p` of a mass ranked above a survivor in the sort order, over the
    rows that are not uniform (those are decided exactly, proofs/filtering.md §3.3)."""
    z = z.to(F64).reshape(-1, z.shape[-1])
    _, keep_k = reference.apply_top_k_top_p(z, top_k, 1.0)
    zk = torch.where(keep_k, z, float("-inf"))
    q = reference.log_softmax(zk).exp()
    order = torch.sort(zk, dim=-1, stable=True).indices.flip(-1)
    qs = q.gather(-1, order)
    excl = torch.cumsum(qs, dim=-1) - qs
    uniform = ((zk == zk.amax(dim=-1, keepdim=True)) | (q == 0)).all(dim=-1)  # every live survivor at the max
    rows = ~uniform
    return float((excl - top_p).abs()[rows].min()) if rows.any() else float("inf")


def _rank_sorted(rank, world, group, z, target, dout, blocks, top_k, top_p, strategy, backend=None):
    start, width = blocks[rank]
    span = {"group": group, "vocab_start": start, "vocab_size": z.shape[-1]} if world > 1 else {}
    shard = z[..., start : start + width].detach().clone().requires_grad_(True)

    def threshold(x):
        return lossfx.top_k_top_p_threshold(
            x, top_k=top_k, top_p=top_p, strategy=strategy, ties="sorted", chunk_rows=5, **span
        )

    def logprobs(x, t):
        return lossfx.filtered_token_logprobs(
            x, t, top_k=top_k, top_p=top_p, strategy=strategy, ties="sorted", chunk_rows=5, **span
        )

    counters = []
    if backend is not None:
        key = (world, tuple(blocks), top_k, top_p, strategy, z.dtype)
        counter_t, threshold = compiled_for_rank(rank, ("sorted threshold", *key), threshold, backend)
        counter_l, logprobs = compiled_for_rank(rank, ("sorted logprobs", *key), logprobs, backend)
        counters = [counter_t, counter_l]
    tau, cut = threshold(shard.detach())
    out = logprobs(shard, target)
    (grad,) = torch.autograd.grad(out, shard, dout)
    _, keep = lossfx.apply_top_k_top_p(shard.detach(), top_k=top_k, top_p=top_p, ties="sorted", **span)
    frames = [c.frame_count for c in counters]
    return tau, cut, keep, out.detach(), grad, frames


def check_sorted(z, top_k, top_p, strategy, world, layout, backend=None):
    """Every rank's `(τ, id_cut)`, kept set, log-probs and gradient against the reference."""
    blocks = spans(world, z.shape[-1], layout)
    gen = torch.Generator().manual_seed(11)
    target = torch.randint(0, z.shape[-1], z.shape[:-1], generator=gen)
    cdtype = compute_dtype(z.dtype)
    dout = torch.randn(target.shape, generator=gen, dtype=F64).to(cdtype)
    _, ref_keep = reference.apply_top_k_top_p(z, top_k, top_p, "sorted")
    want_tau, want_cut = expected_cut(z, ref_keep)
    z64 = z.detach().to(F64, copy=True).requires_grad_(True)
    want = reference.filtered_token_logprobs(z64, target, top_k, top_p, "sorted")
    (want_grad,) = torch.autograd.grad(want, z64, dout.to(F64))
    tol = {"atol": 1e-10, "rtol": 1e-10} if cdtype == F64 else {"atol": 2e-6, "rtol": 2e-6}
    results = run_ranks(world, _rank_sorted, z, target, dout, blocks, top_k, top_p, strategy, backend)
    grad = torch.zeros_like(z)
    for (start, width), (tau, cut, keep, out, g, _frames) in zip(blocks, results, strict=True):
        assert torch.equal(tau.isnan(), want_tau.isnan()) and torch.equal(tau.nan_to_num(), want_tau.nan_to_num())
        assert cut.dtype == torch.int64 and torch.equal(cut, want_cut), (cut, want_cut)
        assert torch.equal(keep, ref_keep[..., start : start + width])
        torch.testing.assert_close(out.to(F64), want.detach(), equal_nan=True, **tol)
        grad[..., start : start + width] = g
    assert grad.dtype == z.dtype
    if z.dtype == torch.bfloat16:  # rounded once to bf16 (7 stored bits): within one ulp of the truth
        tol = {"atol": 1e-6, "rtol": 2**-7}
    torch.testing.assert_close(grad.to(F64), want_grad, equal_nan=True, **tol)  # a NaN row: NaN, as the reference
    return results


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("world,layout", [(1, "even"), (2, "even"), (2, "reversed"), (4, "uneven"), (4, "reversed")])
def test_sorted_ties_match_the_reference(world, layout, dtype):
    vocab = 36 if layout == "even" else 37
    z = tied_logits(vocab, dtype, seed=world + 7 * (layout == "reversed"))
    cut_rows = 0
    for top_k, top_p, strategy in PARAMS:
        assert sorted_margin(z, top_k, top_p) > 1e-9
        check_sorted(z, top_k, top_p, strategy, world, layout)
        keep_sorted = reference.apply_top_k_top_p(z, top_k, top_p, "sorted")[1]
        keep_together = reference.apply_top_k_top_p(z, top_k, top_p)[1]
        cut_rows += int((keep_sorted.sum(-1) < keep_together.sum(-1)).sum())
    assert cut_rows >= 20  # the cases cut tie groups (not only keep them whole)


def test_sorted_ties_nan_rows_and_uniform_rows():
    """A row holding a NaN keeps nothing (id_cut 0, as before); all-equal rows keep `⌈p·t⌉` of
    their `t` ties, the largest ids, wherever the cut falls among the shards."""
    z = torch.zeros(4, 12, dtype=F64)
    z[1, 5] = float("nan")
    z[2, 7:] = float("-inf")  # 7 ties at 0, the rest -inf (weight 0)
    z[3] = 1.0
    z[3, 0] = 3.0  # the max alone above a group of 11
    for world, layout in [(1, "even"), (2, "reversed"), (4, "uneven"), (4, "reversed")]:
        for top_p in (0.5, 0.25, 0.9):
            results = check_sorted(z, None, top_p, "bisection", world, layout)
            cut = results[0][1]
            assert cut[1] == 0 and cut[0] == 12 - -(-12 * top_p // 1)  # ⌈p·12⌉ largest ids kept


# (2, candidates) is slow: by default the candidates' sorted cut compiles on 2 ranks in
# test_filtering.py::test_exact_boundary_compiled_aot_eager_world_2
@pytest.mark.parametrize(
    "world,strategy,dtype",
    [
        (1, "candidates", F64),
        pytest.param(2, "candidates", F64, marks=pytest.mark.slow),
        (2, "bisection", torch.float32),
    ],
)
def test_sorted_ties_compiled(world, strategy, dtype):
    """fullgraph=True (aot_eager): one graph per function and rank, reused for new values. The
    bisection compiles fp32 logits (4 radix passes; float64 unrolls 64 steps: minutes)."""
    layout = "reversed" if world > 1 else "even"
    top_k = 6 if strategy == "candidates" else None
    for seed in (3 + world, 5 + world):  # the same shapes, new values: no recompile
        z = tied_logits(37, dtype, seed=seed)
        assert sorted_margin(z, top_k, 0.5123) > 1e-9
        results = check_sorted(z, top_k, 0.5123, strategy, world, layout, backend="aot_eager")
    for *_, frames in results:
        assert frames == [1, 1]


def _rank_empty(rank, world, group, strategy):
    span = {"group": group} if world > 1 else {}
    shapes = []
    for shape in [(0, 5), (3, 0, 5)]:
        x = torch.randn(shape, dtype=F64, requires_grad=True)
        t = torch.zeros(shape[:-1], dtype=torch.long)
        kw = {"top_k": 2, "top_p": 0.5, "ties": "sorted"}
        out = lossfx.filtered_token_logprobs(x, t, strategy=strategy, **kw, **span)
        (grad,) = torch.autograd.grad(out.sum(), x)
        tau, cut = lossfx.top_k_top_p_threshold(x, strategy=strategy, **kw, **span)
        keep = lossfx.apply_top_k_top_p(x, **kw, **span)[1]
        shapes.append((out.shape, grad.shape, tau.shape, cut.shape, keep.shape))
    return shapes


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy", ["candidates", "bisection"])
def test_sorted_ties_empty_rows(world, strategy):
    """No rows (`N = 0`): correctly shaped empty results, no collective of a mis-sized count."""
    for shapes in run_ranks(world, _rank_empty, strategy):
        for (out, grad, tau, cut, keep), shape in zip(shapes, [(0, 5), (3, 0, 5)], strict=True):
            assert out == tau == cut == shape[:-1] and grad == keep == shape


def _rank_collectives(rank, world, group, z, target, top_k, strategy):
    """`{ties: collectives in the compiled forward graph}` of `filtered_token_logprobs` on this rank."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    width = z.shape[-1] // world
    shard = z[..., rank * width : (rank + 1) * width]
    counts = {}
    for ties in ("together", "sorted"):
        found = []

        def forward(gm, example_inputs, found=found):
            names = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
            found.append(sum(("all_reduce" in n or "all_gather" in n) and "wait" not in n for n in names))
            return make_boxed_func(gm.forward)

        def fn(x, t, ties=ties):
            return lossfx.filtered_token_logprobs(
                x, t, top_k=top_k, top_p=0.5123, strategy=strategy, ties=ties, group=group
            )

        torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=forward))(shard, target)
        counts[ties] = found
    return counts


@pytest.mark.parametrize("strategy,dtype", [("candidates", F64), ("bisection", torch.float32)])
def test_sorted_ties_add_no_collective_search(strategy, dtype):
    """The compiled forward of `ties="sorted"` holds as many collectives as `ties="together"`'s
    (candidates: the tie count's all-reduce becomes an all-gather) or one more (bisection: the
    gathered `(M(τ), ties, live)` of the tie rule), where the id bisection added ⌈log2 V⌉ = 6."""
    z = tied_logits(64, dtype, seed=2)
    target = torch.randint(0, 64, z.shape[:-1], generator=torch.Generator().manual_seed(1))
    top_k = 6 if strategy == "candidates" else None
    for counts in run_ranks(2, _rank_collectives, z, target, top_k, strategy):
        (together,), (tie_sorted,) = counts["together"], counts["sorted"]
        assert together >= 3  # the cross-rank check's, the threshold's, the statistics' gathers
        assert tie_sorted == together + (0 if strategy == "candidates" else 1), counts
