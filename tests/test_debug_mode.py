"""The opt-in debug mode (`LOSSFX_DISTRIBUTED_DEBUG`, lossfx/_boundary/debug.py) on 2 real gloo processes.

The hangs the cross-rank check cannot catch (it is a collective over the call's group, so ranks
that disagree on the group never meet in it): a group on one rank only, two distinct group
objects with the same ranks, a `Replicate()` DTensor on one rank and a sharded one on the other
(logits `Shard(-1)`, a fused head `Shard(0)`), `None` beside a sharded DTensor (a fused head's bias),
a plain tensor beside one (logits, TRL's head). With the mode on, each raises one clear
`ValueError` on every rank, under a deadline (a hang fails the test), and the group is still in
step after it (a probe all-reduce). A rank that never makes the call: `RuntimeError` at the
timeout. Valid calls give the float64 reference's values with the mode on and off; off, a call
touches the store not once and runs the same collectives as the boundary without the hook.
Compiled: the handshake is skipped with a warning, in one `fullgraph=True` graph.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
from unittest import mock

import harness
import pytest
import torch
import torch.distributed as dist

import lossfx
from lossfx import reference
from lossfx._boundary import debug

pytestmark = pytest.mark.distributed

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
B, S, V, H = 2, 3, 8, 4
DEADLINE_S = 90.0  # eager, tiny shapes: about a second; a hang runs into this
TIMEOUT_S = "20"  # the handshake's own timeout in these tests (only the missing-rank case waits for it)
COMPILING = "LOSSFX_DISTRIBUTED_DEBUG is on, but a lossfx call is being compiled"  # the trace-time warning


def _data():
    gen = torch.Generator().manual_seed(7)
    return {
        "logits": torch.randn(B, S, V, generator=gen, dtype=F64),
        "target": torch.randint(0, V, (B, S), generator=gen),
        "hidden": torch.randn(B * S, H, generator=gen, dtype=F64),
        "weight": torch.randn(V, H, generator=gen, dtype=F64),
    }


_groups: dict[str, object] = {}


def _two_groups():
    """Two distinct group objects of the same ranks [0, 1], created once per process (collectively)."""
    if "a" not in _groups:
        _groups["a"], _groups["b"] = dist.new_group([0, 1]), dist.new_group([0, 1])
    return _groups["a"], _groups["b"]


def _dtensor(x, placement):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if placement == "replicate":
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    dim = -1 if placement == "shard_last" else 0
    local = x.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)


# case -> (rank 0's, rank 1's) (logits, group) of a token_logprobs call. Logits: "shard" (this
# rank's columns, plain), "full" (plain) or a `_dtensor` placement of the full logits; group:
# "group" (the call's group), "a" / "b" (two distinct group objects of the same ranks) or None
TOKEN_CALLS = {
    "group_on_one_rank": (("shard", "group"), ("full", None)),
    "distinct_groups": (("shard", "a"), ("shard", "b")),
    "replicate_vs_shard_logits": (("replicate", None), ("shard_last", None)),
    "plain_vs_shard_logits": (("full", None), ("shard_last", None)),
    "replicate_vs_plain_shard": (("replicate", None), ("shard", "group")),  # the held-out suite's strict xfail
    "agree_group": (("shard", "group"),) * 2,
    "agree_no_group": (("full", None),) * 2,  # data parallel: each rank alone, no collective
    "agree_shard_logits": (("shard_last", None),) * 2,
    "agree_replicate_vs_plain": (("replicate", None), ("full", None)),  # all-Replicate(): no collective, no tie
}
# case -> (rank 0's, rank 1's) (weight, bias) of a linear_token_logprobs call: "full" (plain), a
# `_dtensor` placement (of the weight, of a zero bias) or None (no bias)
HEAD_CALLS = {
    "none_vs_shard_bias": (("full", None), ("full", "shard_rows")),
    "replicate_vs_shard_head": (("replicate", None), ("shard_rows", None)),
    "agree_shard_head": (("shard_rows", None),) * 2,
}


def _call(case: str, rank: int, group):
    """`(lossfx call, dense float64 answer)` of `case` on `rank` (rank 1 differs in the hang cases)."""
    d = _data()
    logits, target, hidden, weight = d["logits"], d["target"], d["hidden"], d["weight"]
    if case in TOKEN_CALLS:
        what, tie = TOKEN_CALLS[case][rank]
        x = {"shard": logits.chunk(2, dim=-1)[rank], "full": logits}.get(what)
        x = _dtensor(logits, what) if x is None else x
        kw = {} if tie is None else {"group": group if tie == "group" else _two_groups()["ab".index(tie)]}
        return (lambda: lossfx.token_logprobs(x, target, **kw)), reference.token_logprobs(logits, target)
    if case in HEAD_CALLS:
        w, b = HEAD_CALLS[case][rank]
        w = weight if w == "full" else _dtensor(weight, w)
        bias = None if b is None else _dtensor(torch.zeros(V, dtype=F64), b)
        fused = reference.linear_token_logprobs(hidden, weight, target.reshape(-1))[0]
        return (lambda: lossfx.linear_token_logprobs(hidden, w, target.reshape(-1), bias=bias)), fused
    assert case == "trl_plain_vs_shard_head", case  # TRL's own option all-gather runs before lossfx's boundary
    from lossfx.integrations.trl import per_token_logps_and_entropies

    w = weight if rank == 0 else _dtensor(weight, "shard_rows")
    ids, h = target.reshape(B, S), hidden.reshape(B, S, H)
    dense = reference.linear_token_logprobs(h[:, :-1].reshape(-1, H), weight, ids[:, 1:].reshape(-1))[0]
    call = lambda: per_token_logps_and_entropies(h, w, ids, sharded_head="gather")[0]  # noqa: E731
    return call, dense.reshape(B, S - 1)


def _mode(on: bool, timeout: str = TIMEOUT_S):
    """`LOSSFX_DISTRIBUTED_DEBUG` (and its timeout) set for a block, restored after ("": unset, off)."""
    return mock.patch.dict(os.environ, {debug.ENV: "1" if on else "", debug.ENV_TIMEOUT: timeout})


def _calls(rank, world, group, cases, on):
    """`{case: outcome}` of one call of each of `cases` with the mode `on` or off, each followed by a
    probe all-reduce."""
    outs = {}
    for case in cases:
        call, expected = _call(case, rank, group)
        out = outs[case] = {"error": None}
        started = time.monotonic()
        with _mode(on):
            try:
                out["lp"] = call().detach()
                out["expected"] = expected
            except (ValueError, RuntimeError) as e:
                out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - started
        probe = torch.ones(())
        dist.all_reduce(probe, group=group)  # the group is still in step after the call
        out["probe"] = probe
    return outs


def _run(fn, *args) -> list:
    """Every rank's `fn(*args)`; fails on a hang (no answer by `DEADLINE_S`) or a dead rank."""
    return harness.answers_in_time(fn, *args, timeout=DEADLINE_S)


