"""Row chunking for the eager path; one chunk under `torch.compile`.

Eager PyTorch materialises every intermediate of a row reduction, so the kernels walk the rows in
chunks and keep each chunk's `[C, Vl]` temporaries small (ideally cache-resident). Under
`torch.compile` Inductor fuses the reduction and the elementwise backward into loops that never
materialise `[N, Vl]`, and a Python loop over chunks would only unroll into a graph whose size
(and compile time) grows with the chunk count. So when compiling, the whole tensor is one chunk
and `chunk_size` does not change the graph: results do not depend on it either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from lossfx._host_reads import tracing

# Rows per chunk when the caller gives none: about this many bytes per compute-dtype temporary,
# and at least this many rows, so that the per-chunk Python overhead stays small at large
# vocabularies (one 151936-wide fp32 row is 0.6 MB) while the temporaries stay a small fraction
# of the logits.
DEFAULT_CHUNK_BYTES = 8 << 20
MIN_CHUNK_ROWS = 16


@dataclasses.dataclass(frozen=True)
class ChunkPolicy:
    """How large the eager loops' temporaries may be on one kind of device (a memory budget).

    A CPU wants cache-sized chunks; a GPU pays ~5 µs per launched kernel, so it wants few, large
    chunks. Every loop count derived from a policy must depend only on rank-independent sizes
    (the global vocabulary, N, H), never on this rank's shard width or free memory, so that every
    rank runs the same collectives.

    Attributes:
        row_bytes: bytes of one `[C, V]` compute-dtype temporary of a logits-side row loop.
        min_rows: rows per logits-side chunk, at least.
        tile_bytes: bytes of one `[C, Cv]` compute-dtype tile of the hidden × LM-head loops.
        max_block: vocabulary rows `Cv` per hidden × LM-head tile, at most.
        chunk_bytes: bytes of one `[C, Vl]` compute-dtype chunk of the hidden × LM-head loops that
            run rows outside (`linear_logprob_objective`, the projected teacher); `lossfx._tiles`.
        compile_tiles: run the fused path's per-tile arithmetic as an Inductor-compiled function
            (one compile per dtype and tile shape) instead of eager in-place passes.
    """

    row_bytes: int
    min_rows: int
    tile_bytes: int
    max_block: int
    chunk_bytes: int = 96 << 20
    compile_tiles: bool = False


CPU_POLICY = ChunkPolicy(row_bytes=DEFAULT_CHUNK_BYTES, min_rows=MIN_CHUNK_ROWS, tile_bytes=4 << 20, max_block=2048)
# Provisional; sized so that a [1, 16384, 151936] call runs few chunks (see docs/design.md).
GPU_POLICY = ChunkPolicy(
    row_bytes=1 << 30, min_rows=256, tile_bytes=1 << 30, max_block=1 << 18, chunk_bytes=1 << 30, compile_tiles=True
)

_forced: ChunkPolicy | None = None


def policy_for(device: torch.device) -> ChunkPolicy:
    """The policy in force for tensors on `device`: the one `chunk_policy` forces, else CPU or GPU."""
    if _forced is not None:
        return _forced
    return CPU_POLICY if device.type == "cpu" else GPU_POLICY


@contextlib.contextmanager
def chunk_policy(policy: ChunkPolicy) -> Iterator[None]:
    """Use `policy` for every device inside the block (process-wide; for tuning and for counting a
    GPU's launches on CPU). Per call, `chunk_size=` still wins."""
    global _forced
    if not isinstance(policy, ChunkPolicy):
        raise TypeError(f"policy must be a lossfx.ChunkPolicy; got {type(policy).__name__}")
    previous, _forced = _forced, policy
    try:
        yield
    finally:
        _forced = previous


def default_chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """Rows per eager chunk: one `[C, vocab]` temporary near `DEFAULT_CHUNK_BYTES`, C >= 16."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(MIN_CHUNK_ROWS, DEFAULT_CHUNK_BYTES // max(1, vocab * itemsize))


def row_chunks(n_rows: int, chunk_rows: int | None, vocab: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """`[(start, end), ...]` covering `range(n_rows)`; a single chunk under `torch.compile`."""
    if tracing() or n_rows == 0:
        return [(0, n_rows)]
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(vocab, dtype)
    return [(start, min(n_rows, start + rows)) for start in range(0, n_rows, rows)]
