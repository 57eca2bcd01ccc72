"""`lossfx.linear_filtered_token_logprobs`: the hidden-state twin of `filtered_token_logprobs`.

1 float64 against the dense reference (values and gradients of hidden, weight, bias; both tie
rules; candidate and bisection strategies; the head options; chunked and unchunked); 2 fp32 and
bf16 against the logits path on the same logits (kept sets row for row, tie-heavy rows); 3 NaN
rows and ignored targets; 4 tensor parallelism (rank threads with sequence parallelism, real gloo
with uneven shards); 5 compile (fullgraph, pinned recompiles); 6 gradcheck; 7 the proof's claims
(proofs/linear_filtering.md) checked numerically.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing
from harness import gloo_pool, run_ranks, shard_rows

import lossfx
from lossfx import reference
from lossfx._core.tiles import LogitHead
from lossfx._kernels import linear_filtering as kernel

F64 = torch.float64
TIGHT = {"rtol": 0.0, "atol": 1e-10}
# fp32 against the logits path on the same fp32 logits: the kept sets are equal (same values, same
# threshold code); the log-sum and the gradient matmuls are summed in another order (chunked
# matmuls, per-chunk sums), so values differ by a few fp32 ulps of O(10) quantities.
FP32 = {"rtol": 1e-5, "atol": 2e-5}

FILTERS = [
    {"top_k": 5},
    {"top_p": 0.7},
    {"top_k": 9, "top_p": 0.8},
    {"top_k": 9, "top_p": 0.35},
]


def make_case(n, hidden_size, vocab, *, seed=0, dtype=F64, ties=False, scale=1.0):
    """hidden `[n, H]`, weight `[V, H]`, bias `[V]`, target `[n]`, dout `[n]`.

    `ties`: small integers times quarter-integers, so every logit is an exact dyadic value (in any
    summation order and in bf16) and rows hold many exact ties."""
    gen = torch.Generator().manual_seed(seed)
    if ties:
        hidden = torch.randint(-2, 3, (n, hidden_size), generator=gen).to(F64)
        weight = torch.randint(-4, 5, (vocab, hidden_size), generator=gen).to(F64) / 4
        bias = torch.randint(-2, 3, (vocab,), generator=gen).to(F64) / 2
    else:
        hidden = torch.randn(n, hidden_size, generator=gen, dtype=F64) * scale
        weight = torch.randn(vocab, hidden_size, generator=gen, dtype=F64) * 3 / math.sqrt(hidden_size)
        bias = torch.randn(vocab, generator=gen, dtype=F64) * 0.5
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[::2] = (hidden @ weight.T + bias).argmax(-1)[::2]  # half the targets survive any filter
    dout = torch.randn(n, generator=gen, dtype=F64)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), target, dout


def _grads(out, inputs, dout):
    """Gradients of `Σ dout·out` over the finite outputs (a filtered-out target's `-inf` is constant)."""
    live = torch.isfinite(out.detach())
    loss = torch.where(live, out, torch.zeros_like(out)).mul(dout.to(out.dtype)).sum()
    return torch.autograd.grad(loss, [x for x in inputs if x is not None])


def fused(hidden, weight, bias, target, dout, **opts):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    out = lossfx.linear_filtered_token_logprobs(h, w, target, bias=b, **opts)
    return out.detach(), *_grads(out, (h, w, b), dout)


def dense_reference(hidden, weight, bias, target, dout, *, top_k=None, top_p=None, ties="together", **head):
    h, w = hidden.to(F64).requires_grad_(), weight.to(F64).requires_grad_()
    b = None if bias is None else bias.to(F64).requires_grad_()
    temperature = head.pop("temperature", 1.0)
    head.pop("chunk_size", None)
    out = reference.linear_filtered_token_logprobs(h, w, target, top_k, top_p, ties, temperature, bias=b, **head)
    return out.detach(), *_grads(out, (h, w, b), dout)


def logits_path(hidden, weight, bias, target, dout, *, top_k=None, top_p=None, ties="together"):
    """The unfused twin: `filtered_token_logprobs(hidden @ weight.T + bias)` with autograd through the matmul."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    z = h @ w.T if b is None else h @ w.T + b
    out = lossfx.filtered_token_logprobs(z, target, top_k=top_k, top_p=1.0 if top_p is None else top_p, ties=ties)
    return out.detach(), *_grads(out, (h, w, b), dout)


def assert_same(actual, expected, tol, what=""):
    out, exp = actual[0].to(F64), expected[0].to(F64)
    assert torch.equal(torch.isneginf(out), torch.isneginf(exp)), f"{what}: the kept targets differ"
    assert torch.equal(torch.isnan(out), torch.isnan(exp)), f"{what}: the NaN rows differ"
    for name, a, e in zip(("out", "dhidden", "dweight", "dbias"), actual, expected, strict=True):
        message = lambda m, n=name: f"{what} {n}: {m}"  # noqa: E731
        torch.testing.assert_close(a.to(F64), e.to(F64), equal_nan=True, msg=message, **tol)


# ---------------------------------------------------------------------------------------------
# 1. float64 against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("filt", FILTERS)
@pytest.mark.parametrize("ties", ["together", "sorted"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_float64_matches_reference(filt, ties, chunk):
    case = make_case(23, 8, 40, seed=1)
    got = fused(*case, ties=ties, chunk_size=chunk, **filt)
    want = dense_reference(*case, ties=ties, **filt)
    assert_same(got, want, TIGHT, f"{filt} {ties}")
    assert torch.isneginf(got[0]).any() and torch.isfinite(got[0]).any(), "the case must filter some targets out"


@pytest.mark.parametrize("ties", ["together", "sorted"])
def test_head_options_and_tie_heavy_rows_float64(ties):
    """Soft-cap, scale, temperature, and exact ties at the k-th value and at the top-p boundary."""
    case = make_case(30, 6, 50, seed=2, ties=True)
    head = {"temperature": 0.8, "logit_scale": 1.5, "softcap": 4.0, "chunk_size": 7}
    for filt in FILTERS:
        got = fused(*case, ties=ties, **head, **filt)
        want = dense_reference(*case, ties=ties, **dict(head), **filt)
        assert_same(got, want, TIGHT, f"{filt} {ties}")


def test_bisection_strategy_large_top_k():
    """top_k > CANDIDATE_TOP_K_MAX takes the logits path's bisection inside each chunk."""
    k = lossfx.filtering.CANDIDATE_TOP_K_MAX + 100
    case = make_case(6, 4, k + 300, seed=3)
    for filt in ({"top_k": k}, {"top_k": k, "top_p": 0.5}):
        assert_same(fused(*case, chunk_size=4, **filt), dense_reference(*case, **filt), TIGHT, str(filt))


def test_no_filter_is_token_logprobs():
    hidden, weight, bias, target, _ = make_case(9, 5, 30, seed=4)
    out = lossfx.linear_filtered_token_logprobs(hidden, weight, target, bias=bias)
    torch.testing.assert_close(out, lossfx.linear_token_logprobs(hidden, weight, target, bias=bias), **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. fp32 / bf16 against the logits path on the same logits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ties", ["together", "sorted"])
def test_fp32_is_the_logits_path_twin(ties):
    case = make_case(40, 16, 300, seed=5, dtype=torch.float32)
    for filt in FILTERS:
        got = fused(*case, ties=ties, chunk_size=16, **filt)
        assert_same(got, logits_path(*case, ties=ties, **filt), FP32, f"{filt} {ties}")


@pytest.mark.parametrize("ties", ["together", "sorted"])
def test_bf16_tie_heavy_rows_agree_row_for_row(ties):
    """bf16 inputs whose logits are exact dyadic values: every row holds exact ties; the kept set of
    each row is the logits path's (on the bf16 logits `h @ W.T`) and the reference's."""
    hidden, weight, _, target, dout = make_case(48, 4, 256, seed=6, dtype=torch.bfloat16, ties=True)
    top = (hidden.to(F64) @ weight.to(F64).T).topk(6, dim=-1).values
    assert (top[:, 0] == top[:, 1]).float().mean() > 0.3, "many rows must hold ties at the top"
    assert (top[:, 4] == top[:, 5]).float().mean() > 0.5, "most rows must hold ties at the 5th value"
    for filt in FILTERS:
        got = fused(hidden, weight, None, target, dout, ties=ties, chunk_size=16, **filt)
        twin = logits_path(hidden, weight, None, target, dout, ties=ties, **filt)
        ref = dense_reference(hidden, weight, None, target, dout, ties=ties, **filt)
        assert torch.equal(torch.isneginf(got[0]), torch.isneginf(twin[0])), filt
        assert torch.equal(torch.isneginf(got[0]), torch.isneginf(ref[0])), filt
        torch.testing.assert_close(got[0], twin[0].float(), rtol=0, atol=1e-5)
        # gradients: bf16 matmuls of bf16-rounded dlogits (as the unfused bf16 path), each
        # product rounded to bf16 (2^-8 relative) and summed over O(10) terms: a few 1e-3 of O(1)
        for a, e in zip(got[1:], ref[1:], strict=True):
            torch.testing.assert_close(a.to(F64), e, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# 3. NaN rows, ignored targets, inputs untouched
# ---------------------------------------------------------------------------------------------


def test_nan_row_stays_nan_and_other_rows_unchanged():
    hidden, weight, bias, target, dout = make_case(10, 6, 40, seed=7)
    hidden[3, 2] = float("nan")
    for ties in ("together", "sorted"):
        filt = {"top_k": 6, "top_p": 0.8}
        got = fused(hidden, weight, bias, target, dout, ties=ties, chunk_size=3, **filt)
        want = dense_reference(hidden, weight, bias, target, dout, ties=ties, **filt)
        assert torch.isnan(got[0][3]) and torch.isnan(got[0]).sum() == 1
        twin = logits_path(hidden, weight, bias, target, dout, ties=ties, **filt)  # NaN where the dense path has it
        assert_same(got, twin, TIGHT, ties)
        keep = torch.arange(10) != 3
        torch.testing.assert_close(got[0][keep], want[0][keep], **TIGHT)
        # the gradient: NaN where the reference's is (the NaN row's whole dz, so dhidden's row 3,
        # and every dweight and dbias entry), never 0 (docs/filtering.md)
        for name, g, w in zip(("dhidden", "dweight", "dbias"), got[1:], want[1:], strict=True):
            assert torch.equal(g.isnan(), w.isnan()), f"{ties}: {name}"
        assert got[1][3].isnan().all() and got[1][keep].isfinite().all() and got[2].isnan().all()


def test_ignore_index_rows_are_zero_with_zero_gradient():
    hidden, weight, bias, target, dout = make_case(12, 5, 30, seed=8)
    target[[0, 5, 11]] = -1
    got = fused(hidden, weight, bias, target, dout, top_k=4, top_p=0.9, chunk_size=4, ignore_index=-1)
    want = dense_reference(hidden, weight, bias, target, dout, top_k=4, top_p=0.9, ignore_index=-1)
    assert_same(got, want, TIGHT)
    assert (got[0][[0, 5, 11]] == 0).all() and (got[1][[0, 5, 11]] == 0).all()


def test_inputs_not_mutated_and_leading_shapes():
    hidden, weight, bias, target, _ = make_case(12, 5, 30, seed=9)
    copies = [x.clone() for x in (hidden, weight, bias, target)]
    out = lossfx.linear_filtered_token_logprobs(
        hidden.view(3, 4, 5), weight, target.view(3, 4), bias=bias, top_k=3, ties="sorted"
    )
    assert out.shape == (3, 4)
    flat = lossfx.linear_filtered_token_logprobs(hidden, weight, target, bias=bias, top_k=3, ties="sorted")
    torch.testing.assert_close(out.reshape(-1), flat, **TIGHT)
    for before, after in zip(copies, (hidden, weight, bias, target), strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize(
    ("opts", "error", "words"),
    [
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_k": 1.5}, ValueError, "top_k"),
        ({"ties": "first"}, ValueError, "ties"),
        ({"temperature": 0.0}, ValueError, "temperature"),
    ],
)
def test_bad_arguments_raise_naming_them(opts, error, words):
    hidden, weight, _, target, _ = make_case(4, 3, 10, seed=10)
    with pytest.raises(error, match=words):
        lossfx.linear_filtered_token_logprobs(hidden, weight, target, **opts)


def test_bad_token_ids_raise():
    hidden, weight, _, target, _ = make_case(4, 3, 10, seed=10)
    with pytest.raises(ValueError, match="token_ids"):
        lossfx.linear_filtered_token_logprobs(hidden, weight, target + 10, top_k=2)
    with pytest.raises(TypeError, match="token_ids"):
        lossfx.linear_filtered_token_logprobs(hidden, weight, target.float(), top_k=2)


# ---------------------------------------------------------------------------------------------
# 4. Tensor parallelism
# ---------------------------------------------------------------------------------------------


def _rank_fused(rank, world, group, hidden, weight, bias, target, dout, bounds, sp, filt):
    start, stop = bounds[rank], bounds[rank + 1]
    w = weight[start:stop].clone().requires_grad_()
    b = bias[start:stop].clone().requires_grad_()
    h = (shard_rows(hidden, rank, world) if sp else hidden).clone().requires_grad_()
    out = lossfx.linear_filtered_token_logprobs(
        h,
        w,
        target,
        bias=b,
        group=group,
        vocab_start=start,
        vocab_size=bounds[-1],
        sequence_parallel=sp,
        chunk_size=4,
        **filt,
    )
    dh, dw, db = _grads(out, (h, w, b), dout)
    return out.detach(), dh, dw, db


def _check_ranks(results, want, sp, what):
    for rank, res in enumerate(results):
        assert torch.equal(res[0], results[0][0]), f"{what}: rank {rank}'s log-probs differ from rank 0's"
    dh = torch.cat([r[1] for r in results]) if sp else results[0][1]
    got = (results[0][0], dh, torch.cat([r[2] for r in results]), torch.cat([r[3] for r in results]))
    assert_same(got, want, TIGHT, what)


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True])
def test_two_rank_threads_even_shards(sp):
    case = make_case(16, 6, 40, seed=11, ties=True)
    for filt in ({"top_k": 7, "ties": "sorted"}, {"top_p": 0.6, "ties": "sorted"}, {"top_k": 9, "top_p": 0.5}):
        results = run_ranks(2, _rank_fused, *case, [0, 20, 40], sp, filt)
        _check_ranks(results, dense_reference(*case, **filt), sp, str(filt))


@pytest.mark.distributed
def test_two_gloo_ranks_uneven_shards_both_tie_rules():
    """Real gloo processes, shards of 17 and 26 head rows, tie-heavy rows: every rank returns the
    reference's values, and the gradients assemble to the reference's."""
    case = make_case(14, 6, 43, seed=12, ties=True)
    for filt in (
        {"top_k": 6, "top_p": 0.7, "ties": "together"},
        {"top_k": 6, "top_p": 0.7, "ties": "sorted"},
        {"top_p": 0.55, "ties": "sorted"},
    ):
        results = gloo_pool(2).run(_rank_fused, *case, [0, 17, 43], False, filt)
        _check_ranks(results, dense_reference(*case, **filt), False, str(filt))


@pytest.mark.distributed
def test_two_gloo_ranks_nan_row_has_a_nan_gradient():
    """A NaN hidden row on 2 real gloo processes (uneven shards): NaN log-prob on every rank, and
    the reference's gradient, NaN in that row's `dhidden` and in every `dweight` and `dbias`
    entry of both shards (docs/filtering.md); the other rows' values exact."""
    hidden, weight, bias, target, dout = make_case(14, 6, 43, seed=13)
    hidden[5, 1] = float("nan")
    for filt in ({"top_k": 6, "top_p": 0.7}, {"top_p": 0.55, "ties": "sorted"}):
        results = gloo_pool(2).run(_rank_fused, hidden, weight, bias, target, dout, [0, 17, 43], False, filt)
        for res in results:  # every rank's log-probs, bit for bit (NaN included)
            torch.testing.assert_close(res[0], results[0][0], equal_nan=True, rtol=0, atol=0)
        got = (results[0][0], results[0][1], *(torch.cat([r[i] for r in results]) for i in (2, 3)))
        assert_same(got, dense_reference(hidden, weight, bias, target, dout, **filt), TIGHT, str(filt))
        assert results[0][1][5].isnan().all() and results[1][2].isnan().all() and results[1][3].isnan().all()


@pytest.mark.compile
def test_compiled_nan_row_has_a_nan_gradient():
    """Compiled (fullgraph): a NaN hidden row's gradient is the reference's NaN pattern."""
    hidden, weight, bias, target, dout = make_case(12, 6, 40, seed=14)
    hidden[2, 0] = float("nan")
    fn = torch.compile(
        lambda h, w, b, t: lossfx.linear_filtered_token_logprobs(h, w, t, bias=b, top_k=5, top_p=0.8, chunk_size=4),
        fullgraph=True,
    )
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    out = fn(h, w, b, target)
    got = (out.detach(), *_grads(out, (h, w, b), dout))
    assert_same(got, dense_reference(hidden, weight, bias, target, dout, top_k=5, top_p=0.8), TIGHT, "compiled")
    assert got[1][2].isnan().all() and got[2].isnan().all()


# ---------------------------------------------------------------------------------------------
# 5. Compile
# ---------------------------------------------------------------------------------------------


def _step(h, w, b, target):
    out = lossfx.linear_filtered_token_logprobs(
        h, w, target, bias=b, top_k=6, top_p=0.8, ties="sorted", temperature=0.9, chunk_size=5
    )
    return -torch.where(torch.isfinite(out), out, torch.zeros_like(out)).mean()


@pytest.mark.compile
def test_compiled_fullgraph_matches_reference_and_recompiles_once():
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_step, backend=counter, fullgraph=True)
    counts = []
    for rows in (20, 27, 33):
        hidden, weight, bias, target, _ = make_case(rows, 6, 40, seed=rows, ties=True)
        h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        loss = compiled(h, w, b, target)
        loss.backward()
        rh, rw, rb = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        ref = reference.linear_filtered_token_logprobs(rh, rw, target, 6, 0.8, "sorted", 0.9, bias=rb)
        ref = -torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref)).mean()
        ref.backward()
        for a, e in ((loss, ref), (h.grad, rh.grad), (w.grad, rw.grad), (b.grad, rb.grad)):
            torch.testing.assert_close(a, e, **TIGHT)
        counts.append(counter.frame_count)
    assert counts == [1, 2, 2], counts  # one compile, one automatic-dynamic recompile, then none


