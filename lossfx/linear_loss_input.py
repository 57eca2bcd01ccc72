"""Loss inputs from hidden states: `prepare_loss_input` with the LM head fused in.

    prepare_linear_loss_input(hidden, W, data, loss_fn, ...)
        == prepare_loss_input(head(hidden @ W.T + bias), data, loss_fn, ...)

(`head`: `lossfx.fused_linear`'s options, `z = c · tanh(s · r / c) / T`) with the same keys,
dtypes and gradients (to `hidden`, `W`, `bias`), and the logits never held: every branch runs on
`[C, Cv]` tiles of them. Per input type:

1. `LOGPROB` unfiltered: the fused next-token pipeline (`lossfx._layouts.linear_next_token`);
   top-k/top-p filtered: the same pipeline around the fused filtered kernel
   (`lossfx._kernels.linear_filtering`: `[C, Vl]` row chunks, two passes over the vocabulary);
2. `DISTILLATION`: the student's log-probs at the teacher's top-k ids and `H_all` from one fused
   pass (`lossfx._layouts.linear_distillation`);
3. `DRAFT`: the `D` head rows of the draft vocabulary only, projected from the shifted hidden
   states (`lossfx._layouts.linear_draft`): `[N, D]`, never `[N, V]`;
4. `OPD_FULL`: reverse KL (and the entropy / cross-entropy metrics) of the student against the
   teacher (logits columns, or hidden states × teacher head) from the fused divergence kernel, one
   `[C, Cv]` tile of each side at a time (`lossfx._layouts.linear_opd_full`);
5. `LOGIT`: a `ValueError` (the loss wants the logits: call `prepare_loss_input` with them).

The sequence layout (`context_parallel_group` / `cp_sharder`) and the tensor-parallel head shard
(`vocab_parallel_group`: `lm_head_weight` holds this rank's rows, widths may differ in eager mode;
or a `Shard(0)` DTensor head) are resolved once here, as in `lossfx.loss_input`.
`prepare_linear_packed_loss_input` is the twin of `prepare_packed_loss_input` (`LOGPROB`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, NamedTuple, Unpack

import torch
from torch import Tensor

from lossfx._boundary import debug
from lossfx._boundary.consistency import Roles, ShardWidths, boundary
from lossfx._boundary.dtensor import CALLER, SHARD, VocabShard, local_view
from lossfx._boundary.validation import check_floating, check_tensor
from lossfx._core.distributed import ProcessGroup
from lossfx._core.host_reads import tracing
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels.fused_linear import CheckedCount
from lossfx._layouts import linear_distillation as _distillation
from lossfx._layouts import linear_draft as _draft
from lossfx._layouts import linear_next_token as _next_token
from lossfx._layouts import linear_opd_full as _opd_full
from lossfx._layouts.packing import PackedLayout
from lossfx._layouts.sequence_layout import SequenceLayout
from lossfx.distillation import validated_distillation
from lossfx.draft import validated_draft
from lossfx.fused_linear import HeadKeywords, LinearCall, head_keywords, resolved_call
from lossfx.interfaces import LossInputType, TrainingSamplingParams, wants_reference_kl
from lossfx.loss_input import _column, _data_read, _input_type, _neg_inf_rule, _vocab_parallel
from lossfx.next_token import TopKTopP, resolve_filter, validated_next_token_call
from lossfx.opd_full import validated_opd_full
from lossfx.packing import _validated_packed
from lossfx.sequence_layout import sequence_layout

__all__ = ["prepare_linear_loss_input", "prepare_linear_packed_loss_input"]

# the cross-rank check's view of the parameters (`_boundary.consistency.Roles`)
_ROLES = Roles(
    tp="vocab_parallel_group",
    cp="context_parallel_group",
    cp_from="cp_sharder",
    head="lm_head_weight",
    shards=("bias",),
    rank="vocab_parallel_rank",
    reads=("data", _data_read),
    shard_columns=("student_logits",),
    cp_shards=("hidden",),
    heads="teacher_output_layer_weight_by_index",  # OPD_FULL's: this rank's rows, like the head's
)
_ROLES_PACKED = dataclasses.replace(_ROLES, cp_from=None, heads=None)


class FrontDoor(NamedTuple):
    """A front-door call resolved once: the local tensors, the head's `LinearCall`, and what the
    logits path's validators read of the shard."""

    hidden: Tensor  # [B, S_l, H]
    weight: Tensor  # [Vl, H]
    columns: Mapping[str, Any]  # data with local tensors
    shard: VocabShard  # the head's shard (a DTensor head's placement, or the plain arguments)
    call: LinearCall
    logits: Tensor  # the stand-in for this rank's [B, S_l, Vl] logits (`_front_door`)
    vocab: dict[str, Any]  # the head's vocabulary range as the logits path's validators take it
    data: MutableMapping[str, Any]  # the caller's data (returned, and written to)

    def column(self, key: str) -> Tensor:
        """`data[key]` (local), which must be a tensor."""
        return check_tensor(f"data[{key!r}]", _column(self.columns, key))  # type: ignore[arg-type]


