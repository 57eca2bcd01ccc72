"""Top-k / top-p filtered token log-probs from hidden states and an LM head, logits never materialised.

The hidden-state twin of `lossfx.filtered_token_logprobs(head(hidden @ weight.T + bias), target,
top_k=..., top_p=..., ties=...)`: the same filter (no sort, tie rules "together" / "sorted",
NaN rows kept NaN, the same at every TP size), one `[C, Vl]` chunk of logits at a time, two passes
over the vocabulary in all (one forward, one recomputing backward). How: the kernel,
`lossfx._kernels.linear_filtering`; why it is exact: proofs/linear_filtering.md.

The boundary is the fused path's (`lossfx.fused_linear`): the DTensor unwrap of `weight`/`bias`/
`hidden`, the keywords (`LinearKeywords`), `resolved_call` and the cross-rank check's roles,
reused as they are; this module adds only the filter's options (`lossfx.filtering`'s checks).
"""

from __future__ import annotations

from typing import Unpack

from torch import Tensor

from lossfx._boundary.consistency import boundary
from lossfx._kernels import linear_filtering as kernel
from lossfx.filtering import TIES, check_filter_params
from lossfx.fused_linear import _ROLES, LinearKeywords, linear_keywords, local_view, resolved_call

__all__ = ["TIES", "linear_filtered_token_logprobs"]


@boundary(roles=_ROLES, vocab="tiled", local=local_view(seq_dim=0))
@linear_keywords
def linear_filtered_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    ties: str = "together",
    **kw: Unpack[LinearKeywords],
) -> Tensor:
    """Log-prob of each token under the top-k/top-p filtered softmax of `hidden @ weight.T`, fused.

    Equivalent, with `z = head(hidden @ weight_full.T + bias_full)` (all ranks' shards in rank
    order; `head` the soft-cap, scale and temperature of `linear_token_logprobs`), to::

        lossfx.filtered_token_logprobs(z, token_ids, top_k=top_k, top_p=top_p, ties=ties)

    (0 where `token_ids == ignore_index`), computed one `[C, Vl]` chunk of logits at a time
    (`C <= N/32` rows on a CPU, eager and compiled): one forward pass and one backward pass over the
    vocabulary, whatever the data (docs/fused_linear.md, "Filtered log-probs").

    .. math::
        \\mathrm{out}_n = z_{n,t_n} - \\log \\sum_{v:\\, \\mathrm{keep}_{n,v}} e^{z_{n,v}}
        \\quad (-\\infty \\text{ if the target is filtered out})

    Args:
        hidden: `[..., H]` last hidden states (replicated over the TP group; every rank's
            `hidden.grad` is the full gradient), or with `sequence_parallel=True` this rank's rows
            of the flattened `[N, H]`.
        weight: `[Vl, H]` this rank's rows of the LM head (the whole head without a group), or a
            `Shard(0)` DTensor head.
        token_ids: `[...]` integer global ids in `[0, V)` (or `ignore_index`).
        top_k: keep the `top_k` largest logits (ties with the k-th all kept); `None` or `<= 0`
            disables it.
        top_p: after top-k, keep a token iff the renormalised mass of the tokens with a strictly
            larger logit is `< top_p`; `None` or `1.0` disables it; must lie in `(0, 1]`.
        ties: top-p's rule among equal logits, `"together"` (default) or `"sorted"` (NeMo RL's
            sort order), as in `lossfx.filtered_token_logprobs`.
        group, vocab_start, vocab_size: the vocabulary sharding, as in `lossfx.linear_token_logprobs`.
        bias, temperature, logit_scale, softcap, ignore_index: the head's options (`HeadKeywords`),
            as in `lossfx.linear_token_logprobs` (the filter sees the logits after the head).
        sequence_parallel: as in `lossfx.linear_token_logprobs`.
        chunk_size: rows per logits chunk (a memory bound; results do not depend on it).

    Returns:
        `[...]` log-probs in the compute dtype (fp32, float64 for float64 inputs), replicated over
        the TP group; `-inf` where the token is filtered out, NaN for a row whose logits hold a
        NaN (its gradient NaN too, never 0). Gradients reach `hidden`, `weight` and `bias` (no
        derivative through the thresholds).

    Raises:
        TypeError: non-float `hidden`/`weight`/`bias`, non-integer `token_ids`.
        ValueError: bad `top_k`/`top_p`/`ties`, shape mismatches, ids outside `[0, V)`.

    Example:
        >>> import torch, lossfx
        >>> h, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
        >>> lossfx.linear_filtered_token_logprobs(h, w, torch.tensor([2]), top_k=2)
        tensor([-0.3133])

    See also: proofs/linear_filtering.md, lossfx.reference.linear_filtered_token_logprobs.
    """
    # hidden, weight, token_ids: local tensors (the boundary's one unwrap, `local_view`)
    k, p = check_filter_params(top_k, 1.0 if top_p is None else top_p, ties)
    call = resolved_call(hidden, weight, kw, token_ids, "token_ids")
    return kernel.linear_filtered_token_logprobs(
        hidden, weight, token_ids, call.vocab, top_k=k, top_p=p, ties=ties, **call.options
    )
