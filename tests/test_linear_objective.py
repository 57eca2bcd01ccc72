"""Tests of `linear_logprob_objective`: `Σ a·log p(target) + Σ b·Σ p log p` from hidden states and an
LM head (shard), with the gradients formed in the forward pass (three matmuls, no recompute).

Sections: 1 reference equivalence (float64, 1e-10, TP 1/2/4 x both hidden layouts x chunk sizes
1, 7, > N, with and without the entropy term; vocabulary blocks; uneven shards); 2 low precision;
3 properties (hypothesis, 1/2/4 rank threads); 4 gradcheck; 5 compile (fullgraph, recompile counts,
graph independent of the chunk count, rank threads); 6 real gloo processes; 7 the gradient
contract (upstream scaling, one backward, frozen inputs, no mutation) and errors.

Every case scales the objective by an upstream gradient `G = 1.7` before the backward, so the
in-place scaling of the gradients formed in the forward is always exercised.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch._dynamo.testing
from devices import DEVICE
from harness import compiled_for_rank, gloo_pool, run_ranks, shard_rows
from hypothesis import given
from hypothesis import strategies as st

import lossfx
from lossfx import linear_objective, reference
from lossfx._core.chunking import CPU_POLICY, chunk_policy

F64 = torch.float64
TIGHT = {"rtol": 0.0, "atol": 1e-10}
UPSTREAM = 1.7
NAMES = ("objective", "logprobs", "neg_entropy", "dhidden", "dweight", "dlogprob_weight", "dentropy_weight")
_keys = itertools.count()


def make_case(rows, hidden_size, vocab, *, seed=0, dtype=F64, scale=1.0, entropy=True):
    """hidden `[*rows, H]`, weight `[V, H]`, target `[*rows]`, coefficients a (and b) `[*rows]`."""
    rows = tuple(rows) if isinstance(rows, (tuple, list)) else (rows,)
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*rows, hidden_size, generator=gen, dtype=F64) * scale).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, dtype=F64) / math.sqrt(hidden_size) * 3).to(dtype)
    target = torch.randint(0, vocab, rows, generator=gen)
    a = torch.randn(rows, generator=gen, dtype=F64)
    b = torch.randn(rows, generator=gen, dtype=F64) if entropy else None
    return hidden, weight, target, a, b


def reference_objective(hidden, weight, target, a, b, temperature=1.0):
    """(objective, logprobs, neg_entropy, dhidden, dweight, da, db) of the float64 reference, upstream G."""
    h = hidden.detach().to(F64).requires_grad_()
    w = weight.detach().to(F64).requires_grad_()
    a = a.detach().to(F64).requires_grad_()
    b = None if b is None else b.detach().to(F64).requires_grad_()
    obj, lp, ne = reference.linear_logprob_objective(h, w, target, a, b, temperature)
    (obj * UPSTREAM).backward()
    no_entropy = b is None
    return (
        obj.detach(),
        lp.detach(),
        (None if no_entropy else ne.detach()),
        h.grad,
        w.grad,
        a.grad,
        (None if no_entropy else b.grad),
    )


def _objective_rank(rank, world, group, hidden, weight, target, a, b, chunk, temperature, sp, compiled=None):
    vl = weight.shape[0] // world
    w = weight[rank * vl : (rank + 1) * vl].detach().clone().requires_grad_()
    h = (shard_rows(hidden, rank, world) if sp else hidden).detach().clone().requires_grad_()
    a = a.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()

    def fn(h, w, target, a, b):
        return lossfx.linear_logprob_objective(
            h, w, target, a, neg_entropy_weight=b, group=group, temperature=temperature, sequence_parallel=sp,
            chunk_size=chunk,
        )  # fmt: skip

    counter = None
    if compiled is not None:
        counter, fn = compiled_for_rank(rank, ("objective", compiled, world, chunk, temperature, sp), fn, compiled[0])
    obj, lp, ne = fn(h, w, target, a, b)
    assert not lp.requires_grad and (ne is None or not ne.requires_grad)
    (obj * UPSTREAM).backward()
    frames = None if counter is None else counter.frame_count
    return obj.detach(), lp, ne, h.grad, w.grad, a.grad, (None if b is None else b.grad), frames


def run_objective(world, case, *, chunk=None, temperature=1.0, sp=False, compiled=None):
    """Run on `world` rank threads -> the seven outputs of `reference_objective`, plus frame counts."""
    hidden, weight, target, a, b = case
    results = run_ranks(world, _objective_rank, hidden, weight, target, a, b, chunk, temperature, sp, compiled)
    first = results[0]
    for rank, res in enumerate(results[1:], start=1):
        for i in (0, 1, 2, 5, 6):  # replicated values and coefficient gradients: bit-identical
            if first[i] is not None:
                assert torch.equal(res[i], first[i]), f"rank {rank} {NAMES[i]} differs from rank 0"
        if not sp:
            torch.testing.assert_close(res[3], first[3], rtol=0, atol=1e-12, msg=f"rank {rank} hidden.grad differs")
    dh = torch.cat([res[3] for res in results]).view(hidden.shape) if sp else first[3]
    dw = torch.cat([res[4] for res in results])
    return (first[0], first[1], first[2], dh, dw, first[5], first[6]), [res[7] for res in results]


def assert_matches(actual, expected, tol, what=""):
    assert len(actual) == len(expected)
    for name, got, want in zip(NAMES, actual, expected, strict=False):
        if want is None:
            assert got is None, f"{what} {name}: expected None"
            continue
        torch.testing.assert_close(got.to(F64), want, msg=lambda m, name=name: f"{what} {name}: {m}", **tol)


# ---------------------------------------------------------------------------------------------
# 1. Reference equivalence: float64, 1e-10
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 100])
@pytest.mark.parametrize("entropy", [False, True])
def test_matches_reference(world, sp, chunk, entropy):
    case = make_case((4, 6), 16, 36, seed=world * 10 + chunk, scale=2.0, entropy=entropy)
    out, _ = run_objective(world, case, chunk=chunk, temperature=0.7, sp=sp)
    assert_matches(out, reference_objective(*case, temperature=0.7), TIGHT, f"world={world} sp={sp} chunk={chunk}")


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_vocabulary_blocks_match_one_block(dtype):
    """Tiles narrower than the shard (blocks of 5 of 18 columns) give the one-block results: exactly
    the reference in float64; in bf16 the same per-tile rounding as the blocked backward."""
    case = make_case(12, 8, 36, seed=31, scale=3.0, dtype=dtype)
    blocked = []
    for block in (2048, 5):
        with chunk_policy(dataclasses.replace(CPU_POLICY, max_block=block)):
            blocked.append(run_objective(2, case, chunk=5, temperature=0.9)[0])
    if dtype == F64:
        for out in blocked:
            assert_matches(out, reference_objective(*case, temperature=0.9), TIGHT, "blocks")
    else:
        for name, one, many in zip(NAMES, *blocked, strict=True):
            scale = float(one.to(F64).abs().max())
            torch.testing.assert_close(many.to(F64), one.to(F64), rtol=0, atol=2**-6 * scale, msg=name)


def test_default_chunk_leading_shapes_and_uneven_shards():
    """No chunk_size, 1-D and 3-D leading shapes; shards of 5 and 8 rows with explicit offsets."""
    for rows in [(5,), (2, 3, 4)]:
        case = make_case(rows, 8, 20, seed=3)
        assert_matches(run_objective(1, case)[0], reference_objective(*case), TIGHT, f"rows={rows}")
    hidden, weight, target, a, b = make_case(7, 6, 13, seed=8)
    results = run_ranks(2, _uneven_rank, hidden, weight, target, a, b)
    expected = reference_objective(hidden, weight, target, a, b)
    got = (*results[0][:4], torch.cat([r[4] for r in results]), *results[0][5:])
    assert_matches(got, expected, TIGHT, "uneven")


def _uneven_rank(rank, world, group, hidden, weight, target, a, b):
    bounds = [0, 5, 13]
    w = weight[bounds[rank] : bounds[rank + 1]].clone().requires_grad_()
    h, a, b = hidden.clone().requires_grad_(), a.clone().requires_grad_(), b.clone().requires_grad_()
    obj, lp, ne = lossfx.linear_logprob_objective(
        h, w, target, a, neg_entropy_weight=b, group=group, vocab_start=bounds[rank], vocab_size=13, chunk_size=3
    )
    (obj * UPSTREAM).backward()
    return obj.detach(), lp, ne, h.grad, w.grad, a.grad, b.grad


def test_same_logprobs_as_linear_token_logprobs():
    """The values are `linear_token_logprobs`' (same merge), to the last bits."""
    hidden, weight, target, a, b = make_case(10, 8, 30, seed=5, dtype=torch.float32)
    _, lp, ne = lossfx.linear_logprob_objective(hidden, weight, target, a.float(), neg_entropy_weight=b.float())
    lp2, ne2 = lossfx.linear_token_logprobs(hidden, weight, target, return_neg_entropy=True)
    torch.testing.assert_close(lp, lp2, rtol=0, atol=1e-6)
    torch.testing.assert_close(ne, ne2, rtol=0, atol=1e-6)