def _front_door(view: dict[str, Any] | None, widths: ShardWidths | None, packed: bool) -> FrontDoor:
    """The resolve of a front-door call, once, on its boundary's `view` (`local_view`: local tensors,
    the head's `VocabShard`, the caller's `data` under `CALLER`): the groups,
    `hidden` `[B, S_l, H]` (packed: `[1, T/C, H]`), the head (`resolved_call`) with `chunk_size`
    positions as rows, and the logits path's view of them: the logits as its validators read them,
    which read shapes only (a zero-stride stand-in: one unfilled element, no kernel launched, never
    the logits), and the head's vocabulary range as they resolve it
    (`lossfx.next_token.resolved_vocab`): a DTensor head's, or the widths of uneven plain shards
    that the cross-rank check reported (read with the call's range check of ids: one host read)."""
    assert view is not None, "boundary(local=...) hands the body its view"
    hidden, weight, shard = view["hidden"], view["lm_head_weight"], view[SHARD]
    group = shard.group
    if shard.dtensor is None:
        _vocab_parallel(view["vocab_parallel_rank"], group)
    check_floating("hidden", hidden)
    if hidden.dim() != 3 or (packed and hidden.shape[0] != 1):
        want = "packed hidden must be [1, T/C, H]" if packed else "hidden must be [B, S_local, H]"
        raise ValueError(f"{want}, got shape {tuple(hidden.shape)}")
    vocab: dict[str, Any] = {"vocab_start": shard.vocab_start, "vocab_size": shard.vocab_size}
    keywords = {k: view[k] for k in ("chunk_size", *HeadOptions._fields)}
    call = resolved_call(hidden, weight, {**keywords, **vocab, "group": group})
    call = call._replace(chunk_rows=call.chunk_rows * hidden.shape[0])
    vocab["widths"] = (widths or ShardWidths()) if shard.dtensor is None and group is not None else None  # uneven
    logits = hidden.new_empty(()).expand(hidden.shape[0], hidden.shape[1], weight.shape[0])
    return FrontDoor(hidden, weight, view["data"], shard, call, logits, vocab, view.get(CALLER, view["data"]))


def _rows_ahead(door: FrontDoor, defer_rows: Callable[[list[int]], None]) -> list[int] | None:
    """The fused kernel's count of active rows (its `count`), deferred by `defer_rows` just before
    the call reads the widths of uneven plain shards (`ShardWidths.before_read`): that read carries
    it, not one of the kernel's own after it. None (the kernel reads it with the call's checks)
    for a DTensor head or no group, and while tracing (nothing is read). In the debug mode
    (`LOSSFX_DISTRIBUTED_DEBUG`) the kernel also reads its own count and raises if the two differ."""
    widths = door.vocab["widths"]  # None unless uneven plain shards
    if widths is None or tracing():
        return None
    count = CheckedCount(debug.check_deferred_count) if debug.enabled() else []  # debug: the kernel's own too
    widths.before_read.append(lambda: defer_rows(count))
    return count


