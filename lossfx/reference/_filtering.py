"""Dense references of the top-k/top-p filter, the filtered log-probs and the filtered LOGPROB input.

The rule (NeMo RL's filter, docs/decisions.md §2.6): top-k keeps every value `≥` the k-th
largest (ties kept); top-p then runs on the survivors' renormalised softmax `q` and keeps a
survivor iff the mass ranked **strictly above** it is `< top_p` (the largest always survives).
Two tie rules say what "ranked above" means among equal logits:

* `ties="together"`: only strictly larger logits rank above, so equal logits are kept or dropped
  together;
* `ties="sorted"`: NeMo RL's order, an ascending **stable** sort of the values, in which the larger
  token id ranks higher among equal values (for `p = [.5, .2, .2, .1]`, `top_p = 0.6` it keeps
  tokens {0, 2}).

The masses are those of the float64 weights `exp(z − max)`; `top_p` is the float64 value passed.
Where every survivor with a nonzero weight ties at the row max (a uniform row, or a tied top-k),
the mass above the j-th of those `t` is exactly `j / t`, so `"sorted"` keeps `⌈top_p · t⌉` of
them, decided with exact fractions (the only case in which the mass can equal `top_p`:
proofs/filtering.md §3.3); a value whose weight is 0 has exactly the whole mass above it and is
never kept. A row holding a NaN keeps nothing; its filtered log-probs are NaN with a NaN gradient
in every column (`filtered_token_logprobs`). The masses are float64.
Implemented the way the field does it: a stable sort, a cumulative sum, a scatter back.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from lossfx.reference._logprobs import log_softmax, next_token_logprobs

__all__ = [
    "apply_top_k_top_p",
    "filtered_token_logprobs",
    "mask_out_neg_inf_logprobs",
    "next_token_filtered_logprobs",
    "prepare_filtered_logprob_input",
]

_F64 = torch.float64


def _top_k_keep(z: Tensor, top_k: int | None) -> Tensor:
    if top_k is None or top_k <= 0 or top_k >= z.shape[-1]:
        return torch.ones_like(z, dtype=torch.bool)
    kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
    return z >= kth


TIES = ("together", "sorted")


def _check_ties(ties: str) -> None:
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")


def _top_p_keep(z: Tensor, keep_k: Tensor, top_p: float, ties: str) -> Tensor:
    if top_p >= 1.0:
        return torch.ones_like(z, dtype=torch.bool)
    zk = torch.where(keep_k, z, float("-inf"))
    q = torch.where(keep_k, log_softmax(zk).exp(), 0.0)
    if ties == "sorted":  # NeMo RL's ascending stable sort, read from the top: larger id first among equals
        order = torch.sort(zk, dim=-1, stable=True).indices.flip(-1)
    else:
        order = torch.sort(zk, dim=-1, descending=True, stable=True).indices
    values, q_sorted = zk.gather(-1, order), q.gather(-1, order)
    excl = torch.cat([torch.zeros_like(q_sorted[..., :1]), torch.cumsum(q_sorted, dim=-1)[..., :-1]], dim=-1)
    # a value of float64 weight exp(z − max) = 0 has exactly the whole mass above it: never kept
    # (its rounded cumulative sum may fall below a top_p just under 1); NaN rows pass through
    zmax = zk.amax(dim=-1, keepdim=True)
    excl = torch.where(torch.exp(values - zmax) == 0, torch.ones_like(excl), excl)
    if ties == "sorted":  # each position's own mass above it
        keep_sorted = excl < top_p
        # Where every survivor with a nonzero float64 weight ties at the max, the mass above the
        # j-th of those t is exactly j / t: keep the first ⌈top_p · t⌉, decided with fractions
        # (the float64 cumulative sum of t copies of a rounded 1/t may land on either side).
        top = keep_k & (zk == zmax)
        live = keep_k & (torch.exp(zk - zmax) > 0)
        uniform = (live == (live & top)).all(dim=-1) & torch.isfinite(zmax[..., 0])  # [...]
        t = top.sum(dim=-1)
        n = torch.tensor([math.ceil(Fraction(top_p) * c) for c in t.reshape(-1).tolist()], device=z.device)
        positions = torch.arange(z.shape[-1], device=z.device)
        exact = positions < n.view(t.shape).unsqueeze(-1)
        keep_sorted = torch.where(uniform.unsqueeze(-1), exact, keep_sorted)
        return torch.zeros_like(keep_k).scatter(-1, order, keep_sorted)
    # the mass strictly above a value: the exclusive sum at the first element of its tie group
    new_group = torch.cat(
        [torch.ones_like(values[..., :1], dtype=torch.bool), values[..., 1:] != values[..., :-1]], dim=-1
    )
    positions = torch.arange(z.shape[-1], device=z.device).expand_as(values)
    first = torch.cummax(torch.where(new_group, positions, 0), dim=-1).values
    mass_above = excl.gather(-1, first)
    keep_sorted = mass_above < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def apply_top_k_top_p(
    logits: Tensor, top_k: int | None = None, top_p: float = 1.0, ties: str = "together"
) -> tuple[Tensor, Tensor]:
    """`[..., V]` -> `(filtered, keep)`: float64 logits with dropped entries `-inf`, bool mask.

    A row holding a NaN keeps nothing.
    """
    _check_ties(ties)
    z = logits.to(_F64)
    keep_k = _top_k_keep(z.detach(), top_k)
    keep = keep_k & _top_p_keep(z.detach(), keep_k, float(top_p), ties)
    keep = keep & ~torch.isnan(z.detach()).any(dim=-1, keepdim=True)
    return torch.where(keep, z, float("-inf")), keep


def filtered_token_logprobs(
    logits: Tensor, target: Tensor, top_k: int | None = None, top_p: float = 1.0, ties: str = "together"
) -> Tensor:
    """`[..., V]`, `[...]` -> `[...]`: `log_softmax(filter(logits))[..., target]` in float64.

    A row holding a NaN cannot be ranked, so it is not filtered: its log-prob is the unfiltered
    `log_softmax(logits)[target]`, NaN, and its gradient NaN in every column, as torch's autograd
    gives it (a NaN loss never comes with a zero gradient; docs/filtering.md)."""
    filtered, _ = apply_top_k_top_p(logits, top_k, top_p, ties)
    out = log_softmax(filtered).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    nan_row = torch.isnan(logits.detach()).any(dim=-1)
    # only the NaN rows through the unfiltered softmax: elsewhere its backward adds exactly 0
    raw = torch.where(nan_row[..., None], logits.to(_F64), 0.0)
    unfiltered = raw.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return torch.where(nan_row, unfiltered, out)


def next_token_filtered_logprobs(
    logits: Tensor, input_ids: Tensor, top_k: int | None = None, top_p: float = 1.0, ties: str = "together"
) -> Tensor:
    """`[B, S, V]`, `[B, S]` -> `[B, S-1]`: the filtered log-prob of `input_ids[:, t+1]`."""
    return filtered_token_logprobs(logits[:, :-1], input_ids[:, 1:], top_k, top_p, ties)


def mask_out_neg_inf_logprobs(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Zero where `mask == 0` or the log-prob is `±inf` (a NaN at a valid position stays NaN)."""
    return torch.where((mask != 0) & ~torch.isinf(logprobs), logprobs, torch.zeros_like(logprobs))


