"""Every branch of the entry points on a real gloo process group (2 processes), eager.

The rank-thread tests cover the layouts exhaustively; this file is the real-backend check that
each capability's collectives run on gloo and give the float64 reference's values and gradients:
LOGPROB (filtered), DISTILLATION, OPD_FULL (logits payload), DRAFT, and packed LOGPROB, once with
the two processes as a tensor-parallel group and once as a context-parallel group.
"""

from types import SimpleNamespace

import pytest
import torch
from harness import gloo_pool

import lossfx
from lossfx import reference
from lossfx.context_parallel import cp_positions, shard_for_cp_rank

pytestmark = pytest.mark.distributed

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
B, S, V, K = 2, 8, 12, 3
CU = [0, 4, 12]  # two packed sequences, padded lengths multiples of 2·CP


def _case():
    gen = torch.Generator().manual_seed(0)
    return {
        "z": torch.randn(B, S, V, generator=gen, dtype=F64) * 2,
        "ids": torch.randint(0, V, (B, S), generator=gen),
        "teacher": torch.randn(B, S, V, generator=gen, dtype=F64),
        "topk_logits": torch.randn(B, S, K, generator=gen, dtype=F64),
        "topk_ids": torch.randint(0, V, (B, S, K), generator=gen),
        "packed": torch.randn(1, CU[-1], V, generator=gen, dtype=F64),
        "d2t": torch.tensor([0, 3, 1, 7]),
    }


def _local(x, rank, world, mode, seq_dim=1):
    """This rank's part: a vocabulary shard (tp) or a load-balanced sequence part (cp)."""
    if mode == "tp":
        vl = x.shape[-1] // world
        return x[..., rank * vl : (rank + 1) * vl]
    return shard_for_cp_rank(x, rank, world, seq_dim=seq_dim)


def _run_branches(rank, world, group, mode, case):
    """Each branch on this rank's part; returns outputs and gradients (numpy-safe tensors)."""
    tp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group} if mode == "tp" else {}
    cp = {"context_parallel_group": group} if mode == "cp" else {}
    out = {}

    z = _local(case["z"], rank, world, mode).clone().requires_grad_()
    sp = lossfx.TrainingSamplingParams(top_k=5, top_p=0.9)
    ids = case["ids"]
    masks = {"token_mask": torch.ones(ids.shape), "sample_mask": torch.ones(ids.shape[0])}  # required under a filter
    res, _ = lossfx.prepare_loss_input(
        z, {"input_ids": ids, **masks}, SimpleNamespace(input_type="logprob"), sampling_params=sp, **tp, **cp
    )
    res["next_token_logprobs"].sum().backward()
    out["logprob"], out["logprob_grad"] = res["next_token_logprobs"].detach(), z.grad

    z = _local(case["z"], rank, world, mode).clone().requires_grad_()
    loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=True, kl_type="reverse")
    data = {"teacher_topk_logits": case["topk_logits"], "teacher_topk_indices": case["topk_ids"]}
    res, _ = lossfx.prepare_loss_input(z, data, loss_fn, **tp, **cp)
    (res["student_topk_logprobs"].sum() + res["H_all"].sum()).backward()
    out["distill"], out["distill_grad"] = res["student_topk_logprobs"].detach(), z.grad

    z = _local(case["z"], rank, world, mode).clone().requires_grad_()
    cfg = lossfx.OnPolicyDistillationFullConfig(enabled=True, teacher_payload="logits")
    loss_fn = SimpleNamespace(input_type="opd_full", opd_full=cfg)
    data = {"input_ids": case["ids"], "teacher_full_logits": case["teacher"]}
    res, _ = lossfx.prepare_loss_input(z, data, loss_fn, **tp, **cp)
    res["opd_full_divergence"].sum().backward()
    out["opd"], out["opd_grad"] = res["opd_full_divergence"].detach(), z.grad

    res, _ = lossfx.prepare_loss_input(
        _local(case["z"], rank, world, mode),
        {"token_mask": torch.ones(B, S), "student_logits": case["z"]},
        SimpleNamespace(input_type="draft"),
        d2t=case["d2t"] if mode == "tp" else None,
        **tp,
        **cp,
    )
    out["draft"] = res["teacher_logits"]

    if mode == "cp":
        positions = [CU[i] + p for i in range(len(CU) - 1) for p in cp_positions(CU[i + 1] - CU[i], rank, world)]
        packed = case["packed"][:, positions]
    else:
        packed = _local(case["packed"], rank, world, mode)
    packed = packed.clone().requires_grad_()
    res, _ = lossfx.prepare_packed_loss_input(
        packed, {"input_ids": case["ids"]}, SimpleNamespace(input_type="logprob"), CU, CU, **tp, **cp
    )
    res["next_token_logprobs"].sum().backward()
    out["packed"], out["packed_grad"] = res["next_token_logprobs"].detach(), packed.grad
    return out


def _references(case):
    ref = {}
    z = case["z"].clone().requires_grad_()
    lp = reference.next_token_filtered_logprobs(z, case["ids"], 5, 0.9)
    lp = reference.mask_out_neg_inf_logprobs(lp, torch.ones_like(lp))
    lp.sum().backward()
    ref["logprob"], ref["logprob_grad"] = lp.detach(), z.grad

    z = case["z"].clone().requires_grad_()
    student, _, neg_h = reference.distillation_topk_logprobs(z, case["topk_logits"], case["topk_ids"], True, True)
    (student.sum() + neg_h.sum()).backward()
    ref["distill"], ref["distill_grad"] = student.detach(), z.grad

    z = case["z"].clone().requires_grad_()
    opd = reference.opd_full_loss_input(z, case["teacher"], case["ids"])["opd_full_divergence"]
    opd.sum().backward()
    ref["opd"], ref["opd_grad"] = opd.detach(), z.grad

    ref["draft_tp"] = reference.draft_targets(case["z"], torch.ones(B, S), case["d2t"])[0]
    ref["draft_cp"] = reference.draft_targets(case["z"], torch.ones(B, S), None)[0]

    packed = case["packed"].clone().requires_grad_()
    plp = reference.packed_next_token_logprobs(packed, case["ids"], CU, CU)
    plp.sum().backward()
    ref["packed"], ref["packed_grad"] = plp.detach(), packed.grad
    return ref


@pytest.mark.parametrize("mode", ["tp", "cp"])
def test_every_branch_on_gloo(mode):
    world = 2
    case = _case()
    ref = _references(case)
    results = gloo_pool(world).run(_run_branches, mode, case)
    for rank, out in enumerate(results):
        for key in ("logprob", "distill", "opd", "packed"):
            torch.testing.assert_close(out[key], ref[key], **TIGHT, msg=lambda m, k=key: f"{k}: {m}")
        # gradients: TP -> this rank's vocabulary shard; CP -> C x its sequence part (summed convention)
        scale = 1 if mode == "tp" else world
        for key in ("logprob_grad", "distill_grad", "opd_grad"):
            want = _local(ref[key], rank, world, mode) * scale
            torch.testing.assert_close(out[key], want, **TIGHT, msg=lambda m, k=key: f"{k}: {m}")
        if mode == "cp":
            positions = [CU[i] + p for i in range(len(CU) - 1) for p in cp_positions(CU[i + 1] - CU[i], rank, world)]
            want = ref["packed_grad"][:, positions] * scale
        else:
            want = _local(ref["packed_grad"], rank, world, mode)
        torch.testing.assert_close(out["packed_grad"], want, **TIGHT)
        draft = _local(ref[f"draft_{mode}"], rank, world, mode)
        torch.testing.assert_close(out["draft"], draft, rtol=0, atol=0)
