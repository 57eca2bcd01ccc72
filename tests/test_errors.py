"""Errors that name the argument and the value (issue 10, item 12), on 1 and 2 ranks.

1. a top-k/top-p filter without `token_mask` in `data` raises (decisions.md §2.5; `sample_mask` is
   an optional per-sequence weight, ones when absent);
2. meta tensors: shape-only tracing runs every static check and skips the value checks;
3. any integer dtype of ids (uint8 `teacher_topk_indices`) works, also with a vocabulary offset;
4. a `cu_seqlens_*` that is not a sequence raises `TypeError` naming it and its value;
5. an out-of-range id is reported as `data['input_ids']` at its own `(b, t)`, and
   `input_ids[:, 0]`, never scored, is never checked;
6. `temperature` has one check wherever it is taken: `TypeError` for a value that is not a real
   number, `ValueError` (one message) for one that is not finite and > 0;
7. the hidden-state front door runs the logits branch's own validators (one copy of each check):
   its errors are the logits path's, naming the stand-in for its logits (`hidden's logits`).
"""

from __future__ import annotations

import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE, on_device
from harness import run_ranks

import lossfx
from lossfx import reference
from lossfx.integrations.trl import per_token_logps_and_entropies
from lossfx.packing import packed_next_token_logprobs

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
DISTILL = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION)
DRAFT = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)
OPD_LOGITS = SimpleNamespace(
    input_type="opd_full", opd_full=lossfx.OnPolicyDistillationFullConfig(teacher_payload="logits")
)
TOP_K = lossfx.TrainingSamplingParams(top_k=3, top_p=0.9)


