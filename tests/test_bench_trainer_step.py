"""`benchmarks/bench_trainer_step.py` compares like with like: lossfx's and stock TRL's loss steps
give the same gradients, and the op counter counts."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_trainer_step as bench


def test_both_providers_compute_the_same_step():
    pytest.importorskip("trl")
    torch.manual_seed(0)
    grads = {p: bench.build(p, tokens=16, hidden=8, vocab=50)() for p in bench.PROVIDERS}
    for got, want in zip(grads["lossfx"], grads["stock"], strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_leaf_ops_counts_a_step():
    pytest.importorskip("trl")
    counts = [bench.leaf_ops(bench.build(p, tokens=16, hidden=8, vocab=50)) for p in bench.PROVIDERS]
    assert all(c > 10 for c in counts), counts


def test_filtered_providers_compute_the_same_step():
    """`--filtered`: the fused filtered step and the logits path's give the same gradients, and the
    filter changes them (the unfiltered step's differ)."""
    pytest.importorskip("trl")
    grads = {p: bench.build(p, tokens=16, hidden=8, vocab=200, greedy=True)() for p in bench.FILTERED_PROVIDERS}
    for got, want in zip(grads["lossfx_filtered"], grads["logits_filtered"], strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(grads["lossfx_filtered"][0], grads["stock"][0], rtol=1e-2, atol=1e-4)
