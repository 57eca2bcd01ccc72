"""The cross-rank consistency check on the fused LM-head functions (issue 10 item 6), on a real
2-process gloo pool: ranks that disagree (hidden shape, dtype, weight rows against the declared
vocabulary, a scalar argument) get the same clear ValueError on every rank within seconds, and
the group stays in step: a consistent call afterwards (uneven 6 + 5 rows) matches the reference.
The shard width of a fused call is the weight's row count (`lossfx/_boundary/consistency.py`).
"""

import harness
import pytest
import torch
from harness import assert_every_rank_raises, gloo_pool, value_error

import lossfx

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("short_pool_timeout")]

F64 = torch.float64
SECONDS = 20.0
H = 4


def _data(n, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen, dtype=F64)
    weight = torch.randn(vocab, H, generator=gen, dtype=F64)
    return hidden, weight, torch.randint(0, vocab, (n,), generator=gen)


def _call(case, rank, group):
    """This rank's side of a mismatch case (V = 12 split 6 + 6 unless stated)."""
    hidden, weight, target = _data(5, 12, 0)
    rows = weight[rank * 6 : (rank + 1) * 6]
    if case == "hidden_shape":
        return lossfx.linear_token_logprobs(hidden[: 5 - rank], rows, target[: 5 - rank], group=group)
    if case == "dtype":
        h, w = (hidden.float(), rows.float()) if rank == 0 else (hidden, rows)
        return lossfx.linear_token_logprobs(h, w, target, group=group)
    if case == "weight_rows_vs_vocab_size":  # rows 6 + 5 declared as V = 12
        w = weight[:6] if rank == 0 else weight[6:11]
        return lossfx.linear_token_logprobs(hidden, w, target % 11, group=group, vocab_start=6 * rank, vocab_size=12)
    if case == "weight_rows_default_layout":  # rows 6 + 5 without vocab_start / vocab_size
        w = weight[:6] if rank == 0 else weight[6:11]
        return lossfx.linear_token_logprobs(hidden, w, target % 11, group=group)
    if case == "gather_convention":
        ids = torch.stack([target, (target + 1) % 12], -1)
        return lossfx.linear_gather_logprobs(hidden, rows, ids, zero_outside_topk=rank == 0, group=group)
    if case == "next_token_temperature":
        ids = target.view(1, 5)
        return lossfx.linear_next_token_logprobs(hidden[None], rows, ids, group=group, temperature=1.0 + rank)
    if case == "objective_chunk_size":  # the objective's loop runs one collective per chunk
        coefficients = torch.ones(5, dtype=F64)
        return lossfx.linear_logprob_objective(hidden, rows, target, coefficients, group=group, chunk_size=2 + rank)
    raise AssertionError(case)


def _error_then_ok(rank, world, group, case):
    """`(message or None, seconds, a consistent call's values and weight gradient)` on this rank."""
    message, seconds = value_error(lambda: _call(case, rank, group))
    hidden, weight, target = _data(3, 11, 1)
    rows = weight[:6] if rank == 0 else weight[6:]  # uneven 6 + 5, declared
    rows = rows.clone().requires_grad_()
    after = lossfx.linear_token_logprobs(hidden, rows, target, group=group, vocab_start=6 * rank, vocab_size=11)
    after.sum().backward()
    return message, seconds, after.detach(), rows.grad


EXPECTED = {
    "hidden_shape": ["hidden.shape[0] (rank 0: 5, rank 1: 4)"],
    "dtype": ["hidden.dtype (rank 0: torch.float32, rank 1: torch.float64)"],
    "weight_rows_vs_vocab_size": ["rank 0: [0, 6), rank 1: [6, 11)", "do not tile [0, 12)"],
    "weight_rows_default_layout": ["vocabulary size V (rank 0: 12, rank 1: 10"],
    "gather_convention": ["zero_outside_topk (rank 0: True, rank 1: False)"],
    "next_token_temperature": ["temperature (rank 0: 1.0, rank 1: 2.0)"],
    "objective_chunk_size": ["chunk_size (rank 0: 2, rank 1: 3)"],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_fused_mismatch_raises_on_every_rank(case):
    results = gloo_pool(2).run(_error_then_ok, case)
    messages = [m for m, _, _, _ in results]
    assert_every_rank_raises(messages, EXPECTED[case])
    assert max(s for _, s, _, _ in results) < SECONDS
    harness.assert_fused_call_exact([a for _, _, a, _ in results], [g for _, _, _, g in results], *_data(3, 11, 1))
