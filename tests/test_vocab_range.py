"""Explicit vocabulary ranges and group arguments (issue 15 item 8).

Every function taking `vocab_start` / `vocab_size` rejects, with a ValueError or TypeError that
names the argument and its value, a range its shard cannot hold: without a group the logits (or
the LM-head rows) are the whole vocabulary, so `vocab_start` must be 0 and `vocab_size` the
width; with a group the shard must lie inside `[0, vocab_size)`. A group given by name (`"tp"`)
is a TypeError. Ranges that are right (stated explicitly) match the reference.
"""

import re
from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE
from harness import run_ranks

import lossfx
from lossfx import reference

F64 = torch.float64
V = 10
GEN = torch.Generator().manual_seed(8)
Z = torch.randn(2, 3, V, generator=GEN, dtype=F64).to(DEVICE)
T = torch.randint(0, V, (2, 3), generator=GEN).to(DEVICE)
IDS = torch.randint(0, V, (2, 3, 2), generator=GEN).to(DEVICE)
HID = torch.randn(2, 3, 4, generator=GEN, dtype=F64).to(DEVICE)
W = torch.randn(V, 4, generator=GEN, dtype=F64).to(DEVICE)

CALLS = {
    "token_logprobs": lambda z, w, **kw: lossfx.token_logprobs(z, T, **kw),
    "token_logprobs_with_lse": lambda z, w, **kw: lossfx.token_logprobs_with_lse(z, T, **kw)[0],
    "gather_logprobs": lambda z, w, **kw: lossfx.gather_logprobs(z, IDS, **kw)[0],
    "gather_logits": lambda z, w, **kw: lossfx.gather_logits(z, IDS, **kw),
    "filtered_token_logprobs": lambda z, w, **kw: lossfx.filtered_token_logprobs(z, Z.argmax(-1), top_k=3, **kw),
    "apply_top_k_top_p": lambda z, w, **kw: lossfx.apply_top_k_top_p(z, top_k=3, **kw),
    "top_k_top_p_threshold": lambda z, w, **kw: lossfx.top_k_top_p_threshold(z, top_k=3, **kw)[0],
    "vocab_topk": lambda z, w, **kw: lossfx.vocab_topk(z, 3, **kw)[0],
    "linear_token_logprobs": lambda z, w, **kw: lossfx.linear_token_logprobs(HID, w, T, **kw),
    "linear_next_token_logprobs": lambda z, w, **kw: lossfx.linear_next_token_logprobs(HID, w, T, **kw),
    "linear_gather_logprobs": lambda z, w, **kw: lossfx.linear_gather_logprobs(HID, w, IDS, **kw)[0],
    "linear_logprob_objective": lambda z, w, **kw: lossfx.linear_logprob_objective(HID, w, T, torch.ones(2, 3), **kw)[
        1
    ],
}
NO_VOCAB_SIZE = {"vocab_topk"}

