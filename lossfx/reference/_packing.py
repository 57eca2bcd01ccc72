"""Dense reference of packed next-token log-probs: one sequence at a time, canonical order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lossfx.reference._divergence import cp_shard
from lossfx.reference._filtering import filtered_token_logprobs
from lossfx.reference._logprobs import token_logprobs

_F64 = torch.float64


def packed_next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    cu_seqlens_q: Sequence[int],
    cu_seqlens_q_padded: Sequence[int],
    *,
    prepacked: bool = False,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> Tensor:
    """Canonical packed `[1, T, V]` logits -> `[B, S-1]` (or `[1, T-1]` when `prepacked`).

    Sequence `i` fills slots `[cu_padded[i], cu_padded[i+1])`; its tokens are
    `input_ids[i, :min(len_i, S)]` then zeros (or the packed row itself when `prepacked`); slot `j`
    scores its own token `j+1`. Unpacked rows keep the first `padded_len − 1` results (0 after);
    the packed layout sets each sequence's last slot to 0.
    """
    cu_q, cu_p = [int(c) for c in cu_seqlens_q], [int(c) for c in cu_seqlens_q_padded]
    pieces = []
    for i in range(len(cu_p) - 1):
        start, end = cu_p[i], cu_p[i + 1]
        if prepacked:
            tokens = input_ids[0, start:end]
        else:
            real = min(cu_q[i + 1] - cu_q[i], input_ids.shape[1])
            tokens = torch.cat([input_ids[i, :real], input_ids.new_zeros(end - start - real)])
        target = torch.cat([tokens[1:], tokens.new_zeros(min(1, end - start))])  # last: placeholder
        seq_logits = logits[0, start:end]
        if (top_k is not None and top_k > 0) or top_p != 1.0:
            lp = filtered_token_logprobs(seq_logits, target, top_k, top_p)
        else:
            lp = token_logprobs(seq_logits, target)
        if prepacked and end > start:
            lp = torch.cat([lp[:-1], lp.new_zeros(1)])
        pieces.append(lp)
    canonical = torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=_F64)
    if prepacked:
        return canonical[: max(canonical.shape[0] - 1, 0)].unsqueeze(0)
    width = input_ids.shape[1]
    rows = []
    for i in range(len(cu_p) - 1):
        n = max(0, min(cu_p[i + 1] - cu_p[i] - 1, width - 1))
        row = canonical[cu_p[i] : cu_p[i] + n]
        rows.append(torch.cat([row, row.new_zeros(width - 1 - n)]))
    return torch.stack(rows)


def packed_cp_shard(x: Tensor, cu_seqlens_q_padded: Sequence[int], cp_rank: int, cp_size: int) -> Tensor:
    """Canonical packed `[1, T, ...]` -> CP rank `cp_rank`'s `[1, T/C, ...]`: every sequence's
    padded slots `[cu_padded[i], cu_padded[i+1])` in the load-balanced layout on their own
    (`cp_shard`), concatenated in sequence order."""
    cu_p = [int(c) for c in cu_seqlens_q_padded]
    return torch.cat([cp_shard(x[:, a:b], cp_rank, cp_size) for a, b in zip(cu_p[:-1], cu_p[1:])], dim=1)
