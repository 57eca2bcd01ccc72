"""The one tile engine of hidden states × LM head: `hidden @ weight.T` in tiles, never `[N, V]`.

Every fused path walks tiles of the logits `z = head(hidden @ weight.T + bias)` of this rank's
vocabulary shard and plugs in only its per-tile arithmetic:

* `lossfx::linear_local_stats` / `linear_local_grads` (`_kernels.linear_chunks`): vocabulary blocks
  outside, row chunks inside (`Tiles.blocks` / `Tiles.tiles`): each `[Cv, H]` block of `weight`
  is read from memory once, and one `[C, Cv]` tile of logits is alive;
* `lossfx::linear_objective_rows` (`_kernels.linear_objective`) and the projected teacher of
  `divergence_to_projected_teacher`: rows outside (`Tiles.chunks`), because a row's statistics
  are needed before its logits can be used; one `[C, Vl]` chunk of logits is alive, walked in
  `Tiles.block_slices` for the elementwise passes.

This module owns what those loops share: the tile sizes (from a device's `ChunkPolicy`: `tile_bytes`
per `[C, Cv]` tile, `max_block` columns, `chunk_bytes` per rows-outside chunk), the walk over the
active rows only (ignored rows are never computed), the reused tile buffers (`torch.mm(out=)`
into a view), the head's options as one value (`HeadOptions`), the logits of a tile (`LogitHead`:
bias, logit scale, soft-cap, temperature; rounding of low-precision products). The online merge of
row statistics, the same across vocabulary blocks and across ranks, is
`lossfx._core.numerics.merge_stats` (re-exported here).
Dense equivalent of one tile: ``head(hidden[rows] @ weight[cols].T + bias[cols])``.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from lossfx._core.numerics import compute_dtype, merge_stats

__all__ = [
    "HeadOptions",
    "LogitHead",
    "Tiles",
    "add_rows_",
    "chunk_rows_for",
    "compute_dtype",
    "itemsize",
    "matmul_dtype",
    "merge_stats",
    "row_chunks",
    "tile_shape",
]

MIN_BLOCK = 128  # vocabulary rows per tile at least, when dweight needs a compute-dtype accumulator per block
MIN_ROWS = 8  # rows per `[C, Cv]` tile, at least
MIN_CHUNK_ROWS = 16  # rows per rows-outside chunk, at least (each chunk streams the whole head)
ROW_FRACTION = 16  # a rows-outside chunk holds at most 1/16 of the rows (so of the logits)


class TileSizes(typing.Protocol):
    """The fields of `lossfx._core.chunking.ChunkPolicy` the engine reads."""

    @property
    def tile_bytes(self) -> int: ...
    @property
    def max_block(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def compile_tiles(self) -> bool: ...


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype of every matmul of the fused path: `promote_types(hidden.dtype, weight.dtype)`."""
    return torch.promote_types(hidden.dtype, weight.dtype)


