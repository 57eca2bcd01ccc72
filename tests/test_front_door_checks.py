"""The hidden-state front door runs the logits branch's own validators (one copy of each check):
its errors are the logits path's, naming the stand-in for its logits (`hidden's logits`), and a
check moved into a shared validator now holds on both paths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lossfx
from lossfx import LossInputType
from lossfx.opd_full import OnPolicyDistillationFullConfig

B, S, H, V = 2, 4, 3, 6


def _case():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(B, S, H, generator=gen), torch.randn(V, H, generator=gen), torch.randint(0, V, (B, S))


def test_logprob_shape_error_is_the_logits_paths_naming_the_stand_in():
    hidden, weight, _ = _case()
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB)
    data = {"input_ids": torch.zeros(B, S + 1, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"hidden's logits must cover input_ids' 5 positions"):
        lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn)
    with pytest.raises(ValueError, match=r"^logits must cover input_ids' 5 positions"):
        lossfx.prepare_loss_input(hidden @ weight.T, data, loss_fn)


def test_distillation_and_draft_errors_are_the_logits_paths():
    hidden, weight, _ = _case()
    loss_fn = SimpleNamespace(input_type=LossInputType.DISTILLATION)
    data = {"teacher_topk_logits": torch.zeros(B, S, 0), "teacher_topk_indices": torch.zeros(B, S, 0, dtype=torch.long)}
    for call in (
        lambda: lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn),
        lambda: lossfx.prepare_loss_input(hidden @ weight.T, data, loss_fn),
    ):
        with pytest.raises(ValueError, match=r"topk must be positive: teacher_topk_indices"):
            call()
    draft = SimpleNamespace(input_type=LossInputType.DRAFT)
    data = {"token_mask": torch.ones(B, S), "student_logits": torch.zeros(B, S, 2)}
    for call in (
        lambda: lossfx.prepare_linear_loss_input(hidden, weight, data, draft, d2t=torch.zeros(2, 1, dtype=torch.long)),
        lambda: lossfx.prepare_loss_input(hidden @ weight.T, data, draft, d2t=torch.zeros(2, 1, dtype=torch.long)),
    ):
        with pytest.raises(ValueError, match=r"d2t must be 1-D \[D\]"):
            call()


def test_teacher_logits_dtype_is_checked_on_both_opd_full_paths():
    hidden, weight, ids = _case()
    loss_fn = SimpleNamespace(
        input_type=LossInputType.OPD_FULL, opd_full=OnPolicyDistillationFullConfig(teacher_payload="logits")
    )
    data = {"input_ids": ids, "teacher_full_logits": torch.zeros(B, S, V)}
    with pytest.raises(TypeError, match="teacher_logits_dtype"):
        lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn, teacher_logits_dtype="float32")
    with pytest.raises(TypeError, match="teacher_logits_dtype"):
        lossfx.prepare_loss_input(hidden @ weight.T, data, loss_fn, teacher_logits_dtype="float32")


def test_sampling_params_type_is_checked_by_every_next_token_face():
    hidden, weight, ids = _case()
    with pytest.raises(TypeError, match="sampling_params must be TrainingSamplingParams"):
        lossfx.next_token_logprobs(hidden @ weight.T, ids, sampling_params={"top_k": 2})
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB)
    with pytest.raises(TypeError, match="sampling_params must be TrainingSamplingParams"):
        lossfx.prepare_linear_loss_input(hidden, weight, {"input_ids": ids}, loss_fn, sampling_params={"top_k": 2})


def test_linear_next_token_logprobs_checks_are_next_tokens():
    hidden, weight, ids = _case()
    with pytest.raises(ValueError, match=r"position_ids must have input_ids' shape"):
        lossfx.linear_next_token_logprobs(hidden, weight, ids, position_ids=torch.zeros(B, S + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 6\)"):
        lossfx.linear_next_token_logprobs(hidden, weight, ids.clone().fill_(V))


def test_linear_divergence_takes_the_head_keywords():
    hidden, weight, _ = _case()
    teacher = torch.randn(B, S, V)
    plain = lossfx.linear_divergence_to_teacher(hidden, weight, teacher_logits=teacher, temperature=0.5)
    same = lossfx.linear_divergence_to_teacher(hidden, weight, teacher_logits=teacher, temperature=0.5, ignore_index=3)
    torch.testing.assert_close(plain.reverse_kl, same.reverse_kl)
    with pytest.raises(ValueError, match="temperature"):
        lossfx.linear_divergence_to_teacher(hidden, weight, teacher_logits=teacher, temperature=0.0)
