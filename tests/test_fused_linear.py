"""Tests of the fused LM-head path: `linear_token_logprobs`, `linear_gather_logprobs`,
`linear_next_token_logprobs` (hidden states x LM head -> log-probs, logits never materialised).

Sections: 0 helpers; 1 reference equivalence (float64, 1e-10, TP 1/2/4 x both hidden layouts x
chunk sizes 1, 7, > N; uneven shards); 2 gather (both conventions), next-token and context
parallelism; 3 low precision; 4 properties (hypothesis, 1/2/4 rank threads); 5 gradients
(gradcheck); 6 compile (fullgraph, recompile counts, graph independent of the chunk count);
7 real gloo processes; 8 errors; 9 memory contract.

Rank `r` holds rows `[r·Vl, (r+1)·Vl)` of the full LM head. With the replicated hidden layout
every rank's `hidden.grad` must equal the reference gradient; with `sequence_parallel=True` rank
`r` holds rows `[r·N/R, (r+1)·N/R)` of the flattened hidden states and the ranks' gradients,
concatenated, must equal it. The weight gradients, concatenated in rank order, must equal the
reference's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch._dynamo.testing
from harness import compiled_for_rank, gloo_pool, mesh_groups, run_ranks, shard_rows
from hypothesis import given
from hypothesis import strategies as st

import lossfx
from lossfx import reference
from lossfx._core.chunking import CPU_POLICY, chunk_policy
from lossfx.context_parallel import shard_for_cp_rank
from lossfx.next_token import LoadBalancedSharder

F64 = torch.float64
TIGHT = {"rtol": 0.0, "atol": 1e-10}
_keys = itertools.count()

# ---------------------------------------------------------------------------------------------
# 0. Helpers
# ---------------------------------------------------------------------------------------------


def make_case(rows, hidden_size, vocab, *, seed=0, dtype=F64, scale=1.0, k=None):
    """hidden `[*rows, H]`, weight `[V, H]`, ids `[*rows]` (or `[*rows, K]`) and upstream grads.

    Values are drawn in float64 and then cast, so the float64 truth of a low-precision case is the
    exact upcast of the inputs the kernel sees.
    """
    rows = tuple(rows) if isinstance(rows, (tuple, list)) else (rows,)
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*rows, hidden_size, generator=gen, dtype=F64) * scale).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, dtype=F64) / math.sqrt(hidden_size) * 3).to(dtype)
    id_shape = rows if k is None else (*rows, k)
    ids = torch.randint(0, vocab, id_shape, generator=gen)
    dout = torch.randn(id_shape, generator=gen, dtype=F64)
    dent = torch.randn(rows, generator=gen, dtype=F64)
    return hidden, weight, ids, dout, dent


def reference_token(hidden, weight, target, dout, dent, temperature=1.0):
    """(logprobs, neg_entropy, dhidden, dweight) of the dense float64 reference."""
    h = hidden.detach().to(F64).requires_grad_()
    w = weight.detach().to(F64).requires_grad_()
    lp, ne = reference.linear_token_logprobs(h, w, target, temperature)
    dh, dw = torch.autograd.grad([lp, ne], [h, w], [dout.to(F64), dent.to(F64)])
    return lp.detach(), ne.detach(), dh, dw


def _token_rank(rank, world, group, hidden, weight, target, dout, dent, chunk, temperature, sp, compiled=None):
    """One rank of `linear_token_logprobs` with both outputs and their backward."""
    vl = weight.shape[0] // world
    w = weight[rank * vl : (rank + 1) * vl].detach().clone().requires_grad_()
    h = (shard_rows(hidden, rank, world) if sp else hidden).detach().clone().requires_grad_()

    def fn(h, w, target):
        return lossfx.linear_token_logprobs(
            h,
            w,
            target,
            group=group,
            temperature=temperature,
            sequence_parallel=sp,
            chunk_size=chunk,
            return_neg_entropy=True,
        )

    counter = None
    if compiled is not None:
        counter, fn = compiled_for_rank(rank, (compiled, world, chunk, temperature, sp), fn, compiled[0])
    lp, ne = fn(h, w, target)
    torch.autograd.backward([lp, ne], [dout.to(lp.dtype), dent.to(ne.dtype)])
    frames = None if counter is None else counter.frame_count
    return lp.detach(), ne.detach(), h.grad, w.grad, frames


def run_token(world, case, *, chunk=None, temperature=1.0, sp=False, compiled=None):
    """Run on `world` rank threads -> (lp, ne, dhidden, dweight, frame counts); checks replication."""
    hidden, weight, target, dout, dent = case
    results = run_ranks(world, _token_rank, hidden, weight, target, dout, dent, chunk, temperature, sp, compiled)
    lp0, ne0 = results[0][0], results[0][1]
    for rank, res in enumerate(results[1:], start=1):
        assert torch.equal(res[0], lp0), f"rank {rank} logprobs differ from rank 0"
        assert torch.equal(res[1], ne0), f"rank {rank} neg_entropy differs from rank 0"
    if sp:
        dh = torch.cat([res[2] for res in results]).view(hidden.shape)
    else:
        dh = results[0][2]
        for rank, res in enumerate(results[1:], start=1):
            torch.testing.assert_close(res[2], dh, rtol=0, atol=1e-12, msg=f"rank {rank} hidden.grad differs")
    dw = torch.cat([res[3] for res in results])
    return lp0, ne0, dh, dw, [res[4] for res in results]


def assert_matches(actual, expected, tol, what=""):
    names = ("logprobs", "neg_entropy", "dhidden", "dweight")
    for name, a, e in zip(names, actual, expected, strict=False):
        torch.testing.assert_close(a.to(F64), e, msg=lambda m, name=name: f"{what} {name}: {m}", **tol)


# ---------------------------------------------------------------------------------------------
# 1. Reference equivalence: float64, 1e-10, TP 1/2/4 x both hidden layouts x chunk sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_token_matches_reference(world, sp, chunk):
    case = make_case((4, 6), 16, 36, seed=world * 10 + chunk, scale=2.0)
    out = run_token(world, case, chunk=chunk, temperature=0.7, sp=sp)
    expected = reference_token(*case, temperature=0.7)
    assert_matches(out, expected, TIGHT, f"world={world} sp={sp} chunk={chunk}")


@pytest.mark.parametrize("sp", [False, True])
def test_vocabulary_blocks_match_reference(sp):
    """Tiles narrower than the shard (blocks of 5 of 18 columns: 5, 5, 5, 3) fold their row
    statistics exactly in the forward and split the sums of the backward (proofs §4-5)."""
    case = make_case((3, 4), 8, 36, seed=31, scale=3.0)
    with chunk_policy(dataclasses.replace(CPU_POLICY, max_block=5)):
        out = run_token(2, case, chunk=5, temperature=0.9, sp=sp)
    assert_matches(out, reference_token(*case, temperature=0.9), TIGHT, f"blocks sp={sp}")


def test_default_chunk_and_leading_shapes():
    """No chunk_size, 1-D and 3-D leading shapes, temperature 1: the same as the reference."""
    for rows in [(5,), (2, 3, 4)]:
        case = make_case(rows, 8, 20, seed=3)
        assert_matches(run_token(1, case), reference_token(*case), TIGHT, f"rows={rows}")


def test_without_entropy_output_and_grad():
    """`return_neg_entropy=False` returns the log-probs alone, with the log-prob-only gradient."""
    hidden, weight, target, dout, _ = make_case(9, 8, 20, seed=4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = lossfx.linear_token_logprobs(h, w, target, chunk_size=4, temperature=1.3)
    assert isinstance(lp, torch.Tensor) and lp.shape == target.shape
    lp.backward(dout)
    expected = reference_token(hidden, weight, target, dout, torch.zeros(9, dtype=F64), 1.3)
    assert_matches((lp, expected[1], h.grad, w.grad), expected, TIGHT)


def _uneven_rank(rank, world, group, hidden, weight, target, dout):
    bounds = [0, 5, 13]  # shards of 5 and 8 rows
    w = weight[bounds[rank] : bounds[rank + 1]].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    lp = lossfx.linear_token_logprobs(h, w, target, group=group, vocab_start=bounds[rank], vocab_size=13, chunk_size=3)
    lp.backward(dout)
    return lp.detach(), h.grad, w.grad


def test_uneven_vocabulary_shards():
    hidden, weight, target, dout, _ = make_case(7, 6, 13, seed=5)
    results = run_ranks(2, _uneven_rank, hidden, weight, target, dout)
    lp, _, dh, dw = reference_token(hidden, weight, target, dout, torch.zeros(7, dtype=F64))
    for res in results:
        torch.testing.assert_close(res[0], lp, **TIGHT)
        torch.testing.assert_close(res[1], dh, **TIGHT)
    torch.testing.assert_close(torch.cat([results[0][2], results[1][2]]), dw, **TIGHT)


def test_large_magnitude_is_as_accurate_as_log_softmax():
    """Logits near 1e4: the row max and the log-sum stay apart, so no digit of log s is lost."""
    hidden, weight, target, dout, dent = make_case(6, 4, 30, seed=6, scale=3e3)
    out = run_token(1, (hidden, weight, target, dout, dent), chunk=4)
    expected = reference_token(hidden, weight, target, dout, dent)
    # the values are O(1e3): compare the log-probs relative to log_softmax's own rounding there
    z = reference.linear_logits(hidden, weight)
    eps = torch.finfo(F64).eps * z.abs().amax(-1)
    assert ((out[0] - expected[0]).abs() <= 8 * eps).all()
    assert ((out[1] - expected[1]).abs() <= 8 * eps * 30).all()


def test_inputs_not_mutated():
    hidden, weight, target, _, _ = make_case(5, 4, 12, seed=7)
    copies = [hidden.clone(), weight.clone(), target.clone()]
    lossfx.linear_token_logprobs(hidden, weight, target, chunk_size=2, return_neg_entropy=True)
    for before, after in zip(copies, [hidden, weight, target], strict=True):
        assert torch.equal(before, after)


# ---------------------------------------------------------------------------------------------
# 2. Gather (both conventions), next-token, context parallelism
# ---------------------------------------------------------------------------------------------


def _gather_rank(rank, world, group, hidden, weight, ids, dout, dent, zero_outside, sp):
    vl = weight.shape[0] // world
    w = weight[rank * vl : (rank + 1) * vl].clone().requires_grad_()
    h = (shard_rows(hidden, rank, world) if sp else hidden).clone().requires_grad_()
    lp, ne = lossfx.linear_gather_logprobs(
        h,
        w,
        ids,
        zero_outside_topk=zero_outside,
        with_neg_entropy=True,
        group=group,
        sequence_parallel=sp,
        chunk_size=3,
    )
    torch.autograd.backward([lp, ne], [dout, dent])
    return lp.detach(), ne.detach(), h.grad, w.grad


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("zero_outside", [True, False])
@pytest.mark.parametrize("sp", [False, True])
def test_gather_matches_reference(world, zero_outside, sp):
    hidden, weight, ids, dout, dent = make_case((2, 4), 8, 18, seed=8, k=4)
    ids[0, 0, 1] = ids[0, 0, 0]  # a duplicated id: its gradients add
    results = run_ranks(world, _gather_rank, hidden, weight, ids, dout, dent, zero_outside, sp)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ne = reference.linear_gather_logprobs(h, w, ids, zero_outside)
    dh, dw = torch.autograd.grad([lp, ne], [h, w], [dout, dent])
    for res in results:
        torch.testing.assert_close(res[0], lp.detach(), **TIGHT)
        torch.testing.assert_close(res[1], ne.detach(), **TIGHT)
    got_dh = torch.cat([r[2] for r in results]).view(hidden.shape) if sp else results[0][2]
    torch.testing.assert_close(got_dh, dh, **TIGHT)
    torch.testing.assert_close(torch.cat([r[3] for r in results]), dw, **TIGHT)


def test_gather_without_entropy_returns_none_and_matches_gather_logprobs():
    hidden, weight, ids, _, _ = make_case(5, 6, 10, seed=9, k=3)
    lp, ne = lossfx.linear_gather_logprobs(hidden, weight, ids, temperature=2.0)
    assert ne is None
    expected, _ = lossfx.gather_logprobs(hidden @ weight.T / 2.0, ids)
    torch.testing.assert_close(lp, expected, **TIGHT)


def _next_token_rank(rank, world, group, hidden, weight, input_ids, dout, dent, tp, layout, sp, compiled=None):
    """One rank of `linear_next_token_logprobs` on a `tp x cp` mesh; `layout` in {"plain", "cp", "sharder"}."""
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    vl = weight.shape[0] // tp
    w = weight[tp_rank * vl : (tp_rank + 1) * vl].clone().requires_grad_()
    local = shard_for_cp_rank(hidden, cp_rank, cp, seq_dim=1) if cp > 1 else hidden  # [B, S_l, H]
    if sp and tp > 1:
        n = local.shape[1] // tp
        local = local[:, tp_rank * n : (tp_rank + 1) * n]
    h = local.clone().requires_grad_()
    kwargs = {
        "group": tp_group,
        "sequence_parallel": sp,
        "chunk_size": 3,
        "temperature": 0.9,
        "return_neg_entropy": True,
    }
    if layout == "sharder":
        kwargs.update({"cp_sharder": LoadBalancedSharder(cp_group)})
    elif layout == "cp":
        kwargs.update({"context_parallel_group": cp_group})

    def fn(h, w, ids):
        return lossfx.linear_next_token_logprobs(h, w, ids, **kwargs)

    if compiled is not None and layout != "sharder":
        _, fn = compiled_for_rank(rank, (compiled, world, tp, layout, sp), fn, compiled[0])
    lp, ne = fn(h, w, input_ids)
    # every CP rank computes the same loss: divide by C (the summed-gradient convention)
    torch.autograd.backward([lp, ne], [dout / cp, dent / cp])
    return lp.detach(), ne.detach(), h.grad, w.grad, cp_rank, tp_rank


def _assemble_hidden_grad(results, hidden, tp, cp, sp):
    """Every rank's hidden.grad -> the canonical `[B, S, H]` gradient (checking TP replicas agree)."""
    full = torch.zeros_like(hidden)
    seq = hidden.shape[1]
    for _lp, _ne, dh, _dw, cp_rank, tp_rank in results:
        positions = torch.arange(seq)
        if cp > 1:
            positions = shard_for_cp_rank(positions[None], cp_rank, cp, seq_dim=1)[0]
        if sp and tp > 1:
            n = positions.shape[0] // tp
            positions = positions[tp_rank * n : (tp_rank + 1) * n]
            full[:, positions] += dh
        elif tp_rank == 0:
            full[:, positions] += dh
    return full