_LOGITS = "hidden's logits"  # the stand-in, in the logits path's messages


def _linear_opd_full_input(
    door: FrontDoor,
    loss_fn: Any,
    layout: SequenceLayout,
    *,
    teacher_heads: Any,
    teacher_logits_dtype: torch.dtype | None,
) -> dict[str, Any]:
    """`OPD_FULL`: the logits path's checks (`lossfx.opd_full.validated_opd_full`) on the stand-in,
    then the fused twin `lossfx._layouts.linear_opd_full` once: the student `hidden × weight` and
    the teacher (logits columns, or hidden states × teacher head) one tile at a time.
    `teacher_heads`: this rank's rows of each teacher head (the boundary's one unwrap, `local_view`)."""
    hidden, call = door.hidden, door.call

    def defer_rows(into: list[int]) -> None:  # run once `input_ids` is checked, before the widths are read
        if wants_reference_kl(loss_fn):
            ids = door.column("input_ids")
            _next_token.defer_active_rows(hidden, ids, layout, call.head.ignore_index, into)

    count = _rows_ahead(door, defer_rows)  # the reference-KL log-probs' active rows
    opd = validated_opd_full(
        door.logits,
        door.columns,
        loss_fn,
        vocab_parallel_rank=door.shard.rank,
        vocab_parallel_group=door.shard.group,
        layout=layout,
        chunk_size=None,
        teacher_output_layer_weight_by_index=teacher_heads,
        teacher_logits_dtype=teacher_logits_dtype,
        logits_name=_LOGITS,
        **door.vocab,
    )
    return _opd_full.linear_opd_full_loss_input(
        hidden,
        door.weight,
        opd.payload,
        opd.input_ids if opd.kl else None,
        layout,
        opd.vocab,
        head=call.head,
        columns=opd.teacher.columns,
        heads=opd.teacher.heads,
        position=opd.teacher.position,
        teacher_logits_dtype=teacher_logits_dtype,
        validate_decomposition=bool(getattr(opd.cfg, "validate_decomposition", False)),
        chunk_rows=call.chunk_rows or opd.chunk_rows or 0,
        seq=opd.input_ids.shape[1],
        count=count,
    )


