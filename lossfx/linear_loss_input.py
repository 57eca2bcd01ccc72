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
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple, Unpack

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, ShardWidths, boundary
from lossfx._boundary.dtensor import CALLER, SHARD, VocabShard, local_view, replicated
from lossfx._boundary.validation import (
    check_floating,
    check_group,
    check_ids_in_range,
    check_integer_ids,
    check_tensor,
)
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels import fused_linear as _kernel
from lossfx._kernels import linear_filtering as _filtered
from lossfx._layouts import linear_distillation as _distillation
from lossfx._layouts import linear_draft as _draft
from lossfx._layouts import linear_next_token as _next_token
from lossfx._layouts import linear_opd_full as _opd_full
from lossfx._layouts.sequence_layout import SequenceLayout, score_next_tokens
from lossfx.fused_linear import HeadKeywords, LinearCall, head_keywords, validated_head
from lossfx.interfaces import LossInputType, TrainingSamplingParams
from lossfx.loss_input import _column, _data_read, _input_type, _vocab_parallel
from lossfx.loss_masks import loss_mask_from_data, masked_out_neg_inf
from lossfx.next_token import TopKTopP, resolve_filter
from lossfx.opd_full import (
    _PAYLOAD_COLUMNS,
    TEACHER_INDEX_FIELD,
    _validated_teacher,
    opd_config,
)
from lossfx.packing import _validated_packed
from lossfx.sequence_layout import check_covers, sequence_layout

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
_TEACHER_HEADS = "teacher_output_layer_weight_by_index"
_ROLES_PACKED = dataclasses.replace(_ROLES, cp_from=None, heads=None)


class FrontDoor(NamedTuple):
    """A front-door call resolved once: the local tensors, the head's `LinearCall`, and what the
    branches read of the shard (`size`: `V` as the range checks read it)."""

    hidden: Tensor  # [B, S_l, H]
    weight: Tensor  # [Vl, H]
    columns: Mapping[str, Any]  # data with local tensors
    shard: VocabShard  # the head's shard (a DTensor head's placement, or the plain arguments)
    call: LinearCall
    size: int | Any
    widths: ShardWidths
    data: MutableMapping[str, Any]  # the caller's data (returned, and written to)


def _front_door(view: dict[str, Any] | None, widths: ShardWidths | None, packed: bool) -> FrontDoor:
    """The resolve of a front-door call, once, on its boundary's `view` (`local_view`: local tensors,
    the head's `VocabShard`, the caller's `data` under `CALLER`): the groups,
    `hidden` `[B, S_l, H]` (packed: `[1, T/C, H]`), the head (`validated_head`) with `chunk_size`
    positions as rows, and `V` as the range checks of the ids read it: an int, or (uneven plain
    shards in eager mode) the function of the cross-rank check's widths."""
    assert view is not None, "boundary(unwrapped=True) hands the body its view"
    if not packed:  # (the packed checks check it)
        check_group("context_parallel_group", view["context_parallel_group"])
    hidden, weight, shard = view["hidden"], view["lm_head_weight"], view[SHARD]
    group = shard.group
    if shard.dtensor is None:
        _vocab_parallel(view["vocab_parallel_rank"], group)
    check_tensor("hidden", hidden)
    check_floating("hidden", hidden)
    if hidden.dim() != 3 or (packed and hidden.shape[0] != 1):
        want = "packed hidden must be [1, T/C, H]" if packed else "hidden must be [B, S_local, H]"
        raise ValueError(f"{want}, got shape {tuple(hidden.shape)}")
    call = validated_head(
        hidden,
        weight,
        {k: view[k] for k in HeadOptions._fields},
        group=group,
        vocab_start=shard.vocab_start,
        vocab_size=shard.vocab_size,
        chunk_size=view["chunk_size"],
    )
    call = call._replace(chunk_rows=call.chunk_rows * hidden.shape[0])
    widths = ShardWidths() if widths is None else widths
    uneven = shard.dtensor is None and group is not None
    size = widths.size_when_read(weight.shape[0], group) if uneven else call.vocab.size
    return FrontDoor(hidden, weight, view["data"], shard, call, size, widths, view.get(CALLER, view["data"]))


def _uneven_vocab(door: FrontDoor) -> LinearCall:
    """The call with this rank's range from the widths the cross-rank check reported (uneven plain
    shards, eager); unchanged for a DTensor head, without a group, or traced (equal widths)."""
    call, group = door.call, door.call.vocab.group
    if door.shard.dtensor is not None or group is None:
        return call
    start, size = door.widths.range(door.weight.shape[0], group)
    return call if start is None or size is None else call._replace(vocab=VocabRange(group, start, size))


