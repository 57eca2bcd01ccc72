"""Numeric checks of the identities claimed in proofs/ (float64, random upstream gradient)."""

import pytest
import torch

import lossfx
from lossfx import reference
from lossfx._numerics import merge_max_sumexp, row_max_sumexp

F64 = torch.float64


def _logits(n, v, seed, neg_inf=False):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen, dtype=F64) * 4
    if neg_inf:
        z[torch.rand(n, v, generator=gen) < 0.3] = float("-inf")
        z[0] = float("-inf")  # one all -inf row
    return z


@pytest.mark.parametrize("seed", range(3))
def test_logprobs_vjp_formula(seed):
    """proofs/logprobs.md §2: ∂L/∂z = g (onehot(t) − softmax(z)), against dense autograd."""
    n, v = 6, 13
    z = _logits(n, v, seed).requires_grad_()
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    g = torch.randn(n, dtype=F64)
    (reference.token_logprobs(z, t) * g).sum().backward()
    formula = g[:, None] * (torch.nn.functional.one_hot(t, v).to(F64) - torch.softmax(z.detach(), -1))
    torch.testing.assert_close(z.grad, formula, rtol=0, atol=1e-12)
    # and lossfx's own backward equals it
    z2 = z.detach().clone().requires_grad_()
    (lossfx.token_logprobs(z2, t, chunk_size=2) * g).sum().backward()
    torch.testing.assert_close(z2.grad, formula, rtol=0, atol=1e-12)
    # each row of the gradient sums to zero
    torch.testing.assert_close(z2.grad.sum(-1), torch.zeros(n, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("neg_inf", [False, True])
def test_logprobs_merge_identity(shards, neg_inf):
    """proofs/logprobs.md §3: merging per-shard (max, sumexp) over any partition gives the lse."""
    n, v = 5, 11
    z = _logits(n, v, 7 + shards, neg_inf)
    bounds = torch.linspace(0, v, shards + 1).round().long().tolist()
    stats = [row_max_sumexp(z[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    lse = merge_max_sumexp(torch.stack([m for m, _ in stats]), torch.stack([s for _, s in stats]))
    expected = torch.logsumexp(z, -1)
    assert not torch.isnan(lse).any()
    torch.testing.assert_close(lse, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_logprobs_chunk_independence(chunk):
    """proofs/logprobs.md §2: chunking along rows does not change any row's result."""
    n, v = 7, 9
    z = _logits(n, v, 3, neg_inf=True)
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    out_chunked, lse_chunked = lossfx.token_logprobs_with_lse(z, t, chunk_size=chunk)
    out_whole, lse_whole = lossfx.token_logprobs_with_lse(z, t, chunk_size=n)
    torch.testing.assert_close(lse_chunked, lse_whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(out_chunked, out_whole, rtol=0, atol=1e-12)
