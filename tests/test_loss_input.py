"""Tests of `lossfx.prepare_loss_input` for the LOGIT and LOGPROB branches.

Sections (conventions §9): 0 helpers/cases; 1 reference equivalence (R = 1, 2, 4 rank threads,
chunked and unchunked, float64 1e-10 values and gradients); 3 properties (hypothesis);
6 errors; 7 contracts on `data` and the inputs (never modified, same object returned).
"""

from __future__ import annotations

from collections import UserDict
from types import SimpleNamespace

import harness
import pytest
import strategies
import torch
from harness import run_ranks
from hypothesis import given

import lossfx
from lossfx import LossInputType, TrainingSamplingParams, reference

F64 = torch.float64

# ---------------------------------------------------------------------------------------------
# 0. Helpers and cases
# ---------------------------------------------------------------------------------------------

LOGPROB = SimpleNamespace(input_type=LossInputType.LOGPROB)
LOGIT = SimpleNamespace(input_type=LossInputType.LOGIT)
FUSED = SimpleNamespace(input_type=LossInputType.LOGPROB, use_fused_linear_logprobs=True)

SHAPES = [(1, 1, 4), (2, 2, 4), (3, 7, 8), (2, 13, 36), (1, 33, 1000)]  # (B, S, V); V % 4 == 0
CHUNKS = [None, 1, 2, 5, 100]  # sequence positions per chunk


def make_batch(shape, seed=0, scale=1.0, dtype=F64):
    batch, seq, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen, dtype=F64) * scale).to(dtype)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return logits, input_ids


def _logprob_rank_fn(rank, world, group, logits, input_ids, dout, chunk):
    vl = logits.shape[-1] // world
    shard = logits[..., rank * vl : (rank + 1) * vl].detach().clone().requires_grad_(True)
    data = {"input_ids": input_ids}
    kwargs = {} if group is None else {"vocab_parallel_rank": rank, "vocab_parallel_group": group}
    out, data_back = lossfx.prepare_loss_input(shard, data, LOGPROB, chunk_size=chunk, **kwargs)
    assert data_back is data and set(data) == {"input_ids"}
    assert set(out) == {"next_token_logprobs"}
    logprobs = out["next_token_logprobs"]
    logprobs.backward(dout)
    return logprobs.detach(), shard.grad


def sharded_logprobs(logits, input_ids, world, dout, chunk=None):
    """(next-token log-probs, dlogits concatenated over ranks) from `world` rank threads."""
    results = run_ranks(world, _logprob_rank_fn, logits, input_ids, dout, chunk)
    for rank, (out, _) in enumerate(results[1:], start=1):
        assert torch.equal(out, results[0][0]), f"rank {rank} output differs"
    return results[0][0], torch.cat([grad for _, grad in results], dim=-1)


def reference_logprobs(logits, input_ids, dout):
    x = logits.detach().to(F64).requires_grad_(True)
    out = reference.prepare_loss_input(x, {"input_ids": input_ids}, LOGPROB)["next_token_logprobs"]
    out.backward(dout.to(F64))
    return out.detach(), x.grad