_LOGITS_PATH = (
    "call lossfx.prepare_loss_input(logits, data, loss_fn, ...) with the logits "
    "(logits = hidden @ lm_head_weight.T, bias and head options applied)"
)


def _linear_opd_full_input(
    door: FrontDoor,
    loss_fn: Any,
    layout: SequenceLayout,
    *,
    teacher_heads: Any,
    teacher_logits_dtype: torch.dtype | None,
) -> dict[str, Any]:
    """`OPD_FULL`: `prepare_opd_full_loss_input`'s checks of the config, payload and teacher heads
    (`lossfx.opd_full`'s), then the fused twin `lossfx._layouts.linear_opd_full` once: the student
    `hidden × weight` and the teacher (logits columns, or hidden states × teacher head) one tile at a time.
    `teacher_heads`: this rank's rows of each teacher head (the boundary's one unwrap, `_unwrap`)."""
    hidden, weight, columns, size = door.hidden, door.weight, door.columns, door.size
    cfg, payload_kind, cfg_chunk = opd_config(loss_fn, columns)  # the logits path's config and column checks
    if teacher_logits_dtype is not None and (
        not isinstance(teacher_logits_dtype, torch.dtype) or not teacher_logits_dtype.is_floating_point
    ):
        raise TypeError(f"teacher_logits_dtype must be a floating torch.dtype or None, got {teacher_logits_dtype!r}")
    column = _PAYLOAD_COLUMNS[payload_kind]
    input_ids = check_integer_ids("data['input_ids']", _column(columns, "input_ids"))  # type: ignore[arg-type]
    if input_ids.dim() != 2 or input_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"input_ids must be [B, S] with hidden's batch size; got input_ids.shape={tuple(input_ids.shape)} "
            f"and hidden.shape={tuple(hidden.shape)}"
        )
    seq, local_len, window = input_ids.shape[1], hidden.shape[1], layout.window(hidden.shape[1])
    if window is not None and seq > window:
        raise ValueError(
            f"input_ids has {seq} positions, more than the student window S_l·CP = {local_len}·{layout.cp_size}"
        )
    call = _uneven_vocab(door)
    local_vocab, payload = weight.shape[0], columns[column]
    # the checks read shapes only: a zero-stride stand-in for this rank's [B, S_l, Vl] student logits
    stand_in = hidden.new_zeros(()).expand(hidden.shape[0], local_len, local_vocab)
    teacher = _validated_teacher(
        payload,
        teacher_payload=payload_kind,
        student_logits=stand_in,
        vocab_parallel_rank=0,  # the logits window is checked below, at this rank's own start
        layout=layout,
        teacher_output_layer_weight_by_index=teacher_heads,
        teacher_index=columns.get(TEACHER_INDEX_FIELD) if payload_kind == "hidden_states" else None,
    )
    window_cols = None
    if payload_kind == "logits":
        window_cols = (call.vocab.start, local_vocab)
        if payload.shape[-1] < call.vocab.start + local_vocab:
            raise ValueError(
                "Teacher logits payload is narrower than this rank's vocabulary window: payload width "
                f"{payload.shape[-1]} vs required end {call.vocab.start + local_vocab} (V_local {local_vocab})"
            )
    ids = None
    if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
        got = f"hidden.shape={tuple(hidden.shape)} and input_ids.shape={tuple(input_ids.shape)}"
        check_covers(layout, "hidden", local_len, seq, got)
        check_ids_in_range("data['input_ids']", input_ids, size)
        ids = input_ids
    chunk_rows = call.chunk_rows or (cfg_chunk or 0) * hidden.shape[0]
    return _opd_full.linear_opd_full_loss_input(
        hidden,
        weight,
        payload,
        ids,
        layout,
        call.vocab,
        head=call.head,
        columns=window_cols,
        heads=teacher.heads,
        position=teacher.position,
        teacher_logits_dtype=teacher_logits_dtype,
        validate_decomposition=bool(getattr(cfg, "validate_decomposition", False)),
        chunk_rows=chunk_rows,
        seq=seq,
    )


@boundary(roles=_ROLES, vocab="auto", local=local_view(_ROLES), unwrapped=True)
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
            f"function never forms; {_LOGITS_PATH}"
        )
    # hidden, lm_head_weight, bias, data: local (the boundary's one unwrap, `local_view`); data: the caller's
    door = _front_door(_view, _widths, False)
    layout = sequence_layout(context_parallel_group, cp_sharder)
    if input_type is LossInputType.OPD_FULL:
        return _linear_opd_full_input(
            door,
            loss_fn,
            layout,
            teacher_heads=(_view or {}).get(_TEACHER_HEADS),
            teacher_logits_dtype=teacher_logits_dtype,
        ), door.data
    if input_type is LossInputType.DISTILLATION:
        return _distillation_input(door, loss_fn, layout), door.data
    if input_type is LossInputType.DRAFT:
        return _draft_input(door, d2t, layout), door.data
    return _logprob_input(door, loss_fn, layout, sampling_params), door.data


