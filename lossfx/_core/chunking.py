"""Row chunking of the eager logits-side loops, sized by a per-device policy; one chunk under `torch.compile`.

Eager PyTorch materialises every intermediate of a row reduction, so the kernels walk the rows in
chunks and keep each chunk's `[C, Vl]` temporaries bounded. How large a chunk should be depends on
the device (`ChunkPolicy`, docs/design.md "Chunk sizes per device"): a CPU wants cache-sized
chunks, a GPU pays a kernel launch (~5 µs) per eager op and per chunk, so it wants few, large ones.
Under `torch.compile` Inductor fuses the reduction and the elementwise backward into loops that
never materialise `[N, Vl]`, and a Python loop over chunks would only unroll into a graph whose
size (and compile time) grows with the chunk count. So when compiling, the whole tensor is one
chunk and neither the policy nor `chunk_rows` changes the graph: results do not depend on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import torch

from lossfx._core.host_reads import tracing

__all__ = [
    "CPU_POLICY",
    "GPU_POLICY",
    "ChunkPolicy",
    "cat_chunks",
    "chunk_policy",
    "default_chunk_rows",
    "policy_for",
    "resolve_chunk_rows",
    "row_chunks",
]


@dataclasses.dataclass(frozen=True)
class ChunkPolicy:
    """How large the eager loops' temporaries may be on one kind of device (a memory budget).

    Rows per logits-side chunk: ``max(min_rows, row_bytes // (Vl · itemsize))`` with `Vl` the
    local vocabulary width and `itemsize` the compute dtype's (fp32 for bf16 logits), so one
    `[C, Vl]` temporary is about `row_bytes`. A loop holds a few such temporaries at once (up to
    three in the divergence kernels, three float64 ones in the top-p bisection's mass pass), and
    the gradient it writes is `[N, Vl]` whatever the chunk. Every collective sits outside the chunk
    loops, so a rank's chunk count may depend on its own shard width.

    A CPU wants cache-sized chunks; a GPU pays ~5 µs per launched kernel, so it wants few, large
    chunks. `lossfx.CPU_POLICY` serves tensors on the CPU, `lossfx.GPU_POLICY` every other device;
    `lossfx.chunk_policy` forces one for a block, and `chunk_rows=` of a call wins over both.

    Attributes:
        row_bytes: bytes of one `[C, Vl]` compute-dtype temporary of a logits-side row loop.
        min_rows: rows per logits-side chunk, at least.
        tile_bytes: bytes of one `[C, Cv]` compute-dtype tile of the hidden × LM-head loops.
        max_block: vocabulary rows `Cv` per hidden × LM-head tile, at most.
        chunk_bytes: bytes of one `[C, Vl]` compute-dtype chunk of the hidden × LM-head loops that
            run rows outside (`linear_logprob_objective`, the projected teacher); `lossfx._core.tiles`.
        compile_tiles: run the fused path's per-tile arithmetic as an Inductor-compiled function
            (one compile per dtype and tile shape) instead of eager in-place passes.
        tile_share: the `[C, Cv]` tiles of a fused loop (its logits tile and scratch tiles
            together) hold at most `1/tile_share` of this shard's `[N, Vl]` compute-dtype logits
            (fewer rows `C`, below 256 rows a narrower block; never under 2 MiB of fp32, so small
            shapes keep cache-sized tiles); 1: no bound beyond `tile_bytes`.

    Example:
        >>> import torch, lossfx
        >>> tight = lossfx.ChunkPolicy(row_bytes=4096, min_rows=1, tile_bytes=1 << 20, max_block=512)
        >>> with lossfx.chunk_policy(tight):  # 1 row of 1024 fp32 columns per chunk
        ...     lossfx.token_logprobs(torch.zeros(3, 1024), torch.tensor([0, 1, 2]))
        tensor([-6.9315, -6.9315, -6.9315])
    """

    row_bytes: int
    min_rows: int
    tile_bytes: int
    max_block: int
    chunk_bytes: int = 96 << 20
    compile_tiles: bool = False
    tile_share: int = 1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "compile_tiles":
                if not isinstance(value, bool):
                    raise ValueError(f"ChunkPolicy.compile_tiles must be a bool, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ChunkPolicy.{field.name} must be an int >= 1, got {value!r}")


# CPU: 2 MiB per temporary (the L2 of a core), no row minimum: a multi-pass loop then re-reads its
# chunk from cache (3 rows at V = 151936 fp32); measured no slower than the former 8 MiB / 16-row
# default of the log-prob loops and ~1.8x faster on the 5-pass gather + entropy (benchmarks/README.md).
# The hidden x LM-head tiles are large instead (issue 27): each tile costs a fixed ~70 dispatched
# ops, which dominate a step with a few hundred rows, and with two threads and a busy core every op
# waits for a descheduled thread. [N, 10240] fp32 tiles up to 96 MiB: 15 vocabulary blocks at
# V = 151936, one row chunk up to N = 2457, at most ~0.1x the peak of TRL's [N, 32768] tiles
# (benchmarks/bench_trainer_step.py: 1095 leaf ops per GRPO loss step against 575, at any N <= 2457).
# But a 96 MiB tile is 0.32x of the [2048, 32000] fp32 logits (0.64x with the entropy's scratch
# tile): `tile_share = 32` bounds a loop's tiles together to 1/32 of its [N, Vl] logits (issue 26's
# <= 0.1x target), [200, 10240] fp32 tiles at that shape, measured no slower in CPU time
# (benchmarks/README.md, "Memory of the fused loops at the default CPU tiles").
CPU_POLICY = ChunkPolicy(row_bytes=2 << 20, min_rows=1, tile_bytes=96 << 20, max_block=10240, tile_share=32)
# ... and the tile engine (lossfx/_core/tiles.py): one vocabulary block of up to 2^18 rows (V = 151936 in one
# block), 1 GiB row chunks, Inductor-compiled tile bodies (docs/design.md, "One tile engine").
# GPU: 2 GiB per temporary, at least 1024 rows: a [16384, 151936] fp32 row loop runs 5 chunks
# (3533 rows each), so no logits path launches 1,000 kernels per forward + backward
# (benchmarks/README.md, "Kernel launches per call"); a loop's transient peak is a few such
# temporaries (~6-12 GiB at that shape, beside the 5 GiB bf16 logits and their gradient).
GPU_POLICY = ChunkPolicy(
    row_bytes=2 << 30,
    min_rows=1024,
    tile_bytes=1 << 30,
    max_block=1 << 18,
    chunk_bytes=1 << 30,
    compile_tiles=True,
)

_forced: ChunkPolicy | None = None


def policy_for(device: torch.device | None) -> ChunkPolicy:
    """The policy in force for tensors on `device`: the one `chunk_policy` forces, else CPU or GPU."""
    if _forced is not None:
        return _forced
    return CPU_POLICY if device is None or torch.device(device).type == "cpu" else GPU_POLICY


@contextlib.contextmanager
def chunk_policy(policy: ChunkPolicy) -> Iterator[ChunkPolicy]:
    """Use `policy` for tensors on every device inside the block.

    Process-wide (every thread), for tuning a budget and for counting a GPU's launches on CPU;
    blocks nest. Per call, `chunk_rows=` still wins; under `torch.compile` the kernels use one chunk
    whatever the policy.

    Example:
        >>> import lossfx
        >>> with lossfx.chunk_policy(lossfx.GPU_POLICY):
        ...     pass  # CPU tensors are chunked as on a GPU here
    """
    global _forced
    if not isinstance(policy, ChunkPolicy):
        raise TypeError(f"policy must be a lossfx.ChunkPolicy, got {type(policy).__name__}")
    previous, _forced = _forced, policy
    try:
        yield policy
    finally:
        _forced = previous


def default_chunk_rows(vocab: int, dtype: torch.dtype, device: torch.device | None = None) -> int:
    """Rows per eager chunk on `device`: one `[C, vocab]` `dtype` temporary near the policy's `row_bytes`."""
    policy = policy_for(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(policy.min_rows, policy.row_bytes // max(1, vocab * itemsize))


def row_chunks(
    n_rows: int, chunk_rows: int | None, vocab: int, dtype: torch.dtype, device: torch.device | None = None
) -> list[tuple[int, int]]:
    """`[(start, end), ...]` covering `range(n_rows)`: `chunk_rows` rows each, else the policy's
    (`default_chunk_rows`); a single chunk under `torch.compile`."""
    if tracing() or n_rows == 0:
        return [(0, n_rows)]
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(vocab, dtype, device)
    return [(start, min(n_rows, start + rows)) for start in range(0, n_rows, rows)]


def cat_chunks(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` of per-chunk results, without the copy (a kernel launch) for one chunk."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def resolve_chunk_rows(chunk_rows: int | None, chunk_size: int | None) -> int | None:
    """A kernel's `chunk_rows`, or the same value passed under its former name `chunk_size`.

    The kernels count rows of the flattened `[N, Vl]` logits (`chunk_rows`); the entry points
    (`prepare_loss_input` and its family) count sequence positions (`chunk_size`). The old keyword
    keeps working with a FutureWarning in eager mode (none under `torch.compile`: no graph break).
    """
    if chunk_size is None:
        return chunk_rows
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if chunk_rows is not None:
        raise TypeError("pass chunk_rows only; chunk_size is its deprecated name in the kernels")
    if not tracing():
        warnings.warn(
            "chunk_size= of a lossfx kernel is deprecated: it counts rows of the flattened [N, V_local] "
            "logits, so it is now chunk_rows= (same value); chunk_size= of prepare_loss_input and the "
            "other entry points counts sequence positions and stays",
            FutureWarning,
            stacklevel=4,
        )
    return chunk_size
