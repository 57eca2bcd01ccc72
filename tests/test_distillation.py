"""Top-k distillation (`DISTILLATION`), draft targets (`DRAFT`), and their kernels.

Sections: 0 helpers; 1 kernel equivalence (gather_logprobs, gather_logits, vocab_topk) on 1/2/4
ranks; 2 low precision; 3 properties; 4 float64 gradcheck; 5 the two branches of
prepare_loss_input over TP x CP, eager and compiled; 6 errors; 7 memory and mutation.
"""

from types import SimpleNamespace

import harness
import pytest
import torch
from harness import compiled_for_rank, mesh_groups, run_ranks, sharded_gradcheck
from hypothesis import example, given
from hypothesis import strategies as st

import lossfx
from lossfx import reference
from lossfx.context_parallel import shard_for_cp_rank

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}

# ---------------------------------------------------------------------------------------------
# 0. Helpers
# ---------------------------------------------------------------------------------------------


def _logits(shape, seed, dtype=F64, scale=3.0, neg_inf=False):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=gen, dtype=F64) * scale
    if neg_inf:
        z[torch.rand(*shape, generator=gen) < 0.25] = float("-inf")
        z.view(-1, shape[-1])[0] = float("-inf")  # one all -inf row
    return z.to(dtype)


def _ids(shape, vocab, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _tp_slice(x, tp_rank, tp):
    vl = x.shape[-1] // tp
    return x[..., tp_rank * vl : (tp_rank + 1) * vl]


def _assert_no_nan(*tensors):
    for t in tensors:
        if t is not None:
            assert not torch.isnan(t).any()


# ---------------------------------------------------------------------------------------------
# 1. Kernel equivalence on 1, 2, 4 ranks (float64, 1e-10, values and gradients)
# ---------------------------------------------------------------------------------------------


def _gather_rank(rank, world, group, z, ids, with_entropy, chunk, g, h):
    shard = _tp_slice(z, rank, world).clone().requires_grad_()
    lp, neg_h = lossfx.gather_logprobs(shard, ids, with_neg_entropy=with_entropy, group=group, chunk_size=chunk)
    loss = (torch.where(torch.isfinite(lp), lp, 0.0) * g).sum()
    if with_entropy:
        loss = loss + (neg_h * h).sum()
    loss.backward()
    return lp.detach(), None if neg_h is None else neg_h.detach(), shard.grad


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_gather_logprobs_matches_reference(world, with_entropy, chunk):
    n, v, k = 9, 12, 5
    z = _logits((n, v), seed=world + 10 * (chunk or 0), neg_inf=True)
    ids = _ids((n, k), v, seed=3)
    ids[1] = ids[1, 0]  # duplicate ids in one row
    g, h = torch.randn(n, k, dtype=F64), torch.randn(n, dtype=F64)
    results = run_ranks(world, _gather_rank, z, ids, with_entropy, chunk, g, h)
    zr = z.clone().requires_grad_()
    ref_lp, ref_h = reference.gather_logprobs(zr, ids)
    loss = (torch.where(torch.isfinite(ref_lp), ref_lp, 0.0) * g).sum()
    if with_entropy:
        loss = loss + (ref_h * h).sum()
    loss.backward()
    for lp, neg_h, _ in results:
        torch.testing.assert_close(lp, ref_lp.detach(), **TIGHT)
        if with_entropy:
            torch.testing.assert_close(neg_h, ref_h.detach(), **TIGHT)
    grad = torch.cat([r[2] for r in results], dim=-1)
    _assert_no_nan(grad)
    torch.testing.assert_close(grad, zr.grad, **TIGHT)


def _gather_logits_rank(rank, world, group, z, ids, g):
    shard = _tp_slice(z, rank, world).clone().requires_grad_()
    out = lossfx.gather_logits(shard, ids, group=group)
    (out * g).sum().backward()
    return out.detach(), shard.grad


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gather_logits_matches_dense_gather(world):
    z, ids = _logits((6, 8), seed=1), _ids((6, 3), 8, seed=2)
    ids[0] = 5  # duplicates accumulate
    g = torch.randn(6, 3, dtype=F64)
    results = run_ranks(world, _gather_logits_rank, z, ids, g)
    zr = z.clone().requires_grad_()
    (zr.gather(-1, ids) * g).sum().backward()
    for out, _ in results:
        torch.testing.assert_close(out, z.gather(-1, ids), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([r[1] for r in results], -1), zr.grad, **TIGHT)


def _topk_rank(rank, world, group, z, k):
    return lossfx.vocab_topk(_tp_slice(z, rank, world), k, group=group)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 3, 8, 50])