BAD = [  # (arguments, error, the message names the argument and the value)
    ({"vocab_start": 3}, ValueError, "vocab_start=3"),
    ({"vocab_start": -1}, ValueError, "vocab_start=-1"),
    ({"vocab_size": V + 2}, ValueError, f"vocab_size={V + 2}"),
    ({"vocab_size": V - 2}, ValueError, f"vocab_size={V - 2}"),
    ({"vocab_start": 1.0}, TypeError, "vocab_start must be an int or None, got 1.0"),
    ({"vocab_size": float(V)}, TypeError, f"vocab_size must be an int or None, got {float(V)}"),
    ({"vocab_start": True}, TypeError, "vocab_start must be an int or None, got True"),
    ({"group": "tp"}, TypeError, "group must be a torch.distributed.ProcessGroup or None, got 'tp'"),
]


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize(("arguments", "error", "message"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_vocabulary_range_without_a_group_raises_naming_the_argument(name, arguments, error, message):
    if name in NO_VOCAB_SIZE and "vocab_size" in arguments:
        pytest.skip("vocab_topk takes no vocab_size")
    with pytest.raises(error, match=re.escape(message)):
        CALLS[name](Z, W, **arguments)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_right_range_stated_explicitly_is_accepted(name):
    explicit = {"vocab_start": 0} if name in NO_VOCAB_SIZE else {"vocab_start": 0, "vocab_size": V}
    torch.testing.assert_close(CALLS[name](Z, W, **explicit), CALLS[name](Z, W), rtol=0, atol=0)


def test_the_dtensor_boundary_names_the_callers_parameters():
    """`_boundary.dtensor` knows no parameter name: its messages name the ones the caller's
    `Roles` declare, and a layout argument given without its declared parameter is a lossfx bug
    caught at the call (TypeError), not a message naming nothing."""
    from lossfx._boundary.consistency import Roles
    from lossfx._boundary.dtensor import vocab_shard

    roles = Roles(tp="my_group", start="first_id", size="n_ids")
    cases = [
        (
            {"vocab_start": 3},
            ValueError,
            "first_id=3 without a tensor-parallel group (my_group of one rank or None): scores",
        ),
        ({"vocab_size": V + 1}, ValueError, f"n_ids={V + 1} without a tensor-parallel group (my_group of one rank"),
        ({"vocab_start": 1.0}, TypeError, "first_id must be an int or None, got 1.0"),
        ({"group": "tp"}, TypeError, "my_group must be a torch.distributed.ProcessGroup or None, got 'tp'"),
    ]
    for arguments, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            vocab_shard(Z, name="scores", roles=roles, **arguments)
    assert vocab_shard(Z, name="scores", roles=roles, vocab_start=0, vocab_size=V).local is Z
    with pytest.raises(
        TypeError, match=re.escape("vocab_shard(scores): the caller's roles declare no parameter for rank")
    ):
        vocab_shard(Z, name="scores", roles=roles, rank=0)


def test_without_a_group_the_defaults_match_the_reference():
    torch.testing.assert_close(lossfx.token_logprobs(Z, T, vocab_start=0, vocab_size=V), reference.token_logprobs(Z, T))


@pytest.mark.parametrize(
    "entry",
    [
        lambda g: lossfx.prepare_loss_input(
            Z, {"input_ids": T}, SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB), vocab_parallel_group=g
        ),
        lambda g: lossfx.next_token_logprobs(Z, T, vocab_parallel_group=g, vocab_parallel_rank=0),
        lambda g: lossfx.map_to_draft_vocab(Z, torch.zeros(4, dtype=torch.int64), vocab_parallel_group=g),
        lambda g: lossfx.draft_targets(Z, torch.ones(2, 3), vocab_parallel_group=g, vocab_parallel_rank=0),
    ],
    ids=["prepare_loss_input", "next_token_logprobs", "map_to_draft_vocab", "draft_targets"],
)
def test_a_group_given_by_name_is_a_type_error_naming_vocab_parallel_group(entry):
    with pytest.raises(TypeError, match=re.escape("vocab_parallel_group must be a torch.distributed.ProcessGroup")):
        entry("tp")


def _sharded_range(rank, world, group, arguments):
    """This rank's half of the logits and the LM head, with `arguments` overriding the range."""
    cols = slice(rank * (V // 2), (rank + 1) * (V // 2))
    out = []
    for name in ("token_logprobs", "linear_token_logprobs"):
        span = {"vocab_start": rank * (V // 2), "vocab_size": V, **arguments}
        try:
            CALLS[name](Z[..., cols], W[cols], group=group, **span)
            out.append("ok")
        except ValueError as err:
            out.append(str(err))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("arguments", "messages"),
    [
        ({"vocab_size": 4}, ("vocab_size=4 is smaller than this rank's shard", "do not tile [0, 4)")),
        ({"vocab_start": 7}, ("vocab_start=7 puts this rank's 5 vocabulary entries", "rank 0: [7, 12)")),
        ({"vocab_start": -2}, ("vocab_start=-2 puts this rank's 5 vocabulary entries", "rank 0: [-2, 3)")),
    ],
)
def test_with_a_group_a_shard_outside_the_vocabulary_raises_on_every_rank(arguments, messages):
    """The local range check, or the cross-rank check (which sees every rank's range) before it."""
    for per_rank in run_ranks(2, _sharded_range, arguments):
        assert len(per_rank) == 2 and all(any(m in got for m in messages) for got in per_rank), per_rank


@pytest.mark.distributed
def test_with_a_group_the_explicit_range_matches_the_reference():
    got = run_ranks(
        2,
        lambda rank, world, group: lossfx.token_logprobs(
            Z[..., rank * 5 : rank * 5 + 5], T, group=group, vocab_start=5 * rank, vocab_size=V
        ),
    )
    for lp in got:
        torch.testing.assert_close(lp, reference.token_logprobs(Z, T), rtol=0, atol=1e-12)
