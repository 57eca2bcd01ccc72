"""The pure top-k distillation layout (`lossfx._layouts.distillation`) against the float64
reference, and the boundary of its public faces (`lossfx.distillation_topk_logprobs`,
`prepare_loss_input`'s `DISTILLATION` branch): one public call validates once, range-checks its
ids once, enters the pure code once and calls no other public function.

Sections: 1 values and gradients (1 and 2 ranks, TP and CP, an uneven `VocabRange`); 2 the
boundary counts (plain, rank threads, DTensor logits on a real gloo mesh); 3 one compiled pure call.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from devices import on_device
from harness import run_ranks

import lossfx
from lossfx import reference
from lossfx._core.vocab import VocabRange
from lossfx._layouts import distillation as pure
from lossfx._layouts.sequence_layout import LoadBalancedLayout, PlainLayout

pytestmark = pytest.mark.gpu_check  # the GPU check's subset: `pytest --device cuda -m gpu_check`

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-12}
B, S, V, K = 2, 8, 8, 3


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, S, V, generator=g, dtype=F64) * 3
    values = torch.randn(B, S, K, generator=g, dtype=F64)
    ids = torch.randint(0, V, (B, S, K), generator=g)
    ids[0, 0, 1] = ids[0, 0, 0]  # a duplicated id
    upstream = [torch.randn(B, S - 1, K, generator=g, dtype=F64), torch.randn(B, S - 1, generator=g, dtype=F64)]
    return on_device((z, values, ids.to(torch.int32), upstream))


def _loss(student, neg_entropy, upstream):
    loss = (student * upstream[0]).sum()
    return loss if neg_entropy is None else loss + (neg_entropy * upstream[1]).sum()


def _reference(zero_outside_topk, calculate_entropy, seed=0):
    z, values, ids, upstream = _case(seed)
    z = z.clone().requires_grad_()
    student, teacher, neg_entropy = reference.distillation_topk_logprobs(
        z, values, ids, zero_outside_topk, calculate_entropy
    )
    neg_entropy = neg_entropy if (zero_outside_topk and calculate_entropy) else None
    _loss(student, neg_entropy, upstream).backward()
    return student.detach(), teacher, None if neg_entropy is None else neg_entropy.detach(), z.grad


# ---------------------------------------------------------------------------------------------
# 1. Values and gradients against the float64 reference
# ---------------------------------------------------------------------------------------------


def _pure_rank(rank, world, group, mode, widths, zero_outside_topk, calculate_entropy):
    """One rank: the pure call on this rank's part (`mode`: "tp" vocabulary columns, "cp" sequence
    part); returns the outputs and this rank's gradient."""
    z, values, ids, upstream = _case()
    if mode == "tp":
        start = sum(widths[:rank])
        local = z[..., start : start + widths[rank]].clone().requires_grad_()
        vocab, layout = VocabRange(group, start, V), PlainLayout()
    else:
        layout = LoadBalancedLayout(group) if world > 1 else PlainLayout()
        local = reference.cp_shard(z, rank, world).clone().requires_grad_()
        vocab = VocabRange.whole(V)
    student, teacher, neg_entropy = pure.distillation_topk_logprobs(
        local,
        values,
        ids,
        vocab,
        layout,
        zero_outside_topk=zero_outside_topk,
        calculate_entropy=calculate_entropy,
        chunk_rows=3,
    )
    _loss(student, neg_entropy, upstream).backward()
    return student.detach(), teacher, None if neg_entropy is None else neg_entropy.detach(), local.grad


@pytest.mark.parametrize(
    ("zero_outside_topk", "calculate_entropy"), [(True, True), (True, False), (False, False)], ids=["H", "full", "k"]
)
@pytest.mark.parametrize(
    ("world", "mode", "widths"),
    [(1, "tp", [V]), (2, "tp", [4, 4]), (2, "tp", [5, 3]), (2, "cp", None)],
    ids=["one", "tp2", "tp2-uneven", "cp2"],
)
def test_pure_distillation_against_reference(world, mode, widths, zero_outside_topk, calculate_entropy):
    want = _reference(zero_outside_topk, calculate_entropy)
    results = run_ranks(world, _pure_rank, mode, widths, zero_outside_topk, calculate_entropy)
    for rank, (student, teacher, neg_entropy, grad) in enumerate(results):
        torch.testing.assert_close(student, want[0], **TIGHT)
        torch.testing.assert_close(teacher, want[1], **TIGHT)
        if want[2] is None:
            assert neg_entropy is None
        else:
            torch.testing.assert_close(neg_entropy, want[2], **TIGHT)
        if mode == "tp":
            start = sum(widths[:rank])
            expected = want[3][..., start : start + widths[rank]]
        else:  # summed over CP ranks: every rank's loss is the whole loss
            expected = world * reference.cp_shard(want[3], rank, world)
        torch.testing.assert_close(grad, expected, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. The boundary: once per public call, no nested public call
# ---------------------------------------------------------------------------------------------


def install_counters(counts, pure_module, pure_names):
    """Count every entry into lossfx's public (boundary-wrapped) functions, wherever they are
    referenced (every lossfx module's globals), every `check_ids_in_range` and the functions
    `pure_names` of `pure_module` (`counts[key]`: one entry per call; keys "public calls",
    "range checks", "pure"). Returns a function that undoes the patches."""
    patched = []

    def counting(key, fn):
        def counted(*args, **kwargs):
            counts.setdefault(key, []).append(1)  # (atomic: rank threads share the patched modules)
            return fn(*args, **kwargs)

        return counted

    def patch(module, attr, key):
        value = getattr(module, attr)
        patched.append((module, attr, value))
        setattr(module, attr, counting(key, value))

    for module in [m for name, m in sys.modules.items() if name.startswith("lossfx") and m is not None]:
        for attr, value in list(vars(module).items()):
            if callable(value) and hasattr(value, "_lossfx_roles"):
                patch(module, attr, "public calls")
            elif attr == "check_ids_in_range":
                patch(module, attr, "range checks")
    for attr in pure_names:
        patch(pure_module, attr, "pure")

    def undo():
        for module, attr, value in reversed(patched):
            setattr(module, attr, value)

    return undo


def _install_counters(counts):
    return install_counters(counts, pure, ("distillation_topk_logprobs",))


@pytest.fixture
def counts():
    counts: dict[str, list[int]] = {}
    undo = _install_counters(counts)
    yield counts
    undo()


def _totals(counts):
    return {key: len(calls) for key, calls in counts.items()}


LOSS_FN = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True, kl_type="mixed")
ONCE = {"public calls": 1, "pure": 1, "range checks": 1}


