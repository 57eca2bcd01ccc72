"""lossfx.context_parallel: the load-balanced CP layout and the differentiable all-gather."""

from __future__ import annotations

import pytest
import torch
from harness import compiled_for_rank, run_ranks
from hypothesis import given
from hypothesis import strategies as st

import lossfx
from lossfx import reference as ref
from lossfx.context_parallel import cp_positions


def test_layout_example():
    x = torch.arange(8).view(1, 8)
    assert lossfx.shard_for_cp_rank(x, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert lossfx.shard_for_cp_rank(x, 1, 2).tolist() == [[2, 3, 4, 5]]
    assert cp_positions(8, 0, 2) == [0, 1, 6, 7]
    assert lossfx.shard_for_cp_rank(x, 0, 1) is x


@given(cp=st.sampled_from((1, 2, 3, 4)), n=st.integers(1, 3), seq_dim=st.sampled_from((0, 1, 2, -1)))
def test_shard_unshard_roundtrip(cp, n, seq_dim):
    shape = [2, 3, 4]
    shape[seq_dim] = 2 * cp * n
    x = torch.randn(*shape)
    shards = [lossfx.shard_for_cp_rank(x, r, cp, seq_dim) for r in range(cp)]
    for r, s in enumerate(shards):
        assert torch.equal(s, ref.cp_shard(x, r, cp, seq_dim % 3))
        assert torch.equal(s, x.index_select(seq_dim, torch.tensor(cp_positions(shape[seq_dim], r, cp))))
    assert torch.equal(lossfx.unshard(shards, seq_dim), x)


def test_errors():
    with pytest.raises(ValueError, match="divisible by 2·cp_size = 4"):
        lossfx.shard_for_cp_rank(torch.zeros(1, 6), 0, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        lossfx.shard_for_cp_rank(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="seq_dim"):
        lossfx.shard_for_cp_rank(torch.zeros(1, 8), 0, 2, seq_dim=2)
    with pytest.raises(ValueError, match="even"):
        lossfx.unshard([torch.zeros(1, 3), torch.zeros(1, 3)])
    with pytest.raises(ValueError, match="one shape"):
        lossfx.unshard([torch.zeros(1, 2), torch.zeros(1, 4)])
    with pytest.raises(ValueError, match="divisible"):
        cp_positions(10, 0, 2)


def _gather_rank(rank, world, group, x, weight, seq_dim, backend):
    local = lossfx.shard_for_cp_rank(x, rank, world, seq_dim).clone().requires_grad_()

    def fn(t):
        return lossfx.allgather_cp(t, group, seq_dim=seq_dim)

    if backend is not None:
        _, fn = compiled_for_rank(rank, ("allgather_cp", world, seq_dim), fn, backend)
    full = fn(local)
    (full * weight).sum().backward()  # every rank computes the same loss
    return full.detach(), local.grad


@pytest.mark.distributed
# 4 ranks compiled runs with -m slow (4 ranks eager and 2 ranks compiled by default)
@pytest.mark.parametrize(
    ("world", "backend"),
    [
        (2, None),
        (4, None),
        pytest.param(2, "aot_eager", marks=pytest.mark.compile),
        pytest.param(4, "aot_eager", marks=[pytest.mark.compile, pytest.mark.slow]),
    ],
)
@pytest.mark.parametrize("seq_dim", [1, 0])
def test_allgather_values_and_summed_gradient(world, backend, seq_dim):
    shape = [3, 4 * world] if seq_dim == 1 else [4 * world, 3]
    x = torch.randn(*shape, dtype=torch.float64)
    weight = torch.randn(*shape, dtype=torch.float64)
    for rank, (full, grad) in enumerate(run_ranks(world, _gather_rank, x, weight, seq_dim, backend)):
        assert torch.equal(full, x)
        # Convention: the local grad is the SUM over CP ranks of the upstream grads -> world × true.
        torch.testing.assert_close(
            grad, world * lossfx.shard_for_cp_rank(weight, rank, world, seq_dim), rtol=0, atol=1e-12
        )


def test_allgather_without_group_is_identity():
    x = torch.randn(2, 6, requires_grad=True)
    assert lossfx.allgather_cp(x, None) is x


@pytest.mark.distributed
def test_allgather_odd_local_length_raises():
    def fn(rank, world, group):
        with pytest.raises(ValueError, match="even"):
            lossfx.allgather_cp(torch.zeros(1, 3), group)
        return True

    assert all(run_ranks(2, fn))


def gloo_allgather_job(rank, world, group, x, weight):
    """Eager and compiled (aot_eager) allgather_cp on a real gloo group."""
    local = lossfx.shard_for_cp_rank(x, rank, world).clone().requires_grad_()
    compiled = torch.compile(lambda t: lossfx.allgather_cp(t, group), backend="aot_eager", fullgraph=True)
    results = []
    for fn in (lambda t: lossfx.allgather_cp(t, group), compiled):
        local.grad = None
        full = fn(local)
        (full * weight).sum().backward()
        results.append((full.detach(), local.grad.clone()))
    return results


@pytest.mark.distributed
def test_allgather_on_gloo():
    from harness import gloo_pool

    x, weight = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    for rank, results in enumerate(gloo_pool(2).run(gloo_allgather_job, x, weight)):
        for full, grad in results:
            assert torch.equal(full, x)
            torch.testing.assert_close(grad, 2 * lossfx.shard_for_cp_rank(weight, rank, 2), rtol=0, atol=1e-12)
