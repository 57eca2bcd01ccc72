"""Top-k values and global ids over a vocabulary sharded across tensor-parallel ranks
(`vocab_topk`): each rank's local top-k as global ids, one all-gather of the candidates, the top-k
of their union, ties broken by the smaller global id (the algorithm and why it is exact:
`lossfx._kernels.topk`). No gradient (a selection).

The boundary: `vocab_topk` unwraps (and pads) a DTensor, validates `logits` and `k`, resolves
this rank's `VocabRange` and calls the pure kernel `lossfx._kernels.topk` once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import local_view, resolved_shard
from lossfx._boundary.validation import check_floating, check_positive_int
from lossfx._core.distributed import ProcessGroup
from lossfx._core.vocab import VocabRange
from lossfx._kernels import topk as _kernel

__all__ = ["vocab_topk"]


def _vocab_policy(arguments: Mapping[str, Any]) -> str:
    """The `vocab` policy of `vocab_topk`: shards tile the vocabulary, `min(k, R·Vl)` is equal."""
    k = arguments.get("k")
    return f"topk:{k}" if isinstance(k, int) and not isinstance(k, bool) and k > 0 else "free"


_ROLES = Roles(tp="group", shards=("logits",), start="vocab_start")  # the parameters' parts (`Roles`)


@boundary(roles=_ROLES, vocab=_vocab_policy, local=local_view(_ROLES, even=True))
@torch.no_grad()
def vocab_topk(
    logits: Tensor,
    k: int,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    _view: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """The `k` largest logits per row of a (possibly sharded) vocabulary and their global ids.

    Equivalent to ``torch.topk(logits, k, dim=-1)`` on the full-vocabulary logits, with ties
    ordered by the smaller id, values in `promote_types(logits.dtype, float32)`.

    Args:
        logits: `[..., Vl]` this rank's shard (the full vocabulary without a group).
        k: how many per row; clamped to `V` (a `k` larger than the vocabulary returns all of it).
            With uneven plain shards (no DTensor), `k <= world_size · the smallest shard width`
            (checked across ranks).
        group: tensor-parallel group over the vocabulary, or `None`.
        vocab_start: first global id of this shard; default `rank · Vl`.

    Returns:
        `(values [..., min(k, V)], ids [..., min(k, V)] int64)`, identical on every rank,
        sorted by value descending.

    Raises:
        TypeError: non-float logits or non-int `k`. ValueError: `k <= 0`.

    Example:
        >>> import torch, lossfx
        >>> lossfx.vocab_topk(torch.tensor([[0.5, 2.0, 2.0, -1.0]]), 2)
        (tensor([[2., 2.]]), tensor([[1, 2]]))
    """
    s = resolved_shard(_view)  # the boundary's one unwrap (a DTensor's local shard padded to even widths)
    logits, group, vocab_start = s.local, s.group, None if s.padded else s.vocab_start
    check_floating("logits", logits)
    k = check_positive_int("k", k, allow_none=False)
    k = k if s.vocab_size is None else min(k, s.vocab_size)  # a DTensor's V: its padding columns never count
    local_vocab = logits.shape[-1]
    if logits.dim() < 1 or local_vocab < 1:
        raise ValueError(f"logits must be [..., V_local] with V_local >= 1, got shape {tuple(logits.shape)}")
    vocab = VocabRange.of(group, local_vocab, vocab_start, None)
    return _kernel.vocab_topk(logits, k, vocab)
