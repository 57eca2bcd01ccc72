"""OPD_FULL from hidden states (`prepare_linear_loss_input`, `LossInputType.OPD_FULL`): values AND
gradients (hidden, weight, bias) against the logits path `prepare_loss_input(head(hidden @ W.T + b))`
and against the dense float64 reference (`reference.prepare_linear_loss_input`), for both teacher
payloads (logits columns; hidden states through per-row teacher heads), with and without the
decomposition metrics and the reference-KL log-probs; chunked and unchunked; on 1, 2 and 4 gloo
ranks (tensor-parallel heads of uneven widths, `Shard(0)` DTensor heads, load-balanced context
parallelism and its sharder); compiled (fullgraph, pinned recompiles); bad inputs.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import harness
import pytest
import torch

import lossfx
from lossfx import LossInputType, reference
from lossfx.opd_full import OnPolicyDistillationFullConfig

F64, F32 = torch.float64, torch.float32
B, S, H, HT, V, SP = 2, 8, 6, 5, 13, 6  # V = 13: uneven TP shards; SP < S: a short (zero-padded) payload
HEAD = {"temperature": 0.7, "logit_scale": 1.3, "softcap": 6.0}
# fp32 against float64: logits of magnitude <= 6/0.7 ≈ 9, V = 13 terms; fp32's eps 1.2e-7 times a
# few sums of that size stays under 1e-5 (measured ~1e-6); float64: 1e-10
TOL = {F64: {"atol": 1e-10, "rtol": 0}, F32: {"atol": 2e-5, "rtol": 2e-5}}
TEACHER_KEYS = (3, 7)


def make_case(payload: str, *, seed: int = 0, penalty: float = 0.5, validate: bool = True, chunk=None):
    """(hidden [B, S, H], weight [V, H], bias [V], data, loss_fn, full teacher heads or None), float64."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64)
    bias = torch.randn(V, generator=gen, dtype=F64)
    data: dict = {"input_ids": torch.randint(0, V, (B, S), generator=gen)}
    heads = None
    if payload == "logits":  # wider than V: the tail is never read
        data["teacher_full_logits"] = torch.randn(B, SP, V + 3, generator=gen, dtype=F64) * 3
    else:
        data["teacher_full_hidden_states"] = torch.randn(B, SP, HT, generator=gen, dtype=F64)
        data["opd_full_teacher_index"] = torch.tensor([7, 3])
        heads = {k: torch.randn(V, HT, generator=gen, dtype=F64) for k in TEACHER_KEYS}
    cfg = OnPolicyDistillationFullConfig(
        enabled=True, teacher_payload=payload, validate_decomposition=validate, chunk_size=chunk
    )
    loss_fn = SimpleNamespace(input_type=LossInputType.OPD_FULL, opd_full=cfg, reference_policy_kl_penalty=penalty)
    return hidden, weight, bias, data, loss_fn, heads


head_logits = functools.partial(harness.head_logits, head=HEAD)
_leaves, cotangents, grads = harness.leaves, harness.cotangents, harness.grads
_assert_dicts = functools.partial(harness.assert_dicts, requires_grad=True)


def _cast(data: dict, dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in data.items()}


# ---------------------------------------------------------------------------------------------
# One process: against the logits path and the float64 reference
# ---------------------------------------------------------------------------------------------

