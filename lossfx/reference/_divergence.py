"""Dense references of the student/teacher reductions, the CP layout and the OPD_FULL loss inputs."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lossfx.reference._logprobs import log_softmax, next_token_logprobs

__all__ = [
    "cp_shard",
    "cross_entropy_to_fixed",
    "entropy",
    "neg_entropy",
    "opd_full_loss_input",
    "opd_full_teacher_logits",
    "reverse_kl_to_fixed",
]

_F64 = torch.float64


def _expect(student: Tensor, w: Tensor) -> Tensor:
    """`Σ_v p_s w` with `0 · w = 0` where `p_s = 0` (a NaN `p_s` or `w` stays NaN)."""
    p = log_softmax(student).exp()
    live = p != 0  # True where p is NaN: a row with a NaN or +inf logit is NaN, as torch makes it
    return torch.where(live, p * torch.where(live, w, torch.zeros_like(w)), torch.zeros_like(p)).sum(-1)


def neg_entropy(student: Tensor) -> Tensor:
    """`[..., V]` -> `[...]`: `Σ p log p` (≤ 0, the negative entropy) in float64."""
    return _expect(student, log_softmax(student))


def entropy(student: Tensor) -> Tensor:
    """Deprecated name of `neg_entropy` (same value `Σ p log p` ≤ 0; a FutureWarning)."""
    warnings.warn(
        "lossfx.reference.entropy is deprecated: its value is Σ p log p, the NEGATIVE entropy (≤ 0); use "
        "lossfx.reference.neg_entropy for the same value (the entropy is its negation)",
        FutureWarning,
        stacklevel=2,
    )
    return neg_entropy(student)


def cross_entropy_to_fixed(student: Tensor, teacher: Tensor) -> Tensor:
    """`[..., V]`, `[..., V]` -> `[...]`: `−Σ p_s log p_t` in float64 (teacher detached)."""
    return _expect(student, -log_softmax(teacher.detach()))


def reverse_kl_to_fixed(student: Tensor, teacher: Tensor) -> Tensor:
    """`[..., V]`, `[..., V]` -> `[...]`: `Σ p_s (log p_s − log p_t)` in float64 (teacher detached)."""
    return _expect(student, log_softmax(student) - log_softmax(teacher.detach()))


def cp_shard(x: Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> Tensor:
    """Load-balanced CP layout: chunks `r` and `2C−1−r` of `2C` equal chunks along `seq_dim`
    (its length a multiple of `2C`)."""
    if cp_size == 1:
        return x
    lead = " ".join(f"a{i}" for i in range(seq_dim % x.dim()))  # the dims before the sequence dim
    chunks = rearrange(x, f"{lead} (k n) ... -> k {lead} n ...", k=2 * cp_size)
    return rearrange(chunks[[cp_rank, 2 * cp_size - 1 - cp_rank]], f"two {lead} n ... -> {lead} (two n) ...")


def opd_full_teacher_logits(
    payload: Tensor,
    seq_len: int,
    *,
    teacher_payload: str,
    weights: dict[int, Tensor] | None = None,
    teacher_index: Tensor | None = None,
) -> Tensor:
    """Full-vocabulary canonical teacher logits `[B, seq_len, V]` in float64 from the payload.

    Logits payload: zero-padded along the sequence. Hidden states: row `b` goes through
    `weights[teacher_index[b]]` (or the only weight), as `h.to(W.dtype).to(f64) @ W.to(f64)ᵀ`.
    """
    pad = seq_len - payload.shape[1]
    payload = torch.nn.functional.pad(payload, (0, 0, 0, pad))
    if teacher_payload == "logits":
        return payload.to(_F64)
    if not weights:
        raise ValueError("hidden-state payloads need at least one LM-head weight")
    rows = []
    for b in range(payload.shape[0]):
        key = next(iter(weights)) if teacher_index is None else int(teacher_index[b])
        w = weights[key]
        rows.append(payload[b].to(w.dtype).to(_F64) @ w.to(_F64).T)
    return torch.stack(rows)


def opd_full_loss_input(
    student: Tensor,
    teacher: Tensor,
    input_ids: Tensor,
    *,
    validate_decomposition: bool = False,
    reference_policy_kl_penalty: float = 0.0,
) -> dict[str, Any]:
    """OPD_FULL outputs from dense canonical `student`, `teacher` `[B, S', V]` (`S' ≥ S`)."""
    width = input_ids.shape[1] - 1
    s, t = student[:, :width], teacher[:, :width]
    out: dict[str, Any] = {
        "opd_full_divergence": reverse_kl_to_fixed(s, t),
        "opd_full_entropy": neg_entropy(s).detach() if validate_decomposition else None,
        "opd_full_cross_entropy": cross_entropy_to_fixed(s, t).detach() if validate_decomposition else None,
    }
    if reference_policy_kl_penalty != 0:
        out["next_token_logprobs"] = next_token_logprobs(student[:, : width + 1], input_ids)
    return out