@pytest.mark.parametrize(
    ("world", "tp", "layout", "sp"),
    [(1, 1, "plain", False), (2, 1, "cp", False), (2, 1, "sharder", False), (4, 2, "cp", False), (4, 2, "cp", True)],
)
def test_next_token_matches_reference(world, tp, layout, sp, compiled=None):
    batch, seq, hidden_size, vocab = 2, 8, 6, 14
    hidden, weight, input_ids, _, _ = make_case((batch, seq), hidden_size, vocab, seed=11)
    gen = torch.Generator().manual_seed(12)
    dout = torch.randn(batch, seq - 1, generator=gen, dtype=F64)
    dent = torch.randn(batch, seq - 1, generator=gen, dtype=F64)
    results = run_ranks(world, _next_token_rank, hidden, weight, input_ids, dout, dent, tp, layout, sp, compiled)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ne = reference.linear_next_token_logprobs(h, w, input_ids, 0.9)
    dh, dw = torch.autograd.grad([lp, ne], [h, w], [dout, dent])
    for res in results:
        torch.testing.assert_close(res[0], lp.detach(), **TIGHT)
        torch.testing.assert_close(res[1], ne.detach(), **TIGHT)
    cp = world // tp
    torch.testing.assert_close(_assemble_hidden_grad(results, hidden, tp, cp, sp), dh, **TIGHT)
    dw_full = torch.zeros_like(weight)
    vl = vocab // tp
    for res in results:  # the CP ranks' weight gradients add up (each saw its positions)
        dw_full[res[5] * vl : (res[5] + 1) * vl] += res[3]
    torch.testing.assert_close(dw_full, dw, **TIGHT)


