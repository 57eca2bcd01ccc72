"""The pure OPD_FULL layout (`lossfx._layouts.opd_full`) against the float64 reference, and the
boundary of its public faces (`prepare_opd_full_loss_input`, `prepare_loss_input`'s OPD_FULL
branch, `reconstruct_opd_full_teacher_logits`): one public
call validates once, range-checks the ids once, enters the pure code once and calls no other
public function; DTensor logits and heads are unwrapped once (no re-entry on local tensors).

Sections: 1 the teacher (logits window, hidden states through per-row heads); 2 the OPD_FULL
quantities, values and gradients (1 and 2 ranks: even and uneven `VocabRange`, CP); 3 the
boundary counts (plain, rank threads, uneven DTensor logits and `Shard(0)` heads on gloo).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE
from harness import run_ranks
from test_pure_distillation import install_counters

import lossfx
from lossfx import reference
from lossfx._core.vocab import VocabRange
from lossfx._layouts import opd_full as pure
from lossfx._layouts.sequence_layout import LoadBalancedLayout, PlainLayout

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
B, S, S_P, H, V = 3, 6, 5, 4, 8
PENALTY = 0.5
KEYS = ("opd_full_divergence", "opd_full_entropy", "opd_full_cross_entropy", "next_token_logprobs")
INDEX = torch.tensor([7, 3, 7]).to(DEVICE)  # each row's teacher; position in [W3, W7]: 1, 0, 1
POSITION = torch.tensor([1, 0, 1]).to(DEVICE)


def _case(vocab=V, window=S, seed=0):
    """Student `[B, window, V]` (`window >= S`), ids `[B, S]`, payloads, two heads `[V, H]`, upstreams."""
    g = torch.Generator().manual_seed(seed + vocab)
    return {
        "z": torch.randn(B, window, vocab, generator=g, dtype=F64) * 2,
        "ids": torch.randint(0, vocab, (B, S), generator=g),
        "hidden": torch.randn(B, S_P, H, generator=g, dtype=F64),
        "logits": torch.randn(B, S_P, vocab, generator=g, dtype=F64),
        "heads": {k: torch.randn(vocab, H, generator=g, dtype=F64) for k in (3, 7)},
        "dout": torch.randn(2, B, S - 1, generator=g, dtype=F64),
    }


def _teacher(c, payload, window):
    if payload == "logits":
        return reference.opd_full_teacher_logits(c["logits"], window, teacher_payload="logits")
    return reference.opd_full_teacher_logits(
        c["hidden"], window, teacher_payload="hidden_states", weights=c["heads"], teacher_index=INDEX
    )


def _loss(out, dout):
    return (out["opd_full_divergence"] * dout[0]).sum() + (out["next_token_logprobs"] * dout[1]).sum()


def _reference(payload, window=S, vocab=V):
    c = _case(vocab, window)
    z = c["z"].clone().requires_grad_()
    want = reference.opd_full_loss_input(
        z, _teacher(c, payload, window), c["ids"], validate_decomposition=True, reference_policy_kl_penalty=PENALTY
    )
    _loss(want, c["dout"]).backward()
    return {k: want[k].detach() for k in KEYS}, z.grad


# ---------------------------------------------------------------------------------------------
# 1. The teacher
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", ["logits", "hidden_states"])
@pytest.mark.parametrize("widths", [[V], [4, 4], [5, 3]], ids=["one", "even", "uneven"])
def test_pure_teacher_logits_against_reference(payload, widths):
    """Each rank's columns `[start, start + w)` of the dense teacher, zero-padded to the window."""
    c = _case()
    want = _teacher(c, payload, S)
    for rank, width in enumerate(widths):
        start = sum(widths[:rank])
        kwargs = {"columns": (start, width)}
        if payload == "hidden_states":
            kwargs = {"heads": [c["heads"][k][start : start + width] for k in (3, 7)], "position": POSITION}
        got = pure.teacher_logits(
            c[payload.split("_")[0]], PlainLayout(), S, DEVICE, **kwargs
        )  # fmt: skip
        torch.testing.assert_close(got, want[..., start : start + width], **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. The OPD_FULL quantities
# ---------------------------------------------------------------------------------------------


def _pure_rank(rank, world, group, mode, widths, payload):
    """One rank's pure call (`mode` "tp": vocabulary columns of `widths`; "cp": the load-balanced
    sequence part of an `S_l · C = 8` window); its outputs and its gradient."""
    window = S if mode == "tp" else 8
    c = _case(window=window)
    if mode == "tp":
        start, width = sum(widths[:rank]), widths[rank]
        local = c["z"][..., start : start + width].clone().requires_grad_()
        layout, vocab, group_ = PlainLayout(), VocabRange(group, start, V), group
    else:
        start, width = 0, V
        layout = LoadBalancedLayout(group) if world > 1 else PlainLayout()
        local = reference.cp_shard(c["z"], rank, world).clone().requires_grad_()
        vocab, group_ = VocabRange.whole(V), None
    teacher: dict = {"columns": (start, width)}
    if payload == "hidden_states":
        teacher = {"heads": [c["heads"][k][start : start + width] for k in (3, 7)], "position": POSITION}
    out = pure.opd_full_loss_input(
        local,
        c[payload.split("_")[0]],
        S,
        layout,
        group_,
        **teacher,
        validate_decomposition=True,
        chunk_rows=4,
        teacher_logits_dtype=None,
        logprobs=(local, c["ids"], vocab, 5),
    )
    _loss(out, c["dout"]).backward()
    assert not out["opd_full_entropy"].requires_grad and not out["opd_full_cross_entropy"].requires_grad
    return {k: out[k].detach() for k in KEYS}, local.grad


@pytest.mark.parametrize("payload", ["logits", "hidden_states"])
@pytest.mark.parametrize(
    ("world", "mode", "widths"),
    [(1, "tp", [V]), (2, "tp", [4, 4]), (2, "tp", [5, 3]), (2, "cp", None)],
    ids=["one", "tp2", "tp2-uneven", "cp2"],
)
def test_pure_opd_full_against_reference(world, mode, widths, payload):
    window = S if mode == "tp" else 8
    want, want_grad = _reference(payload, window)
    for rank, (out, grad) in enumerate(run_ranks(world, _pure_rank, mode, widths, payload)):
        for key in KEYS:
            torch.testing.assert_close(out[key], want[key], **TIGHT)
        if mode == "tp":
            start = sum(widths[:rank])
            expected = want_grad[..., start : start + widths[rank]]
        else:  # summed over CP ranks: every rank's loss is the whole loss
            expected = world * reference.cp_shard(want_grad, rank, world)
        torch.testing.assert_close(grad, expected, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 3. The boundary: once per public call, no nested public call
# ---------------------------------------------------------------------------------------------


def _loss_fn():
    cfg = lossfx.OnPolicyDistillationFullConfig(
        enabled=True, teacher_payload="hidden_states", validate_decomposition=True
    )
    return SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=cfg, reference_policy_kl_penalty=PENALTY)


LOSS_FN = _loss_fn()
ONCE = {"public calls": 1, "pure": 1, "range checks": 1}
ONCE_RECONSTRUCT = {"public calls": 1, "pure": 1}  # no ids


def _calls(logits, c, heads, rank, group):
    data = {"input_ids": c["ids"], "teacher_full_hidden_states": c["hidden"], "opd_full_teacher_index": INDEX}
    tp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group}
    entry = {**tp, "context_parallel_group": None, "sampling_params": None, "chunk_size": None}
    return {
        "prepare_opd_full_loss_input": lambda: lossfx.prepare_opd_full_loss_input(
            logits, data, LOSS_FN, teacher_output_layer_weight_by_index=heads, **entry
        ),
        "prepare_loss_input": lambda: lossfx.prepare_loss_input(
            logits, data, LOSS_FN, teacher_output_layer_weight_by_index=heads, **tp
        )[0],
        "reconstruct_opd_full_teacher_logits": lambda: lossfx.reconstruct_opd_full_teacher_logits(
            c["hidden"],
            teacher_payload="hidden_states",
            student_logits=logits,
            vocab_parallel_rank=rank,
            context_parallel_group=None,
            teacher_output_layer_weight_by_index=heads,
            teacher_index=INDEX,
        ),
    }


