"""Ranks that disagree get the same clear ValueError on every rank: never a hang, an abort or a
silently wrong answer (issue 10 items 4-6, issue 15 items 1-4 and 6, `lossfx/_boundary/consistency.py`).

One table (`EXPECTED`) of disagreements, each on a real 2-process gloo pool (a hang fails after
60 s): shapes, dtypes, vocabulary layouts (uneven, overlapping, weight rows against the declared
`V`), sampling parameters and scalar arguments, the function called; the values of replicated
inputs (fingerprints: ids, masks, a teacher payload, hidden states, permuted rows), `requires_grad`
and grad mode (they decide the backward's collectives), `Shard(0)` DTensor LM heads (checked like
plain shards) and FSDP2-style heads (a `Shard(0)` DTensor over ranks holding different hidden
states: an error with a remedy). Each rank returns the message of its ValueError (all ranks must
raise the same one, within seconds), then makes one consistent call on the same group (uneven
6 + 5 head rows, with a backward): it matches the float64 reference, so the group is still in step
and the pool is never restarted. The CP, TP x CP and rank-thread cases follow.
"""

import ast
import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace

import harness
import pytest
import torch
from harness import assert_every_rank_raises, gloo_pool, mesh_groups, thread_world, value_error

import lossfx
from benchmarks.bench_syncs import count_host_reads
from lossfx import reference
from lossfx._boundary import consistency as _consistency
from lossfx.context_parallel import shard_for_cp_rank
from lossfx.next_token import LoadBalancedSharder

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("short_pool_timeout")]

F64 = torch.float64
H = 4  # the fused cases' hidden size
LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
DISTILLATION = SimpleNamespace(input_type="distillation", zero_outside_topk=False, kl_type="forward")
SECONDS = 20.0  # "within seconds": the slowest mismatch case must answer well inside this


def _logits(b, s, v, seed, dtype=F64):
    return torch.randn(b, s, v, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype) * 2


def _ids(b, s, high, seed):
    return torch.randint(0, high, (b, s), generator=torch.Generator().manual_seed(seed + 1))


