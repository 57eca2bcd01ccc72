"""Builders for `benchmarks.rss.peak_rss_extra_bytes` used by tests/test_filtering.py (kept apart so
the fresh measuring process imports only torch and lossfx)."""

import torch

import lossfx


def filtered_forward(rows: int, vocab: int, chunk: int):
    """The eager bf16 filtered forward (k = 50, p = 0.9) on logits whose (k+1)-th local value ties
    the k-th on most rows (bf16 at a wide vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(1, rows, vocab, generator=gen) * 2.0).to(torch.bfloat16)
    t = torch.randint(0, vocab, (1, rows), generator=gen)
    return lambda: lossfx.filtered_token_logprobs(z, t, top_k=50, top_p=0.9, chunk_size=chunk)
