"""Pure: next-token log-probs over a sequence layout.

    out[b, t] = log p(input_ids[b, t+1] | logits[b, t])          t < S − 1

Plain tensors, a `SequenceLayout`, this rank's `VocabRange` and resolved options in; every
argument was validated by the public boundary (`lossfx.next_token`, `lossfx.loss_input`): ids in
range, shapes that the layout covers, a filter's `top_k` / `top_p` / `ties` checked. The pipeline
is the layout's (`score_next_tokens`: shift the canonical ids, lay them out like the logits, the
per-token kernel, gather back, drop the last column); the per-token kernel is
`lossfx._kernels.logprobs.token_logprobs`, or `lossfx._kernels.filtering.filtered_token_logprobs`
under a top-k/top-p filter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lossfx._core.vocab import VocabRange
from lossfx._kernels import filtering as _filtering
from lossfx._kernels import logprobs as _logprobs
from lossfx._layouts.sequence_layout import SequenceLayout, score_next_tokens

__all__ = ["TopKTopP", "next_token_logprobs", "target_logprobs"]


class TopKTopP(NamedTuple):
    """A resolved, enabled top-k/top-p filter: `top_k` an int > 0 or `None`, `top_p` in `(0, 1]`,
    `ties` `"together"` or `"sorted"` (`lossfx.filtering`)."""

    top_k: int | None
    top_p: float
    ties: str = "together"


def target_logprobs(
    logits: Tensor, target: Tensor, vocab: VocabRange, *, top: TopKTopP | None = None, chunk_rows: int | None = None
) -> Tensor:
    """logits `[..., Vl]`, target `[...]` global ids in `[0, vocab.size)` -> `[...]` in the compute dtype.

    Dense: ``log_softmax(z, -1).gather(-1, target[..., None])[..., 0]`` on the full-vocabulary
    logits, with `z = where(keep, z, -inf)` under a filter `top` (`-inf` where the target is
    filtered out).
    """
    if top is None:
        return _logprobs.token_logprobs(logits, target, vocab, chunk_rows=chunk_rows)
    return _filtering.filtered_token_logprobs(
        logits, target, vocab, top_k=top.top_k, top_p=top.top_p, chunk_rows=chunk_rows, ties=top.ties
    )


def next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    layout: SequenceLayout,
    vocab: VocabRange,
    *,
    top: TopKTopP | None = None,
    chunk_size: int | None = None,
    position_ids: Tensor | None = None,
    ignore_index: int | None = None,
) -> Tensor:
    """logits `[B, S_l, Vl]` (this rank's vocabulary and sequence part), input_ids `[B, S]`
    canonical -> `[B, S−1]` in the compute dtype, replicated over the layout's ranks.

    Dense (no parallelism): ``reference.next_token_logprobs(logits, input_ids)``, or its filtered
    twin under `top`. `chunk_size`: sequence positions per eager chunk. `position_ids [B, S]`:
    each padding-free sequence's last position gives 0 with a zero gradient. `ignore_index`:
    positions `t` with `input_ids[:, t+1] == ignore_index` give 0 with a zero gradient.
    """
    ignored = None
    if ignore_index is not None:
        ignored = input_ids[:, 1:] == ignore_index  # [B, S-1]
        input_ids = input_ids.masked_fill(input_ids == ignore_index, 0)  # any valid id; replaced below
    rows = None if chunk_size is None else chunk_size * input_ids.shape[0]

    def kernel(target: Tensor) -> list[Tensor]:  # [B, S_l] -> [B, S_l]
        return [target_logprobs(logits, target, vocab, top=top, chunk_rows=rows)]

    (out,) = score_next_tokens(layout, input_ids.to(logits.device), logits.shape[1], kernel, position_ids=position_ids)
    return out if ignored is None else torch.where(ignored.to(out.device), torch.zeros_like(out), out)