def test_next_token_is_token_logprobs_of_the_unfused_logits():
    hidden, weight, input_ids, _, _ = make_case((3, 5), 4, 9, seed=13)
    out = lossfx.linear_next_token_logprobs(hidden, weight, input_ids, temperature=1.5)
    torch.testing.assert_close(out, lossfx.next_token_logprobs(hidden @ weight.T / 1.5, input_ids), **TIGHT)
    empty = lossfx.linear_next_token_logprobs(hidden[:, :1], weight, input_ids[:, :1])
    assert empty.shape == (3, 0)


# ---------------------------------------------------------------------------------------------
# 3. Low precision
# ---------------------------------------------------------------------------------------------


def test_float32_within_1e5():
    case = make_case(24, 32, 64, seed=14, dtype=torch.float32, scale=2.0)
    out = run_token(2, case, chunk=7, temperature=0.8, sp=True)
    expected = reference_token(*case, temperature=0.8)
    assert all(t.dtype == torch.float32 for t in out[:4])
    assert_matches(out, expected, {"rtol": 1e-5, "atol": 1e-5}, "fp32")


def test_bfloat16_within_the_bf16_logits_rounding():
    """bf16: the matmul rounds each logit to bf16 (as the unfused `hidden @ weight.T` does), an
    error up to `2^-8·|z|` per logit; everything after it is fp32. So the tolerance is set by the
    float64 reference evaluated on bf16-rounded logits: the fused values must match that to fp32
    precision, and the exact (unrounded) reference within the bf16 logit rounding `|z|·2^-8`."""
    case = make_case(16, 32, 48, seed=15, dtype=torch.bfloat16)
    hidden, weight, target, _, _ = case
    out = run_token(2, case, chunk=5)
    assert out[2].dtype == torch.bfloat16 and out[3].dtype == torch.bfloat16
    z_rounded = (hidden @ weight.T).to(F64)  # the bf16 logits the kernel sees
    lp_r, ne_r = reference.gather_logprobs(z_rounded, target[:, None])
    torch.testing.assert_close(out[0].to(F64), lp_r[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1].to(F64), ne_r, rtol=0, atol=1e-5)
    expected = reference_token(*case)
    bound = 2.0**-8 * reference.linear_logits(hidden, weight).abs().amax() * 2  # |Δ(z_t − lse)| <= 2 max|Δz|
    assert (out[0].to(F64) - expected[0]).abs().max() <= bound
    # gradients: bf16 outputs (rounding 2^-8 relative) of fp32 quantities
    for got, ref, name in [(out[2], expected[2], "dhidden"), (out[3], expected[3], "dweight")]:
        err = (got.to(F64) - ref).abs().max()
        assert err <= 2.0**-6 * ref.abs().max() + 1e-3, (name, float(err))


