"""A weighted sum of token log-probs from hidden states, its gradient formed in the forward pass.

    objective = Σ_n a_n · log p_n(t_n) + Σ_n b_n · Σ_v p_n(v) log p_n(v),   z = hidden @ weight.T / T

with per-token coefficients `a` (and optionally `b`) known before the forward: a negative
log-likelihood (`a = −mask / Σ mask`), an on-policy policy gradient (`a = −advantage · mask / norm`,
the gradient of GRPO's or PPO's clipped ratio loss when the ratio is 1), an entropy bonus (`b`,
the coefficient of the negative entropy `Σ p log p`: a bonus β is `b = −β · mask / norm`).

Why: `linear_token_logprobs` does not know the upstream gradient of its log-probs in the forward,
so its backward must recompute every logits tile: four matmuls against the unfused path's three.
Here the upstream gradient of every logit is known as soon as the row's softmax is, so one pass
over the rows forms `dlogits` and both gradients (three matmuls, as unfused), and the backward only
scales them by the upstream gradient of the scalar.

The loop (`lossfx::linear_objective_rows`, one opaque custom op under `torch.compile`, on the tile
engine `lossfx._core.tiles`, rows outside) walks chunks of `C` rows of `hidden` and keeps one `[C, Vl]`
chunk of logits of this rank's vocabulary shard, the most any design with three matmuls needs: per
chunk it forms the logits (in vocabulary blocks), the row statistics, merges them over the
tensor-parallel ranks (one all-gather of `[R, 4, C]` per-row scalars, inside the op), turns the
chunk into `dlogits` in place and adds its products to `dhidden` and `dweight`
(proofs/linear_objective.md). The dense equivalent: `lossfx.reference.linear_logprob_objective`.

The boundary: this module is the public face. `linear_logprob_objective` does its boundary work
once, at the top (DTensor unwrap, validation of the arguments and coefficients, one range check of
the target, the `VocabRange`), then calls the pure kernel `lossfx._kernels.linear_objective` once.
"""

from __future__ import annotations

from typing import Unpack

from torch import Tensor

from lossfx._boundary.consistency import boundary
from lossfx._boundary.deprecation import renamed_keywords
from lossfx._boundary.validation import check_floating
from lossfx._kernels import linear_objective as kernel
from lossfx._kernels.linear_objective import default_objective_chunk_rows as default_objective_chunk_rows
from lossfx.fused_linear import _ROLES, LinearKeywords, linear_keywords, local_view, resolved_call

__all__ = ["linear_logprob_objective"]