HANGS = {  # case: (the argument the ranks are tied by, what else every rank's error must say)
    "group_on_one_rank": (
        "group",
        ["rank 0: process group '0' of ranks [0, 1], rank 1: None", "pass the same group (or none)"],
    ),
    "distinct_groups": ("group", ["two distinct process group objects with the same ranks"]),
    "replicate_vs_shard_logits": (
        "logits",
        ["rank 0: a DTensor (Replicate()) of shape [2, 3, 8]", "rank 1: a DTensor (Shard(2)) of shape [2, 3, 8]"],
    ),
    "plain_vs_shard_logits": ("logits", ["rank 0: a plain tensor, rank 1: a DTensor (Shard(2))"]),
    "replicate_vs_plain_shard": ("group", ["rank 0: None, rank 1: process group '0' of ranks [0, 1]"]),
    # rank 1's view rejects the bias, then meets its mesh group in the check: a hang
    "none_vs_shard_bias": (
        "bias",
        ["rank 0: None, rank 1: a DTensor (Shard(0)) of shape [8]", "pass the same kind of argument"],
    ),
    "trl_plain_vs_shard_head": (
        "weight",
        ["lossfx.integrations.trl.per_token_logps", "rank 0: a plain tensor, rank 1: a DTensor (Shard(0))"],
    ),
    "replicate_vs_shard_head": (
        "weight",
        ["rank 0: a DTensor (Replicate()) of shape [8, 4]", "rank 1: a DTensor (Shard(0)) of shape [8, 4]"],
    ),
}


