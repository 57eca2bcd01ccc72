"""OPD_FULL: config, teacher logits reconstruction (NeMo's payload rules, docs/opd_full.md) and the branch."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from devices import on_device
from harness import compiled_for_rank, run_ranks

import lossfx
from lossfx import reference as ref
from lossfx.divergence import divergence_to_projected_teacher
from lossfx.opd_full import OnPolicyDistillationFullConfig, reconstruct_opd_full_teacher_logits

F64 = torch.float64
TOL = 1e-10


# ---------------------------------------------------------------------------------------------
# 0. Cases
# ---------------------------------------------------------------------------------------------


def make_case(mode, *, batch=3, seq=8, vocab=12, hidden=5, payload_len=6, extra_vocab=3, seed=0):
    """Canonical student `[B, S, V]`, `data`, full LM heads, and the dense teacher `[B, S, V]`."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, seq, vocab, generator=g, dtype=F64) * 2
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    data = {"input_ids": input_ids, "token_mask": torch.ones(batch, seq)}
    weights = None
    if mode == "logits":
        payload = torch.randn(batch, payload_len, vocab + extra_vocab, generator=g, dtype=F64) * 2
        data["teacher_full_logits"] = payload
        teacher = ref.opd_full_teacher_logits(payload[..., :vocab], seq, teacher_payload="logits")
    else:
        payload = torch.randn(batch, payload_len, hidden, generator=g, dtype=F64)
        weights = {k: torch.randn(vocab, hidden, generator=g, dtype=F64) for k in (3, 7)}
        index = torch.tensor([7, 3, 7][:batch] + [3] * max(0, batch - 3))
        data["teacher_full_hidden_states"] = payload
        data["opd_full_teacher_index"] = index
        teacher = ref.opd_full_teacher_logits(
            payload, seq, teacher_payload="hidden_states", weights=weights, teacher_index=index
        )
    return student, data, weights, teacher


def loss_fn(mode, penalty=0.0, validate=True, chunk=None):
    cfg = OnPolicyDistillationFullConfig(
        enabled=True, teacher_payload=mode, chunk_size=chunk, validate_decomposition=validate
    )
    return SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=cfg, reference_policy_kl_penalty=penalty)


_SUBGROUPS: dict = {}