NAMES = list(_calls(None, _case(), None, None, None))


def _counted(call):
    counts: dict[str, list[int]] = {}
    undo = install_counters(counts, pure, ("opd_full_loss_input", "teacher_logits"))
    try:
        out = call()
    finally:
        undo()
    return out, {key: len(calls) for key, calls in counts.items()}


def _rank_call(rank, world, group, name):
    c = _case()
    local = c["z"].chunk(world, -1)[rank]
    heads = {k: w.chunk(world, 0)[rank] for k, w in c["heads"].items()}
    return _calls(local, c, heads, rank if world > 1 else None, group)[name]()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_one_public_call_validates_once_and_enters_the_pure_code_once(name, world):
    """Plain tensors, with and without a group (the cross-rank check runs too): on each rank one
    range check of the ids, one pure call and no nested public call; the values are the reference's."""
    want, _ = _reference("hidden_states")
    results, counts = _counted(lambda: run_ranks(world, _rank_call, name))
    once = ONCE_RECONSTRUCT if name == "reconstruct_opd_full_teacher_logits" else ONCE
    assert counts == {key: world * n for key, n in once.items()}
    for rank, out in enumerate(results):
        if name == "reconstruct_opd_full_teacher_logits":
            teacher = _teacher(_case(), "hidden_states", S)
            torch.testing.assert_close(out, teacher.chunk(world, -1)[rank], **TIGHT)
            continue
        for key in KEYS:
            torch.testing.assert_close(out[key], want[key], **TIGHT)


