"""Pure: the OPD_FULL teacher (aligned, projected) and the OPD_FULL quantities over a sequence layout.

    teacher[b, t]        = payload[b, t, start : start + Vl]        (logits payload)
                         = hidden[b, t] @ heads[position[b]]ᵀ        (hidden-states payload)
    opd_full_divergence  = KL(p_s ‖ p_t)[:, :S−1]      (+ Σ p_s log p_s, −Σ p_s log p_t as metrics)
    next_token_logprobs  = log p_s(input_ids[:, t+1] | t)            (the reference-KL term)

Plain tensors, a `SequenceLayout` and a `VocabRange` in; the public boundary (`lossfx.opd_full`,
`lossfx.loss_input`) has unwrapped the DTensors, validated the payload, the heads and the ids and
resolved every option. Below: `lossfx._kernels.divergence` and the pure next-token layout
`lossfx._layouts.next_token`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lossfx._core.distributed import ProcessGroup
from lossfx._core.host_reads import tracing
from lossfx._core.vocab import VocabRange
from lossfx._kernels import divergence as _divergence
from lossfx._layouts import next_token as _next_token
from lossfx._layouts.sequence_layout import SequenceLayout

__all__ = [
    "ProjectedTeacher",
    "align_payload",
    "aligned_payload",
    "opd_full_loss_input",
    "project_per_teacher",
    "teacher_logits",
]


@dataclass(frozen=True)
class ProjectedTeacher:
    """The teacher as aligned hidden states `[B, S_l, H]`, LM-head shards `[Vl, H]` (one shape and
    dtype) and each row's position in `heads` (`[B]`, or `None` with one head)."""

    hidden: Tensor
    heads: list[Tensor]
    position: Tensor | None


def align_payload(payload: Tensor, local_len: int, layout: SequenceLayout, canonical_len: int | None = None) -> Tensor:
    """Canonical `payload [B, S_p, D]` -> this rank's `[B, S_l, D]` in `layout`, zero-padded (zero
    logits or zero hidden states: a uniform teacher). A layout that pads by itself (an external
    sharder) gets the payload zero-padded or cut to `canonical_len` first, when given.

    Dense equivalent (no CP): ``torch.nn.functional.pad(payload, (0, 0, 0, S_l - S_p))``.
    """
    if layout.window(local_len) is None and canonical_len is not None and payload.shape[1] != canonical_len:
        payload = torch.nn.functional.pad(payload, (0, 0, 0, canonical_len - payload.shape[1]))
    return layout.to_local(payload, local_len)  # [B, S_l, D]


def project_per_teacher(
    hidden: Tensor, heads: list[Tensor], position: Tensor | None, output_dtype: torch.dtype | None
) -> Tensor:
    """Row `b` of `hidden [B, S, H]` through `heads[position[b]]` -> `[B, S, Vl]` (materialised).

    Dense equivalent: ``torch.stack([hidden[b] @ heads[position[b]].T for b in range(B)])`` (see
    `lossfx._kernels.divergence.project_onto_lm_head` for the dtypes).
    """
    project = _divergence.project_onto_lm_head
    if position is None:
        return project(hidden, heads[0], output_dtype)
    if tracing():  # no value-dependent shapes in a graph: project all, select
        out = project(hidden, heads[0], output_dtype)
        for k, weight in enumerate(heads[1:], start=1):
            out = torch.where((position == k)[:, None, None], project(hidden, weight, output_dtype), out)
        return out
    out = hidden.new_empty((*hidden.shape[:-1], heads[0].shape[0]), dtype=output_dtype or heads[0].dtype)
    for k, weight in enumerate(heads):
        rows = position == k  # [B]
        out[rows] = project(hidden[rows], weight, output_dtype)
    return out


def aligned_payload(
    payload: Tensor,
    layout: SequenceLayout,
    local_len: int,
    device: torch.device,
    *,
    columns: tuple[int, int] | None = None,
    canonical_len: int | None = None,
) -> Tensor:
    """This rank's `[B, S_l, D]` part of the canonical payload `[B, S_p, D]`, contiguous on `device`
    (`align_payload`); a logits payload cut to this rank's `columns = (start, Vl)` window first."""
    if columns is not None:
        payload = payload.narrow(-1, columns[0], columns[1])  # [B, S_p, Vl]
    return align_payload(payload, local_len, layout, canonical_len).contiguous().to(device)