def _logits(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ids(shape, vocab, seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _tp_slice(x, rank, world):
    vl = x.shape[-1] // world
    return x[..., rank * vl : (rank + 1) * vl]


# ---------------------------------------------------------------------------------------------
# 1. Missing mask columns under a filter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [("token_mask",), ("token_mask", "sample_mask")])
def test_filter_without_token_mask_raises_naming_it(missing):
    z, ids = _logits((2, 4, 10)), _ids((2, 4), 10)
    full = {"input_ids": ids, "token_mask": torch.ones(2, 4), "sample_mask": torch.ones(2)}
    data = {k: v for k, v in full.items() if k not in missing}
    keys = set(data)
    with pytest.raises(ValueError, match="'token_mask'"):
        lossfx.prepare_loss_input(z, data, LOGPROB, sampling_params=TOP_K)
    with pytest.raises(ValueError, match="'token_mask'"):
        lossfx.prepare_packed_loss_input(
            z.reshape(1, 8, 10), data, LOGPROB, (0, 4, 8), (0, 4, 8), sampling_params=TOP_K
        )
    assert set(data) == keys, "a failed call leaves data untouched"
    # without a filter the masks are not read
    lossfx.prepare_loss_input(z, data, LOGPROB)


def test_filter_with_both_masks_matches_reference():
    z, ids = _logits((2, 5, 10), 3), _ids((2, 5), 10, 4)
    data = {"input_ids": ids, "token_mask": torch.tensor([[1, 1, 0, 1, 1]] * 2), "sample_mask": torch.tensor([1, 0])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = lossfx.prepare_loss_input(z, data, LOGPROB, sampling_params=TOP_K)
    ref, _ = reference.prepare_filtered_logprob_input(z, data, LOGPROB, 3, 0.9)
    torch.testing.assert_close(out["next_token_logprobs"], ref["next_token_logprobs"], **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. Meta tensors: shapes through, value checks skipped
# ---------------------------------------------------------------------------------------------


def test_meta_tensors_trace_shapes_without_value_checks():
    meta = torch.device("meta")
    z = torch.empty(2, 5, 12, device=meta, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.empty(2, 5, dtype=torch.long, device=meta)
    out = lossfx.token_logprobs(z, ids)
    assert out.is_meta and out.shape == (2, 5) and out.dtype == torch.float32
    out.sum().backward()
    assert z.grad.is_meta and z.grad.shape == z.shape and z.grad.dtype == torch.bfloat16
    lp, neg_h = lossfx.gather_logprobs(
        z.detach(), torch.empty(2, 5, 3, dtype=torch.long, device=meta), with_neg_entropy=True
    )
    assert lp.shape == (2, 5, 3) and neg_h.shape == (2, 5) and lp.is_meta
    loss_input, _ = lossfx.prepare_loss_input(z.detach(), {"input_ids": ids}, LOGPROB)
    assert loss_input["next_token_logprobs"].shape == (2, 4) and loss_input["next_token_logprobs"].is_meta
    distill = SimpleNamespace(input_type="distillation", zero_outside_topk=True, kl_type="mixed")
    data = {
        "teacher_topk_logits": torch.empty(2, 5, 3, device=meta),
        "teacher_topk_indices": torch.empty(2, 5, 3, dtype=torch.long, device=meta),
    }
    loss_input, _ = lossfx.prepare_loss_input(z.detach(), data, distill)
    assert loss_input["student_topk_logprobs"].shape == (2, 4, 3) and loss_input["H_all"].shape == (2, 4)
    packed, _ = lossfx.prepare_packed_loss_input(
        torch.empty(1, 10, 12, device=meta), {"input_ids": ids}, LOGPROB, (0, 5, 10), (0, 5, 10)
    )
    assert packed["next_token_logprobs"].shape == (2, 4) and packed["next_token_logprobs"].is_meta
    # static checks still run on meta
    with pytest.raises(ValueError, match="leading dims"):
        lossfx.token_logprobs(z, ids[:, :3])
    with pytest.raises(TypeError, match="integer token ids"):
        lossfx.token_logprobs(z, ids.float())


# ---------------------------------------------------------------------------------------------
# 3. Any integer dtype of ids
# ---------------------------------------------------------------------------------------------


def _distill_rank(rank, world, group, z, teacher, ids, zero_outside_topk):
    loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=zero_outside_topk, kl_type="mixed")
    shard = _tp_slice(z, rank, world).clone().requires_grad_()
    out, _ = lossfx.prepare_loss_input(
        shard,
        {"teacher_topk_logits": teacher, "teacher_topk_indices": ids},
        loss_fn,
        vocab_parallel_rank=rank if group is not None else None,
        vocab_parallel_group=group,
    )
    loss = out["student_topk_logprobs"].sum() + (0 if out["H_all"] is None else out["H_all"].sum())
    loss.backward()
    return out["student_topk_logprobs"].detach(), shard.grad


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("zero_outside_topk", [True, False])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_teacher_topk_indices_of_any_integer_dtype(dtype, zero_outside_topk, world):
    """uint8 ids used to hit a raw `gather()` dtype error (and would wrap in `ids − vocab_start`)."""
    z, teacher = _logits((2, 4, 120), 5), _logits((2, 4, 3), 6)
    ids = _ids((2, 4, 3), 120, 7)  # ids ≥ 60 live on rank 1 at world 2: uint8 − 60 would wrap
    expected = run_ranks(world, _distill_rank, z, teacher, ids, zero_outside_topk)
    results = run_ranks(world, _distill_rank, z, teacher, ids.to(dtype), zero_outside_topk)
    for (out, grad), (out64, grad64) in zip(results, expected):
        torch.testing.assert_close(out, out64, rtol=0, atol=0)
        torch.testing.assert_close(grad, grad64, rtol=0, atol=0)
    ref = reference.distillation_topk_logprobs(z, teacher, ids.to(dtype), zero_outside_topk, False)[0]
    torch.testing.assert_close(results[0][0], ref, **TIGHT)


def test_gather_kernels_accept_uint8_ids():
    z, ids = _logits((3, 50), 8), _ids((3, 4), 50, 9)
    lp8, h8 = lossfx.gather_logprobs(z, ids.to(torch.uint8), with_neg_entropy=True)
    lp, h = lossfx.gather_logprobs(z, ids, with_neg_entropy=True)
    assert torch.equal(lp8, lp) and torch.equal(h8, h)
    assert torch.equal(lossfx.gather_logits(z, ids.to(torch.uint8)), lossfx.gather_logits(z, ids))


# ---------------------------------------------------------------------------------------------
# 4. cu_seqlens of the wrong type
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cu_q", "cu_p", "shown"),
    [
        ("cu_seqlens_q", 10, (0, 4, 8), "10"),
        ("cu_seqlens_q_padded", (0, 4, 8), 8, "8"),
        ("cu_seqlens_q", (0, 4.0, 8), (0, 4, 8), "4.0"),
        ("cu_seqlens_q", "048", (0, 4, 8), "'048'"),
    ],
)
def test_cu_seqlens_of_the_wrong_type_raise_type_error_naming_it(name, cu_q, cu_p, shown):
    z, ids = _logits((1, 8, 10)), _ids((2, 4), 10)
    with pytest.raises(TypeError, match=rf"{name} must .*{shown}"):
        lossfx.prepare_packed_loss_input(z, {"input_ids": ids}, LOGPROB, cu_q, cu_p)
    with pytest.raises(TypeError, match=name):
        packed_next_token_logprobs(z, ids, cu_q, cu_p)


# ---------------------------------------------------------------------------------------------
# 5. Out-of-range input_ids: named at their own position; input_ids[:, 0] never checked
# ---------------------------------------------------------------------------------------------


def _logprob_rank(rank, world, group, z, ids, filtered, packed):
    shard = _tp_slice(z, rank, world)
    kw = {"vocab_parallel_rank": rank, "vocab_parallel_group": group} if group is not None else {}
    data = {"input_ids": ids, "token_mask": torch.ones(ids.shape), "sample_mask": torch.ones(ids.shape[0])}
    sp = TOP_K if filtered else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if packed:
            b, s = ids.shape
            cu = tuple(range(0, b * s + 1, s))
            out, _ = lossfx.prepare_packed_loss_input(
                shard.reshape(1, b * s, -1), data, LOGPROB, cu, cu, sampling_params=sp, **kw
            )
        else:
            out, _ = lossfx.prepare_loss_input(shard, data, LOGPROB, sampling_params=sp, **kw)
    return out["next_token_logprobs"]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("filtered", [False, True])
def test_out_of_range_input_id_is_named_at_its_own_position(filtered, packed, world):
    z, ids = _logits((2, 5, 12), 10), _ids((2, 5), 12, 11)
    bad = ids.clone()
    bad[1, 3] = 12  # V = 12 on every world size
    with pytest.raises(
        Exception, match=r"data\['input_ids'\] must lie in \[0, 12\).*values \[12\] at positions \[\[1, 3\]\]"
    ):
        run_ranks(world, _logprob_rank, z, bad, filtered, packed)


@pytest.mark.filterwarnings("ignore:.*policy top-k/top-p mismatch")  # random ids under a filter: expected
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("filtered", [False, True])
def test_first_input_id_is_never_scored_nor_checked(filtered, packed, world):
    z, ids = _logits((2, 5, 12), 12), _ids((2, 5), 12, 13)
    odd = ids.clone()
    odd[:, 0] = torch.tensor([-7, 99])  # never scored: any value is fine
    expected = run_ranks(world, _logprob_rank, z, ids, filtered, packed)
    got = run_ranks(world, _logprob_rank, z, odd, filtered, packed)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_kernel_level_next_token_functions_name_input_ids():
    z, ids = _logits((2, 5, 12), 14), _ids((2, 5), 12, 15)
    ids[0, 4] = -1
    with pytest.raises(ValueError, match=r"^input_ids must lie in \[0, 12\).*values \[-1\] at positions \[\[0, 4\]\]"):
        lossfx.next_token_logprobs(z, ids)
    with pytest.raises(ValueError, match=r"^input_ids must lie .*values \[-1\] at positions \[\[0, 4\]\]"):
        packed_next_token_logprobs(z.reshape(1, 10, 12), ids, (0, 5, 10), (0, 5, 10))
    ids[0, 4] = 3
    ids[:, 0] = 1000  # position 0 is never scored
    lossfx.next_token_logprobs(z, ids)
    packed_next_token_logprobs(z.reshape(1, 10, 12), ids, (0, 5, 10), (0, 5, 10))


# ---------------------------------------------------------------------------------------------
# 6. temperature: one check, one exception type per kind of error, one message
# ---------------------------------------------------------------------------------------------


def _head_case():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 4, 3, generator=gen, dtype=F64)
    weight = torch.randn(9, 3, generator=gen, dtype=F64)
    ids = torch.randint(0, 9, (2, 4), generator=gen)
    return hidden, weight, ids


# every public function that takes a temperature, called with temperature=t
TEMPERATURE_TAKERS = {
    "TrainingSamplingParams": lambda h, w, ids, t: lossfx.TrainingSamplingParams(temperature=t),
    "linear_token_logprobs": lambda h, w, ids, t: lossfx.linear_token_logprobs(h, w, ids, temperature=t),
    "linear_next_token_logprobs": lambda h, w, ids, t: lossfx.linear_next_token_logprobs(h, w, ids, temperature=t),
    "linear_gather_logprobs": lambda h, w, ids, t: lossfx.linear_gather_logprobs(h, w, ids[..., None], temperature=t),
    "linear_logprob_objective": lambda h, w, ids, t: lossfx.linear_logprob_objective(
        h, w, ids, torch.ones(ids.shape, dtype=F64), temperature=t
    ),
    "trl": lambda h, w, ids, t: per_token_logps_and_entropies(h, w, ids, temperature=t),
    "trl_filtered": lambda h, w, ids, t: per_token_logps_and_entropies(
        h, w, ids, temperature=t, sampling_params=lossfx.TrainingSamplingParams(top_k=3)
    ),
}


@pytest.mark.parametrize("value", [0.0, -1.0, -0.0, math.inf, math.nan, 0])
@pytest.mark.parametrize("taker", sorted(TEMPERATURE_TAKERS))
def test_temperature_that_is_not_finite_and_positive_is_one_value_error(taker, value):
    with pytest.raises(ValueError, match="^" + re.escape(f"temperature must be a finite number > 0, got {value!r}")):
        TEMPERATURE_TAKERS[taker](*_head_case(), value)


@pytest.mark.parametrize("value", ["0.7", True, None, torch.tensor(0.7).to(DEVICE), 1j], ids=repr)
@pytest.mark.parametrize("taker", sorted(TEMPERATURE_TAKERS))
def test_temperature_that_is_not_a_real_number_is_one_type_error(taker, value):
    with pytest.raises(TypeError, match="^" + re.escape(f"temperature must be a real number, got {value!r}")):
        TEMPERATURE_TAKERS[taker](*_head_case(), value)


def test_an_integer_temperature_is_the_float_one():
    hidden, weight, ids = _head_case()
    assert lossfx.TrainingSamplingParams(temperature=2).temperature == 2
    h = hidden.clone().requires_grad_()
    lp = lossfx.linear_token_logprobs(h, weight, ids, temperature=2)
    h64 = hidden.clone().requires_grad_()
    want, _ = reference.linear_token_logprobs(h64, weight, ids, 2.0)
    torch.testing.assert_close(lp, want, **TIGHT)
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    (lp * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(h.grad, h64.grad, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 7. The hidden-state front door's errors are the logits path's (one copy of each check)
# ---------------------------------------------------------------------------------------------

IDS = on_device(_head_case()[2])  # [2, 4] of a V = 9 head
FRONT_DOOR = on_device(
    {  # case -> (data, loss_fn, keywords, exception, message; {logits}: the path's name for its logits)
        "logprob_shape": (
            {"input_ids": torch.zeros(2, 5, dtype=torch.long)},
            LOGPROB,
            {},
            ValueError,
            r"{logits} must cover input_ids' 5 positions",
        ),
        "distillation_topk": (
            {
                "teacher_topk_logits": torch.zeros(2, 4, 0),
                "teacher_topk_indices": torch.zeros(2, 4, 0, dtype=torch.long),
            },
            DISTILL,
            {},
            ValueError,
            r"topk must be positive: teacher_topk_indices",
        ),
        "draft_d2t": (
            {"token_mask": torch.ones(2, 4), "student_logits": torch.zeros(2, 4, 2)},
            DRAFT,
            {"d2t": torch.zeros(2, 1, dtype=torch.long)},
            ValueError,
            r"d2t must be 1-D \[D\]",
        ),
        "opd_full_teacher_logits_dtype": (
            {"input_ids": IDS, "teacher_full_logits": torch.zeros(2, 4, 9)},
            OPD_LOGITS,
            {"teacher_logits_dtype": "float32"},
            TypeError,
            "teacher_logits_dtype",
        ),
        "sampling_params_type": (
            {"input_ids": IDS},
            LOGPROB,
            {"sampling_params": {"top_k": 2}},
            TypeError,
            "sampling_params must be TrainingSamplingParams",
        ),
    }
)


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("case", sorted(FRONT_DOOR))
def test_front_door_errors_are_the_logits_paths(case, path):
    hidden, weight, _ = _head_case()
    data, loss_fn, keywords, exception, message = FRONT_DOOR[case]
    with pytest.raises(
        exception, match=message.replace("{logits}", "hidden's logits" if path == "hidden" else "^logits")
    ):
        if path == "hidden":
            lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn, **keywords)
        else:
            lossfx.prepare_loss_input(hidden @ weight.T, data, loss_fn, **keywords)


def test_next_token_faces_check_their_own_arguments():
    hidden, weight, ids = _head_case()
    with pytest.raises(TypeError, match="sampling_params must be TrainingSamplingParams"):
        lossfx.next_token_logprobs(hidden @ weight.T, ids, sampling_params={"top_k": 2})
    with pytest.raises(ValueError, match=r"position_ids must have input_ids' shape"):
        lossfx.linear_next_token_logprobs(hidden, weight, ids, position_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 9\)"):
        lossfx.linear_next_token_logprobs(hidden, weight, ids.clone().fill_(9))


def test_linear_divergence_takes_the_head_keywords():
    hidden, weight, _ = _head_case()
    teacher = torch.randn(2, 4, 9, dtype=F64)
    plain = lossfx.linear_divergence_to_teacher(hidden, weight, teacher_logits=teacher, temperature=0.5)
    same = lossfx.linear_divergence_to_teacher(hidden, weight, teacher_logits=teacher, temperature=0.5, ignore_index=3)
    torch.testing.assert_close(plain.reverse_kl, same.reverse_kl)
    with pytest.raises(ValueError, match="temperature"):
        lossfx.linear_divergence_to_teacher(hidden, weight, teacher_logits=teacher, temperature=0.0)