def test_large_magnitude_logits_stay_exact():
    """Logits near 1e4 (fp32: spacing 1e-3): log-probs and gradients stay finite and match float64."""
    hidden, weight, target, a, b = make_case(6, 4, 12, seed=6, scale=3000.0, dtype=torch.float32)
    out, _ = run_objective(2, (hidden, weight, target, a, b), chunk=4)
    expected = reference_objective(hidden, weight, target, a, b)
    for got in out:
        assert got is None or torch.isfinite(got).all()
    # the fp32 logits themselves round at 2^-24·|z|; log p inherits that absolute error
    bound = 4 * 2.0**-24 * float(reference.linear_logits(hidden, weight).abs().max())
    torch.testing.assert_close(out[1].to(F64), expected[1], rtol=0, atol=bound)


# ---------------------------------------------------------------------------------------------
# 2. Low precision
# ---------------------------------------------------------------------------------------------


def test_float32_within_1e5():
    case = make_case(24, 32, 64, seed=14, dtype=torch.float32, scale=2.0)
    out, _ = run_objective(2, case, chunk=7, temperature=0.8, sp=True)
    assert out[3].dtype == torch.float32 and out[4].dtype == torch.float32
    assert_matches(out, reference_objective(*case, temperature=0.8), {"rtol": 1e-5, "atol": 1e-5}, "fp32")