# ---------------------------------------------------------------------------------------------
# 4. Properties (hypothesis): 1, 2 and 4 rank threads, eager
# ---------------------------------------------------------------------------------------------


@st.composite
def token_cases(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans())
    rows = draw(st.integers(1, 5)) * (world if sp else 1)
    hidden_size = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 5)) * world
    chunk = draw(st.sampled_from([None, 1, 2, 7, rows + 3]))
    temperature = draw(st.sampled_from([0.3, 1.0, 2.5]))
    scale = draw(st.sampled_from([1e-3, 1.0, 20.0]))
    seed = draw(st.integers(0, 2**16))
    return world, sp, rows, hidden_size, vocab, chunk, temperature, scale, seed


@given(params=token_cases())
def test_property_token_matches_reference(params):
    world, sp, rows, hidden_size, vocab, chunk, temperature, scale, seed = params
    case = make_case(rows, hidden_size, vocab, seed=seed, scale=scale)
    out = run_token(world, case, chunk=chunk, temperature=temperature, sp=sp)
    expected = reference_token(*case, temperature=temperature)
    assert_matches(out, expected, {"rtol": 1e-9, "atol": 1e-9}, str(params))
    assert (out[1] <= 1e-9).all()  # Σ p log p <= 0


# ---------------------------------------------------------------------------------------------
# 5. Gradients: float64 gradcheck of the custom backward, for hidden and weight
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_outside", [True, False])
def test_gradcheck_hidden_and_weight(zero_outside):
    hidden, weight, ids, _, _ = make_case(4, 3, 7, seed=16, k=2)

    def fn(h, w):
        return lossfx.linear_gather_logprobs(
            h, w, ids, zero_outside_topk=zero_outside, with_neg_entropy=True, temperature=0.8, chunk_size=3
        )

    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_()))


