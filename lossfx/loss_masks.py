"""Loss masks from a NeMo-RL data dict: which positions count, and zeroing the ones that cannot.

Data-dict plumbing of the entry points (`loss_input.py`), kept apart from the kernels: it knows the
column names of a batch (`token_mask`, `sample_mask`) but nothing about vocabularies or layouts.

* `loss_mask_from_data`: `token_mask · sample_mask[:, None]` `[B, S]` (a missing `token_mask`
  raises `ValueError`, docs/decisions.md §2.5; a missing `sample_mask` is ones);
* `mask_out_neg_inf_logprobs`: `where(mask & ~isinf(logprobs), logprobs, 0)`, warning in eager
  mode about valid tokens a top-k/top-p filter removed. The warning's count is copied to the host
  without stalling the device (`lossfx._core.host_reads.when_landed`): on CPU it fires in the
  call, on a GPU once the copy has landed (at the latest at the next lossfx call in the thread).

Reference: `lossfx.reference.mask_out_neg_inf_logprobs`.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lossfx._boundary.consistency import boundary
from lossfx._boundary.dtensor import replicated
from lossfx._boundary.validation import check_floating, check_tensor, values_checkable
from lossfx._core import host_reads as _host_reads

__all__ = ["loss_mask_from_data", "mask_out_neg_inf_logprobs"]


@boundary(collectives=False)
def mask_out_neg_inf_logprobs(logprobs: Tensor, mask: Tensor, name: str = "logprobs") -> Tensor:
    """Zero every position whose mask is 0 or whose log-prob is `±inf`; warn about valid ones.

    Equivalent to ``torch.where((mask != 0) & ~isinf(logprobs), logprobs, 0)`` (the seed's rule): a
    NaN at a valid position stays NaN, since it signals broken logits, not a filter mismatch. The gradient is
    0 at the zeroed positions (never NaN). In eager mode, when some position with a nonzero mask
    holds `±inf`, a `UserWarning` reports how many of the valid tokens were masked out; under
    `torch.compile` the count and the warning are skipped (no graph break). The count never
    stalls the device: on a GPU the warning fires once its copy reached the host, at the latest
    at the next lossfx call of the thread.

    Args:
        logprobs: `[B, T]` float log-probs (e.g. filtered next-token log-probs).
        mask: `[B, T]` (any numeric or bool dtype): 1 for valid tokens.
        name: what the warning calls the tensor.

    Returns:
        `[B, T]` like `logprobs`.

    Example:
        >>> import torch, lossfx
        >>> lossfx.mask_out_neg_inf_logprobs(torch.tensor([[-1.0, float("-inf")]]), torch.tensor([[1, 0]]))
        tensor([[-1.,  0.]])
    """
    logprobs, mask = replicated(logprobs, name), replicated(mask, "mask")  # lossfx/_boundary/dtensor.py
    check_floating("logprobs", logprobs)
    check_tensor("mask", mask)
    if tuple(mask.shape) != tuple(logprobs.shape):
        raise ValueError(
            f"mask must have the shape of {name}; got mask.shape={tuple(mask.shape)} and "
            f"{name}.shape={tuple(logprobs.shape)}"
        )
    return masked_out_neg_inf(logprobs, mask, name)


def masked_out_neg_inf(logprobs: Tensor, mask: Tensor, name: str = "logprobs") -> Tensor:
    """`mask_out_neg_inf_logprobs` without its boundary (for the entry points, whose own boundary
    checked `logprobs [B, T]` and `mask [B, T]`): the same result and warning."""
    valid = mask != 0
    not_inf = ~torch.isinf(logprobs)  # NaN passes through (issue 10 item 3)
    if values_checkable(logprobs, mask):  # a report: copied to the host without a stall

        def warn_if_bad(counts: list[int]) -> None:
            if counts[0]:
                warnings.warn(
                    f"{counts[0]}/{counts[1]} valid tokens have -inf in {name} (policy top-k/top-p "
                    "mismatch). Masking out these positions.",
                    stacklevel=_outside_lossfx(),
                )

        _host_reads.when_landed(torch.stack([(valid & ~not_inf).sum(), valid.sum()]), warn_if_bad)
    return torch.where(valid & not_inf, logprobs, torch.zeros_like(logprobs))


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_lossfx() -> int:
    """The `stacklevel` of `warnings.warn`, called from the caller of this function, that names
    the first frame outside lossfx (the user's line, whenever the warning fires)."""
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


def loss_mask_from_data(data: Mapping[str, Any], input_ids: Tensor) -> Tensor:
    """`token_mask · sample_mask[:, None] != 0` `[B, S]` bool from `data`.

    `token_mask` `[B, S]` is required (a missing one raises `ValueError` naming it, docs/decisions.md
    §2.5; it is never taken as ones); `sample_mask` `[B]` is an optional per-sequence weight (ones
    when absent). Any numeric or bool dtype.
    """
    batch, seq = input_ids.shape
    if data.get("token_mask") is None:
        raise ValueError(
            "data must contain 'token_mask' under a top-k/top-p filter (the -inf rule masks with "
            f"token_mask · sample_mask); it has {sorted(data.keys())}"
        )
    token_mask = check_tensor("data['token_mask']", data["token_mask"])
    if tuple(token_mask.shape) != (batch, seq):
        raise ValueError(f"data['token_mask'] must be [B, S] = {(batch, seq)}, got {tuple(token_mask.shape)}")
    mask = token_mask != 0
    sample_mask = data.get("sample_mask")
    if sample_mask is not None:
        check_tensor("data['sample_mask']", sample_mask)
        if tuple(sample_mask.shape) != (batch,):
            raise ValueError(f"data['sample_mask'] must be [B] = {(batch,)}, got {tuple(sample_mask.shape)}")
        mask = mask & (sample_mask != 0)[:, None]
    return mask