def test_vocab_topk_matches_reference_with_ties(world, k):
    z = torch.randint(-3, 3, (7, 8)).to(F64)  # many exact ties
    z[0] = float("-inf")
    ref_values, ref_ids = reference.vocab_topk(z, k)
    for values, ids in run_ranks(world, _topk_rank, z, k):
        torch.testing.assert_close(values, ref_values, rtol=0, atol=0)
        torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("k_is_v", [False, True], ids=["K=1", "K=V"])
def test_gather_logprobs_k_one_and_k_equal_v(world, k_is_v):
    n, v = 5, 8
    z = _logits((n, v), seed=21 + world)
    ids = torch.arange(v).repeat(n, 1) if k_is_v else _ids((n, 1), v, seed=3)
    g, h = torch.randn(ids.shape, dtype=F64), torch.randn(n, dtype=F64)
    results = run_ranks(world, _gather_rank, z, ids, True, None, g, h)
    zr = z.clone().requires_grad_()
    ref_lp, ref_h = reference.gather_logprobs(zr, ids)
    ((ref_lp * g).sum() + (ref_h * h).sum()).backward()
    for lp, neg_h, _ in results:
        torch.testing.assert_close(lp, ref_lp.detach(), **TIGHT)
        torch.testing.assert_close(neg_h, ref_h.detach(), **TIGHT)
    torch.testing.assert_close(torch.cat([r[2] for r in results], -1), zr.grad, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. Low precision: no worse than the dense same-dtype baseline, against a float64 truth
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_logprobs_low_precision(dtype):
    n, v, k = 16, 300, 8
    z = _logits((n, v), seed=5, dtype=dtype, scale=10.0)
    ids = _ids((n, k), v, seed=6)
    truth_lp, truth_h = reference.gather_logprobs(z, ids)  # float64 of the same (rounded) logits
    lp, neg_h = lossfx.gather_logprobs(z, ids, with_neg_entropy=True, chunk_size=3)
    assert lp.dtype == torch.float32 and neg_h.dtype == torch.float32
    base = torch.log_softmax(z.float(), -1)
    base_lp, base_h = base.gather(-1, ids), (base.exp() * base).sum(-1)
    # fp32 accumulation: lossfx's error is bounded by the fp32 dense baseline's plus a few ulps
    # of the values' magnitude (|logprob| <= ~50 here, fp32 ulp ~4e-6).
    tol = 1e-5
    assert ((lp.double() - truth_lp).abs() <= (base_lp.double() - truth_lp).abs() + tol).all()
    assert ((neg_h.double() - truth_h).abs() <= (base_h.double() - truth_h).abs() + tol).all()
    # gradient dtype follows the logits
    zg = z.clone().requires_grad_()
    lossfx.gather_logprobs(zg, ids, with_neg_entropy=True)[1].sum().backward()
    assert zg.grad.dtype == dtype


# ---------------------------------------------------------------------------------------------
# 3. Properties
# ---------------------------------------------------------------------------------------------


@given(
    n=st.integers(1, 6),
    v=st.integers(1, 20),
    k=st.integers(1, 6),
    world=st.sampled_from([1, 2, 4]),
    chunk=st.one_of(st.none(), st.integers(1, 7)),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    neg_inf=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(n=1, v=1, k=1, world=1, chunk=1, scale=1.0, neg_inf=False, seed=0)
def test_property_gather_logprobs_sharded_equals_dense(n, v, k, world, chunk, scale, neg_inf, seed):
    v = v * world
    z = _logits((n, v), seed, scale=scale, neg_inf=neg_inf)
    ids = _ids((n, k), v, seed + 1)
    g, h = torch.randn(n, k, dtype=F64), torch.randn(n, dtype=F64)
    results = run_ranks(world, _gather_rank, z, ids, True, chunk, g, h)
    zr = z.clone().requires_grad_()
    ref_lp, ref_h = reference.gather_logprobs(zr, ids)
    ((torch.where(torch.isfinite(ref_lp), ref_lp, 0.0) * g).sum() + (ref_h * h).sum()).backward()
    tol = {"rtol": 1e-9, "atol": 1e-9 * max(1.0, scale)}
    for lp, neg_h, _ in results:
        torch.testing.assert_close(lp, ref_lp.detach(), **tol)
        torch.testing.assert_close(neg_h, ref_h.detach(), **tol)
        # entropy bounds: -log V <= Σ p log p <= 0
        assert (neg_h <= 1e-12).all() and (neg_h >= -torch.log(torch.tensor(float(v))) - 1e-9).all()
    grad = torch.cat([r[2] for r in results], dim=-1)
    _assert_no_nan(grad)
    torch.testing.assert_close(grad, zr.grad, **tol)


@given(n=st.integers(1, 5), v=st.integers(2, 30), seed=st.integers(0, 2**16))
def test_property_gather_logprobs_shift_invariant(n, v, seed):
    z, ids = _logits((n, v), seed), _ids((n, 3), v, seed)
    a, ha = lossfx.gather_logprobs(z, ids, with_neg_entropy=True)
    b, hb = lossfx.gather_logprobs(z + 17.5, ids, with_neg_entropy=True)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(ha, hb, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# 4. gradcheck (float64) of the custom Function, one rank and two rank threads
# ---------------------------------------------------------------------------------------------


def _gradcheck_rank(rank, world, group, z, ids):
    shard = _tp_slice(z, rank, world).clone().requires_grad_()

    def fn(x):
        return lossfx.gather_logprobs(x, ids, with_neg_entropy=True, group=group, chunk_size=2)

    if world == 1:
        return torch.autograd.gradcheck(fn, (shard,), check_undefined_grad=True)
    return sharded_gradcheck(fn, shard, rank=rank, world=world)


@pytest.mark.parametrize("world", [1, 2])
def test_gradcheck_gather_logprobs(world):
    z, ids = _logits((4, 6), seed=9), _ids((4, 3), 6, seed=9)
    ids[2] = 1
    assert all(run_ranks(world, _gradcheck_rank, z, ids))


def test_gather_logprobs_double_backward_raises():
    z = _logits((3, 5), 0).requires_grad_()
    lp, _ = lossfx.gather_logprobs(z, _ids((3, 2), 5, 0))
    (grad,) = torch.autograd.grad(lp.sum(), z, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


# ---------------------------------------------------------------------------------------------
# 5. prepare_loss_input: DISTILLATION and DRAFT over TP x CP, eager and compiled
# ---------------------------------------------------------------------------------------------


def _local_student(z, tp_rank, tp, cp_rank, cp):
    """This rank's [B, S/C, V/TP] part of the canonical [B, S, V] logits."""
    return _tp_slice(shard_for_cp_rank(z, cp_rank, cp, seq_dim=1), tp_rank, tp)


def _distill_rank(rank, world, group, tp, z, data, loss_fn, chunk, upstream, compiled):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    local = _local_student(z, tp_rank, tp, cp_rank, cp).clone().requires_grad_()

    def step(logits, data, upstream):  # everything that varies is an argument: the compiled
        out, _ = lossfx.prepare_loss_input(  # function is cached across calls (compiled_for_rank)
            logits,
            data,
            loss_fn,
            vocab_parallel_rank=tp_rank if tp_group is not None else None,
            vocab_parallel_group=tp_group,
            context_parallel_group=cp_group,
            chunk_size=chunk,
        )
        loss = (out["student_topk_logprobs"] * upstream["student"]).sum()
        if out["H_all"] is not None:
            loss = loss + (out["H_all"] * upstream["H"]).sum()
        return out, loss / cp  # the CP gradient convention: divide by C

    if compiled:
        _, step = compiled_for_rank(rank, ("distill", world, tp, compiled), step, backend=compiled)
    out, loss = step(local, data, upstream)
    loss.backward()
    return {k: (None if v is None else v.detach()) for k, v in out.items()}, local.grad


def _distill_reference(z, data, loss_fn, upstream):
    zr = z.clone().requires_grad_()
    ref = reference.prepare_distillation_input(zr, data, loss_fn)
    loss = (ref["student_topk_logprobs"] * upstream["student"]).sum()
    if ref["H_all"] is not None:
        loss = loss + (ref["H_all"] * upstream["H"]).sum()
    loss.backward()
    return ref, zr.grad


@pytest.mark.parametrize(
    ("world", "tp"), [(1, 1), (2, 2), (4, 4), (2, 1), (4, 2)], ids=["tp1", "tp2", "tp4", "cp2", "tp2xcp2"]
)
@pytest.mark.parametrize(("zero_outside_topk", "kl_type"), [(True, "reverse"), (True, "forward"), (False, "mixed")])
@pytest.mark.parametrize("chunk", [None, 1])
def test_distillation_branch_matches_reference(world, tp, zero_outside_topk, kl_type, chunk):
    cp = world // tp
    b, s, v, k = 2, 8, 8, 4
    z = _logits((b, s, v), seed=world * 7 + tp)
    data = {
        "teacher_topk_logits": _logits((b, s, k), seed=2),
        "teacher_topk_indices": _ids((b, s, k), v, seed=3),
    }
    data["teacher_topk_indices"][0, 1] = 2  # duplicates
    loss_fn = SimpleNamespace(
        input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=zero_outside_topk, kl_type=kl_type
    )
    upstream = {"student": torch.randn(b, s - 1, k, dtype=F64), "H": torch.randn(b, s - 1, dtype=F64)}
    results = run_ranks(world, _distill_rank, tp, z, data, loss_fn, chunk, upstream, None)
    ref, ref_grad = _distill_reference(z, data, loss_fn, upstream)
    for out, _ in results:
        for key in ("student_topk_logprobs", "teacher_topk_logprobs", "H_all"):
            if ref[key] is None:
                assert out[key] is None
            else:
                torch.testing.assert_close(out[key], ref[key].detach(), **TIGHT)
    for rank, (_, grad) in enumerate(results):
        tp_group_rank, cp_rank = rank % tp, rank // tp
        expected = _local_student(ref_grad, tp_group_rank, tp, cp_rank, cp)
        torch.testing.assert_close(grad, expected, **TIGHT)


def _draft_rank(rank, world, group, tp, z, data, d2t, compiled):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    local = _local_student(z, tp_rank, tp, cp_rank, world // tp).clone()
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)

    def step(logits, data):
        out, _ = lossfx.prepare_loss_input(
            logits,
            data,
            loss_fn,
            vocab_parallel_rank=tp_rank if tp_group is not None else None,
            vocab_parallel_group=tp_group,
            context_parallel_group=cp_group,
            d2t=d2t,
        )
        return out["teacher_logits"], out["token_mask"], out["student_logits"]

    if compiled:
        _, step = compiled_for_rank(rank, ("draft", world, tp, compiled), step, backend=compiled)
    return step(local, data)


@pytest.mark.parametrize(
    ("world", "tp"), [(1, 1), (2, 2), (4, 4), (2, 1), (4, 2)], ids=["tp1", "tp2", "tp4", "cp2", "tp2xcp2"]
)
@pytest.mark.parametrize("with_d2t", [False, True])
def test_draft_branch_matches_reference(world, tp, with_d2t):
    cp = world // tp
    b, s, v, d = 2, 8, 12, 4
    z = _logits((b, s, v), seed=11)
    d2t = torch.tensor([0, 2, 5, 8]) if with_d2t else None  # draft i -> target i + d2t[i]
    data = {"token_mask": (torch.rand(b, s) > 0.3).float(), "student_logits": torch.randn(b, s, d)}
    ref = reference.prepare_draft_input(z, data, d2t)
    for rank, (teacher, mask, student) in enumerate(run_ranks(world, _draft_rank, tp, z, data, d2t, None)):
        tp_rank, cp_rank = rank % tp, rank // tp
        expected = shard_for_cp_rank(ref["teacher_logits"], cp_rank, cp, seq_dim=1)
        expected = _tp_slice(expected, tp_rank, tp)  # TP: this rank's draft (or target) shard
        torch.testing.assert_close(teacher, expected, rtol=0, atol=0)
        torch.testing.assert_close(mask, shard_for_cp_rank(ref["token_mask"], cp_rank, cp, seq_dim=1))
        assert student is data["student_logits"]
        assert not teacher.requires_grad


def _frame_counts(key, world):
    """Compiles so far of each rank's `compiled_for_rank` entry `key` (0 before the first)."""
    entries = [harness._compiled.get((rank, key, "aot_eager")) for rank in range(world)]
    return [0 if entry is None else entry[0].frame_count for entry in entries]


# CP 2 runs with -m slow: by default distillation and draft compile under CP 2 in an external
# sharder's layout (test_sequence_layout.py::test_sharder_layout_compiles_on_every_branch), and the
# load-balanced layout compiles in the LOGPROB, packed, OPD_FULL and fused CP tests
@pytest.mark.compile
@pytest.mark.parametrize(
    ("tp", "lengths"),
    [(2, (8, 12, 16)), pytest.param(1, (8, 12, 16), marks=pytest.mark.slow)],
    ids=["tp2", "cp2"],
)
def test_distillation_and_draft_compile_on_two_ranks(tp, lengths):
    """fullgraph=True (aot_eager) on TP2 and CP2; equal to eager; bounded recompiles."""
    b, v, k = 2, 8, 3
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True, kl_type="reverse")
    world = 2
    before = _frame_counts(("distill", world, tp, "aot_eager"), world)
    for s in lengths:
        z = _logits((b, s, v), seed=s)
        data = {"teacher_topk_logits": _logits((b, s, k), 1), "teacher_topk_indices": _ids((b, s, k), v, 2)}
        upstream = {"student": torch.randn(b, s - 1, k, dtype=F64), "H": torch.randn(b, s - 1, dtype=F64)}
        compiled = run_ranks(world, _distill_rank, tp, z, data, loss_fn, None, upstream, "aot_eager")
        ref, ref_grad = _distill_reference(z, data, loss_fn, upstream)
        for rank, (out, grad) in enumerate(compiled):
            torch.testing.assert_close(out["student_topk_logprobs"], ref["student_topk_logprobs"].detach(), **TIGHT)
            torch.testing.assert_close(out["H_all"], ref["H_all"].detach(), **TIGHT)
            expected = _local_student(ref_grad, rank % tp, tp, rank // tp, world // tp)
            torch.testing.assert_close(grad, expected, **TIGHT)
        draft_data = {"token_mask": torch.ones(b, s), "student_logits": z}
        drafts = run_ranks(world, _draft_rank, tp, z, draft_data, None, "aot_eager")
        ref_draft = reference.prepare_draft_input(z, draft_data, None)
        for rank, (teacher, _, _) in enumerate(drafts):
            expected = shard_for_cp_rank(ref_draft["teacher_logits"], rank // tp, world // tp, 1)
            expected = _tp_slice(expected, rank % tp, tp)
            torch.testing.assert_close(teacher, expected, rtol=0, atol=0)
    after = _frame_counts(("distill", world, tp, "aot_eager"), world)
    for rank in range(world):
        assert after[rank] - before[rank] <= 2, "at most one recompile when the sequence length changes"


@pytest.mark.compile
def test_distillation_inductor_single_process():
    b, s, v, k = 2, 6, 16, 4
    z = _logits((b, s, v), seed=4)
    data = {"teacher_topk_logits": _logits((b, s, k), 1), "teacher_topk_indices": _ids((b, s, k), v, 2)}
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True, kl_type="mixed")
    upstream = {"student": torch.randn(b, s - 1, k, dtype=F64), "H": torch.randn(b, s - 1, dtype=F64)}
    explain = torch._dynamo.explain(lambda x: lossfx.prepare_loss_input(x, data, loss_fn)[0]["H_all"])(z)
    assert explain.graph_break_count == 0
    ((out, grad),) = run_ranks(1, _distill_rank, 1, z, data, loss_fn, None, upstream, "inductor")
    ref, ref_grad = _distill_reference(z, data, loss_fn, upstream)
    torch.testing.assert_close(out["student_topk_logprobs"], ref["student_topk_logprobs"].detach(), **TIGHT)
    torch.testing.assert_close(out["H_all"], ref["H_all"].detach(), **TIGHT)
    torch.testing.assert_close(grad, ref_grad, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 6. Errors
# ---------------------------------------------------------------------------------------------


def _distill(z, ids, teacher=None, **kw):
    loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=True, kl_type="reverse")
    teacher = torch.zeros(ids.shape, dtype=F64) if teacher is None else teacher
    data = {"teacher_topk_logits": teacher, "teacher_topk_indices": ids}
    return lossfx.prepare_loss_input(z, data, loss_fn, **kw)


def test_distillation_errors():
    z = _logits((1, 4, 6), 0)
    with pytest.raises(ValueError, match="topk must be positive"):
        _distill(z, torch.zeros(1, 4, 0, dtype=torch.long))
    oob = r"teacher_topk_indices must lie in \[0, 6\).*values \[6\] at positions \[\[0, 2, 0\]\]"
    with pytest.raises(ValueError, match=oob):
        _distill(z, torch.tensor([[[0], [1], [6], [2]]]))
    with pytest.raises(ValueError, match="teacher_topk_logits and teacher_topk_indices"):
        _distill(z, torch.zeros(1, 4, 2, dtype=torch.long), teacher=torch.zeros(1, 4, 3))
    with pytest.raises(TypeError, match="integer token ids"):
        _distill(z, torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="teacher_topk_logits"):
        lossfx.prepare_loss_input(z, {}, SimpleNamespace(input_type="distillation"))
    with pytest.raises(ValueError, match="positions"):
        _distill(z, torch.zeros(1, 5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="positive"):
        lossfx.vocab_topk(z, 0)


def gloo_uneven_dtensor_distillation_job(rank, world, group, z, ids, values, public):
    """Uneven `Shard(2)` DTensor logits (V = 11 over 2 ranks: 6 + 5, the short rank padded): an id
    equal to V, a padding column, is a range error on every rank, at both faces of DISTILLATION."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(z, init_device_mesh("cpu", (world,)), [Shard(2)], src_data_rank=None)
    try:
        if public:
            lossfx.distillation_topk_logprobs(x, values, ids, zero_outside_topk=True, calculate_entropy=False)
        else:
            data = {"teacher_topk_logits": values, "teacher_topk_indices": ids}
            loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=True, kl_type="reverse")
            lossfx.prepare_loss_input(x, data, loss_fn)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("public", [True, False])
def test_distillation_uneven_dtensor_rejects_a_padding_id(public):
    z = _logits((1, 4, 11), 3)
    ids = torch.tensor([[[0, 11]] * 4])
    results = harness.gloo_pool(2).run(gloo_uneven_dtensor_distillation_job, z, ids, torch.zeros(1, 4, 2), public)
    for message in results:  # prepare_loss_input returned -inf log-probs here before
        assert message is not None and "teacher_topk_indices must lie in [0, 11)" in message


def test_draft_errors():
    z = _logits((1, 4, 6), 0)
    data = {"token_mask": torch.ones(1, 4), "student_logits": z}
    loss_fn = SimpleNamespace(input_type="draft")
    with pytest.raises(ValueError, match=r"d2t targets .* must lie in \[0, 6\)"):
        lossfx.prepare_loss_input(z, data, loss_fn, d2t=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="student_logits"):
        lossfx.prepare_loss_input(z, {"token_mask": torch.ones(1, 4)}, loss_fn)
    with pytest.raises(ValueError, match="token_mask"):
        lossfx.prepare_loss_input(z, {"token_mask": torch.ones(1, 5), "student_logits": z}, loss_fn)
    with pytest.raises(TypeError, match="d2t"):
        lossfx.prepare_loss_input(z, data, loss_fn, d2t=torch.zeros(2))


def _draft_indivisible(rank, world, group):
    z = _logits((1, 4, 6), 0)
    try:
        lossfx.map_to_draft_vocab(
            z, torch.zeros(3, dtype=torch.long), vocab_parallel_rank=rank, vocab_parallel_group=group
        )
    except ValueError as exc:
        return str(exc)
    return None


def test_draft_d2t_not_divisible_by_tp_raises():
    for message in run_ranks(2, _draft_indivisible):
        assert message is not None and "divisible by the tensor-parallel size 2" in message


# ---------------------------------------------------------------------------------------------
# 7. Memory contract and no mutation
# ---------------------------------------------------------------------------------------------


def test_gather_logprobs_saves_logits_without_copy_and_mutates_nothing():
    z = _logits((6, 40), 1, dtype=torch.bfloat16).requires_grad_()
    ids = _ids((6, 4), 40, 1)
    z_before, ids_before = z.detach().clone(), ids.clone()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, h = lossfx.gather_logprobs(z, ids, with_neg_entropy=True, chunk_size=2)
    total = sum(t.numel() * t.element_size() for t in saved)
    per_row = 3 * 4 + ids.shape[-1] * 8  # shift, log_s, H (fp32) and the int64 ids
    assert total <= z.numel() * z.element_size() + z.shape[0] * per_row
    assert any(t.data_ptr() == z.data_ptr() for t in saved), "logits must be saved without a copy"
    (lp.sum() + h.sum()).backward()
    assert torch.equal(z.detach(), z_before) and torch.equal(ids, ids_before)


def test_branches_do_not_mutate_data():
    z = _logits((2, 5, 6), 0)
    data = {
        "teacher_topk_logits": _logits((2, 5, 3), 1),
        "teacher_topk_indices": _ids((2, 5, 3), 6, 1),
        "token_mask": torch.ones(2, 5),
        "student_logits": z.clone(),
    }
    before = {k: v.clone() for k, v in data.items()}
    keys = set(data)
    for input_type in ("distillation", "draft"):
        _, returned = lossfx.prepare_loss_input(
            z, data, SimpleNamespace(input_type=input_type, zero_outside_topk=True), d2t=torch.tensor([1, 1, 1])
        )
        assert returned is data and set(data) == keys
        for k in keys:
            assert torch.equal(data[k], before[k])


def test_gather_logits_bf16_backward_allocates_only_the_gradient():
    """`zero_outside_topk=False` reads the student through `gather_logits`; torch's own gather
    backward scatter-adds through a float32 buffer of the whole bf16 logits (3× their bytes). The
    lean backward allocates the bf16 gradient and `[N, K]`-sized temporaries only (profiler events
    see every eager allocation)."""
    from benchmarks.measure import peak_extra_bytes

    n, vocab, k = 256, 4096, 16
    z = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, vocab, (n, k))
    ids[:, 1] = ids[:, 0]  # duplicates add
    g = torch.randn(n, k)

    def run():
        return torch.autograd.grad(lossfx.gather_logits(z, ids), z, g)[0]

    grad = run()
    want = torch.zeros(n, vocab).scatter_add_(1, ids, g).to(torch.bfloat16)
    torch.testing.assert_close(grad, want, rtol=0, atol=0)  # one rounding of the exact column sums
    assert peak_extra_bytes(run) <= z.numel() * z.element_size() + 64 * n * k * 4
