"""TRL: per-token log-probs and entropies from hidden states and an LM head, through the fused path.

    z               = c · tanh(s · (h[b, S−K−1+j] Wᵀ + bias) / c) / T       (bias, s, c: the head's options)
    logps[b, j]     = log softmax(z)[labels[b, S−K+j]]                    j < K = logits_to_keep
    entropies[b, j] = −Σ_v p log p at the same position              (0 where the label is masked)

`per_token_logps_and_entropies` is what TRL's `GRPOTrainer._get_per_token_logps_and_entropies`
returns for one micro-batch (TRL 1.16: its fused LM head, `trl.trainer.utils.add_fused_lm_head`),
computed by `lossfx.linear_next_token_logprobs` on the last `K + 1` positions only: the logits are
never materialised and the prompt is never projected. `LossfxGRPOMixin` plugs it into a
`GRPOTrainer`; `LossfxGRPOTrainer` is the ready subclass (built on first access, so importing this
module imports neither TRL nor transformers). Docs: docs/huggingface.md.

An integration is a user of lossfx's public API: it calls the public entry points
(`lossfx.linear_next_token_logprobs`, `lossfx.next_token_logprobs`), each of which does its
boundary work once, never the pure code below them.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
from typing import Any, Literal

import torch
from torch import Tensor

from lossfx._boundary.dtensor import is_dtensor
from lossfx._boundary.validation import check_floating, check_integer_ids, check_positive_float
from lossfx.fused_linear import linear_next_token_logprobs
from lossfx.interfaces import TrainingSamplingParams, need_top_k_or_top_p_filtering
from lossfx.loss_input import next_token_logprobs

# LossfxGRPOTrainer comes from the module's __getattr__ (built on first access)
__all__ = [
    "LossfxGRPOMixin",
    "LossfxGRPOTrainer",  # noqa: F822
    "head_options",
    "lm_head_weight",
    "per_token_logps_and_entropies",
]

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


def _head_tensor(name: str, weight: Any, sharded_head: ShardedHead) -> Any:
    """`lm_head_weight` for the weight or the bias (`name` names it in errors)."""
    if sharded_head not in ("raise", "gather", "tensor_parallel"):
        raise ValueError(f"sharded_head must be 'raise', 'gather' or 'tensor_parallel', got {sharded_head!r}")
    if not is_dtensor(weight):
        return check_floating(name, weight)
    if all(p.is_replicate() for p in weight.placements):
        return weight.to_local()
    if sharded_head == "gather":
        from torch.distributed.tensor import Partial  # the DTensor above proves it importable

        # every mesh dim is data parallel: the head's gradient is averaged over all ranks' data,
        # FSDP2's default reduction (a plain full_tensor() would give each shard its own rank's part)
        return weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
    if sharded_head == "tensor_parallel":
        return weight
    raise ValueError(
        f"the {name} is a DTensor with placements {tuple(weight.placements)} (FSDP2 or tensor "
        "parallel); lossfx will not guess which: pass sharded_head='gather' to all-gather it with "
        "full_tensor() (FSDP2, DDP-like data parallelism), or sharded_head='tensor_parallel' for a "
        "vocabulary-sharded head whose ranks all hold the same hidden states"
    )


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
    that score nothing are `ignore_index` rows of the kernel (never projected).

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
            `temperature` is ignored, `temperature` above applies). With a filter, `logps` are
            those of the filtered distribution the sampler drew from (`−inf` where the token lies
            outside it), computed on the logits path: the `[B, K, V]` logits are materialised.
            The entropies stay those of the unfiltered distribution (TRL's metric).
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
            `temperature`, `logit_scale` or `softcap` that is not finite and > 0.
    """
    check_floating("hidden_states", hidden_states)
    check_integer_ids("input_ids", input_ids)
    # checked here as well as in the fused kernel: the filtered path below divides by them itself
    temperature = check_positive_float("temperature", temperature)
    logit_scale = check_positive_float("logit_scale", logit_scale)
    softcap = check_positive_float("softcap", softcap, allow_none=True)
    weight = lm_head_weight(weight, sharded_head)
    if bias is not None:
        bias = _head_tensor("lm_head bias", bias, sharded_head)
    if input_ids.dim() != 2 or hidden_states.dim() != 3 or tuple(hidden_states.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"hidden_states must be [B, S, H] and input_ids [B, S]; got hidden_states.shape="
            f"{tuple(hidden_states.shape)} and input_ids.shape={tuple(input_ids.shape)}"
        )
    for name, x in (("attention_mask", attention_mask), ("labels", labels), ("position_ids", position_ids)):
        if x is not None:
            if not (name == "attention_mask" and x.dtype == torch.bool):
                check_integer_ids(name, x)
            if tuple(x.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {name}.shape={tuple(x.shape)}"
                )
    keep = _check_logits_to_keep(logits_to_keep, input_ids.shape[1])
    start = input_ids.shape[1] - keep - 1  # hidden position scoring the first kept token
    targets = (input_ids if labels is None else labels)[:, start:]  # [B, K+1]; column 0 never scored
    scored = targets[:, 1:] != IGNORE_INDEX  # [B, K]
    if attention_mask is not None:
        scored = scored & (attention_mask[:, start + 1 :] != 0)
    hidden = hidden_states[:, start:]
    pos = None if position_ids is None else position_ids[:, start:]
    if pos is not None:  # a sequence's last position scores nothing (both paths, both outputs)
        scored = scored & (pos[:, 1:] != 0)
    head = {"bias": bias, "logit_scale": logit_scale, "softcap": softcap}
    if need_top_k_or_top_p_filtering(sampling_params):
        targets = torch.where(targets == IGNORE_INDEX, torch.zeros_like(targets), targets)
        return _filtered(hidden, weight, targets, scored, temperature, compute_entropy, pos, sampling_params, head)
    # what scores nothing is an ignored row of the kernel: 0, zero gradient, never projected
    ignored = torch.full_like(targets[:, :1], IGNORE_INDEX)
    targets = torch.cat([ignored, torch.where(scored, targets[:, 1:], IGNORE_INDEX)], dim=1)
    with torch.autocast(hidden.device.type, enabled=False):  # promote_types(hidden, weight) is the matmuls'
        result = linear_next_token_logprobs(
            hidden,
            weight,
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            return_neg_entropy=bool(compute_entropy),
            position_ids=pos,
            ignore_index=IGNORE_INDEX,
            **head,
        )
    logps, neg_entropy = result if isinstance(result, tuple) else (result, None)
    return logps, None if neg_entropy is None else -neg_entropy