def _tp2_cp2_groups(rank, world_group):
    """(tp_group, cp_group) of a 4-rank world as TP 2 × CP 2: TP rank = rank % 2, CP rank = rank // 2."""
    key = (threading.get_ident(), id(world_group))
    if key not in _SUBGROUPS:  # every rank creates every group, in the same order
        tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _SUBGROUPS[key] = (tps[rank // 2], cps[rank % 2])
    return _SUBGROUPS[key]


def _opd_rank(rank, world, group, parallel, mode, student, data, weights, fn_args, backend=None):
    """One rank of the branch; `parallel`: "tp" (vocab group), "cp" (sequence group) or "tp2cp2"."""
    if parallel == "tp2cp2":
        tp_group, cp_group = _tp2_cp2_groups(rank, group)
        tp, cp, tp_rank, cp_rank = 2, 2, rank % 2, rank // 2
    else:
        tp_group, cp_group = (group, None) if parallel == "tp" else (None, group)
        tp, cp = (world, 1) if parallel == "tp" else (1, world)
        tp_rank, cp_rank = (rank, 0) if parallel == "tp" else (0, rank)
    local = student.chunk(tp, dim=-1)[tp_rank]
    local = lossfx.shard_for_cp_rank(local, cp_rank, cp).clone().requires_grad_()
    heads = None if weights is None else {k: w.chunk(tp, dim=0)[tp_rank] for k, w in weights.items()}
    penalty, validate, chunk, dout = fn_args
    lf = loss_fn(mode, penalty, validate, chunk)

    def fn(logits):
        out, _ = lossfx.prepare_loss_input(
            logits,
            data,
            lf,
            vocab_parallel_rank=None if tp_group is None else tp_rank,
            vocab_parallel_group=tp_group,
            context_parallel_group=cp_group,
            chunk_size=2,
            teacher_output_layer_weight_by_index=heads,
        )
        loss = (out["opd_full_divergence"] * dout).sum()
        if "next_token_logprobs" in out:
            loss = loss + (out["next_token_logprobs"] * dout.flip(0)).sum()
        return out, loss / cp  # the CP all-gather sums gradients over CP ranks

    if backend is not None:
        _, fn = compiled_for_rank(rank, ("opd_full", parallel, world, mode, penalty, validate, chunk), fn, backend)
    out, loss = fn(local)
    loss.backward()
    return {k: (None if v is None else v.detach()) for k, v in out.items()}, local.grad


def check_branch(parallel, world, mode, *, penalty=0.5, validate=True, chunk=None, backend=None, seed=0, **case_kw):
    student, data, weights, teacher = make_case(mode, seed=seed, **case_kw)
    snapshot = {k: v.clone() for k, v in data.items()}
    width = data["input_ids"].shape[1] - 1
    dout = torch.randn(student.shape[0], width, generator=torch.Generator().manual_seed(seed + 5), dtype=F64)
    s = student.clone().requires_grad_()
    want = ref.opd_full_loss_input(
        s, teacher, data["input_ids"], validate_decomposition=validate, reference_policy_kl_penalty=penalty
    )
    want_loss = (want["opd_full_divergence"] * dout).sum()
    if penalty:
        want_loss = want_loss + (want["next_token_logprobs"] * dout.flip(0)).sum()
    want_loss.backward()
    results = run_ranks(
        world, _opd_rank, parallel, mode, student, data, weights, (penalty, validate, chunk, dout), backend
    )
    errors = []
    for rank, (out, grad) in enumerate(results):
        if parallel == "tp2cp2":
            tp, cp, tp_rank, cp_rank = 2, 2, rank % 2, rank // 2
        else:
            tp, cp = (world, 1) if parallel == "tp" else (1, world)
            tp_rank, cp_rank = (rank, 0) if parallel == "tp" else (0, rank)
        assert set(out) == set(want)
        for key, value in want.items():
            if value is None:
                assert out[key] is None, key
            else:
                assert out[key].shape == (student.shape[0], width) and out[key].dtype == F64
                torch.testing.assert_close(out[key], value.detach(), atol=TOL, rtol=TOL)
                errors.append(float((out[key] - value.detach()).abs().max()))
        want_grad = s.grad.chunk(tp, dim=-1)[tp_rank]
        want_grad = lossfx.shard_for_cp_rank(want_grad, cp_rank, cp)
        torch.testing.assert_close(grad, want_grad, atol=TOL, rtol=TOL)
        errors.append(float((grad - want_grad).abs().max()))
    assert all(torch.equal(data[k], snapshot[k]) for k in snapshot) and set(data) == set(snapshot)
    return max(errors)


# ---------------------------------------------------------------------------------------------
# 1. The branch against the dense float64 reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["logits", "hidden_states"])
@pytest.mark.parametrize(("parallel", "world"), [("tp", 1), ("tp", 2), ("tp", 4), ("cp", 2)])
def test_branch_matches_reference_eager(parallel, world, mode):
    check_branch(parallel, world, mode, chunk=1)
    check_branch(parallel, world, mode, penalty=0.0, validate=False, seed=3)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["logits", "hidden_states"])
def test_branch_cp4(mode):
    check_branch("cp", 4, mode, seq=16, payload_len=13)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["logits", "hidden_states"])
@pytest.mark.parametrize("backend", [None, pytest.param("aot_eager", marks=[pytest.mark.compile, pytest.mark.slow])])
def test_branch_tp2_cp2(mode, backend):
    check_branch("tp2cp2", 4, mode, backend=backend, chunk=2)


@pytest.mark.compile
@pytest.mark.distributed
# by default each parallelism and each payload compiles once (tp x logits, cp x hidden states);
# the other two pairs with -m slow
@pytest.mark.parametrize(
    ("parallel", "world", "mode"),
    [
        ("tp", 2, "logits"),
        ("cp", 2, "hidden_states"),
        pytest.param("tp", 2, "hidden_states", marks=pytest.mark.slow),
        pytest.param("cp", 2, "logits", marks=pytest.mark.slow),
    ],
)
def test_branch_matches_reference_compiled(parallel, world, mode):
    check_branch(parallel, world, mode, backend="aot_eager")