@pytest.mark.parametrize("case", sorted(HANGS))
def test_each_hang_is_one_clear_error_on_every_rank(case):
    answers = [a[case] for a in _run(_calls, [case], True)]
    tied, parts = HANGS[case]
    for rank, answer in enumerate(answers):
        error = answer["error"]
        assert error is not None and error.startswith("ValueError: lossfx."), (rank, error)
        assert "LOSSFX_DISTRIBUTED_DEBUG" in error and "call #" in error, (rank, error)
        for part in [f"the ranks tied by {tied} describe it differently", *parts]:
            assert part in error, (rank, part, error)
        assert answer["seconds"] < 10, (rank, answer["seconds"])  # a disagreement waits for nobody
        assert float(answer["probe"]) == 2.0, "the group is out of step"
    assert len({re.sub(r"call #\d+", "call #", a["error"]) for a in answers}) == 1, answers  # one message


def _hangs_when_off(case: str, seconds: float = 10.0) -> bool:
    """Whether `case` with the mode off leaves every rank without an answer for `seconds` (the pool is then closed)."""
    answers, problems = harness.gloo_pool(2).answers(_calls, ([case], False), timeout=seconds)
    return not answers and set(problems.values()) == {"hang"}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(HANGS))
def test_without_the_mode_each_case_hangs(case):
    """Why the mode exists: off, the same calls hang (if one starts to raise, docs/dtensor.md's list is stale)."""
    assert _hangs_when_off(case)


VALID = ["agree_group", "agree_no_group", "agree_shard_logits", "agree_shard_head", "agree_replicate_vs_plain"]


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_valid_calls_are_exact_with_the_mode_on_and_off(on):
    """Every VALID case in one launch; a failure names the case and the rank."""
    for rank, answers in enumerate(_run(_calls, VALID, on)):
        for case, answer in answers.items():
            assert answer["error"] is None, (case, rank, answer["error"])
            torch.testing.assert_close(
                answer["lp"].reshape(-1), answer["expected"].reshape(-1), **TIGHT, msg=lambda m, c=case: f"{c}: {m}"
            )
            assert float(answer["probe"]) == 2.0, case


_COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "all_gather", "all_reduce", "broadcast", "barrier",
                "monitored_barrier", "all_gather_object", "reduce_scatter_tensor", "all_to_all_single")  # fmt: skip


def _counting(counts, name, original):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    return wrapper


def _counted(rank, world, group, case):
    """Store keys added, store look-ups, handshakes and collectives of one call of `case`, for the
    mode off, off through the boundary without the debug hook ("bare") and on."""
    call, _ = _call(case, rank, group)
    store = dist.distributed_c10d._get_default_store()
    runs = {}
    for run in ("off", "bare", "on"):
        counts = runs[run] = {"store look-ups": 0, "handshakes": 0, **dict.fromkeys(_COLLECTIVES, 0)}
        with contextlib.ExitStack() as stack:
            for name in (c for c in _COLLECTIVES if hasattr(dist, c)):
                stack.enter_context(mock.patch.object(dist, name, _counting(counts, name, getattr(dist, name))))
            c10d, lookup = dist.distributed_c10d, dist.distributed_c10d._get_default_store
            stack.enter_context(
                mock.patch.object(c10d, "_get_default_store", _counting(counts, "store look-ups", lookup))
            )
            stack.enter_context(
                mock.patch.object(debug, "_handshake", _counting(counts, "handshakes", debug._handshake))
            )
            if run == "bare":  # the same call through the boundary without the hook
                stack.enter_context(mock.patch.object(debug, "before_call", lambda *args: None))
            stack.enter_context(_mode(run == "on"))
            keys_before = store.num_keys()
            call()
            counts["store keys added"] = store.num_keys() - keys_before
        dist.barrier(group=group)  # the next run's key count starts after every rank's call
    return runs


@pytest.mark.parametrize("case", ["agree_group", "agree_no_group", "agree_shard_head"])
def test_off_the_mode_adds_no_store_access_and_no_collective(case):
    for rank, runs in enumerate(_run(_counted, case)):
        off, bare, on = runs["off"], runs["bare"], runs["on"]
        assert off == bare, (rank, off, bare)  # the hook, off, does nothing
        assert off["store look-ups"] == off["handshakes"] == off["store keys added"] == 0
        assert on["handshakes"] == 1 and on["store look-ups"] == 1, on  # one, nested calls none
        collectives = {c: on[c] for c in _COLLECTIVES}
        assert collectives == {c: off[c] for c in _COLLECTIVES}, (rank, on, off)  # store only