def _filtered(
    hidden: Tensor,
    weight: Any,
    targets: Tensor,
    scored: Tensor,
    temperature: float,
    compute_entropy: bool,
    position_ids: Tensor | None,
    sampling_params: Any,
    head: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """The logits path of `per_token_logps_and_entropies` under a top-k/top-p filter."""
    bias, scale, cap = head["bias"], head["logit_scale"], head["softcap"]
    if is_dtensor(weight) or is_dtensor(bias):
        raise ValueError("sampling_params with a top-k/top-p filter needs a plain (or gathered) LM-head weight")
    with torch.autocast(hidden.device.type, enabled=False):
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        logits = hidden.to(dtype) @ weight.to(dtype).T  # [B, K+1, V]
        if bias is not None:
            logits = logits + bias.to(dtype)
        logits = logits * scale
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        logits = logits / temperature
        logps = next_token_logprobs(logits, targets, sampling_params=sampling_params, position_ids=position_ids)
        entropies = None
        if compute_entropy:
            lp = torch.log_softmax(logits[:, :-1].to(logps.dtype), dim=-1)
            entropies = -(lp.exp() * lp).sum(-1)
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    logps = torch.where(scored, logps, zero)
    return logps, None if entropies is None else torch.where(scored, entropies, zero)


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


class LossfxGRPOMixin:
    """Put before `trl.GRPOTrainer` in the bases: its per-token log-probs come from lossfx.

    Overrides `_get_per_token_logps_and_entropies`: the model runs through its (possibly DDP- or
    FSDP-wrapped) forward with `output_hidden_states=True` and `logits_to_keep=1` (one logit row
    per sequence instead of `S`), then `per_token_logps_and_entropies` scores the completion from
    the last hidden states and the LM head. Multimodal batches and MoE auxiliary losses go to
    the stock method. The head's bias, logit scale and soft-cap come from `head_options`.
    `lossfx_sharded_head` (class attribute, default `"raise"`) is passed as
    `sharded_head`: set it to `"gather"` under FSDP2. `lossfx_filtered_logprobs = True` scores
    the completions under the trainer's `top_k` / `top_p` (the sampler's filtered distribution,
    on the logits path) instead of the full distribution stock TRL scores.
    """

    lossfx_sharded_head: ShardedHead = "raise"
    lossfx_chunk_size: int | None = None
    lossfx_filtered_logprobs: bool = False

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
            sampling = TrainingSamplingParams(top_k=top_k or None, top_p=float(getattr(self, "top_p", 1.0) or 1.0))
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            kwargs = {"logits_to_keep": 1} if takes_keep else {}
            autocast = getattr(self.accelerator, "autocast", contextlib.nullcontext)  # type: ignore[attr-defined]
            with autocast():
                out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, **kwargs)
            lp, ent = per_token_logps_and_entropies(
                out.hidden_states[-1],
                unwrapped.get_output_embeddings().weight,
                ids,
                mask,
                logits_to_keep=logits_to_keep,
                temperature=self.temperature,  # type: ignore[attr-defined]
                compute_entropy=compute_entropy,
                chunk_size=self.lossfx_chunk_size,
                sharded_head=self.lossfx_sharded_head,
                sampling_params=sampling,
                **head,
            )
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