def _canonical(columns: Mapping[str, Any], key: str, hidden: Tensor, dims: int, layout: SequenceLayout) -> Tensor:
    """`data[key]`, a canonical `[B, S, ...]` tensor (`dims` dims) that `hidden [B, S_l, H]` covers."""
    x = check_tensor(f"data[{key!r}]", _column(columns, key))  # type: ignore[arg-type]
    if x.dim() != dims or x.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"data[{key!r}] must have {dims} dims with hidden's batch {hidden.shape[0]}; got shape {tuple(x.shape)}"
        )
    got = f"hidden.shape={tuple(hidden.shape)} and data[{key!r}].shape={tuple(x.shape)}"
    check_covers(layout, "hidden", hidden.shape[1], x.shape[1], got, canonical=f"data[{key!r}]")
    return x


def _logprob_input(
    door: FrontDoor, loss_fn: Any, layout: SequenceLayout, sampling_params: TrainingSamplingParams | None
) -> dict[str, Tensor]:
    """`LOGPROB`: next-token log-probs `[B, S-1]` through the fused pipeline; with a top-k/top-p
    `sampling_params`, under the filtered softmax (`lossfx._kernels.linear_filtering`: one
    `[C, Vl]` row chunk at a time, two passes over the vocabulary), `-inf` masked as on the logits path."""
    if sampling_params is not None and not isinstance(sampling_params, TrainingSamplingParams):
        raise TypeError(f"sampling_params must be TrainingSamplingParams or None, got {sampling_params!r}")
    input_ids = _canonical(door.columns, "input_ids", door.hidden, 2, layout)
    check_integer_ids("data['input_ids']", input_ids)
    scored = input_ids[:, 1:]
    ignored = scored == door.call.head.ignore_index
    check_ids_in_range("data['input_ids']", scored.masked_fill(ignored, 0), door.size, column_offset=1)
    call = _uneven_vocab(door)
    top = resolve_filter(sampling_params)
    mask = None if top is None else loss_mask_from_data(door.columns, input_ids)  # before anything is computed

    def next_token(filter_: TopKTopP | None) -> Tensor:
        (out,) = _next_token.linear_next_token_logprobs(
            door.hidden,
            door.weight,
            input_ids,
            layout,
            call.vocab,
            head=call.head,
            chunk_rows=call.chunk_rows,
            top=filter_,
        )
        return out

    if top is None or mask is None:
        return {"next_token_logprobs": next_token(None)}
    logprobs = masked_out_neg_inf(next_token(top), mask[:, 1:], "curr_logprobs")
    if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0:
        door.data["curr_logprobs_unfiltered"] = next_token(None)
    return {"next_token_logprobs": logprobs}


def _distillation_input(door: FrontDoor, loss_fn: Any, layout: SequenceLayout) -> dict[str, Any]:
    """`DISTILLATION`: student/teacher log-probs at the teacher's top-k ids and `H_all`."""
    zero_outside_topk = bool(getattr(loss_fn, "zero_outside_topk", False))
    calculate_entropy = zero_outside_topk and getattr(loss_fn, "kl_type", "mixed") != "forward"
    ids = _canonical(door.columns, "teacher_topk_indices", door.hidden, 3, layout)
    values = check_tensor("data['teacher_topk_logits']", _column(door.columns, "teacher_topk_logits"))  # type: ignore[arg-type]
    check_integer_ids("data['teacher_topk_indices']", ids)
    check_floating("data['teacher_topk_logits']", values)
    if ids.shape[-1] < 1 or tuple(values.shape) != tuple(ids.shape):
        raise ValueError(
            "data['teacher_topk_logits'] and data['teacher_topk_indices'] must share one [B, S, K] shape with K >= 1; "
            f"got {tuple(values.shape)} and {tuple(ids.shape)}"
        )
    check_ids_in_range("data['teacher_topk_indices']", ids, door.size)
    call = _uneven_vocab(door)
    student, teacher, neg_entropy = _distillation.linear_distillation_topk_logprobs(
        door.hidden,
        door.weight,
        values,
        ids,
        call.vocab,
        layout,
        head=call.head,
        zero_outside_topk=zero_outside_topk,
        calculate_entropy=calculate_entropy,
        chunk_rows=call.chunk_rows,
    )
    return {"student_topk_logprobs": student, "teacher_topk_logprobs": teacher, "H_all": neg_entropy}


