"""Pure: OPD_FULL from hidden states over a sequence layout, the student's (and the teacher's) logits never held.

    z_s[b, t]            = head(hidden[b, t] @ weight.T + head.bias)            (this rank's Vl columns)
    z_t[b, t]            = payload[b, t, start : start + Vl]             (logits payload)
                         = payload[b, t] @ heads[position[b]].T           (hidden-states payload)
    opd_full_divergence  = KL(p_s ‖ p_t)[:, :S−1]   (+ Σ p_s log p_s, −Σ p_s log p_t as metrics)
    next_token_logprobs  = log p_s(input_ids[:, t+1] | t)                  (the reference-KL term)

The twin of `lossfx._layouts.opd_full.opd_full_loss_input` with `z_s` formed tile by tile: the
three quantities come from one call of the fused divergence kernel
(`lossfx._kernels.linear_divergence`: one `[C, Cv]` tile of each side alive), the log-probs from the
fused next-token pipeline (`lossfx._layouts.linear_next_token`). Plain tensors, a `SequenceLayout`
and a `VocabRange` in; the boundary (`lossfx.linear_loss_input`) has validated everything.
Dense equivalent: `lossfx.reference.prepare_linear_loss_input` (`OPD_FULL`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels import linear_divergence as _divergence
from lossfx._layouts import linear_next_token as _next_token
from lossfx._layouts.opd_full import align_payload
from lossfx._layouts.sequence_layout import SequenceLayout

__all__ = ["linear_opd_full_loss_input"]


def linear_opd_full_loss_input(
    hidden: Tensor,
    weight: Tensor,
    payload: Tensor,
    input_ids: Tensor | None,
    layout: SequenceLayout,
    vocab: VocabRange,
    *,
    head: HeadOptions,
    columns: tuple[int, int] | None,
    heads: list[Tensor] | None,
    position: Tensor | None,
    teacher_logits_dtype: torch.dtype | None,
    validate_decomposition: bool,
    chunk_rows: int,
    seq: int,
    count: list[int] | None = None,
) -> dict[str, Tensor | None]:
    """hidden `[B, S_l, H]` (this rank's part in `layout`), this rank's head rows `weight [Vl, H]`
    and the canonical teacher `payload [B, S_p, D]` -> the OPD_FULL dict, each `[B, S−1]` canonical.

    The teacher: a logits payload cut to `columns = (start, Vl)` (a view, never copied without
    context parallelism), or hidden states through `heads` (`[Vl, H_t]`, row `b` through
    `heads[position[b]]`, products rounded to `teacher_logits_dtype`, default the heads' dtype).
    `input_ids [B, S]` adds `next_token_logprobs` (`None`: not asked). Gradients reach `hidden`,
    `weight`, `head.bias` through the divergence (and the log-probs); entropy and cross-entropy are
    detached metrics, as on the logits path. `seq` is the canonical `S`; `count`: the log-probs'
    active rows, deferred by the caller (`linear_next_token_logprobs`'s `count`).
    """
    batch, local_len = hidden.shape[0], hidden.shape[1]
    if columns is not None:
        payload = payload.narrow(-1, columns[0], columns[1])  # [B, S_p, Vl], a view
    local = align_payload(payload, local_len, layout, canonical_len=seq).to(hidden.device).detach()
    fused = _divergence.linear_divergence_to_teacher
    if heads is None:
        kl, ce, ne = fused(
            hidden,
            weight,
            vocab.group,
            teacher_logits=local,
            logits_dtype=local.dtype,
            head=head,
            chunk_rows=chunk_rows,
        )
    else:
        row_head = None if position is None else position[:, None].expand(batch, local_len)  # [B, S_l]
        kl, ce, ne = fused(
            hidden,
            weight,
            vocab.group,
            teacher_hidden=local,
            teacher_weights=heads,
            teacher_head=row_head,
            logits_dtype=heads[0].dtype if teacher_logits_dtype is None else teacher_logits_dtype,
            head=head,
            chunk_rows=chunk_rows,
        )
    # canonical order (under lossfx's CP layout the gradient is summed over CP ranks), cut to the
    # next-token width: student and teacher at t both predict t+1 (no shift between them)
    width = max(seq - 1, 0)
    out: dict[str, Tensor | None] = {
        "opd_full_divergence": layout.to_canonical(kl, width),
        "opd_full_entropy": layout.to_canonical(ne.detach(), width) if validate_decomposition else None,
        "opd_full_cross_entropy": layout.to_canonical(ce.detach(), width) if validate_decomposition else None,
    }
    if input_ids is not None:
        (out["next_token_logprobs"],) = _next_token.linear_next_token_logprobs(
            hidden, weight, input_ids, layout, vocab, head=head, chunk_rows=chunk_rows, count=count
        )
    return out
