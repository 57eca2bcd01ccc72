"""Full-vocabulary on-policy distillation (`LossInputType.OPD_FULL`): teacher logits and the branch.

Pipeline of `opd_full_input` (NeMo RL's OPD_FULL branch, behind `lossfx.prepare_opd_full_loss_input`;
docs/opd_full.md, docs/decisions.md §3):

1. read the config `loss_fn.opd_full` and the teacher payload column (`teacher_full_logits`
   `[B, S_p, V]`, or `teacher_full_hidden_states` `[B, S_p, H]` with the per-row
   `opd_full_teacher_index` `[B]`);
2. `reconstruct_opd_full_teacher_logits`: slice this rank's vocabulary window (logits) or project
   through the per-teacher LM-head shards (hidden states), zero-pad the sequence to the student's
   window `S_l·C`, and take this rank's part in the student's sequence layout
   (`lossfx.sequence_layout`: load-balanced CP, or an external `cp_sharder`) -> `[B, S_l, Vl]`, detached;
3. the reverse KL `[B, S_l]` (lossfx.divergence, differentiable in the student), and with
   `validate_decomposition` the entropy and cross-entropy as metrics (nothing saved for them);
4. back to canonical order (`SequenceLayout.to_canonical`; lossfx's CP all-gather sums its
   backward over CP ranks: divide the loss by `C`);
5. the slice to the next-token width `S − 1`; with a nonzero `reference_policy_kl_penalty`, the
   unfiltered `next_token_logprobs` (CP-aware).

`vocab_parallel_group=None` works (the reference raises), on CPU and in float64.

The boundary: `reconstruct_opd_full_teacher_logits` unwraps its DTensors once (the student's
shard, the replicated payload, each teacher head as this rank's rows: `local_heads`);
the entry points' OPD_FULL branch (`opd_full_input`) runs on the local tensors of
`lossfx.loss_input`'s one unwrap, the same for every branch. Each validates the config, columns,
payload and heads, range-checks the ids once, then calls the pure code in
`lossfx._layouts.opd_full` once. No re-entry on local tensors, and no public function calls another.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import VocabShard, local_view, replicated, resolved_shard
from lossfx._boundary.validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
    check_tensor,
    values_checkable,
)
from lossfx._core import host_reads as _host_reads
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx._core.vocab import VocabRange
from lossfx._layouts import opd_full as _pure
from lossfx.interfaces import wants_reference_kl
from lossfx.next_token import resolved_vocab, tp_rank
from lossfx.sequence_layout import ContextParallelSharder, SequenceLayout, check_covers, sequence_layout

__all__ = [
    "OnPolicyDistillationFullConfig",
    "reconstruct_opd_full_teacher_logits",
]

_PAYLOAD_COLUMNS = {"hidden_states": "teacher_full_hidden_states", "logits": "teacher_full_logits"}
TEACHER_INDEX_FIELD = "opd_full_teacher_index"


@dataclass(frozen=True)
class OnPolicyDistillationFullConfig:
    """The `loss_fn.opd_full` config (any object with these attributes is accepted too).

    Args:
        enabled: whether the loss uses OPD_FULL (read by the loss construction, not here).
        teacher_payload: `"hidden_states"` (project through the teacher LM head) or `"logits"`.
        divergence: `"reverse_kl"` (the only one).
        payload_dtype: `"bfloat16"`, `"float16"` or `"float32"` (transport dtype; informational).
        chunk_size: sequence positions per eager chunk of the divergence kernels, `>= 1` or
            `None` (a memory bound; results do not depend on it).
        teacher_lm_head_lifecycle: `"none"`, `"offload"` or `"evict"` (informational).
        validate_decomposition: also return the entropy and cross-entropy metrics.

    Raises:
        ValueError: a value outside its set, `chunk_size < 1`.
    """

    enabled: bool = False
    teacher_payload: str = "hidden_states"
    divergence: str = "reverse_kl"
    payload_dtype: str = "bfloat16"
    chunk_size: int | None = None
    teacher_lm_head_lifecycle: str = "offload"
    validate_decomposition: bool = False

    def __post_init__(self) -> None:
        for name in _CHOICES:
            _check_choice(name, getattr(self, name))
        _check_chunk(self.chunk_size)


_CHOICES = {
    "teacher_payload": tuple(_PAYLOAD_COLUMNS),
    "divergence": ("reverse_kl",),
    "payload_dtype": ("bfloat16", "float16", "float32"),
    "teacher_lm_head_lifecycle": ("none", "offload", "evict"),
}


def _check_choice(name: str, value: Any) -> Any:
    """A config field `name` of `_CHOICES`, else `ValueError` (the dataclass, a duck-typed config's
    `teacher_payload` in the branch, `reconstruct_opd_full_teacher_logits`' argument)."""
    if value not in _CHOICES[name]:
        raise ValueError(f"on_policy_distillation.full.{name} must be one of {_CHOICES[name]}, got {value!r}")
    return value


def _check_chunk(chunk_size: Any) -> Any:
    """`chunk_size` of the config: an int `>= 1` or `None`, else `ValueError`."""
    bad = isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1
    if chunk_size is not None and bad:
        raise ValueError(f"on_policy_distillation.full.chunk_size must be >= 1, got {chunk_size!r} (an int or None)")
    return chunk_size


# ---------------------------------------------------------------------------------------------
# The teacher: validated once, at the boundary (the pure alignment is lossfx._layouts.opd_full)
# ---------------------------------------------------------------------------------------------


class _Teacher(NamedTuple):
    """The validated teacher, as the pure code takes it: a logits payload's `columns = (start, Vl)`,
    or the LM-head shards and each row's position in them (`None` with one head): the keywords of
    `lossfx._layouts.opd_full.teacher_logits` and `.opd_full_loss_input` (`**teacher._asdict()`)."""

    columns: tuple[int, int] | None
    heads: list[Tensor] | None
    position: Tensor | None


def _validated_teacher(
    payload: Tensor,
    *,
    teacher_payload: str,
    student_logits: Tensor,
    vocab_parallel_rank: int | None,
    layout: SequenceLayout,
    teacher_output_layer_weight_by_index: dict[Any, Tensor] | None,
    teacher_index: Tensor | None,
    vocab_start: int | None = None,
) -> _Teacher:
    """Every check of the teacher payload and heads against this rank's `student_logits [B, S_l, Vl]`
    (NeMo's payload-reconstruction errors, docs/decisions.md §3), before any work; the caller
    checked `teacher_payload` (`_check_choice`) and the student's rank. A logits
    payload's window starts at `vocab_start` (default `vocab_parallel_rank · Vl`). The heads: one
    shard shape and dtype, in a list, with each payload row's position in it (`None` with one head
    and no index); in eager mode every row's head must be loaded (that check reads values)."""
    check_floating("payload", payload)
    if payload.dim() != 3 or payload.shape[0] != student_logits.shape[0]:
        raise ValueError(
            f"the teacher payload must be [B, S_p, D] with the student's batch size; got payload.shape="
            f"{tuple(payload.shape)} and student_logits.shape={tuple(student_logits.shape)}"
        )
    local_vocab = student_logits.shape[-1]
    weights = teacher_output_layer_weight_by_index or {}
    columns = None
    if teacher_payload == "hidden_states":
        if not weights:
            raise ValueError(
                "opd_full teacher_payload='hidden_states' requires a loaded teacher output-layer "
                "weight shard "
                "(teacher_output_layer_weight_by_index is empty or None)"
            )
        if len(weights) > 1 and teacher_index is None:
            raise ValueError(
                f"{len(weights)} teacher LM-head shards loaded (>1 shards) but no per-row teacher index "
                f"('{TEACHER_INDEX_FIELD}') was given"
            )
        first = min(weights)  # every head checked in key order, each against the first
        for key in sorted(weights):
            weight = check_floating(f"teacher_output_layer_weight_by_index[{key!r}]", weights[key])
            if weight.dim() != 2:
                raise ValueError(
                    f"teacher_output_layer_weight_by_index[{key!r}] must be a [V_local, H] LM-head shard, got shape "
                    f"{tuple(weight.shape)}"
                )
            if payload.shape[-1] != weight.shape[1]:
                raise ValueError(
                    f"Teacher hidden states do not match the loaded teacher LM head for teacher_index={key}: "
                    f"payload width {payload.shape[-1]} vs LM-head input width {weight.shape[1]}"
                )
            if (weight.shape[0], weight.dtype) != (weights[first].shape[0], weights[first].dtype):
                raise ValueError(
                    "teacher LM heads must share one vocabulary shard and dtype; got "
                    f"{tuple(weight.shape)}/{weight.dtype} for teacher_index={key} vs "
                    f"{tuple(weights[first].shape)}/{weights[first].dtype} for teacher_index={first}"
                )
    else:
        if vocab_parallel_rank is None:
            raise ValueError("vocab_parallel_rank is required to slice the opd_full logits payload (use 0 without TP)")
        start = vocab_parallel_rank * local_vocab if vocab_start is None else vocab_start
        end = start + local_vocab
        if payload.shape[-1] < end:
            raise ValueError(
                "Teacher logits payload is narrower than this rank's vocabulary window: payload width "
                f"{payload.shape[-1]} vs required end {end} "
                f"(rank {vocab_parallel_rank}, V_local {local_vocab})"
            )
        columns = (start, local_vocab)
    local_len = student_logits.shape[1]
    window = layout.window(local_len)
    if window is not None and payload.shape[1] > window:
        raise ValueError(
            f"Teacher payload is longer than the student forward window: {payload.shape[1]} vs "
            f"{window} (= S_l {local_len} · CP {layout.cp_size})"
        )
    if teacher_payload != "hidden_states":
        return _Teacher(columns, None, None)
    heads, position, batch, device = list(weights.values()), None, payload.shape[0], student_logits.device
    if teacher_index is not None:
        check_integer_ids("teacher_index", teacher_index)
        teacher_index = teacher_index.to(device).reshape(-1)
        if teacher_index.shape[0] != batch:
            raise ValueError(
                f"teacher_index must carry one entry per payload row: got {teacher_index.shape[0]} entries for "
                f"{batch} rows"
            )
        # position of each row's key in `heads` (an unloaded key, unchecked under compile, reads 0)
        key_values = torch.tensor(list(weights), dtype=torch.int64, device=device)  # [K], in `heads`' order
        matches = teacher_index.to(torch.int64)[:, None] == key_values[None, :]  # [B, K]

        def raise_if_unloaded(values: list[int]) -> None:
            if values[0]:
                raise ValueError(
                    f"row tagged teacher_index={values[1]}, but no teacher LM head is loaded for that index "
                    f"(loaded: {sorted(weights)})"
                )

        if values_checkable(teacher_index) and teacher_index.numel():  # read with the call's other checks
            unloaded = ~matches.any(dim=-1)  # [B]
            smallest = torch.where(unloaded, teacher_index.to(torch.int64), torch.iinfo(torch.int64).max).min()
            _host_reads.defer(torch.stack([unloaded.any().to(torch.int64), smallest]), raise_if_unloaded)
        position = matches.to(torch.int64).argmax(dim=-1)  # [B]
    width = heads[0].shape[0]
    if width != local_vocab:
        raise ValueError(
            "Reconstructed teacher logits must match the student vocabulary shard width; got "
            f"{width} vs {local_vocab} (the teacher LM heads have {width} rows; pass this rank's {local_vocab} rows "
            "of each head, split like the student logits, or the head as a Shard(0) DTensor on the logits' mesh)"
        )
    return _Teacher(None, heads, position)


def _payload_view(arguments: dict[str, Any], shard: VocabShard) -> None:
    """The payload replicated, a logits payload padded like the student's even shard."""
    payload = replicated(arguments["payload"], "payload")
    arguments["payload"] = shard.pad_full(payload) if arguments["teacher_payload"] == "logits" else payload


# the one unwrap of `reconstruct_opd_full_teacher_logits` (`local_view`): the student's shard (even for a
# logits payload: a projection needs no even width), the payload and index replicated, each head this rank's rows
_RECONSTRUCT_VIEW = local_view(
    Roles(shards=("student_logits",), rank="vocab_parallel_rank", heads="teacher_output_layer_weight_by_index"),
    even=lambda arguments: arguments["teacher_payload"] == "logits",
    then=_payload_view,
)


@boundary(collectives=False, local=_RECONSTRUCT_VIEW)
def reconstruct_opd_full_teacher_logits(
    payload: Tensor,
    *,
    teacher_payload: str,
    student_logits: Tensor,
    vocab_parallel_rank: int | None,
    context_parallel_group: ProcessGroup | None,
    teacher_output_layer_weight_by_index: dict[Any, Tensor] | None = None,
    teacher_index: Tensor | None = None,
    output_dtype: torch.dtype | None = None,
    cp_sharder: ContextParallelSharder | None = None,
    _view: dict[str, Any] | None = None,
) -> Tensor:
    """This rank's teacher logits `[B, S_l, Vl]`, aligned with the student's `[B, S_l, Vl]`.

    Equivalent (no TP, no CP, logits payload) to
    ``torch.nn.functional.pad(payload, (0, 0, 0, S_l - S_p))``.

    Args:
        payload: canonical `[B, S_p, D]` teacher payload (already gathered on the teacher side,
            any device): full-vocabulary logits (`D >= (rank+1)·Vl`) or hidden states (`D = H`).
        teacher_payload: `"logits"` or `"hidden_states"`.
        student_logits: `[B, S_l, Vl]` this rank's student logits (shape and device only).
        vocab_parallel_rank: this rank's TP index (the vocabulary window is
            `[rank·Vl, (rank+1)·Vl)`); required for the logits payload (pass 0 without TP).
        context_parallel_group: CP group or `None`; with `C > 1` the padded payload
            (`S_l·C` long) is split in the load-balanced layout.
        teacher_output_layer_weight_by_index: `{teacher_index: W [Vl, H]}` LM-head shards
            (hidden states only), split like `student_logits`: this rank's rows or a `Shard(0)`
            DTensor on its mesh.
        teacher_index: `[B]` integer teacher of each row; required with more than one head.
        output_dtype: dtype of projected logits (`None`: the head's dtype). The logits payload
            keeps its dtype.
        cp_sharder: an external layout (`shard_token_tensor` / `gather_token_tensor`: the payload
            is handed to it unpadded) or a `lossfx.sequence_layout.SequenceLayout`; takes
            precedence over `context_parallel_group`.

    Returns:
        `[B, S_l, Vl]` on the student's device (not detached: the caller detaches).

    Raises:
        ValueError: every error condition of NeMo's payload reconstruction (docs/decisions.md §3):
            no/unusable LM head, several heads without a row index, width mismatches, a row tagged with an
            unloaded head, heads of different shard width or dtype, a payload narrower than this rank's
            vocabulary window or longer than the student's window, a result whose width is not
            `Vl`; also a bad `teacher_payload`, a payload that is not `[B, S_p, D]` or whose
            batch differs from the student's. (The per-row head check reads values and runs in
            eager mode only.)
    """
    shard, student = resolved_shard(_view), student_logits  # local (`_RECONSTRUCT_VIEW`)
    _check_choice("teacher_payload", teacher_payload)
    if check_tensor("student_logits", student).dim() != 3:
        raise ValueError(f"Student logits must be rank 3 [B, S, V_local]; got shape {tuple(student.shape)}")
    layout = sequence_layout(context_parallel_group, cp_sharder)
    teacher = _validated_teacher(
        payload,
        teacher_payload=teacher_payload,
        student_logits=student,
        vocab_parallel_rank=vocab_parallel_rank,  # a DTensor's, else as given
        layout=layout,
        teacher_output_layer_weight_by_index=teacher_output_layer_weight_by_index,
        teacher_index=teacher_index,
    )
    local_len, device = student.shape[1], student.device
    out = _pure.teacher_logits(payload, layout, local_len, device, output_dtype=output_dtype, **teacher._asdict())
    return shard.wrap(out)


# ---------------------------------------------------------------------------------------------
# The branch
# ---------------------------------------------------------------------------------------------


class OpdFullCall(NamedTuple):
    """A validated OPD_FULL call (`validated_opd_full`), as the pure layouts take it."""

    cfg: Any  # loss_fn.opd_full
    payload: Tensor  # the teacher payload column
    input_ids: Tensor  # [B, S]
    student: Tensor  # the logits the divergence sees (a short rank's padding columns dropped)
    teacher: _Teacher
    vocab: VocabRange  # this rank's
    kl: bool  # the reference-KL term's log-probs are asked for (its ids range-checked)
    chunk_rows: int | None  # the config's chunk_size · B


def validated_opd_full(
    logits: Tensor,
    data: Mapping[str, Any],
    loss_fn: Any,
    *,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: ProcessGroup | None,
    layout: SequenceLayout,
    chunk_size: int | None,
    teacher_output_layer_weight_by_index: dict[Any, Tensor] | None,
    teacher_logits_dtype: torch.dtype | None,
    logits_name: str = "logits",
    vocab_size: int | None = None,
    **vocab: Any,
) -> OpdFullCall:
    """The boundary work of an OPD_FULL call on local tensors, once: the config, the arguments and
    columns, the teacher (`_validated_teacher`) and, with a reference-KL term, one range check of
    `input_ids`; all before any work (`data` is never modified). Shared by the logits path's two
    faces and the fused front door (`logits_name`: its stand-in for the logits of its hidden
    states; `vocab`: its head's `vocab_start`, `widths`, as `lossfx.next_token.resolved_vocab` takes
    them). `vocab_size`: `V` of a vocabulary-parallel DTensor shard (which of its columns are real)."""
    group = vocab_parallel_group
    cfg = getattr(loss_fn, "opd_full", None)  # the config (`OnPolicyDistillationFullConfig` or alike) and columns
    if cfg is None:
        raise ValueError("LossInputType.OPD_FULL requires loss_fn.opd_full (an OnPolicyDistillationFullConfig)")
    teacher_payload = _check_choice("teacher_payload", getattr(cfg, "teacher_payload", "hidden_states"))
    cfg_chunk = _check_chunk(getattr(cfg, "chunk_size", None))
    for what, key in (("teacher payload column", _PAYLOAD_COLUMNS[teacher_payload]), ("column", "input_ids")):
        if key not in data:
            raise ValueError(
                f"opd_full requires the {what} {key!r} in the training microbatch; data has {sorted(data)}"
            )
    check_positive_int("chunk_size", chunk_size)
    if teacher_logits_dtype is not None and (
        not isinstance(teacher_logits_dtype, torch.dtype) or not teacher_logits_dtype.is_floating_point
    ):
        raise TypeError(f"teacher_logits_dtype must be a floating torch.dtype or None, got {teacher_logits_dtype!r}")
    check_floating(logits_name, logits)
    if logits.dim() != 3:
        raise ValueError(f"Student logits must be rank 3 [B, S, V_local]; got shape {tuple(logits.shape)}")
    rank = tp_rank(vocab_parallel_rank, group)
    input_ids = check_integer_ids("data['input_ids']", data["input_ids"])
    got = f"input_ids.shape={tuple(input_ids.shape)} and {logits_name}.shape={tuple(logits.shape)}"
    if input_ids.dim() != 2 or input_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"input_ids must be [B, S] with the logits' batch size; got {got}")
    seq = input_ids.shape[1]
    window = layout.window(logits.shape[1])
    if window is not None and seq > window:
        raise ValueError(
            f"input_ids has {seq} positions, more than the student window S_l·CP = {logits.shape[1]}·{layout.cp_size}"
        )
    # the student the divergence sees: a short rank's -inf padding columns dropped for a projected
    # teacher (exact: they hold no probability), so its columns are the teacher heads' rows
    student = logits
    if vocab_size is not None and group is not None and teacher_payload == "hidden_states":
        width, ranks = logits.shape[-1], group_size(group)
        if (ranks - 1) * width >= vocab_size:  # the same verdict on every rank
            raise ValueError(
                f"a vocabulary of V={vocab_size} split over {ranks} ranks leaves the last rank(s) no rows "
                f"(torch's split: {width} per rank); a hidden-states teacher needs every rank to hold at "
                "least one vocabulary row: use fewer ranks or pad the vocabulary"
            )
        real = min(vocab_size - rank * width, width)
        student = logits.narrow(-1, 0, real) if real < logits.shape[-1] else logits
    # the reference-KL term's ids, range-checked once (padded logits: V is the real size)
    kl = wants_reference_kl(loss_fn)
    if kl:
        check_covers(layout, logits_name, logits.shape[1], seq, got)
    check = functools.partial(check_ids_in_range, "data['input_ids']", input_ids) if kl else None
    resolved = resolved_vocab(group, logits.shape[-1], check, vocab_size=vocab_size, **vocab)
    # this rank's teacher, validated: a logits payload's window, or the LM-head shards
    payload = data[_PAYLOAD_COLUMNS[teacher_payload]]
    teacher = _validated_teacher(
        payload,
        teacher_payload=teacher_payload,
        student_logits=student,
        vocab_parallel_rank=rank,
        layout=layout,
        teacher_output_layer_weight_by_index=teacher_output_layer_weight_by_index,
        teacher_index=data.get(TEACHER_INDEX_FIELD) if teacher_payload == "hidden_states" else None,
        vocab_start=resolved.start if group is not None else None,
    )
    chunk_rows = None if cfg_chunk is None else int(cfg_chunk) * logits.shape[0]
    return OpdFullCall(cfg, payload, input_ids, student, teacher, resolved, kl, chunk_rows)