def _sharded_gradcheck_rank(rank, world, group, hidden, weight, target, sp):
    from harness import sharded_gradcheck

    vl = weight.shape[0] // world
    h = shard_rows(hidden, rank, world) if sp else hidden

    def of_weight(w):
        return lossfx.linear_token_logprobs(h, w, target, group=group, sequence_parallel=sp, return_neg_entropy=True)

    ok = sharded_gradcheck(of_weight, weight[rank * vl : (rank + 1) * vl], rank=rank, world=world)
    if sp:

        def of_hidden(x):
            return lossfx.linear_token_logprobs(
                x,
                weight[rank * vl : (rank + 1) * vl],
                target,
                group=group,
                sequence_parallel=True,
                return_neg_entropy=True,
            )

        ok = ok and sharded_gradcheck(of_hidden, h, rank=rank, world=world)
    return ok


@pytest.mark.parametrize("sp", [False, True])
def test_sharded_gradcheck_two_ranks(sp):
    hidden, weight, target, _, _ = make_case(4, 3, 6, seed=17)
    assert all(run_ranks(2, _sharded_gradcheck_rank, hidden, weight, target, sp))


# ---------------------------------------------------------------------------------------------
# 6. Compile: fullgraph, recompile counts, a graph independent of the chunk count
# ---------------------------------------------------------------------------------------------


