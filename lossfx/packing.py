"""Packed sequences: several sequences in one row, each sharded for context parallelism on its own.

Layout. Sequence `i` occupies the padded slots `[cu_padded[i], cu_padded[i+1])` of a canonical
packed row of length `T = cu_padded[-1]`; its real tokens are `input_ids[i, :min(len_i, S)]`
(`len_i = cu[i+1] − cu[i]`, clamped to the row width because a packer may fold bin padding into
the last sequence's length), the rest of its slots are padding (token 0). Under context
parallelism of size `C` every padded length is a multiple of `2C` and each sequence is sharded
on its own in the load-balanced layout; rank `r`'s packed logits `[1, T/C, Vl]` concatenate its
parts of every sequence.

`PackedLayout` is this layout as a `lossfx.sequence_layout.SequenceLayout`, and
`packed_next_token_logprobs` runs the one next-token pipeline (`score_next_tokens`) with it:

1. index maps from `cu_seqlens` with tensor ops only (`searchsorted`, integer arithmetic), so
   nothing in the graph depends on Python values of the layout: for each local slot its
   sequence `seg` and position `j` in it; for each canonical slot the rank and local slot holding it;
2. per-sequence next-token targets: slot `j` scores token `j+1` **of its own sequence** (never the
   next sequence's first token; the last slot's target is a placeholder whose result is dropped);
3. the token log-prob kernel on the local `[T/C, Vl]` logits (tensor parallel, chunked,
   optionally filtered);
4. one all-gather over the CP group (gradient summed over CP ranks: divide the loss by `C`) and a
   gather into canonical packed order, then either the unpacked `[B, S−1]` view or the packed
   physical `[1, T−1]` layout with each sequence's last slot set to 0.

The boundary: `packed_next_token_logprobs` (and `lossfx.prepare_packed_loss_input`) validate
once (types, shapes, `cu_seqlens` values and the scored ids, read together in one host read),
resolve this rank's `VocabRange` and the filter, then call the pure pipeline
`lossfx._layouts.packing.packed_next_token_logprobs` once. The index maps and the pure
`PackedLayout` live in `lossfx._layouts.packing`; `PackedLayout` here adds the boundary's
`cu_seqlens` check (`check_covers`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lossfx._boundary.consistency import boundary
from lossfx._boundary.validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
    values_checkable,
)
from lossfx._core import host_reads as _host_reads
from lossfx._core.distributed import ProcessGroup
from lossfx._core.vocab import VocabRange
from lossfx._layouts import packing as _pure
from lossfx.interfaces import TrainingSamplingParams
from lossfx.next_token import ROLES_TILED, resolve_filter, resolved_vocab

__all__ = ["PackedLayout", "check_cu_seqlens", "check_packed_input_ids", "packed_next_token_logprobs"]


def _check_cu_type(name: str, cu: Any) -> None:
    """Raise `TypeError` naming `name` and the value unless `cu` is a 1-D integer tensor or a
    sequence of ints."""
    if isinstance(cu, Tensor):
        check_integer_ids(name, cu)
        if cu.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(cu.shape)}")
        return
    if not isinstance(cu, Sequence) or isinstance(cu, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got {type(cu).__name__} {cu!r}")
    bad = [v for v in cu if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:
        raise TypeError(f"{name} must hold ints, got {cu!r} (non-int entries {bad[:5]!r})")


def check_cu_seqlens(cu_seqlens_q: Any, cu_seqlens_q_padded: Any, n_seqs: int, total: int, cp_size: int) -> None:
    """Raise `ValueError` naming the offending entries of malformed cumulative sequence lengths.

    Checks: `n_seqs + 1` entries each, starting at 0, non-decreasing, every padded length at
    least its unpadded length, the padded total equal to `total` (the packed logits' `C·T/C`),
    and, with context parallelism, every padded length a multiple of `2C`. Eager only. Tensor
    values are read with the call's other host reads (`_core.host_reads.defer`).
    """
    _check_cu_type("cu_seqlens_q", cu_seqlens_q)  # types always; values in eager mode only
    _check_cu_type("cu_seqlens_q_padded", cu_seqlens_q_padded)
    if not values_checkable(cu_seqlens_q, cu_seqlens_q_padded):
        return
    tensors = [cu for cu in (cu_seqlens_q, cu_seqlens_q_padded) if isinstance(cu, Tensor)]
    if not tensors:
        _check_cu_lists([int(v) for v in cu_seqlens_q], [int(v) for v in cu_seqlens_q_padded], n_seqs, total, cp_size)
        return
    # tensor values: read with the call's other checks (one host read), checked when read
    q, p = (_pure.cu_tensor(cu, tensors[0].device) for cu in (cu_seqlens_q, cu_seqlens_q_padded))
    n = q.shape[0]
    _host_reads.defer(torch.cat([q, p]), lambda v: _check_cu_lists(v[:n], v[n:], n_seqs, total, cp_size))


def _check_cu_lists(cu_q: list[int], cu_p: list[int], n_seqs: int, total: int, cp_size: int) -> None:
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_q_padded", cu_p)):
        if len(cu) != n_seqs + 1:
            raise ValueError(f"{name} must have B+1 = {n_seqs + 1} entries, got {len(cu)}: {cu}")
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
        bad = [(i, cu[i], cu[i + 1]) for i in range(n_seqs) if cu[i + 1] < cu[i]]
        if bad:
            raise ValueError(f"{name} must be non-decreasing; decreasing at (index, value, next): {bad[:5]}")
    lengths_q, lengths_p = ([b - a for a, b in zip(cu[:-1], cu[1:], strict=True)] for cu in (cu_q, cu_p))
    short = [(i, pad, real) for i, (pad, real) in enumerate(zip(lengths_p, lengths_q, strict=True)) if pad < real]
    if short:
        raise ValueError(f"padded sequence lengths must be >= unpadded ones; (sequence, padded, unpadded): {short[:5]}")
    if cu_p[-1] != total:
        raise ValueError(f"cu_seqlens_q_padded[-1] = {cu_p[-1]} must equal the packed length the logits cover, {total}")
    if cp_size > 1:
        odd = [(i, padded) for i, padded in enumerate(lengths_p) if padded % (2 * cp_size)]
        if odd:
            raise ValueError(
                f"with context parallelism {cp_size}, every padded length must be a multiple of "
                f"2·{cp_size}; (sequence, padded length): {odd[:5]}"
            )


def check_packed_input_ids(
    name: str,
    input_ids: Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_q_padded: Any,
    vocab: int | Callable[[], int],
    prepacked: bool,
) -> None:
    """Raise `ValueError` for a scored id outside `[0, vocab)`, naming its `(b, t)` in `input_ids`.

    The scored ids are each sequence's tokens after its first: `input_ids[b, 1:len_b]` (unpacked,
    `len_b` the real length, clipped to the row and to the padded length), or
    `input_ids[0, cu_p[i] + 1 : cu_p[i+1]]` (pre-packed). Other entries (first tokens, padding) are
    never read and may hold anything: `check_ids_in_range` sees them as 0 (compiled: its in-graph assertion). Call
    after `check_cu_seqlens` (it checks their types). The scored ids'
    min and max are read with the call's other host reads; `vocab` may be a function called then
    (the size the call's cross-rank check reports, `ShardWidths.size_when_read`).
    """
    traced = _host_reads.tracing() and not input_ids.is_meta  # an in-graph assertion (`check_ids_in_range`)
    if not (traced or values_checkable(input_ids, cu_seqlens_q, cu_seqlens_q_padded)) or input_ids.numel() == 0:
        return
    # the scored positions on the device: the `cu_seqlens` values are not read here
    cu_q, cu_p = (_pure.cu_tensor(cu, input_ids.device) for cu in (cu_seqlens_q, cu_seqlens_q_padded))
    scored = _pure.scored_slots(input_ids.shape[1], cu_q, cu_p, prepacked)  # [B, S] ([1, T] pre-packed)
    values = torch.where(scored, input_ids, torch.zeros_like(input_ids))  # 0: in range for any V >= 1
    check_ids_in_range(name, values, vocab)  # an unscored entry is never named: it reads as 0


class PackedLayout(_pure.PackedLayout):
    """`lossfx._layouts.packing.PackedLayout` (packed rows as a sequence layout: the canonical
    packed row `[1, T, ...]`, `T = cu_seqlens_q_padded[-1]`, and this rank's `[1, T/C, ...]`, each
    sequence load-balanced on its own over `cp_group`), with the boundary's question answered:
    `check_covers` runs `check_cu_seqlens` against the packed length the local rows cover."""

    def check_covers(self, what: str, local_len: int, seq: int, got: str, canonical: str = "input_ids") -> None:
        """`check_cu_seqlens` against the packed length the local rows cover, `C·T/C`."""
        n_seqs = len(self.cu_seqlens_q_padded) - 1 if self.prepacked else seq
        check_cu_seqlens(self.cu_seqlens_q, self.cu_seqlens_q_padded, n_seqs, local_len * self.cp_size, self.cp_size)


@boundary(roles=ROLES_TILED, vocab="tiled")
def packed_next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_q_padded: Any,
    *,
    prepacked: bool = False,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Next-token log-probs of packed sequences, each shifted within itself.

    Equivalent to ``lossfx.reference.packed_next_token_logprobs`` on the canonical packed logits:
    for every sequence `i`, the dense next-token log-probs of its own slots.

    Args:
        logits: `[1, T/C, Vl]` packed logits (this rank's TP vocabulary shard and CP part).
        input_ids: `[B, S]` unpacked ids, or the physical packed row `[1, T]` when `prepacked`.
        cu_seqlens_q: `[B+1]` cumulative real lengths (tuple of ints or an int tensor).
        cu_seqlens_q_padded: `[B+1]` cumulative padded lengths; `T = cu_seqlens_q_padded[-1]`.
        prepacked: return the packed physical layout `[1, T−1]` (each sequence's last slot 0)
            instead of the unpacked `[B, S−1]`.
        vocab_parallel_group: TP group over the vocabulary, or `None`.
        context_parallel_group: CP group, or `None`; gradient summed over CP ranks.
        sampling_params: top-k/top-p filter (log-probs are `−inf` where the target is filtered out).
        chunk_size: packed slots per eager chunk (memory bound only).
        vocab_start, vocab_size: this shard's first id and `V`, for uneven shards (defaults
            `rank · Vl` and `TP · Vl`).

    Returns:
        `[B, S−1]` (position `t` of row `i` scores token `t+1` of sequence `i`; 0 past the padded
        length), or `[1, T−1]` when `prepacked`; in the compute dtype.

    Raises:
        TypeError: `cu_seqlens_*` neither a sequence of ints nor a 1-D integer tensor.
        ValueError: bad shapes; malformed `cu_seqlens` (`check_cu_seqlens`); a scored id outside
            `[0, V)` (`check_packed_input_ids`: first tokens and padding are never read; compiled: an
            in-graph `RuntimeError`). The `cu_seqlens` values are checked eagerly only.
    """
    logits, input_ids, layout, vocab, options = _validated_packed(
        logits,
        input_ids,
        cu_seqlens_q,
        cu_seqlens_q_padded,
        prepacked=prepacked,
        vocab_parallel_group=vocab_parallel_group,
        context_parallel_group=context_parallel_group,
        sampling_params=sampling_params,
        chunk_size=chunk_size,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
    )
    return _pure.packed_next_token_logprobs(logits, input_ids, layout, vocab, **options)


def _validated_packed(
    logits: Tensor,
    input_ids: Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_q_padded: Any,
    *,
    prepacked: bool,
    vocab_parallel_group: ProcessGroup | None,
    context_parallel_group: ProcessGroup | None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    ids_name: str = "input_ids",
    **vocab: Any,
) -> tuple[Tensor, Tensor, PackedLayout, VocabRange, dict[str, Any]]:
    """The boundary work of a packed call, once: `(logits, input_ids, layout, vocab, options)` as
    `lossfx._layouts.packing.packed_next_token_logprobs(logits, input_ids, layout, vocab, **options)`
    takes them (`options`: the resolved filter and `chunk_rows`). `cu_seqlens` and the scored
    ids are checked here (read with the call's other host reads); errors about the ids name them
    `ids_name` (the entry point passes `data['input_ids']`). `vocab`: `resolved_vocab`'s `vocab_start`,
    `vocab_size`, or `widths` (the call's `ShardWidths`: the range comes from the shard widths the
    call's cross-rank check reported, asked for once the checks are deferred, so that they are
    read together)."""
    check_floating("logits", logits)
    check_integer_ids(ids_name, input_ids)
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"packed logits must be [1, T/C, V_local], got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"logits must have at least one vocabulary column, got shape {tuple(logits.shape)}")
    if input_ids.dim() != 2 or (prepacked and input_ids.shape[0] != 1):
        raise ValueError(
            f"input_ids must be [B, S] (or [1, T] for pre-packed data), got shape {tuple(input_ids.shape)}"
        )
    top = resolve_filter(sampling_params)
    options: dict[str, Any] = {
        "chunk_rows": check_positive_int("chunk_size", chunk_size),
        **(top._asdict() if top else {}),
    }
    layout = PackedLayout(cu_seqlens_q, cu_seqlens_q_padded, context_parallel_group, prepacked)
    layout.check_covers("packed logits", logits.shape[1], input_ids.shape[0], f"logits.shape={tuple(logits.shape)}")
    check = lambda v: check_packed_input_ids(ids_name, input_ids, cu_seqlens_q, cu_seqlens_q_padded, v, prepacked)  # noqa: E731
    resolved = resolved_vocab(vocab_parallel_group, logits.shape[-1], check, **vocab)
    return logits, input_ids, layout, resolved, options
