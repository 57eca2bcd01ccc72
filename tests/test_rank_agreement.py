"""Ranks that disagree on what the cross-rank check did not see before (issue 15 items 1-4, 6):
the values of replicated inputs (fingerprints), `requires_grad` and grad mode (they decide the
backward's collectives), `Shard(0)` DTensor LM heads (checked like plain shards) and FSDP2-style
heads (a `Shard(0)` DTensor over ranks holding different hidden states: an error with a remedy).

Every case runs on a real 2-process gloo pool (a hang fails after 60 s): each rank returns the
message of its ValueError (all ranks must raise the same one), then makes one consistent call on
the same group, which must match the float64 reference (the group is still in step).
"""

import os
from types import SimpleNamespace

import harness
import pytest
import torch
from harness import gloo_pool

import lossfx
from lossfx import reference
from lossfx._consistency import fingerprint

pytestmark = pytest.mark.distributed

F64 = torch.float64
LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
N, H, V = 6, 4, 12  # fused cases: V split 6 + 6


@pytest.fixture(autouse=True)
def _short_pool_timeout(monkeypatch):
    monkeypatch.setattr(harness, "_TIMEOUT_S", 60.0)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _fused(seed, n=N):
    gen = _gen(seed)
    return (
        torch.randn(n, H, generator=gen, dtype=F64),
        torch.randn(V, H, generator=gen, dtype=F64),
        torch.randint(0, V, (n,), generator=gen),
    )


def _bump(x, rank, index=(0,)):
    """`x` on rank 0; on rank 1 a copy with one element changed."""
    if rank == 0:
        return x
    y = x.clone()
    y[index] = y[index] + 1 if not y.is_floating_point() else y[index] * 1.5 + 0.25
    return y


_MESH: dict = {}


def _head(weight, rank):
    """`weight [V, H]` as a `Shard(0)` DTensor over the 2-rank mesh (a ColwiseParallel head, or
    FSDP2's data-parallel sharding: the same placement)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if "mesh" not in _MESH:
        _MESH["mesh"] = init_device_mesh("cpu", (2,))
    return distribute_tensor(weight, _MESH["mesh"], [Shard(0)], src_data_rank=None)


def _call(case, rank, group):
    """This rank's side of a disagreement."""
    hidden, weight, target = _fused(0)
    rows = weight[rank * 6 : (rank + 1) * 6]
    z = torch.randn(2, 5, V, generator=_gen(1), dtype=F64)[..., rank * 6 : (rank + 1) * 6]
    ids = torch.randint(0, V, (2, 5), generator=_gen(2))
    # item 1: replicated values
    if case == "targets_2d":
        return lossfx.token_logprobs(z, _bump(ids, rank, (1, 3)), group=group)
    if case == "input_ids":
        data = {"input_ids": _bump(ids, rank, (0, 2))}
        return lossfx.prepare_loss_input(z, data, LOGPROB, rank, group)
    if case == "token_mask":
        data = {"input_ids": ids, "token_mask": _bump(torch.ones(2, 5), rank, (1, 1))}
        sp = lossfx.TrainingSamplingParams(top_k=3)
        return lossfx.prepare_loss_input(z, data, LOGPROB, rank, group, sampling_params=sp)
    if case == "teacher_payload":
        topk = torch.randint(0, V, (2, 5, 3), generator=_gen(3))
        data = {
            "teacher_topk_logits": _bump(torch.randn(2, 5, 3, generator=_gen(4), dtype=F64), rank, (1, 4, 2)),
            "teacher_topk_indices": topk,
        }
        loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=False, kl_type="forward")
        return lossfx.prepare_loss_input(z, data, loss_fn, rank, group)
    if case == "hidden_replicated":
        return lossfx.linear_token_logprobs(_bump(hidden, rank, (3, 1)), rows, target, group=group)
    if case == "fused_target":
        return lossfx.linear_token_logprobs(hidden, rows, _bump(target, rank, (5,)), group=group)
    if case == "coefficients":
        coefficients = _bump(torch.ones(N, dtype=F64), rank, (2,))
        return lossfx.linear_logprob_objective(hidden, rows, target, coefficients, group=group)
    if case == "rows_swapped":  # a permutation of the batch: same multiset of values
        h = hidden if rank == 0 else hidden[[1, 0, 2, 3, 4, 5]]
        return lossfx.linear_token_logprobs(h, rows, target, group=group)
    # item 4: flags that decide a collective
    if case == "hidden_requires_grad":
        h = hidden.clone().requires_grad_(rank == 0)
        return lossfx.linear_token_logprobs(h, rows.clone().requires_grad_(), target, group=group)
    if case == "objective_requires_grad":  # the objective forms its gradients in the forward
        h = hidden.clone().requires_grad_(rank == 0)
        return lossfx.linear_logprob_objective(h, rows, target, torch.ones(N, dtype=F64), group=group)
    if case == "grad_mode":
        with torch.set_grad_enabled(rank == 0):
            h = hidden.clone().requires_grad_()
            return lossfx.linear_token_logprobs(h, rows, target, group=group)
    # item 3: a Shard(0) DTensor weight is checked
    head = _head(weight, rank)
    temperature = 1.0 if rank == 0 else 0.7
    n = 4 if rank == 0 else 5
    if case == "dtensor_token_temperature":
        return lossfx.linear_token_logprobs(hidden, head, target, temperature=temperature)
    if case == "dtensor_gather_temperature":
        return lossfx.linear_gather_logprobs(hidden, head, target[:, None], temperature=temperature)
    if case == "dtensor_next_token_temperature":
        return lossfx.linear_next_token_logprobs(hidden[None], head, target[None], temperature=temperature)
    if case == "dtensor_objective_temperature":
        return lossfx.linear_logprob_objective(hidden, head, target, torch.ones(N, dtype=F64), temperature=temperature)
    if case == "dtensor_token_rows":
        return lossfx.linear_token_logprobs(hidden[:n], head, target[:n])
    if case == "dtensor_objective_rows":
        return lossfx.linear_logprob_objective(hidden[:n], head, target[:n], torch.ones(n, dtype=F64))
    # item 2: FSDP2 leaves the head Shard(0) over the data-parallel mesh; each rank its own batch
    if case == "fsdp2_head":
        h, _, t = _fused(10 + rank)
        return lossfx.linear_token_logprobs(h, head, t)
    if case == "fsdp2_head_objective":
        h, _, t = _fused(10 + rank)
        return lossfx.linear_logprob_objective(h, head, t, torch.full((N,), 1.0 / N, dtype=F64))
    raise AssertionError(case)


