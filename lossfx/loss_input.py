"""Loss-input preparation: logits in, the dict a loss function consumes out.

A drop-in for NeMo RL's `nemo_rl.algorithms.loss.loss_input` (same names, arguments, dict keys),
built on lossfx's kernels. `prepare_loss_input` dispatches on `loss_fn.input_type`:

1. `LOGIT` returns the logits unchanged;
2. `LOGPROB` returns next-token log-probs `[B, S-1]` (optionally over a tensor-parallel
   vocabulary shard, chunked);
3. the other branches land with their capabilities and raise `NotImplementedError` until then.

`data` is never modified except for the documented `curr_logprobs_unfiltered` column; a call that
raises leaves it untouched.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor

from lossfx._distributed import ProcessGroup, group_rank, group_size
from lossfx._numerics import compute_dtype
from lossfx._validation import check_floating, check_integer_ids, check_positive_int, check_tensor
from lossfx.interfaces import LossInputType, TrainingSamplingParams, need_top_k_or_top_p_filtering
from lossfx.logprobs import token_logprobs

__all__ = [
    "next_token_logprobs",
    "prepare_loss_input",
    "prepare_opd_full_loss_input",
    "prepare_packed_loss_input",
]


def _input_type(loss_fn: Any) -> LossInputType:
    if not hasattr(loss_fn, "input_type"):
        raise TypeError(f"loss_fn must have an `input_type` attribute, got {type(loss_fn).__name__}")
    try:
        return LossInputType(loss_fn.input_type)
    except ValueError:
        raise ValueError(f"Unknown loss function input type: {loss_fn.input_type!r}") from None


def _column(data: MutableMapping[str, Any], name: str) -> Any:
    if name not in data:
        raise ValueError(f"data must contain the column {name!r}; it has {sorted(data.keys())}")
    return data[name]


def _vocab_parallel(
    vocab_parallel_rank: int | None, vocab_parallel_group: ProcessGroup | None
) -> tuple[int, ProcessGroup | None]:
    """Validate the tensor-parallel arguments; return `(rank, group)` (`(0, None)` without TP)."""
    if vocab_parallel_group is None:
        return 0, None
    if vocab_parallel_rank is None:
        raise ValueError("vocab_parallel_rank must be provided when vocab_parallel_group is provided")
    if isinstance(vocab_parallel_rank, bool) or not isinstance(vocab_parallel_rank, int):
        raise TypeError(f"vocab_parallel_rank must be an int, got {vocab_parallel_rank!r}")
    size, rank = group_size(vocab_parallel_group), group_rank(vocab_parallel_group)
    if vocab_parallel_rank != rank:
        raise ValueError(
            f"vocab_parallel_rank={vocab_parallel_rank} disagrees with the rank {rank} of "
            f"vocab_parallel_group (size {size})"
        )
    return rank, vocab_parallel_group


def next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Next-token log-probs: position `t` scores token `input_ids[:, t+1]`.

    Equivalent to ``logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]``
    on the full-vocabulary logits, without slicing (so without copying) the logits.

    Args:
        logits: `[B, S, Vl]` this rank's vocabulary shard (the full vocabulary without TP).
        input_ids: `[B, S]` integer token ids in `[0, V)`, `V = Vl · TP`.
        vocab_parallel_rank: this rank's index in `vocab_parallel_group`.
        vocab_parallel_group: tensor-parallel group over the vocabulary, or `None`.
        chunk_size: sequence positions per eager chunk (a memory bound; results do not depend
            on it).

    Returns:
        `[B, S-1]` in the compute dtype (fp32, or float64 for float64 logits); replicated on
        every tensor-parallel rank, whose gradient is its own shard's.
    """
    check_floating("logits", logits)
    check_integer_ids("input_ids", input_ids)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if logits.dim() != 3 or input_ids.dim() != 2 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"logits must be [B, S, V_local] and input_ids [B, S] with the same B and S; got "
            f"logits.shape={tuple(logits.shape)} and input_ids.shape={tuple(input_ids.shape)}"
        )
    _, group = _vocab_parallel(vocab_parallel_rank, vocab_parallel_group)
    batch, seq = input_ids.shape
    # The shift is a roll of the targets, not a slice of the logits: logits[:, :-1] is not viewable
    # as [N, V] and would be copied. The wrapped last column is a valid id and is sliced off below.
    target = torch.roll(input_ids, shifts=-1, dims=1)  # [B, S]
    rows = None if chunk_size is None else chunk_size * batch
    out = token_logprobs(logits, target, group=group, chunk_size=rows)  # [B, S]
    return out[:, : max(seq - 1, 0)]


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
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """Build the loss-function input dict from model logits.

    Equivalent (for `LOGPROB`, no parallelism) to
    ``{"next_token_logprobs": lossfx.reference.next_token_logprobs(logits, data["input_ids"])}``.

    Args:
        logits: `[B, S, Vl]` student logits: this rank's vocabulary shard under tensor
            parallelism. Divide by the sampling temperature **before** calling: lossfx never
            applies `sampling_params.temperature`.
        data: mapping of column name to tensor; `LOGPROB` reads `input_ids` `[B, S]`.
        loss_fn: object with `input_type` (a `LossInputType`) and optionally
            `use_fused_linear_logprobs`, `reference_policy_kl_penalty` (see `LossFunction`).
        vocab_parallel_rank: rank in `vocab_parallel_group`; required with it.
        vocab_parallel_group: tensor-parallel group over the vocabulary, or `None`.
        context_parallel_group: context-parallel group (not yet supported when larger than 1).
        sampling_params: top-k/top-p filter of the rollout (`LOGPROB` only).
        d2t: draft-to-target vocabulary map (`DRAFT` only).
        chunk_size: sequence positions per eager chunk; a memory bound, results do not depend
            on it.
        cp_sharder: context-parallel sharder object (not yet supported).
        teacher_output_layer_weight_by_index: per-teacher LM-head shards (`OPD_FULL` only).
        teacher_logits_dtype: dtype of teacher logits projected from hidden states (`OPD_FULL`).

    Returns:
        `(loss_input, data)`: `LOGIT` gives `{"logits"}`, `LOGPROB` gives
        `{"next_token_logprobs": [B, S-1]}`; `data` is the same object that was passed in.

    Raises:
        ValueError: unknown input type, missing columns, bad shapes or ids, `chunk_size <= 0`.
        TypeError: wrong argument types.
        NotImplementedError: a branch or layout whose capability has not landed yet.

    Example:
        >>> import torch, lossfx
        >>> from types import SimpleNamespace
        >>> loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
        >>> data = {"input_ids": torch.tensor([[0, 2, 1]])}
        >>> out, _ = lossfx.prepare_loss_input(torch.zeros(1, 3, 4), data, loss_fn)
        >>> out["next_token_logprobs"]
        tensor([[-1.3863, -1.3863]])
    """
    input_type = _input_type(loss_fn)
    check_tensor("logits", logits)
    if input_type is LossInputType.LOGIT:
        return {"logits": logits}, data
    if group_size(context_parallel_group) > 1 or cp_sharder is not None:
        raise NotImplementedError("context parallelism is not supported yet (see issue #5)")
    if input_type is LossInputType.LOGPROB:
        return _prepare_logprob_input(
            logits, data, loss_fn, vocab_parallel_rank, vocab_parallel_group, sampling_params, chunk_size
        ), data
    raise NotImplementedError(f"LossInputType.{input_type.name} is not implemented yet")


