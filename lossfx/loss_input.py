"""Loss-input preparation: logits in, the dict a loss function consumes out.

A drop-in for NeMo RL's `nemo_rl.algorithms.loss.loss_input` (same names, arguments, dict keys),
built on lossfx's kernels. `prepare_loss_input` dispatches on `loss_fn.input_type`:

1. `LOGIT` returns the logits unchanged;
2. `LOGPROB` returns next-token log-probs `[B, S-1]` (tensor-parallel vocabulary shard,
   top-k/top-p filter, chunked);
3. `DISTILLATION` returns student/teacher log-probs at the teacher's top-k ids
   (`lossfx.distillation`);
4. `DRAFT` returns the shifted teacher logits in the draft vocabulary (`lossfx.draft`);
5. `OPD_FULL` returns full-vocabulary on-policy distillation divergences (`lossfx.opd_full`).

The sequence layout (`lossfx.sequence_layout`: none, load-balanced context parallelism, an
external `cp_sharder`) is built once here from `context_parallel_group=` / `cp_sharder=` and
handed to the branch, so every input type but `LOGIT` works in every layout.

Packed sequences go through `prepare_packed_loss_input` (`LOGPROB` only).

`data` is never modified except for the documented `curr_logprobs_unfiltered` column; a call that
raises leaves it untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, ShardWidths, boundary
from lossfx._boundary.dtensor import CALLER, SHARD, VocabShard, local_view
from lossfx._boundary.validation import check_floating, check_group, check_tensor
from lossfx._core.distributed import ProcessGroup
from lossfx._core.numerics import compute_dtype
from lossfx._layouts import draft as _draft
from lossfx._layouts import packing as _packing
from lossfx.distillation import _distillation
from lossfx.draft import _wrap_draft, validated_draft
from lossfx.interfaces import LossInputType, TrainingSamplingParams, need_top_k_or_top_p_filtering, wants_reference_kl
from lossfx.logprobs import check_ignore_index
from lossfx.loss_masks import loss_mask_from_data, masked_out_neg_inf
from lossfx.next_token import next_token_logprobs_of, resolve_filter, validated_next_token_call
from lossfx.next_token import tp_rank as _vocab_parallel  # (the fused front door's name for it too)
from lossfx.opd_full import _PAYLOAD_COLUMNS, TEACHER_INDEX_FIELD, opd_full_input
from lossfx.packing import _validated_packed
from lossfx.sequence_layout import SequenceLayout, sequence_layout

__all__ = [
    "next_token_logprobs",
    "prepare_loss_input",
    "prepare_opd_full_loss_input",
    "prepare_packed_loss_input",
]

_HEADS = "teacher_output_layer_weight_by_index"


def _input_type(loss_fn: Any, packed: str = "") -> LossInputType:
    """`loss_fn.input_type` as a `LossInputType`; `packed`: the name of a packed entry point (its
    `_packed_loss_input` left out: `prepare`, `prepare_linear`), which takes `LOGPROB` only."""
    if not hasattr(loss_fn, "input_type"):
        raise TypeError(f"loss_fn must have an `input_type` attribute, got {type(loss_fn).__name__}")
    try:
        input_type = LossInputType(loss_fn.input_type)
    except ValueError:
        raise ValueError(f"Unknown loss function input type: {loss_fn.input_type!r}") from None
    if packed and input_type is not LossInputType.LOGPROB:
        raise ValueError(
            f"{packed}_packed_loss_input only supports LossInputType.LOGPROB, got {input_type}; "
            f"use {packed}_loss_input per sequence for other types"
        )
    return input_type


def _column(data: MutableMapping[str, Any], name: str) -> Any:
    if name not in data:
        raise ValueError(f"data must contain the column {name!r}; it has {sorted(data.keys())}")
    return data[name]


_OPD_COLUMNS = (*_PAYLOAD_COLUMNS.values(), TEACHER_INDEX_FIELD)  # the payload read, by the config
# the attributes of `loss_fn` the entry points read (`getattr`; `interfaces.LossFunction`, `opd_full`'s config)
_LOSS_FN_READS = (
    "input_type",
    "use_fused_linear_logprobs",
    "reference_policy_kl_penalty",
    "zero_outside_topk",
    "kl_type",
    "opd_full.teacher_payload",
    "opd_full.chunk_size",
    "opd_full.validate_decomposition",
)


def _input_name(arguments: Mapping[str, Any]) -> str:
    """The name of the call's input type (`"LOGPROB"`; a string type as given, upper-cased)."""
    input_type = getattr(arguments.get("loss_fn"), "input_type", None)
    return getattr(input_type, "name", str(input_type)).upper()