def _missing_rank(rank, world, group):
    """Rank 1 never makes the call: rank 0 waits for it up to the (short) timeout."""
    call, _ = _call("agree_group", rank, group)
    out = {"error": None}
    with _mode(True, timeout="1.5"):
        started = time.monotonic()
        if rank == 0:
            try:
                call()
            except RuntimeError as e:
                out["error"] = str(e)
        out["seconds"] = time.monotonic() - started
    return out


def test_a_rank_that_never_arrives_is_named_at_the_timeout():
    try:
        answers = _run(_missing_rank)
    finally:
        harness.gloo_pool(2).close()  # the ranks' call numbers in the store are out of step now
    error = answers[0]["error"]
    assert error is not None and "rank(s) [1] of the 2 ranks did not reach lossfx call #" in error, error
    assert "within 1.5 s (rank 0 did)" in error, error
    assert 1.5 <= answers[0]["seconds"] < 30, answers[0]["seconds"]


def _compiled(rank, world, group):
    """A compiled call with the mode on: no handshake, a warning at trace time, exact values."""
    call, expected = _call("agree_group", rank, group)
    counter, compiled = harness.compiled_for_rank(rank, "debug_mode", lambda: call(), backend="aot_eager")
    calls = []
    with mock.patch.object(debug, "_handshake", lambda *a: calls.append(a)), _mode(True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lp = compiled()
    return {
        "lp": lp.detach(),
        "expected": expected,
        "handshakes": len(calls),
        "frames": counter.frame_count,
        "warned": any(COMPILING in str(w.message) for w in caught),
    }


@pytest.mark.slow
def test_compiled_calls_skip_the_handshake_with_a_warning():
    for answer in _run(_compiled):
        assert answer["handshakes"] == 0 and answer["frames"] == 1 and answer["warned"], answer
        torch.testing.assert_close(answer["lp"].reshape(-1), answer["expected"].reshape(-1), **TIGHT)


def test_switch_values(monkeypatch):
    for value, on in [("1", True), ("on", True), ("TRUE", True), ("", False), ("0", False), ("off", False)]:
        monkeypatch.setenv(debug.ENV, value)
        assert debug.enabled() is on
    monkeypatch.setenv(debug.ENV, "2")
    with pytest.raises(ValueError, match="LOSSFX_DISTRIBUTED_DEBUG='2'"):
        debug.enabled()
    monkeypatch.setenv(debug.ENV_TIMEOUT, "-1")
    with pytest.raises(ValueError, match="LOSSFX_DISTRIBUTED_DEBUG_TIMEOUT='-1'"):
        debug._timeout()


def test_single_process_calls_never_handshake(monkeypatch):
    """On, without an initialised default group of several ranks, a call runs as it would off."""
    monkeypatch.setenv(debug.ENV, "1")
    monkeypatch.setattr(debug, "_handshake", lambda *a: pytest.fail("handshake without a world"))
    d = _data()
    lp = lossfx.token_logprobs(d["logits"], d["target"])
    torch.testing.assert_close(lp, reference.token_logprobs(d["logits"], d["target"]), **TIGHT)


def test_compiled_call_in_one_process_warns_once_in_one_graph(monkeypatch):
    """On, a traced call runs the hook at trace time only: the warning, one graph (fullgraph), no handshake."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv(debug.ENV, "1")
    monkeypatch.setattr(debug, "_handshake", lambda *a: pytest.fail("a handshake while compiled"))
    d = _data()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, t: lossfx.token_logprobs(x, t), backend=counter, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = compiled(d["logits"], d["target"])
        second = compiled(d["logits"] * 2, d["target"])
    assert sum(COMPILING in str(w.message) for w in caught) == 1 and counter.frame_count == 1
    torch.testing.assert_close(first, reference.token_logprobs(d["logits"], d["target"]), **TIGHT)
    torch.testing.assert_close(second, reference.token_logprobs(d["logits"] * 2, d["target"]), **TIGHT)
