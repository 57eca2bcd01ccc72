"""The hidden-state front door against NeMo RL's logits-path answer (`bench_filtering`'s sort-based
`apply_top_k_top_p`: sort each row, top-k cut, softmax, cumulative sum, top-p cut, scatter back),
on the logits `h @ W.T`, on the branch NeMo has: LOGPROB, unfiltered and top-k/top-p filtered.

NeMo keeps equal logits in its sort order, lossfx's `ties="sorted"` rule; on continuous random
logits there are no ties and both rules agree. fp32 throughout: equal to fp32 rounding (the fused
path sums its log-sums tile by tile). NeMo's dropped target is `-inf`; the front door masks it to
0 (the logits path's rule), so the dropped positions are compared, the kept values to 2e-5.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE

import lossfx
from benchmarks.bench_filtering import sort_based_filtered_logprobs

F32 = torch.float32
B, S, H, V = 2, 32, 16, 300
LOSS_FN = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
FILTERS = {"top-k 50, top-p 0.9": (50, 0.9), "top-p 0.9": (V, 0.9), "top-p 0.5": (V, 0.5), "top-k 20": (20, 1.0)}


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=gen).to(DEVICE)
    weight = (torch.randn(V, H, generator=gen) * 0.8).to(DEVICE)
    ids = torch.randint(0, V, (B, S), generator=gen)
    ids[:, 1::2] = (hidden.cpu() @ weight.cpu().T).argmax(-1)[:, :-1:2]  # half the targets are kept
    return hidden, weight, {"input_ids": ids.to(DEVICE), "token_mask": torch.ones(B, S, device=DEVICE)}


def _nemo(hidden, weight, ids, top_k, top_p):
    """NeMo's next-token log-probs `[B, S - 1]` and their gradients, on the logits `h @ W.T`."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (h @ w.T)[:, :-1]
    lp = sort_based_filtered_logprobs(logits, ids[:, 1:], top_k, top_p)
    live = torch.isfinite(lp.detach())
    cot = torch.linspace(-1, 1, lp.numel(), device=lp.device).view(lp.shape)
    grads = torch.autograd.grad(torch.where(live, lp, 0.0).mul(cot).sum(), (h, w))
    return lp.detach(), grads, cot


def _front_door(hidden, weight, data, sampling, cot):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice that dropped targets are masked to 0
        out, _ = lossfx.prepare_linear_loss_input(h, w, dict(data), LOSS_FN, sampling_params=sampling)
    lp = out["next_token_logprobs"]  # [B, S - 1]
    grads = torch.autograd.grad((lp * cot).sum(), (h, w))
    return lp.detach(), grads


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_filtered_logprob_equals_nemos_sort_based_answer(name):
    hidden, weight, data = _case()
    top_k, top_p = FILTERS[name]
    want, want_g, cot = _nemo(hidden, weight, data["input_ids"], top_k, top_p)
    sampling = lossfx.TrainingSamplingParams(top_k=top_k if top_k < V else None, top_p=top_p, ties="sorted")
    got, got_g = _front_door(hidden, weight, data, sampling, cot)
    dropped = torch.isneginf(want)
    assert dropped.any() and (~dropped).any(), "the case must both keep and drop targets"
    assert torch.equal(got[dropped], torch.zeros_like(got[dropped]))
    torch.testing.assert_close(got[~dropped], want[~dropped], rtol=2e-5, atol=2e-5)
    for a, e in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_unfiltered_logprob_equals_nemos_answer():
    hidden, weight, data = _case(1)
    want, want_g, cot = _nemo(hidden, weight, data["input_ids"], V, 1.0)  # no cut: log_softmax + gather
    got, got_g = _front_door(hidden, weight, data, None, cot)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for a, e in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
