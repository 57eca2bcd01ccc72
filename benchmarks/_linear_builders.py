"""Builders of the fused LM-head path and its unfused baseline, for `benchmarks.rss` and timing.

Each `build_*` returns a zero-argument callable that runs one training step, forward and
backward, and returns `(dhidden, dweight)`: the gradients every method must allocate. The inputs
(`hidden [N, H]`, `weight [V, H]`, `target [N]`) are built once, outside the measured call.

- `build_fused`: `lossfx.linear_token_logprobs` (logits in `[C, V]` chunks only);
- `build_unfused`: `hidden @ weight.T` then `lossfx.token_logprobs` (the `[N, V]` logits and their
  gradient are materialised).

`compiled=True` wraps the loss in `torch.compile(fullgraph=True)`; the backward is AOTAutograd's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import lossfx


def _inputs(n: int, hidden_size: int, vocab: int, dtype: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    hidden = torch.randn(n, hidden_size, generator=gen).to(torch_dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(torch_dtype).requires_grad_()
    target = torch.randint(0, vocab, (n,), generator=gen)
    return hidden, weight, target


def _step(loss_fn: Callable[..., torch.Tensor], compiled: bool, hidden, weight, target) -> Callable[[], Any]:
    fn = torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn

    def run():
        loss = fn(hidden, weight, target)
        return torch.autograd.grad(loss, (hidden, weight))

    return run


def build_fused(
    n: int = 2048,
    hidden_size: int = 512,
    vocab: int = 32000,
    dtype: str = "float32",
    compiled: bool = False,
    chunk_size: int | None = None,
) -> Callable[[], Any]:
    def loss_fn(h, w, t):
        return -lossfx.linear_token_logprobs(h, w, t, chunk_size=chunk_size).mean()

    return _step(loss_fn, compiled, *_inputs(n, hidden_size, vocab, dtype))


def build_unfused(
    n: int = 2048, hidden_size: int = 512, vocab: int = 32000, dtype: str = "float32", compiled: bool = False
) -> Callable[[], Any]:
    def loss_fn(h, w, t):
        return -lossfx.token_logprobs(h @ w.T, t).mean()

    return _step(loss_fn, compiled, *_inputs(n, hidden_size, vocab, dtype))