# ---------------------------------------------------------------------------------------------
# 6. gradcheck
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ties", ["together", "sorted"])
def test_gradcheck_hidden_weight_bias(ties):
    hidden, weight, bias, target, _ = make_case(5, 3, 12, seed=13)
    inputs = [x.clone().requires_grad_() for x in (hidden, weight, bias)]

    def fn(h, w, b):
        out = lossfx.linear_filtered_token_logprobs(h, w, target, bias=b, top_k=6, top_p=0.9, ties=ties, chunk_size=2)
        return torch.where(torch.isfinite(out), out, torch.zeros_like(out))

    assert torch.isfinite(lossfx.linear_filtered_token_logprobs(hidden, weight, target, bias=bias, top_k=6)).any()
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# 7. The proof's claims, numerically (proofs/linear_filtering.md)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ties", ["together", "sorted"])
def test_saved_thresholds_are_the_logits_paths(ties):
    """Claim 1: each chunk's `τ` (and id cut) is the logits path's threshold of the same rows, and the
    backward's recomputed chunk is bit-identical to the forward's (so the keep mask is the same)."""
    hidden, weight, bias, target, _ = make_case(26, 8, 300, seed=14, dtype=torch.float32)
    active = torch.arange(26)
    rows, cut = kernel.linear_filtered_rows(
        hidden, weight, bias, target, active, 1.0, 1.0, None, 7, 0.6, ties, 0, 300, 5, 300, ""
    )
    z = hidden @ weight.T + bias
    found = lossfx.top_k_top_p_threshold(z, top_k=7, top_p=0.6, ties=ties)
    tau = found if ties == "together" else found[0]
    assert torch.equal(rows[3], tau)
    if ties == "sorted":
        # this rank's own cut keeps the same entries as the global cut (one rank: the same ids kept)
        ids = torch.arange(300)
        keep_own = (z > tau[:, None]) | ((z == tau[:, None]) & (ids >= cut[:, None]))
        keep = lossfx.apply_top_k_top_p(z, top_k=7, top_p=0.6, ties=ties)[1]
        assert torch.equal(keep_own, keep)
    # the recomputation: the same chunk walk, the same logits, bit for bit
    tiles = kernel._tiles(hidden, weight, bias, LogitHead(), active, 5, 300, 0)
    first = [z_c.clone() for _, _, z_c in tiles.chunks_full()]
    again = [z_c.clone() for _, _, z_c in tiles.chunks_full()]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_two_passes_over_the_vocabulary():
    """Claim 2: one matmul per chunk in the forward, one in the backward, whatever the filter."""
    hidden, weight, bias, target, dout = make_case(20, 4, 60, seed=15)
    calls = []
    real = kernel.Tiles.chunk_logits

    def counted(self, rows, h=None):
        calls.append(1)
        return real(self, rows, h)

    kernel.Tiles.chunk_logits = counted  # type: ignore[method-assign]
    try:
        for filt in ({"top_k": 5}, {"top_p": 0.5}, {"top_k": 30, "top_p": 0.99, "ties": "sorted"}):
            calls.clear()
            fused(hidden, weight, bias, target, dout, chunk_size=5, **filt)
            assert len(calls) == 2 * 4, (filt, len(calls))  # 4 chunks, forward + backward
    finally:
        kernel.Tiles.chunk_logits = real  # type: ignore[method-assign]


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 0.9), (None, 0.9), (None, 0.5), (8, 0.6)])
def test_streamed_candidates_are_exact_where_the_proof_says(top_k, top_p):
    """Claim 3 (§3, the alternative design, measured by benchmarks/bench_linear_filtering.py
    --coverage): where the running top-C candidates cover the rule (`exact`), the threshold from
    them alone is the logits path's; the rows it flags as needing an extra pass do occur."""
    from benchmarks.bench_linear_filtering import candidate_coverage, peaked_bf16_logits

    logits = peaked_bf16_logits(64, 3000, seed=1)
    found = candidate_coverage(logits, top_k, top_p, 64)
    tau = lossfx.top_k_top_p_threshold(logits.float(), top_k=top_k, top_p=top_p).double()
    exact = found["exact"]
    assert exact.any()
    assert torch.equal(found["tau"][exact], tau[exact])
    if top_k is None and top_p > 0.8:
        assert not exact.all(), "the generator must produce rows whose candidates do not cover top_p"