def test_bfloat16_within_the_bf16_logits_rounding():
    """bf16: each logit is rounded to bf16 by the matmul (`|Δz| <= 2^-8·|z|`, as the unfused
    `hidden @ weight.T`), the rest is fp32. The values must equal the float64 reference evaluated on
    those rounded logits to fp32 precision; the gradients are bf16 roundings (2^-8 relative) of
    fp32 sums of bf16-rounded tile products, so within 2^-6 of their largest entry."""
    case = make_case(16, 32, 48, seed=15, dtype=torch.bfloat16)
    hidden, weight, target, _, _ = case
    out, _ = run_objective(2, case, chunk=5)
    assert out[3].dtype == torch.bfloat16 and out[4].dtype == torch.bfloat16
    lp_r, ne_r = reference.gather_logprobs((hidden @ weight.T).to(F64), target[:, None])
    torch.testing.assert_close(out[1].to(F64), lp_r[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[2].to(F64), ne_r, rtol=0, atol=1e-5)
    expected = reference_objective(*case)
    for i in (3, 4):
        err = (out[i].to(F64) - expected[i]).abs().max()
        assert err <= 2.0**-6 * expected[i].abs().max() + 1e-3, (NAMES[i], float(err))


# ---------------------------------------------------------------------------------------------
# 3. Properties (hypothesis): 1, 2 and 4 rank threads, eager
# ---------------------------------------------------------------------------------------------


@st.composite
def objective_cases(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans())
    rows = draw(st.integers(1, 5)) * (world if sp else 1)
    hidden_size = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 5)) * world
    chunk = draw(st.sampled_from([None, 1, 2, 7, rows + 3]))
    temperature = draw(st.sampled_from([0.3, 1.0, 2.5]))
    scale = draw(st.sampled_from([1e-3, 1.0, 20.0]))
    entropy = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return world, sp, rows, hidden_size, vocab, chunk, temperature, scale, entropy, seed