def _fused(n, vocab, seed):
    """`(hidden [n, H], weight [vocab, H], target [n])` of a fused LM-head call."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen, dtype=F64)
    weight = torch.randn(vocab, H, generator=gen, dtype=F64)
    return hidden, weight, torch.randint(0, vocab, (n,), generator=gen)


def _bump(x, rank, index=(0,)):
    """`x` on rank 0; on rank 1 a copy with one element changed."""
    if rank == 0:
        return x
    y = x.clone()
    y[index] = y[index] + 1 if not y.is_floating_point() else y[index] * 1.5 + 0.25
    return y


_MESH: dict = {}


def _head(weight):
    """`weight [V, H]` as a `Shard(0)` DTensor over the 2-rank mesh (a ColwiseParallel head, or
    FSDP2's data-parallel sharding: the same placement)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if "mesh" not in _MESH:
        _MESH["mesh"] = init_device_mesh("cpu", (2,))
    return distribute_tensor(weight, _MESH["mesh"], [Shard(0)], src_data_rank=None)


def _call(case, rank, group):
    """This rank's side of a disagreement: the same entry point, per-rank arguments. Logits: V = 16
    split 8 + 8 unless stated; the fused LM head: V = 12 split 6 + 6 unless stated."""
    tp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group}
    z, ids = _logits(2, 6, 16, 0)[..., rank * 8 : (rank + 1) * 8], _ids(2, 6, 16, 0)
    hidden, weight, target = _fused(6, 12, 0)
    rows, uneven = weight[rank * 6 : (rank + 1) * 6], weight[:6] if rank == 0 else weight[6:11]  # 6 + 6, 6 + 5
    ones, top_k_3 = torch.ones(6, dtype=F64), lossfx.TrainingSamplingParams(top_k=3)
    teacher = {"teacher_topk_logits": _logits(2, 6, 3, 1), "teacher_topk_indices": _ids(2, 18, 16, 2).view(2, 6, 3)}
    token, objective = lossfx.linear_token_logprobs, lossfx.linear_logprob_objective
    temperature, n, low = (1.0, 4, torch.float32) if rank == 0 else (0.7, 5, F64)

    def wide(start1, **kw):  # V = 64: rank 0 holds [0, 34), rank 1 [start1, start1 + 30)
        span = _logits(2, 6, 64, 0)[..., start1 * rank : start1 * rank + 34 - 4 * rank]
        return lossfx.token_logprobs(span, _ids(2, 6, 60, 0), group=group, **kw)

    def prepare(data=None, loss_fn=LOGPROB, logits=z, **kw):
        return lossfx.prepare_loss_input(logits, {"input_ids": ids} if data is None else data, loss_fn, **tp, **kw)

    def grad_mode():
        with torch.set_grad_enabled(rank == 0):
            return token(hidden.clone().requires_grad_(), rows, target, group=group)

    def fsdp2(fn, *args):  # FSDP2 leaves the head Shard(0) over the data-parallel mesh; each rank its own batch
        h, _, t = _fused(6, 12, 10 + rank)
        return fn(h, _head(weight), t, *args)

    def cp(**groups):  # the group as a context-parallel group (V = 6 whole on each rank): top_k 2 against 3
        local = shard_for_cp_rank(_logits(2, 8, 6, 3), rank, 2, seq_dim=1)
        sp = lossfx.TrainingSamplingParams(top_k=2 if rank == 0 else 3)
        return lossfx.prepare_loss_input(local, {"input_ids": _ids(2, 8, 6, 3)}, LOGPROB, sampling_params=sp, **groups)

    def env_off_on_rank_0():  # the old switch's environment variable on one rank: the check still runs on both
        with pytest.MonkeyPatch.context() as mp:
            if rank == 0:
                mp.setenv("LOSSFX_CONSISTENCY_CHECKS", "0")
            return lossfx.token_logprobs(z, _bump(ids, rank, (1, 3)), group=group)

    calls = {
        # shapes, dtypes, layouts, settings, the function called (logits)
        "widths": lambda: wide(34),  # widths 34 / 30 with the kernels' uniform default layout
        "overlap": lambda: wide(30, vocab_start=30 * rank, vocab_size=64),  # explicit but overlapping
        "widths_distillation": lambda: prepare(  # equal shards needed: the top-k distillation path
            teacher, DISTILLATION, _logits(2, 6, 64, 0)[..., 34 * rank : 34 + 30 * rank]
        ),
        "topk_wider_than_uneven_shards": lambda: lossfx.vocab_topk(  # widths 3 / 7: k = 7 > world · 3
            _logits(2, 6, 10, 0)[..., 3 * rank : 3 + 7 * rank], 7, group=group, vocab_start=3 * rank
        ),
        "sampling": lambda: prepare(sampling_params=top_k_3 if rank == 0 else None),
        "top_k": lambda: prepare(sampling_params=lossfx.TrainingSamplingParams(top_k=5 + 2 * rank)),
        "top_p": lambda: prepare(sampling_params=lossfx.TrainingSamplingParams(top_p=0.9 if rank == 0 else 0.8)),
        "batch": lambda: prepare({"input_ids": ids[: 2 - rank]}, logits=z[: 2 - rank]),
        "seq": lambda: prepare({"input_ids": ids[:, : 6 - rank]}, logits=z[:, : 6 - rank]),
        "dtype": lambda: prepare(logits=z.to(low)),
        "kernel": lambda: (lossfx.filtered_token_logprobs if rank == 0 else lossfx.token_logprobs)(
            z[:, :-1], ids[:, 1:], group=group, **({"top_k": 3} if rank == 0 else {})
        ),
        "cp_group": lambda: cp(context_parallel_group=group),
        "cp_sharder": lambda: cp(cp_sharder=LoadBalancedSharder(group)),
        # the values of replicated inputs
        "targets_2d": lambda: lossfx.token_logprobs(z, _bump(ids, rank, (1, 3)), group=group),
        "check_env_off_on_one_rank": env_off_on_rank_0,
        "input_ids": lambda: prepare({"input_ids": _bump(ids, rank, (0, 2))}),
        "token_mask": lambda: prepare(
            {"input_ids": ids, "token_mask": _bump(torch.ones(2, 6), rank, (1, 1))}, sampling_params=top_k_3
        ),
        "teacher_payload": lambda: prepare(
            {**teacher, "teacher_topk_logits": _bump(teacher["teacher_topk_logits"], rank, (1, 4, 2))}, DISTILLATION
        ),
        "hidden_replicated": lambda: token(_bump(hidden, rank, (3, 1)), rows, target, group=group),
        "fused_target": lambda: token(hidden, rows, _bump(target, rank, (5,)), group=group),
        "coefficients": lambda: objective(hidden, rows, target, _bump(ones, rank, (2,)), group=group),
        "rows_swapped": lambda: token(  # a permutation of the batch: same multiset of values
            hidden if rank == 0 else hidden[[1, 0, 2, 3, 4, 5]], rows, target, group=group
        ),
        # flags that decide a collective
        "hidden_requires_grad": lambda: token(
            hidden.clone().requires_grad_(rank == 0), rows.clone().requires_grad_(), target, group=group
        ),
        "objective_requires_grad": lambda: objective(  # the objective forms its gradients in the forward
            hidden.clone().requires_grad_(rank == 0), rows, target, ones, group=group
        ),
        "grad_mode": grad_mode,
        # the fused LM head: shapes, dtypes, weight rows against the declared vocabulary, settings
        "hidden_shape": lambda: token(hidden[: 6 - rank], rows, target[: 6 - rank], group=group),
        "fused_dtype": lambda: token(hidden.to(low), rows.to(low), target, group=group),
        "weight_rows_vs_vocab_size": lambda: token(  # rows 6 + 5 declared as V = 12
            hidden, uneven, target % 11, group=group, vocab_start=6 * rank, vocab_size=12
        ),
        "weight_rows_default_layout": lambda: token(hidden, uneven, target % 11, group=group),  # 6 + 5, undeclared
        "gather_convention": lambda: lossfx.linear_gather_logprobs(
            hidden, rows, torch.stack([target, (target + 1) % 12], -1), zero_outside_topk=rank == 0, group=group
        ),
        "next_token_temperature": lambda: lossfx.linear_next_token_logprobs(
            hidden[None], rows, target[None], group=group, temperature=1.0 + rank
        ),
        "objective_chunk_size": lambda: objective(  # the objective's loop runs one collective per chunk
            hidden, rows, target, ones, group=group, chunk_size=2 + rank
        ),
        # a Shard(0) DTensor weight is checked
        "dtensor_token_temperature": lambda: token(hidden, _head(weight), target, temperature=temperature),
        "dtensor_gather_temperature": lambda: lossfx.linear_gather_logprobs(
            hidden, _head(weight), target[:, None], temperature=temperature
        ),
        "dtensor_next_token_temperature": lambda: lossfx.linear_next_token_logprobs(
            hidden[None], _head(weight), target[None], temperature=temperature
        ),
        "dtensor_objective_temperature": lambda: objective(
            hidden, _head(weight), target, ones, temperature=temperature
        ),
        "dtensor_token_rows": lambda: token(hidden[:n], _head(weight), target[:n]),  # as FSDP2 with uneven batches
        "dtensor_objective_rows": lambda: objective(hidden[:n], _head(weight), target[:n], ones[:n]),
        "fsdp2_head": lambda: fsdp2(token),
        "fsdp2_head_objective": lambda: fsdp2(objective, torch.full((6,), 1.0 / 6, dtype=F64)),
    }
    return calls[case]()


