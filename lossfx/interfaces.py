"""The types the loss-input dispatch reads: `LossInputType`, `TrainingSamplingParams`, `LossFunction`.

These mirror NeMo RL's names so that porting is an import change. `data` is any mutable mapping of
column name to tensor; `loss_fn` is any object with the attributes `LossFunction` lists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeGuard, runtime_checkable

from lossfx._boundary.validation import check_positive_float
from lossfx.filtering import check_filter_params

__all__ = ["LossFunction", "LossInputType", "TrainingSamplingParams", "need_top_k_or_top_p_filtering"]


class LossInputType(str, enum.Enum):
    """Which inputs a loss function consumes; selects the branch of `prepare_loss_input`."""

    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"
    DRAFT = "draft"
    OPD_FULL = "opd_full"


@dataclass(frozen=True)
class TrainingSamplingParams:
    """The rollout's sampling filter, re-applied at training time.

    Args:
        top_k: keep the `top_k` largest logits per row (ties at the k-th value are all kept).
            `None` or `<= 0` disables top-k.
        top_p: keep the smallest prefix of the (top-k renormalised) distribution whose mass
            reaches `top_p`. `1.0` disables top-p. Must lie in `(0, 1]`.
        temperature: carried for the caller only. **No lossfx function divides by it**: divide
            the logits by the temperature before calling, exactly once.
        ties: top-p's rule among equal logits at the boundary (docs/filtering.md, "Ties"):
            `"together"` (default: a tie group is kept or dropped as a whole, as threshold
            samplers do) or `"sorted"` (NeMo RL's ascending stable sort order: among equal values
            the larger token id ranks higher, as sort-based samplers keep a prefix of their
            order). Either is deterministic and the same at every TP size.

    Raises:
        TypeError: a `temperature` that is not a real number.
        ValueError: `top_p` outside `(0, 1]`, a non-integer `top_k`, an unknown `ties`, or a
            `temperature` that is not finite and > 0.
    """

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0
    ties: Literal["together", "sorted"] = "together"

    def __post_init__(self) -> None:
        check_filter_params(self.top_k, self.top_p, self.ties)  # the filter's own checks
        check_positive_float("temperature", self.temperature)

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k is not None and self.top_k > 0

    @property
    def top_p_enabled(self) -> bool:
        return float(self.top_p) != 1.0


def wants_reference_kl(loss_fn: Any) -> bool:
    """Whether `loss_fn` has a nonzero `reference_policy_kl_penalty` (the reference-KL term, which
    reads unfiltered log-probs)."""
    return getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0


def need_top_k_or_top_p_filtering(sampling_params: TrainingSamplingParams | None) -> TypeGuard[TrainingSamplingParams]:
    """True iff `sampling_params` asks for a top-k or a top-p filter."""
    return sampling_params is not None and (sampling_params.top_k_enabled or sampling_params.top_p_enabled)


@runtime_checkable
class LossFunction(Protocol):
    """The attributes `prepare_loss_input` reads from a loss function.

    Only `input_type` is required. The others are read with `getattr(loss_fn, name, default)`:

    - `use_fused_linear_logprobs` (bool, default False): `logits` already holds `[B, S']`
      next-token log-probs from a fused linear-cross-entropy forward.
    - `reference_policy_kl_penalty` (float, default 0): when nonzero and a filter is active,
      an unfiltered copy of the log-probs is stored in `data["curr_logprobs_unfiltered"]`.
    - `zero_outside_topk` (bool), `kl_type` (str): top-k distillation options.
    - `opd_full`: the full-vocabulary on-policy-distillation config.
    """

    input_type: LossInputType

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
