"""Dense reference of the hidden-state front door: form the float64 logits, then the logits branch.

prepare_linear_loss_input(hidden, W, data, loss_fn) = prepare_*_input(linear_logits(hidden, W, ...), ...)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lossfx.reference._distillation import prepare_distillation_input, prepare_draft_input
from lossfx.reference._divergence import opd_full_loss_input, opd_full_teacher_logits
from lossfx.reference._filtering import prepare_filtered_logprob_input
from lossfx.reference._linear import linear_logits
from lossfx.reference._logprobs import next_token_logprobs
from lossfx.reference._packing import packed_next_token_logprobs

__all__ = ["prepare_linear_loss_input", "prepare_linear_packed_loss_input"]


def prepare_linear_loss_input(
    hidden: Tensor,
    weight: Tensor,
    data: dict[str, Any],
    loss_fn: Any,
    *,
    d2t: Tensor | None = None,
    top_k: int | None = None,
    top_p: float = 1.0,
    ties: str = "together",
    bias: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> dict[str, Any]:
    """Canonical `hidden [B, S, H]`, full `weight [V, H]`, `bias [V]` -> the loss-input dict of
    `LOGPROB` (filtered when `top_k` / `top_p < 1`: the unfiltered copy is dropped),
    `DISTILLATION`, `DRAFT` or `OPD_FULL` (`loss_fn.opd_full`; the teacher from `data`'s payload,
    full-vocabulary logits or hidden states through `teacher_output_layer_weight_by_index`'s full
    `[V, H_t]` heads) on the float64 logits ``linear_logits(hidden, weight, ...)``."""
    z = linear_logits(hidden, weight, temperature, bias, logit_scale, softcap)  # [B, S, V] float64
    input_type = getattr(loss_fn.input_type, "value", loss_fn.input_type)
    if input_type == "logprob":
        if top_k is not None or top_p < 1.0:
            return prepare_filtered_logprob_input(z, data, loss_fn, top_k, top_p, ties)[0]
        return {"next_token_logprobs": next_token_logprobs(z, data["input_ids"])}
    if input_type == "distillation":
        return prepare_distillation_input(z, data, loss_fn)
    if input_type == "draft":
        return prepare_draft_input(z, data, d2t)
    if input_type == "opd_full":
        cfg, seq = loss_fn.opd_full, data["input_ids"].shape[1]
        kind = getattr(cfg, "teacher_payload", "hidden_states")
        payload = data["teacher_full_logits" if kind == "logits" else "teacher_full_hidden_states"]
        teacher = opd_full_teacher_logits(
            payload[..., : z.shape[-1]] if kind == "logits" else payload,
            z.shape[1],
            teacher_payload=kind,
            weights=teacher_output_layer_weight_by_index,
            teacher_index=data.get("opd_full_teacher_index"),
        )
        return opd_full_loss_input(
            z,
            teacher,
            data["input_ids"][:, :seq],
            validate_decomposition=bool(getattr(cfg, "validate_decomposition", False)),
            reference_policy_kl_penalty=getattr(loss_fn, "reference_policy_kl_penalty", 0.0),
        )
    raise ValueError(f"reference.prepare_linear_loss_input has no branch for {input_type!r}")


def prepare_linear_packed_loss_input(
    hidden: Tensor,
    weight: Tensor,
    input_ids: Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_q_padded: Any,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """Canonical packed `hidden [1, T, H]` -> `packed_next_token_logprobs` of its float64 logits."""
    z = linear_logits(hidden, weight, temperature, bias, logit_scale, softcap)
    return packed_next_token_logprobs(z, input_ids, cu_seqlens_q, cu_seqlens_q_padded)