def gloo_dtensor_count_job(rank, world, group, z, hidden, heads, ids):
    """Uneven `Shard(2)` DTensor logits (V = 11 over 2 ranks: 6 + 5) and `Shard(0)` DTensor heads on
    a real gloo mesh: each public call unwraps once, validates once, enters the pure code once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    logits = distribute_tensor(z, mesh, [Shard(2)], src_data_rank=None)
    dheads = {k: distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None) for k, w in heads.items()}
    c = {"ids": ids, "hidden": hidden}
    results = []
    for name, call in _calls(logits, c, dheads, None, None).items():
        out, counts = _counted(call)
        if name == "reconstruct_opd_full_teacher_logits":
            assert counts == ONCE_RECONSTRUCT, (name, counts)
            results.append(out.full_tensor())
        else:
            assert counts == ONCE, (name, counts)
            results.extend(out[key] for key in KEYS)
    return results


@pytest.mark.distributed
def test_dtensor_public_calls_validate_once_on_gloo():
    from harness import gloo_pool

    c = _case(vocab=11)
    want, _ = _reference("hidden_states", vocab=11)
    teacher = _teacher(c, "hidden_states", S)
    expected = [*(want[k] for k in KEYS)] * 2 + [teacher]
    for got in gloo_pool(2).run(gloo_dtensor_count_job, c["z"], c["hidden"], c["heads"], c["ids"]):
        assert len(got) == len(expected)
        for out, ref in zip(got, expected, strict=True):
            torch.testing.assert_close(out, ref, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 4. Compiled
# ---------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_pure_opd_full_compiles_without_graph_breaks():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    vocab = VocabRange.whole(V)

    def fn(z, payload, ids):
        return pure.opd_full_loss_input(
            z,
            payload,
            S,
            PlainLayout(),
            None,
            columns=(0, V),
            validate_decomposition=True,
            chunk_rows=None,
            teacher_logits_dtype=None,
            logprobs=(z, ids, vocab, None),
        )

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for seed in (0, 1):
        c = _case(seed=seed)
        want = reference.opd_full_loss_input(
            c["z"], _teacher(c, "logits", S), c["ids"], validate_decomposition=True, reference_policy_kl_penalty=PENALTY
        )
        got = compiled(c["z"], c["logits"], c["ids"])
        for key in KEYS:
            torch.testing.assert_close(got[key], want[key], **TIGHT)
    assert counter.frame_count == 1


def gloo_rejected_head_job(rank, world, group, z, hidden, heads, ids):
    """Rank 1 passes its head as a `Shard(1)` DTensor (rejected: not the vocabulary dim), rank 0 as
    `Shard(0)`: each rank's error message (None if it did not raise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    logits = distribute_tensor(z, mesh, [Shard(2)], src_data_rank=None)
    placement = Shard(1) if rank == 1 else Shard(0)
    dheads = {k: distribute_tensor(w, mesh, [placement], src_data_rank=None) for k, w in heads.items()}
    messages = []
    for name, call in _calls(logits, {"ids": ids, "hidden": hidden}, dheads, None, None).items():
        if name in ("prepare_opd_full_loss_input", "prepare_loss_input"):
            try:
                call()
                messages.append(None)
            except ValueError as err:
                messages.append(str(err))
    return messages


@pytest.mark.distributed
def test_a_head_rejected_on_one_rank_raises_on_every_rank(monkeypatch):
    """A DTensor head that one rank's boundary rejects is a field of the cross-rank check, not an
    error before its collective (where the other rank would wait): every rank raises, none hangs."""
    import harness

    monkeypatch.setattr(harness, "_TIMEOUT_S", 120.0)
    c = _case(vocab=12)
    for rank, messages in enumerate(
        harness.gloo_pool(2).run(gloo_rejected_head_job, c["z"], c["hidden"], c["heads"], c["ids"])
    ):
        for message in messages:
            assert message is not None, f"rank {rank} did not raise"
            assert "DTensor arguments rejected" in message, message