def _error_then_ok(rank, world, group, case):
    """`(message or None, seconds, a consistent call's values and weight gradient)` on this rank."""
    message, seconds = value_error(lambda: _call(case, rank, group))
    hidden, weight, target = _fused(3, 11, 1)
    rows = (weight[:6] if rank == 0 else weight[6:]).clone().requires_grad_()  # uneven 6 + 5, declared
    after = lossfx.linear_token_logprobs(hidden, rows, target, group=group, vocab_start=6 * rank, vocab_size=11)
    after.sum().backward()
    return message, seconds, after.detach(), rows.grad


VALUES = "the values of {} (which must be the same on every rank) (rank 0: fingerprint "
FSDP = ["if it is FSDP2's data-parallel sharding", "weight.full_tensor()", "pass the tensor-parallel shard"]
TEMPERATURE = ["temperature (rank 0: 1.0, rank 1: 0.7)"]
EXPECTED = {
    "widths": ["vocabulary size V (rank 0: 68, rank 1: 60", "widths rank 0: 34, rank 1: 30", "pass vocab_size"],
    "overlap": ["rank 0: [0, 34), rank 1: [30, 60)", "do not tile [0, 64)"],
    "widths_distillation": ["vocabulary shard width", "rank 0: 34, rank 1: 30", "equal shards"],
    "topk_wider_than_uneven_shards": [
        "rank 0: 3, rank 1: 7",
        "this function needs k=7 <= world_size · the smallest width (6)",
    ],
    "sampling": ["sampling_params (rank 0: a TrainingSamplingParams, rank 1: None)"],
    "top_k": ["sampling_params.top_k (rank 0: 5, rank 1: 7)"],
    "top_p": ["sampling_params.top_p (rank 0: 0.9, rank 1: 0.8)"],
    "batch": ["logits.shape[0] (rank 0: 2, rank 1: 1)"],
    "seq": ["logits.shape[1] (rank 0: 6, rank 1: 5)"],
    "dtype": ["logits.dtype (rank 0: torch.float32, rank 1: torch.float64)"],
    "kernel": ["the function called (rank 0: lossfx.filtered_token_logprobs, rank 1: lossfx.token_logprobs)"],
    "cp_group": ["context_parallel_group disagree on sampling_params.top_k (rank 0: 2, rank 1: 3)"],
    "cp_sharder": ["cp_sharder.cp_group disagree on sampling_params.top_k (rank 0: 2, rank 1: 3)"],
    "targets_2d": [VALUES.format("target")],
    "check_env_off_on_one_rank": [VALUES.format("target")],
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
    "hidden_shape": ["hidden.shape[0] (rank 0: 6, rank 1: 5)"],
    "fused_dtype": ["hidden.dtype (rank 0: torch.float32, rank 1: torch.float64)"],
    "weight_rows_vs_vocab_size": ["rank 0: [0, 6), rank 1: [6, 11)", "do not tile [0, 12)"],
    "weight_rows_default_layout": ["vocabulary size V (rank 0: 12, rank 1: 10"],
    "gather_convention": ["zero_outside_topk (rank 0: True, rank 1: False)"],
    "next_token_temperature": ["temperature (rank 0: 1.0, rank 1: 2.0)"],
    "objective_chunk_size": ["chunk_size (rank 0: 2, rank 1: 3)"],
    "dtensor_token_temperature": TEMPERATURE,
    "dtensor_gather_temperature": TEMPERATURE,
    "dtensor_next_token_temperature": TEMPERATURE,
    "dtensor_objective_temperature": TEMPERATURE,
    "dtensor_token_rows": ["hidden.shape[0] (rank 0: 4, rank 1: 5)", *FSDP],
    "dtensor_objective_rows": ["hidden.shape[0] (rank 0: 4, rank 1: 5)", *FSDP],
    "fsdp2_head": [VALUES.format("hidden"), *FSDP],
    "fsdp2_head_objective": [VALUES.format("hidden"), *FSDP],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_gloo_mismatch_raises_on_every_rank(case):
    results = gloo_pool(2).run(_error_then_ok, case)
    messages = [m for m, *_ in results]
    assert_every_rank_raises(messages, EXPECTED[case])
    if FSDP[0] not in EXPECTED[case]:
        assert "FSDP2" not in messages[0]  # the remedy is named only for a DTensor head and differing hidden
    assert max(s for _, s, _, _ in results) < SECONDS
    harness.assert_fused_call_exact([a for _, _, a, _ in results], [g for *_, g in results], *_fused(3, 11, 1))


def test_no_switch():
    """There is no way to turn the check off on one rank only (no switch at all; the old switch's
    environment variable on one rank: case `check_env_off_on_one_rank`)."""
    assert not hasattr(lossfx, "set_consistency_checks")
    assert not hasattr(lossfx, "consistency_checks_enabled")


def _agreeing_flags(rank, world, group):
    """Every rank with the same flags and values: exact values and gradients (no false alarm)."""
    hidden, weight, target = _fused(6, 12, 7)
    h = hidden.clone().requires_grad_()
    head = _head(weight).requires_grad_()
    out = lossfx.linear_token_logprobs(h, head, target, temperature=0.7)
    out.sum().backward()
    return out.detach(), h.grad, head.grad.full_tensor()


def test_agreeing_dtensor_head_is_exact():
    hidden, weight, target = _fused(6, 12, 7)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference.linear_token_logprobs(h, w, target, 0.7)[0]
    ref.sum().backward()
    for out, dh, dw in gloo_pool(2).run(_agreeing_flags):
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(dh, h.grad, rtol=0, atol=1e-10)
        torch.testing.assert_close(dw, w.grad, rtol=0, atol=1e-10)


class _LossHead(torch.nn.Module):
    """The LM head with the loss inside its forward: where FSDP2 has unsharded the weight."""

    def __init__(self, weight):
        super().__init__()
        self.lm_head = torch.nn.Linear(H, weight.shape[0], bias=False, dtype=F64)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def forward(self, hidden, target):
        return lossfx.linear_token_logprobs(hidden, self.lm_head.weight, target)


def _fsdp2_real(rank, world, group):
    """`fully_shard` leaves the head Shard(0) over the data-parallel ranks outside the forward:
    an error with the remedy. Inside the module's forward (the FSDP2 recipe) the weight is whole:
    exact values, and FSDP2's reduce-scatter averages the ranks' gradients into the shards."""
    from torch.distributed.fsdp import fully_shard

    _head(torch.zeros(2, 1))  # the mesh
    module = _LossHead(_fused(6, 12, 0)[1])
    fully_shard(module, mesh=_MESH["mesh"])
    hidden, _, target = _fused(6, 12, 10 + rank)
    weight = module.lm_head.weight
    try:
        lossfx.linear_token_logprobs(hidden, weight, target)
        message = None
    except ValueError as err:
        message = str(err)
    out = module(hidden, target)
    out.sum().backward()
    return message, type(weight).__name__, out.detach(), module.lm_head.weight.grad.full_tensor()


def test_fsdp2_fully_sharded_head():
    results = gloo_pool(2).run(_fsdp2_real)
    _, weight, _ = _fused(6, 12, 0)
    grads = []
    assert_every_rank_raises([message for message, *_ in results], [VALUES.format("hidden"), *FSDP])
    for rank, (_, kind, out, _) in enumerate(results):
        assert kind == "DTensor"
        hidden, _, target = _fused(6, 12, 10 + rank)
        w = weight.clone().requires_grad_()
        ref = reference.linear_token_logprobs(hidden, w, target)[0]
        ref.sum().backward()
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-10)
        grads.append(w.grad)
    for _, _, _, grad in results:  # FSDP2 averages over the data-parallel ranks
        torch.testing.assert_close(grad, (grads[0] + grads[1]) / 2, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Context parallelism: a TP x CP grid where one TP group disagrees (the CP-group cases are in the table)
# ---------------------------------------------------------------------------------------------


def _grid_mismatch(rank, world, group):
    """TP=2 x CP=2; only ranks 0 and 1 (one TP group) disagree (on top_k). Then a consistent call
    on the same groups: `(message, seconds, its host reads, its log-probs)`."""
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp=2)
    z, ids = _logits(2, 8, 6, 4), _ids(2, 8, 6, 4)
    local = shard_for_cp_rank(z, cp_rank, 2, seq_dim=1)[..., tp_rank * 3 : (tp_rank + 1) * 3]
    groups = {"vocab_parallel_rank": tp_rank, "vocab_parallel_group": tp_group, "context_parallel_group": cp_group}

    def call(sp=None):
        return lossfx.prepare_loss_input(local, {"input_ids": ids}, LOGPROB, sampling_params=sp, **groups)[0]

    message, seconds = value_error(lambda: call(lossfx.TrainingSamplingParams(top_k=2 if rank == 0 else 3)))
    call()  # warm-up
    return message, seconds, count_host_reads(call), call()["next_token_logprobs"]