def tile_shape(local_vocab: int, hidden_size: int, dtype: torch.dtype, sizes: TileSizes) -> tuple[int, int]:
    """`(Cv, C)` of a vocabulary-outside tile: `Cv <= max_block` columns (for bf16/fp16 weights also
    few enough that the backward's `[Cv, H]` compute-dtype accumulator stays near `tile_bytes`),
    `C >= 8` rows so that one `[C, Cv]` compute-dtype tile is near `tile_bytes`.

    Both sides stay large enough for an efficient matmul: a skinny `[C, H] @ [H, Cv]` streams the
    block from memory for every few rows (measured 2x slower at C = 32 than at C = 256 on a CPU)."""
    cbytes = itemsize(compute_dtype(dtype))
    block = sizes.max_block
    if dtype != compute_dtype(dtype):
        block = min(block, max(MIN_BLOCK, sizes.tile_bytes // max(1, hidden_size * cbytes)))
    block = max(1, min(local_vocab, block))
    return block, max(MIN_ROWS, sizes.tile_bytes // max(1, block * cbytes))


def chunk_rows_for(
    n_rows: int, shard_width: int, dtype: torch.dtype, sizes: TileSizes, min_rows: int = MIN_CHUNK_ROWS
) -> int:
    """Rows `C` of a rows-outside chunk: `min(N / 16, a [C, shard_width] compute-dtype chunk near
    chunk_bytes)`, at least `min_rows` (16).

    A loop with a collective per chunk needs every rank to walk the same chunks: pass a
    rank-independent `shard_width` (`ceil(V / R)`), never this rank's own width."""
    by_bytes = sizes.chunk_bytes // max(1, shard_width * itemsize(compute_dtype(dtype)))
    return max(min_rows, min(-(-n_rows // ROW_FRACTION), by_bytes))


_COMPILED: dict[typing.Callable[..., typing.Any], typing.Callable[..., typing.Any]] = {}


def compiled_body(fn: typing.Callable[..., typing.Any]) -> typing.Callable[..., typing.Any]:
    """`fn` (a functional per-tile body) compiled by Inductor, made once per function:
    `torch.compile(fn, dynamic=False, fullgraph=True)`, so one compile per dtype and tile shape
    (and per kind of caller, eager or compiled: their tensors differ in a dispatch key)."""
    if fn not in _COMPILED:
        compiled = torch.compile(fn, dynamic=False, fullgraph=True)

        def run(*args: typing.Any) -> typing.Any:
            with torch.no_grad():  # one grad mode for every caller: no recompile on it
                return compiled(*args)

        _COMPILED[fn] = run
    return _COMPILED[fn]


def row_chunks(active: Tensor | None, n_rows: int, chunk_rows: int) -> list[slice] | list[Tensor]:
    """The row chunks a loop visits: slices of `[0, N)`, or chunks of the indices of the active
    rows only (ignored rows are never computed). `active`: None (every row), the ascending int64
    index of the active rows (no host read), or a bool mask `[N]` (compiled callers: read here,
    inside the opaque op, once per loop; a `meta` mask, which has no values, counts as all rows)."""
    if active is not None and active.dtype == torch.bool:
        active = None if active.is_meta or bool(active.all()) else active.nonzero()[:, 0]
    if active is None or active.shape[0] == n_rows:
        return [slice(s, min(n_rows, s + chunk_rows)) for s in range(0, n_rows, chunk_rows)]
    return [active[s : s + chunk_rows] for s in range(0, active.shape[0], chunk_rows)]


def add_rows_(out: Tensor, rows: slice | Tensor, value: Tensor, alpha: float = 1.0) -> None:
    """`out[rows] += alpha · value` for a slice or an index tensor of rows."""
    if isinstance(rows, slice):
        out[rows].add_(value, alpha=alpha)
    else:
        out.index_add_(0, rows, value.to(out.dtype), alpha=alpha)


class LogitHead(typing.NamedTuple):
    """The map from raw logits `r = h Wᵀ + b` to the logits `z` the softmax sees:
    `z = c · tanh(s · r / c) / T` with a soft-cap `c`, else `z = s · r / T` (TRL's order)."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def apply_(self, z: Tensor) -> Tensor:
        """`r -> z` in place."""
        scale, temperature, cap = self.logit_scale, self.temperature, self.softcap
        if cap is not None:
            return z.mul_(scale / cap).tanh_().mul_(cap / temperature)
        if scale != 1.0:
            z.mul_(scale)
        return z.div_(temperature) if temperature != 1.0 else z

    @property
    def scale(self) -> float:
        """`s / T`: the factor of `dz/dr` outside the soft-cap (folded into the gradient matmuls)."""
        return self.logit_scale / self.temperature

    def cap_derivative(self, z: Tensor, out: Tensor) -> Tensor:
        """`(dz/dr) / (s/T) = 1 − tanh² = 1 − (z·T/c)²` of the logits `z`, into `out` (soft-cap only);
        exactly 0 where the cap saturates (`|z| = c/T` as `apply_` rounds it: `tanh = ±1`, an infinite
        raw logit included), as `tanh'` is there, where `1 − (z·T/c)²` is an ulp off 0
        (proofs/fused_linear.md §11)."""
        assert self.softcap is not None
        derivative = torch.mul(z, self.temperature / self.softcap, out=out).square_().neg_().add_(1.0)
        return derivative.masked_fill_(z.abs() == self.softcap / self.temperature, 0.0)


class HeadOptions(typing.NamedTuple):
    """The fused head's options, one value: checked and resolved once per public call
    (`lossfx.fused_linear.resolved_head`, from its keywords of the same names) and consumed whole
    by every fused kernel. `bias` `[Vl]`: this rank's rows of the head's bias (a local tensor) or
    None; `temperature`, `logit_scale`, `softcap`: the logits map (`logits`, the tile arithmetic);
    `ignore_index`: ids equal to it score 0 and their rows are never computed.

    Adding an option: a field here (its default is the public default), its arithmetic in
    `LogitHead`, its check in `resolved_head`, and its twin in `lossfx.reference`."""

    bias: Tensor | None = None
    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    ignore_index: int = -100

    @property
    def logits(self) -> LogitHead:
        """The map `r = h Wᵀ + b -> z` of the tiles (`LogitHead`)."""
        return LogitHead(self.temperature, self.logit_scale, self.softcap)


class Tiles:
    """The tile walk of `hidden [N, H] × weight [Vl, H]ᵀ` (this rank's shard) and its buffers.

    Args:
        hidden: `[N, H]` (all rows; any float dtype).
        weight: `[Vl, H]`, or a list of such heads with `head_of_row` `[N]` choosing one per row
            (rows-outside walk only).
        bias: `[Vl]` or None; head: the `LogitHead`.
        active: the rows to compute (`row_chunks`), or None: all.
        rows: rows per tile/chunk; block: columns per tile (`tile_shape`, `chunk_rows_for`).
        scratch: extra `[C, Cv]` compute-dtype buffers a kernel needs (`Tiles.scratch`).
        chunk_width: the width of the rows-outside chunk buffer (`Vl`), or 0: none.
        round_to: round each raw product to this dtype (a projected teacher's `logits_dtype`);
            None: the matmul dtype.
        compile_tiles: whether `body` hands out compiled tile bodies (`ChunkPolicy.compile_tiles`).
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor | Sequence[Tensor],
        bias: Tensor | None,
        head: LogitHead,
        *,
        active: Tensor | None,
        rows: int,
        block: int,
        scratch: int = 0,
        chunk_width: int = 0,
        head_of_row: Tensor | None = None,
        round_to: torch.dtype | None = None,
        compile_tiles: bool = False,
    ) -> None:
        self.weights = [weight] if isinstance(weight, Tensor) else list(weight)
        self.hidden, self.bias, self.head, self.head_of_row = hidden, bias, head, head_of_row
        self.mm_dtype = matmul_dtype(hidden, self.weights[0])
        self.cdtype = compute_dtype(self.mm_dtype)
        self.exact = self.mm_dtype == self.cdtype
        self.round_to = None if round_to in (None, self.mm_dtype) else round_to
        n_rows, local_vocab = hidden.shape[0], self.weights[0].shape[0]
        self.rows, self.block = max(1, min(rows, n_rows)), max(1, min(block, local_vocab))
        self.chunks = row_chunks(active, n_rows, self.rows)
        self.block_slices = [slice(c, min(local_vocab, c + self.block)) for c in range(0, local_vocab, self.block)]
        device, size = hidden.device, self.rows * self.block
        self._tile: Tensor | None = None  # made on first use: the rows-outside walks never need it
        self._full_tile: Tensor | None = None
        self._low = None if self.exact else torch.empty(size, dtype=self.mm_dtype, device=device)
        self._scratch = [torch.empty(size, dtype=self.cdtype, device=device) for _ in range(scratch)]
        self._chunk = torch.empty(self.rows * chunk_width, dtype=self.cdtype, device=device) if chunk_width else None
        self._weights_mm: list[Tensor] | None = None
        self.compile_tiles = compile_tiles

    def body(self, fn: typing.Callable[..., typing.Any], z: Tensor) -> typing.Callable[..., typing.Any] | None:
        """The compiled `fn` for the tile `z` when the policy compiles tile bodies and `z` has the
        full tile shape `[rows, block]` (the ragged last row chunk and block run eagerly, so a new
        `N` or `Vl` never compiles again); else None (also on `meta` tensors, which have no
        values to compute): the caller runs its eager in-place body."""
        if self.compile_tiles and not z.is_meta and tuple(z.shape) == (self.rows, self.block):
            return compiled_body(fn)
        return None

    @staticmethod
    def view(buffer: Tensor, rows: int, cols: int) -> Tensor:
        """The first `rows * cols` elements of a flat buffer as a contiguous `[rows, cols]` tensor."""
        return buffer[: rows * cols].view(rows, cols)

    def scratch(self, i: int, like: Tensor) -> Tensor:
        """Scratch buffer `i` as a `[C, Cv]` tensor of `like`'s shape."""
        return self.view(self._scratch[i], like.shape[0], like.shape[1])

    def low(self, like: Tensor) -> Tensor:
        """The matmul-dtype tile buffer (bf16/fp16 matmuls only) shaped like `like`."""
        assert self._low is not None
        return self.view(self._low, like.shape[0], like.shape[1])

    def compact(self) -> tuple[Tensor | None, list[slice]]:
        """The visited rows as `(index, slices)`: `index` the int64 index of the active rows (None:
        every row, in order) and each row chunk's positions among them, slices of `[0, N_active)`.
        A loop gathers its per-row quantities once by `index` and slices them per chunk: no
        per-tile index op, and in-place writes into slices."""
        if not self.chunks or isinstance(self.chunks[0], slice):
            return None, typing.cast(list[slice], self.chunks)
        chunks = typing.cast(list[Tensor], self.chunks)
        index = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        starts = [i * self.rows for i in range(len(chunks))]
        return index, [slice(s, s + c.shape[0]) for s, c in zip(starts, chunks, strict=True)]

    def hidden_rows(self, rows: slice | Tensor) -> Tensor:
        return self.hidden[rows].to(self.mm_dtype)  # [C, H]

    def _product(self, h: Tensor, w: Tensor, out: Tensor) -> None:
        """`h @ w.T` into `out` (compute dtype): bf16/fp16 products rounded once, then widened."""
        if self.exact:
            torch.mm(h, w.T, out=out)
        else:  # input-dtype matmul (fp32 accumulation inside the BLAS), rounded once, then widened
            for cols in range(0, w.shape[0], self.block):
                part = w[cols : cols + self.block]
                out[:, cols : cols + part.shape[0]].copy_(
                    torch.mm(h, part.T, out=self.view(self._low, h.shape[0], part.shape[0]))  # type: ignore[arg-type]
                )
        if self.round_to is not None:
            out.copy_(out.to(self.round_to))

    def _tile_view(self, rows: int, cols: int) -> Tensor:
        """The reused `[rows, cols]` compute-dtype tile buffer (made on first use)."""
        if self._tile is None:
            self._tile = torch.empty(self.rows * self.block, dtype=self.cdtype, device=self.hidden.device)
            self._full_tile = self.view(self._tile, self.rows, self.block)  # the common shape: one view
        if (rows, cols) == (self.rows, self.block) and self._full_tile is not None:
            return self._full_tile
        return self.view(self._tile, rows, cols)

    def zeros(self, h: Tensor, w: Tensor) -> Tensor:
        """A `[C, Cv]` tile of zeros for `h [C, H]` and `w [Cv, H]`, in the tile buffer, in place of
        `logits` for an arithmetic that never reads the logits."""
        return self._tile_view(h.shape[0], w.shape[0]).zero_()

    def logits(self, h: Tensor, w: Tensor, b: Tensor | None, out: Tensor | None = None) -> Tensor:
        """`head(h [C, H] @ w [Cv, H].T + b)` -> `[C, Cv]` in the compute dtype, in the tile buffer
        (or `out`); the buffer is reused by the next tile."""
        z = self._tile_view(h.shape[0], w.shape[0]) if out is None else out
        # (not folded into one `addmm(b, h, wᵀ, alpha=s/T, beta=s/T)`: that rounds `s/T` and sums
        # `b` inside the BLAS, so its logits differ from `(h @ wᵀ + b)·s/T` by an ulp)
        self._product(h, w, z)
        if b is not None:
            z.add_(b)
        return self.head.apply_(z)

    def blocks(self) -> Iterator[tuple[slice, Tensor, Tensor | None]]:
        """Vocabulary blocks, outside: `(cols, weight[cols] [Cv, H] in the matmul dtype, bias[cols])`."""
        for cols in self.block_slices:
            b = None if self.bias is None else self.bias[cols].to(self.cdtype)
            yield cols, self.weights[0][cols].to(self.mm_dtype), b

    def tiles(self, w: Tensor, b: Tensor | None) -> Iterator[tuple[slice | Tensor, Tensor, Tensor]]:
        """Row chunks of one block, inside: `(rows, hidden rows [C, H], logits [C, Cv])`."""
        for rows in self.chunks:
            h = self.hidden_rows(rows)
            yield rows, h, self.logits(h, w, b)

    def mm_weights(self) -> list[Tensor]:
        """The heads in the matmul dtype (a copy, made once, only for a head of a lower dtype)."""
        if self._weights_mm is None:
            self._weights_mm = [w.to(self.mm_dtype) for w in self.weights]
        return self._weights_mm

    def chunks_full(self) -> Iterator[tuple[slice | Tensor, Tensor, Tensor]]:
        """Row chunks, outside: `(rows, hidden rows [C, H], logits [C, Vl])` (the chunk buffer; walk
        its columns in `block_slices`)."""
        for rows in self.chunks:
            h = self.hidden_rows(rows)
            yield rows, h, self.chunk_logits(rows, h)

    def chunk_logits(self, rows: slice | Tensor, h: Tensor | None = None) -> Tensor:
        """The logits `[C, Vl]` of the rows `rows` in the chunk buffer (reused by the next chunk).
        Several heads: each row through its own (`head_of_row`)."""
        assert self._chunk is not None
        weights = self.mm_weights()
        b = None if self.bias is None else self.bias.to(self.cdtype)
        h = self.hidden_rows(rows) if h is None else h
        z = self.view(self._chunk, h.shape[0], weights[0].shape[0])
        if len(weights) == 1:
            return self.logits(h, weights[0], b, out=z)
        assert self.head_of_row is not None
        chosen = self.head_of_row[rows]
        for k, w in enumerate(weights):  # value-dependent: eager only (inside an opaque op)
            picked = (chosen == k).nonzero()[:, 0]
            if picked.numel():
                part = z.new_empty((picked.shape[0], z.shape[1]))
                z.index_copy_(0, picked, self.logits(h.index_select(0, picked), w, b, out=part))
        return z
