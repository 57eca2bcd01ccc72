"""The filtered fused loop's rows per chunk come from the device policy (issue 26): `N / 32` rows
under the CPU policy (its memory target), 2 GiB chunks under the GPU policy (its launch target);
the results do not depend on the policy."""

from __future__ import annotations

import math

import pytest
import torch

import lossfx
from lossfx import reference
from lossfx._core.chunking import CPU_POLICY, GPU_POLICY, chunk_policy
from lossfx._kernels.linear_filtering import filtered_chunk_rows

F64 = torch.float64
CPU = torch.device("cpu")


def test_cpu_policy_keeps_a_thirty_second_of_the_rows():
    with chunk_policy(CPU_POLICY):
        for n, vocab in [(2048, 32000), (2048, 151936)]:
            assert filtered_chunk_rows(n, vocab, torch.float32, CPU) == math.ceil(n / CPU_POLICY.tile_share)
        # a larger N: the chunk and its gradient near chunk_bytes (96 MiB) instead
        assert filtered_chunk_rows(16384, 151936, torch.float32, CPU) == CPU_POLICY.chunk_bytes // (2 * 151936 * 4)
        assert filtered_chunk_rows(40, 1000, torch.float32, CPU) == 16  # at least 16 rows


def test_gpu_policy_walks_row_bytes_chunks():
    with chunk_policy(GPU_POLICY):
        rows = filtered_chunk_rows(16384, 151936, torch.float32, CPU)
        assert rows == GPU_POLICY.row_bytes // (151936 * 4)  # one [C, V] fp32 chunk near 2 GiB
        assert math.ceil(16384 / rows) == 5
        assert filtered_chunk_rows(2048, 32000, torch.float32, CPU) == 2048  # small: one chunk
        assert filtered_chunk_rows(2048, 32000, torch.bfloat16, CPU) == 2048


@pytest.mark.parametrize("filters", [{"top_k": 9, "top_p": 0.8}, {"top_p": 0.7}])
def test_results_do_not_depend_on_the_policy(filters):
    gen = torch.Generator().manual_seed(3)
    n, hidden_size, vocab = 70, 16, 300  # CPU policy: 16-row chunks (5); GPU policy: one chunk
    hidden = torch.randn(n, hidden_size, generator=gen, dtype=F64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=F64) * 0.75
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[::2] = (hidden @ weight.T).argmax(-1)[::2]
    dout = torch.randn(n, generator=gen, dtype=F64)
    results = []
    for policy in (CPU_POLICY, GPU_POLICY):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with chunk_policy(policy):
            out = lossfx.linear_filtered_token_logprobs(h, w, target, **filters)
        live = torch.isfinite(out.detach())
        loss = torch.where(live, out, torch.zeros_like(out)).mul(dout).sum()
        results.append((out.detach(), *torch.autograd.grad(loss, [h, w])))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    dense = reference.filtered_token_logprobs(h @ w.T, target, **filters)
    assert torch.equal(torch.isfinite(dense), torch.isfinite(results[0][0]))
    for cpu, gpu in zip(*results, strict=True):
        torch.testing.assert_close(cpu, gpu, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(results[0][0], dense.detach(), rtol=0.0, atol=1e-10)