@pytest.mark.xdist_group("gloo4")  # one 4-process pool per session (addopts: --dist loadgroup)
def test_gloo_tp_cp_grid_every_rank_raises_then_reads_once(monkeypatch):
    """Ranks 0 and 1 see the disagreement in their TP group; ranks 2 and 3 (whose TP group agrees)
    in their CP group. The consistent call afterwards reads the host once: the TP verdict travels
    in the CP signature computed on the device, so both gathered matrices are read together (2
    reads before); its values are the float64 reference's (the groups are still in step)."""
    monkeypatch.setattr(harness, "_TIMEOUT_S", 300.0)
    results = gloo_pool(4).run(_grid_mismatch)
    for rank, (message, seconds, _, _) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert seconds < SECONDS
    assert results[0][0] == results[1][0]
    assert "vocab_parallel_group disagree on sampling_params.top_k (rank 0: 2, rank 1: 3)" in results[0][0]
    assert results[2][0] == results[0][0].replace("vocab_parallel_group", "context_parallel_group")
    assert "rank(s) [0] of context_parallel_group (size 2) found ranks of their vocab_parallel_group" in results[3][0]
    assert [reads for _, _, reads, _ in results] == [1, 1, 1, 1]
    ref = reference.next_token_logprobs(_logits(2, 8, 6, 4), _ids(2, 8, 6, 4))
    for _, _, _, lp in results:  # gathered over the CP group: the whole sequence on every rank
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Uneven vocabulary shards through the loss-input entry points (eager)
# ---------------------------------------------------------------------------------------------

