"""The documented exception of the fused head: `linear_gather_logprobs(..., zero_outside_topk=False)`.

It renormalises the full-softmax log-probs at the `K` ids (`log_softmax(log p[ids])`), while the
reference renormalises the `K` logits alone (`log_softmax(z[ids])`). The two agree wherever the
row is finite; a NaN or `+inf` logit of the row outside its ids makes the kernel's row NaN
(and its gradient row, hence `weight.grad` and `bias.grad` entirely) where the reference is finite
(docs/fused_linear.md, "NaN and `+inf` are never made finite"). What holds, asserted here without
the entropy term (with it, tests/test_fused_nonfinite.py checks the gradients exactly):

* no NaN is made finite: every non-finite entry of the reference is non-finite in the kernel, in
  the values and in every gradient;
* the exception is exactly the rows with a non-finite logit outside their ids: their values are
  NaN, and every other row has the reference's values;
* wherever both are finite, the values and gradients are the reference's.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_neg_inf import backward, call, call_reference
from test_fused_nonfinite import BLOCKS, VALUES, WHERE, make_case

from lossfx import reference
from lossfx._core.chunking import chunk_policy

F64 = torch.float64


@pytest.mark.parametrize("value", VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", WHERE)
def test_renormalised_gather_without_entropy(where, value):
    hidden, weight, bias, ids, coef, grads = make_case("gather_renorm", where, value)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    want = call_reference("gather_renorm", False, *leaves, ids, coef)
    want += backward("gather_renorm", want, grads, leaves)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    with chunk_policy(BLOCKS):
        got = call("gather_renorm", False, *leaves, ids, coef, chunk_size=3)
        got += backward("gather_renorm", got, grads, leaves)
    for name, g, w in zip(("logprobs", "dhidden", "dweight", "dbias"), got, want, strict=True):
        g, w = g.detach().to(F64), w.detach().to(F64)
        assert not (g.isfinite() & ~w.isfinite()).any(), f"{where}/{value}: {name}: a non-finite entry made finite"
        both = g.isfinite() & w.isfinite()
        torch.testing.assert_close(g[both], w[both], rtol=0, atol=1e-10)
    # the exception, row by row: a NaN or +inf logit outside the row's ids
    z = reference.linear_logits(hidden, weight, bias=bias)  # [B, S, V]
    bad = z.isnan() | z.isposinf()  # what makes log_softmax NaN (a -inf logit does not)
    at_ids = bad.gather(-1, ids).any(-1)  # [B, S]: a non-finite logit among the ids
    outside = bad.any(-1) & ~at_ids
    lp, lp_ref = got[0].detach(), want[0].detach()
    assert lp[outside].isnan().all() and lp_ref[outside].isfinite().all()
    inside = ~outside
    assert torch.equal(lp[inside].isnan(), lp_ref[inside].isnan())
    if where != "hidden":  # a head entry reaches every row: some row shows the exception
        assert outside.any()
