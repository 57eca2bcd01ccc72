"""Padding-free rows (`position_ids=`): several sequences in one row, positions restarting at 0.

`linear_next_token_logprobs` and `next_token_logprobs` must not shift across a sequence boundary:
each sequence's last position gets 0 with a zero gradient. Checked against the float64 reference
(values and gradients at 1e-10, TP 1 and 2 on rank threads, CP 2, eager and compiled) and against
scoring each sequence on its own.
"""

from __future__ import annotations

import math

import pytest
import torch
from devices import DEVICE
from harness import compiled_for_rank, run_ranks

import lossfx
from lossfx import reference
from lossfx.context_parallel import shard_for_cp_rank
from lossfx.interfaces import TrainingSamplingParams

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
LENGTHS = [(3, 1, 5, 3), (6, 6)]  # per row: sequence lengths summing to S = 12 (a length-1 sequence included)


def positions(lengths_per_row):
    """`[B, S]` position ids restarting at 0 at each sequence start."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def make_case(seed=0, batch=2, seq=12, hidden_size=5, vocab=16):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen, dtype=F64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=F64) * 3 / math.sqrt(hidden_size)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    dout = torch.randn(batch, seq - 1, generator=gen, dtype=F64)
    dent = torch.randn(batch, seq - 1, generator=gen, dtype=F64)
    return hidden, weight, input_ids, dout, dent


def reference_grads(hidden, weight, input_ids, pos, dout, dent, temperature):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ne = reference.linear_next_token_logprobs(h, w, input_ids, temperature, position_ids=pos)
    dh, dw = torch.autograd.grad([lp, ne], [h, w], [dout, dent])
    return lp.detach(), ne.detach(), dh, dw


def _fused_rank(rank, world, group, hidden, weight, input_ids, pos, dout, dent, sp, compiled=None):
    vl = weight.shape[0] // world
    w = weight[rank * vl : (rank + 1) * vl].clone().requires_grad_()
    h = hidden
    if sp and world > 1:
        n = hidden.shape[1] // world
        h = hidden[:, rank * n : (rank + 1) * n]
    h = h.clone().requires_grad_()

    def fn(h, w, ids, pos):
        return lossfx.linear_next_token_logprobs(
            h, w, ids, group=group, temperature=0.7, sequence_parallel=sp, chunk_size=5, return_neg_entropy=True,
            position_ids=pos,
        )  # fmt: skip

    counter = None
    if compiled is not None:
        counter, fn = compiled_for_rank(rank, ("padding_free", world, sp), fn, compiled)
    lp, ne = fn(h, w, input_ids, pos)
    torch.autograd.backward([lp, ne], [dout, dent])
    return lp.detach(), ne.detach(), h.grad, w.grad, None if counter is None else counter.frame_count


def check_fused(world, sp, compiled=None, seed=0, lengths=LENGTHS):
    hidden, weight, input_ids, dout, dent = make_case(seed)
    pos = positions(lengths)
    results = run_ranks(world, _fused_rank, hidden, weight, input_ids, pos, dout, dent, sp, compiled)
    lp, ne, dh, dw = reference_grads(hidden, weight, input_ids, pos, dout, dent, 0.7)
    for res in results:
        torch.testing.assert_close(res[0], lp, **TIGHT)
        torch.testing.assert_close(res[1], ne, **TIGHT)
    got_dh = torch.cat([r[2] for r in results], dim=1) if sp and world > 1 else results[0][2]
    torch.testing.assert_close(got_dh, dh, **TIGHT)
    torch.testing.assert_close(torch.cat([r[3] for r in results]), dw, **TIGHT)
    return results


@pytest.mark.parametrize(("world", "sp"), [(1, False), (2, False), (2, True)])
def test_fused_matches_reference(world, sp):
    results = check_fused(world, sp)
    ends = positions(LENGTHS)[:, 1:] == 0
    assert ends.sum() == 4  # three boundaries in row 0, one in row 1: the test is not vacuous
    assert (results[0][0][ends] == 0).all() and (results[0][0][~ends] != 0).all()


@pytest.mark.compile
def test_fused_compiled_matches_reference_one_graph_for_any_boundaries():
    first = check_fused(1, False, compiled="inductor", seed=1)
    second = check_fused(1, False, compiled="inductor", seed=2, lengths=[(2, 2, 2, 2, 4), (12,)])
    assert first[0][4] == second[0][4] == 1, "boundaries are tensor values: no recompile when they move"


def _logits_rank(rank, world, group, logits, input_ids, pos, dout, tp):
    if tp:  # tensor parallel over the vocabulary
        vl = logits.shape[-1] // world
        z = logits[..., rank * vl : (rank + 1) * vl].clone().requires_grad_()
        lp = lossfx.next_token_logprobs(
            z, input_ids, vocab_parallel_group=group, vocab_parallel_rank=rank, chunk_size=3, position_ids=pos
        )
    else:  # context parallel, load-balanced layout
        z = shard_for_cp_rank(logits, rank, world, seq_dim=1).clone().requires_grad_()
        lp = lossfx.next_token_logprobs(z, input_ids, context_parallel_group=group, position_ids=pos)
        dout = dout / world  # every CP rank computes the same loss
    lp.backward(dout)
    return lp.detach(), z.grad


@pytest.mark.parametrize(("world", "tp"), [(1, True), (2, True), (2, False)])
def test_logits_path_matches_reference(world, tp):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 12, 16, generator=gen, dtype=F64) * 2
    input_ids = torch.randint(0, 16, (2, 12), generator=gen)
    dout = torch.randn(2, 11, generator=gen, dtype=F64)
    pos = positions(LENGTHS)
    results = run_ranks(world, _logits_rank, logits, input_ids, pos, dout, tp)
    z = logits.clone().requires_grad_()
    lp = reference.next_token_logprobs(z, input_ids, position_ids=pos)
    (dz,) = torch.autograd.grad(lp, z, dout)
    for res in results:
        torch.testing.assert_close(res[0], lp.detach(), **TIGHT)
    if tp:
        got = torch.cat([r[1] for r in results], dim=-1)
    else:
        got = torch.zeros_like(logits)
        idx = torch.arange(12)[None]
        for rank, res in enumerate(results):
            got[:, shard_for_cp_rank(idx, rank, world, seq_dim=1)[0]] += res[1]
    torch.testing.assert_close(got, dz, **TIGHT)
    assert (dz[:, :-1][pos[:, 1:] == 0] == 0).all()  # a sequence's last position receives no gradient


def test_equals_each_sequence_scored_on_its_own():
    hidden, weight, input_ids, _, _ = make_case(seed=4)
    lengths = LENGTHS[0]
    pos = positions([lengths])
    h, ids = hidden[:1], input_ids[:1]
    lp, ne = lossfx.linear_next_token_logprobs(h, weight, ids, position_ids=pos, return_neg_entropy=True)
    lp_logits = lossfx.next_token_logprobs(h @ weight.T, ids, position_ids=pos)
    pieces_lp, pieces_ne, start = [], [], 0
    for n in lengths:
        one_lp, one_ne = lossfx.linear_next_token_logprobs(
            h[:, start : start + n], weight, ids[:, start : start + n], return_neg_entropy=True
        )
        zero = one_lp.new_zeros(1, 1)
        pieces_lp += [one_lp, zero]
        pieces_ne += [one_ne, zero]
        start += n
    expected_lp = torch.cat(pieces_lp, dim=1)[:, :-1]  # the row's last position is dropped, as always
    expected_ne = torch.cat(pieces_ne, dim=1)[:, :-1]
    torch.testing.assert_close(lp, expected_lp, **TIGHT)
    torch.testing.assert_close(ne, expected_ne, **TIGHT)
    torch.testing.assert_close(lp_logits, expected_lp, **TIGHT)


def test_ordinary_positions_change_nothing_and_inputs_are_not_mutated():
    hidden, weight, input_ids, _, _ = make_case(seed=5)
    pos = torch.arange(12).expand(2, 12).clone()
    pos_before, ids_before = pos.clone(), input_ids.clone()
    plain = lossfx.linear_next_token_logprobs(hidden, weight, input_ids)
    torch.testing.assert_close(lossfx.linear_next_token_logprobs(hidden, weight, input_ids, position_ids=pos), plain)
    assert torch.equal(pos, pos_before) and torch.equal(input_ids, ids_before)


def test_filtered_logits_path_gives_no_nan_at_boundaries():
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(2, 12, 16, generator=gen, dtype=F64) * 3).requires_grad_()
    input_ids = torch.randint(0, 16, (2, 12), generator=gen)
    pos = positions(LENGTHS)
    params = TrainingSamplingParams(top_k=3, top_p=1.0)
    lp = lossfx.next_token_logprobs(logits, input_ids, sampling_params=params, position_ids=pos)
    expected = reference.next_token_filtered_logprobs(logits.detach(), input_ids, 3, 1.0)
    ends = pos[:, 1:] == 0
    torch.testing.assert_close(lp[~ends], expected[~ends], **TIGHT)
    assert (lp[ends] == 0).all()
    lp.masked_fill(torch.isinf(lp), 0).sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(
    ("pos", "error", "match"),
    [
        (torch.zeros(2, 12).to(DEVICE), TypeError, "position_ids must hold integer"),
        (
            torch.zeros(1, 12, dtype=torch.long).to(DEVICE),
            ValueError,
            r"position_ids must have input_ids' shape.*\(1, 12\)",
        ),
        ([0, 1, 2], TypeError, "position_ids must be a torch.Tensor"),
    ],
)
def test_bad_position_ids(pos, error, match):
    hidden, weight, input_ids, _, _ = make_case()
    with pytest.raises(error, match=match):
        lossfx.linear_next_token_logprobs(hidden, weight, input_ids, position_ids=pos)
    with pytest.raises(error, match=match):
        lossfx.next_token_logprobs(hidden @ weight.T, input_ids, position_ids=pos)