WIDTHS = (34, 30)  # V = 64, the issue's case


def _uneven(rank, world, group, top_k, packed):
    start = sum(WIDTHS[:rank])
    z = _logits(2, 6, 64, 7)[..., start : start + WIDTHS[rank]].clone().requires_grad_()
    ids = _ids(2, 6, 64, 7)
    sp = None if top_k is None else lossfx.TrainingSamplingParams(top_k=top_k, top_p=0.9)
    tp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group, "sampling_params": sp}
    data = {"input_ids": ids, "token_mask": torch.ones(2, 6), "sample_mask": torch.ones(2)}  # required under a filter
    if packed:  # the two rows packed into one, cu_seqlens [0, 6, 12]
        flat = z.reshape(1, 12, -1)
        out, _ = lossfx.prepare_packed_loss_input(flat, data, LOGPROB, (0, 6, 12), (0, 6, 12), **tp)
    else:
        out, _ = lossfx.prepare_loss_input(z, data, LOGPROB, **tp)
    lp = out["next_token_logprobs"]
    lp.masked_fill(torch.isneginf(lp), 0.0).sum().backward()
    return lp.detach(), z.grad


@pytest.mark.parametrize(("top_k", "packed"), [(None, False), (5, False), (None, True)])
def test_gloo_uneven_widths_match_reference(top_k, packed):
    results = gloo_pool(2).run(_uneven, top_k, packed)
    z = _logits(2, 6, 64, 7).requires_grad_()
    ids = _ids(2, 6, 64, 7)
    if top_k is None:
        ref = reference.next_token_logprobs(z, ids)
    else:
        ref = reference.next_token_filtered_logprobs(z, ids, top_k, 0.9)
        ref = ref.masked_fill(torch.isneginf(ref), 0.0)
    ref.sum().backward()
    for out, _ in results:
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-10)
    grad = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(grad, z.grad, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Rank threads: one collective per entry call, nested calls unchecked, nothing under compile
# ---------------------------------------------------------------------------------------------


def _gathers_and_ops(rank, world, group, counts, ops):
    """`(signature gathers of one filtered prepare_loss_input with a KL term, the ops a
    token_logprobs call ran on its gathered signatures before the check returned)` on this rank."""
    full = _logits(2, 6, 16, 0)
    # every scored id is its row's argmax, so the top-3 filter keeps it (no -inf warning)
    ids = torch.cat([torch.zeros_like(full[:, :1, 0], dtype=torch.long), full.argmax(-1)[:, :-1]], dim=1)
    sp = lossfx.TrainingSamplingParams(top_k=3)
    loss_fn = SimpleNamespace(input_type="logprob", reference_policy_kl_penalty=0.1)
    data = {"input_ids": ids, "token_mask": torch.ones(2, 6)}  # token_mask: required under a filter
    before = counts[rank]
    lossfx.prepare_loss_input(full[..., rank * 8 : (rank + 1) * 8], data, loss_fn, rank, group, sampling_params=sp)
    gathers, before = counts[rank] - before, len(ops[rank])
    z, ids = _logits(2, 3, 8, 6)[..., rank * 4 : (rank + 1) * 4], _ids(2, 3, 8, 6)
    lossfx.token_logprobs(z, ids, group=group)  # vocab="tiled": the most layout rules
    return gathers, ops[rank][before:]


def test_one_signature_gather_per_entry_call_judged_on_the_host_copy(monkeypatch):
    """One signature gather per entry call: prepare_loss_input -> next_token_logprobs (twice:
    filtered and unfiltered) -> target_logprobs -> filtered_token_logprobs / token_logprobs: one
    check for all of them. Eagerly the check runs no op on the gathered signatures before the
    call's one host read: the read carries the gathered matrix, and the judgement (`_judged`) runs
    on the host copy (on a GPU, no launches); the ranks still agree (every call passes the check)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    counts, ops, modes = [0, 0], [[], []], {}
    gather, check = _consistency._gather_on_device, _consistency._check

    def gathering(sig, group):
        counts[group.rank()] += 1
        out = gather(sig, group)
        modes[threading.get_ident()] = Ops(ops[group.rank()]).__enter__()  # records until the check returns
        return out

    def checking(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        finally:
            modes.pop(threading.get_ident()).__exit__(None, None, None)

    monkeypatch.setattr(_consistency, "_gather_on_device", gathering)
    monkeypatch.setattr(_consistency, "_check", checking)
    assert thread_world(2).run(_gathers_and_ops, counts, ops) == [(1, []), (1, [])]


def _thread_batch_mismatch(rank, world, group):
    return value_error(lambda: _call("batch", rank, group))[0]


def test_rank_threads_mismatch():
    messages = thread_world(2).run(_thread_batch_mismatch)
    assert messages[0] == messages[1] and "logits.shape[0] (rank 0: 2, rank 1: 1)" in messages[0]


def _compiled_step(rank, world, group):
    from harness import compiled_for_rank

    def step(z, ids):
        return lossfx.token_logprobs(z, ids, group=group).sum()

    counter, compiled = compiled_for_rank(rank, "consistency", step, backend="eager")
    z, ids = _logits(2, 3, 8, 6)[..., rank * 4 : (rank + 1) * 4], _ids(2, 3, 8, 6)
    return compiled(z, ids), counter.frame_count


@pytest.mark.compile
def test_no_graph_break_under_compile(monkeypatch):
    def fail(sig, group):
        raise AssertionError("the signature gather ran inside compiled code")

    monkeypatch.setattr(_consistency, "_gather_on_device", fail)
    results = thread_world(2).run(_compiled_step)  # fullgraph=True: a graph break would raise
    ref = reference.token_logprobs(_logits(2, 3, 8, 6), _ids(2, 3, 8, 6)).sum()
    for value, frames in results:
        torch.testing.assert_close(value, ref, rtol=0, atol=1e-10)
        assert frames == 1


def test_every_checked_function_has_its_own_name():
    """The signature codes the function called by its name (`_consistency.boundary`): two checked
    functions of one name would pass for each other and be reported under one name (the layout
    pipeline in `next_token` was also called `next_token_logprobs`, like the public function)."""
    seen: dict[str, str] = {}
    for path in sorted(Path(lossfx.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
            if isinstance(node, ast.FunctionDef) and any(d.startswith("boundary") for d in decorators):
                assert node.name not in seen, f"{node.name} is checked in {seen[node.name]} and in {path.name}"
                seen[node.name] = path.name
    assert {"next_token_logprobs", "sharded_next_token_logprobs", "prepare_loss_input"} <= set(seen)


def test_signature_is_by_value_and_fixed_length():
    """An enum and its value agree; shapes and scalars are encoded; the length never changes."""
    as_enum = {"loss_fn": SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB), "logits": torch.zeros(2, 3, 5)}
    as_str = {"loss_fn": SimpleNamespace(input_type="logprob"), "logits": torch.zeros(2, 3, 7)}
    roles = _consistency.Roles(shards=("logits",), attrs=("loss_fn", ("input_type",)))  # as prepare_loss_input
    sig_enum, fields = _consistency._signature("prepare_loss_input", as_enum, roles=roles)
    sig_str, _ = _consistency._signature("prepare_loss_input", as_str, roles=roles)
    assert sig_enum.shape == sig_str.shape == (_consistency.SIGNATURE_LEN,)
    body = slice(_consistency._HEADER, None)
    assert torch.equal(sig_enum[body], sig_str[body])  # the shard width (5 vs 7) is per rank: header only
    assert "logits.shape[1]" in fields.labels and "loss_fn.input_type" in fields.labels
    many = {f"x{i}": i for i in range(500)}  # past the field budget: a digest, same length
    sig_many, _ = _consistency._signature("f", many)
    assert sig_many.shape == (_consistency.SIGNATURE_LEN,)


def _breaks_layout(sigs: list[list[int]], policy: str) -> bool:
    """The layout rules read densely (independent of `_layout_flags`): the ranks' spans must hold
    every id of `[0, V)` exactly once (after the width, top-k and size rules of `policy`)."""
    C = _consistency
    world, widths = len(sigs), [s[C._H_WIDTH] for s in sigs]
    if policy in ("free", "auto") or C._NONE in widths:
        return False
    if policy == "equal":
        return len(set(widths)) > 1
    sizes = [world * w if s[C._H_SIZE] == C._NONE else s[C._H_SIZE] for s, w in zip(sigs, widths, strict=True)]
    if policy.startswith("topk:"):
        if len({min(int(policy[5:]), world * w) for w in widths}) > 1:
            return True
        policy, sizes = "tiled", [sum(widths)] * world
    if len(set(sizes)) > 1:
        return True
    if policy == "sized":
        return sum(widths) != sizes[0]
    starts = [r * w if s[C._H_START] == C._NONE else s[C._H_START] for r, (s, w) in enumerate(zip(sigs, widths))]
    return sorted(i for a, w in zip(starts, widths, strict=True) for i in range(a, a + w)) != list(range(sizes[0]))


def _finding(rows: list[list[int]], fields, across_tp: bool, policy: str = "free"):
    """What the check finds in the gathered signatures `rows` (rank 0's view): the one judgement
    (`_judged`, which eager and compiled calls share) worded as an eager call words it: `(label,
    rank 0's value)`, the layout's message, or None."""
    C = _consistency
    _, how = C._assertions(tuple(fields.owners), tuple(fields.tp_only), across_tp, policy, "")
    failed, rules = C._judged(torch.tensor(rows), how)
    if not failed.any():
        return None
    found = C._worded(failed.tolist().index(True), how[0], rows, rows[0], fields, C._NO_ROLES)
    return found or C._tiling_error(*(t.tolist() for t in rules), policy)


@pytest.mark.parametrize("policy", ["free", "auto", "equal", "sized", "tiled", "topk:5", "topk:40"])
def test_one_judgement_of_fields_and_layout(policy):
    """The check decides once (`_judged`, tensor ops: eagerly on the host copy of the gathered
    signatures, on the device for the TP verdict, and in the compiled graph); the TP verdict that
    travels to the CP peers is that decision. Against a dense reading: it fails exactly when a
    field differs or the layout breaks `policy` (`_layout_flags`, against `_breaks_layout`), and
    a differing field is named before a broken layout."""
    C = _consistency
    gen = torch.Generator().manual_seed(len(policy))
    base, fields = C._signature("f", {"x": torch.ones(3), "k": 4})
    cases = 0
    for world in (2, 3):
        for _ in range(150):
            g = base.repeat(world, 1)
            widths = torch.randint(0, 4, (world,), generator=gen) * 3 + 1
            g[:, C._H_WIDTH] = widths
            if torch.rand(1, generator=gen) < 0.1:
                g[0, C._H_WIDTH] = C._NONE
            if torch.rand(1, generator=gen) < 0.5:  # explicit starts: the tiling, a gap or an overlap
                starts = torch.cumsum(widths, 0) - widths
                starts[torch.randint(0, world, (1,), generator=gen)] += int(torch.randint(-1, 2, (1,), generator=gen))
                g[:, C._H_START] = starts
            if torch.rand(1, generator=gen) < 0.5:
                g[:, C._H_SIZE] = int(widths.sum()) + int(torch.randint(-1, 2, (1,), generator=gen))
            field = bool(torch.rand(1, generator=gen) < 0.2)
            if field:  # a field disagrees
                g[-1, C._HEADER + 3] += 1
            sigs = g.tolist()
            tiling = None
            if policy not in ("free", "auto"):  # (the rules of a layout that has some)
                broken, spans = C._layout_flags(g, policy)
                tiling = C._tiling_error(broken.tolist(), spans.tolist(), policy) if broken.any() else None
            assert (tiling is not None) == _breaks_layout(sigs, policy), sigs
            found = _finding(sigs, fields, True, policy)
            assert (found is not None) == (field or tiling is not None), (policy, sigs[0][:10], [s[:10] for s in sigs])
            if field:
                assert found == (fields.labels[1], _consistency._show(fields.shown[1])), found
            elif tiling is not None:
                assert found == tiling
            cases += found is not None
    assert 0 < cases < 300 or policy in ("free", "auto")  # both outcomes were exercised


def test_boundary_roles_must_name_parameters_and_groups():
    """A typo in a declared role, or a function with collectives that declares no group (it would
    never be checked), fails when the function is defined, not silently at run time."""
    with pytest.raises(TypeError, match=r"names no parameter of it: \['logit'\]"):
        _consistency.boundary(roles=_consistency.Roles(tp="group", shards=("logit",)))(lambda logits, group: None)
    with pytest.raises(TypeError, match=r"declare its groups"):
        _consistency.boundary(vocab="tiled")(lambda logits, group: None)
    _consistency.boundary(collectives=False)(lambda logits: None)  # no collective: no group needed


def test_cp_shards_are_compared_across_tensor_parallel_only():
    """A tensor argument declared `Roles.cp_shards` is this CP rank's sequence part: its values may
    differ across the context-parallel group but not across the tensor-parallel one; a key of a
    mapping declared `Roles.shard_columns` (DRAFT's `student_logits`: a draft-vocabulary shard, and
    a sequence part) is compared in neither (nor is its last dim); every other replicated tensor
    must agree across both groups."""
    C = _consistency
    roles = C.Roles(cp_shards=("x",), shard_columns=("part",))

    def sigs(x: float, data_part: float, ids: int, width: int = 3) -> tuple[list[list[int]], C._Fields]:
        rows = []
        for rank in range(2):
            args = {
                "x": torch.full((2, 3), x if rank else 0.0),
                "data": {
                    "part": torch.full((2, width if rank else 3), data_part if rank else 0.0),
                    "ids": torch.full((2,), ids if rank else 0),
                },
            }
            sig, fields = C._signature("f", args, roles=roles)
            rows.append(sig.tolist())
        return rows, fields

    for x, part, ids, width, across_cp in [
        (0.0, 0.0, 0, 3, None),
        (1.0, 0.0, 0, 3, None),
        (0.0, 1.0, 0, 3, None),
        (0.0, 1.0, 0, 2, None),
        (0.0, 0.0, 1, 3, "ids"),
    ]:
        rows, fields = sigs(x, part, ids, width)
        cp, tp = _finding(rows, fields, across_tp=False), _finding(rows, fields, across_tp=True)
        assert (cp is None) == (across_cp is None) and (cp is None or across_cp in cp[0]), (x, part, ids, cp)
        assert (tp is not None) == bool(x or ids), (x, part, ids, tp)
        if x:
            assert tp is not None and tp[0].startswith("the values of x")


def _inductor_code_of_a_checked_call(rank, world, group, top_k):
    """Rank 0's Inductor wrapper code of a compiled `prepare_loss_input(LOGPROB)` over the group
    (top-k filtered when `top_k`), and rank 0's log-probs."""
    from torch._inductor.utils import run_and_get_code

    sampling = lossfx.TrainingSamplingParams(top_k=top_k) if top_k else None
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)

    def step(z, ids):
        data = {"input_ids": ids, "token_mask": torch.ones(ids.shape)}
        kw = {"vocab_parallel_rank": rank, "vocab_parallel_group": group, "sampling_params": sampling}
        return lossfx.prepare_loss_input(z, data, loss_fn, **kw)[0]["next_token_logprobs"]

    z, ids = _logits(2, 5, 64, 7, dtype=torch.float32), _ids(2, 5, 64, 7)
    width = 64 // world
    out, code = run_and_get_code(torch.compile(step, fullgraph=True), z[..., rank * width : (rank + 1) * width], ids)
    return out, code[0] if rank == 0 else None


def _calls(code: str) -> list[str]:
    """The wrapper's calls (kernels, extern ops, collectives), in the order it makes them."""
    return [line.strip() for line in code.splitlines() if line.startswith("        ") and "(" in line]


@pytest.mark.compile
@pytest.mark.parametrize("top_k", [None, 5])
def test_compiled_check_precedes_the_kernels_first_collective(top_k):
    """Safety, in the code Inductor generates: the check's all-gather is issued first, and its
    assertions (`lossfx::assert_agreement`, after the wait) come before the kernel's own first
    all-gather, which reads their token (`settle_before`): no compiler order can run a collective
    whose size may differ first. Overlap, where the kernel starts with an extern op (the top-k
    filter's `topk`): that op runs between the check's all-gather and its wait, so the round trip
    flies meanwhile. (A fused first pass may be fused into the fingerprint's kernel, ahead of the
    all-gather: no overlap then, and no loss.) Values checked against the float64 reference."""
    (out, code), _ = gloo_pool(2).run(_inductor_code_of_a_checked_call, top_k)
    ids = _ids(2, 5, 64, 7)
    ref = reference.next_token_filtered_logprobs(_logits(2, 5, 64, 7), ids, top_k=top_k)
    ref = ref.masked_fill(ref.isneginf(), 0.0)  # prepare_loss_input's filtered-out targets read 0
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)  # fp32 over 64 columns
    calls = _calls(code)

    def first(pred, after: int = -1) -> int:
        return next(i for i, line in enumerate(calls) if i > after and pred(line))

    check_gather = first(lambda s: "all_gather_into_tensor.default(" in s)
    wait = first(lambda s: "wait_tensor.default(" in s)
    asserts = first(lambda s: "lossfx.assert_agreement.default(" in s)
    kernel_gather = first(lambda s: "all_gather_into_tensor.default(" in s, after=check_gather)
    assert check_gather < wait < asserts < kernel_gather, calls
    if top_k:
        assert check_gather < first(lambda s: "aten.topk.default(" in s) < wait, calls