@boundary(roles=_ROLES, vocab="auto", local=local_view(_ROLES))
@head_keywords
def prepare_linear_loss_input(
    hidden: Tensor,
    lm_head_weight: Tensor,
    data: MutableMapping[str, Any],
    loss_fn: Any,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    cp_sharder: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    d2t: Tensor | None = None,
    chunk_size: int | None = None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
    teacher_logits_dtype: torch.dtype | None = None,
    _widths: ShardWidths | None = None,
    _view: dict[str, Any] | None = None,
    **head: Unpack[HeadKeywords],
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """Build the loss-function input dict from last hidden states and the LM head, fused.

    Equivalent to ``lossfx.prepare_loss_input(z, data, loss_fn, ...)`` with
    ``z = c · tanh(s · (hidden @ lm_head_weight.T + bias) / c) / T`` (no tanh without `softcap`)
    for `LOGPROB`, `DISTILLATION`, `DRAFT` and `OPD_FULL`: same keys, dtypes and gradients
    (to `hidden`, `lm_head_weight`, `bias`) to fp32 rounding, holding one `[C, Cv]` tile of `z` at
    most (`DRAFT`: its `[N, D/R]` result). Dense twin: ``lossfx.reference.prepare_linear_loss_input``.

    Args:
        hidden: `[B, S_l, H]` last hidden states, this rank's part of the sequence (the
            load-balanced part under `context_parallel_group`, the sharder's with `cp_sharder`),
            replicated over the TP group (plain or a `Replicate()` DTensor).
        lm_head_weight: `[Vl, H]` this rank's rows of the LM head (the whole head without TP; in
            eager mode ranks may hold different widths, in rank order), or a `Shard(0)` DTensor.
        data: as `prepare_loss_input` (`LOGPROB`: `input_ids`; `DISTILLATION`:
            `teacher_topk_logits`, `teacher_topk_indices`; `DRAFT`: `token_mask`,
            `student_logits`). Not modified (but for `curr_logprobs_unfiltered`, as there).
        loss_fn: has `input_type` (a `LossInputType`); `use_fused_linear_logprobs` is ignored
            (this is the fused path).
        vocab_parallel_rank: rank in `vocab_parallel_group`; required with it.
        vocab_parallel_group: tensor-parallel group over the vocabulary (the head's rows), or `None`.
        context_parallel_group: context-parallel group (load-balanced layout of `hidden`), or
            `None`; outputs are canonical and their gradient is summed over CP ranks (divide the
            loss by the CP size), as in `prepare_loss_input`.
        cp_sharder: an external context-parallel layout, as in `prepare_loss_input`.
        sampling_params: top-k/top-p filter (`LOGPROB`); a filter raises today (see Raises).
        d2t: draft-to-target vocabulary map (`DRAFT` only).
        chunk_size: sequence positions per eager chunk (a memory bound; results do not depend on it).
        teacher_output_layer_weight_by_index: teacher LM-head shards (`OPD_FULL` only): this
            rank's rows, the same vocabulary rows as `lm_head_weight` (or `Shard(0)` DTensors).
        teacher_logits_dtype: dtype of teacher logits projected from hidden states (`OPD_FULL`).
        bias: `[Vl]` this rank's rows of the head's bias (or a `Shard(0)` DTensor), or `None`.
        temperature, logit_scale, softcap: the head's options (`lossfx.linear_token_logprobs`).
        ignore_index: `LOGPROB` only: a position whose next id equals it scores 0 with a zero
            gradient (its row is never computed). Without such ids, the `prepare_loss_input` result.

    Returns:
        `(loss_input, data)` as `prepare_loss_input`.

    Raises:
        ValueError: `LOGIT` (it wants the logits: call `prepare_loss_input` with them); every
            error of `prepare_loss_input`'s branches and of the fused head's options.
        TypeError: wrong argument types.

    Example:
        >>> import torch, lossfx
        >>> from types import SimpleNamespace
        >>> loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
        >>> data = {"input_ids": torch.tensor([[0, 2, 1]])}
        >>> out, _ = lossfx.prepare_linear_loss_input(torch.zeros(1, 3, 2), torch.ones(4, 2), data, loss_fn)
        >>> out["next_token_logprobs"]
        tensor([[-1.3863, -1.3863]])
    """
    input_type = _input_type(loss_fn)
    if input_type is LossInputType.LOGIT:
        raise ValueError(
            "prepare_linear_loss_input has no LOGIT branch: a LOGIT loss consumes the full logits, which this "
            "function never forms; call lossfx.prepare_loss_input(logits, data, loss_fn, ...) with the logits "
            "(logits = hidden @ lm_head_weight.T, bias and head options applied)"
        )
    # hidden, lm_head_weight, bias, data: local (the boundary's one unwrap, `local_view`); data: the caller's
    door = _front_door(_view, _widths, False)
    layout = sequence_layout(context_parallel_group, cp_sharder)
    if input_type is LossInputType.OPD_FULL:
        return _linear_opd_full_input(
            door,
            loss_fn,
            layout,
            teacher_heads=teacher_output_layer_weight_by_index,
            teacher_logits_dtype=teacher_logits_dtype,
        ), door.data
    if input_type is LossInputType.DISTILLATION:
        return _distillation_input(door, loss_fn, layout), door.data
    if input_type is LossInputType.DRAFT:
        return _draft_input(door, d2t, layout), door.data
    return _logprob_input(door, loss_fn, layout, sampling_params), door.data


def _logprob_input(
    door: FrontDoor, loss_fn: Any, layout: SequenceLayout, sampling_params: TrainingSamplingParams | None
) -> dict[str, Tensor]:
    """`LOGPROB`: the logits path's checks (`validated_next_token_call`) on the stand-in, then
    next-token log-probs `[B, S-1]` through the fused pipeline; with a top-k/top-p
    `sampling_params`, under the filtered softmax (`lossfx._kernels.linear_filtering`: one
    `[C, Vl]` row chunk at a time, two passes over the vocabulary), `-inf` masked as on the logits path."""
    top = resolve_filter(sampling_params)
    input_ids = door.column("input_ids")
    ignore_index = door.call.head.ignore_index
    count = _rows_ahead(  # run once the checks below passed, before the widths are read
        door, lambda into: _next_token.defer_active_rows(door.hidden, input_ids, layout, ignore_index, into)
    )
    checked = validated_next_token_call(
        door.logits,
        input_ids,
        group=door.shard.group,
        layout=layout,
        chunk_size=None,
        ids_name="data['input_ids']",
        ignore_index=door.call.head.ignore_index,
        logits_name=_LOGITS,
        **door.vocab,
    )
    return _next_token_input(door, loss_fn, input_ids, layout, checked.vocab, top, count=count)


def _next_token_input(
    door: FrontDoor,
    loss_fn: Any,
    input_ids: Tensor,
    layout: SequenceLayout,
    vocab: VocabRange,
    top: TopKTopP | None,
    fill: int | None = None,
    count: list[int] | None = None,
) -> dict[str, Tensor]:
    """The validated `LOGPROB` call of either front door (packed: `fill = 0`, the packed rows' rule)
    through the fused pipeline; under a filter, the logits path's `-inf` rule
    (`lossfx.loss_input._neg_inf_rule`: `curr_logprobs_unfiltered` lands in the caller's data)."""

    def next_token(filtered: bool) -> Tensor:
        (out,) = _next_token.linear_next_token_logprobs(
            door.hidden,
            door.weight,
            input_ids,
            layout,
            vocab,
            head=door.call.head,
            chunk_rows=door.call.chunk_rows,
            top=top if filtered else None,
            fill=fill,
            count=count,
        )
        return out

    if top is None:
        return {"next_token_logprobs": next_token(False)}
    return _neg_inf_rule(door.columns, loss_fn, input_ids, next_token, door.data)


def _distillation_input(door: FrontDoor, loss_fn: Any, layout: SequenceLayout) -> dict[str, Any]:
    """`DISTILLATION`: the logits path's checks (`validated_distillation`) on the stand-in, then
    student/teacher log-probs at the teacher's top-k ids and `H_all` from one fused pass."""
    zero_outside_topk = bool(getattr(loss_fn, "zero_outside_topk", False))
    calculate_entropy = zero_outside_topk and getattr(loss_fn, "kl_type", "mixed") != "forward"
    values, ids = door.column("teacher_topk_logits"), door.column("teacher_topk_indices")
    names = (_LOGITS, "teacher_topk_logits", "teacher_topk_indices")
    count = _rows_ahead(door, lambda into: _distillation.defer_active_rows(door.hidden, ids, layout, into))
    _, values, ids, vocab, _ = validated_distillation(
        door.logits, values, ids, door.shard.group, layout, None, names, **door.vocab
    )
    student, teacher, neg_entropy = _distillation.linear_distillation_topk_logprobs(
        door.hidden,
        door.weight,
        values,
        ids,
        vocab,
        layout,
        head=door.call.head,
        zero_outside_topk=zero_outside_topk,
        calculate_entropy=calculate_entropy,
        chunk_rows=door.call.chunk_rows,
        count=count,
    )
    return {"student_topk_logprobs": student, "teacher_topk_logprobs": teacher, "H_all": neg_entropy}


def _draft_input(door: FrontDoor, d2t: Tensor | None, layout: SequenceLayout) -> dict[str, Any]:
    """`DRAFT`: the logits path's checks (`lossfx.draft.validated_draft`) on the stand-in, then the
    shifted teacher logits in the draft vocabulary (this rank's `D/R` shard) and the shifted mask,
    from the head's `D` draft rows only."""
    student_logits = _column(door.data, "student_logits")  # type: ignore[arg-type]  # (passed through)
    token_mask = door.column("token_mask")
    shard = door.shard
    target_ids, vocab = validated_draft(
        door.logits, token_mask, d2t, shard.group, shard.rank, layout, _LOGITS, **door.vocab
    )
    teacher, mask = _draft.linear_draft_targets(
        door.hidden, door.weight, token_mask, target_ids, vocab, layout, head=door.call.head
    )
    return {"teacher_logits": teacher, "student_logits": student_logits, "token_mask": mask}


@boundary(roles=_ROLES_PACKED, vocab="auto", local=local_view(_ROLES_PACKED))
@head_keywords
def prepare_linear_packed_loss_input(
    hidden: Tensor,
    lm_head_weight: Tensor,
    data: MutableMapping[str, Any],
    loss_fn: Any,
    cu_seqlens_q: Any,
    cu_seqlens_q_padded: Any,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    _widths: ShardWidths | None = None,
    _view: dict[str, Any] | None = None,
    **head: Unpack[HeadKeywords],
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """Loss inputs (`LOGPROB`) from packed hidden states: `prepare_packed_loss_input` fused.

    Equivalent to ``lossfx.prepare_packed_loss_input(z, data, loss_fn, cu_seqlens_q,
    cu_seqlens_q_padded, ...)`` with ``z = head(hidden @ lm_head_weight.T + bias)``, one
    `[C, Cv]` tile of `z` at a time.

    Args:
        hidden: `[1, T/C, H]` packed hidden states (this rank's load-balanced part of every
            sequence under context parallelism of size `C`).
        lm_head_weight, bias, temperature, logit_scale, softcap, ignore_index: as
            `prepare_linear_loss_input`.
        data: `input_ids` `[B, S]`, or the packed `[1, T]` row with `cu_seqlens` (pre-packed),
            as in `prepare_packed_loss_input`.
        loss_fn: must have `input_type == LossInputType.LOGPROB`.
        cu_seqlens_q: `[B+1]` cumulative real lengths (ints, or an int tensor).
        cu_seqlens_q_padded: `[B+1]` cumulative padded lengths (`T` in total; multiples of `2C`).
        vocab_parallel_rank: rank in `vocab_parallel_group`; required with it.
        vocab_parallel_group: tensor-parallel group over the vocabulary, or `None`.
        context_parallel_group: CP group, or `None`; gradients are summed over CP ranks.
        sampling_params: top-k/top-p filter; a filter raises today (see Raises).
        chunk_size: packed positions per eager chunk (memory bound only).

    Returns:
        `({"next_token_logprobs": [B, S-1]}, data)` (`[1, T-1]` for pre-packed data).

    Raises:
        ValueError: an input type other than `LOGPROB`; a filter (the message names the logits
            path); every error of `prepare_packed_loss_input`
            (the checks name the packed `[1, T/C, Vl]` logits that `hidden` stands for).
    """
    _input_type(loss_fn, packed="prepare_linear")
    # hidden, lm_head_weight, bias, data: local (the boundary's one unwrap, `local_view`); data: the caller's
    door = _front_door(_view, _widths, True)
    top = resolve_filter(sampling_params)
    input_ids = door.column("input_ids")
    prepacked = "cu_seqlens" in door.columns
    packed = PackedLayout(cu_seqlens_q, cu_seqlens_q_padded, context_parallel_group, prepacked)  # as validated
    ignore_index = door.call.head.ignore_index
    count = _rows_ahead(  # run once the checks of `_validated_packed` passed, before the widths are read
        door, lambda into: _next_token.defer_active_rows(door.hidden, input_ids, packed, ignore_index, into, 0)
    )
    _, input_ids, layout, vocab, _ = _validated_packed(  # the stand-in: [1, T/C, Vl]
        door.logits,
        input_ids,
        cu_seqlens_q,
        cu_seqlens_q_padded,
        prepacked=prepacked,
        vocab_parallel_group=door.shard.group,
        context_parallel_group=context_parallel_group,
        chunk_size=chunk_size,
        ids_name="data['input_ids']",
        **door.vocab,
    )
    return _next_token_input(door, loss_fn, input_ids, layout, vocab, top, fill=0, count=count), door.data
