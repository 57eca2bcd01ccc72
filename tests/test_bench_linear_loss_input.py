"""Smoke test of benchmarks/bench_linear_loss_input.py: each branch's eager builders run at tiny
shapes and return what the memory figure subtracts (the gradients, or DRAFT's targets)."""

import pytest
import torch

from benchmarks import bench_linear_loss_input as bench


@pytest.mark.parametrize("branch", bench.BRANCHES)
def test_builders_run_and_return_what_is_subtracted(branch):
    n, hidden, vocab = 16, 8, 64
    returned = [bench.build(branch, provider, n, hidden, vocab, chunk_size=4)() for provider in ("linear-eager",)]
    (out,) = returned
    nbytes = sum(t.numel() * t.element_size() for t in out)
    assert nbytes == bench._returned_bytes(branch, n, hidden, vocab)
    # the front door and the logits path agree on the same inputs (the benchmark compares like with like)
    logits_path = bench.build(branch, "logits-eager", n, hidden, vocab)()
    for a, b in zip(out, logits_path):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("branch", bench.BRANCHES)
def test_bf16_builders_return_bf16_results_of_the_subtracted_size(branch):
    n, hidden, vocab = 16, 8, 64
    out = bench.build(branch, "linear-eager", n, hidden, vocab, chunk_size=4, dtype="bfloat16")()
    assert all(t.dtype == torch.bfloat16 for t in out)
    assert sum(t.numel() * t.element_size() for t in out) == bench._returned_bytes(branch, n, hidden, vocab, 2)