def _vocab_policy(arguments: Mapping[str, Any]) -> str:
    """The `vocab` policy of `prepare_loss_input`: uneven shards (`"auto"`) for the log-prob and
    logits branches, equal shards for the others."""
    return "auto" if _input_name(arguments).endswith(("LOGPROB", "LOGIT")) else "equal"


def _data_read(arguments: Mapping[str, Any]) -> tuple[str, ...]:
    """The `data` columns a call reads: the cross-rank check compares these and no others (a
    training microbatch carries many columns a branch never reads; they may differ per rank)."""
    name = _input_name(arguments)
    if name.endswith("DISTILLATION"):
        return ("teacher_topk_logits", "teacher_topk_indices")
    if name.endswith("DRAFT"):
        return ("token_mask", "student_logits")
    if name.endswith("OPD_FULL"):
        return ("input_ids", *_OPD_COLUMNS)
    if name.endswith("LOGIT"):
        return ()
    sampling = arguments.get("sampling_params")  # LOGPROB: the masks only under a filter
    filtered = not isinstance(sampling, TrainingSamplingParams) or need_top_k_or_top_p_filtering(sampling)
    return ("input_ids", "cu_seqlens") + ("token_mask", "sample_mask") * (sampling is not None and filtered)


# the cross-rank check's view of the parameters (`_boundary.consistency.Roles`)
_ROLES = Roles(
    tp="vocab_parallel_group",
    cp="context_parallel_group",
    shards=("logits",),
    rank="vocab_parallel_rank",
    reads=("data", _data_read),
    shard_columns=("student_logits",),  # DRAFT's: this rank's shard of the draft vocabulary (and of the sequence)
    columns=("teacher_full_logits",),  # OPD_FULL's logits payload: vocabulary-wide, padded like the logits
    attrs=("loss_fn", _LOSS_FN_READS),  # what the entry points read of `loss_fn`, all of it
)
_ROLES_SHARDER = dataclasses.replace(_ROLES, cp_from="cp_sharder")
# `vocab_size`: filled in by the DTensor view of an OPD_FULL call (`_unwrap`)
_ROLES_ALL = dataclasses.replace(_ROLES_SHARDER, heads="teacher_output_layer_weight_by_index", size="vocab_size")


@boundary(
    roles=_ROLES_SHARDER,
    vocab="auto",
    local=local_view(_ROLES_SHARDER, even=True),
)
def next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    cp_sharder: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    position_ids: Tensor | None = None,
    ignore_index: int | None = None,
    _widths: ShardWidths | None = None,
) -> Tensor:
    """Next-token log-probs: position `t` scores token `input_ids[:, t+1]`.

    Equivalent to ``logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]``
    on the full-vocabulary, canonical logits, without slicing (so without copying) the logits.

    Args:
        logits: `[B, S_l, Vl]` this rank's vocabulary shard (the full vocabulary without TP) and
            sequence part (load-balanced under context parallelism; `S_l = S` without). Eager:
            shards may have different widths (rank order); compiled: equal widths.
        input_ids: `[B, S]` canonical integer token ids in `[0, V)`, `V` the shards' widths summed.
        vocab_parallel_rank: this rank's index in `vocab_parallel_group`.
        vocab_parallel_group: tensor-parallel group over the vocabulary, or `None`.
        context_parallel_group: context-parallel group (load-balanced layout), or `None`.
        cp_sharder: a `lossfx.next_token.ContextParallelSharder` owning the sequence layout.
        sampling_params: top-k/top-p filter; filtered-out tokens get `-inf`.
        chunk_size: sequence positions per eager chunk (a memory bound; results do not depend
            on it).
        position_ids: `[B, S]` canonical positions of padding-free rows (several sequences per
            row, each restarting at 0), or `None`: each sequence's last position (where
            `position_ids[:, t+1] == 0`) gets 0 and a zero gradient instead of scoring the next
            sequence's first token (``reference.next_token_logprobs(..., position_ids=)``).
        ignore_index: an id of `input_ids` that scores nothing (Hugging Face's `-100`): a
            position `t` whose `input_ids[:, t+1]` equals it gets 0 and a zero gradient, and is no
            range error. Default `None`: every id must lie in `[0, V)` (NeMo's contract, kept by
            `prepare_loss_input`). Dense equivalent:
            ``torch.where(input_ids[:, 1:] == ignore_index, 0, out)``.

    Returns:
        `[B, S-1]` in the compute dtype (fp32, or float64 for float64 logits); replicated on
        every tensor- and context-parallel rank. Each TP rank's gradient is its own shard's; under
        CP the gradient is summed over CP ranks (divide the loss by the CP size).
    """
    if ignore_index is not None:
        check_ignore_index(ignore_index)
    _vocab_parallel(vocab_parallel_rank, vocab_parallel_group)
    call = validated_next_token_call(
        logits,
        input_ids,
        group=vocab_parallel_group,
        layout=sequence_layout(context_parallel_group, cp_sharder),
        chunk_size=chunk_size,
        position_ids=position_ids,
        widths=ShardWidths() if _widths is None else _widths,
        ignore_index=ignore_index,
    )
    return next_token_logprobs_of(call, resolve_filter(sampling_params))