def assert_close(actual, expected, atol, what=""):
    torch.testing.assert_close(actual.to(F64), expected.to(F64), atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


def _dout(batch, seq, seed=3, dtype=F64):
    return torch.randn(batch, max(seq - 1, 0), generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# 1. Reference equivalence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_logprob_matches_reference(world, shape, chunk):
    logits, input_ids = make_batch(shape, seed=world + shape[1])
    dout = _dout(shape[0], shape[1])
    out, grad = sharded_logprobs(logits, input_ids, world, dout, chunk)
    ref, ref_grad = reference_logprobs(logits, input_ids, dout)
    assert out.shape == (shape[0], shape[1] - 1) and out.dtype == F64
    assert_close(out, ref, 1e-10, "values")
    assert_close(grad, ref_grad, 1e-10, "dlogits")
    # the last position scores no token: its gradient is exactly zero
    assert (grad[:, -1] == 0).all()


def test_logprob_matches_next_token_reference_and_function():
    """`prepare_loss_input` == `lossfx.next_token_logprobs` == `reference.next_token_logprobs`."""
    logits, input_ids = make_batch((2, 9, 11), seed=4, scale=5.0)
    out = lossfx.prepare_loss_input(logits, {"input_ids": input_ids}, LOGPROB)[0]["next_token_logprobs"]
    direct = lossfx.next_token_logprobs(logits, input_ids, chunk_size=2)
    ref = reference.next_token_logprobs(logits, input_ids)
    assert_close(out, ref, 1e-10, "prepare_loss_input")
    assert_close(direct, ref, 1e-10, "next_token_logprobs")


@pytest.mark.parametrize("input_type", [LossInputType.LOGPROB, "logprob"])
def test_input_type_accepts_enum_and_string(input_type):
    logits, input_ids = make_batch((2, 4, 6))
    loss_fn = SimpleNamespace(input_type=input_type)
    out, _ = lossfx.prepare_loss_input(logits, {"input_ids": input_ids}, loss_fn)
    assert_close(out["next_token_logprobs"], reference.next_token_logprobs(logits, input_ids), 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_low_precision(dtype):
    """fp32/bf16 logits: fp32 output and logits-dtype gradient, close to the float64 truth.

    Tolerance: both the output and the fp32 gradient before its final rounding are within a few
    fp32 ulps of |z| + log V ≈ 10 (so 1e-5 is generous); the bf16 gradient is one rounding to
    bf16 of that (relative 2^-8, |g| ≤ 1 here, so 8e-3 absolute).
    """
    logits, input_ids = make_batch((2, 6, 40), seed=9, scale=3.0, dtype=dtype)
    dout = _dout(2, 6, dtype=torch.float32)
    out, grad = sharded_logprobs(logits, input_ids, 2, dout, chunk=2)
    ref, ref_grad = reference_logprobs(logits, input_ids, dout)
    assert out.dtype == torch.float32 and grad.dtype == dtype
    assert_close(out, ref, 1e-5, "values")
    gtol = 1e-5 if dtype == torch.float32 else 8e-3 * float(dout.abs().max())
    assert_close(grad, ref_grad, gtol, "dlogits")


def test_logit_is_identity():
    logits, input_ids = make_batch((2, 3, 5))
    data = {"input_ids": input_ids}
    out, data_back = lossfx.prepare_loss_input(logits, data, LOGIT)
    assert out.keys() == {"logits"} and out["logits"] is logits
    assert data_back is data and data.keys() == {"input_ids"}
    assert reference.prepare_loss_input(logits, data, LOGIT)["logits"] is logits


def test_logit_needs_no_input_ids():
    logits = torch.zeros(1, 2, 3)
    out, data = lossfx.prepare_loss_input(logits, {}, SimpleNamespace(input_type="logit"))
    assert out["logits"] is logits and data == {}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_linear_logprobs_pass_through(dtype):
    """With `use_fused_linear_logprobs`, `logits` are already `[B, S']` log-probs: sliced to S-1."""
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(2, 6, generator=gen, dtype=F64).to(dtype).requires_grad_(True)
    input_ids = torch.randint(0, 10, (2, 6), generator=gen)
    data = {"input_ids": input_ids}
    out, data_back = lossfx.prepare_loss_input(fused, data, FUSED)
    ref = reference.prepare_loss_input(fused.detach(), data, FUSED)["next_token_logprobs"]
    got = out["next_token_logprobs"]
    assert data_back is data
    assert got.shape == (2, 5) and got.dtype == torch.promote_types(dtype, torch.float32)
    assert_close(got, ref, 0.0, "pass-through")
    dout = torch.randn(2, 5, generator=gen, dtype=got.dtype)
    got.backward(dout)
    expected = torch.cat([dout, torch.zeros(2, 1, dtype=dout.dtype)], dim=1).to(dtype)
    assert torch.equal(fused.grad, expected)


def test_fused_linear_logprobs_false_is_regular_path():
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB, use_fused_linear_logprobs=False)
    logits, input_ids = make_batch((2, 4, 6))
    out, _ = lossfx.prepare_loss_input(logits, {"input_ids": input_ids}, loss_fn)
    assert_close(out["next_token_logprobs"], reference.next_token_logprobs(logits, input_ids), 1e-10)


@pytest.mark.parametrize("world", [1, 2])
def test_seq_one_gives_empty(world):
    """S = 1: no next-token position, a `[B, 0]` result, and a zero gradient."""
    logits, input_ids = make_batch((3, 1, 4))
    dout = _dout(3, 1)
    out, grad = sharded_logprobs(logits, input_ids, world, dout)
    assert out.shape == (3, 0)
    assert grad.shape == logits.shape and (grad == 0).all()


def test_no_sampling_filter_params_are_regular_path():
    """`TrainingSamplingParams()` with no filter (and temperature, never applied) is plain LOGPROB."""
    logits, input_ids = make_batch((2, 5, 7))
    params = TrainingSamplingParams(top_k=None, top_p=1.0, temperature=0.5)
    out, _ = lossfx.prepare_loss_input(logits, {"input_ids": input_ids}, LOGPROB, sampling_params=params)
    assert_close(out["next_token_logprobs"], reference.next_token_logprobs(logits, input_ids), 1e-10)


def test_group_of_world_one_equals_none():
    def fn(rank, world, group, logits, input_ids):
        return lossfx.prepare_loss_input(
            logits, {"input_ids": input_ids}, LOGPROB, vocab_parallel_rank=0, vocab_parallel_group=group
        )[0]["next_token_logprobs"]

    logits, input_ids = make_batch((2, 5, 7))
    # a real threaded group of size 1 (run_ranks(1, ...) would pass group=None)
    (with_group,) = harness.thread_world(1).run(fn, logits, input_ids)
    without = lossfx.prepare_loss_input(logits, {"input_ids": input_ids}, LOGPROB)[0]["next_token_logprobs"]
    assert torch.equal(with_group, without)


# ---------------------------------------------------------------------------------------------
# 3. Properties
# ---------------------------------------------------------------------------------------------


@given(case=strategies.logits_cases(dtypes=(F64,), chunk_unit="seq"))
@strategies.with_examples(chunk_unit="seq")
def test_logprob_property_matches_reference(case):
    logits, input_ids = case.logits(), case.target()
    dout = _dout(case.batch, case.seq, seed=case.seed)
    out, grad = sharded_logprobs(logits, input_ids, case.world, dout, case.chunk)
    ref, ref_grad = reference_logprobs(logits, input_ids, dout)
    assert not torch.isnan(out).any() and not torch.isnan(grad).any()
    torch.testing.assert_close(out, ref, atol=1e-10 * max(1.0, case.scale), rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-10, rtol=0)


@given(case=strategies.logits_cases(chunk_unit="seq"))
def test_data_and_inputs_never_modified(case):
    logits, input_ids = case.logits(), case.target()
    extra = torch.arange(case.batch * case.seq).view(case.batch, case.seq)
    mappings = (
        {"input_ids": input_ids, "token_mask": extra},
        UserDict(input_ids=input_ids, token_mask=extra),
    )
    for data in mappings:
        before = {k: v.clone() for k, v in data.items()}
        logits_before = logits.clone()
        x = logits.requires_grad_(True)
        out, data_back = lossfx.prepare_loss_input(x, data, LOGPROB, chunk_size=case.chunk)
        out["next_token_logprobs"].sum().backward()
        assert data_back is data
        assert set(data.keys()) == set(before)
        for key, value in before.items():
            assert data[key] is (input_ids if key == "input_ids" else extra)
            assert torch.equal(data[key], value), key
        assert torch.equal(logits.detach(), logits_before)
        logits = logits.detach()


# ---------------------------------------------------------------------------------------------
# 6. Errors
# ---------------------------------------------------------------------------------------------


def _call(logits=None, data=None, loss_fn=LOGPROB, **kwargs):
    if logits is None:
        logits = torch.zeros(2, 3, 4)
    if data is None:
        data = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    return lossfx.prepare_loss_input(logits, data, loss_fn, **kwargs)


def _group_rank_fn(rank, world, group, kwargs):
    logits = torch.zeros(2, 3, 4)
    data = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    try:
        lossfx.prepare_loss_input(logits, data, LOGPROB, vocab_parallel_group=group, **kwargs)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def test_group_without_rank():
    results = run_ranks(2, _group_rank_fn, {})
    for name, msg in results:
        assert name == "ValueError" and "vocab_parallel_rank" in msg


def test_wrong_rank():
    results = run_ranks(2, _group_rank_fn, {"vocab_parallel_rank": 5})
    for name, msg in results:
        assert name == "ValueError" and "vocab_parallel_rank" in msg and "5" in msg


def test_missing_input_ids():
    with pytest.raises(ValueError, match="input_ids"):
        _call(data={"token_mask": torch.ones(2, 3)})


@pytest.mark.parametrize("input_type", ["not_a_type", "LOGPROB_X", 3])
def test_unknown_input_type(input_type):
    with pytest.raises(ValueError, match="input type"):
        _call(loss_fn=SimpleNamespace(input_type=input_type))


@pytest.mark.parametrize("bad", [-1, 4, 1000])
def test_ids_out_of_range(bad):
    ids = torch.zeros(2, 3, dtype=torch.long)
    ids[1, 1] = bad
    data = {"input_ids": ids}
    with pytest.raises(ValueError, match=str(bad)) as info:
        _call(data=data)
    assert "input_ids" in str(info.value) or "target" in str(info.value)
    assert data["input_ids"] is ids and ids[1, 1] == bad and data.keys() == {"input_ids"}


def test_first_position_id_is_never_checked():
    """Position 0 is never a target: any value there is accepted and changes nothing (issue 10 item 12)."""
    ids = torch.tensor([[0, 1, 2], [3, 2, 1]])
    logits = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    expected = _call(logits, data={"input_ids": ids.clone()})
    ids[0, 0] = 99
    got = _call(logits, data={"input_ids": ids})
    assert torch.equal(got[0]["next_token_logprobs"], expected[0]["next_token_logprobs"])


@pytest.mark.parametrize(("chunk", "exc"), [(0, ValueError), (-1, ValueError), (1.5, TypeError)])
def test_bad_chunk_size(chunk, exc):
    with pytest.raises(exc, match="chunk_size"):
        _call(chunk_size=chunk)


@pytest.mark.parametrize(
    ("logits_shape", "ids_shape"),
    [((2, 3, 4), (2, 4)), ((2, 3, 4), (3, 3)), ((6, 4), (2, 3)), ((2, 3, 4), (2, 3, 1))],
)
def test_shape_mismatch(logits_shape, ids_shape):
    with pytest.raises(ValueError, match="shape"):
        _call(logits=torch.zeros(logits_shape), data={"input_ids": torch.zeros(ids_shape, dtype=torch.long)})


def test_non_integer_input_ids():
    with pytest.raises(TypeError, match="input_ids"):
        _call(data={"input_ids": torch.zeros(2, 3)})


@pytest.mark.parametrize(
    "params",
    [
        TrainingSamplingParams(top_k=5),
        TrainingSamplingParams(top_p=0.9),
        TrainingSamplingParams(top_k=2, top_p=0.5),
    ],
)
def test_fused_with_filtering_raises(params):
    data = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="use_fused_linear_logprobs"):
        lossfx.prepare_loss_input(torch.zeros(2, 3), data, FUSED, sampling_params=params)
    assert data.keys() == {"input_ids"}


def test_failed_call_leaves_data_untouched():
    ids = torch.zeros(2, 3, dtype=torch.long)
    ids[0, 2] = 7
    data = {"input_ids": ids}
    with pytest.raises(ValueError):
        _call(data=data)
    assert data.keys() == {"input_ids"} and data["input_ids"] is ids


def test_neg_inf_rule_reads_the_masks_before_any_log_prob(monkeypatch):
    """The `-inf` rule (`lossfx.loss_input._neg_inf_rule`) is one rule for the logits path, the
    packed path and the fused front doors: under a filter, a missing `token_mask` raises before any
    log-prob is computed, and `data` is untouched."""
    import lossfx.linear_loss_input as linear
    import lossfx.loss_input as entry

    computed = []
    for module, name in (
        (entry, "next_token_logprobs_of"),
        (entry._packing, "packed_next_token_logprobs"),
        (linear._next_token, "linear_next_token_logprobs"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, _name=name, **k: computed.append(_name) or _real(*a, **k)
        )
    hidden, weight = torch.randn(1, 4, 3, dtype=F64), torch.randn(6, 3, dtype=F64)
    ids = torch.tensor([[1, 2, 3, 4]])
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB, reference_policy_kl_penalty=1.0)
    sp = TrainingSamplingParams(top_k=2)
    calls = [
        lambda data: lossfx.prepare_loss_input(hidden @ weight.T, data, loss_fn, sampling_params=sp),
        lambda data: lossfx.prepare_packed_loss_input(
            hidden @ weight.T, data, loss_fn, (0, 4), (0, 4), sampling_params=sp
        ),
        lambda data: lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn, sampling_params=sp),
    ]
    for call in calls:
        data = {"input_ids": ids}
        with pytest.raises(ValueError, match="must contain 'token_mask'"):
            call(data)
        assert computed == [] and set(data) == {"input_ids"}
        data["token_mask"] = torch.ones(1, 4)
        call(data)
        assert len(computed) == 2 and "curr_logprobs_unfiltered" in data  # filtered, then unfiltered
        computed.clear()


def test_packed_entry_points_take_logprob_only_by_one_rule():
    """Both packed entry points reject other input types by one rule (`lossfx.loss_input._input_type`
    with `packed=`), each naming itself and its per-sequence twin."""
    hidden, weight = torch.randn(1, 4, 3, dtype=F64), torch.randn(6, 3, dtype=F64)
    data = {"input_ids": torch.tensor([[1, 2, 3, 4]])}
    loss_fn = SimpleNamespace(input_type=LossInputType.DISTILLATION)
    for name, call in (
        ("prepare", lambda: lossfx.prepare_packed_loss_input(hidden @ weight.T, data, loss_fn, (0, 4), (0, 4))),
        (
            "prepare_linear",
            lambda: lossfx.prepare_linear_packed_loss_input(hidden, weight, data, loss_fn, (0, 4), (0, 4)),
        ),
    ):
        want = (
            f"{name}_packed_loss_input only supports LossInputType.LOGPROB, got {LossInputType.DISTILLATION}; "
            f"use {name}_loss_input per sequence for other types"
        )
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == want