def _prepare_logprob_input(
    logits: Tensor,
    data: MutableMapping[str, Any],
    loss_fn: Any,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: ProcessGroup | None,
    sampling_params: TrainingSamplingParams | None,
    chunk_size: int | None,
) -> dict[str, Tensor]:
    input_ids = check_tensor("data['input_ids']", _column(data, "input_ids"))
    if sampling_params is not None and not isinstance(sampling_params, TrainingSamplingParams):
        raise TypeError(f"sampling_params must be TrainingSamplingParams or None, got {sampling_params!r}")
    filtering = need_top_k_or_top_p_filtering(sampling_params)
    if getattr(loss_fn, "use_fused_linear_logprobs", False):
        if filtering:
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
    if filtering:
        raise NotImplementedError("top-k/top-p filtered log-probs are not implemented yet (see issue #3)")
    logprobs = next_token_logprobs(
        logits,
        input_ids,
        vocab_parallel_rank=vocab_parallel_rank,
        vocab_parallel_group=vocab_parallel_group,
        chunk_size=chunk_size,
    )
    return {"next_token_logprobs": logprobs}


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
) -> dict[str, Any]:
    """Full-vocabulary on-policy distillation inputs (see issue #4; not implemented yet)."""
    raise NotImplementedError("OPD_FULL is not implemented yet (see issue #4)")


_prepare_opd_full_loss_input = prepare_opd_full_loss_input


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
) -> tuple[dict[str, Any], MutableMapping[str, Any]]:
    """Loss inputs from packed logits (see issue #5; not implemented yet)."""
    raise NotImplementedError("prepare_packed_loss_input is not implemented yet (see issue #5)")