OPTIONS = [(0.5, True), (0.0, False)]  # (reference_policy_kl_penalty, validate_decomposition)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize(("penalty", "validate"), OPTIONS, ids=["all-outputs", "divergence-only"])
@pytest.mark.parametrize("payload", ["logits", "hidden_states"])
def test_one_process_matches_logits_path_and_reference(payload, penalty, validate, chunk_size, dtype):
    hidden, weight, bias, data, loss_fn, heads = make_case(payload, penalty=penalty, validate=validate)
    data_d = _cast(data, dtype)
    heads_d = None if heads is None else {k: w.to(dtype) for k, w in heads.items()}
    h, w, b = _leaves(dtype, hidden, weight, bias)
    snapshot = {k: v.clone() for k, v in data_d.items()}
    out, returned = lossfx.prepare_linear_loss_input(
        h, w, data_d, loss_fn, bias=b, chunk_size=chunk_size, teacher_output_layer_weight_by_index=heads_d, **HEAD
    )
    assert returned is data_d and all(torch.equal(data_d[k], snapshot[k]) for k in snapshot)  # not modified
    # the logits path on the same-dtype logits: same keys, dtypes, requires_grad; values and gradients
    h2, w2, b2 = _leaves(dtype, hidden, weight, bias)
    want, _ = lossfx.prepare_loss_input(
        head_logits(h2, w2, b2), data_d, loss_fn, chunk_size=chunk_size, teacher_output_layer_weight_by_index=heads_d
    )
    _assert_dicts(out, want, TOL[dtype], "vs logits path")
    cot = cotangents(want)
    got_grads = grads(out, cot, (h, w, b))
    for got_g, want_g in zip(got_grads, grads(want, cot, (h2, w2, b2))):
        torch.testing.assert_close(got_g.to(F64), want_g.to(F64), **TOL[dtype])
    # the float64 reference (dtypes are float64 there)
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    ref = reference.prepare_linear_loss_input(
        hr, wr, data_d, loss_fn, bias=br, teacher_output_layer_weight_by_index=heads_d, **HEAD
    )
    _assert_dicts(out, ref, TOL[dtype], "vs reference", dtypes=False)
    for got_g, want_g in zip(got_grads, grads(ref, cot, (hr, wr, br))):
        torch.testing.assert_close(got_g.to(F64), want_g, **TOL[dtype])


def test_teacher_logits_dtype_and_bf16_heads_as_the_logits_path():
    """A bf16 teacher head projected to float32 (`teacher_logits_dtype`): the logits path's
    rounding (hidden states rounded to the head's dtype, each product to float32)."""
    hidden, weight, bias, data, loss_fn, heads = make_case("hidden_states", seed=3)
    data = _cast(data, torch.bfloat16)
    heads = {k: w.to(torch.bfloat16) for k, w in heads.items()}
    kw = {"teacher_output_layer_weight_by_index": heads, "teacher_logits_dtype": F32}
    h, w, b = _leaves(F32, hidden, weight, bias)
    out, _ = lossfx.prepare_linear_loss_input(h, w, data, loss_fn, bias=b, **kw, **HEAD)
    h2, w2, b2 = _leaves(F32, hidden, weight, bias)
    want, _ = lossfx.prepare_loss_input(head_logits(h2, w2, b2), data, loss_fn, **kw)
    _assert_dicts(out, want, TOL[F32], "bf16 heads")
    cot = cotangents(want)
    for got_g, want_g in zip(grads(out, cot, (h, w, b)), grads(want, cot, (h2, w2, b2))):
        torch.testing.assert_close(got_g, want_g, **TOL[F32])


def test_masked_teacher_entries_as_the_logits_path():
    """A `-inf` teacher column under student mass: KL and CE `+inf`, no gradient from that row;
    an all `-inf` teacher row: `+inf` too; nothing NaN where the logits path is finite."""
    hidden, weight, bias, data, loss_fn, _ = make_case("logits", seed=5, penalty=0.0)
    payload = data["teacher_full_logits"].clone()
    payload[0, 1, 4] = -float("inf")
    payload[1, 2, :V] = -float("inf")
    data["teacher_full_logits"] = payload
    h, w, b = _leaves(F64, hidden, weight, bias)
    out, _ = lossfx.prepare_linear_loss_input(h, w, data, loss_fn, bias=b, **HEAD)
    h2, w2, b2 = _leaves(F64, hidden, weight, bias)
    want, _ = lossfx.prepare_loss_input(head_logits(h2, w2, b2), data, loss_fn)
    for k in want:
        assert torch.equal(out[k].isposinf(), want[k].isposinf()) and not out[k].isnan().any(), k
        fin = want[k].isfinite()
        torch.testing.assert_close(out[k][fin], want[k][fin], **TOL[F64])
    assert out["opd_full_divergence"][0, 1].isposinf() and out["opd_full_divergence"][1, 2].isposinf()
    cot = cotangents(want)
    for got_g, want_g in zip(grads(out, cot, (h, w, b)), grads(want, cot, (h2, w2, b2))):
        assert got_g.isfinite().all()
        torch.testing.assert_close(got_g, want_g, **TOL[F64])


