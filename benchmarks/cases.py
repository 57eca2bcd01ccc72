"""Shape registry for the benchmarks: real vocabulary sizes and the issue's cases.

Scripts take shapes from here by name; no model dimension is written in a script.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Vocabulary sizes of released models (the Liger / Cut-Cross-Entropy practice).
VOCAB_SIZES: dict[str, int] = {
    "llama2": 32_000,  # Llama 2, Mistral 7B
    "llama3": 128_256,  # Llama 3.x
    "qwen2": 151_936,  # Qwen 2 / 2.5 / 3
    "gemma3": 262_144,  # Gemma 3
}


@dataclass(frozen=True)
class Case:
    """One logits shape `[batch, seq, vocab]`."""

    name: str
    batch: int
    seq: int
    vocab: int

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    def logits_bytes(self, dtype: torch.dtype) -> int:
        return self.rows * self.vocab * torch.empty((), dtype=dtype).element_size()


def _case(batch: int, seq: int, vocab: int) -> Case:
    return Case(f"{batch}x{seq}x{vocab}", batch, seq, vocab)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        # issue 2, item 9
        _case(4, 512, VOCAB_SIZES["llama2"]),
        _case(1, 2048, VOCAB_SIZES["qwen2"]),
        # further real vocabularies, about 1 GB of fp32 logits each
        _case(1, 2048, VOCAB_SIZES["llama3"]),
        _case(1, 1024, VOCAB_SIZES["gemma3"]),
    )
}

# The two shapes: what `python -m benchmarks.run` measures by default.
DEFAULT_CASES: tuple[str, ...] = ("4x512x32000", "1x2048x151936")

# Tiny shapes for `--quick` (the smoke test): seconds, not minutes; timings meaningless.
QUICK_CASES: dict[str, Case] = {c.name: c for c in (_case(2, 16, 64), _case(1, 9, 257))}


def get_case(name: str) -> Case:
    """The registered case `name` (from `CASES` or `QUICK_CASES`)."""
    for table in (CASES, QUICK_CASES):
        if name in table:
            return table[name]
    known = sorted([*CASES, *QUICK_CASES])
    raise KeyError(f"unknown case {name!r}; known cases: {', '.join(known)}")