@given(params=objective_cases())
def test_property_matches_reference(params):
    world, sp, rows, hidden_size, vocab, chunk, temperature, scale, entropy, seed = params
    case = make_case(rows, hidden_size, vocab, seed=seed, scale=scale, entropy=entropy)
    out, _ = run_objective(world, case, chunk=chunk, temperature=temperature, sp=sp)
    assert_matches(out, reference_objective(*case, temperature=temperature), {"rtol": 1e-9, "atol": 1e-9}, str(params))


# ---------------------------------------------------------------------------------------------
# 4. Gradients: float64 gradcheck (hidden, weight, both coefficients)
# ---------------------------------------------------------------------------------------------


def test_gradcheck():
    hidden, weight, target, a, b = make_case(5, 3, 7, seed=16)

    def fn(h, w, a, b):
        return lossfx.linear_logprob_objective(
            h, w, target, a, neg_entropy_weight=b, temperature=0.8, chunk_size=2, allow_repeated_backward=True
        )[0]

    inputs = tuple(x.clone().requires_grad_() for x in (hidden, weight, a, b))
    assert torch.autograd.gradcheck(fn, inputs)


def _sharded_gradcheck_rank(rank, world, group, hidden, weight, target, a, b, sp):
    from harness import sharded_gradcheck

    vl = weight.shape[0] // world
    h = shard_rows(hidden, rank, world) if sp else hidden
    w = weight[rank * vl : (rank + 1) * vl]

    def of_weight(w):
        return lossfx.linear_logprob_objective(
            h, w, target, a, neg_entropy_weight=b, group=group, sequence_parallel=sp, allow_repeated_backward=True
        )[0]

    ok = sharded_gradcheck(of_weight, w, rank=rank, world=world)
    if sp:

        def of_hidden(x):
            return lossfx.linear_logprob_objective(
                x, w, target, a, neg_entropy_weight=b, group=group, sequence_parallel=True, allow_repeated_backward=True
            )[0]

        ok = ok and sharded_gradcheck(of_hidden, h, rank=rank, world=world)
    return ok


@pytest.mark.parametrize("sp", [False, True])
def test_sharded_gradcheck_two_ranks(sp):
    hidden, weight, target, a, b = make_case(4, 3, 6, seed=17)
    assert all(run_ranks(2, _sharded_gradcheck_rank, hidden, weight, target, a, b, sp))


# ---------------------------------------------------------------------------------------------
# 5. Compile: fullgraph, recompile counts, a graph independent of the chunk count
# ---------------------------------------------------------------------------------------------


def _training_step(chunk):
    def step(h, w, target, a, b):
        objective, _, _ = lossfx.linear_logprob_objective(
            h, w, target, a, neg_entropy_weight=b, chunk_size=chunk, temperature=0.7
        )
        return -UPSTREAM * objective

    return step


@pytest.mark.compile
def test_compiled_inductor_step_matches_reference_and_recompiles_once():
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_training_step(7), backend=counter, fullgraph=True)
    counts = []
    for rows in (20, 27, 33):
        hidden, weight, target, a, b = make_case(rows, 8, 24, seed=rows)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = compiled(h, w, target, a, b)
        loss.backward()
        assert "CompiledFunction" in type(loss.grad_fn).__name__
        expected = reference_objective(hidden, weight, target, a, b, temperature=0.7)
        torch.testing.assert_close(loss, -UPSTREAM * expected[0], **TIGHT)
        torch.testing.assert_close(h.grad, -expected[3], **TIGHT)
        torch.testing.assert_close(w.grad, -expected[4], **TIGHT)
        counts.append(counter.frame_count)
    assert counts == [1, 2, 2], counts  # one compile, one automatic-dynamic recompile, then none


