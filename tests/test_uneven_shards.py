"""Uneven vocabulary shards on a real 2-process gloo pool (issue 15 item 7).

Every loop count and collective size must come from rank-independent quantities: with shards of
51 + 50 columns (V = 101), each rank's *default* chunking (sized from its own width) differs, and
a path that ran a collective per chunk would abort or hang. The chunk budgets are shrunk here so
that this happens at N = 400 rows (each case first asserts that the two ranks' width-based
chunk counts do differ); values and gradients are compared with the float64 reference.
"""

import contextlib
import math
from types import SimpleNamespace

import harness
import pytest
import torch
from harness import gloo_pool

import lossfx
from lossfx import reference
from lossfx._core import chunking as _chunking
from lossfx._core import tiles as _tiles

pytestmark = pytest.mark.distributed

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
N, H, V = 400, 8, 101
WIDTHS = (51, 50)  # rank 0, rank 1
BUDGET = 8000  # bytes: 19 rows of 51 float64 columns, 20 of 50


@pytest.fixture(autouse=True)
def _short_pool_timeout(monkeypatch):
    """A hang fails the test after 120 s instead of the harness's default 600 s."""
    monkeypatch.setattr(harness, "_TIMEOUT_S", 120.0)


def _data():
    gen = torch.Generator().manual_seed(15)
    z = torch.randn(N, V, generator=gen, dtype=F64) * 2
    return {
        "z": z,
        "target": torch.randint(0, V, (N,), generator=gen),
        "top": z.argmax(-1),  # inside every filter
        "ids": torch.randint(0, V, (N, 3), generator=gen),
        "hidden": torch.randn(N, H, generator=gen, dtype=F64),
        "weight": torch.randn(V, H, generator=gen, dtype=F64) / 2,
        "a": torch.randn(N, generator=gen, dtype=F64),
        "b": torch.randn(N, generator=gen, dtype=F64),
        "g": torch.randn(N, 3, generator=gen, dtype=F64),  # upstream gradients
        "teacher": torch.randn(N, V, generator=gen, dtype=F64) * 2,
    }


@contextlib.contextmanager
def _budgets():
    """Every chunk budget shrunk to BUDGET bytes through a forced `lossfx.ChunkPolicy`: the logits
    loops' rows, the tile engine's tiles and its rows-outside chunks (lossfx/_core/tiles.py)."""
    tight = lossfx.ChunkPolicy(row_bytes=BUDGET, min_rows=1, tile_bytes=BUDGET, max_block=2048, chunk_bytes=BUDGET)
    with lossfx.chunk_policy(tight):
        yield


def _width_based_chunks(case, width):
    """How many chunks this rank's own width would give (what the ranks must not depend on)."""
    if case.startswith("objective"):
        return math.ceil(N / _tiles.chunk_rows_for(N, width, F64, _chunking.policy_for(None)))
    if case == "fused_token":
        return math.ceil(N / _tiles.tile_shape(width, H, F64, _chunking.policy_for(None))[1])
    return math.ceil(N / _chunking.default_chunk_rows(width, F64))


def _weighted(out, d, case):
    """A fixed weighting of a logits path's output, to backpropagate (top-k: its values only)."""
    if case == "vocab_topk":
        out = out[:, :5]
    g = d["g"].repeat(1, 2)[: out.shape[0], : out.shape[-1]] if out.dim() == 2 else d["g"][: out.shape[0], 0]
    return (out * g).sum()


def _logits_call(case, shard, d, group, start):
    span = {"group": group, "vocab_start": start, "vocab_size": V}
    if case == "token_logprobs":
        return lossfx.token_logprobs(shard, d["target"], **span)
    if case == "filtered":
        return lossfx.filtered_token_logprobs(shard, d["top"], top_k=7, top_p=0.9, **span)
    if case == "filtered_bisection":  # top-p alone: bisection, one all-reduce per step; ties cut by id
        return lossfx.filtered_token_logprobs(shard, d["top"], top_p=0.8, ties="sorted", **span)
    if case == "gather":
        return lossfx.gather_logprobs(shard, d["ids"], **span)[0]
    if case == "entropy":
        return lossfx.neg_entropy(shard, group=group)
    if case in ("reverse_kl", "cross_entropy"):  # a teacher shard of the same width
        fn = lossfx.reverse_kl_to_fixed if case == "reverse_kl" else lossfx.cross_entropy_to_fixed
        return fn(shard, d["teacher"][:, start : start + shard.shape[-1]], group=group)
    if case == "gather_neg_entropy":
        lp, ne = lossfx.gather_logprobs(shard, d["ids"], with_neg_entropy=True, **span)
        return torch.cat([lp, ne[:, None]], -1)
    if case == "prepare_loss_input":  # plain uneven shards: the widths come from the ranks
        data = {"input_ids": d["target"][None]}
        loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
        out, _ = lossfx.prepare_loss_input(
            shard[None], data, loss_fn, vocab_parallel_group=group, vocab_parallel_rank=group.rank()
        )
        return out["next_token_logprobs"][0]
    if case == "vocab_topk":
        values, ids = lossfx.vocab_topk(shard, 5, group=group, vocab_start=start)
        return torch.cat([values, ids.to(values.dtype)], -1)
    raise AssertionError(case)