def _training_step(chunk):
    def step(h, w, target):
        lp, ne = lossfx.linear_token_logprobs(h, w, target, chunk_size=chunk, temperature=0.7, return_neg_entropy=True)
        return -lp.mean() + 0.1 * ne.mean()

    return step


@pytest.mark.compile
def test_compiled_inductor_step_matches_reference_and_recompiles_once():
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_training_step(7), backend=counter, fullgraph=True)
    counts = []
    for rows in (20, 27, 33):
        hidden, weight, target, _, _ = make_case(rows, 8, 24, seed=rows)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = compiled(h, w, target)
        loss.backward()
        assert "CompiledFunction" in type(loss.grad_fn).__name__
        rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ne = reference.linear_token_logprobs(rh, rw, target, 0.7)
        ref = -lp.mean() + 0.1 * ne.mean()
        ref.backward()
        torch.testing.assert_close(loss, ref, **TIGHT)
        torch.testing.assert_close(h.grad, rh.grad, **TIGHT)
        torch.testing.assert_close(w.grad, rw.grad, **TIGHT)
        counts.append(counter.frame_count)
    assert counts == [1, 2, 2], counts  # one compile, one automatic-dynamic recompile, then none


@pytest.mark.compile
def test_compiled_graph_does_not_grow_with_the_chunk_count():
    """4 chunks and 64 chunks trace to graphs of the same size, with no graph break."""
    hidden, weight, target, _, _ = make_case(64, 4, 10, seed=18)
    op_counts = []
    for chunk in (16, 1):  # 4 and 64 chunks
        explanation = torch._dynamo.explain(_training_step(chunk))(
            hidden.clone().requires_grad_(), weight.clone().requires_grad_(), target
        )
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        op_counts.append(explanation.op_count)
        torch._dynamo.reset()
    assert op_counts[0] == op_counts[1], op_counts


@pytest.mark.compile
# sp=False with -m slow: the compiled 2-rank fused gather without sequence parallelism runs by
# default in test_magnitudes.py (gather, 2 ranks) and test_dtensor.py (gloo, the fused cases)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True])
def test_compiled_rank_threads_match_reference(world, sp):
    case = make_case(8, 6, 12, seed=19 + world)
    key = ("aot_eager", next(_keys))
    out = run_token(world, case, chunk=3, temperature=0.7, sp=sp, compiled=key)
    assert_matches(out, reference_token(*case, temperature=0.7), TIGHT, f"compiled world={world} sp={sp}")
    assert out[4] == [1] * world  # one compile per rank, no graph break


