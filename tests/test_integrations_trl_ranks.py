"""lossfx.integrations.trl on 2 real gloo processes: ranks whose options differ get one clear error.

Issue 25: with a DTensor LM head, a rank whose `sharded_head` (or temperature, filter, chunk size,
head options...) differs from its peers' used to reach a collective its peers never call (the
`"gather"` rank's `full_tensor()` ran before lossfx's own check): the process aborted or hung.
`per_token_logps_and_entropies` now all-gathers a fingerprint of its options over the head's mesh
first. Each case runs on 2 gloo processes under a deadline (a hang or an abort fails the test),
then a probe all-reduce proves the group is still in step. Eager; the compiled call (the mixin's
`lossfx_compile`) runs the same check eagerly before it (one case here).
"""

from __future__ import annotations

import harness
import pytest
import torch
import torch.distributed as dist
from test_integrations_trl import dense, make_case

from lossfx import TrainingSamplingParams
from lossfx.integrations import trl as lossfx_trl

TIGHT = {"rtol": 0, "atol": 1e-10}
DEADLINE_S = 60.0  # eager, 2 processes, tiny shapes: a second or two; a hang runs into this


def _options(case: str, rank: int) -> dict:
    """The call's keyword arguments on `rank` for `case` (rank 1 differs, unless the case agrees)."""
    options: dict = {"logits_to_keep": 4, "temperature": 0.9, "sharded_head": "gather", "compute_entropy": True}
    odd = rank == 1
    if case == "sharded_head" and odd:
        options["sharded_head"] = "raise"  # rank 0 would run full_tensor(), rank 1 raise: was a hang
    elif case == "sharded_head_tp" and odd:
        options["sharded_head"] = "tensor_parallel"
    elif case == "temperature" and odd:
        options["temperature"] = 1.0
    elif case == "bad_temperature" and odd:
        options["temperature"] = -1.0  # rank 1 alone rejects its value
    elif case == "filtered" and odd:
        options["sampling_params"] = TrainingSamplingParams(top_k=5)
    elif case == "ties":  # both filter; top-p's tie rule differs
        options["sampling_params"] = TrainingSamplingParams(top_p=0.8, ties="sorted" if odd else "together")
    elif case == "chunk_size" and odd:
        options["chunk_size"] = 4
    elif case == "softcap" and odd:
        options["softcap"] = 3.0
    elif case == "logits_to_keep_gather":  # data parallel: each rank pads its own completions
        options["logits_to_keep"] = 4 + rank
    elif case == "logits_to_keep_tp":
        options.update(sharded_head="tensor_parallel", logits_to_keep=4 + rank)
    elif case == "agree_tp":
        options["sharded_head"] = "tensor_parallel"
    return options


