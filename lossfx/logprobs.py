"""Token log-probabilities over a vocabulary that may be sharded across tensor-parallel ranks.

    out[n] = logits[n, target[n]] - logsumexp_v logits[n, v]          (v over the global vocab)

The boundary: each public function here unwraps DTensors, validates its arguments (ids
range-checked once), resolves this rank's `VocabRange` and calls the pure kernel
`lossfx._kernels.logprobs` once; the streaming forward, the collective-free backward and their
exactness argument live there (proofs/logprobs.md). Reference: lossfx.reference.token_logprobs.
"""

from __future__ import annotations

from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import local_view
from lossfx._boundary.validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
)
from lossfx._core.chunking import resolve_chunk_rows
from lossfx._core.distributed import ProcessGroup
from lossfx._core.vocab import VocabRange
from lossfx._kernels import logprobs as _kernel

__all__ = ["token_logprobs"]


_ROLES = Roles(
    tp="group", shards=("logits",), start="vocab_start", size="vocab_size"
)  # the cross-rank check's view of the parameters (gather's and filtering's too)


def _validated(
    logits: Tensor,
    target: Tensor,
    group: ProcessGroup | None,
    vocab_start: int | None,
    vocab_size: int | None,
    chunk_rows: int | None,
    chunk_size: int | None,
    ignore_index: int | None = None,
    per_row: bool = False,
) -> tuple[VocabRange, int | None]:
    """The boundary work of the logits path's id functions (`token_logprobs`, `gather_logprobs`,
    `filtered_token_logprobs`, ...), once, on the boundary's view (local tensors):
    `(vocab, chunk_rows)` as the kernel takes them (this rank's range; ids range-checked, the
    ignored positions excepted). `target`: `[...]` ids, one per row, or with `per_row` gather's
    `[..., K]` (named `ids`): one shape rule, `[..., K]` with `K >= 1` and logits' leading dims,
    a target read as `[..., 1]`."""
    name = "ids" if per_row else "target"
    check_floating("logits", logits)
    check_integer_ids(name, target)
    chunk_rows = check_positive_int("chunk_rows", resolve_chunk_rows(chunk_rows, chunk_size))
    ids = target if per_row else target[..., None]  # [..., K]
    if logits.dim() < 1 or ids.dim() != logits.dim() or ids.shape[:-1] != logits.shape[:-1] or ids.shape[-1] < 1:
        raise ValueError(
            f"logits must be [..., V_local] and {name} {'[..., K] (K >= 1)' if per_row else '[...]'} with the same "
            f"leading dims; got logits.shape={tuple(logits.shape)} and {name}.shape={tuple(target.shape)}"
        )
    local_vocab = logits.shape[-1]
    if local_vocab < 1:
        raise ValueError(f"logits must have at least one vocabulary column, got shape {tuple(logits.shape)}")
    vocab = VocabRange.of(group, local_vocab, vocab_start, vocab_size)
    checked = target if ignore_index is None else target.masked_fill(target == ignore_index, 0)
    check_ids_in_range(name, checked, vocab.size)
    return vocab, chunk_rows


@boundary(roles=_ROLES, vocab="tiled", local=local_view(_ROLES))
def token_logprobs_with_lse(
    logits: Tensor,
    target: Tensor,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` that also returns the row log-sum-exp `[...]` (not differentiable).

    The log-probabilities are formed from the max and the log-sum kept apart (exact at any
    magnitude); the returned `lse = shift + log_s` is their rounded sum, for callers that need it.
    `chunk_size` is the deprecated name of `chunk_rows` (same value, a FutureWarning).
    """
    vocab, chunk_rows = _validated(logits, target, group, vocab_start, vocab_size, chunk_rows, chunk_size)
    return _kernel.token_logprobs_with_lse(logits, target, vocab, chunk_rows=chunk_rows)


@boundary(roles=_ROLES, vocab="tiled", local=local_view(_ROLES))
def token_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    ignore_index: int | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Log-probability of each target token under softmax over the (possibly sharded) vocabulary.

    Equivalent to ``logits.log_softmax(-1).gather(-1, target[..., None])[..., 0]`` on the
    full-vocabulary logits (all ranks' shards concatenated in rank order), computed in
    `promote_types(logits.dtype, float32)` without materialising a `[N, V]` float32 tensor.

    .. math::
        \\mathrm{out}_n = z_{n, t_n} - \\log \\sum_v e^{z_{n,v}}

    Args:
        logits: `[..., Vl]` this rank's vocabulary shard (the full vocabulary without a group).
            Any float dtype; never modified.
        target: `[...]` integer global token ids in `[0, V)`.
        group: tensor-parallel process group over the vocabulary, or `None`. The output is the
            same on every rank; the gradient each rank receives is for its own shard only.
        vocab_start: first global id of this shard; default `rank · Vl` (uniform contiguous
            shards). Pass it with `vocab_size` for uneven shards.
        vocab_size: global vocabulary size `V`; default `world_size · Vl`.
        chunk_rows: rows of the flattened `[N, Vl]` logits processed at once in eager mode
            (a memory bound; results do not depend on it). Default: the device's
            `lossfx.ChunkPolicy` (CPU: about 2 MiB per temporary). Under `torch.compile` the
            whole tensor is one fused pass.
        ignore_index: a target id that scores nothing (Hugging Face's `-100`): those positions
            give 0 with a zero gradient and are no range error. Default `None`: every target
            must lie in `[0, V)` (NeMo's contract). Dense equivalent:
            ``torch.where(target == ignore_index, 0, out)`` with any valid id in their place.
        chunk_size: deprecated name of `chunk_rows` (same value; a FutureWarning).

    Returns:
        `[...]` log-probabilities in the compute dtype (fp32 for bf16/fp16/fp32, float64 for
        float64). The gradient flows back to `logits` in its own dtype.

    Raises:
        TypeError: non-float `logits`, non-integer `target`, non-int `chunk_rows`.
        ValueError: shape mismatch, `chunk_rows <= 0`, ids outside `[0, V)`
            (compiled: an in-graph `RuntimeError`).

    Note:
        `-inf` logits are allowed: a `-inf` target logit gives `-inf`; a row that is `-inf`
        everywhere gives `-inf` with a zero gradient (never NaN). Double backward is not
        supported (`once_differentiable`).

    Example:
        >>> import torch, lossfx
        >>> z = torch.tensor([[0.0, 1.0, 2.0]])
        >>> lossfx.token_logprobs(z, torch.tensor([2]))
        tensor([-0.4076])

    See also: proofs/logprobs.md, lossfx.reference.token_logprobs.
    """
    if ignore_index is not None:
        check_ignore_index(ignore_index)
    vocab, chunk_rows = _validated(logits, target, group, vocab_start, vocab_size, chunk_rows, chunk_size, ignore_index)
    return _kernel.token_logprobs(logits, target, vocab, chunk_rows=chunk_rows, ignore_index=ignore_index)


def check_ignore_index(ignore_index: object) -> int:
    """`ignore_index` as an int (TypeError for a bool or a non-int, naming it)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
    return ignore_index