@renamed_keywords(signed=True, entropy_weight="neg_entropy_weight")
@boundary(roles=_ROLES, vocab="tiled", local=local_view(seq_dim=0))
@linear_keywords
def linear_logprob_objective(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    logprob_weight: Tensor,
    *,
    neg_entropy_weight: Tensor | None = None,
    allow_repeated_backward: bool = False,
    **kw: Unpack[LinearKeywords],
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`Σ a·log p(target) (+ Σ b·Σ p log p)` from hidden states, gradients formed in the forward.

    Equivalent, on the full LM head (all ranks' shards in rank order), to::

        lp = (hidden @ weight.T / temperature).log_softmax(-1)
        logprobs, neg_entropy = lp.gather(-1, target[..., None])[..., 0], (lp.exp() * lp).sum(-1)
        objective = (logprob_weight * logprobs).sum() + (neg_entropy_weight * neg_entropy).sum()
        return objective, logprobs.detach(), neg_entropy.detach()

    in three matmuls per logits element (the unfused path's count; `linear_token_logprobs` needs
    four, because its backward recomputes the logits) and one `[C, Vl]` chunk of logits alive.
    Use it when the per-token coefficients are known before the forward: negative log-likelihood
    (`a = −mask / Σ mask`, then minimise `−objective`), on-policy policy gradients (`a = −A·mask /
    norm`: the gradient of a clipped-ratio loss at ratio 1), entropy bonuses (`b = −β·mask/norm`:
    `b` multiplies the negative entropy, so minimising `−objective` then raises the entropy). When the
    coefficient depends on the log-prob itself (an off-policy clipped ratio), use
    `linear_token_logprobs` and any loss.

    Args:
        hidden: `[..., H]` last hidden states, replicated on every TP rank (each rank's
            `hidden.grad` is the full gradient: the all-reduce of `[N, H]` runs in the forward),
            or with `sequence_parallel=True` this rank's rows of the flattened `[N, H]` (all-gathered
            in the forward, the gradient reduce-scattered in the forward). DTensor layouts as in
            `linear_token_logprobs`.
        weight: `[Vl, H]` this rank's rows of the LM head (the whole head without a group), or a
            `Shard(0)` DTensor head; any floating dtype (matmuls in the promoted dtype).
        target: `[...]` integer global ids in `[0, V)`; the full `N` positions on every rank.
        logprob_weight: `[...]` float coefficients `a` of the log-probs (the target's shape; the
            full `N` on every rank). Its gradient is `logprobs` (scaled).
        neg_entropy_weight: `[...]` float coefficients `b` of `Σ_v p log p` (the negative
            entropy), or `None` (no entropy term, and `neg_entropy` is not computed). Formerly
            `entropy_weight=`, which still works with a FutureWarning.
        group: tensor-parallel group over the vocabulary, or `None`.
        vocab_start: first global id of this shard; default `rank · Vl`.
        vocab_size: global vocabulary size `V`; default `world_size · Vl`.
        bias, temperature, logit_scale, softcap, ignore_index: the head's options (`HeadKeywords`),
            as in `linear_token_logprobs` (an ignored target adds nothing to the objective).
        sequence_parallel: the hidden layout described above.
        chunk_size: rows per chunk; one `[C, Vl]` chunk of logits in the compute dtype is alive
            (results do not depend on it). Default: `N / 16` rows, at most a `[C, ceil(V/R)]`
            chunk near the device policy's `chunk_bytes` (96 MiB on CPU), at least 16 rows: the
            same on every rank, uneven shards included (each chunk runs one all-gather over the group).
        allow_repeated_backward: `False`: the backward scales the `weight` gradient formed in the
            forward in place (no second `[Vl, H]` buffer), and a second backward through the same
            graph raises; `True`: it scales a copy, so `retain_graph=True` and `gradcheck` work,
            at one more `[Vl, H]` buffer during the backward.

    Returns:
        `(objective, logprobs, neg_entropy)`: the scalar objective in
        `promote_types(dtype, float32)` (differentiable with respect to `hidden`, `weight` and the
        coefficients), and the values `logprobs [...]` and `neg_entropy [...]` (or `None`) without
        gradient, replicated over the TP group.

    Gradient contract: `hidden`/`weight` gradients are formed in the forward and scaled by the
    objective's upstream gradient in the backward (`weight`'s in its dtype: exact when that
    gradient is 1; in place unless `allow_repeated_backward`). Extra
    memory: the gradients themselves from the forward on, one `[C, Vl]` chunk, and for bf16/fp16
    weights one `[Vl, H]` fp32 accumulator of `dweight` (the rows-outer loop revisits every
    vocabulary row once per chunk).

    Raises:
        TypeError: non-float `hidden`/`weight`/`bias`/coefficients, non-integer `target`,
            a non-bool `allow_repeated_backward`.
        ValueError: shape mismatches, `temperature <= 0`, `chunk_size <= 0`, target ids outside
            `[0, V)` (compiled: an in-graph `RuntimeError`).

    Example:
        >>> import torch, lossfx
        >>> h, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
        >>> objective, lp, _ = lossfx.linear_logprob_objective(h, w, torch.tensor([2]), torch.tensor([-1.0]))
        >>> objective, lp
        (tensor(0.4076), tensor([-0.4076]))

    See also: docs/fused_linear.md, proofs/linear_objective.md, lossfx.reference.linear_logprob_objective.
    """
    # hidden, weight, target and the coefficients: local tensors (the boundary's one unwrap, `local_view`)
    coefficients = {"logprob_weight": logprob_weight}
    if neg_entropy_weight is not None:
        coefficients["neg_entropy_weight"] = neg_entropy_weight
    for name, value in coefficients.items():
        check_floating(name, value)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name} must have the target's shape {tuple(target.shape)}, got {tuple(value.shape)}")
    if not isinstance(allow_repeated_backward, bool):
        raise TypeError(f"allow_repeated_backward must be a bool, got {allow_repeated_backward!r}")
    call = resolved_call(hidden, weight, kw, target, "target")
    return kernel.linear_logprob_objective(
        hidden,
        weight,
        target,
        logprob_weight,
        neg_entropy_weight,
        call.vocab,
        allow_repeated_backward=allow_repeated_backward,
        **call.options,
    )