def _error_then_ok(rank, world, group, case):
    try:
        _call(case, rank, group)
        message = None
    except ValueError as err:
        message = str(err)
    hidden, weight, target = _fused(5)
    rows = weight[rank * 6 : (rank + 1) * 6].clone().requires_grad_()
    after = lossfx.linear_token_logprobs(hidden, rows, target, group=group)
    after.sum().backward()
    return message, after.detach(), rows.grad


VALUES = "the values of {} (which must be the same on every rank) (rank 0: fingerprint "
FSDP = ["if it is FSDP2's data-parallel sharding", "weight.full_tensor()", "pass the tensor-parallel shard"]
EXPECTED = {
    "targets_2d": [VALUES.format("target")],
    "input_ids": [VALUES.format("data['input_ids']")],
    "token_mask": [VALUES.format("data['token_mask']")],
    "teacher_payload": [VALUES.format("data['teacher_topk_logits']")],
    "hidden_replicated": [VALUES.format("hidden")],
    "fused_target": [VALUES.format("target")],
    "coefficients": [VALUES.format("logprob_weight")],
    "rows_swapped": [VALUES.format("hidden")],
    "hidden_requires_grad": ["hidden.requires_grad (rank 0: True, rank 1: False)"],
    "objective_requires_grad": ["hidden.requires_grad (rank 0: True, rank 1: False)"],
    "grad_mode": ["torch.is_grad_enabled() (rank 0: True, rank 1: False)"],
    "dtensor_token_temperature": ["temperature (rank 0: 1.0, rank 1: 0.7)"],
    "dtensor_gather_temperature": ["temperature (rank 0: 1.0, rank 1: 0.7)"],
    "dtensor_next_token_temperature": ["temperature (rank 0: 1.0, rank 1: 0.7)"],
    "dtensor_objective_temperature": ["temperature (rank 0: 1.0, rank 1: 0.7)"],
    "dtensor_token_rows": ["hidden.shape[0] (rank 0: 4, rank 1: 5)", *FSDP],  # as FSDP2 with uneven batches
    "dtensor_objective_rows": ["hidden.shape[0] (rank 0: 4, rank 1: 5)", *FSDP],
    "fsdp2_head": [VALUES.format("hidden"), *FSDP],
    "fsdp2_head_objective": [VALUES.format("hidden"), *FSDP],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_disagreement_raises_on_every_rank(case):
    results = gloo_pool(2).run(_error_then_ok, case)
    messages = [m for m, _, _ in results]
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        for part in EXPECTED[case]:
            assert part in message, (rank, message)
    assert messages[0] == messages[1], "every rank raises the same error"
    if not any("full_tensor" in part for part in EXPECTED[case]):
        assert "FSDP2" not in messages[0]  # the remedy is named only for a DTensor head and differing hidden
    hidden, weight, target = _fused(5)
    weight = weight.clone().requires_grad_()
    ref = reference.linear_token_logprobs(hidden, weight, target)[0]
    ref.sum().backward()
    for _, after, _ in results:
        torch.testing.assert_close(after, ref.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.cat([g for _, _, g in results]), weight.grad, rtol=0, atol=1e-10)


def _agreeing_flags(rank, world, group):
    """Every rank with the same flags and values: exact values and gradients (no false alarm)."""
    hidden, weight, target = _fused(7)
    h = hidden.clone().requires_grad_()
    head = _head(weight, rank).requires_grad_()
    out = lossfx.linear_token_logprobs(h, head, target, temperature=0.7)
    out.sum().backward()
    return out.detach(), h.grad, head.grad.full_tensor()


def test_agreeing_dtensor_head_is_exact():
    hidden, weight, target = _fused(7)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference.linear_token_logprobs(h, w, target, 0.7)[0]
    ref.sum().backward()
    for out, dh, dw in gloo_pool(2).run(_agreeing_flags):
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(dh, h.grad, rtol=0, atol=1e-10)
        torch.testing.assert_close(dw, w.grad, rtol=0, atol=1e-10)


def _env_off_on_one_rank(rank, world, group):
    """The old switch's environment variable on one rank: the check still runs on both."""
    if rank == 0:
        os.environ["LOSSFX_CONSISTENCY_CHECKS"] = "0"
    try:
        return _error_then_ok(rank, world, group, "targets_2d")[0]
    finally:
        os.environ.pop("LOSSFX_CONSISTENCY_CHECKS", None)


def test_no_switch():
    """Item 6: there is no way to turn the check off on one rank only (no switch at all)."""
    assert not hasattr(lossfx, "set_consistency_checks")
    assert not hasattr(lossfx, "consistency_checks_enabled")
    messages = gloo_pool(2).run(_env_off_on_one_rank)
    assert messages[0] == messages[1] and VALUES.format("target") in messages[0]


# ---------------------------------------------------------------------------------------------
# The fingerprint itself
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [F64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
)
def test_fingerprint_changes_with_any_one_element(dtype):
    x = torch.randn(3, 5, 7, generator=_gen(0), dtype=F64) * 4
    x = x.gt(0) if dtype == torch.bool else x.to(dtype)
    base = fingerprint(x)
    assert base.dtype == torch.int64 and base.dim() == 0
    assert torch.equal(fingerprint(x.clone()), base)  # deterministic, by value
    for i in range(x.numel()):  # every single-element change is seen
        y = x.clone()
        flat = y.view(-1)
        flat[i] = ~flat[i] if dtype == torch.bool else flat[i] + 1
        assert not torch.equal(fingerprint(y), base), i
    assert not torch.equal(fingerprint(x.flip(0)), base)  # moved rows
    assert not torch.equal(fingerprint(x.transpose(1, 2).contiguous().transpose(1, 2)), fingerprint(x.flip(2)))
    assert torch.equal(fingerprint(x.transpose(1, 2).contiguous().transpose(1, 2)), base)  # layout-free


def test_fingerprint_does_not_mutate_and_skips_empty():
    x = torch.randn(4, 3, dtype=torch.float32)
    before = x.clone()
    fingerprint(x.t())  # non-contiguous
    assert torch.equal(x, before)
    assert fingerprint(torch.tensor(2.5)).dim() == 0