def test_validate_decomposition_sums_and_saves_nothing():
    student, data, weights, _ = make_case("hidden_states")
    s = student.clone().requires_grad_()
    out = lossfx.prepare_opd_full_loss_input(
        s,
        data,
        loss_fn("hidden_states"),
        vocab_parallel_rank=None,
        vocab_parallel_group=None,
        context_parallel_group=None,
        sampling_params=None,
        chunk_size=None,
        teacher_output_layer_weight_by_index=weights,
    )
    torch.testing.assert_close(
        out["opd_full_entropy"] + out["opd_full_cross_entropy"],
        out["opd_full_divergence"].detach(),
        atol=1e-12,
        rtol=0,
    )
    assert not out["opd_full_entropy"].requires_grad and not out["opd_full_cross_entropy"].requires_grad
    assert out["opd_full_divergence"].requires_grad and "next_token_logprobs" not in out


def test_nemo_private_spelling_is_the_public_function():
    """docs/decisions.md §1: NeMo's `_prepare_opd_full_loss_input` stays importable as an alias."""
    from lossfx.loss_input import _prepare_opd_full_loss_input

    assert _prepare_opd_full_loss_input is lossfx.prepare_opd_full_loss_input


def test_identical_teacher_gives_zero_kl_and_grad():
    student, data, _, _ = make_case("logits", payload_len=8, extra_vocab=0)
    data["teacher_full_logits"] = student.clone()
    s = student.clone().requires_grad_()
    out, _ = lossfx.prepare_loss_input(s, data, loss_fn("logits", validate=False))
    out["opd_full_divergence"].sum().backward()
    assert bool((out["opd_full_divergence"] == 0).all()) and bool((s.grad == 0).all())


def test_bf16_student_fp32_teacher_and_dtype_rule():
    student, data, weights, _ = make_case("hidden_states")
    w32 = {k: w.float() for k, w in weights.items()}
    s = student.bfloat16().requires_grad_()
    args = {
        "vocab_parallel_rank": None,
        "vocab_parallel_group": None,
        "context_parallel_group": None,
        "sampling_params": None,
        "chunk_size": None,
    }
    out = lossfx.prepare_opd_full_loss_input(
        s, data, loss_fn("hidden_states"), teacher_output_layer_weight_by_index=w32, **args
    )
    assert out["opd_full_divergence"].dtype == torch.float32
    out["opd_full_divergence"].sum().backward()
    assert s.grad.dtype == torch.bfloat16
    # Output dtype rule: fp32 heads, float64 result = the unrounded product of the fp32 operands.
    logits = reconstruct_opd_full_teacher_logits(
        data["teacher_full_hidden_states"],
        teacher_payload="hidden_states",
        student_logits=student,
        vocab_parallel_rank=0,
        context_parallel_group=None,
        teacher_output_layer_weight_by_index=w32,
        teacher_index=data["opd_full_teacher_index"],
        output_dtype=F64,
    )
    want = ref.opd_full_teacher_logits(
        data["teacher_full_hidden_states"],
        8,
        teacher_payload="hidden_states",
        weights=w32,
        teacher_index=data["opd_full_teacher_index"],
    )
    assert logits.dtype == F64
    torch.testing.assert_close(logits, want, atol=1e-12, rtol=1e-12)
    logits32 = reconstruct_opd_full_teacher_logits(
        data["teacher_full_hidden_states"],
        teacher_payload="hidden_states",
        student_logits=student,
        vocab_parallel_rank=0,
        context_parallel_group=None,
        teacher_output_layer_weight_by_index=w32,
        teacher_index=data["opd_full_teacher_index"],
    )
    assert logits32.dtype == torch.float32