def _fused_call(case, hidden, w, d, group, start):
    span = {"group": group, "vocab_start": start, "vocab_size": V}
    if case == "fused_token":
        lp = lossfx.linear_token_logprobs(hidden, w, d["target"], **span)
        return lp, (lp * d["g"][:, 0]).sum()
    if case == "objective":
        objective, lp, ne = lossfx.linear_logprob_objective(
            hidden, w, d["target"], d["a"], neg_entropy_weight=d["b"], **span
        )
        return torch.stack([lp, ne]), objective
    if case == "objective_sequence_parallel":
        rows = harness.shard_rows(hidden, group.rank(), group.size())
        objective, lp, _ = lossfx.linear_logprob_objective(rows, w, d["target"], d["a"], sequence_parallel=True, **span)
        return lp, objective
    if case == "objective_dtensor":
        from torch.distributed.tensor import DeviceMesh, DTensor, Shard

        mesh = DeviceMesh("cpu", list(range(group.size())))
        head = DTensor.from_local(w, mesh, [Shard(0)], shape=torch.Size([V, H]), stride=(H, 1))
        objective, lp, _ = lossfx.linear_logprob_objective(hidden, head, d["target"], d["a"])
        return lp, objective
    raise AssertionError(case)


def _uneven(rank, world, group, case):
    """`(this rank's width-based chunk count, values, gradients)` of one case on this rank."""
    d = _data()
    start = sum(WIDTHS[:rank])
    cols = slice(start, start + WIDTHS[rank])
    with _budgets():
        chunks = _width_based_chunks(case, WIDTHS[rank])
        if case in LOGITS_CASES:
            shard = d["z"][:, cols].clone().requires_grad_()
            out = _logits_call(case, shard, d, group, start)
            if case == "vocab_topk":  # values only: its outputs carry no gradient
                return chunks, out, (None,)
            _weighted(out, d, case).backward()
            return chunks, out.detach(), (shard.grad,)
        hidden = d["hidden"].clone().requires_grad_()
        w = d["weight"][cols].clone().requires_grad_()
        values, loss = _fused_call(case, hidden, w, d, group, start)
        loss.backward()
        grad_hidden = hidden.grad.clone()
        if case == "objective_sequence_parallel":  # this rank's rows are filled, the others 0
            torch.distributed.all_reduce(grad_hidden, group=group)
        return chunks, values.detach(), (grad_hidden, w.grad)


def _reference(case):
    d = _data()
    if case in LOGITS_CASES:
        z = d["z"].clone().requires_grad_()
        if case == "token_logprobs":
            out = reference.token_logprobs(z, d["target"])
        elif case == "filtered":
            out = reference.filtered_token_logprobs(z, d["top"], top_k=7, top_p=0.9)
        elif case == "filtered_bisection":
            out = reference.filtered_token_logprobs(z, d["top"], top_p=0.8, ties="sorted")
        elif case == "gather":
            out = reference.gather_logprobs(z, d["ids"])[0]
        elif case == "entropy":
            out = reference.neg_entropy(z)
        elif case == "reverse_kl":
            out = reference.reverse_kl_to_fixed(z, d["teacher"])
        elif case == "cross_entropy":
            out = reference.cross_entropy_to_fixed(z, d["teacher"])
        elif case == "gather_neg_entropy":
            lp, ne = reference.gather_logprobs(z, d["ids"])
            out = torch.cat([lp, ne[:, None]], -1)
        elif case == "prepare_loss_input":
            out = reference.next_token_logprobs(z[None], d["target"][None])[0]
        else:
            values, ids = reference.vocab_topk(z, 5)
            out = torch.cat([values, ids.to(values.dtype)], -1)
        _weighted(out, d, case).backward()
        return out.detach(), (z.grad,)
    hidden = d["hidden"].clone().requires_grad_()
    weight = d["weight"].clone().requires_grad_()
    if case == "fused_token":
        lp, _ = reference.linear_token_logprobs(hidden, weight, d["target"])
        values, loss = lp, (lp * d["g"][:, 0]).sum()
    else:
        b = d["b"] if case == "objective" else None
        loss, lp, ne = reference.linear_logprob_objective(hidden, weight, d["target"], d["a"], b)
        values = torch.stack([lp, ne]) if case == "objective" else lp
    loss.backward()
    return values.detach(), (hidden.grad, weight.grad)


LOGITS_CASES = (
    "token_logprobs",
    "filtered",
    "filtered_bisection",
    "gather",
    "entropy",
    "reverse_kl",
    "cross_entropy",
    "gather_neg_entropy",
    "prepare_loss_input",
    "vocab_topk",
)
CASES = [
    *LOGITS_CASES,
    "fused_token",
    "objective",
    "objective_sequence_parallel",
    "objective_dtensor",
]


@pytest.mark.parametrize("case", CASES)
def test_uneven_shards_with_rank_dependent_default_chunks_match_the_reference(case):
    results = gloo_pool(2).run(_uneven, case)
    (chunks0, *_), (chunks1, *_) = results
    assert chunks0 != chunks1, "the shrunk budget must make the width-based chunk counts differ"
    want_values, want_grads = _reference(case)
    for rank, (_, values, grads) in enumerate(results):
        torch.testing.assert_close(values, want_values, **TIGHT)
        if case == "vocab_topk":
            assert grads == (None,)
        elif len(want_grads) == 1:  # logits paths: this rank's columns of the gradient
            start = sum(WIDTHS[:rank])
            torch.testing.assert_close(grads[0], want_grads[0][:, start : start + WIDTHS[rank]], **TIGHT)
        else:  # fused paths: the full hidden gradient, this rank's weight rows
            start = sum(WIDTHS[:rank])
            torch.testing.assert_close(grads[0], want_grads[0], **TIGHT)
            torch.testing.assert_close(grads[1], want_grads[1][start : start + WIDTHS[rank]], **TIGHT)