# a config of 300 fields (a dataclass: the check compares its fields; of another object only the attributes
# the call reads, `Roles.attrs`)
_Config300 = dataclasses.make_dataclass("_Config300", [f"option_{i:03d}" for i in range(300)])


@pytest.mark.slow  # ~45 s (a 300-field config traced twice); the default run has the adversarial nemo cases
@pytest.mark.compile
def test_every_field_past_the_body_is_compared_eager_and_compiled():
    """Issue 25: fields past the first 122 (a loss config with 300 options, tensors after them)
    are compared through two digests computed on the device, eagerly and in a compiled graph (they
    were not compared at all under compile: ranks whose `top_p` differed returned different
    answers): any one changed field changes the digest compared across every group; the values of
    a sequence shard (`Roles.cp_shards`) only the one compared across the tensor-parallel group."""
    C = _consistency
    roles = C.Roles(cp_shards=("x",))

    def signature(cfg, x, ids):
        return C._signature("f", {"cfg": cfg, "ids": ids, "x": x}, roles=roles)[0]

    options, x, ids = [0.5] * 300, torch.zeros(2, 3), torch.arange(4)
    compiled = torch.compile(signature, fullgraph=True, backend="aot_eager")
    for fn in (signature, compiled):

        def sig(options, x, ids, fn=fn):
            return fn(_Config300(*options), x, ids)

        base = sig(options, x, ids)
        for i in (130, 299) if fn is signature else (299,):  # a float far past the body (each a recompile)
            changed = sig([*options[:i], 0.25, *options[i + 1 :]], x, ids)
            assert changed[C._H_DIGEST] != base[C._H_DIGEST] and changed[C._H_VALUES] != base[C._H_VALUES], i
        changed = sig(options, x, ids.flip(0))  # a canonical tensor's values: both digests
        assert changed[C._H_DIGEST] != base[C._H_DIGEST] and changed[C._H_VALUES] != base[C._H_VALUES]
        changed = sig(options, x + 1, ids)  # a sequence shard's values: across TP only
        assert changed[C._H_DIGEST] == base[C._H_DIGEST] and changed[C._H_VALUES] != base[C._H_VALUES]
    cfg = _Config300(*options)
    eager, traced = signature(cfg, x, ids), compiled(cfg, x, ids)
    assert traced[C._H_TRACED] == 1 and eager[C._H_TRACED] == 0
    traced[C._H_TRACED] = 0
    assert torch.equal(eager, traced)  # the same signature, compiled or not
