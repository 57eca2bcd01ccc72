"""The logits side's `Σ p log p` under names that carry its sign (docs/decisions.md).

`lossfx.neg_entropy`, `gather_logprobs(with_neg_entropy=)`, `lossfx.reference.neg_entropy` and
`lossfx.testing.check_neg_entropy_fn` against the float64 reference (values and gradients); each
former name gives the same value with one FutureWarning in eager mode and none, without a graph
break, under `torch.compile(fullgraph=True)`.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lossfx
import lossfx.testing as lt
from lossfx import reference

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
SIGN = "is deprecated: its value is Σ p log p, the NEGATIVE entropy"


def _logits(seed=0, rows=5, vocab=11):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=F64) * 3


def test_neg_entropy_matches_the_reference_values_and_gradients():
    z = _logits().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = lossfx.neg_entropy(z, chunk_rows=2)
        z2 = z.detach().clone().requires_grad_()
        want = reference.neg_entropy(z2)
    torch.testing.assert_close(got, want, **TIGHT)
    assert (got < 0).all()  # the sign its name says
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    (g,) = torch.autograd.grad(got, z, dout)
    (r,) = torch.autograd.grad(want, z2, dout)
    torch.testing.assert_close(g, r, **TIGHT)


def test_old_entropy_name_keeps_its_value_and_warns():
    z = _logits(seed=2)
    with pytest.warns(FutureWarning, match=f"lossfx.entropy {SIGN}.*lossfx.neg_entropy"):
        old = lossfx.entropy(z)
    assert torch.equal(old, lossfx.neg_entropy(z))


def test_old_reference_entropy_name_keeps_its_value_and_warns():
    z = _logits(seed=3)
    with pytest.warns(FutureWarning, match=f"lossfx.reference.entropy {SIGN}"):
        old = reference.entropy(z)
    assert torch.equal(old, reference.neg_entropy(z))


def test_gather_logprobs_old_keyword_keeps_its_value_and_warns():
    z, ids = _logits(seed=4), torch.tensor([[0, 3], [1, 1], [10, 2], [5, 4], [7, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp, ne = lossfx.gather_logprobs(z, ids, with_neg_entropy=True)
    with pytest.warns(FutureWarning, match=f"with_entropy {SIGN}.*with_neg_entropy"):
        lp_old, ne_old = lossfx.gather_logprobs(z, ids, with_entropy=True)
    assert torch.equal(lp, lp_old) and torch.equal(ne, ne_old)
    ref_lp, ref_ne = reference.gather_logprobs(z, ids)
    torch.testing.assert_close(ne, ref_ne, **TIGHT)
    torch.testing.assert_close(lp, ref_lp, **TIGHT)
    with pytest.raises(TypeError, match="pass with_neg_entropy only; with_entropy is its deprecated name"):
        lossfx.gather_logprobs(z, ids, with_neg_entropy=True, with_entropy=True)


def test_old_checker_name_runs_the_same_check_and_warns():
    z = _logits(seed=5)
    with pytest.warns(FutureWarning, match=f"check_entropy_fn {SIGN}.*check_neg_entropy_fn"):
        lt.check_entropy_fn(lossfx.neg_entropy, z, dtypes=(F64,))
    with pytest.warns(FutureWarning), pytest.raises(AssertionError, match="opposite sign"):
        lt.check_entropy_fn(lambda x: -lossfx.neg_entropy(x), z, dtypes=(F64,))


def test_old_names_compile_without_a_graph_break_or_warning():
    z = _logits(seed=6, rows=4, vocab=7).float()
    ids = torch.tensor([[0], [6], [3], [2]])

    def both(x):
        return lossfx.entropy(x) + lossfx.gather_logprobs(x, ids, with_entropy=True)[1]

    torch._dynamo.reset()
    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        got = compiled(z)
    torch.testing.assert_close(got.double(), 2 * reference.neg_entropy(z.double()), rtol=1e-5, atol=1e-5)