def _draft_input(door: FrontDoor, d2t: Tensor | None, layout: SequenceLayout) -> dict[str, Any]:
    """`DRAFT`: shifted teacher logits in the draft vocabulary (this rank's `D/R` shard) and the
    shifted mask, from the head's `D` draft rows only."""
    student_logits = _column(door.data, "student_logits")  # type: ignore[arg-type]  # (passed through)
    token_mask = _canonical(door.columns, "token_mask", door.hidden, 2, layout)
    target_ids = None
    d2t = replicated(d2t, "d2t")
    if d2t is not None:
        check_integer_ids("d2t", d2t)
        world = group_size(door.call.vocab.group)
        if d2t.dim() != 1 or d2t.shape[0] % world:
            raise ValueError(
                f"d2t must be 1-D [D] with D divisible by the tensor-parallel size {world}, "
                f"got shape {tuple(d2t.shape)}"
            )
        target_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t.to(torch.int64)
        check_ids_in_range("d2t targets (i + d2t[i])", target_ids, door.size)
    call = _uneven_vocab(door)
    teacher, mask = _draft.linear_draft_targets(
        door.hidden, door.weight, token_mask, target_ids, call.vocab, layout, head=call.head
    )
    return {"teacher_logits": teacher, "student_logits": student_logits, "token_mask": mask}


@boundary(roles=_ROLES_PACKED, vocab="auto", local=local_view(_ROLES_PACKED), unwrapped=True)
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
    input_type = _input_type(loss_fn)
    if input_type is not LossInputType.LOGPROB:
        raise ValueError(
            f"prepare_linear_packed_loss_input only supports LossInputType.LOGPROB, got {input_type}; "
            "use prepare_linear_loss_input per sequence for other types"
        )
    # hidden, lm_head_weight, bias, data: local (the boundary's one unwrap, `local_view`); data: the caller's
    door = _front_door(_view, _widths, True)
    hidden, weight, columns, shard, call = door.hidden, door.weight, door.columns, door.shard, door.call
    input_ids = check_tensor("data['input_ids']", _column(columns, "input_ids"))  # type: ignore[arg-type]
    # the packed checks read shapes only: a zero-stride stand-in for the [1, T/C, Vl] logits
    stand_in = hidden.new_zeros(()).expand(1, hidden.shape[1], weight.shape[0])
    _, input_ids, layout, vocab, options = _validated_packed(
        stand_in,
        input_ids,
        cu_seqlens_q,
        cu_seqlens_q_padded,
        prepacked="cu_seqlens" in columns,
        vocab_parallel_group=shard.group,
        context_parallel_group=context_parallel_group,
        sampling_params=sampling_params,
        chunk_size=chunk_size,
        vocab_start=shard.vocab_start,
        vocab_size=shard.vocab_size,
        ids_name="data['input_ids']",
        widths=door.widths if shard.dtensor is None and shard.group is not None else None,
    )
    call = call._replace(vocab=vocab)
    top = resolve_filter(sampling_params)
    mask = None if top is None else loss_mask_from_data(columns, input_ids)

    def kernel(target: Tensor) -> list[Tensor]:  # [1, T/C] -> [1, T/C]
        if filter_ is not None:
            return [
                _filtered.linear_filtered_token_logprobs(
                    hidden,
                    weight,
                    target,
                    call.vocab,
                    top_k=filter_.top_k,
                    top_p=filter_.top_p,
                    ties=filter_.ties,
                    head=call.head,
                )
            ]
        out, _ = _kernel.linear_token_logprobs(
            hidden,
            weight,
            target,
            call.vocab,
            head=call.head,
            chunk_rows=options["chunk_rows"] or 0,
        )
        return [out]

    filter_: TopKTopP | None = None

    def next_token() -> Tensor:
        # fill 0, as the logits path: a padded slot scores the zero-padded token id 0 (kept, the
        # reference's rule), and a slot without any next token is dropped by the layout
        (out,) = score_next_tokens(layout, input_ids.to(hidden.device), hidden.shape[1], kernel)
        return out

    if top is None or mask is None:
        return {"next_token_logprobs": next_token()}, door.data
    unfiltered = next_token() if getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0 else None
    filter_ = top
    logprobs = masked_out_neg_inf(next_token(), mask[:, 1:], "curr_logprobs")
    if unfiltered is not None:
        door.data["curr_logprobs_unfiltered"] = unfiltered
    return {"next_token_logprobs": logprobs}, door.data