@pytest.mark.compile
@pytest.mark.parametrize(
    ("world", "tp", "sp"), [(2, 1, False), pytest.param(4, 2, True, marks=pytest.mark.slow)], ids=["cp2", "tp2xcp2"]
)
def test_compiled_next_token_context_parallel(world, tp, sp):
    test_next_token_matches_reference(world, tp, "cp", sp, compiled=("aot_eager", next(_keys)))


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_compiled_inductor_every_layout(world, sp, chunk):
    case = make_case(8, 6, 12, seed=world + chunk)
    out = run_token(world, case, chunk=chunk, temperature=0.7, sp=sp, compiled=("inductor", next(_keys)))
    assert_matches(out, reference_token(*case, temperature=0.7), TIGHT, f"inductor world={world} sp={sp}")


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize(("world", "tp", "layout", "sp"), [(2, 1, "cp", False), (4, 2, "cp", False)])
def test_compiled_inductor_next_token_cp(world, tp, layout, sp):
    test_next_token_matches_reference(world, tp, layout, sp, compiled=("inductor", next(_keys)))


# ---------------------------------------------------------------------------------------------
# 7. Real gloo processes (TP 2, both layouts, eager and compiled)
# ---------------------------------------------------------------------------------------------


def gloo_token_rank(rank, world, group, hidden, weight, target, dout, dent):
    """Both hidden layouts, eager, on a real gloo group: (per layout) outputs and gradients."""
    out = []
    for sp in (False, True):
        vl = weight.shape[0] // world
        w = weight[rank * vl : (rank + 1) * vl].clone().requires_grad_()
        h = (shard_rows(hidden, rank, world) if sp else hidden).clone().requires_grad_()
        lp, ne = lossfx.linear_token_logprobs(
            h, w, target, group=group, sequence_parallel=sp, chunk_size=5, return_neg_entropy=True
        )
        torch.autograd.backward([lp, ne], [dout, dent])
        out.append((lp.detach(), ne.detach(), h.grad, w.grad))
    return out