def test_gradcheck():
    hidden, weight, bias, data, loss_fn, heads = make_case("hidden_states", seed=2)
    hidden, weight = hidden[:, :4, :3], weight[:, :3]  # small: gradcheck is O(inputs)
    data = {
        **data,
        "input_ids": data["input_ids"][:, :4],
        "teacher_full_hidden_states": data["teacher_full_hidden_states"][:, :3],
    }

    def fn(h, w, b):
        out, _ = lossfx.prepare_linear_loss_input(
            h, w, data, loss_fn, bias=b, chunk_size=1, teacher_output_layer_weight_by_index=heads, **HEAD
        )
        return tuple(v for k, v in sorted(out.items()) if v is not None and v.requires_grad)

    assert torch.autograd.gradcheck(fn, tuple(_leaves(F64, hidden, weight, bias)))


# ---------------------------------------------------------------------------------------------
# Bad inputs: ValueError / TypeError naming the argument
# ---------------------------------------------------------------------------------------------


def _bad(change: str):
    hidden, weight, bias, data, loss_fn, heads = make_case("hidden_states")
    kw: dict = {"teacher_output_layer_weight_by_index": heads}
    if change == "no config":
        loss_fn = SimpleNamespace(input_type=LossInputType.OPD_FULL)
    elif change == "bad payload kind":
        loss_fn = SimpleNamespace(input_type=LossInputType.OPD_FULL, opd_full=SimpleNamespace(teacher_payload="x"))
    elif change == "missing payload":
        data = {"input_ids": data["input_ids"]}
    elif change == "no heads":
        kw = {}
    elif change == "head width":
        kw = {"teacher_output_layer_weight_by_index": {k: w[:5] for k, w in heads.items()}}
    elif change == "payload width":
        data = {**data, "teacher_full_hidden_states": torch.zeros(B, SP, HT + 1, dtype=F64)}
    elif change == "no index":
        data = {k: v for k, v in data.items() if k != "opd_full_teacher_index"}
    elif change == "flat input_ids":
        data = {**data, "input_ids": data["input_ids"].reshape(-1)}
    elif change == "long input_ids":
        data = {**data, "input_ids": torch.zeros(B, S + 1, dtype=torch.int64)}
    elif change == "id out of range":
        data = {**data, "input_ids": data["input_ids"].clone().fill_(V)}
    elif change == "narrow logits payload":
        _, _, _, data, loss_fn, _ = make_case("logits")
        data = {**data, "teacher_full_logits": data["teacher_full_logits"][..., : V - 1]}
    elif change == "bad chunk":
        loss_fn = SimpleNamespace(
            input_type=LossInputType.OPD_FULL, opd_full=SimpleNamespace(teacher_payload="logits", chunk_size=0)
        )
    elif change == "teacher dtype":
        kw["teacher_logits_dtype"] = "float32"
    return lambda: lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn, bias=bias, **kw)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("no config", ValueError, "requires loss_fn.opd_full"),
        ("bad payload kind", ValueError, "teacher_payload must be"),
        ("missing payload", ValueError, "teacher_full_hidden_states"),
        ("no heads", ValueError, "teacher_output_layer_weight_by_index is empty"),
        ("head width", ValueError, "must match the student vocabulary shard width"),
        ("payload width", ValueError, "payload width 6 vs LM-head input width 5"),
        ("no index", ValueError, "opd_full_teacher_index"),
        ("flat input_ids", ValueError, r"input_ids must be \[B, S\]"),
        ("long input_ids", ValueError, "more than the student window"),
        ("id out of range", ValueError, "input_ids"),
        ("narrow logits payload", ValueError, "narrower than this rank's vocabulary window"),
        ("bad chunk", ValueError, "chunk_size"),
        ("teacher dtype", TypeError, "teacher_logits_dtype"),
    ],
)
def test_bad_inputs_raise_naming_them(change, error, match):
    with pytest.raises(error, match=match):
        _bad(change)()


