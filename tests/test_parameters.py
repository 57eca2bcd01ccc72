"""Public parameters that no other test passed: each checked against the dense float64 reference.

`tests/test_docstrings.py` requires every parameter with a default of every public function to be
passed by some test or doctest; these are the ones the rest of the suite left out. Uneven
vocabulary shards (2 rank threads holding 3 and 7 of 10 columns) exercise `vocab_start` /
`vocab_size`, which the default `rank · Vl` layout never needs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from harness import run_ranks

import lossfx
from lossfx import reference
from lossfx.opd_full import OnPolicyDistillationFullConfig

F64 = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-10}
SIZES = (3, 7)  # uneven shards of a 10-column vocabulary
BOUNDS = ((0, 3), (3, 10))


def _logits(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=gen, dtype=F64) * 2
    z[0, 1] = float("-inf")  # a masked column
    z[1, :4] = z[1, 4]  # ties across the shard boundary
    return z


def _uneven_rank(rank, world, group, z, target, ids):
    start, end = BOUNDS[rank]
    vocab = z.shape[-1]
    shard = z[:, start:end].clone().requires_grad_(True)
    lp = lossfx.filtered_token_logprobs(
        shard, target, top_k=4, top_p=0.9, group=group, vocab_start=start, vocab_size=vocab
    )
    torch.where(torch.isfinite(lp), lp, 0).sum().backward()  # filtered-out targets carry no loss
    tau = lossfx.top_k_top_p_threshold(shard.detach(), top_k=4, top_p=0.9, group=group, vocab_size=vocab)
    filtered, keep = lossfx.apply_top_k_top_p(shard.detach(), top_k=4, top_p=0.9, group=group, vocab_size=vocab)
    glp, neg_h = lossfx.gather_logprobs(
        shard.detach(), ids, with_neg_entropy=True, group=group, vocab_start=start, vocab_size=vocab
    )
    gz = lossfx.gather_logits(shard.detach(), ids, group=group, vocab_start=start, vocab_size=vocab)
    values, top_ids = lossfx.vocab_topk(shard.detach(), 3, group=group, vocab_start=start)
    return lp.detach(), shard.grad, tau, filtered, keep, glp, neg_h, gz, values, top_ids


def test_uneven_vocabulary_shards_match_the_reference():
    z = _logits((6, 10))
    target = torch.tensor([0, 2, 5, 9, 3, 7])
    ids = torch.tensor([[0, 9, 3], [2, 4, 4], [1, 5, 8], [9, 0, 6], [3, 3, 7], [2, 8, 5]])
    results = run_ranks(2, _uneven_rank, z, target, ids)

    x = z.clone().requires_grad_(True)
    want_lp = reference.filtered_token_logprobs(x, target, 4, 0.9)
    torch.where(torch.isfinite(want_lp), want_lp, 0).sum().backward()
    want_filtered, want_keep = reference.apply_top_k_top_p(z, 4, 0.9)
    want_glp, want_neg_h = reference.gather_logprobs(z, ids)
    want_values, want_ids = reference.vocab_topk(z, 3)
    grad = torch.cat([r[1] for r in results], dim=-1)
    for rank, (lp, _, tau, filtered, keep, glp, neg_h, gz, values, top_ids) in enumerate(results):
        start, end = BOUNDS[rank]
        torch.testing.assert_close(lp, want_lp, **TOL)
        torch.testing.assert_close(z[:, start:end] >= tau[:, None], want_keep[:, start:end])
        torch.testing.assert_close(keep, want_keep[:, start:end])
        torch.testing.assert_close(filtered, want_filtered[:, start:end].to(filtered.dtype))
        torch.testing.assert_close(glp, want_glp, **TOL)
        torch.testing.assert_close(neg_h, want_neg_h, **TOL)
        torch.testing.assert_close(gz, z.gather(-1, ids), **TOL)
        torch.testing.assert_close(values, want_values, **TOL)
        torch.testing.assert_close(top_ids, want_ids)
    torch.testing.assert_close(grad, x.grad, **TOL)


def _topk_rank(rank, world, group, z, k):
    start, end = BOUNDS[rank]
    return lossfx.vocab_topk(z[:, start:end], k, group=group, vocab_start=start)


@pytest.mark.parametrize("k", [4, 5, 6])
def test_vocab_topk_k_wider_than_the_smallest_uneven_shard(k):
    """Shards of BOUNDS' widths: the narrow shard pads its candidates to min(k, R·Vl) with
    (-inf, sentinel id), which never displaces a real logit, also when real logits are -inf."""
    z = _logits((6, 10))
    z[0, :] = float("-inf")  # a masked row: the real -inf ids still come first, by id
    z[1, 1:4] = float("-inf")
    results = run_ranks(2, _topk_rank, z, k)
    want_values, want_ids = reference.vocab_topk(z, k)
    for values, ids in results:
        torch.testing.assert_close(values, want_values, **TOL)
        torch.testing.assert_close(ids, want_ids)


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_distillation_topk_logprobs_chunk_size_changes_nothing(chunk_size):
    gen = torch.Generator().manual_seed(1)
    student = torch.randn(2, 5, 11, generator=gen, dtype=F64)
    teacher_logits = torch.randn(2, 5, 3, generator=gen, dtype=F64)
    teacher_ids = torch.randint(0, 11, (2, 5, 3), generator=gen)
    x = student.clone().requires_grad_(True)
    got = lossfx.distillation_topk_logprobs(
        x, teacher_logits, teacher_ids, zero_outside_topk=True, calculate_entropy=True, chunk_size=chunk_size
    )
    xr = student.clone().requires_grad_(True)
    want = reference.distillation_topk_logprobs(xr, teacher_logits, teacher_ids, True, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    (got[0].sum() + got[2].sum()).backward()
    (want[0].sum() + want[2].sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL)


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [(None, 1.0, False), (0, 1.0, False), (-1, 1.0, False), (5, 1.0, True), (None, 0.9, True), (3, 0.5, True)],
)
def test_need_top_k_or_top_p_filtering(top_k, top_p, expected):
    params = lossfx.TrainingSamplingParams(top_k=top_k, top_p=top_p)
    assert lossfx.need_top_k_or_top_p_filtering(sampling_params=params) is expected
    assert lossfx.need_top_k_or_top_p_filtering(None) is False


def _shift_rank(rank, world, group, x):
    local = lossfx.shard_for_cp_rank(x, rank, world) if world > 1 else x
    return lossfx.shift_left(x=local, context_parallel_group=group)


@pytest.mark.parametrize("world", [1, 2])
def test_shift_left_on_canonical_and_cp_shards(world):
    x = torch.arange(2 * 8 * 3, dtype=F64).view(2, 8, 3)
    want = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
    shards = run_ranks(world, _shift_rank, x)
    torch.testing.assert_close(lossfx.unshard(shards, seq_dim=1), want, atol=0, rtol=0)


def test_teacher_logits_dtype_sets_the_precision_of_projected_teacher_logits():
    """float64 teacher logits give the reference (the exact product of the fp32 operands) to 1e-10;
    the default (the head's fp32) differs from it by fp32 rounding only."""
    gen = torch.Generator().manual_seed(2)
    student = torch.randn(2, 6, 9, generator=gen, dtype=F64)
    hidden = torch.randn(2, 5, 4, generator=gen, dtype=F64)
    weights = {0: torch.randn(9, 4, generator=gen, dtype=torch.float32)}  # an fp32 teacher LM head
    data = {"input_ids": torch.randint(0, 9, (2, 6), generator=gen), "teacher_full_hidden_states": hidden}
    cfg = OnPolicyDistillationFullConfig(enabled=True, teacher_payload="hidden_states")
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=cfg)
    teacher = reference.opd_full_teacher_logits(hidden, 6, teacher_payload="hidden_states", weights=weights)
    want = reference.opd_full_loss_input(student, teacher, data["input_ids"])["opd_full_divergence"]
    head = {"teacher_output_layer_weight_by_index": weights}
    layout = {"vocab_parallel_rank": None, "vocab_parallel_group": None, "context_parallel_group": None}
    exact, _ = lossfx.prepare_loss_input(student, data, loss_fn, teacher_logits_dtype=F64, **head)
    direct = lossfx.prepare_opd_full_loss_input(
        student, data, loss_fn, sampling_params=None, chunk_size=None, teacher_logits_dtype=F64, **head, **layout
    )
    fp32, _ = lossfx.prepare_loss_input(student, data, loss_fn, **head)
    torch.testing.assert_close(exact["opd_full_divergence"], want, **TOL)
    torch.testing.assert_close(direct["opd_full_divergence"], want, **TOL)
    err = (fp32["opd_full_divergence"] - want).abs().max().item()
    assert 0 < err < 1e-4, err
