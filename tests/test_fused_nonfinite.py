"""A NaN or `+inf` in `hidden`, `weight` or `bias` of the fused LM-head path: never made finite.

torch's `log_softmax` makes a row with a NaN or `+inf` logit NaN throughout, and its backward a
NaN gradient of every logit of that row; the matmuls then carry the NaN (and `0·inf`) into
`dhidden`, `dweight` and `dbias`. The float64 reference (`lossfx.reference`, autograd through the
dense formula) does exactly that, so every fused function must give the same non-finite pattern
(which entries are NaN, `+inf`, `-inf`) in every output and every gradient, and the reference's
values elsewhere: with and without the entropy term, in vocabulary blocks and row chunks, eager
and compiled (issue 25: the entropy branch of the backward used to zero every NaN of a tile).

`linear_gather_logprobs(..., zero_outside_topk=False)` ("gather_renorm") renormalises the logits
at the `K` ids alone, as the reference: a non-finite logit outside a row's ids leaves that row
finite in both (tests/test_nonfinite_fused_renorm.py checks it row by row, unchunked and on 2 gloo
ranks). The one exception (documented in docs/fused_linear.md): an ignored row (every id
`ignore_index`) is never projected, so a NaN there reaches no gradient.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from test_fused_neg_inf import backward, call, call_reference, coefficients_and_grads

from lossfx._core.chunking import CPU_POLICY, chunk_policy

F64 = torch.float64
KINDS = ("token", "gather", "gather_renorm", "next_token", "objective")
WHERE = ("hidden", "weight", "bias")
VALUES = (math.nan, math.inf)
BLOCKS = dataclasses.replace(CPU_POLICY, max_block=4)  # V = 16: four vocabulary blocks of 4 columns
ROW = (0, 2)  # the hidden row (batch, position) made non-finite: projected in every kind


def make_case(kind, where, value, *, seed=0, batch=2, seq=5, hidden_size=6, vocab=16, k=3):
    """`(hidden, weight, bias, ids, (a, b), upstream grads)` in float64 with one entry `value` in
    `hidden[ROW]`, in head row 5 or at bias entry 7 (`where`), or none (`where=None`); no ignored id."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen, dtype=F64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=F64)
    bias = torch.randn(vocab, generator=gen, dtype=F64)
    if where == "hidden":
        hidden[ROW][1] = value
    elif where == "weight":
        weight[5, 3] = value
    elif where == "bias":
        bias[7] = value
    shape = (batch, seq, k) if kind.startswith("gather") else (batch, seq)
    ids = torch.randint(0, vocab, shape, generator=gen)
    return hidden, weight, bias, ids, *coefficients_and_grads(kind, shape, gen)


def assert_same_pattern(got, want, what, atol=1e-10):
    """The same NaN, `+inf` and `-inf` entries, and the reference's finite values elsewhere."""
    got, want = got.detach().to(F64), want.detach().to(F64)
    for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        g, w = test(got), test(want)
        assert torch.equal(g, w), f"{what}: {name} at {g.nonzero().tolist()}, reference at {w.nonzero().tolist()}"
    fin = want.isfinite()
    torch.testing.assert_close(got[fin], want[fin], rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def run(kind, entropy, case, fn=call, chunk=3):
    """The fused `kind` (through `fn`) against the reference on `case`: outputs and gradients."""
    hidden, weight, bias, ids, coef, grads = case
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    want = call_reference(kind, entropy, *leaves, ids, coef)
    want += backward(kind, want, grads, leaves)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    got = fn(kind, entropy, *leaves, ids, coef, chunk_size=chunk)
    got += backward(kind, got, grads, leaves)
    names = [*("out0", "out1", "out2")[: len(got) - 3], "dhidden", "dweight", "dbias"]
    for name, g, w in zip(names, got, want, strict=True):
        assert_same_pattern(g, w, f"{kind}/entropy={entropy}: {name}")
    return got


@pytest.mark.parametrize("value", VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_input_gives_the_reference_pattern(kind, entropy, where, value):
    with chunk_policy(BLOCKS):
        got = run(kind, entropy, make_case(kind, where, value))
    # the point of the issue: a non-finite loss never comes with finite gradients (the
    # renormalised gather's values can all be finite: a non-finite logit outside every row's ids)
    if not all(o.isfinite().all() for o in got[:-3]):
        assert all(not g.isfinite().all() for g in got[-3:]), f"{kind}/{where}: a finite gradient"


@pytest.mark.parametrize("kind", KINDS)
def test_finite_wide_logits_unchanged(kind):
    """Finite logits spread far beyond exp's range (`p` underflows to 0 on some columns, a `-inf`
    bias column beside them): the clamped `0·log 0` guard leaves every value and gradient the
    reference's, and nothing non-finite appears."""
    hidden, weight, bias, ids, coef, grads = make_case(kind, None, 0.0)
    bias[3], bias[9], bias[12] = -1500.0, -800.0, -math.inf
    ids = torch.where(ids == 12, 0, ids)  # no target on the -inf column (the objective's a > 0)
    with chunk_policy(BLOCKS):
        got = run(kind, True, (hidden, weight, bias, ids, coef, grads))
    assert all(g.isfinite().all() for g in got[-3:])


def test_ignored_row_is_never_projected():
    """The documented exception: a NaN in a row whose target is `ignore_index` reaches no
    gradient (the row is skipped), where the reference's autograd spreads it."""
    hidden, weight, bias, ids, coef, grads = make_case("token", "hidden", math.nan)
    ids[ROW] = -100
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    with chunk_policy(BLOCKS):
        got = call("token", True, *leaves, ids, coef, chunk_size=3)
    dh, dw, db = backward("token", got, grads, leaves)
    assert got[0][ROW] == 0 and got[1][ROW] == 0
    assert torch.equal(dh[ROW], torch.zeros_like(dh[ROW]))
    assert dh.isfinite().all() and dw.isfinite().all() and db.isfinite().all()


def _compiled_call():
    """`call` under `torch.compile(fullgraph=True)`, one compiled function per kind."""
    compiled = {}

    def fn(kind, entropy, h, w, b, ids, coef, **kw):
        if kind not in compiled:
            compiled[kind] = torch.compile(
                lambda h, w, b, ids, a, e: call(kind, entropy, h, w, b, ids, (a, e), **kw), fullgraph=True
            )
        return compiled[kind](h, w, b, ids, *coef)

    return fn


def _check_compiled(kind, entropy):
    """Every position and value through one compiled function (one compile: only values
    change), with the per-tile bodies compiled as the GPU policy does (`compile_tiles`)."""
    fn = _compiled_call()
    with chunk_policy(dataclasses.replace(BLOCKS, compile_tiles=True)):
        for where, value in itertools.product(WHERE, VALUES):
            run(kind, entropy, make_case(kind, where, value), fn=fn)


@pytest.mark.compile
def test_compiled_token_with_entropy():
    _check_compiled("token", True)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize(
    ("kind", "entropy"), [(k, e) for k in KINDS for e in (False, True) if (k, e) != ("token", True)]
)
def test_compiled_every_kind(kind, entropy):
    _check_compiled(kind, entropy)
