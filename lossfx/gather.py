"""Log-probabilities at arbitrary global token ids, and the negative entropy, in one streaming pass.

    out[n, k] = logits[n, ids[n, k]] − lse[n]           neg_entropy[n] = Σ_v p[n, v] log p[n, v]

over a vocabulary that may be sharded across tensor-parallel ranks.

The boundary: each public function here unwraps DTensors, validates its arguments (ids
range-checked once), resolves this rank's `VocabRange` and calls the pure kernel
`lossfx._kernels.gather` once; the streaming pass, the collective-free backward and their proofs
live there (proofs/gather.md). Reference: lossfx.reference.gather_logprobs.
"""

from __future__ import annotations

from torch import Tensor

from lossfx._boundary.consistency import boundary
from lossfx._boundary.deprecation import renamed_keywords
from lossfx._boundary.dtensor import local_view
from lossfx._core.distributed import ProcessGroup
from lossfx._kernels import gather as _kernel
from lossfx.logprobs import _ROLES, _validated  # (the same parameters and checks as token_logprobs)

__all__ = ["gather_logits", "gather_logprobs"]


@renamed_keywords(signed=True, with_entropy="with_neg_entropy")
@boundary(roles=_ROLES, vocab="tiled", local=local_view(_ROLES))
def gather_logprobs(
    logits: Tensor,
    ids: Tensor,
    *,
    with_neg_entropy: bool = False,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Full-vocabulary log-probabilities at `K` global ids per row, and optionally `Σ p log p`.

    Equivalent to ``lp = logits.log_softmax(-1); (lp.gather(-1, ids), (lp.exp() * lp).sum(-1))``
    on the full-vocabulary logits, without materialising `[N, V]`; one pass serves both outputs.

    .. math::
        \\mathrm{out}_{n,k} = z_{n, i_{n,k}} - \\mathrm{lse}_n, \\qquad
        H_n = \\sum_v p_{n,v} \\log p_{n,v}

    Args:
        logits: `[..., Vl]` this rank's vocabulary shard (the full vocabulary without a group).
        ids: `[..., K]` global ids in `[0, V)`, any integer dtype; duplicates allowed (their
            gradients add).
        with_neg_entropy: also return the negative entropy `Σ p log p` `[...]` (else `None`).
            (Formerly `with_entropy=`, which still works with a FutureWarning.)
        group: tensor-parallel group over the vocabulary, or `None`; outputs are replicated,
            each rank's gradient is its own shard's.
        vocab_start: first global id of this shard; default `rank · Vl`.
        vocab_size: global `V`; default `world_size · Vl`.
        chunk_rows: rows of the flattened `[N, Vl]` logits per eager chunk (memory bound only);
            default: the device's `lossfx.ChunkPolicy`.
        chunk_size: deprecated name of `chunk_rows` (same value; a FutureWarning).

    Returns:
        `(logprobs [..., K], neg_entropy [...] or None)` in the compute dtype.

    Raises:
        TypeError: non-float logits, non-integer ids.
        ValueError: shape mismatch, `K = 0`, ids outside `[0, V)` (compiled: an in-graph `RuntimeError`),
            `chunk_rows <= 0`.

    Note:
        `−∞` logits contribute `0 · log 0 = 0` to the entropy; an all-`−∞` row gives `−∞`
        log-probs, entropy 0 and a zero gradient.

    Example:
        >>> import torch, lossfx
        >>> lp, h = lossfx.gather_logprobs(torch.zeros(1, 4), torch.tensor([[0, 3]]), with_neg_entropy=True)
        >>> lp, h
        (tensor([[-1.3863, -1.3863]]), tensor([-1.3863]))

    See also: proofs/gather.md, lossfx.reference.gather_logprobs.
    """
    vocab, chunk_rows = _validated(logits, ids, group, vocab_start, vocab_size, chunk_rows, chunk_size, per_row=True)
    return _kernel.gather_logprobs(logits, ids, vocab, with_neg_entropy=with_neg_entropy, chunk_rows=chunk_rows)


@boundary(roles=_ROLES, vocab="tiled", local=local_view(_ROLES))
def gather_logits(
    logits: Tensor,
    ids: Tensor,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """The logits at `K` global ids per row, from a possibly sharded vocabulary.

    Equivalent to ``logits.gather(-1, ids)`` on the full-vocabulary logits, in the compute dtype.
    Each rank contributes the ids it owns, and one all-reduce sums them; the gradient reaches only
    this rank's shard (the replicated-output convention). Duplicate ids' gradients add.

    Args:
        logits: `[..., Vl]` this rank's shard.
        ids: `[..., K]` integer global ids in `[0, V)`.
        group, vocab_start, vocab_size: as in `gather_logprobs`.

    Returns:
        `[..., K]` in `promote_types(logits.dtype, float32)`.

    Example:
        >>> import torch, lossfx
        >>> lossfx.gather_logits(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[2, 2, 0]]))
        tensor([[3., 3., 1.]])
    """
    vocab, _ = _validated(logits, ids, group, vocab_start, vocab_size, None, None, per_row=True)
    return _kernel.gather_logits(logits, ids, vocab)
