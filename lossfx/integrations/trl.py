"""TRL: per-token log-probs and entropies from hidden states and an LM head, through the fused path.

    z               = c · tanh(s · (h[b, S−K−1+j] Wᵀ + bias) / c) / T       (bias, s, c: the head's options)
    logps[b, j]     = log softmax(z)[labels[b, S−K+j]]                    j < K = logits_to_keep
    entropies[b, j] = −Σ_v p log p at the same position              (0 where the label is masked)

`per_token_logps_and_entropies` is what TRL's `GRPOTrainer._get_per_token_logps_and_entropies`
returns for one micro-batch (TRL 1.16: its fused LM head, `trl.trainer.utils.add_fused_lm_head`),
computed by `lossfx.linear_next_token_logprobs` on the last `K + 1` positions only: the logits are
never materialised and the prompt is never projected. Under the sampler's top-k/top-p filter
(`sampling_params`) the log-probs come from `lossfx.linear_filtered_token_logprobs`, fused too.
`LossfxGRPOMixin` plugs it into a `GRPOTrainer`; `LossfxGRPOTrainer` is the ready subclass (built
on first access, so importing this module imports neither TRL nor transformers). With a DTensor
head the ranks of its mesh first check, by one small all-gather, that they call with the same
options (`_check_ranks_agree`): a rank that differs gets a `ValueError` on every rank, not a hang
in the head's gather. Docs: docs/huggingface.md.

An integration is a user of lossfx's public API: it calls the public entry points
(`lossfx.linear_next_token_logprobs`, `lossfx.linear_filtered_token_logprobs`), each of which
does its boundary work once, never the pure code below them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import numbers
import struct
import warnings
from typing import Any, Literal

import torch
from torch import Tensor

from lossfx._boundary import debug as _debug
from lossfx._boundary.dtensor import is_dtensor
from lossfx._boundary.validation import (
    check_floating,
    check_integer_ids,
    check_positive_float,
    check_positive_int,
)
from lossfx.fused_linear import linear_next_token_logprobs
from lossfx.interfaces import TrainingSamplingParams, need_top_k_or_top_p_filtering
from lossfx.linear_filtering import TIES, linear_filtered_token_logprobs

# LossfxGRPOTrainer comes from the module's __getattr__ (built on first access)
__all__ = [
    "LossfxGRPOMixin",
    "LossfxGRPOTrainer",  # noqa: F822
    "head_options",
    "lm_head_weight",
    "per_token_logps_and_entropies",
]

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100  # Hugging Face's label for "not scored"
ShardedHead = Literal["raise", "gather", "tensor_parallel"]
# config attributes of a multiplier of the logits before soft-capping, in the order TRL's fused head reads them
_LOGIT_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier")


def lm_head_weight(weight: Any, sharded_head: ShardedHead = "raise") -> Tensor:
    """The LM-head weight `[V, H]` to hand to the fused kernel; a DTensor head is never guessed.

    Args:
        weight: a plain `[V, H]` tensor, or a DTensor: all-`Replicate()` (its local tensor is the
            head), or sharded (FSDP2's `Shard(0)` over data-parallel ranks, or a tensor-parallel
            `ColwiseParallel` head).
        sharded_head: what a sharded DTensor head means. `"raise"` (default): `ValueError`, since
            FSDP2 shards over ranks holding *different* data and treating that as a vocabulary
            shard would be silently wrong. `"gather"`: every mesh dim is data parallel
            (FSDP2, HSDP): `weight.full_tensor()`, one all-gather of `V·H` per call, whose gradient
            is averaged over every rank's data and reduce-scattered back to the shards (FSDP2's
            default mean reduction). `"tensor_parallel"`: the DTensor goes to lossfx unchanged, whose DTensor
            boundary reads the group and offsets from it; every rank of that mesh dim must hold
            the same hidden states.

    Returns:
        A plain tensor, or the DTensor for `"tensor_parallel"`.
    """
    return _head_tensor("lm_head weight", weight, sharded_head)


def _check_head(name: str, weight: Any, sharded_head: object) -> None:
    """The checks of `_head_tensor`, no collective: `sharded_head`'s value, a floating plain head, and
    a sharded DTensor head under `"raise"`."""
    if sharded_head not in ("raise", "gather", "tensor_parallel"):
        raise ValueError(f"sharded_head must be 'raise', 'gather' or 'tensor_parallel', got {sharded_head!r}")
    if not is_dtensor(weight):
        check_floating(name, weight)
    elif sharded_head == "raise" and not all(p.is_replicate() for p in weight.placements):
        raise ValueError(
            f"the {name} is a DTensor with placements {tuple(weight.placements)} (FSDP2 or tensor "
            "parallel); lossfx will not guess which: pass sharded_head='gather' to all-gather it with "
            "full_tensor() (FSDP2, DDP-like data parallelism), or sharded_head='tensor_parallel' for a "
            "vocabulary-sharded head whose ranks all hold the same hidden states"
        )


def _head_tensor(name: str, weight: Any, sharded_head: ShardedHead) -> Any:
    """`lm_head_weight` for the weight or the bias (`name` names it in errors)."""
    _check_head(name, weight, sharded_head)
    if not is_dtensor(weight):
        return weight
    if all(p.is_replicate() for p in weight.placements):
        return weight.to_local()
    if sharded_head == "gather":
        from torch.distributed.tensor import Partial  # the DTensor above proves it importable

        # every mesh dim is data parallel: the head's gradient is averaged over all ranks' data,
        # FSDP2's default reduction (a plain full_tensor() would give each shard its own rank's part)
        return weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
    return weight  # "tensor_parallel"


def _check_logits_to_keep(logits_to_keep: object, seq: int) -> int:
    if logits_to_keep is None:
        return seq - 1
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, numbers.Integral):
        raise TypeError(f"logits_to_keep must be an int or None, got {logits_to_keep!r}")
    keep = int(logits_to_keep)
    if not 1 <= keep <= seq - 1:
        raise ValueError(f"logits_to_keep must lie in [1, S-1] = [1, {seq - 1}] for S = {seq}, got {keep}")
    return keep


def per_token_logps_and_entropies(
    hidden_states: Tensor,
    weight: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    logits_to_keep: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    labels: Tensor | None = None,
    position_ids: Tensor | None = None,
    chunk_size: int | None = None,
    sharded_head: ShardedHead = "raise",
    sampling_params: TrainingSamplingParams | None = None,
    bias: Any = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """TRL's per-token log-probs (and entropies) of the last `K` tokens, from hidden states, fused.

    Dense equivalent (TRL 1.16 `GRPOTrainer._get_per_token_logps_and_entropies`, one micro-batch)::

        z = hidden_states[:, :-1] @ weight.T + bias                        # [B, S-1, V]
        z = softcap * tanh(logit_scale * z / softcap) / temperature        # (no tanh without softcap)
        labels = input_ids.masked_fill(attention_mask == 0, -100)[:, 1:]   # (or the given labels)
        lp = z.log_softmax(-1)
        logps = lp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        entropies = -(lp.exp() * lp).sum(-1)
        both masked to 0 where labels == -100, then [:, -logits_to_keep:]

    computed by `lossfx.linear_next_token_logprobs` on the last `K + 1` positions only; positions
    that score nothing are `ignore_index` rows of the kernel (never projected). With a top-k/top-p
    `sampling_params`, `logps` are `lossfx.linear_filtered_token_logprobs` of the same rows (the
    dense `lp` above is then the filtered `log_softmax`, `−inf` outside the filter).

    Args:
        hidden_states: `[B, S, H]` the model's last hidden states (after the final norm:
            `model.model(...).last_hidden_state`, or `output_hidden_states=True` and
            `.hidden_states[-1]`). Never cast: with a head of another dtype (a bf16 backbone
            and an fp32 head) the matmuls run in `promote_types` of the two (fp32 there, as TRL's
            `cast_lm_head_to_fp32`), outside autocast.
        weight: `[V, H]` LM-head weight (`model.get_output_embeddings().weight`), or a DTensor
            (see `sharded_head`).
        input_ids: `[B, S]` prompt and completion ids.
        attention_mask: `[B, S]`, 0 at padding (its positions score nothing), or `None`.
        logits_to_keep: `K`, the number of trailing tokens scored (TRL: the completion length);
            `None`: all `S − 1`.
        temperature: the logits are divided by it (TRL's sampling temperature).
        compute_entropy: also return the entropies `−Σ p log p` (≥ 0, TRL's sign).
        labels: `[B, S]` targets aligned with `input_ids` (the shift happens here), `-100` where
            nothing is scored; default `input_ids` with `-100` where `attention_mask == 0`.
        position_ids: `[B, S]` positions of padding-free rows (restarting at 0 where a sequence
            starts): no position scores the next sequence's first token.
        chunk_size: rows per logits chunk of the fused kernel (memory bound only).
        sharded_head: what a sharded DTensor `weight` means (`lm_head_weight`): `"raise"`,
            `"gather"` or `"tensor_parallel"`.
        sampling_params: the rollout's top-k/top-p filter (`lossfx.TrainingSamplingParams`; its
            `temperature` is ignored, `temperature` above applies first, as samplers do; its
            `ties` is top-p's tie rule). With a filter, `logps` are those of the filtered
            distribution the sampler drew from (`−inf` where the token lies outside it), computed
            from the hidden states by `lossfx.linear_filtered_token_logprobs` (no logits
            materialised; two passes over the vocabulary, forward and backward). The entropies
            stay those of the unfiltered distribution (TRL's metric): with `compute_entropy` they
            cost the unfiltered fused kernel's passes on top.
        bias: `[V]` LM-head bias (`lm_head.bias`), or a DTensor (as `weight`, `sharded_head`).
        logit_scale: multiplier of the logits before soft-capping (`config.logit_scale` of
            Cohere, `1 / config.logits_scaling` of Granite, ...: `head_options` reads them).
        softcap: final-logit soft-cap `c` (`config.final_logit_softcapping`, Gemma 2/3), or `None`.

    Returns:
        `(logps [B, K], entropies [B, K] or None)` in the promoted dtype of `hidden_states` and
        `weight` (fp32 at least); 0 with a zero gradient where the label is `-100` or padding.
        Gradients reach `hidden_states`, `weight` and `bias`.

    Raises:
        TypeError: non-float hidden states, non-integer ids/labels/mask, bad `logits_to_keep` type,
            a `temperature`, `logit_scale` or `softcap` that is not a real number.
        ValueError: shape mismatches, `logits_to_keep` outside `[1, S−1]`, a sharded DTensor
            head with `sharded_head="raise"`, label ids outside `[0, V)` other than `-100`, a
            `temperature`, `logit_scale` or `softcap` that is not finite and > 0. With a DTensor
            head, before any collective: ranks of its mesh that disagree on an option (every rank
            raises, naming the option and each rank's value), or a peer that rejected its arguments
            (eager; a compiled call is checked by the caller, as the mixin does).
    """
    if not torch.compiler.is_compiling():  # compiled (the mixin's lossfx_compile): it checks before, eagerly
        _check_ranks_agree(
            hidden_states, weight, input_ids, attention_mask, logits_to_keep=logits_to_keep, temperature=temperature,
            compute_entropy=compute_entropy, labels=labels, position_ids=position_ids, chunk_size=chunk_size,
            sharded_head=sharded_head, sampling_params=sampling_params, bias=bias, logit_scale=logit_scale,
            softcap=softcap,
        )  # fmt: skip
    temperature, logit_scale, softcap, keep = _check_arguments(
        hidden_states, weight, input_ids, attention_mask, logits_to_keep, temperature, labels, position_ids,
        chunk_size, sharded_head, bias, logit_scale, softcap,
    )  # fmt: skip
    weight = _head_tensor("lm_head weight", weight, sharded_head)
    if bias is not None:
        bias = _head_tensor("lm_head bias", bias, sharded_head)
    start = input_ids.shape[1] - keep - 1  # hidden position scoring the first kept token
    targets = (input_ids if labels is None else labels)[:, start:]  # [B, K+1]; column 0 never scored
    scored = targets[:, 1:] != IGNORE_INDEX  # [B, K]
    if attention_mask is not None:
        scored = scored & (attention_mask[:, start + 1 :] != 0)
    hidden = hidden_states[:, start:]
    pos = None if position_ids is None else position_ids[:, start:]
    if pos is not None:  # a sequence's last position scores nothing (both paths, both outputs)
        scored = scored & (pos[:, 1:] != 0)
    head = {"bias": bias, "logit_scale": logit_scale, "softcap": softcap, "temperature": temperature}
    # what scores nothing is an ignored row of the kernels: 0, zero gradient
    scored_ids = torch.where(scored, targets[:, 1:], IGNORE_INDEX)  # [B, K]
    sampler = sampling_params if need_top_k_or_top_p_filtering(sampling_params) else None
    neg_entropy = None
    with torch.autocast(hidden.device.type, enabled=False):  # promote_types(hidden, weight) is the matmuls'
        if sampler is None or compute_entropy:  # with a filter: the unfiltered distribution's entropies (TRL's metric)
            ignored = torch.full_like(targets[:, :1], IGNORE_INDEX)
            result = linear_next_token_logprobs(
                hidden,
                weight,
                torch.cat([ignored, scored_ids], dim=1),
                chunk_size=chunk_size,
                return_neg_entropy=bool(compute_entropy),
                position_ids=pos,
                ignore_index=IGNORE_INDEX,
                **head,
            )
            logps, neg_entropy = result if isinstance(result, tuple) else (result, None)
        if sampler is not None:  # the sampler's distribution; hidden position j scores token j + 1
            logps = linear_filtered_token_logprobs(
                hidden[:, :-1],
                weight,
                scored_ids,
                top_k=sampler.top_k,
                top_p=sampler.top_p,
                ties=sampler.ties,
                chunk_size=chunk_size,
                ignore_index=IGNORE_INDEX,
                **head,
            )
    return logps, None if neg_entropy is None else -neg_entropy


def _check_arguments(
    hidden_states: Any,
    weight: Any,
    input_ids: Any,
    attention_mask: Any,
    logits_to_keep: object,
    temperature: object,
    labels: Any,
    position_ids: Any,
    chunk_size: object,
    sharded_head: object,
    bias: Any,
    logit_scale: object,
    softcap: object,
) -> tuple[float, float, float | None, int]:
    """Every check of `per_token_logps_and_entropies`'s arguments, local (no collective): raises
    what it documents, else returns `(temperature, logit_scale, softcap, logits_to_keep)` as numbers."""
    check_floating("hidden_states", hidden_states)
    check_integer_ids("input_ids", input_ids)
    # checked here as well as in the fused kernel: the filtered path divides by them itself
    temp = check_positive_float("temperature", temperature)
    scale = check_positive_float("logit_scale", logit_scale)
    cap = check_positive_float("softcap", softcap, allow_none=True)
    _check_head("lm_head weight", weight, sharded_head)
    if bias is not None:
        _check_head("lm_head bias", bias, sharded_head)
    check_positive_int("chunk_size", chunk_size)
    if input_ids.dim() != 2 or hidden_states.dim() != 3 or tuple(hidden_states.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"hidden_states must be [B, S, H] and input_ids [B, S]; got hidden_states.shape="
            f"{tuple(hidden_states.shape)} and input_ids.shape={tuple(input_ids.shape)}"
        )
    for name, x in (("attention_mask", attention_mask), ("labels", labels), ("position_ids", position_ids)):
        if x is not None:
            if not (name == "attention_mask" and isinstance(x, Tensor) and x.dtype == torch.bool):
                check_integer_ids(name, x)
            if tuple(x.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {name}.shape={tuple(x.shape)}"
                )
    return temp, scale, cap, _check_logits_to_keep(logits_to_keep, input_ids.shape[1])


# ---------------------------------------------------------------------------------------------
# Every rank of a DTensor head's mesh scores with the same options, checked before any collective
# ---------------------------------------------------------------------------------------------

_SHARDED_HEADS = ("raise", "gather", "tensor_parallel")
_CHOICES = {"choice": _SHARDED_HEADS, "ties": TIES}  # an option of a few strings: its index
# int64 codes no option encodes otherwise (NaN payloads that `float()` never yields): None, a bad type
_NONE, _INVALID = 0x7FF8_0000_0000_0A11, 0x7FF8_0000_0000_0BAD


def _code(value: object, kind: str) -> int:
    """`value` as one int64: an index of its `_CHOICES`, a bool, an int, or a float's bits."""
    if value is None:
        return _NONE
    if kind in _CHOICES:
        return next((i for i, v in enumerate(_CHOICES[kind]) if value == v), _INVALID)
    if kind == "bool" or isinstance(value, bool):
        return int(value) if isinstance(value, bool) and kind == "bool" else _INVALID
    if kind == "int":
        return int(value) if isinstance(value, numbers.Integral) and abs(int(value)) < 2**62 else _INVALID
    if isinstance(value, numbers.Real):
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return _INVALID


def _shown(code: int, kind: str) -> str:
    if code == _NONE:
        return "None"
    if code == _INVALID:
        return "<invalid>"
    if kind in _CHOICES:
        return repr(_CHOICES[kind][code])
    if kind == "bool":
        return repr(bool(code))
    return repr(code) if kind == "int" else repr(struct.unpack("<d", struct.pack("<q", code))[0])


def _option_fields(
    sharded_head: object,
    logits_to_keep: object,
    temperature: object,
    compute_entropy: object,
    chunk_size: object,
    sampling_params: Any,
    bias: Any,
    logit_scale: object,
    softcap: object,
) -> list[tuple[str, object, str]]:
    """`(name, value, kind)` of every option the ranks of a head's mesh must agree on."""
    filtered = need_top_k_or_top_p_filtering(sampling_params)
    return [
        ("sharded_head", sharded_head, "choice"),
        ("temperature", temperature, "float"),
        ("logit_scale", logit_scale, "float"),
        ("softcap", softcap, "float"),
        ("bias given", bias is not None, "bool"),
        ("compute_entropy", bool(compute_entropy), "bool"),
        ("chunk_size", chunk_size, "int"),
        ("sampling_params.top_k (a filter)", sampling_params.top_k if filtered else None, "int"),
        ("sampling_params.top_p (a filter)", sampling_params.top_p if filtered else None, "float"),
        ("sampling_params.ties (a filter)", sampling_params.ties if filtered else None, "ties"),
        ("logits_to_keep", logits_to_keep, "int"),  # compared under "tensor_parallel" only
    ]


def _gather_over_mesh(sig: Tensor, mesh: Any) -> list[list[int]]:
    """Every rank's `sig [L]`, in the order of `mesh.mesh.flatten()`: one all-gather per mesh dim
    (the last dim first, so the result is laid out as the mesh), each of what the previous one
    gathered, so every rank ends with the whole mesh's; then one host read."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name warns in 2.13
    x = sig
    for dim in reversed(range(mesh.ndim)):
        group = mesh.get_group(dim)
        out = x.new_empty(group.size() * x.numel())
        gather(out, x.reshape(-1), group=group)
        x = out.view(group.size(), *x.shape)
    return x.reshape(-1, sig.numel()).tolist()


def _check_ranks_agree(
    hidden_states: Any,
    weight: Any,
    input_ids: Any,
    attention_mask: Any,
    *,
    logits_to_keep: object = None,
    temperature: object = 1.0,
    compute_entropy: object = False,
    labels: Any = None,
    position_ids: Any = None,
    chunk_size: object = None,
    sharded_head: object = "raise",
    sampling_params: Any = None,
    bias: Any = None,
    logit_scale: object = 1.0,
    softcap: object = None,
) -> None:
    """With a DTensor head (a process group exists): before any collective of the call (the
    `"gather"` head's `full_tensor()`, lossfx's own check), every rank of the head's mesh learns
    every rank's options and whether its arguments pass `_check_arguments`, by one all-gather of a
    few int64 per mesh dim; then every rank raises the same `ValueError` naming each option the
    ranks disagree on with each rank's value, or, when a rank rejected its arguments, that rank
    its own error and every other one a `ValueError` naming it. Nothing is left waiting in a
    collective. `logits_to_keep` may differ over data-parallel ranks (each pads its own
    completions): compared under `"tensor_parallel"` only, where every rank holds the same batch.
    Plain heads: nothing (no group, no collective). With `LOSSFX_DISTRIBUTED_DEBUG` on, a timed
    handshake first turns a plain head on one rank and a DTensor head on its peer into an error on
    both (docs/dtensor.md)."""
    _debug.before_integration_call("integrations.trl.per_token_logps", {"weight": weight, "bias": bias})
    head = weight if is_dtensor(weight) else bias if is_dtensor(bias) else None
    if head is None:
        return
    error: Exception | None = None
    try:
        _check_arguments(
            hidden_states, weight, input_ids, attention_mask, logits_to_keep, temperature, labels, position_ids,
            chunk_size, sharded_head, bias, logit_scale, softcap,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        error = e
    fields = _option_fields(
        sharded_head, logits_to_keep, temperature, compute_entropy, chunk_size, sampling_params, bias, logit_scale,
        softcap,
    )  # fmt: skip
    codes = [int(error is None)] + [_code(value, kind) for _, value, kind in fields]
    mesh = head.device_mesh
    rows = _gather_over_mesh(torch.tensor(codes, dtype=torch.int64, device=head.device), mesh)
    ranks = mesh.mesh.flatten().tolist()
    tensor_parallel = _code("tensor_parallel", "choice")
    differ = []
    for i, (name, _, kind) in enumerate(fields, start=1):
        column = [row[i] for row in rows]
        if name == "logits_to_keep" and any(row[1] != tensor_parallel for row in rows):
            continue
        if len(set(column)) > 1:
            values = ", ".join(f"rank {r}: {_shown(c, kind)}" for r, c in zip(ranks, column, strict=True))
            differ.append(f"{name} ({values})")
    if differ:
        raise ValueError(
            "lossfx.integrations.trl: the ranks of the LM head's device mesh disagree on " + "; ".join(differ)
            + ". Every rank must score with the same options (LossfxGRPOTrainer: lossfx_sharded_head, "
            "lossfx_filtered_logprobs, lossfx_filter_ties, lossfx_chunk_size, GRPOConfig's temperature, top_k, "
            "top_p; the model's "
            "head). Checked before any collective: every rank raises this error"
        )  # fmt: skip
    if error is not None:
        raise error
    rejected = [r for r, row in zip(ranks, rows, strict=True) if not row[0]]
    if rejected:
        raise ValueError(
            f"lossfx.integrations.trl: rank(s) {rejected} of the LM head's device mesh rejected their arguments "
            "(each raised its own error); this rank stops too, before any collective"
        )


def head_options(model: Any) -> dict[str, Any]:
    """`{"bias", "logit_scale", "softcap"}` of a transformers causal LM's head, for
    `per_token_logps_and_entropies`: `lm_head.bias`, the config's `final_logit_softcapping`
    (Gemma 2/3) and its logit multiplier, read as TRL's fused head reads them: `logit_scale`
    (Cohere), `output_multiplier`, `lm_head_multiplier` (Falcon-H1), else `1 / logits_scaling`
    (Granite, MiniCPM3; HyperCLOVA X multiplies by it)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scale = next((getattr(config, n) for n in _LOGIT_SCALES if getattr(config, n, None) is not None), None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1 / scaling
    return {
        "bias": getattr(model.get_output_embeddings(), "bias", None),
        "logit_scale": 1.0 if scale is None else scale,
        "softcap": getattr(config, "final_logit_softcapping", None),
    }


_UNSET: Any = object()  # an option not passed to the trainer: its class attribute applies
# the arguments the mixin's method takes and hands to the stock one, in TRL 1.16's order
_STOCK_PARAMETERS = (
    "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
    "compute_aux_loss",
)  # fmt: skip
_OPTIONS = (
    "lossfx_sharded_head", "lossfx_filtered_logprobs", "lossfx_filter_ties", "lossfx_chunk_size", "lossfx_compile",
)  # fmt: skip


def _check_option(name: str, value: Any) -> Any:
    """`value` of the trainer option `name`, checked: `ValueError` / `TypeError` naming it."""
    if name == "lossfx_sharded_head":
        if value not in _SHARDED_HEADS:
            raise ValueError(f"lossfx_sharded_head must be 'raise', 'gather' or 'tensor_parallel', got {value!r}")
    elif name == "lossfx_filtered_logprobs":
        if not isinstance(value, bool):
            raise TypeError(f"lossfx_filtered_logprobs must be a bool, got {value!r}")
    elif name == "lossfx_filter_ties":
        if value not in TIES:
            raise ValueError(f"lossfx_filter_ties must be 'together' or 'sorted', got {value!r}")
    elif name == "lossfx_chunk_size":
        check_positive_int("lossfx_chunk_size", value)
    elif not isinstance(value, (bool, dict)):
        raise TypeError(f"lossfx_compile must be a bool or a dict of torch.compile keyword arguments, got {value!r}")
    return value


def _check_trainer_class(cls: type) -> None:
    """`TypeError` unless `cls` is a `trl.GRPOTrainer` whose per-token log-prob method the mixin
    overrides and can hand to (TRL 1.16's name and leading parameters)."""
    import trl
    from trl import GRPOTrainer

    if not issubclass(cls, GRPOTrainer):
        raise TypeError(
            f"LossfxGRPOMixin replaces trl.GRPOTrainer's per-token log-probs; {cls.__qualname__} is not a "
            f"GRPOTrainer (its bases: {[b.__qualname__ for b in cls.__mro__[1:-1]]}): put LossfxGRPOMixin first "
            "in the bases of a GRPOTrainer subclass"
        )
    after = cls.__mro__[cls.__mro__.index(LossfxGRPOMixin) + 1 :]
    name = "_get_per_token_logps_and_entropies"
    stock = next((vars(k)[name] for k in after if name in vars(k)), None)
    found = None if stock is None else tuple(inspect.signature(stock).parameters)
    if found is None or found[: len(_STOCK_PARAMETERS)] != _STOCK_PARAMETERS:
        raise TypeError(
            f"LossfxGRPOMixin overrides GRPOTrainer._get_per_token_logps_and_entropies{_STOCK_PARAMETERS[1:]} "
            f"(TRL 1.16); the GRPOTrainer of TRL {trl.__version__} under {cls.__qualname__} "
            + ("has no such method" if found is None else f"takes {found}")
            + ": the override would do nothing or break; use a TRL version it supports (1.16)"
        )


_DEFAULTS = {
    "lossfx_sharded_head": "raise", "lossfx_filtered_logprobs": False, "lossfx_filter_ties": "together",
    "lossfx_chunk_size": None,
}  # fmt: skip


def _warn_shared_class_options() -> None:
    """FutureWarning when an option was set on `LossfxGRPOMixin` or `LossfxGRPOTrainer` themselves
    (the old, process-wide way): it still applies, as every trainer's default."""
    for cls in (LossfxGRPOMixin, _trainer_class):
        for name in _OPTIONS:
            if cls is not None and name in vars(cls) and vars(cls)[name] != _DEFAULTS.get(name, False):
                warnings.warn(
                    f"{cls.__name__}.{name} set on the class applies to every trainer in the process; pass "
                    f"{name}= to the trainer instead (or set it on a subclass of your own)",
                    FutureWarning,
                    stacklevel=3,
                )


class LossfxGRPOMixin:
    """Put before `trl.GRPOTrainer` in the bases: its per-token log-probs come from lossfx.

    Overrides `_get_per_token_logps_and_entropies`, which TRL calls for the policy's log-probs in
    the loss, the old policy's (when the rollouts are reused off-step) and the reference model's
    (`beta > 0`): the model runs through its (possibly DDP- or FSDP-wrapped) forward with
    `output_hidden_states=True` and `logits_to_keep=1` (one logit row per sequence instead of
    `S`), then `per_token_logps_and_entropies` scores the completion from the last hidden states
    and the LM head. Multimodal batches and MoE auxiliary losses go to the stock method. The
    head's bias, logit scale and soft-cap come from `head_options`. Logs once per trainer (logger
    `lossfx.integrations.trl`, INFO) when it first computes log-probs.

    Options, keyword arguments of the trainer's `__init__`, stored on the instance (a class
    attribute of the same name, e.g. on a subclass, is the default):

    - `lossfx_sharded_head`: `"raise"` (default), `"gather"` (FSDP2) or `"tensor_parallel"`,
      passed as `sharded_head`;
    - `lossfx_filtered_logprobs`: `True` scores the completions under the trainer's `top_k` /
      `top_p` (the sampler's filtered distribution, fused: `linear_filtered_token_logprobs`)
      instead of the full distribution stock TRL scores (default `False`);
    - `lossfx_filter_ties`: top-p's rule among equal logits under `lossfx_filtered_logprobs`,
      `"together"` (default) or `"sorted"` (`lossfx.TrainingSamplingParams.ties`);
    - `lossfx_chunk_size`: rows per logits chunk of the fused kernel (`None`: its default);
    - `lossfx_compile`: `True` runs `per_token_logps_and_entropies` under
      `torch.compile(fullgraph=True)` (compiled once per trainer), a dict adds keyword arguments
      of `torch.compile` (e.g. `{"backend": "aot_eager"}`); TRL's `torch_compile=True` compiles
      the model's forward only (default `False`).

    Raises `TypeError` at `__init__` on a class that is not a `GRPOTrainer`, or whose TRL lacks
    the method it overrides (or takes other leading parameters), and at class creation when a
    base before it in the MRO defines that method (the override would never run).
    """

    lossfx_sharded_head: ShardedHead = "raise"
    lossfx_filtered_logprobs: bool = False
    lossfx_filter_ties: Literal["together", "sorted"] = "together"
    lossfx_chunk_size: int | None = None
    lossfx_compile: bool | dict[str, Any] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        owner = next((k for k in cls.__mro__ if "_get_per_token_logps_and_entropies" in vars(k)), None)
        if owner is not None and not issubclass(owner, LossfxGRPOMixin):
            raise TypeError(
                f"{cls.__qualname__}: {owner.__qualname__}._get_per_token_logps_and_entropies comes before "
                "LossfxGRPOMixin's in the MRO, so lossfx would never run: put LossfxGRPOMixin first in the bases"
            )

    def __init__(
        self,
        *args: Any,
        lossfx_sharded_head: ShardedHead = _UNSET,
        lossfx_filtered_logprobs: bool = _UNSET,
        lossfx_filter_ties: Literal["together", "sorted"] = _UNSET,
        lossfx_chunk_size: int | None = _UNSET,
        lossfx_compile: bool | dict[str, Any] = _UNSET,
        **kwargs: Any,
    ) -> None:
        _check_trainer_class(type(self))
        _warn_shared_class_options()
        given = (lossfx_sharded_head, lossfx_filtered_logprobs, lossfx_filter_ties, lossfx_chunk_size, lossfx_compile)
        for name, value in zip(_OPTIONS, given, strict=True):
            setattr(self, name, _check_option(name, getattr(type(self), name) if value is _UNSET else value))
        self._lossfx_compiled: Any = None
        self._lossfx_logged = False
        super().__init__(*args, **kwargs)

    def _lossfx_function(self) -> Any:
        """`per_token_logps_and_entropies`, compiled once per trainer under `lossfx_compile`."""
        options = getattr(self, "lossfx_compile", False)
        if options is False:
            return per_token_logps_and_entropies
        if getattr(self, "_lossfx_compiled", None) is None:
            self._lossfx_compiled = torch.compile(
                per_token_logps_and_entropies, **{"fullgraph": True, **(options if isinstance(options, dict) else {})}
            )
        return self._lossfx_compiled

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: Tensor,
        attention_mask: Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(  # type: ignore[misc]
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        unwrapped = self.accelerator.unwrap_model(model)  # type: ignore[attr-defined]
        head = head_options(unwrapped)
        takes_keep = "logits_to_keep" in inspect.signature(unwrapped.forward).parameters
        sampling = None
        if self.lossfx_filtered_logprobs:
            top_k = getattr(self, "top_k", None)
            top_p = float(getattr(self, "top_p", 1.0) or 1.0)
            sampling = TrainingSamplingParams(top_k=top_k or None, top_p=top_p, ties=self.lossfx_filter_ties)
        fn = self._lossfx_function()
        if not getattr(self, "_lossfx_logged", False):
            self._lossfx_logged = True
            logger.info(
                "lossfx computes %s's per-token log-probs and entropies (lossfx.integrations.trl: sharded_head=%r, "
                "filtered_logprobs=%r, filter_ties=%r, chunk_size=%r, compile=%r)",
                type(self).__name__, self.lossfx_sharded_head, self.lossfx_filtered_logprobs,
                self.lossfx_filter_ties, self.lossfx_chunk_size, getattr(self, "lossfx_compile", False),
            )  # fmt: skip
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            kwargs = {"logits_to_keep": 1} if takes_keep else {}
            autocast = getattr(self.accelerator, "autocast", contextlib.nullcontext)  # type: ignore[attr-defined]
            with autocast():
                out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, **kwargs)
            args = (out.hidden_states[-1], unwrapped.get_output_embeddings().weight, ids, mask)
            options = {
                "logits_to_keep": logits_to_keep,
                "temperature": self.temperature,  # type: ignore[attr-defined]
                "compute_entropy": compute_entropy,
                "chunk_size": self.lossfx_chunk_size,
                "sharded_head": self.lossfx_sharded_head,
                "sampling_params": sampling,
                **head,
            }
            if fn is not per_token_logps_and_entropies:  # compiled: the ranks' check runs here, eagerly
                _check_ranks_agree(*args, **options)
            lp, ent = fn(*args, **options)
            logps.append(lp)
            if ent is not None:
                entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


_trainer_class: Any = None


def __getattr__(name: str) -> Any:
    """`LossfxGRPOTrainer`: `LossfxGRPOMixin` on `trl.GRPOTrainer`, built (importing TRL) on first use."""
    global _trainer_class
    if name != "LossfxGRPOTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _trainer_class is None:
        from trl import GRPOTrainer

        _trainer_class = type(
            "LossfxGRPOTrainer",
            (LossfxGRPOMixin, GRPOTrainer),
            {"__doc__": "`trl.GRPOTrainer` whose per-token log-probs and entropies come from lossfx's fused head."},
        )
        _trainer_class.__module__ = __name__
    return _trainer_class
