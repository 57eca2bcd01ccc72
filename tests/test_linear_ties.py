"""Filtered LOGPROB from hidden states keeps the logits path's tie rule, row for row, on tie-heavy bf16 rows.

The hidden states and the head lie on a coarse grid (small integers times quarter-integers), so
every logit `h @ W.T` is an exact dyadic value in any summation order and in bf16: the fused path's
tiles and the logits path's `[N, V]` bf16 logits hold the same values, and most rows hold exact
ties at the top-k value and at the top-p boundary. `prepare_linear_loss_input` must then keep the
same tokens as `prepare_loss_input(h @ W.T)` under both rules (`"together"`, `"sorted"`): equal
outputs (the dropped targets' zeros in the same places), gradients of the same size, and the kept
log-probs equal the float64 reference's.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE

import lossfx
from lossfx import reference

F64, BF16 = torch.float64, torch.bfloat16
B, S, H, V = 2, 40, 8, 1024
FILTERS = {
    "top-p 0.9": {"top_p": 0.9},
    "top-p 0.5": {"top_p": 0.5},
    "top-k 20, top-p 0.8": {"top_k": 20, "top_p": 0.8},
    "top-k 7": {"top_k": 7},
}
LOSS_FN = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)


def _grid_case(seed: int = 0):
    """hidden `[B, S, H]`, weight `[V, H]` bf16 on a coarse grid (|logit| <= 2·1·8 = 16 in
    quarter steps: exact in bf16), `input_ids` whose next ids are often the row's argmax."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (B, S, H), generator=gen).to(F64)
    weight = torch.randint(-4, 5, (V, H), generator=gen).to(F64) / 4
    ids = torch.randint(0, V, (B, S), generator=gen)
    best = (hidden @ weight.T).argmax(-1)  # [B, S]
    ids[:, 1::2] = best[:, :-1:2]  # half the scored targets are a row's (tied) maximum: kept
    data = {"input_ids": ids.to(DEVICE), "token_mask": torch.ones(B, S, device=DEVICE)}
    return hidden.to(BF16).to(DEVICE), weight.to(BF16).to(DEVICE), data


def _run(front_door: bool, hidden, weight, data, params, ties):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    sampling = lossfx.TrainingSamplingParams(**params, ties=ties)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice that dropped targets are masked to 0
        if front_door:
            out, _ = lossfx.prepare_linear_loss_input(h, w, dict(data), LOSS_FN, sampling_params=sampling)
        else:
            out, _ = lossfx.prepare_loss_input(h @ w.T, dict(data), LOSS_FN, sampling_params=sampling)
    lp = out["next_token_logprobs"]
    cot = torch.linspace(-1, 1, lp.numel(), dtype=F64, device=lp.device).view(lp.shape)
    grads = torch.autograd.grad((lp.to(F64) * cot).sum(), (h, w))
    return lp.detach(), grads


def test_the_grid_makes_tie_heavy_rows():
    hidden, weight, _ = _grid_case()
    logits = hidden.to(F64) @ weight.to(F64).T
    assert torch.equal(logits, (hidden @ weight.T).to(F64)), "bf16 logits must be exact"
    top = logits.flatten(0, 1).topk(8, dim=-1).values
    assert (top[:, 0] == top[:, 1]).float().mean() > 0.15, "many rows tie at the top"
    assert (top[:, 6] == top[:, 7]).float().mean() > 0.5, "most rows tie at the 7th value"


@pytest.mark.parametrize("ties", ["together", "sorted"])
@pytest.mark.parametrize("name", sorted(FILTERS))
def test_front_door_keeps_the_logits_paths_tokens_row_for_row(name, ties):
    hidden, weight, data = _grid_case()
    params = FILTERS[name]
    got, got_g = _run(True, hidden, weight, data, params, ties)
    want, want_g = _run(False, hidden, weight, data, params, ties)
    assert got.dtype == want.dtype
    # the same targets dropped (0, the logits path's -inf rule) and kept, row for row
    assert torch.equal(got == 0, want == 0), name
    assert (got == 0).any() and (got != 0).any(), "the case must both keep and drop targets"
    # kept log-probs: the same bf16 logits and the same kept set; log-sums in fp32 in another order
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-5)
    ref = reference.prepare_linear_loss_input(hidden.to(F64), weight.to(F64), dict(data), LOSS_FN, ties=ties, **params)
    kept = got != 0
    torch.testing.assert_close(got[kept].to(F64), ref["next_token_logprobs"][kept], rtol=0, atol=1e-5)
    # gradients: both bf16 (dlogits rounded to bf16 before each matmul, as the unfused path), summed
    # in another order: a few bf16 ulps of O(1) sums
    for a, e in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a.to(F64), e.to(F64), rtol=2e-2, atol=3e-2)


def test_the_tie_rules_differ_on_these_rows():
    """The case discriminates the rules: some rows' outputs differ between "together" and "sorted"
    (so the row-for-row agreement above checks each rule, not a rule-free filter)."""
    hidden, weight, data = _grid_case()
    differ = 0
    for params in FILTERS.values():
        together, _ = _run(True, hidden, weight, data, params, "together")
        sorted_, _ = _run(True, hidden, weight, data, params, "sorted")
        differ += int((together != sorted_).sum())
    assert differ > 0