def _unwrap(roles: Roles, opd: bool = False) -> Callable[[dict[str, Any]], tuple[dict[str, Any], str]]:
    """The one unwrap of an entry point's DTensors, the same for every branch (`local_view` of its
    roles: without a DTensor anywhere, the arguments as given): the logits their even local shard
    (`-inf` columns on a short rank), the `data` columns the call reads local, the teacher heads
    this rank's rows; an OPD_FULL call (`opd`, or its input type) gets `vocab_size = V` of a
    vocabulary-parallel shard (which of its columns are real). The shard (`SHARD`) and the
    caller's `data` (`CALLER`) are the body's (`_back`)."""

    def opd_size(arguments: dict[str, Any], shard: VocabShard) -> None:
        if _HEADS in arguments and (opd or _input_name(arguments).endswith("OPD_FULL")):
            arguments["vocab_size"] = shard.vocab_size if shard.group is not None else None

    return local_view(roles, even=True, when_dtensor=True, then=opd_size)


def _unwrapped(view: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(view, before)`: the call's one unwrap (`_unwrap`: every argument, local) and, with DTensors,
    its local `data` as it was (`_back` tells the columns the branch wrote from it)."""
    assert view is not None, "boundary(local=...) hands the body its view"
    return view, dict(view["data"]) if view.get(SHARD) is not None else {}


def _back(
    view: Mapping[str, Any], before: Mapping[str, Any], loss_input: dict[str, Any]
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """`(loss_input, data)` for the caller: with DTensors (the view's `SHARD`), columns the branch
    wrote into the local data (`before`: as it was) land in the caller's (`CALLER`), logits
    returned as given become the caller's DTensor, `DRAFT`'s `teacher_logits` one placed like them
    (on the draft vocabulary of `len(d2t)` ids with a `d2t`)."""
    shard, local, d2t = view.get(SHARD), view["data"], view.get("d2t")
    caller = view.get(CALLER, local)
    if shard is None:
        return loss_input, caller
    caller.update({key: value for key, value in local.items() if before.get(key) is not value})
    if loss_input.get("logits") is shard.local and shard.dtensor is not None:
        loss_input["logits"] = shard.dtensor
    if loss_input.get("teacher_logits") is not None:
        loss_input["teacher_logits"] = _wrap_draft(shard, loss_input["teacher_logits"], d2t)
    return loss_input, caller


@boundary(roles=_ROLES_ALL, vocab=_vocab_policy, local=_unwrap(_ROLES_ALL))
def prepare_loss_input(
    logits: Tensor,
    data: MutableMapping[str, Any],
    loss_fn: Any,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    d2t: Tensor | None = None,
    chunk_size: int | None = None,
    cp_sharder: Any = None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
    teacher_logits_dtype: torch.dtype | None = None,
    _widths: ShardWidths | None = None,
    _view: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """Build the loss-function input dict from model logits.

    Equivalent (for `LOGPROB`, no parallelism) to
    ``{"next_token_logprobs": lossfx.reference.next_token_logprobs(logits, data["input_ids"])}``.

    Args:
        logits: `[B, S, Vl]` student logits: this rank's vocabulary shard under tensor
            parallelism (for `LOGPROB` in eager mode the shards may have different widths, in
            rank order; compiled code assumes equal widths). Divide by the sampling temperature
            **before** calling: lossfx never applies `sampling_params.temperature`.
        data: mapping of column name to tensor; `LOGPROB` reads `input_ids` `[B, S]`.
        loss_fn: object with `input_type` (a `LossInputType`) and optionally
            `use_fused_linear_logprobs`, `reference_policy_kl_penalty` (see `LossFunction`).
        vocab_parallel_rank: rank in `vocab_parallel_group`; required with it.
        vocab_parallel_group: tensor-parallel group over the vocabulary, or `None`.
        context_parallel_group: context-parallel group (load-balanced layout: `logits` hold this
            rank's part `[B, S_l, Vl]`, `data` stays canonical), or `None`; outputs are
            gathered to canonical order and their gradient is summed over CP ranks (divide the
            loss by the CP size). Every input type but `LOGIT` supports it.
        sampling_params: top-k/top-p filter of the rollout (`LOGPROB` only).
        d2t: draft-to-target vocabulary map (`DRAFT` only).
        chunk_size: sequence positions per eager chunk; a memory bound, results do not depend
            on it.
        cp_sharder: an external context-parallel layout, for every input type but `LOGIT`: an
            object with `shard_token_tensor`/`gather_token_tensor`
            (`lossfx.next_token.ContextParallelSharder`, e.g. automodel's), or a
            `lossfx.sequence_layout.SequenceLayout` (e.g. `LoadBalancedLayout(cp_group)`); takes
            precedence over `context_parallel_group`.
        teacher_output_layer_weight_by_index: per-teacher LM-head shards, split like the logits
            (`OPD_FULL` only; see `prepare_opd_full_loss_input`).
        teacher_logits_dtype: dtype of teacher logits projected from hidden states (`OPD_FULL`).

    Returns:
        `(loss_input, data)`: `LOGIT` gives `{"logits"}`, `LOGPROB` gives
        `{"next_token_logprobs": [B, S-1]}`, `DISTILLATION` `{"student_topk_logprobs",
        "teacher_topk_logprobs", "H_all"}`, `DRAFT` `{"teacher_logits", "student_logits",
        "token_mask"}`, `OPD_FULL` as `prepare_opd_full_loss_input`; `data` is the same object
        that was passed in.

    Raises:
        ValueError: unknown input type, missing columns, bad shapes or ids, `chunk_size <= 0`;
            on every rank, ranks of a group whose calls disagree (shapes, dtypes, sampling
            parameters, values of replicated columns, shard layout: the cross-rank check).
        TypeError: wrong argument types.

    Example:
        >>> import torch, lossfx
        >>> from types import SimpleNamespace
        >>> loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
        >>> data = {"input_ids": torch.tensor([[0, 2, 1]])}
        >>> out, _ = lossfx.prepare_loss_input(torch.zeros(1, 3, 4), data, loss_fn)
        >>> out["next_token_logprobs"]
        tensor([[-1.3863, -1.3863]])
    """
    view, before = _unwrapped(_view)  # every argument local; the branches read theirs from the view
    input_type = _input_type(loss_fn)
    check_tensor("logits", logits)
    check_group("vocab_parallel_group", vocab_parallel_group)
    check_group("context_parallel_group", context_parallel_group)
    if input_type is LossInputType.OPD_FULL:
        out = opd_full_input(view)
    elif input_type is LossInputType.LOGIT:
        out = {"logits": logits}
    else:
        layout = sequence_layout(context_parallel_group, cp_sharder)  # built once, handed to the branch
        rank = _vocab_parallel(vocab_parallel_rank, vocab_parallel_group)
        if input_type is LossInputType.DISTILLATION:
            out = _prepare_distillation_input(view, layout)
        elif input_type is LossInputType.DRAFT:
            out = _prepare_draft_input(view, layout, rank)
        else:  # the last of LossInputType's five members (`_input_type` rejects anything else)
            out = _prepare_logprob_input(view, layout, _widths)
    return _back(view, before, out)


def _prepare_logprob_input(
    view: Mapping[str, Any], layout: SequenceLayout, widths: ShardWidths | None
) -> dict[str, Any]:
    """`LOGPROB` on the call's `view`: next-token log-probs, filtered (and the `-inf` rule) under
    `sampling_params`."""
    logits, data, loss_fn, sampling_params = view["logits"], view["data"], view["loss_fn"], view["sampling_params"]
    input_ids = check_tensor("data['input_ids']", _column(data, "input_ids"))
    top = resolve_filter(sampling_params)
    if getattr(loss_fn, "use_fused_linear_logprobs", False):
        if top is not None:
            raise ValueError(
                "use_fused_linear_logprobs cannot be combined with top-k/top-p filtering "
                f"(sampling_params={sampling_params})"
            )
        check_floating("logits", logits)
        if logits.dim() != 2 or logits.shape[0] != input_ids.shape[0]:
            raise ValueError(
                "with use_fused_linear_logprobs, logits must be [B, S'] next-token log-probs; got "
                f"logits.shape={tuple(logits.shape)} and input_ids.shape={tuple(input_ids.shape)}"
            )
        width = max(input_ids.shape[1] - 1, 0)
        return {"next_token_logprobs": logits.to(compute_dtype(logits.dtype))[:, :width]}
    call = validated_next_token_call(
        logits,
        input_ids,
        group=view["vocab_parallel_group"],
        layout=layout,
        chunk_size=view["chunk_size"],
        widths=ShardWidths() if widths is None else widths,
        ids_name="data['input_ids']",
    )
    if top is None:
        return {"next_token_logprobs": next_token_logprobs_of(call)}  # [B, S-1]
    return _neg_inf_rule(data, loss_fn, input_ids, lambda on: next_token_logprobs_of(call, top if on else None), data)


def _neg_inf_rule(
    data: Mapping[str, Any],
    loss_fn: Any,
    input_ids: Tensor,
    logprobs_of: Callable[[bool], Tensor],
    into: MutableMapping[str, Any],
) -> dict[str, Tensor]:
    """The `-inf` rule of a filtered call (NeMo's `mask_out_neg_inf_logprobs`, docs/decisions.md §3),
    the same on the logits path and the fused front doors: positions whose token fell outside the
    kept set, or whose mask = token_mask · sample_mask (read from `data` before anything is computed;
    token_mask required, a missing sample_mask is ones) is 0, become 0. `logprobs_of(True)`: the
    filtered log-probs, `logprobs_of(False)`: the unfiltered ones, which with a nonzero
    `reference_policy_kl_penalty` land last in `into` (the caller's data) as `curr_logprobs_unfiltered`
    (the reference-KL term cannot take `-inf`), so a call that raises leaves it unchanged."""
    mask = loss_mask_from_data(data, input_ids)  # [B, S] bool ([1, T] pre-packed)
    logprobs = masked_out_neg_inf(logprobs_of(True), mask[:, 1:], "curr_logprobs")  # shapes match by construction
    if wants_reference_kl(loss_fn):
        into["curr_logprobs_unfiltered"] = logprobs_of(False)
    return {"next_token_logprobs": logprobs}


# `prepare_opd_full_loss_input` reads the OPD_FULL columns, whatever `loss_fn.input_type` says
_ROLES_OPD_CALL = dataclasses.replace(_ROLES_ALL, reads=("data", lambda arguments: ("input_ids", *_OPD_COLUMNS)))


@boundary(roles=_ROLES_OPD_CALL, vocab="equal", local=_unwrap(_ROLES_OPD_CALL, opd=True))
def prepare_opd_full_loss_input(
    logits: Tensor,
    data: MutableMapping[str, Any],
    loss_fn: Any,
    *,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: ProcessGroup | None,
    context_parallel_group: ProcessGroup | None,
    sampling_params: TrainingSamplingParams | None,
    chunk_size: int | None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
    teacher_logits_dtype: torch.dtype | None = None,
    cp_sharder: Any = None,
    _view: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Full-vocabulary on-policy distillation inputs: reverse KL to fixed teacher logits.

    Equivalent (no TP, no CP, logits payload `[B, S, V]`) to
    ``{"opd_full_divergence": lossfx.reference.reverse_kl_to_fixed(logits, teacher)[:, :S-1], ...}``
    (see `lossfx.reference.opd_full_loss_input`). Full contract: docs/opd_full.md.

    Args:
        logits: `[B, S_l, Vl]` student logits (TP vocabulary shard, CP load-balanced part).
        data: needs `input_ids` `[B, S]` and the payload column `teacher_full_logits`
            `[B, S_p, V]` or `teacher_full_hidden_states` `[B, S_p, H]` (with
            `opd_full_teacher_index` `[B]` when several LM heads are loaded). Not modified.
        loss_fn: has `opd_full` (e.g. `lossfx.opd_full.OnPolicyDistillationFullConfig`) and
            optionally `reference_policy_kl_penalty`.
        vocab_parallel_rank, vocab_parallel_group: tensor parallelism (`None` works).
        context_parallel_group: CP group (load-balanced layout); outputs are gathered to
            canonical order and their gradient is summed over CP ranks (divide the loss by C).
        sampling_params: accepted and unused (as in the reference).
        chunk_size: sequence positions per eager chunk of the `next_token_logprobs` kernel; the
            divergence chunk comes from `loss_fn.opd_full.chunk_size`.
        teacher_output_layer_weight_by_index: `{index: W [Vl, H]}` teacher LM-head shards, split
            like the logits: this rank's rows (a short rank of an uneven DTensor split: its real
            rows), a `Shard(0)` DTensor on the logits' mesh, or the full `[V, H]` beside full logits.
        teacher_logits_dtype: dtype of teacher logits projected from hidden states.
        cp_sharder: an external context-parallel layout (`shard_token_tensor` /
            `gather_token_tensor`; the teacher payload is handed to it zero-padded or cut to
            `S`) or a `lossfx.sequence_layout.SequenceLayout`; takes precedence over
            `context_parallel_group`.

    Returns:
        `{"opd_full_divergence": [B, S-1], "opd_full_entropy": [B, S-1] | None,
        "opd_full_cross_entropy": [B, S-1] | None}` (+ `"next_token_logprobs"` `[B, S-1]`
        when `reference_policy_kl_penalty != 0`), in `promote_types(student, teacher, fp32)`.

    Raises:
        ValueError: every error condition of NeMo's payload reconstruction (docs/decisions.md §3),
            missing columns, bad shapes.
    """
    return opd_full_input(_view)


# NeMo RL's private spelling, kept as an alias (docs/decisions.md §1)
_prepare_opd_full_loss_input = prepare_opd_full_loss_input


@boundary(roles=_ROLES, vocab="auto", local=_unwrap(_ROLES))
def prepare_packed_loss_input(
    logits: Tensor,
    data: MutableMapping[str, Any],
    loss_fn: Any,
    cu_seqlens_q: Any,
    cu_seqlens_q_padded: Any,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    _widths: ShardWidths | None = None,
    _view: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """Loss inputs (`LOGPROB`) from packed logits, every sequence shifted within itself.

    Equivalent to ``lossfx.reference.packed_next_token_logprobs(full_packed_logits, input_ids,
    cu_seqlens_q, cu_seqlens_q_padded)`` (then the `-inf` rule when filtering), i.e. for every
    sequence the unpacked path's next-token log-probs. Layout: `lossfx/packing.py`, proof:
    proofs/packing.md.

    Args:
        logits: `[1, T/C, Vl]` packed logits: this rank's vocabulary shard and, under context
            parallelism of size `C`, its load-balanced part of every sequence.
        data: `input_ids` `[B, S]` unpacked; or, when `"cu_seqlens" in data` (pre-packed input),
            the physical packed row `[1, T]` — the result is then in the packed layout. Optional
            `token_mask` / `sample_mask` for the `-inf` rule.
        loss_fn: must have `input_type == LossInputType.LOGPROB`.
        cu_seqlens_q: `[B+1]` cumulative real lengths: a tuple of ints, or an int tensor (inside
            compiled code pass tensors: tuples of ints are specialised, one graph per layout).
        cu_seqlens_q_padded: `[B+1]` cumulative padded lengths (`T` in total; each a multiple of
            `2C` under context parallelism).
        vocab_parallel_rank, vocab_parallel_group: tensor parallelism (`None` works).
        context_parallel_group: CP group, or `None`; gradients are summed over CP ranks.
        sampling_params: top-k/top-p filter, as in `prepare_loss_input`.
        chunk_size: packed positions per eager chunk (memory bound only).

    Returns:
        `({"next_token_logprobs": [B, S-1]}, data)`, or `[1, T-1]` (each sequence's last slot 0)
        for pre-packed input. With a filter and a nonzero `reference_policy_kl_penalty`,
        `data["curr_logprobs_unfiltered"]` holds the unfiltered log-probs.

    Raises:
        ValueError: an input type other than `LOGPROB`; malformed `cu_seqlens` (not starting at 0,
            decreasing, padded shorter than unpadded, total not matching the logits, not a
            multiple of `2C`), naming the offending entries; bad shapes or ids.
    """
    view, before = _unwrapped(_view)
    _input_type(loss_fn, packed="prepare")
    if getattr(loss_fn, "use_fused_linear_logprobs", False):
        raise ValueError("prepare_packed_loss_input does not support use_fused_linear_logprobs")
    _vocab_parallel(vocab_parallel_rank, vocab_parallel_group)
    logits, input_ids, layout, vocab, options = _validated_packed(  # checks the logits and ids too
        logits,
        _column(data, "input_ids"),
        cu_seqlens_q,
        cu_seqlens_q_padded,
        prepacked="cu_seqlens" in data,
        vocab_parallel_group=vocab_parallel_group,
        context_parallel_group=context_parallel_group,
        sampling_params=sampling_params,
        chunk_size=chunk_size,
        ids_name="data['input_ids']",
        widths=ShardWidths() if _widths is None else _widths,  # read with the packed checks (one host read)
    )

    def logprobs_of(filtered: bool) -> Tensor:  # under the filter of `options`, or none
        chosen = options if filtered else {"chunk_rows": options["chunk_rows"]}
        return _packing.packed_next_token_logprobs(logits, input_ids, layout, vocab, **chosen)

    if not need_top_k_or_top_p_filtering(sampling_params):
        return _back(view, before, {"next_token_logprobs": logprobs_of(True)})
    return _back(view, before, _neg_inf_rule(data, loss_fn, input_ids, logprobs_of, data))


def _prepare_distillation_input(view: Mapping[str, Any], layout: SequenceLayout) -> dict[str, Any]:
    """`DISTILLATION` on the call's `view`: student/teacher log-probs at the teacher's top-k ids
    (`lossfx.distillation`).

    The whole boundary of the branch, DTensor logits and columns included (no re-entry), through
    `lossfx.distillation._distillation`: one range check of the ids, one pure call."""
    zero_outside_topk = bool(getattr(view["loss_fn"], "zero_outside_topk", False))
    calculate_entropy = zero_outside_topk and getattr(view["loss_fn"], "kl_type", "mixed") != "forward"
    values, ids = (
        check_tensor(f"data[{key!r}]", _column(view["data"], key))
        for key in ("teacher_topk_logits", "teacher_topk_indices")
    )
    student, teacher, neg_entropy = _distillation(
        view["logits"],
        values,
        ids,
        zero_outside_topk=zero_outside_topk,
        calculate_entropy=calculate_entropy,
        vocab_parallel_group=view["vocab_parallel_group"],
        layout=layout,
        chunk_size=view["chunk_size"],
        vocab_size=view[SHARD].vocab_size if SHARD in view else None,  # a padded DTensor shard's real V
    )
    return {"student_topk_logprobs": student, "teacher_topk_logprobs": teacher, "H_all": neg_entropy}


def _prepare_draft_input(view: Mapping[str, Any], layout: SequenceLayout, rank: int) -> dict[str, Any]:
    """`DRAFT` on the call's `view` (local tensors): shifted teacher logits in draft vocabulary and
    the shifted mask, validated once (`lossfx.draft.validated_draft`), then the pure
    `lossfx._layouts.draft.draft_targets` once."""
    logits, data, group = view["logits"], view["data"], view["vocab_parallel_group"]
    student_logits = _column(data, "student_logits")
    token_mask = check_tensor("data['token_mask']", _column(data, "token_mask"))
    target_ids, vocab = validated_draft(logits, token_mask, view["d2t"], group, rank, layout)  # (rank: checked)
    teacher, mask = _draft.draft_targets(logits, token_mask, target_ids, vocab, layout)
    return {"teacher_logits": teacher, "student_logits": student_logits, "token_mask": mask}