def test_logits_payload_keeps_its_dtype():
    student, data, _, _ = make_case("logits")
    payload = data["teacher_full_logits"].bfloat16()
    out = reconstruct_opd_full_teacher_logits(
        payload,
        teacher_payload="logits",
        student_logits=student,
        vocab_parallel_rank=0,
        context_parallel_group=None,
    )
    assert out.dtype == torch.bfloat16 and out.shape == student.shape


# ---------------------------------------------------------------------------------------------
# 2. Reconstruction (the reference's unit tests, §5.5)
# ---------------------------------------------------------------------------------------------


def _reconstruct(payload, mode, student_shape, rank=0, **kw):
    return reconstruct_opd_full_teacher_logits(
        payload,
        teacher_payload=mode,
        student_logits=torch.zeros(student_shape),
        vocab_parallel_rank=rank,
        context_parallel_group=None,
        **kw,
    )


def test_projects_hidden_states_through_the_teacher_lm_head():
    payload, w = torch.randn(2, 6, 3, dtype=F64), torch.randn(5, 3, dtype=F64)
    torch.testing.assert_close(
        _reconstruct(payload, "hidden_states", (2, 6, 5), teacher_output_layer_weight_by_index={0: w}),
        payload @ w.T,
    )


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_slices_this_ranks_vocabulary_window(rank):
    payload = torch.randn(2, 5, 12)
    assert torch.equal(_reconstruct(payload, "logits", (2, 5, 4), rank), payload[..., 4 * rank : 4 * rank + 4])


def test_right_pads_a_short_payload_on_the_sequence_dim():
    payload = torch.randn(2, 3, 4)
    out = _reconstruct(payload, "logits", (2, 5, 4))
    assert torch.equal(out[:, :3], payload) and bool((out[:, 3:] == 0).all())


def test_routes_each_row_through_its_own_teacher():
    payload = torch.randn(3, 4, 2, dtype=F64)
    heads = {0: torch.randn(5, 2, dtype=F64), 1: torch.randn(5, 2, dtype=F64)}
    out = _reconstruct(
        payload,
        "hidden_states",
        (3, 4, 5),
        teacher_output_layer_weight_by_index=heads,
        teacher_index=torch.tensor([1, 0, 1]),
    )
    for b, k in enumerate([1, 0, 1]):
        torch.testing.assert_close(out[b], payload[b] @ heads[k].T)
    one = _reconstruct(
        payload,
        "hidden_states",
        (3, 4, 5),
        teacher_output_layer_weight_by_index=heads,
        teacher_index=torch.tensor([1, 1, 1]),
    )
    torch.testing.assert_close(one, payload @ heads[1].T)


def test_compiled_routing_matches_eager():
    payload = torch.randn(3, 4, 2, dtype=F64)
    heads = {0: torch.randn(5, 2, dtype=F64), 1: torch.randn(5, 2, dtype=F64)}
    index = torch.tensor([1, 0, 1])
    student = torch.zeros(3, 4, 5)

    def fn(p, i):
        return reconstruct_opd_full_teacher_logits(
            p,
            teacher_payload="hidden_states",
            student_logits=student,
            vocab_parallel_rank=0,
            context_parallel_group=None,
            teacher_output_layer_weight_by_index=heads,
            teacher_index=i,
        )

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(payload, index), fn(payload, index))


HS = "hidden_states"


