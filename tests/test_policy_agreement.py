"""A forced `lossfx.chunk_policy` is part of the cross-rank check (on a real 2-process gloo pool).

The policy is process state, not an argument, yet it sizes the eager loops: the fused objective
runs one all-gather per row chunk, so ranks forcing different policies (or one rank only) would
run different numbers of collectives and abort or hang. The check puts the forced policy (or
none) into the signature, eagerly and traced (a constant of the graph, guarded by Dynamo), so a
mismatch is the same clear error on every rank, and the group is still in step afterwards.
"""

import harness
import pytest
import torch
from harness import assert_every_rank_raises, gloo_pool

import lossfx
from lossfx import reference

pytestmark = pytest.mark.distributed

F64 = torch.float64
N, H, V = 12, 4, 11  # 6 + 5 vocabulary rows
TIGHT = lossfx.ChunkPolicy(row_bytes=64, min_rows=1, tile_bytes=64, max_block=4, chunk_bytes=64)
OTHER = lossfx.ChunkPolicy(row_bytes=256, min_rows=1, tile_bytes=64, max_block=4, chunk_bytes=256)


@pytest.fixture(autouse=True)
def _short_pool_timeout(monkeypatch):
    """A hang fails the test after 120 s instead of the harness's default 600 s."""
    monkeypatch.setattr(harness, "_TIMEOUT_S", 120.0)


def _data():
    gen = torch.Generator().manual_seed(7)
    return {
        "z": torch.randn(N, V, generator=gen, dtype=F64),
        "hidden": torch.randn(N, H, generator=gen, dtype=F64),
        "weight": torch.randn(V, H, generator=gen, dtype=F64),
        "target": torch.randint(0, V, (N,), generator=gen),
        "a": torch.randn(N, generator=gen, dtype=F64),
    }


def _logits(z, target, group, start):
    return lossfx.token_logprobs(z, target, group=group, vocab_start=start, vocab_size=V)


def _objective(hidden, w, target, a, group, start):
    return lossfx.linear_logprob_objective(hidden, w, target, a, group=group, vocab_start=start, vocab_size=V)[1]


def _policies(case, rank):
    """The policy each rank forces (None: none forced)."""
    return {"one_rank": (TIGHT, None), "different": (TIGHT, OTHER), "same": (TIGHT, TIGHT)}[case][rank]


def _run(rank, world, group, path, case, compiled):
    """`(message or None, this rank's consistent values afterwards)` of one case on this rank."""
    d = _data()
    start = 6 * rank
    cols = slice(start, start + (6 if rank == 0 else 5))
    if path == "logits":
        fn, args = _logits, (d["z"][:, cols], d["target"], group, start)
    else:
        fn, args = _objective, (d["hidden"], d["weight"][cols], d["target"], d["a"], group, start)
    if compiled:
        _, fn = harness.compiled_for_rank(rank, ("policy", path), fn, "aot_eager")
    policy = _policies(case, rank)
    try:
        if policy is None:
            fn(*args)
        else:
            with lossfx.chunk_policy(policy):
                fn(*args)
        message = None
    except (ValueError, RuntimeError) as err:
        message = str(err)
    return message, fn(*args)


def _reference(path):
    d = _data()
    if path == "logits":
        return reference.token_logprobs(d["z"], d["target"])
    return reference.linear_logprob_objective(d["hidden"], d["weight"], d["target"], d["a"])[1]


CASES = [
    ("logits", "one_rank", False),
    ("fused", "one_rank", False),
    ("fused", "different", False),
    ("fused", "same", False),
    ("logits", "different", True),
    ("fused", "one_rank", True),
]


@pytest.mark.parametrize(("path", "case", "compiled"), CASES)
def test_forced_policy_mismatch_raises_on_every_rank(path, case, compiled):
    results = gloo_pool(2).run(_run, path, case, compiled)
    messages = [m for m, _ in results]
    if case == "same":
        assert messages == [None, None]
    elif compiled:  # an in-graph assertion: names the policy, each rank's value is not shown
        what = "the ranks of group disagree on the forced lossfx.chunk_policy"
        assert_every_rank_raises(messages, [what])
    else:
        theirs = "none (each device's default)" if case == "one_rank" else "row_bytes=256"
        assert_every_rank_raises(messages, ["the forced lossfx.chunk_policy (rank 0: ChunkPolicy(row_bytes=64", theirs])
    want = _reference(path)
    for _, values in results:  # the group is still in step
        torch.testing.assert_close(values, want, rtol=0, atol=1e-10)