@pytest.mark.compile
def test_compiled_graph_does_not_grow_with_the_chunk_count():
    hidden, weight, target, a, b = make_case(64, 4, 10, seed=18)
    op_counts = []
    for chunk in (16, 1):  # 4 and 64 chunks
        explanation = torch._dynamo.explain(_training_step(chunk))(
            hidden.clone().requires_grad_(), weight.clone().requires_grad_(), target, a, b
        )
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        op_counts.append(explanation.op_count)
        torch._dynamo.reset()
    assert op_counts[0] == op_counts[1], op_counts


@pytest.mark.compile
# sp=False with -m slow: the compiled 2-rank objective without sequence parallelism runs by default
# in test_fused_options.py::test_compiled_options_match_reference[objective-2-aot_eager]
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True])
def test_compiled_rank_threads_match_reference(world, sp):
    case = make_case(8, 6, 12, seed=19 + world)
    out, frames = run_objective(world, case, chunk=3, temperature=0.7, sp=sp, compiled=("aot_eager", next(_keys)))
    assert_matches(out, reference_objective(*case, temperature=0.7), TIGHT, f"compiled world={world} sp={sp}")
    assert frames == [1] * world  # one compile per rank, no graph break


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_compiled_inductor_every_layout(world, sp, chunk):
    case = make_case(8, 6, 12, seed=world + chunk)
    out, _ = run_objective(world, case, chunk=chunk, temperature=0.7, sp=sp, compiled=("inductor", next(_keys)))
    assert_matches(out, reference_objective(*case, temperature=0.7), TIGHT, f"inductor world={world} sp={sp}")


# ---------------------------------------------------------------------------------------------
# 6. Real gloo processes (TP 2, both layouts)
# ---------------------------------------------------------------------------------------------


def gloo_objective_rank(rank, world, group, hidden, weight, target, a, b):
    out = []
    for sp in (False, True):
        vl = weight.shape[0] // world
        w = weight[rank * vl : (rank + 1) * vl].clone().requires_grad_()
        h = (shard_rows(hidden, rank, world) if sp else hidden).clone().requires_grad_()
        obj, lp, ne = lossfx.linear_logprob_objective(
            h, w, target, a, neg_entropy_weight=b, group=group, sequence_parallel=sp, chunk_size=5
        )
        (obj * UPSTREAM).backward()
        out.append((obj.detach(), lp, ne, h.grad, w.grad))
    return out