@pytest.mark.parametrize(
    ("mode", "payload_shape", "student_shape", "kw", "match"),
    on_device(
        [
            (
                HS,
                (2, 6, 3),
                (2, 6, 5),
                {"teacher_output_layer_weight_by_index": None},
                "requires a loaded teacher output-layer weight shard",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 5),
                {"teacher_output_layer_weight_by_index": {}},
                "requires a loaded teacher output-layer weight shard",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {"teacher_output_layer_weight_by_index": {0: torch.randn(4, 7)}},
                "do not match the loaded teacher LM head for teacher_index=0: payload width 3 vs LM-head input width 7",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {"teacher_output_layer_weight_by_index": {0: torch.randn(9, 3)}},
                "must match the student vocabulary shard width; got 9 vs 4",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {"teacher_output_layer_weight_by_index": {0: torch.randn(4, 3), 1: torch.randn(4, 3)}},
                ">1 shards",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {
                    "teacher_output_layer_weight_by_index": {0: torch.randn(4, 3), 1: torch.randn(4, 5)},
                    "teacher_index": torch.tensor([0, 0]),
                },
                "teacher_index=1: payload width 3 vs LM-head input width 5",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {
                    "teacher_output_layer_weight_by_index": {0: torch.randn(4, 3)},
                    "teacher_index": torch.tensor([0, 2]),
                },
                r"row tagged teacher_index=2, but no teacher LM head is loaded for that index \(loaded: \[0\]\)",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {
                    "teacher_output_layer_weight_by_index": {0: torch.randn(4, 3)},
                    "teacher_index": torch.tensor([0, 0, 0]),
                },
                "one entry per payload row",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {
                    "teacher_output_layer_weight_by_index": {
                        0: torch.randn(4, 3),
                        1: torch.randn(4, 3, dtype=F64),
                    },
                    "teacher_index": torch.tensor([0, 1]),
                },
                "share one vocabulary shard and dtype",
            ),
            (
                HS,
                (2, 6, 3),
                (2, 6, 4),
                {
                    "teacher_output_layer_weight_by_index": {0: torch.randn(4, 3), 1: torch.randn(5, 3)},
                    "teacher_index": torch.tensor([1, 0]),
                },
                "share one vocabulary shard and dtype",
            ),
            (
                "logits",
                (2, 3, 6),
                (2, 3, 4),
                {"rank": 1},
                "narrower than this rank's vocabulary window: payload width 6 vs required end 8",
            ),
            ("logits", (2, 9, 4), (2, 3, 4), {}, "longer than the student forward window: 9 vs 3"),
            ("logits", (2, 3, 4), (2, 3, 4), {"rank": None}, "vocab_parallel_rank is required"),
            ("logits", (3, 3, 4), (2, 3, 4), {}, "student's batch size"),
            ("bogus", (2, 3, 4), (2, 3, 4), {}, "teacher_payload"),
            ("logits", (2, 3, 4), (3, 4), {}, "rank 3"),
        ]
    ),
)
def test_reconstruct_errors(mode, payload_shape, student_shape, kw, match):
    kw = dict(kw)
    rank = kw.pop("rank", 0)
    with pytest.raises(ValueError, match=match):
        _reconstruct(torch.randn(*payload_shape), mode, student_shape, rank, **kw)


# ---------------------------------------------------------------------------------------------
# 3. Config and branch errors
# ---------------------------------------------------------------------------------------------


def test_config():
    cfg = OnPolicyDistillationFullConfig()
    assert (cfg.enabled, cfg.teacher_payload, cfg.divergence, cfg.payload_dtype, cfg.chunk_size) == (
        False,
        "hidden_states",
        "reverse_kl",
        "bfloat16",
        None,
    )
    assert (cfg.teacher_lm_head_lifecycle, cfg.validate_decomposition) == ("offload", False)
    with pytest.raises(ValueError, match=r"on_policy_distillation.full.chunk_size must be >= 1, got 0"):
        OnPolicyDistillationFullConfig(chunk_size=0)
    for field, bad in [
        ("teacher_payload", "x"),
        ("divergence", "forward_kl"),
        ("payload_dtype", "int8"),
        ("teacher_lm_head_lifecycle", "x"),
    ]:
        with pytest.raises(ValueError, match=field):
            OnPolicyDistillationFullConfig(**{field: bad})


def test_teacher_payload_one_rule():
    """`teacher_payload` has one rule and one message (`lossfx.opd_full._check_choice`), checked once
    per call: by the config dataclass, by the branch for a duck-typed config, and by
    `reconstruct_opd_full_teacher_logits` for its argument."""
    want = r"on_policy_distillation\.full\.teacher_payload must be one of \('hidden_states', 'logits'\), got 'bogus'"
    student, data, _, _ = make_case("logits")
    calls = [
        lambda: OnPolicyDistillationFullConfig(teacher_payload="bogus"),
        lambda: lossfx.prepare_loss_input(
            student, data, SimpleNamespace(input_type="opd_full", opd_full=SimpleNamespace(teacher_payload="bogus"))
        ),
        lambda: _reconstruct(torch.randn(2, 3, 4), "bogus", (2, 3, 4)),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=want):
            call()