def _case(rank, world, group, case):
    """One call of `per_token_logps_and_entropies` with a `Shard(0)` head; its outcome, then a probe."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    hidden, weight, input_ids, mask = make_case(seed=5, vocab=20)
    options = _options(case, rank)
    if options["sharded_head"] != "tensor_parallel":  # data parallel: each rank its own hidden states
        hidden = make_case(seed=10 + rank, vocab=20)[0]
    if case == "bad_shape" and rank == 1:
        hidden = hidden[:, :-1]  # rank 1 alone: hidden_states and input_ids disagree
    head = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    out: dict = {"error": None}
    try:
        if case == "compiled":  # the mixin's path under lossfx_compile: the eager check, then the compiled call
            args = (hidden, head, input_ids, mask)
            options["temperature"] = 0.9 + 0.1 * rank
            lossfx_trl._check_ranks_agree(*args, **options)
            raise AssertionError("the check let a disagreement through")
        lp, ent = lossfx_trl.per_token_logps_and_entropies(hidden, head, input_ids, mask, **options)
        lp.sum().backward()
        out["lp"], out["ent"], out["grad"] = lp.detach(), ent.detach(), head.grad.to_local()
        ref = dense(hidden, weight, input_ids, mask, options["logits_to_keep"], options["temperature"])
        out["ref_lp"], out["ref_ent"] = ref
    except (ValueError, TypeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    probe = torch.ones(())
    dist.all_reduce(probe, group=group)  # the group is still in step after the call
    out["probe"] = probe
    return out


def _run(case: str, fn=None, world: int = 2) -> list[dict]:
    """Every rank's `fn(case)` result (default `_case`); fails on a hang (no answer by
    `DEADLINE_S`) or a dead rank, and checks the probe: the group is still in step."""
    answers = harness.answers_in_time(fn or _case, case, timeout=DEADLINE_S, world=world)
    assert [float(a["probe"]) for a in answers] == [float(world)] * world, "the group is out of step"
    return answers


DISAGREE = {  # case: what every rank's error must say
    "sharded_head": ["disagree on sharded_head", "rank 0: 'gather'", "rank 1: 'raise'"],
    "sharded_head_tp": ["disagree on sharded_head", "rank 0: 'gather'", "rank 1: 'tensor_parallel'"],
    "temperature": ["disagree on temperature", "rank 0: 0.9", "rank 1: 1.0"],
    "bad_temperature": ["disagree on temperature", "rank 0: 0.9", "rank 1: -1.0"],
    "filtered": ["sampling_params.top_k (a filter) (rank 0: None, rank 1: 5)"],
    "ties": ["disagree on sampling_params.ties (a filter) (rank 0: 'together', rank 1: 'sorted')"],
    "chunk_size": ["disagree on chunk_size (rank 0: None, rank 1: 4)"],
    "softcap": ["disagree on softcap (rank 0: None, rank 1: 3.0)"],
    "logits_to_keep_tp": ["disagree on logits_to_keep (rank 0: 4, rank 1: 5)"],
    "compiled": ["disagree on temperature", "rank 0: 0.9", "rank 1: 1.0"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(DISAGREE))
def test_ranks_that_disagree_all_get_one_clear_error(case):
    answers = _run(case)
    for rank, answer in enumerate(answers):
        error = answer["error"]
        assert error is not None and error.startswith("ValueError: lossfx.integrations.trl"), (rank, error)
        for part in DISAGREE[case]:
            assert part in error, (rank, part, error)
    assert answers[0]["error"] == answers[1]["error"]  # the same message on every rank


@pytest.mark.distributed
def test_a_rank_that_rejects_its_arguments_stops_every_rank():
    answers = _run("bad_shape")
    assert answers[1]["error"].startswith("ValueError: hidden_states must be [B, S, H]"), answers[1]["error"]
    assert "rank(s) [1] of the LM head's device mesh rejected their arguments" in answers[0]["error"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["agree", "agree_tp", "logits_to_keep_gather"])
def test_ranks_that_agree_get_the_unchanged_result(case):
    """Agreeing ranks (and data-parallel ranks whose `logits_to_keep` differs, as TRL's may): the
    dense float64 values; `"gather"`: the head's gradient is the mean over the ranks' data."""
    answers = _run(case)
    for answer in answers:
        assert answer["error"] is None, answer["error"]
        torch.testing.assert_close(answer["lp"], answer["ref_lp"], **TIGHT)
        torch.testing.assert_close(answer["ent"], answer["ref_ent"], **TIGHT)
    if case == "agree":
        weight = make_case(seed=5, vocab=20)[1].clone().requires_grad_()
        _, _, input_ids, mask = make_case(seed=5, vocab=20)
        total = sum(
            dense(make_case(seed=10 + r, vocab=20)[0], weight, input_ids, mask, 4, 0.9)[0].sum() for r in (0, 1)
        )
        (grad,) = torch.autograd.grad(total / 2, weight)
        for rank, answer in enumerate(answers):
            torch.testing.assert_close(answer["grad"], grad[rank * 10 : (rank + 1) * 10], **TIGHT)


def test_plain_heads_add_no_collective(monkeypatch):
    """No DTensor, no group: the check returns before any collective (none is even possible here)."""
    calls = []
    monkeypatch.setattr(lossfx_trl, "_gather_over_mesh", lambda *a: calls.append(a))
    hidden, weight, input_ids, mask = make_case()
    lossfx_trl.per_token_logps_and_entropies(hidden, weight, input_ids, mask, logits_to_keep=4)
    assert calls == []


def _case_2d(rank, world, group, odd_rank):
    """An HSDP-like 2 × 2 mesh (`Replicate()` over dim 0, `Shard(0)` over dim 1), `"gather"`;
    `odd_rank` alone scores at another temperature (`-1`: none does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    _, weight, input_ids, mask = make_case(seed=5, vocab=20)
    hidden = make_case(seed=10 + rank, vocab=20)[0]
    head = distribute_tensor(weight, mesh, [Replicate(), Shard(0)], src_data_rank=None)
    temperature = 1.0 if rank == odd_rank else 0.9
    out: dict = {"error": None}
    try:
        lp, _ = lossfx_trl.per_token_logps_and_entropies(
            hidden, head, input_ids, mask, logits_to_keep=4, temperature=temperature, sharded_head="gather"
        )
        out["lp"], out["ref"] = lp.detach(), dense(hidden, weight, input_ids, mask, 4, temperature)[0]
    except ValueError as e:
        out["error"] = str(e)
    probe = torch.ones(())
    dist.all_reduce(probe, group=group)
    out["probe"] = probe
    return out


@pytest.mark.xdist_group("gloo4")  # one 4-process pool per session (addopts: --dist loadgroup)
@pytest.mark.distributed
def test_a_2d_mesh_every_rank_raises_when_one_differs(monkeypatch):
    """A rank that differs only from its neighbours along one mesh dim still stops every rank:
    the check gathers the whole mesh (one all-gather per dim, of what the previous one gathered).
    Judged per dim, rank 0 would see both its groups agree and go on into the gather."""
    monkeypatch.setattr(harness, "_TIMEOUT_S", DEADLINE_S)  # a hang fails in a minute
    pool = harness.gloo_pool(4)
    for odd_rank in (3, -1):
        answers = pool.run(_case_2d, odd_rank)
        assert [float(a["probe"]) for a in answers] == [4.0] * 4
        if odd_rank == -1:
            for answer in answers:
                assert answer["error"] is None, answer["error"]
                torch.testing.assert_close(answer["lp"], answer["ref"], **TIGHT)
            continue
        want = "disagree on temperature (rank 0: 0.9, rank 1: 0.9, rank 2: 0.9, rank 3: 1.0)"
        for answer in answers:
            assert answer["error"] is not None and want in answer["error"], answer["error"]


def _fsdp2(rank, world, group, case):
    """A tiny Qwen2 under FSDP2 (`fully_shard` on each layer and the model: the LM head is a
    `Shard(0)` DTensor outside the forward), scored by the mixin with `lossfx_sharded_head` from
    `case`, and by stock TRL's method on an identical FSDP2 copy with TRL's fused head."""
    import contextlib
    import copy
    from types import SimpleNamespace

    from test_integrations_trl import tiny_qwen2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    class Trainer(lossfx_trl.LossfxGRPOMixin):  # what the method reads of a trainer
        def __init__(self, sharded_head):
            self.accelerator = SimpleNamespace(
                unwrap_model=lambda m: m, autocast=contextlib.nullcontext, is_main_process=True
            )
            self.temperature, self.lossfx_sharded_head = 0.8, sharded_head

    mesh = init_device_mesh("cpu", (world,))
    ours = tiny_qwen2()
    stock = copy.deepcopy(ours)
    add_fused_lm_head(stock, temperature=0.8, outputs=("log_probs", "entropy"))
    for model in (ours, stock):  # the head its own FSDP unit, resharded after its forward: a DTensor at the call
        own_unit = (model.lm_head,) if case != "fsdp2_root" else ()  # else in the root unit: unsharded at the call
        for module in (*model.model.layers, *own_unit, model):
            fully_shard(module, mesh=mesh)
    input_ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(20 + rank))  # own data
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0
    sharded_head = "raise" if case == "fsdp2_disagree" and rank == 1 else "gather"
    out: dict = {"error": None}
    heads = []
    real = lossfx_trl.per_token_logps_and_entropies

    def spy(hidden, weight, *args, **kwargs):
        heads.append(type(weight).__name__)
        return real(hidden, weight, *args, **kwargs)

    lossfx_trl.per_token_logps_and_entropies = spy
    try:
        results = []
        for method, model, trainer in (
            (lossfx_trl.LossfxGRPOMixin._get_per_token_logps_and_entropies, ours, Trainer(sharded_head)),
            (GRPOTrainer._get_per_token_logps_and_entropies, stock, Trainer("gather")),
        ):
            lp, ent, _ = method(trainer, model, input_ids, mask, 6, batch_size=2, compute_entropy=True)
            (lp.sum() + 0.1 * ent.sum()).backward()
            grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
            results.append((lp.detach(), ent.detach(), grads))
        out["ours"], out["stock"] = results
    except ValueError as e:
        out["error"] = str(e)
    finally:
        lossfx_trl.per_token_logps_and_entropies = real
    out["heads"] = heads
    if case in ("fsdp2_agree", "fsdp2_root"):  # the head's gradient FSDP2 must give: the mean over the ranks' data
        want = 0
        for r in range(world):
            plain = tiny_qwen2()
            ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(20 + r))
            lp, ent, _ = lossfx_trl.LossfxGRPOMixin._get_per_token_logps_and_entropies(
                Trainer("raise"), plain, ids, mask, 6, compute_entropy=True
            )
            (lp.sum() + 0.1 * ent.sum()).backward()
            want = want + plain.lm_head.weight.grad / world
        rows = want.shape[0] // world
        out["want_head"] = want[rank * rows : (rank + 1) * rows]
    probe = torch.ones(())
    dist.all_reduce(probe, group=group)
    out["probe"] = probe
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fsdp2_agree", "fsdp2_root"])
def test_fsdp2_mixin_with_gather_matches_stock_trl(case):
    """The mixin under FSDP2 with `lossfx_sharded_head="gather"`, the head its own unit (resharded
    after its forward: a `Shard(0)` DTensor at the lossfx call) or in the root unit (a plain tensor
    there; FSDP2 reduce-scatters its gradient): stock TRL's log-probs, entropies and backbone
    gradient shards, and the head's gradient shard equal to the mean over the ranks' data of the
    unsharded model's (FSDP2's reduction), fp32. (Stock TRL's own head gradient is not the
    reference here: its fused head reads `lm_head.weight` without running the head's FSDP2 unit,
    and in this setup its head gradient differs from that mean.)"""
    pytest.importorskip("trl")
    for answer in _run(case, _fsdp2):
        assert answer["error"] is None, answer["error"]
        # two micro-batches; a head in the root unit is still gathered when the forward returns
        assert answer["heads"] == ["Parameter" if case == "fsdp2_root" else "DTensor"] * 2
        (lp, ent, grads), (lp_t, ent_t, grads_t) = answer["ours"], answer["stock"]
        torch.testing.assert_close(lp, lp_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent_t, rtol=1e-5, atol=1e-5)
        assert grads.keys() == grads_t.keys() and "lm_head.weight" in grads
        torch.testing.assert_close(grads.pop("lm_head.weight"), answer["want_head"], rtol=1e-4, atol=1e-6)
        for name in grads:
            torch.testing.assert_close(grads[name], grads_t[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_fsdp2_trainers_whose_sharded_head_differs_all_raise():
    """Issue 25's case through the mixin: rank 0's trainer gathers, rank 1's says "raise"."""
    pytest.importorskip("trl")
    answers = _run("fsdp2_disagree", _fsdp2)
    for answer in answers:
        assert "disagree on sharded_head (rank 0: 'gather', rank 1: 'raise')" in (answer["error"] or ""), answer