@pytest.mark.distributed
def test_gloo_processes_two_ranks():
    hidden, weight, target, dout, dent = make_case(12, 8, 20, seed=20)
    results = gloo_pool(2).run(gloo_token_rank, hidden, weight, target, dout, dent)
    expected = reference_token(hidden, weight, target, dout, dent)
    for layout, sp in enumerate((False, True)):
        per_rank = [r[layout] for r in results]
        dh = torch.cat([r[2] for r in per_rank]) if sp else per_rank[0][2]
        if not sp:
            torch.testing.assert_close(per_rank[1][2], dh, **TIGHT)
        got = (per_rank[0][0], per_rank[0][1], dh, torch.cat([r[3] for r in per_rank]))
        assert_matches(got, expected, TIGHT, f"gloo sp={sp}")
        torch.testing.assert_close(per_rank[1][0], per_rank[0][0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# 8. Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"sequence_parallel": 1}, TypeError, "sequence_parallel"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    hidden, weight, target, _, _ = make_case(4, 3, 5)
    with pytest.raises(error, match=match):
        lossfx.linear_token_logprobs(hidden, weight, target, **kwargs)


def test_bad_shapes_dtypes_and_ids():
    hidden, weight, target, _, _ = make_case(4, 3, 5)
    with pytest.raises(ValueError, match="same H"):
        lossfx.linear_token_logprobs(hidden, weight[:, :2], target)
    with pytest.raises(ValueError, match="leading dims"):
        lossfx.linear_token_logprobs(hidden, weight, target[:3])
    with pytest.raises(ValueError, match=r"target must lie in \[0, 5\)"):  # only ignore_index is exempt
        lossfx.linear_token_logprobs(hidden, weight, torch.tensor([0, -1, 1, 2]))
    with pytest.raises(TypeError, match="floating-point"):
        lossfx.linear_token_logprobs(hidden.long(), weight.long(), target)
    with pytest.raises(TypeError, match="integer"):
        lossfx.linear_token_logprobs(hidden, weight, target.double())
    with pytest.raises(ValueError, match=r"target must lie in \[0, 5\)"):
        lossfx.linear_token_logprobs(hidden, weight, torch.tensor([0, 5, 1, 2]))
    with pytest.raises(ValueError, match="K >= 1"):
        lossfx.linear_gather_logprobs(hidden, weight, target[:, None][:, :0])
    with pytest.raises(ValueError, match="input_ids"):
        lossfx.linear_next_token_logprobs(hidden[None], weight, target[None, :3])


def _bad_sp_rank(rank, world, group, hidden, weight, target):
    try:
        lossfx.linear_token_logprobs(hidden, weight, target, group=group, sequence_parallel=True)
    except ValueError as exc:
        return str(exc)
    return None


def test_sequence_parallel_row_count_mismatch():
    hidden, weight, target, _, _ = make_case(4, 3, 6)
    messages = run_ranks(2, _bad_sp_rank, hidden, weight, target)  # 2 x 4 rows != 4 positions
    assert all(m is not None and "sequence_parallel=True" in m for m in messages)


# ---------------------------------------------------------------------------------------------
# 9. Memory contract: nothing of size N·V is saved for backward
# ---------------------------------------------------------------------------------------------


def test_saved_for_backward_is_inputs_and_row_scalars():
    rows, hidden_size, vocab = 64, 8, 500
    hidden, weight, target, _, _ = make_case(rows, hidden_size, vocab, dtype=torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lossfx.linear_token_logprobs(h, w, target, return_neg_entropy=True, chunk_size=8)
    assert max(saved) <= max(rows * hidden_size, vocab * hidden_size)
    assert sum(saved) < rows * vocab  # far below one [N, V] logits tensor


def test_bfloat16_backward_in_vocabulary_blocks(monkeypatch):
    """bf16 weights take the blocked backward (a `[Cv, H]` fp32 accumulator per vocabulary block):
    several blocks give the gradients of one block, to the bf16 rounding of each tile's product."""
    from lossfx._core import tiles as _tiles

    hidden, weight, target, dout, dent = make_case(24, 16, 40, seed=21, dtype=torch.bfloat16)
    grads = []
    for min_block, budget in [(64, 4 << 20), (3, 16 * 4 * 7)]:  # one block of 40; blocks of 7
        monkeypatch.setattr(_tiles, "MIN_BLOCK", min_block)
        policy = dataclasses.replace(CPU_POLICY, tile_bytes=budget)
        assert _tiles.tile_shape(40, 16, torch.bfloat16, policy)[0] == (40 if min_block == 64 else 7)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with chunk_policy(policy):
            lp, ne = lossfx.linear_token_logprobs(h, w, target, chunk_size=5, return_neg_entropy=True)
        torch.autograd.backward([lp, ne], [dout.float(), dent.float()])
        grads.append((h.grad.to(F64), w.grad.to(F64)))
    for one, blocked in zip(grads[0], grads[1], strict=True):
        # each tile's product is rounded to bf16 once before the fp32 sum: a few 2^-9 roundings
        torch.testing.assert_close(blocked, one, rtol=0, atol=2**-6 * float(one.abs().max()))


def _frozen_hidden_rank(rank, world, group, hidden, weight, target):
    vl = weight.shape[0] // world
    w = weight[rank * vl : (rank + 1) * vl].clone().requires_grad_()
    lossfx.linear_token_logprobs(hidden, w, target, group=group, chunk_size=3).sum().backward()
    return w.grad


def test_frozen_hidden_weight_grad_only():
    """A `hidden` without grad (a frozen trunk): only `weight.grad`, and it is the reference's."""
    hidden, weight, target, _, _ = make_case(6, 4, 10, seed=32)
    grads = run_ranks(2, _frozen_hidden_rank, hidden, weight, target)
    _, _, _, dw = reference_token(hidden, weight, target, torch.ones(6, dtype=F64), torch.zeros(6, dtype=F64))
    torch.testing.assert_close(torch.cat(grads), dw, **TIGHT)