# ---------------------------------------------------------------------------------------------
# Compiled: fullgraph, one compile, no recompile for new values of the same shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize(
    "payload",  # ~10-25 s per compile on the loaded 2-core VM: the projected teacher by default
    [pytest.param("logits", marks=pytest.mark.slow), "hidden_states"],
)
def test_compiled_fullgraph_matches_eager(payload):
    from torch._dynamo.testing import CompileCounterWithBackend

    _, _, _, data, loss_fn, heads = make_case(payload, seed=11)
    column = "teacher_full_logits" if payload == "logits" else "teacher_full_hidden_states"

    def step(h, w, b, ids, teacher):
        out, _ = lossfx.prepare_linear_loss_input(
            h,
            w,
            {**data, "input_ids": ids, column: teacher},
            loss_fn,
            bias=b,
            teacher_output_layer_weight_by_index=heads,
            **HEAD,
        )
        return {k: v for k, v in out.items() if v is not None}

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter, dynamic=False)
    for seed in (11, 12):
        hidden, weight, bias, data2, _, _ = make_case(payload, seed=seed)
        h, w, b = _leaves(F64, hidden, weight, bias)
        out = compiled(h, w, b, data2["input_ids"], data2[column])
        h2, w2, b2 = _leaves(F64, hidden, weight, bias)
        want = step(h2, w2, b2, data2["input_ids"], data2[column])
        _assert_dicts(out, want, TOL[F64], f"compiled {payload}")
        cot = cotangents(want)
        for got_g, want_g in zip(grads(out, cot, (h, w, b)), grads(want, cot, (h2, w2, b2))):
            torch.testing.assert_close(got_g, want_g, **TOL[F64])
    assert counter.frame_count == 1, counter.frame_count


@pytest.mark.slow  # Inductor compiles (~40 s on the loaded 2-core VM)
@pytest.mark.compile
def test_compiled_inductor_pinned_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    def step(h, w, b, data, heads):
        out, _ = lossfx.prepare_linear_loss_input(
            h, w, data, loss_fn, bias=b, teacher_output_layer_weight_by_index=heads, **HEAD
        )
        return out["opd_full_divergence"].sum() + out["next_token_logprobs"].sum()

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for seed in (1, 2):
        hidden, weight, bias, data, loss_fn, heads = make_case("hidden_states", seed=seed)
        h, w, b = _leaves(F64, hidden, weight, bias)
        loss = compiled(h, w, b, data, heads)
        h2, w2, b2 = _leaves(F64, hidden, weight, bias)
        want = step(h2, w2, b2, data, heads)
        torch.testing.assert_close(loss, want, **TOL[F64])
        for got_g, want_g in zip(torch.autograd.grad(loss, (h, w, b)), torch.autograd.grad(want, (h2, w2, b2))):
            torch.testing.assert_close(got_g, want_g, **TOL[F64])
    assert counter.frame_count == 1, counter.frame_count


# ---------------------------------------------------------------------------------------------
# Several ranks (gloo): uneven TP heads, DTensor heads, load-balanced CP and its sharder
# ---------------------------------------------------------------------------------------------


_widths = functools.partial(harness.uneven_widths, V)


def ranked_case(rank, world, group, payload, mode, dtype_name):
    """One rank's call: `mode` "tp" (the student and teacher heads split in uneven rows), "cp" /
    "sharder" (the sequence load-balanced over the world). Returns outputs and gradients."""
    dtype = getattr(torch, dtype_name)
    hidden, weight, bias, data, loss_fn, heads = make_case(payload, seed=7)
    h_local, w_local, b_local, rows, layout = harness.split_head_call(mode, rank, world, group, hidden, weight, bias)
    heads = None if heads is None else {k: x[rows] for k, x in heads.items()}  # the teacher heads' rows too
    kw: dict = dict(HEAD, **layout)
    h, w, b = _leaves(dtype, h_local, w_local, b_local)
    out, _ = lossfx.prepare_linear_loss_input(
        h, w, data, loss_fn, bias=b, chunk_size=3, teacher_output_layer_weight_by_index=heads, **kw
    )
    cot = cotangents(out)
    scale = 1 if mode == "tp" else world  # the summed CP convention: divide the loss by C
    return {k: None if v is None else v.detach() for k, v in out.items()}, grads(out, cot, (h, w, b), scale)