@pytest.mark.distributed
def test_gloo_processes_two_ranks():
    hidden, weight, target, a, b = make_case(12, 8, 20, seed=20)
    results = gloo_pool(2).run(gloo_objective_rank, hidden, weight, target, a, b)
    expected = reference_objective(hidden, weight, target, a, b)
    for layout, sp in enumerate((False, True)):
        per_rank = [r[layout] for r in results]
        dh = torch.cat([r[3] for r in per_rank]) if sp else per_rank[0][3]
        got = (*per_rank[0][:3], dh, torch.cat([r[4] for r in per_rank]))
        assert_matches(got, expected[:5], TIGHT, f"gloo sp={sp}")
        torch.testing.assert_close(per_rank[1][1], per_rank[0][1], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# 7. The gradient contract and errors
# ---------------------------------------------------------------------------------------------


def test_second_backward_raises_unless_allowed():
    hidden, weight, target, a, _ = make_case(5, 4, 9, seed=21)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    objective, _, _ = lossfx.linear_logprob_objective(h, w, target, a)
    objective.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        objective.backward()
    h.grad = w.grad = None
    objective, _, _ = lossfx.linear_logprob_objective(h, w, target, a, allow_repeated_backward=True)
    objective.backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    objective.backward()  # accumulates the same gradient once more
    torch.testing.assert_close(h.grad, 2 * first[0], **TIGHT)
    torch.testing.assert_close(w.grad, 2 * first[1], **TIGHT)


def test_frozen_inputs_skip_their_gradient():
    """A frozen trunk (`hidden` without grad) or a frozen head: the other gradient alone, still the
    reference's; with neither, the objective is a value."""
    hidden, weight, target, a, b = make_case(6, 4, 10, seed=22)
    expected = reference_objective(hidden, weight, target, a, b)
    for frozen in ("hidden", "weight", "both"):
        h = hidden.clone().requires_grad_(frozen not in ("hidden", "both"))
        w = weight.clone().requires_grad_(frozen not in ("weight", "both"))
        objective, _, _ = lossfx.linear_logprob_objective(h, w, target, a, neg_entropy_weight=b, chunk_size=4)
        torch.testing.assert_close(objective, expected[0], **TIGHT)
        if frozen == "both":
            assert not objective.requires_grad
            continue
        (objective * UPSTREAM).backward()
        grad, want = (w.grad, expected[4]) if frozen == "hidden" else (h.grad, expected[3])
        torch.testing.assert_close(grad, want, **TIGHT)


def test_inputs_not_mutated():
    case = make_case(6, 4, 10, seed=23)
    before = [x.clone() for x in case]
    hidden, weight, target, a, b = (x.clone() for x in case)
    objective, _, _ = lossfx.linear_logprob_objective(
        hidden.requires_grad_(), weight.requires_grad_(), target, a, neg_entropy_weight=b
    )
    objective.backward()
    for got, want in zip((hidden, weight, target, a, b), before, strict=True):
        assert torch.equal(got.detach(), want)


def test_saved_state_is_the_gradients_and_row_values():
    """Nothing of size N·V is kept: the forward saves the two gradients and per-row values."""
    rows, hidden_size, vocab = 24, 4, 40
    hidden, weight, target, a, b = make_case(rows, hidden_size, vocab, seed=24)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lossfx.linear_logprob_objective(
            hidden.requires_grad_(), weight.requires_grad_(), target, a, neg_entropy_weight=b, chunk_size=8
        )
    # dhidden, dweight, an empty dbias (no bias), log-probs and Σ p log p per row
    assert sorted(saved) == sorted([rows * hidden_size, vocab * hidden_size, 0, rows, rows])


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"logprob_weight": torch.ones(5).to(DEVICE)}, ValueError, "logprob_weight must have the target's shape"),
        (
            {"neg_entropy_weight": torch.ones(2, 3).to(DEVICE)},
            ValueError,
            "neg_entropy_weight must have the target's shape",
        ),
        ({"logprob_weight": torch.ones(6, dtype=torch.int64).to(DEVICE)}, TypeError, "logprob_weight"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"target": torch.full((6,), 10).to(DEVICE)}, ValueError, "target"),
        ({"weight": torch.ones(10, 3, dtype=F64).to(DEVICE)}, ValueError, "same H"),
    ],
)
def test_bad_arguments(change, error, match):
    hidden, weight, target, a, _ = make_case(6, 4, 10, seed=25)
    kwargs = {"hidden": hidden, "weight": weight, "target": target, "logprob_weight": a} | change
    with pytest.raises(error, match=match):
        lossfx.linear_logprob_objective(**kwargs)


def test_default_chunk_is_at_most_a_sixteenth_of_the_logits_and_96_mib():
    rows = linear_objective.default_objective_chunk_rows
    assert rows(2048, 151936, torch.float32) == 128  # N / 16
    assert rows(32768, 151936, torch.float32) == (96 << 20) // (151936 * 4)  # the 96 MiB cap: 165
    assert rows(32768, 151936, torch.bfloat16) == 165  # the chunk is fp32 (the compute dtype)
    assert rows(40, 1000, torch.float64) == 16  # at least 16 rows