def prepare_filtered_logprob_input(
    logits: Tensor, data: dict[str, Any], loss_fn: Any, top_k: int | None, top_p: float, ties: str = "together"
) -> tuple[dict[str, Tensor], Tensor | None]:
    """The filtered LOGPROB loss input and the unfiltered copy (or `None`) from dense `[B, S, V]`.

    `mask = token_mask · sample_mask[:, None]` (`token_mask` required, `sample_mask` ones if absent); positions with
    `mask[:, 1:] == 0` or an infinite filtered log-prob become 0 (NaN stays NaN). The unfiltered copy is what
    `prepare_loss_input` stores in `data["curr_logprobs_unfiltered"]` when
    `loss_fn.reference_policy_kl_penalty != 0`.
    """
    input_ids = data["input_ids"]
    mask = data["token_mask"].to(_F64)
    if "sample_mask" in data:
        mask = mask * data["sample_mask"].to(_F64)[:, None]
    logprobs = next_token_filtered_logprobs(logits, input_ids, top_k, top_p, ties)
    logprobs = mask_out_neg_inf_logprobs(logprobs, mask[:, 1:])
    unfiltered = None
    if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
        unfiltered = next_token_logprobs(logits, input_ids)
    return {"next_token_logprobs": logprobs}, unfiltered
