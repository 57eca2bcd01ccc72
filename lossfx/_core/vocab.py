"""`VocabRange`: this rank's slice of a (possibly tensor-parallel) vocabulary, as the kernels take it.

The public functions resolve it once, at their boundary (DTensor placement, explicit
`vocab_start` / `vocab_size`, or the uniform default); the kernels below only read it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

__all__ = ["VocabRange"]


class VocabRange(NamedTuple):
    """Global ids `[start, start + Vl)` of `[0, size)` on this rank, `Vl` the local width.

    `group` is the tensor-parallel group over the vocabulary (`None`: no tensor parallelism,
    then `start = 0` and `size = Vl`). Dense equivalent: this rank's logits are
    `full_logits[..., start : start + Vl]`.
    """

    group: dist.ProcessGroup | None
    start: int
    size: int

    @classmethod
    def uniform(cls, group: dist.ProcessGroup | None, width: int) -> VocabRange:
        """Equal shards of `width` columns in rank order: `start = rank · width`, `size = R · width`."""
        if group is None:
            return cls(None, 0, width)
        return cls(group, group.rank() * width, group.size() * width)

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, width: int, start: int | None, size: int | None) -> VocabRange:
        """Explicit `start` / `size` (a DTensor's placement, or the caller's), each defaulting to
        the uniform layout's (`uniform`)."""
        uniform = cls.uniform(group, width)
        return cls(group, uniform.start if start is None else start, uniform.size if size is None else size)

    @classmethod
    def whole(cls, size: int) -> VocabRange:
        """The full vocabulary on one rank."""
        return cls(None, 0, size)
