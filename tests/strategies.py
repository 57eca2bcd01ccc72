"""Hypothesis strategies shared by every capability's tests.

A drawn `LogitsCase` holds only small parameters (shapes, world size, dtype, chunk size, scale,
`-inf` pattern, seed); the bulk values are materialised from the seed with
`torch.Generator().manual_seed(seed)` in float64 and only then cast, so the float64 truth of a
low-precision case is the exact upcast of the very logits the op sees, and a failing example is
reproduced from its printed parameters alone.

Usage::

    @given(case=strategies.logits_cases(dtypes=(torch.float64,)))
    @strategies.with_examples(dtypes=(torch.float64,))
    def test_something(case):
        logits, target = case.logits(), case.target()
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import example
from hypothesis import strategies as st

DTYPES = (torch.float64, torch.float32, torch.bfloat16)
WORLD_SIZES = (1, 2, 4)
SCALES = (1e-3, 1.0, 30.0, 1e4)  # flat, normal, peaked, overflow-prone (exp(1e4) = inf)
# None: finite logits; "some": scattered -inf entries; "row": also whole -inf rows;
# "target": also -inf at the target's own entry. Listed in order of increasing oddity (hypothesis
# shrinks towards the first entry).
NEG_INF_MODES = (None, "some", "row", "target")
CHUNK_KINDS = (None, "one", "lt", "eq", "gt")  # chunk size: default, 1, C<N, C=N, C>N


@dataclass(frozen=True)
class LogitsCase:
    """One drawn case: logits `[B, S, V]` (V = R·Vl), targets `[B, S]`, and how to run them.

    `chunk` is a concrete chunk size (or None) measured in `chunk_unit` ("rows": rows of the
    flattened `[N, Vl]` logits, as `token_logprobs` counts them; "seq": sequence positions, as
    `prepare_loss_input` counts them).
    """

    batch: int
    seq: int
    vocab: int
    world: int
    dtype: torch.dtype
    chunk: int | None
    scale: float
    neg_inf: str | None
    ties: bool
    seed: int
    chunk_unit: str = "rows"

    @property
    def local_vocab(self) -> int:
        return self.vocab // self.world

    @property
    def n_tokens(self) -> int:
        return self.batch * self.seq

    def _generator(self, salt: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + salt)

    def target(self) -> torch.Tensor:
        """`[B, S]` int64 ids in `[0, V)`."""
        return torch.randint(0, self.vocab, (self.batch, self.seq), generator=self._generator(1))

    def logits64(self) -> torch.Tensor:
        """`[B, S, V]` float64 logits before the cast (with the `-inf` pattern applied)."""
        gen = self._generator(2)
        shape = (self.batch, self.seq, self.vocab)
        if self.ties:
            # few distinct values: exact ties in the max and among the target's competitors
            x = torch.randint(0, 3, shape, generator=gen).to(torch.float64)
        else:
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
        x = x * self.scale
        if self.neg_inf is not None:
            drop = torch.rand(shape, generator=gen, dtype=torch.float64) < 0.3
            x = x.masked_fill(drop, float("-inf"))
            flat = x.view(-1, self.vocab)
            if self.neg_inf in ("row", "target") and flat.shape[0] > 0:
                row = int(torch.randint(0, flat.shape[0], (), generator=gen))
                flat[row] = float("-inf")
            if self.neg_inf == "target" and flat.shape[0] > 0:
                tgt = self.target().view(-1)
                pick = torch.rand(flat.shape[0], generator=gen) < 0.5
                pick[int(torch.randint(0, flat.shape[0], (), generator=gen))] = True
                rows = pick.nonzero().view(-1)
                flat[rows, tgt[rows]] = float("-inf")
        return x

    def logits(self) -> torch.Tensor:
        """`[B, S, V]` logits in `self.dtype` (the float64 values, cast once)."""
        return self.logits64().to(self.dtype)

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s uniform vocabulary shard `x[..., r·Vl:(r+1)·Vl]`."""
        vl = self.local_vocab
        return x[..., rank * vl : (rank + 1) * vl]

    def with_(self, **changes) -> LogitsCase:
        return replace(self, **changes)


def _resolve_chunk(draw, kind: str | None, n: int) -> int | None:
    if kind is None:
        return None
    if kind == "one":
        return 1
    if kind == "lt":
        return draw(st.integers(1, n - 1)) if n > 1 else 1
    if kind == "eq":
        return max(n, 1)
    return max(n, 1) + draw(st.integers(1, 5))


@st.composite
def logits_cases(
    draw,
    *,
    dtypes=DTYPES,
    worlds=WORLD_SIZES,
    scales=SCALES,
    neg_inf=NEG_INF_MODES,
    chunk_unit: str = "rows",
    max_batch: int = 3,
    max_seq: int = 7,
    max_local_vocab: int = 9,
    min_seq: int = 1,
) -> LogitsCase:
    """Draw a `LogitsCase`: odd sizes included (S=1, V=1 when R=1), V a multiple of R."""
    world = draw(st.sampled_from(worlds))
    batch = draw(st.integers(1, max_batch))
    seq = draw(st.integers(min_seq, max_seq))
    local_vocab = draw(st.integers(1, max_local_vocab))
    dtype = draw(st.sampled_from(dtypes))
    n = batch * seq if chunk_unit == "rows" else seq
    chunk = _resolve_chunk(draw, draw(st.sampled_from(CHUNK_KINDS)), n)
    return LogitsCase(
        batch=batch,
        seq=seq,
        vocab=world * local_vocab,
        world=world,
        dtype=dtype,
        chunk=chunk,
        scale=draw(st.sampled_from(scales)),
        neg_inf=draw(st.sampled_from(neg_inf)),
        ties=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        chunk_unit=chunk_unit,
    )


def example_cases(dtype: torch.dtype = torch.float64, chunk_unit: str = "rows") -> list[LogitsCase]:
    """The explicit corner cases every property also runs: V=1, chunk=1, exact ties."""
    base = LogitsCase(
        batch=2,
        seq=3,
        vocab=1,
        world=1,
        dtype=dtype,
        chunk=None,
        scale=1.0,
        neg_inf=None,
        ties=False,
        seed=0,
        chunk_unit=chunk_unit,
    )
    return [
        base,  # V = 1: every log-prob is exactly 0
        base.with_(vocab=5, chunk=1, seed=1),  # one row (or position) per chunk
        base.with_(vocab=4, world=2, chunk=2, ties=True, seed=2),  # exact ties, across shards
        base.with_(batch=1, seq=1, vocab=8, world=4, scale=1e4, seed=3),  # S=1, overflow-prone
    ]


def with_examples(dtype: torch.dtype = torch.float64, chunk_unit: str = "rows", name: str = "case"):
    """Decorator adding `@example(case=...)` for every `example_cases` entry."""

    def decorate(test):
        for case in reversed(example_cases(dtype, chunk_unit)):
            test = example(**{name: case})(test)
        return test

    return decorate
