"""The per-device chunk policy (`lossfx.ChunkPolicy`, `lossfx.chunk_policy`) and `chunk_rows=`.

Every logits kernel gives the float64 reference's values and gradients under the CPU policy, a
one-row policy and the GPU policy forced on CPU; the policy decides the chunk count, `chunk_rows=`
wins over it; the kernels' former keyword `chunk_size=` keeps its value with a FutureWarning
(none, and no graph break, under `torch.compile(fullgraph=True)`), while the entry points'
`chunk_size=` (sequence positions) does not warn.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

import lossfx
from lossfx import reference
from lossfx._core import chunking as _chunking
from lossfx._core.chunking import default_chunk_rows, policy_for, row_chunks

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
ONE_ROW = lossfx.ChunkPolicy(row_bytes=1, min_rows=1, tile_bytes=1, max_block=1)
POLICIES = {"cpu": lossfx.CPU_POLICY, "one row": ONE_ROW, "gpu": lossfx.GPU_POLICY}
RENAMED = "chunk_size= of a lossfx kernel is deprecated"


def _data(seed=0, rows=7, vocab=13):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen, dtype=F64) * 3
    return {
        "z": z,
        "teacher": torch.randn(rows, vocab, generator=gen, dtype=F64) * 3,
        "target": torch.randint(0, vocab, (rows,), generator=gen),
        "ids": torch.randint(0, vocab, (rows, 3), generator=gen),
        "top": z.argmax(-1),
        "dout": torch.randn(rows, generator=gen, dtype=F64),
    }


# (name, lossfx call, reference call): each `(z, d, **chunking) -> [N]` (top-k: values only)
KERNELS = {
    "token_logprobs": (
        lambda z, d, **c: lossfx.token_logprobs(z, d["target"], **c),
        lambda z, d: reference.token_logprobs(z, d["target"]),
    ),
    "token_logprobs_with_lse": (
        lambda z, d, **c: lossfx.token_logprobs_with_lse(z, d["target"], **c)[0],
        lambda z, d: reference.token_logprobs(z, d["target"]),
    ),
    "gather_logprobs": (
        lambda z, d, **c: (lambda lp, ne: lp.sum(-1) + ne)(
            *lossfx.gather_logprobs(z, d["ids"], with_neg_entropy=True, **c)
        ),
        lambda z, d: (lambda lp, ne: lp.sum(-1) + ne)(*reference.gather_logprobs(z, d["ids"])),
    ),
    "filtered candidates": (
        lambda z, d, **c: lossfx.filtered_token_logprobs(z, d["top"], top_k=4, top_p=0.8, **c),
        lambda z, d: reference.filtered_token_logprobs(z, d["top"], top_k=4, top_p=0.8),
    ),
    "filtered bisection, sorted ties": (
        lambda z, d, **c: lossfx.filtered_token_logprobs(z, d["top"], top_p=0.7, ties="sorted", **c),
        lambda z, d: reference.filtered_token_logprobs(z, d["top"], top_p=0.7, ties="sorted"),
    ),
    "apply_top_k_top_p": (
        lambda z, d, **c: lossfx.apply_top_k_top_p(z, top_k=5, top_p=0.9, **c)[0].clamp_min(-50).sum(-1),
        lambda z, d: reference.apply_top_k_top_p(z, 5, 0.9)[0].clamp_min(-50).sum(-1),
    ),
    "top_k_top_p_threshold": (
        lambda z, d, **c: lossfx.top_k_top_p_threshold(z.detach(), top_k=5, top_p=0.9, **c),
        lambda z, d: (lambda f, keep: torch.where(keep, z.detach(), torch.inf).amin(-1))(
            *reference.apply_top_k_top_p(z.detach(), 5, 0.9)
        ),
    ),
    "neg_entropy": (lambda z, d, **c: lossfx.neg_entropy(z, **c), lambda z, d: reference.neg_entropy(z)),
    "cross_entropy_to_fixed": (
        lambda z, d, **c: lossfx.cross_entropy_to_fixed(z, d["teacher"], **c),
        lambda z, d: reference.cross_entropy_to_fixed(z, d["teacher"]),
    ),
    "reverse_kl_to_fixed": (
        lambda z, d, **c: lossfx.reverse_kl_to_fixed(z, d["teacher"], **c),
        lambda z, d: reference.reverse_kl_to_fixed(z, d["teacher"]),
    ),
}


def _value_and_grad(fn, d):
    z = d["z"].clone().requires_grad_()
    out = fn(z, d)
    grad = torch.autograd.grad(out, z, d["dout"])[0] if out.requires_grad else None
    return out.detach(), grad


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_matches_the_reference_under_every_policy(kernel, policy):
    fn, ref = KERNELS[kernel]
    d = _data(seed=len(kernel))
    want = _value_and_grad(ref, d)
    with warnings.catch_warnings(), lossfx.chunk_policy(POLICIES[policy]):
        warnings.simplefilter("error")  # no deprecation on the new names
        got = _value_and_grad(fn, d)
    torch.testing.assert_close(got[0], want[0], **TIGHT)
    if want[1] is not None:
        torch.testing.assert_close(got[1], want[1], **TIGHT)


def test_the_policy_follows_the_device_and_a_forced_one_wins_until_the_block_ends():
    assert policy_for(torch.device("cpu")) is lossfx.CPU_POLICY
    assert policy_for(torch.device("meta")) is lossfx.GPU_POLICY  # any device that is not a CPU
    with lossfx.chunk_policy(ONE_ROW) as forced:
        assert forced is ONE_ROW and policy_for(torch.device("cpu")) is ONE_ROW
        with lossfx.chunk_policy(lossfx.GPU_POLICY):
            assert policy_for(torch.device("cpu")) is lossfx.GPU_POLICY
        assert policy_for(torch.device("cpu")) is ONE_ROW
    assert policy_for(torch.device("cpu")) is lossfx.CPU_POLICY
    with pytest.raises(RuntimeError), lossfx.chunk_policy(ONE_ROW):
        raise RuntimeError("restored on an exception too")
    assert policy_for(torch.device("cpu")) is lossfx.CPU_POLICY


@pytest.mark.parametrize(("vocab", "dtype"), [(151936, torch.float32), (32000, F64), (7, torch.float32)])
def test_rows_per_chunk_are_the_budget_over_one_row_at_least_min_rows(vocab, dtype):
    itemsize = torch.empty((), dtype=dtype).element_size()
    for policy in (lossfx.CPU_POLICY, lossfx.GPU_POLICY):
        with lossfx.chunk_policy(policy):
            rows = default_chunk_rows(vocab, dtype)
        assert rows == max(policy.min_rows, policy.row_bytes // (vocab * itemsize))
        assert rows >= policy.min_rows
        # one [C, V] temporary stays within the budget unless min_rows forces more
        assert rows * vocab * itemsize <= policy.row_bytes or rows == policy.min_rows


def test_the_gpu_policy_runs_few_chunks_at_the_issue_shape():
    rows = default_chunk_rows(151936, torch.float32, torch.device("meta"))
    assert len(row_chunks(16384, None, 151936, torch.float32, torch.device("meta"))) == -(-16384 // rows) <= 8


def test_chunk_rows_wins_over_the_policy():
    with lossfx.chunk_policy(ONE_ROW):
        assert len(row_chunks(10, None, 13, F64)) == 10
        assert row_chunks(10, 4, 13, F64) == [(0, 4), (4, 8), (8, 10)]
        d = _data()
        z = d["z"].clone().requires_grad_()
        calls = []
        real = _chunking.row_chunks

        def spy(n_rows, chunk_rows, *args):
            calls.append(len(real(n_rows, chunk_rows, *args)))
            return real(n_rows, chunk_rows, *args)

        for module in (lossfx._kernels.logprobs, lossfx._kernels.divergence):
            module.row_chunks, saved = spy, module.row_chunks
            try:
                lossfx.token_logprobs(z, d["target"], chunk_rows=7).sum().backward()
                lossfx.reverse_kl_to_fixed(z, d["teacher"]).sum().backward()
            finally:
                module.row_chunks = saved
    assert calls == [1, 1, 7, 7]  # token: fwd + bwd in one chunk; reverse KL: the policy's 7 chunks


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(lossfx.ChunkPolicy) if f.name != "compile_tiles"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_policy_field_that_is_not_a_positive_int_is_a_value_error_naming_it(field, bad):
    values = dataclasses.asdict(lossfx.CPU_POLICY) | {field: bad}
    with pytest.raises(ValueError, match=f"ChunkPolicy.{field} must be an int >= 1, got {bad!r}"):
        lossfx.ChunkPolicy(**values)


@pytest.mark.parametrize("bad", [0, 1, "yes", None])
def test_compile_tiles_must_be_a_bool(bad):
    values = dataclasses.asdict(lossfx.CPU_POLICY) | {"compile_tiles": bad}
    with pytest.raises(ValueError, match=f"ChunkPolicy.compile_tiles must be a bool, got {bad!r}"):
        lossfx.ChunkPolicy(**values)


def test_chunk_policy_takes_a_policy_only():
    with pytest.raises(TypeError, match=r"policy must be a lossfx\.ChunkPolicy, got int"):
        with lossfx.chunk_policy(1 << 20):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernels_former_keyword_keeps_its_value_and_warns(kernel):
    fn, _ = KERNELS[kernel]
    d = _data(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = fn(d["z"], d, chunk_rows=2)
    with pytest.warns(FutureWarning, match=f"{RENAMED}.*chunk_rows="):
        old = fn(d["z"], d, chunk_size=2)
    assert torch.equal(new, old)
    with pytest.raises(TypeError, match="pass chunk_rows only; chunk_size is its deprecated name"):
        fn(d["z"], d, chunk_rows=2, chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        fn(d["z"], d, chunk_size=0)
    with pytest.raises(TypeError, match=r"chunk_size must be a positive int or None, got 2\.0"):
        fn(d["z"], d, chunk_size=2.0)
    with pytest.raises(ValueError, match="chunk_rows must be positive, got 0"):
        fn(d["z"], d, chunk_rows=0)


def test_lossfx_entropy_takes_chunk_rows_too():
    d = _data(seed=4)
    with pytest.warns(FutureWarning, match="lossfx.entropy is deprecated"):
        old = lossfx.entropy(d["z"], chunk_rows=3)
    assert torch.equal(old, lossfx.neg_entropy(d["z"], chunk_rows=3))


def test_entry_points_keep_chunk_size_in_positions_without_a_warning():
    d = _data(seed=5)
    logits = d["z"][None]  # [1, S, V]
    data = {"input_ids": d["target"][None]}
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = lossfx.prepare_loss_input(logits, data, loss_fn, chunk_size=2)
        lp = lossfx.next_token_logprobs(logits, data["input_ids"], chunk_size=3)
    want = reference.next_token_logprobs(logits, data["input_ids"])
    torch.testing.assert_close(out["next_token_logprobs"], want, **TIGHT)
    torch.testing.assert_close(lp, want, **TIGHT)


@pytest.mark.compile
def test_the_former_keyword_compiles_without_a_warning_or_graph_break():
    d = _data(seed=6)

    def step(z, teacher):
        return lossfx.reverse_kl_to_fixed(z, teacher, chunk_size=2) + lossfx.neg_entropy(z, chunk_rows=2)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        got = compiled(d["z"], d["teacher"])
    want = reference.reverse_kl_to_fixed(d["z"], d["teacher"]) + reference.neg_entropy(d["z"])
    torch.testing.assert_close(got, want, **TIGHT)
