"""Pure: the packed-sequence layout and the packed next-token log-probs.

Sequence `i` occupies the padded slots `[cu_p[i], cu_p[i+1])` of the canonical packed row of
length `T = cu_p[-1]`; under context parallelism of size `C` each sequence is load-balanced on
its own and rank `r`'s packed logits `[1, T/C, Vl]` concatenate its parts of every sequence
(`lossfx.packing` documents the layout and the pipeline).

Plain tensors in: `cu_seqlens` already validated by the public boundary (`lossfx.packing`,
`lossfx.prepare_packed_loss_input`: types, values, the packed length, the ids in range, read
once), a `VocabRange` resolved there. Nothing here validates; the index maps are tensor ops
only (`searchsorted`, integer arithmetic), so nothing depends on Python values of the layout.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lossfx._core.distributed import ProcessGroup, all_gather_stack_summed_grad, group_rank, group_size
from lossfx._core.vocab import VocabRange
from lossfx._kernels.filtering import filtered_token_logprobs
from lossfx._kernels.logprobs import token_logprobs
from lossfx._layouts.sequence_layout import SequenceLayout, score_next_tokens

__all__ = ["PackedLayout", "cu_tensor", "packed_next_token_logprobs", "scored_slots"]


def cu_tensor(cu: Any, device: torch.device) -> Tensor:
    """Checked `cu_seqlens` (a sequence of ints or a 1-D integer tensor) as int64 `[B+1]` on `device`."""
    if isinstance(cu, Tensor):
        return cu.to(device=device, dtype=torch.int64)
    return torch.tensor(list(cu), dtype=torch.int64, device=device)


def scored_slots(width: int, cu_q: Tensor, cu_p: Tensor, prepacked: bool) -> Tensor:
    """Which entries of the ids `[B, S]` (`width = S`) a packed call scores: each sequence's tokens
    after its first, `1 <= t < min(len_b, padded_b)`; pre-packed `[1, T]` (`width = T`): the
    slots `cu_p[i] < t < cu_p[i+1]`. Bool, `[B, S]` or `[1, T]`."""
    position = torch.arange(width, device=cu_p.device)[None, :]  # [1, S]
    if prepacked:
        return ((position > cu_p[:-1, None]) & (position < cu_p[1:, None])).any(dim=0, keepdim=True)
    length = torch.minimum(cu_q[1:] - cu_q[:-1], cu_p[1:] - cu_p[:-1])  # [B]
    return (position >= 1) & (position < length[:, None])


def _slot_of_local(cu_p: Tensor, local_len: int, cp_rank: int, cp_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each local slot `[T/C]`: its sequence, its position in that sequence, the padded length."""
    n_seqs = cu_p.shape[0] - 1
    q = torch.arange(local_len, device=cu_p.device)
    seg = torch.searchsorted(cu_p[1:] // cp_size, q, right=True).clamp(max=max(n_seqs - 1, 0))  # [T/C]
    padded_len = cu_p[seg + 1] - cu_p[seg]  # [T/C]
    lo = q - cu_p[seg] // cp_size  # position inside this rank's part of the sequence
    if cp_size == 1:
        return seg, lo, padded_len
    half = padded_len // (2 * cp_size)  # each of the rank's two chunks
    first = cp_rank * half + lo
    second = (2 * cp_size - 1 - cp_rank) * half + (lo - half)
    return seg, torch.where(lo < half, first, second), padded_len


def _local_of_canonical(cu_p: Tensor, local_len: int, cp_size: int) -> Tensor:
    """For each canonical slot `[T]`: its index in the rank-major gathered `[C·T/C]` local slots."""
    n_seqs = cu_p.shape[0] - 1
    p = torch.arange(local_len * cp_size, device=cu_p.device)
    if cp_size == 1:
        return p
    seg = torch.searchsorted(cu_p[1:], p, right=True).clamp(max=max(n_seqs - 1, 0))
    offset, j = cu_p[seg], p - cu_p[seg]
    half = ((cu_p[seg + 1] - offset) // (2 * cp_size)).clamp_min(1)  # a slot's sequence is non-empty
    chunk = j // half
    owner = torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)
    lo = torch.where(chunk < cp_size, j - chunk * half, half + j - chunk * half)
    return owner * local_len + offset // cp_size + lo


def _local_targets(
    input_ids: Tensor,
    cu_q: Tensor,
    cu_p: Tensor,
    seg: Tensor,
    j: Tensor,
    padded_len: Tensor,
    prepacked: bool,
    fill: int = 0,
) -> Tensor:
    """Next-token target of every local slot, within its own sequence (`fill` where there is none)."""
    nxt = j + 1
    if prepacked:  # input_ids is the physical packed row [1, T]
        has_next = nxt < padded_len
        position = (cu_p[seg] + nxt).clamp(max=input_ids.shape[1] - 1)
        return torch.where(has_next, input_ids[0, position], torch.full_like(position, fill))
    width = input_ids.shape[1]
    real_len = torch.clamp(cu_q[seg + 1] - cu_q[seg], max=width)  # bin padding may exceed the row
    has_next = (nxt < real_len) & (nxt < padded_len)
    token = input_ids[seg, nxt.clamp(max=width - 1)]
    return torch.where(has_next, token, torch.full_like(token, fill))


class PackedLayout(SequenceLayout):
    """Packed rows as a sequence layout: the canonical packed row `[1, T, ...]`
    (`T = cu_seqlens_q_padded[-1]`) and this rank's `[1, T/C, ...]`, each sequence load-balanced
    on its own over `cp_group` (`C` ranks; `None`: the local row is the canonical one).

    `to_local` / `to_canonical` map slots through the index maps above (tensor ops only);
    `to_canonical` is one all-gather whose backward sums the upstream gradients over CP ranks
    (divide the loss by `C`). The next-token targets shift **within each sequence**, and the
    outputs are the unpacked `[B, S−1]` rows (or the packed `[1, T−1]` row, each sequence's last
    slot 0, when `prepacked`). Pure: `cu_seqlens` must be checked already (the public
    `lossfx.packing.PackedLayout.check_covers` checks them at the boundary).
    """

    def __init__(self, cu_seqlens_q: Any, cu_seqlens_q_padded: Any, cp_group: ProcessGroup | None, prepacked: bool):
        self.cu_seqlens_q, self.cu_seqlens_q_padded = cu_seqlens_q, cu_seqlens_q_padded
        self.cp_group, self.prepacked = cp_group, prepacked
        self.cp_size, self.cp_rank = group_size(cp_group), group_rank(cp_group)
        self.describe = f"packed sequences over {self.cp_size} context-parallel ranks"

    def local_len(self, seq: int) -> int | None:
        """`T/C` (the packed row's length is `cu_seqlens_q_padded[-1]`, whatever `seq`)."""
        return int(self.cu_seqlens_q_padded[-1]) // self.cp_size

    def _cu(self, device: torch.device) -> tuple[Tensor, Tensor]:
        return cu_tensor(self.cu_seqlens_q, device), cu_tensor(self.cu_seqlens_q_padded, device)

    def to_local(self, x: Tensor, local_len: int, fill: float = 0) -> Tensor:
        _, cu_p = self._cu(x.device)
        seg, j, _ = _slot_of_local(cu_p, local_len, self.cp_rank, self.cp_size)  # [T/C] each
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, max(local_len * self.cp_size - x.shape[1], 0)])
        return x[:, cu_p[seg] + j]  # [1, T/C, ...]

    def to_canonical(self, x: Tensor, length: int | None = None) -> Tensor:
        _, cu_p = self._cu(x.device)
        stacked = all_gather_stack_summed_grad(x, self.cp_group)  # [C, 1, T/C, ...]
        gathered = rearrange(stacked, "c b t ... -> b (c t) ...")  # the ranks' rows, rank-major
        return gathered[:, _local_of_canonical(cu_p, x.shape[1], self.cp_size)][:, :length]  # [1, T, ...]

    def next_token_targets(
        self, input_ids: Tensor, local_len: int, *, fill: int = 0, position_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """`[1, T/C]`: slot `j` of a sequence scores its token `j+1` (`fill` where there is none)."""
        cu_q, cu_p = self._cu(input_ids.device)
        seg, j, padded_len = _slot_of_local(cu_p, local_len, self.cp_rank, self.cp_size)
        return _local_targets(input_ids, cu_q, cu_p, seg, j, padded_len, self.prepacked, fill).unsqueeze(0), None

    def next_token_outputs(self, local: Tensor, input_ids: Tensor, ends: Tensor | None) -> Tensor:
        """`[1, T/C]` -> `[B, S−1]` (row `i`: sequence `i`'s slots, 0 past its padded length), or
        `[1, T−1]` (each sequence's last slot 0) when `prepacked`."""
        _, cu_p = self._cu(local.device)
        canonical = self.to_canonical(local)[0]  # [T]
        total, n_seqs = canonical.shape[0], cu_p.shape[0] - 1
        slot = torch.arange(total, device=local.device)
        if self.prepacked:
            seq_of_slot = torch.searchsorted(cu_p[1:], slot, right=True).clamp(max=max(n_seqs - 1, 0))
            is_last = slot == cu_p[seq_of_slot + 1] - 1
            packed = torch.where(is_last, torch.zeros_like(canonical), canonical)
            return packed[: max(total - 1, 0)].unsqueeze(0)  # [1, T−1]
        t = torch.arange(max(input_ids.shape[1] - 1, 0), device=local.device)  # [S−1]
        position = cu_p[:-1, None] + t  # [B, S−1]
        valid = t < (cu_p[1:] - cu_p[:-1] - 1)[:, None]
        values = canonical[position.clamp(max=max(total - 1, 0))] if total > 0 else position.to(canonical.dtype)
        return torch.where(valid, values, torch.zeros_like(values))


def packed_next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    layout: PackedLayout,
    vocab: VocabRange,
    *,
    top_k: int | None = None,
    top_p: float = 1.0,
    ties: str = "together",
    chunk_rows: int | None = None,
) -> Tensor:
    """logits `[1, T/C, Vl]` (this rank's vocabulary columns `vocab` and CP part), input_ids `[B, S]`
    (or `[1, T]` when `layout.prepacked`) -> `[B, S−1]` (or `[1, T−1]`) in the compute dtype.

    Dense equivalent: ``lossfx.reference.packed_next_token_logprobs(full_packed_logits, input_ids,
    cu_seqlens_q, cu_seqlens_q_padded)`` (its filtered twin with `top_k` (`None`: off) or
    `top_p < 1`). The scored ids must lie in `[0, vocab.size)`; targets without a next token
    score id 0 and are dropped.
    """
    filtered, rows = top_k is not None or top_p < 1.0, chunk_rows

    def kernel(target: Tensor) -> list[Tensor]:  # [1, T/C] -> [1, T/C]: this rank's [T/C, Vl] logits
        if filtered:
            out = filtered_token_logprobs(logits, target, vocab, top_k=top_k, top_p=top_p, ties=ties, chunk_rows=rows)
            return [out]
        return [token_logprobs(logits, target, vocab, chunk_rows=rows)]

    (out,) = score_next_tokens(layout, input_ids.to(logits.device), logits.shape[1], kernel)
    return out