def _calls(logits, values, ids, **parallel):
    data = {"teacher_topk_logits": values, "teacher_topk_indices": ids}
    group = parallel.get("vocab_parallel_group")
    return {
        "distillation_topk_logprobs": lambda: lossfx.distillation_topk_logprobs(
            logits, values, ids, zero_outside_topk=True, calculate_entropy=True, vocab_parallel_group=group
        ),
        "prepare_loss_input": lambda: lossfx.prepare_loss_input(logits, data, LOSS_FN, **parallel)[0],
    }


@pytest.mark.parametrize("name", ["distillation_topk_logprobs", "prepare_loss_input"])
def test_one_public_call_validates_once_and_enters_the_pure_code_once(name, counts):
    z, values, ids, _ = _case()
    _calls(z, values, ids)[name]()
    assert _totals(counts) == ONCE


def _counted_rank(rank, world, group, name):
    z, values, ids, _ = _case()
    local = z.chunk(world, -1)[rank]
    out = _calls(local, values, ids, vocab_parallel_group=group, vocab_parallel_rank=rank)[name]()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["distillation_topk_logprobs", "prepare_loss_input"])
def test_grouped_public_call_validates_once_per_rank(name, counts):
    """With a group (the cross-rank check runs too): one range check, one pure call and no nested
    public call on each of the 2 ranks."""
    run_ranks(2, _counted_rank, name)
    assert _totals(counts) == {k: 2 * v for k, v in ONCE.items()}


def gloo_dtensor_count_job(rank, world, group, z, values, ids):
    """Uneven `Shard(2)` DTensor logits (V = 11 over 2 ranks: 6 + 5) on a real gloo mesh: each
    public call unwraps once (no re-entry on local tensors); the outputs and the counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(z, mesh, [Shard(2)], src_data_rank=None)
    results = []
    for name, call in _calls(x, values, ids).items():
        counts: dict[str, list[int]] = {}
        undo = _install_counters(counts)
        try:
            out = call()
        finally:
            undo()
        if isinstance(out, dict):
            out = (out["student_topk_logprobs"], out["teacher_topk_logprobs"], out["H_all"])
        assert _totals(counts) == ONCE, (name, _totals(counts))
        results.extend(out)
    return results


@pytest.mark.distributed
def test_dtensor_public_calls_validate_once_on_gloo():
    from harness import gloo_pool

    g = torch.Generator().manual_seed(3)
    z = torch.randn(B, S, 11, generator=g, dtype=F64)
    values = torch.randn(B, S, K, generator=g, dtype=F64)
    ids = torch.randint(0, 11, (B, S, K), generator=g)
    ids[:, :, 0] = 10  # the last id, on the short rank
    want = reference.distillation_topk_logprobs(z, values, ids, True, True)
    for got in gloo_pool(2).run(gloo_dtensor_count_job, z, values, ids):
        for out, ref in zip(got, [*want, *want], strict=True):
            torch.testing.assert_close(out, ref, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 3. Compiled
# ---------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_pure_distillation_compiles_without_graph_breaks():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    vocab = VocabRange.whole(V)

    def fn(z, values, ids):
        return pure.distillation_topk_logprobs(
            z, values, ids, vocab, PlainLayout(), zero_outside_topk=True, calculate_entropy=True
        )

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for seed in (0, 1):
        z, values, ids, _ = _case(seed)
        want = reference.distillation_topk_logprobs(z, values, ids, True, True)
        for got, ref in zip(compiled(z, values, ids), want, strict=True):
            torch.testing.assert_close(got, ref, **TIGHT)
    assert counter.frame_count == 1