# the arguments of `validated_opd_full` that the view of an entry point's call holds (and a DTensor's `vocab_size`)
_VIEW_ARGUMENTS = (
    "logits data loss_fn vocab_parallel_rank vocab_parallel_group chunk_size teacher_output_layer_weight_by_index "
    "teacher_logits_dtype"
).split()


def opd_full_input(view: Mapping[str, Any] | None) -> dict[str, Any]:
    """An OPD_FULL call on the `view` of its one unwrap (`lossfx.loss_input`: the logits' even
    shard, the local columns, each teacher head as this rank's rows and, for a DTensor shard,
    `vocab_size = V`, which of its columns are real; the arguments of
    `lossfx.prepare_opd_full_loss_input`, which `prepare_loss_input`'s OPD_FULL branch shares):
    `validated_opd_full` once, then the pure `lossfx._layouts.opd_full.opd_full_loss_input` once.
    No cross-rank check here (their `boundary` runs it)."""
    assert view is not None, "boundary(local=...) hands the body its view"
    layout = sequence_layout(view["context_parallel_group"], view["cp_sharder"])
    arguments = {key: view[key] for key in _VIEW_ARGUMENTS}
    call = validated_opd_full(**arguments, layout=layout, vocab_size=view.get("vocab_size"))
    return _pure.opd_full_loss_input(
        call.student,
        call.payload,
        call.input_ids.shape[1],
        layout,
        view["vocab_parallel_group"],
        **call.teacher._asdict(),  # its columns, heads, position
        validate_decomposition=bool(getattr(call.cfg, "validate_decomposition", False)),
        chunk_rows=call.chunk_rows,
        teacher_logits_dtype=view["teacher_logits_dtype"],
        logprobs=(view["logits"], call.input_ids, call.vocab, view["chunk_size"]) if call.kl else None,
    )