def _check_ranked(results, payload, mode, dtype):
    hidden, weight, bias, data, loss_fn, heads = make_case(payload, seed=7)
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    ref = reference.prepare_linear_loss_input(
        hr, wr, data, loss_fn, bias=br, teacher_output_layer_weight_by_index=heads, **HEAD
    )
    for rank, (values, _) in enumerate(results):
        _assert_dicts(
            values,
            {k: None if v is None else v.detach() for k, v in ref.items()},
            TOL[dtype],
            f"{mode} r{rank}",
            dtypes=False,
        )
    harness.assert_head_grads(results, grads(ref, cotangents(ref), (hr, wr, br)), mode, TOL[dtype])


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("payload", "mode"), [("logits", "tp"), ("hidden_states", "tp"), ("hidden_states", "cp"), ("logits", "sharder")]
)
def test_two_gloo_ranks(payload, mode):
    results = harness.gloo_pool(2).run(ranked_case, payload, mode, "float64")
    _check_ranked(results, payload, mode, F64)


@pytest.mark.xdist_group("gloo4")  # one 4-process pool per session (addopts: --dist loadgroup)
@pytest.mark.slow  # a 4-process gloo pool (~30 s to start on the loaded 2-core VM); 2 ranks cover TP by default
@pytest.mark.distributed
@pytest.mark.parametrize(("payload", "mode"), [("logits", "tp"), ("hidden_states", "tp"), ("hidden_states", "cp")])
def test_four_gloo_ranks(payload, mode):
    results = harness.gloo_pool(4).run(ranked_case, payload, mode, "float32")
    _check_ranked(results, payload, mode, F32)


def dtensor_case(rank, world, group, payload):
    """`Shard(0)` DTensor student head, bias and teacher heads (V = 13 over 2 ranks: 7 and 6 rows,
    torch's split), no group arguments."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = harness.device_mesh((world,))
    hidden, weight, bias, data, loss_fn, heads = make_case(payload, seed=7)
    h = hidden.clone().requires_grad_(True)
    w = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_(True)
    b = distribute_tensor(bias, mesh, [Shard(0)], src_data_rank=None).requires_grad_(True)
    if heads is not None:
        heads = {k: distribute_tensor(x, mesh, [Shard(0)], src_data_rank=None) for k, x in heads.items()}
    out, _ = lossfx.prepare_linear_loss_input(
        h, w, data, loss_fn, bias=b, chunk_size=3, teacher_output_layer_weight_by_index=heads, **HEAD
    )
    loss = sum((out[k].to(F64) * g).sum() for k, g in cotangents(out).items())
    loss.backward()
    values = {k: None if v is None else v.detach() for k, v in out.items()}
    return values, (h.grad, w.grad.full_tensor(), b.grad.full_tensor())


@pytest.mark.distributed
@pytest.mark.parametrize("payload", ["logits", "hidden_states"])
def test_dtensor_heads_two_gloo_ranks(payload):
    results = harness.gloo_pool(2).run(dtensor_case, payload)
    hidden, weight, bias, data, loss_fn, heads = make_case(payload, seed=7)
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    ref = reference.prepare_linear_loss_input(
        hr, wr, data, loss_fn, bias=br, teacher_output_layer_weight_by_index=heads, **HEAD
    )
    want_grads = grads(ref, cotangents(ref), (hr, wr, br))
    for rank, (values, got) in enumerate(results):
        _assert_dicts(
            values, {k: None if v is None else v.detach() for k, v in ref.items()}, TOL[F64], f"r{rank}", dtypes=False
        )
        for name, g, want in zip("hwb", got, want_grads):
            torch.testing.assert_close(g.to(F64), want, **TOL[F64], msg=lambda m, n=name, r=rank: f"r{r} d{n}: {m}")


def disagreeing_ranks(rank, world, group):
    """The replicated teacher payload differs between the ranks: every rank raises, the same error."""
    hidden, weight, _, data, loss_fn, _ = make_case("logits")
    payload = data["teacher_full_logits"].clone()
    payload[0, 0, 0] += rank
    widths = _widths(world)
    rows = slice(sum(widths[:rank]), sum(widths[: rank + 1]))
    calls = {
        "payload": lambda: lossfx.prepare_linear_loss_input(
            hidden,
            weight[rows],
            {**data, "teacher_full_logits": payload},
            loss_fn,
            vocab_parallel_group=group,
            vocab_parallel_rank=rank,
        )
    }
    return harness.value_error_messages(calls)


@pytest.mark.distributed
def test_cross_rank_check_raises_on_every_rank():
    messages = harness.gloo_pool(2).run(disagreeing_ranks)
    assert all("teacher_full_logits" in m["payload"] for m in messages), messages
    assert messages[0]["payload"] == messages[1]["payload"], messages
