"""Row chunking for the eager path; one chunk under `torch.compile`.

Eager PyTorch materialises every intermediate of a row reduction, so the kernels walk the rows in
chunks and keep each chunk's `[C, Vl]` temporaries small (ideally cache-resident). Under
`torch.compile` Inductor fuses the reduction and the elementwise backward into loops that never
materialise `[N, Vl]`, and a Python loop over chunks would only unroll into a graph whose size
(and compile time) grows with the chunk count. So when compiling, the whole tensor is one chunk
and `chunk_size` does not change the graph: results do not depend on it either way.
"""

from __future__ import annotations

import torch

# Rows per chunk when the caller gives none: about this many bytes per compute-dtype temporary,
# and at least this many rows, so that the per-chunk Python overhead stays small at large
# vocabularies (one 151936-wide fp32 row is 0.6 MB) while the temporaries stay a small fraction
# of the logits.
DEFAULT_CHUNK_BYTES = 8 << 20
MIN_CHUNK_ROWS = 16


def default_chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """Rows per eager chunk: one `[C, vocab]` temporary near `DEFAULT_CHUNK_BYTES`, C >= 16."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(MIN_CHUNK_ROWS, DEFAULT_CHUNK_BYTES // max(1, vocab * itemsize))


def row_chunks(n_rows: int, chunk_rows: int | None, vocab: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """`[(start, end), ...]` covering `range(n_rows)`; a single chunk under `torch.compile`."""
    if torch.compiler.is_compiling() or n_rows == 0:
        return [(0, n_rows)]
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(vocab, dtype)
    return [(start, min(n_rows, start + rows)) for start in range(0, n_rows, rows)]
