"""`-inf` logits in the fused LM-head path: a bias that is `-inf` over some columns, a whole
vocabulary block, a rank's whole shard, or every column (padded head rows masked out).

The float64 reference is finite there (an all `-inf` row: log-prob `-inf`, `Σ p log p = 0`, zero
gradient), so every fused function must be too: values and gradients (hidden, weight, bias)
against `lossfx.reference`, for token, gather (both conventions), next-token and the objective,
with and without the entropy, eager and compiled, in one process (vocabulary blocks forced by a
tight `ChunkPolicy`) and on 2 real gloo processes (rank 1's whole shard `-inf`).
proofs/fused_linear.md §10.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from harness import compiled_for_rank, gloo_pool, shard_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import lossfx
from lossfx import reference
from lossfx._core.chunking import CPU_POLICY, chunk_policy

F64 = torch.float64
KINDS = ("token", "gather", "gather_renorm", "next_token", "objective")
MASKS = ("none", "some", "block", "shard", "all")
_keys = itertools.count()


def make_bias(vocab: int, mask: str, gen: torch.Generator, block: int = 4) -> torch.Tensor:
    """`bias [V]` (float64) with `-inf` at: nothing, a few columns, the columns `[block, 2·block)`
    (one whole vocabulary block), the second half (rank 1's shard of 2), or every column."""
    bias = torch.randn(vocab, generator=gen, dtype=F64)
    if mask == "some":
        bias[torch.randperm(vocab, generator=gen)[: max(1, vocab // 3)]] = float("-inf")
    elif mask == "block":
        bias[block : 2 * block] = float("-inf")
    elif mask == "shard":
        bias[vocab // 2 :] = float("-inf")
    elif mask == "all":
        bias[:] = float("-inf")
    return bias


def call(kind, entropy, h, w, b, ids, coef, **kw):
    """The fused function of `kind` -> its outputs (the objective's scalar first)."""
    if kind == "token":
        out = lossfx.linear_token_logprobs(h, w, ids, bias=b, return_neg_entropy=entropy, **kw)
        return list(out) if entropy else [out]
    if kind in ("gather", "gather_renorm"):
        zero = kind == "gather"
        lp, ne = lossfx.linear_gather_logprobs(
            h, w, ids, bias=b, zero_outside_topk=zero, with_neg_entropy=entropy, **kw
        )
        return [lp, ne] if entropy else [lp]
    if kind == "next_token":
        out = lossfx.linear_next_token_logprobs(h, w, ids, bias=b, return_neg_entropy=entropy, **kw)
        return list(out) if entropy else [out]
    a, e = coef
    obj, lp, ne = lossfx.linear_logprob_objective(h, w, ids, a, neg_entropy_weight=e if entropy else None, bias=b, **kw)
    return [obj, lp, ne] if entropy else [obj, lp]


def call_reference(kind, entropy, h, w, b, ids, coef, **kw):
    """The float64 reference of `call`."""
    if kind == "token":
        lp, ne = reference.linear_token_logprobs(h, w, ids, bias=b, **kw)
    elif kind in ("gather", "gather_renorm"):
        lp, ne = reference.linear_gather_logprobs(h, w, ids, kind == "gather", bias=b, **kw)
    elif kind == "next_token":
        lp, ne = reference.linear_next_token_logprobs(h, w, ids, bias=b, **kw)
    else:
        a, e = coef
        obj, lp, ne = reference.linear_logprob_objective(h, w, ids, a, e if entropy else None, bias=b, **kw)
        return [obj, lp, ne] if entropy else [obj, lp]
    return [lp, ne] if entropy else [lp]


def backward(kind, outs, grads, leaves):
    """Gradients of `Σ g·out` (the objective alone for `objective`: its log-probs carry none)."""
    if kind == "objective":
        outs, grads = outs[:1], grads[:1]
    return list(torch.autograd.grad(outs, leaves, grads, allow_unused=True))


def assert_same(got, want, what, atol=1e-10):
    """Same `±inf` pattern, no NaN where the reference has none, finite values within `atol`."""
    got, want = got.detach().to(F64), want.detach().to(F64)
    assert not want.isnan().any(), f"{what}: the reference itself is NaN (a bad case)"
    assert not got.isnan().any(), f"{what}: NaN where the reference is {want[got.isnan()].tolist()}"
    assert torch.equal(got.isposinf(), want.isposinf()) and torch.equal(got.isneginf(), want.isneginf()), what
    fin = want.isfinite()
    torch.testing.assert_close(got[fin], want[fin], rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def make_case(kind, mask, *, seed, batch=2, seq=5, hidden_size=6, vocab=16, block=4, k=3, neg_inf_targets=True):
    """`(hidden [B, S, H], weight [V, H], bias [V], ids, (a, b), upstream grads)`, float64.

    Targets may point at `-inf` columns (log-prob `-inf`, finite gradient) unless the objective,
    whose `a > 0` keeps `Σ a·log p` at `-inf` (not NaN) when they do."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen, dtype=F64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=F64)
    bias = make_bias(vocab, mask, gen, block)
    finite = bias.isfinite().nonzero()[:, 0]
    pool = torch.arange(vocab) if neg_inf_targets or finite.numel() == 0 else finite
    shape = (batch, seq, k) if kind.startswith("gather") else (batch, seq)
    ids = pool[torch.randint(0, pool.numel(), shape, generator=gen)]
    ids.view(-1)[1] = -100  # an ignored id
    return hidden, weight, bias, ids, *coefficients_and_grads(kind, shape, gen)


def coefficients_and_grads(kind, shape, gen):
    """`((a, e), upstream grads)` in float64 for ids of `shape` `[B, S]` or `[B, S, K]`: the
    objective's log-prob and entropy coefficients, and the gradients reaching each output."""
    batch, seq = shape[:2]
    a = torch.rand(batch, seq, generator=gen, dtype=F64) + 0.1
    e = torch.randn(batch, seq, generator=gen, dtype=F64)
    rows = (batch, seq - 1) if kind == "next_token" else (batch, seq)
    grads = [torch.randn(*rows, *shape[2:], generator=gen, dtype=F64), torch.randn(rows, generator=gen, dtype=F64)]
    if kind == "objective":
        grads = [torch.tensor(1.7, dtype=F64), None, None]
    return (a, e), grads


def check_single_process(kind, mask, entropy, *, seed=0, policy=None, chunk=3, head=None, **shape):
    """One process: the fused `kind` against the reference, values and gradients."""
    head = head or {}
    hidden, weight, bias, ids, coef, grads = make_case(kind, mask, seed=seed, **shape)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    want = call_reference(kind, entropy, *leaves, ids, coef, **head)
    want += backward(kind, want, grads, leaves)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    with chunk_policy(policy or CPU_POLICY):  # read by the forward's and the backward's loops
        got = call(kind, entropy, *leaves, ids, coef, chunk_size=chunk, **head)
        got += backward(kind, got, grads, leaves)
    names = [*("out0", "out1", "out2")[: len(got) - 3], "dhidden", "dweight", "dbias"]
    for name, g, w in zip(names, got, want, strict=True):
        assert_same(g, w, f"{kind}/{mask}/entropy={entropy}: {name}")


# ---------------------------------------------------------------------------------------------
# One process: every fused function, every mask, vocabulary blocks forced
# ---------------------------------------------------------------------------------------------

BLOCKS = dataclasses.replace(CPU_POLICY, max_block=4)  # V = 16: four blocks of 4 columns


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_fused_function_in_vocabulary_blocks(kind, mask, entropy):
    check_single_process(kind, mask, entropy, policy=BLOCKS, neg_inf_targets=kind != "objective")


@pytest.mark.parametrize("kind", ["token", "objective"])
def test_low_precision_block_stays_finite(kind):
    """float32: the same masks give no NaN (values against the reference at fp32 accuracy)."""
    for mask in ("block", "all"):
        hidden, weight, bias, ids, coef, _ = make_case(kind, mask, seed=3, neg_inf_targets=False)
        leaves = [x.float().requires_grad_() for x in (hidden, weight, bias)]
        with chunk_policy(BLOCKS):
            got = call(kind, True, *leaves, ids, (coef[0].float(), coef[1].float()), chunk_size=3)
            got[0].sum().backward()
        want = call_reference(kind, True, hidden, weight, bias, ids, coef)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w, f"{kind}/{mask} fp32", atol=1e-4)
        for leaf in leaves:
            assert not leaf.grad.isnan().any(), f"{kind}/{mask} fp32: NaN gradient"


@settings(max_examples=examples(40), deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    mask=st.sampled_from(MASKS),
    entropy=st.booleans(),
    vocab=st.integers(2, 20),
    block=st.integers(1, 8),
    chunk=st.sampled_from([1, 2, 7]),
    head=st.sampled_from([{}, {"temperature": 0.6}, {"logit_scale": 1.5, "temperature": 2.0}, {"softcap": 4.0}]),
    seed=st.integers(0, 2**16),
)
def test_property_neg_inf_columns_match_reference(kind, mask, entropy, vocab, block, chunk, head, seed):
    """Any vocabulary, block width, row chunk, logit head and `-inf` pattern: the reference's
    values and gradients, never NaN."""
    policy = dataclasses.replace(CPU_POLICY, max_block=block)
    check_single_process(
        kind,
        mask,
        entropy,
        seed=seed,
        policy=policy,
        chunk=chunk,
        head=head,
        vocab=vocab,
        block=block,
        neg_inf_targets=kind != "objective",
    )


@pytest.mark.compile
def test_compiled_tile_bodies_with_neg_inf_blocks():
    """`compile_tiles` (the GPU policy's Inductor-compiled per-tile bodies, forced on CPU): a
    whole `-inf` block and an all `-inf` row give the reference's values and gradients."""
    policy = dataclasses.replace(CPU_POLICY, max_block=4, compile_tiles=True)
    for mask in ("some", "block", "all"):
        check_single_process("token", mask, True, policy=policy, chunk=4, batch=2, seq=4)
        check_single_process("gather", mask, False, policy=policy, chunk=4, batch=2, seq=4, neg_inf_targets=False)


# ---------------------------------------------------------------------------------------------
# 2 real gloo processes: rank 1's whole shard -inf, an all -inf row; eager and compiled
# ---------------------------------------------------------------------------------------------

GLOO_CASES = [
    (kind, mask, entropy, sp)
    for kind in KINDS
    for mask in ("shard", "all", "block")
    for entropy in (False, True)
    for sp in ((False, True) if kind in ("token", "objective") else (False,))
]
COMPILED_CASES = [(k, m, True, False) for k in ("token", "gather", "objective") for m in ("shard", "all")]


def _gloo_case(kind, mask, seed):
    return make_case(kind, mask, seed=seed, neg_inf_targets=kind != "objective")


def gloo_neg_inf_rank(rank, world, group, cases, seed, compiled):
    """Every case on this rank's half of the head (and of the rows with sequence parallelism):
    its outputs and the gradients of its own hidden rows, head rows and bias entries."""
    results = []
    for i, (kind, mask, entropy, sp) in enumerate(cases):
        hidden, weight, bias, ids, coef, grads = make_case(
            kind, mask, seed=seed + i, neg_inf_targets=kind != "objective"
        )
        vl = weight.shape[0] // world
        cols = slice(rank * vl, (rank + 1) * vl)
        h = (shard_rows(hidden, rank, world).clone() if sp else hidden.clone()).requires_grad_()
        w, b = weight[cols].clone().requires_grad_(), bias[cols].clone().requires_grad_()

        def fn(h, w, b, ids, a, e, kind=kind, entropy=entropy, sp=sp):
            extra = {"sequence_parallel": True} if sp else {}
            return call(kind, entropy, h, w, b, ids, (a, e), group=group, chunk_size=3, **extra)

        if compiled:
            _, fn = compiled_for_rank(rank, ("neg_inf", kind, entropy, sp), fn, "aot_eager")  # one per mask
        with chunk_policy(BLOCKS):
            outs = fn(h, w, b, ids, *coef)
            n = 1 if kind == "objective" else len(outs)
            torch.autograd.backward(outs[:n], grads[:n])
        results.append([o.detach() for o in outs] + [h.grad, w.grad, b.grad])
    return results


def check_gloo(cases, compiled, seed=100):
    per_rank = gloo_pool(2).run(gloo_neg_inf_rank, cases, seed, compiled)
    for i, (kind, mask, entropy, sp) in enumerate(cases):
        what = f"{kind}/{mask}/entropy={entropy}/sp={sp}/compiled={compiled}"
        hidden, weight, bias, ids, coef, grads = make_case(
            kind, mask, seed=seed + i, neg_inf_targets=kind != "objective"
        )
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        want = call_reference(kind, entropy, *leaves, ids, coef)
        dh, dw, db = backward(kind, want, grads, leaves)
        r0, r1 = per_rank[0][i], per_rank[1][i]
        n_out = len(want)
        for j in range(n_out):
            assert_same(r0[j], want[j], f"{what}: output {j}, rank 0")
            assert_same(r1[j], want[j], f"{what}: output {j}, rank 1")
        got_dh = (
            torch.cat([r0[n_out].reshape(-1, dh.shape[-1]), r1[n_out].reshape(-1, dh.shape[-1])]) if sp else r0[n_out]
        )
        assert_same(got_dh.reshape(dh.shape), dh, f"{what}: dhidden")
        if not sp:
            assert_same(r1[n_out], dh, f"{what}: dhidden, rank 1")
        assert_same(torch.cat([r0[n_out + 1], r1[n_out + 1]]), dw, f"{what}: dweight")
        assert_same(torch.cat([r0[n_out + 2], r1[n_out + 2]]), db, f"{what}: dbias")


@pytest.mark.distributed
def test_gloo_two_ranks_eager():
    check_gloo(GLOO_CASES, compiled=False)


@pytest.mark.distributed
@pytest.mark.compile
def test_gloo_two_ranks_compiled():
    check_gloo(COMPILED_CASES, compiled=True)