def test_heads_checked_in_one_pass_in_key_order():
    """The heads' checks run once per head, in key order: each head's width, then its shard shape and
    dtype against the first key's (one loop; the message names both keys)."""
    heads = {2: torch.randn(4, 3), 0: torch.randn(4, 3, dtype=F64), 1: torch.randn(4, 3)}
    with pytest.raises(ValueError, match=r"float32 for teacher_index=1 vs \(4, 3\)/torch.float64 for teacher_index=0"):
        _reconstruct(
            torch.randn(2, 6, 3),
            "hidden_states",
            (2, 6, 4),
            teacher_output_layer_weight_by_index=heads,
            teacher_index=torch.tensor([0, 1]),
        )


def test_branch_errors_leave_data_untouched():
    student, data, weights, _ = make_case("logits")
    snapshot = dict(data)
    with pytest.raises(ValueError, match="requires the teacher payload column 'teacher_full_hidden_states'"):
        lossfx.prepare_loss_input(student, data, loss_fn("hidden_states"), teacher_output_layer_weight_by_index=weights)
    with pytest.raises(ValueError, match=r"loss_fn\.opd_full"):
        lossfx.prepare_loss_input(student, data, SimpleNamespace(input_type="opd_full"))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        lossfx.prepare_loss_input(
            student,
            data,
            SimpleNamespace(input_type="opd_full", opd_full=SimpleNamespace(teacher_payload="logits", chunk_size=0)),
        )
    with pytest.raises(ValueError, match="rank 3"):
        lossfx.prepare_loss_input(student[0], data, loss_fn("logits"))
    with pytest.raises(ValueError, match="student window"):
        lossfx.prepare_loss_input(student[:, :4], data, loss_fn("logits"))
    with pytest.raises(ValueError, match=r"input_ids.*must lie in"):
        bad = dict(data, input_ids=data["input_ids"] + 100)
        lossfx.prepare_loss_input(student, bad, loss_fn("logits", penalty=1.0))
    assert data == snapshot


def test_simple_namespace_config_and_no_group():
    student, data, _, teacher = make_case("logits")
    cfg = SimpleNamespace(teacher_payload="logits", chunk_size=None, validate_decomposition=False)
    out, same = lossfx.prepare_loss_input(
        student, data, SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=cfg)
    )
    assert same is data
    torch.testing.assert_close(
        out["opd_full_divergence"],
        ref.reverse_kl_to_fixed(student[:, :7], teacher[:, :7]),
        atol=TOL,
        rtol=TOL,
    )
    assert out["opd_full_entropy"] is None and out["opd_full_cross_entropy"] is None


# ---------------------------------------------------------------------------------------------
# 9. Hidden-states teacher projected chunk by chunk inside the divergence (issue 9.3)
# ---------------------------------------------------------------------------------------------


def _projected_case(n=9, vocab=16, hidden=5, heads=2, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(n, vocab, generator=g, dtype=F64) * 2).to(dtype)
    h = torch.randn(n, hidden, generator=g, dtype=F64).to(dtype)
    weights = [torch.randn(vocab, hidden, generator=g, dtype=F64).to(dtype) for _ in range(heads)]
    head = torch.randint(0, heads, (n,), generator=g)
    teacher = torch.stack([h[i].to(F64) @ weights[int(head[i])].to(F64).T for i in range(n)])  # [n, V]
    return student, h, weights, head, teacher


