"""`linear_gather_logprobs(..., zero_outside_topk=False)` with a NaN or `+inf` in hidden, weight or bias.

The renormalised log-probs are `log_softmax(z[ids])` over the `K` logits at the ids alone, as the
float64 reference (`lossfx.reference.linear_gather_logprobs`) computes them: the fused kernel
returns the raw logits at the ids (`merge_row_stats(raw=True)`), whose backward has no softmax
term (`linear_local_grads(grad_total=None)`). So a non-finite logit outside a row's ids leaves
that row finite, its gradient finite, and `weight.grad` / `bias.grad` finite wherever the
reference's are; a non-finite logit at one of its ids makes it NaN as in the reference. The NaN
and `±inf` pattern of every output and gradient is the reference's (tests/test_fused_nonfinite.py
runs the same over every fused kind in vocabulary blocks and compiled): here row by row,
unchunked, with a soft-cap and temperature, compiled, on 2 gloo ranks (eager and compiled,
chunked and not), and a float64 gradcheck of the changed backward (proofs/fused_linear.md §12).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from harness import compiled_for_rank, gloo_pool, run_ranks, sharded_gradcheck
from test_fused_neg_inf import backward, call, call_reference
from test_fused_nonfinite import BLOCKS, KINDS, VALUES, WHERE, assert_same_pattern, make_case, run

import lossfx
from lossfx import reference
from lossfx._core.chunking import CPU_POLICY, chunk_policy

F64 = torch.float64
KIND = "gather_renorm"
POLICIES = {"blocks": (BLOCKS, 3), "unchunked": (CPU_POLICY, None)}


def _outside_rows(case):
    """`[B, S]`: the rows with a NaN or `+inf` logit outside their ids and none at them."""
    hidden, weight, bias, ids = case[:4]
    z = reference.linear_logits(hidden, weight, bias=bias)  # [B, S, V]
    bad = z.isnan() | z.isposinf()  # what makes a full log_softmax NaN (a -inf logit does not)
    return bad.any(-1) & ~bad.gather(-1, ids).any(-1)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("value", VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", WHERE)
def test_rows_outside_stay_finite(where, value, entropy, policy):
    """The reference's pattern in every output and gradient; the rows whose non-finite logit lies
    outside their ids have finite log-probs (the full softmax, and so `Σ p log p`, is NaN there)."""
    case = make_case(KIND, where, value)
    sizes, chunk = POLICIES[policy]
    with chunk_policy(sizes):
        got = run(KIND, entropy, case, chunk=chunk)
    outside = _outside_rows(case)
    if where != "hidden":  # a head entry reaches every row: some row has it outside its ids
        assert outside.any()
    assert got[0][outside].isfinite().all()


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_never_an_id_leaves_everything_finite(where):
    """A NaN head column that is none of the ids: the reference's values and gradients are all
    finite without the entropy (`dz = 0` there; `dweight`'s and `dbias`'s NaN-free), and so are
    the kernel's. (Before, its full-softmax renormalisation made every output and gradient NaN.)"""
    hidden, weight, bias, ids, coef, grads = make_case(KIND, None, 0.0)
    ids = torch.where(ids == 7, 0, ids)  # column 7: no row's id
    if where == "weight":
        weight[7] = math.nan  # every hidden component of the head row: dhidden = dz W is NaN
    else:
        bias[7] = math.nan
    with chunk_policy(BLOCKS):
        got = run(KIND, False, (hidden, weight, bias, ids, coef, grads))
    finite = ["out0", "dhidden", "dweight", "dbias"]
    if where == "weight":  # the reference's dense dz W multiplies the NaN row by 0: NaN, kept
        assert got[1].isnan().all()
        finite = ["out0", "dweight", "dbias"]
    for name, g in zip(["out0", "dhidden", "dweight", "dbias"], got, strict=True):
        if name in finite:
            assert g.isfinite().all(), name


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("value", VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(
    "head", [{"softcap": 3.0, "temperature": 0.7}, {"logit_scale": 1.5, "temperature": 2.0}], ids=["softcap", "scale"]
)
def test_logit_heads(head, where, value, entropy):
    """A soft-cap's `dz/dr = 1 − tanh²` is NaN at a NaN logit even where `dz = 0`: the reference's
    NaN there is kept (the tile is recomputed); without a cap it is not needed (`dz = 0`).

    At a `+inf` input under a soft-cap the logit saturates (`tanh = ±1`): the kernel's `1 − tanh²`
    is exactly 0 there, as the reference's, so `0·inf` is NaN in both (it was `1 − (z·T/c)²`, an
    ulp off 0, which made a gradient entry `±inf` where the reference has NaN)."""
    _same_pattern_under_head(KIND, head, where, value, entropy)


def _same_pattern_under_head(kind, head, where, value, entropy):
    hidden, weight, bias, ids, coef, grads = make_case(kind, where, value, seed=4)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    want = call_reference(kind, entropy, *leaves, ids, coef, **head)
    want += backward(kind, want, grads, leaves)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    with chunk_policy(BLOCKS):
        got = call(kind, entropy, *leaves, ids, coef, chunk_size=3, **head)
        got += backward(kind, got, grads, leaves)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_pattern(g, w, f"{kind}/{head}/{where}/{value}/entropy={entropy}: {i}")


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("kind", KINDS)
def test_softcap_saturated_by_inf_every_kind(kind, where, entropy):
    """Every fused kind: a `+inf` in hidden, weight or bias under a soft-cap saturates its logits
    (`tanh = ±1`, a finite logit `±c/T`); each backward's `1 − tanh²` is exactly 0 there, as the
    float64 reference's, so every gradient has the reference's NaN where `0·inf` meets it, and its
    finite values elsewhere (`LogitHead.cap_derivative`, proofs/fused_linear.md §11)."""
    _same_pattern_under_head(kind, {"softcap": 3.0, "temperature": 0.7}, where, math.inf, entropy)


@pytest.mark.compile
@pytest.mark.parametrize("compile_tiles", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_compiled(entropy, compile_tiles):
    """Under `torch.compile(fullgraph=True)`, with the per-tile bodies compiled or not, soft-capped
    or not: every position and value through one compiled function per head."""
    for head in ({}, {"softcap": 3.0}):
        fn = torch.compile(
            lambda h, w, b, ids, a, e, head=head: call(KIND, entropy, h, w, b, ids, (a, e), chunk_size=3, **head),
            fullgraph=True,
        )
        with chunk_policy(dataclasses.replace(BLOCKS, compile_tiles=compile_tiles)):
            for where, value in itertools.product(WHERE, VALUES):
                hidden, weight, bias, ids, coef, grads = make_case(KIND, where, value)
                leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
                want = call_reference(KIND, entropy, *leaves, ids, coef, **head)
                want += backward(KIND, want, grads, leaves)
                leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
                got = fn(*leaves, ids, *coef)
                got += backward(KIND, got, grads, leaves)
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert_same_pattern(g, w, f"compiled {head}/{where}/{value}/entropy={entropy}: {i}")


# ---------------------------------------------------------------------------------------------
# 2 real gloo processes: each rank holds half of the head; eager and compiled, chunked and not
# ---------------------------------------------------------------------------------------------

GLOO_CASES = [(w, v, e) for w in WHERE for v in VALUES for e in (False, True)]


def gloo_renorm_rank(rank, world, group, cases, compiled, policy):
    sizes, chunk = POLICIES[policy]
    results = []
    for where, value, entropy in cases:
        hidden, weight, bias, ids, coef, grads = make_case(KIND, where, value)
        vl = weight.shape[0] // world
        cols = slice(rank * vl, (rank + 1) * vl)
        h = hidden.clone().requires_grad_()
        w, b = weight[cols].clone().requires_grad_(), bias[cols].clone().requires_grad_()

        def fn(h, w, b, ids, a, e, entropy=entropy):
            return call(KIND, entropy, h, w, b, ids, (a, e), group=group, chunk_size=chunk)

        if compiled:
            _, fn = compiled_for_rank(rank, ("renorm_nonfinite", entropy, policy), fn, "aot_eager")
        with chunk_policy(sizes):
            outs = fn(h, w, b, ids, *coef)
            torch.autograd.backward(outs, grads[: len(outs)])
        results.append([o.detach() for o in outs] + [h.grad, w.grad, b.grad])
    return results


@pytest.mark.distributed
@pytest.mark.parametrize(("compiled", "policy"), [(False, "blocks"), (False, "unchunked"), (True, "blocks")])
def test_gloo_two_ranks(compiled, policy):
    per_rank = gloo_pool(2).run(gloo_renorm_rank, GLOO_CASES, compiled, policy)
    for i, (where, value, entropy) in enumerate(GLOO_CASES):
        what = f"{where}/{value}/entropy={entropy}/compiled={compiled}/{policy}"
        hidden, weight, bias, ids, coef, grads = make_case(KIND, where, value)
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        want = call_reference(KIND, entropy, *leaves, ids, coef)
        dh, dw, db = backward(KIND, want, grads, leaves)
        r0, r1 = per_rank[0][i], per_rank[1][i]
        n = len(want)
        for j in range(n):
            assert_same_pattern(r0[j], want[j], f"{what}: output {j}, rank 0")
            assert_same_pattern(r1[j], want[j], f"{what}: output {j}, rank 1")
        assert_same_pattern(r0[n], dh, f"{what}: dhidden, rank 0")
        assert_same_pattern(r1[n], dh, f"{what}: dhidden, rank 1")
        assert_same_pattern(torch.cat([r0[n + 1], r1[n + 1]]), dw, f"{what}: dweight")
        assert_same_pattern(torch.cat([r0[n + 2], r1[n + 2]]), db, f"{what}: dbias")
        if where != "hidden":
            assert r0[0][_outside_rows((hidden, weight, bias, ids))].isfinite().all()


# ---------------------------------------------------------------------------------------------
# float64 gradcheck of the backward without the softmax term (`grad_total=None`)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entropy", "head"),
    [(False, {}), (False, {"softcap": 2.0, "temperature": 0.8}), (True, {"logit_scale": 1.3})],
    ids=["sparse", "softcap", "entropy"],
)
def test_gradcheck(entropy, head):
    """Every path of the changed tile backward: `dz = scatter(ids, g)` without recomputing the
    logits; with a soft-cap (`dz = 0` times `1 − tanh²`); with the entropy term (no `−p Σ g`)."""
    hidden, weight, bias, ids, _, _ = make_case(KIND, None, 0.0, batch=1, seq=3, hidden_size=3, vocab=7, k=2)
    ids[0, 1, 1] = -100  # an ignored id

    def fn(h, w, b):
        with chunk_policy(dataclasses.replace(CPU_POLICY, max_block=3)):
            lp, ne = lossfx.linear_gather_logprobs(
                h, w, ids, bias=b, zero_outside_topk=False, with_neg_entropy=entropy, chunk_size=2, **head
            )
        return (lp, ne) if entropy else lp

    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    assert torch.autograd.gradcheck(fn, leaves)


def _sharded_gradcheck_rank(rank, world, group, hidden, weight, bias, ids):
    vl = weight.shape[0] // world
    cols = slice(rank * vl, (rank + 1) * vl)

    def of_weight(w):
        return lossfx.linear_gather_logprobs(
            hidden, w, ids, bias=bias[cols], zero_outside_topk=False, group=group, chunk_size=2
        )[0]

    return sharded_gradcheck(of_weight, weight[cols], rank=rank, world=world)


def test_sharded_gradcheck_two_ranks():
    hidden, weight, bias, ids, _, _ = make_case(KIND, None, 0.0, batch=1, seq=3, hidden_size=3, vocab=8, k=2)
    assert all(run_ranks(2, _sharded_gradcheck_rank, hidden, weight, bias, ids))