def teacher_logits(
    payload: Tensor,
    layout: SequenceLayout,
    local_len: int,
    device: torch.device,
    *,
    columns: tuple[int, int] | None = None,
    heads: list[Tensor] | None = None,
    position: Tensor | None = None,
    output_dtype: torch.dtype | None = None,
) -> Tensor:
    """This rank's teacher logits `[B, S_l, Vl]` on `device` from the canonical payload `[B, S_p, D]`:
    a logits payload's `columns` window (its dtype kept), or hidden states through `heads` (each
    row's `position`, `project_per_teacher`). Dense equivalent (no TP, no CP, logits payload):
    ``torch.nn.functional.pad(payload, (0, 0, 0, S_l - S_p))``.
    """
    local = aligned_payload(payload, layout, local_len, device, columns=columns)
    return local if heads is None else project_per_teacher(local, heads, position, output_dtype)


def opd_full_loss_input(
    student: Tensor,
    payload: Tensor,
    seq: int,
    layout: SequenceLayout,
    group: ProcessGroup | None,
    *,
    columns: tuple[int, int] | None = None,
    heads: list[Tensor] | None = None,
    position: Tensor | None = None,
    validate_decomposition: bool,
    chunk_rows: int | None,
    teacher_logits_dtype: torch.dtype | None,
    logprobs: tuple[Tensor, Tensor, VocabRange, int | None] | None = None,
) -> dict[str, Tensor | None]:
    """The OPD_FULL outputs `[B, S−1]` in canonical order from this rank's `student [B, S_l, Vl]`
    and the canonical teacher `payload [B, S_p, D]` (`seq` the canonical `S`): a logits payload
    cut to `columns`, or hidden states through `heads` (each row's `position`), projected chunk
    by chunk inside the divergence (never `[B, S_l, Vl]`).

    `logprobs = (logits [B, S_l, Vl'], input_ids [B, S], vocab, chunk_size)` adds the unfiltered
    `next_token_logprobs` (the reference-KL term, `lossfx._layouts.next_token`; `chunk_size`:
    sequence positions per eager chunk). Dense equivalent:
    `lossfx.reference.opd_full_loss_input`. The divergence is differentiable in the student; the
    decomposition (`opd_full_entropy`, `opd_full_cross_entropy`) is computed without autograd.
    """
    local = aligned_payload(payload, layout, student.shape[1], student.device, columns=columns, canonical_len=seq)
    teacher = local if heads is None else ProjectedTeacher(local, heads, position)

    def divergence_to_teacher(kind: str) -> Tensor:  # [B, S_l]
        if isinstance(teacher, ProjectedTeacher):
            head = None
            if teacher.position is not None:  # each row's head, for every position of the row
                head = teacher.position[:, None].expand(student.shape[:-1])  # [B, S_l]
            dtype = teacher.heads[0].dtype if teacher_logits_dtype is None else teacher_logits_dtype
            return _divergence.divergence_to_projected_teacher(
                kind, student, teacher.hidden, teacher.heads, head, group, chunk_rows=chunk_rows, logits_dtype=dtype
            )
        fn = _divergence.reverse_kl_to_fixed if kind == "reverse_kl" else _divergence.cross_entropy_to_fixed
        return fn(student, teacher.detach(), group, chunk_rows=chunk_rows)

    divergence = divergence_to_teacher("reverse_kl")  # [B, S_l]
    ent = ce = None
    if validate_decomposition:
        with torch.no_grad():
            ent = _divergence.neg_entropy(student, group, chunk_rows=chunk_rows)  # [B, S_l]
            ce = divergence_to_teacher("cross_entropy")  # [B, S_l]
    # canonical order (under lossfx's CP layout the gradient is summed over CP ranks), cut to the
    # next-token width: student and teacher at t both predict t+1 (no shift between them)
    width = max(seq - 1, 0)
    out: dict[str, Tensor | None] = {
        "opd_full_divergence": layout.to_canonical(divergence, width),
        "opd_full_entropy": None if ent is None else layout.to_canonical(ent, width),
        "opd_full_cross_entropy": None if ce is None else layout.to_canonical(ce, width),
    }
    if logprobs is not None:
        logits, input_ids, vocab, chunk_size = logprobs
        out["next_token_logprobs"] = _next_token.next_token_logprobs(
            logits, input_ids, layout, vocab, chunk_size=chunk_size
        )
    return out