def _projected_rank(rank, world, group, kind, student, h, weights, head, chunk, dout, backend=None):
    s = student.tensor_split(world, dim=-1)[rank].clone().requires_grad_()
    shards = [w.tensor_split(world, dim=0)[rank] for w in weights]

    def fn(s):
        return divergence_to_projected_teacher(kind, s, h, shards, head, group=group, chunk_size=chunk)

    if backend is not None:
        _, fn = compiled_for_rank(rank, ("projected", kind, world, chunk), fn, backend)
    out = fn(s)
    (out * dout).sum().backward()
    return out.detach(), s.grad


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", ["reverse_kl", "cross_entropy"])
@pytest.mark.parametrize("chunk", [None, 1, 4])
def test_projected_teacher_matches_reference(world, kind, chunk):
    student, h, weights, head, teacher = _projected_case(seed=world + 3 * (chunk or 0))
    dout = torch.randn(student.shape[0], dtype=F64)
    want_fn = ref.reverse_kl_to_fixed if kind == "reverse_kl" else ref.cross_entropy_to_fixed
    s = student.clone().requires_grad_()
    want = want_fn(s, teacher)
    (want * dout).sum().backward()
    grads = s.grad.tensor_split(world, dim=-1)
    for rank, (out, grad) in enumerate(run_ranks(world, _projected_rank, kind, student, h, weights, head, chunk, dout)):
        torch.testing.assert_close(out, want.detach(), atol=TOL, rtol=TOL)
        torch.testing.assert_close(grad, grads[rank], atol=TOL, rtol=TOL)


def test_projected_teacher_gradcheck_and_no_teacher_grad():
    student, h, weights, head, _ = _projected_case(n=5, vocab=7)
    h.requires_grad_()
    weights = [w.requires_grad_() for w in weights]

    def fn(s):
        return divergence_to_projected_teacher("reverse_kl", s, h, weights, head, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (student.clone().requires_grad_(),))
    fn(student.clone().requires_grad_()).sum().backward()
    assert h.grad is None and all(w.grad is None for w in weights)


def _saved_bytes(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        fn()
    return saved


def test_branch_hidden_states_never_materialises_teacher_logits():
    """OPD_FULL with a hidden-states payload saves no `[B, S, Vl]` teacher tensor, and its eager
    fwd+bwd peak is the student gradient plus O(chunk), not plus the teacher logits."""
    from benchmarks.measure import peak_extra_bytes

    student, data, weights, _ = make_case("hidden_states", batch=2, seq=64, vocab=1024, hidden=8, payload_len=64)
    s = student.clone().requires_grad_()
    lf = loss_fn("hidden_states", validate=True, chunk=2)  # 2 positions x B=2 rows per chunk

    def run():
        out, _ = lossfx.prepare_loss_input(s, data, lf, teacher_output_layer_weight_by_index=weights)
        return torch.autograd.grad(out["opd_full_divergence"].sum(), s)[0]

    saved = _saved_bytes(lambda: lossfx.prepare_loss_input(s, data, lf, teacher_output_layer_weight_by_index=weights))
    assert all(x.numel() < s.numel() or x.data_ptr() == s.data_ptr() for x in saved)
    run()
    logits_bytes = s.numel() * s.element_size()
    chunk_bytes = 4 * 1024 * 8  # one [C = 4, Vl] float64 temporary
    peak = peak_extra_bytes(run)
    assert peak <= logits_bytes + 8 * chunk_bytes + 64 * 1024, (peak, logits_bytes)


@pytest.mark.compile
def test_projected_teacher_compiles_fullgraph_graph_independent_of_chunks():
    student, h, weights, head, teacher = _projected_case(n=12)

    def fn(s, chunk):
        return divergence_to_projected_teacher("reverse_kl", s, h, weights, head, chunk_size=chunk)

    nodes = []
    for chunk in (1, 5):
        explanation = torch._dynamo.explain(fn)(student.clone().requires_grad_(), chunk)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
        nodes.append(len(explanation.graphs[0].graph.nodes))
    assert nodes[0] == nodes[1]  # the chunk loop lives inside the custom op
    counter, compiled = compiled_for_rank(0, "projected-inductor", lambda s: fn(s, 3))
    s = student.clone().requires_grad_()
    out = compiled(s)
    out.sum().backward()
    s2 = student.clone().requires_grad_()
    want = ref.reverse_kl_to_fixed(s2, teacher)
    want.sum().backward()
    torch.testing.assert_close(out, want.detach(), atol=TOL, rtol=TOL)
    torch.testing.assert_close(s.grad, s2.grad, atol=TOL, rtol=TOL)
    assert counter.frame_count == 1
