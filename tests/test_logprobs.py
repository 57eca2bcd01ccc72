"""Tests of `lossfx.token_logprobs` / `token_logprobs_with_lse` (the vocab-parallel kernel).

Sections (conventions §9): 0 helpers/cases; 1 reference equivalence; 2 low precision;
3 properties (hypothesis); 4 gradients (gradcheck, double backward); 6 errors; 7 memory contract.
Section 5 (compile) lives in test_compile.py.

Several ranks run as threads (`harness.run_ranks`): rank r sees the shard `x[..., r·Vl:(r+1)·Vl]`
of the full logits; its output must equal the dense reference and the gradients of all ranks,
concatenated along V in rank order, must equal the reference gradient.
"""

from __future__ import annotations

import math

import pytest
import strategies
import torch
from harness import run_ranks
from hypothesis import given
from hypothesis import strategies as st

import lossfx
from lossfx import reference

F64 = torch.float64

# ---------------------------------------------------------------------------------------------
# 0. Helpers and cases
# ---------------------------------------------------------------------------------------------

# (B, S, V): odd and indivisible sizes; V=1 only on one rank.
SHAPES = [(1, 1, 1), (3, 7, 4), (2, 5, 36), (1, 41, 1272), (4, 3, 8)]
WORLDS = [1, 2, 4]
CHUNK_KINDS = ["none", "one", "lt", "eq", "gt"]


def resolve_chunk(kind: str, n: int) -> int | None:
    """Chunk size (rows of the flattened `[N, Vl]`): default, 1, C<N, C=N, C>N."""
    return {"none": None, "one": 1, "lt": max(1, n // 3), "eq": n, "gt": n + 5}[kind]


def make_inputs(shape, seed=0, scale=1.0, dtype=F64):
    batch, seq, vocab = shape
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen, dtype=F64) * scale).to(dtype)
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    return logits, target


def _rank_fn(rank, world, group, logits, target, dout, chunk, kind):
    """One rank: log-probs of its shard, then backward of `kind` with upstream `dout`."""
    vl = logits.shape[-1] // world
    shard = logits[..., rank * vl : (rank + 1) * vl].detach().clone().requires_grad_(True)
    out, lse = lossfx.token_logprobs_with_lse(shard, target, group=group, chunk_size=chunk)
    if kind == "sum":
        out.sum().backward()
    elif kind == "times2":
        (out * 2.0).backward(dout)
    else:
        out.backward(dout)
    return out.detach(), lse.detach(), shard.grad


def sharded(logits, target, world, *, dout=None, chunk=None, kind="dout"):
    """Run the kernel on `world` rank threads -> (out, lse, dlogits concatenated over ranks).

    Also checks that every rank returns the same (replicated) output and lse.
    """
    if dout is None:
        dout = torch.ones(target.shape, dtype=lossfx._core.numerics.compute_dtype(logits.dtype))
    results = run_ranks(world, _rank_fn, logits, target, dout, chunk, kind)
    out0, lse0, _ = results[0]
    for rank, (out, lse, _) in enumerate(results[1:], start=1):
        assert torch.equal(out, out0), f"rank {rank} output differs from rank 0"
        assert torch.equal(lse, lse0), f"rank {rank} lse differs from rank 0"
    return out0, lse0, torch.cat([grad for _, _, grad in results], dim=-1)


def reference_grad(logits, target, dout=None, kind="dout"):
    """(values, grads) of `reference.token_logprobs` in float64 on the upcast logits."""
    x = logits.detach().to(F64).requires_grad_(True)
    out = reference.token_logprobs(x, target)
    if kind == "sum":
        out.sum().backward()
    elif kind == "times2":
        (out * 2.0).backward(dout.to(F64))
    else:
        out.backward(dout.to(F64) if dout is not None else torch.ones_like(out))
    return out.detach(), x.grad


def assert_close_verbose(actual, expected, *, atol, rtol=0.0, what=""):
    """Element-wise `|a − e| ≤ atol + rtol·|e|` (inf must match exactly), reporting offenders."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().to(F64), expected.detach().to(F64)
    assert not torch.isnan(a).any(), f"{what}: NaN at {torch.isnan(a).nonzero()[:5].tolist()}"
    same_inf = (a == e) | (~torch.isfinite(a) & ~torch.isfinite(e) & (a == e))
    diff = torch.where(same_inf, torch.zeros_like(a), (a - e).abs())
    bad = diff > atol + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        pairs = [(i, a[tuple(i)].item(), e[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} mismatches (index, actual, expected): {pairs}")


def assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t.detach().to(F64)).any(), "NaN found"


# ---------------------------------------------------------------------------------------------
# 1. Reference equivalence (float64, 1e-10, R = 1, 2, 4)
# ---------------------------------------------------------------------------------------------

_EQUIV = [
    (world, shape, chunk)
    for world in WORLDS
    for shape in SHAPES
    if shape[2] % world == 0 and not (shape[2] > 100 and world == 4)
    for chunk in CHUNK_KINDS
]


@pytest.mark.parametrize(("world", "shape", "chunk_kind"), _EQUIV)
def test_reference_equivalence_random_dout(world, shape, chunk_kind):
    logits, target = make_inputs(shape, seed=world * 100 + len(chunk_kind))
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    chunk = resolve_chunk(chunk_kind, target.numel())
    out, _, grad = sharded(logits, target, world, dout=dout, chunk=chunk)
    ref, ref_grad = reference_grad(logits, target, dout)
    assert out.dtype == F64 and grad.dtype == F64
    assert_close_verbose(out, ref, atol=1e-10, what="values")
    assert_close_verbose(grad, ref_grad, atol=1e-10, what="dlogits")


@pytest.mark.parametrize("kind", ["sum", "times2"])
@pytest.mark.parametrize("world", WORLDS)
def test_reference_equivalence_loss_kinds(world, kind):
    logits, target = make_inputs((2, 5, 12), seed=7, scale=3.0)
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    out, _, grad = sharded(logits, target, world, dout=dout, chunk=3, kind=kind)
    ref, ref_grad = reference_grad(logits, target, dout, kind=kind)
    assert_close_verbose(out, ref, atol=1e-10, what="values")
    assert_close_verbose(grad, ref_grad, atol=1e-10, what="dlogits")


@pytest.mark.parametrize("world", WORLDS)
def test_reference_equivalence_leading_dims(world):
    """Any leading shape `[...]` works: 1-D target, 3-D target."""
    for shape in [(5, 8), (2, 3, 2, 8)]:
        gen = torch.Generator().manual_seed(len(shape))
        logits = torch.randn(shape, generator=gen, dtype=F64)
        target = torch.randint(0, shape[-1], shape[:-1], generator=gen)
        out, _, grad = sharded(logits, target, world)
        ref, ref_grad = reference_grad(logits, target)
        assert_close_verbose(out, ref, atol=1e-10, what=f"values {shape}")
        assert_close_verbose(grad, ref_grad, atol=1e-10, what=f"dlogits {shape}")


def test_reference_equivalence_non_contiguous():
    """A transposed (non-contiguous) logits view gives the same values and gradient."""
    base = torch.randn(9, 4, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    logits = base.transpose(0, 2)  # [3, 4, 9], non-contiguous
    target = torch.randint(0, 9, (3, 4), generator=torch.Generator().manual_seed(2))
    x = logits.detach().requires_grad_(True)
    out = lossfx.token_logprobs(x, target, chunk_size=5)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, ref_grad = reference_grad(logits, target, dout)
    assert_close_verbose(out, ref, atol=1e-10, what="values")
    assert_close_verbose(x.grad, ref_grad, atol=1e-10, what="dlogits")


# ---------------------------------------------------------------------------------------------
# 2. Low precision (fp32, bf16) against a float64 truth
# ---------------------------------------------------------------------------------------------

EPS32 = torch.finfo(torch.float32).eps


def _baseline(logits, target, dout):
    """The naive dense baseline in the same precision: fp32 log_softmax of the logits, gather."""
    x = logits.detach().clone().requires_grad_(True)
    out = torch.log_softmax(x.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    out.backward(dout.float())
    return out.detach(), x.grad


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0, 1e4])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_against_float64_truth(dtype, world, scale):
    logits, target = make_inputs((3, 11, 64), seed=3, scale=scale, dtype=dtype)
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    out, lse, grad = sharded(logits, target, world, dout=dout, chunk=7)
    # The truth is the float64 reference of the very (already rounded) logits the op sees.
    truth, truth_grad = reference_grad(logits, target, dout)
    base, base_grad = _baseline(logits, target, dout)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert grad.dtype == dtype and base_grad.dtype == dtype
    # Values: op and baseline both compute a max-shifted log-sum-exp in fp32, so each is off
    # by a few fp32 roundings of numbers of size |z| + log V (the shift and the log of a sum of
    # up to V terms). The op may round differently (it merges R partial sums), so it gets a slack
    # of 16 fp32 ulps of that magnitude on top of the baseline's own error.
    mag = logits.detach().to(F64).abs().amax(dim=-1) + math.log(logits.shape[-1]) + 1.0  # [B, S]
    tol = 16 * EPS32 * mag
    err_op, err_base = (out.to(F64) - truth).abs(), (base.to(F64) - truth).abs()
    bad = err_op > err_base + tol
    assert not bad.any(), (
        f"values: {int(bad.sum())} worse than baseline; e.g. op={out[bad][:3].tolist()} "
        f"base={base[bad][:3].tolist()} truth={truth[bad][:3].tolist()}"
    )
    # Gradients: both are an fp32 value (error ~ a few EPS32·|dout|·(1 + exp-error of the
    # softmax, which is EPS32·mag relative)) rounded once to the logits' dtype. Two fp32 values a
    # hair apart can round to neighbouring representable numbers, so the op may be one rounding
    # step (eps_dtype·|g|) worse than the baseline, plus the fp32 slack.
    eps_dtype = torch.finfo(dtype).eps
    g_scale = dout.abs().to(F64)[..., None]
    gtol = eps_dtype * truth_grad.abs() + 16 * EPS32 * mag[..., None] * g_scale
    gerr_op, gerr_base = (grad.to(F64) - truth_grad).abs(), (base_grad.to(F64) - truth_grad).abs()
    gbad = gerr_op > gerr_base + gtol
    assert not gbad.any(), (
        f"dlogits: {int(gbad.sum())} worse than baseline at {gbad.nonzero()[:3].tolist()}; "
        f"op={grad[gbad][:3].tolist()} base={base_grad[gbad][:3].tolist()} "
        f"truth={truth_grad[gbad][:3].tolist()}"
    )


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_output_and_grad_dtypes(dtype, out_dtype):
    logits, target = make_inputs((2, 3, 5), dtype=dtype)
    x = logits.requires_grad_(True)
    out, lse = lossfx.token_logprobs_with_lse(x, target)
    assert out.dtype == out_dtype and lse.dtype == out_dtype
    out.sum().backward()
    assert x.grad.dtype == dtype


# ---------------------------------------------------------------------------------------------
# 3. Properties (hypothesis, eager, ranks as threads)
# ---------------------------------------------------------------------------------------------

f64_cases = strategies.logits_cases(dtypes=(F64,))


def _grad_tol(dtype):
    """Chunking/sharding changes only which rows/columns share a temporary, not the per-row
    maths: results agree to float64 rounding, or to one rounding of the output/grad dtype."""
    return {F64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]


@given(case=strategies.logits_cases())
@strategies.with_examples()
def test_chunked_equals_unchunked(case):
    logits, target = case.logits(), case.target()
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(case.seed), dtype=F64)
    dout = dout.to(lossfx._core.numerics.compute_dtype(case.dtype))
    out_c, lse_c, grad_c = sharded(logits, target, case.world, dout=dout, chunk=case.chunk)
    out_1, lse_1, grad_1 = sharded(logits, target, case.world, dout=dout, chunk=max(1, case.n_tokens + 1))
    tol = _grad_tol(case.dtype)
    assert_close_verbose(out_c, out_1, atol=tol, rtol=tol, what="values")
    assert_close_verbose(lse_c, lse_1, atol=tol, rtol=tol, what="lse")
    assert_close_verbose(grad_c, grad_1, atol=tol, rtol=tol, what="dlogits")


@given(case=f64_cases)
@strategies.with_examples()
def test_sharded_equals_dense_reference(case):
    logits, target = case.logits(), case.target()
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(case.seed + 1), dtype=F64)
    out, _, grad = sharded(logits, target, case.world, dout=dout, chunk=case.chunk)
    out_dense, _, grad_dense = sharded(logits, target, 1, dout=dout, chunk=case.chunk)
    ref, ref_grad = reference_grad(logits, target, dout)
    # values scale with the logits; 1e-10 relative to the logit scale (and absolute below 1)
    atol = 1e-10 * max(1.0, case.scale)
    assert_close_verbose(out, ref, atol=atol, what="values vs reference")
    assert_close_verbose(grad, ref_grad, atol=1e-10, what="dlogits vs reference")
    assert_close_verbose(out, out_dense, atol=atol, what="values R vs 1")
    assert_close_verbose(grad, grad_dense, atol=1e-10, what="dlogits R vs 1")


@given(case=strategies.logits_cases(dtypes=(F64,), scales=(1e-3, 1.0, 30.0)), shift=st.floats(-50, 50))
def test_shift_invariance(case, shift):
    logits, target = case.logits(), case.target()
    gen = torch.Generator().manual_seed(case.seed)
    row_shift = shift * torch.rand(target.shape, generator=gen, dtype=F64)
    out, _, grad = sharded(logits, target, case.world, chunk=case.chunk)
    out_s, _, grad_s = sharded(logits + row_shift[..., None], target, case.world, chunk=case.chunk)
    # Subtracting the shift back costs a rounding of numbers of size |z| + |shift|.
    atol = 1e-12 * (case.scale + abs(shift) + 10)
    assert_close_verbose(out_s, out, atol=atol, what="values")
    assert_close_verbose(grad_s, grad, atol=atol, what="dlogits")


def _lse_rank_fn(rank, world, group, logits, target, chunk):
    vl = logits.shape[-1] // world
    shard = logits[..., rank * vl : (rank + 1) * vl]
    out, lse = lossfx.token_logprobs_with_lse(shard, target, group=group, chunk_size=chunk)
    local_mass = torch.exp(shard - lse[..., None]).sum(dim=-1)  # this rank's share of Σ softmax
    return out, lse, local_mass


@given(case=f64_cases)
@strategies.with_examples()
def test_lse_form_sums_to_one(case):
    """exp(z − lse) summed over all ranks' columns is 1 on each row, and out = z[target] − lse."""
    logits, target = case.logits(), case.target()
    results = run_ranks(case.world, _lse_rank_fn, logits, target, case.chunk)
    out, lse = results[0][0], results[0][1]
    mass = sum(r[2] for r in results)
    finite_row = ~torch.isneginf(logits).all(dim=-1)
    # exp(z − lse) carries the rounding of lse (relative 1e-16 of |lse| ≈ scale) as a relative error
    mass_tol = 1e-13 * max(1.0, case.scale)
    ones = torch.ones_like(mass[finite_row])
    assert_close_verbose(mass[finite_row], ones, atol=mass_tol, what="Σ softmax")
    assert torch.isneginf(lse[~finite_row]).all()
    picked = logits.gather(-1, target[..., None])[..., 0]
    expected = torch.where(torch.isneginf(lse), torch.full_like(lse, -math.inf), picked - lse)
    assert_close_verbose(out, expected, atol=1e-10 * max(1.0, case.scale), what="out = z_t − lse")
    ref_lse = torch.logsumexp(logits, dim=-1)
    assert_close_verbose(lse, ref_lse, atol=1e-10 * max(1.0, case.scale), what="lse vs logsumexp")


@given(case=strategies.logits_cases(dtypes=(F64,), neg_inf=("some", "row", "target")))
def test_neg_inf_entries_behave_like_absent(case):
    """A row's `-inf` columns may be deleted: same value, and their gradient is 0."""
    logits, target = case.logits(), case.target()
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(case.seed), dtype=F64)
    out, _, grad = sharded(logits, target, case.world, dout=dout, chunk=case.chunk)
    assert_no_nan(out, grad)
    flat, tflat, oflat = logits.view(-1, case.vocab), target.view(-1), out.view(-1)
    gflat, dflat = grad.reshape(-1, case.vocab), dout.view(-1)
    for n in range(flat.shape[0]):
        keep = ~torch.isneginf(flat[n])
        others = ~keep & (torch.arange(case.vocab) != tflat[n])
        assert (gflat[n][others] == 0).all(), f"row {n}: nonzero gradient on a -inf non-target entry"
        if not keep[tflat[n]]:
            # d out/d z_t = 1 − p_t = 1 for a -inf target (finite row) and 0 for a dead row
            assert oflat[n] == -math.inf, f"row {n}: -inf target logit must give -inf"
            expected = 0.0 if not keep.any() else float(dflat[n])
            assert float(gflat[n][tflat[n]]) == pytest.approx(expected, abs=1e-12), f"row {n}"
            continue
        compact = flat[n][keep].detach().requires_grad_(True)
        new_t = keep[: tflat[n]].sum()  # position of the target among the kept columns
        ref = reference.token_logprobs(compact[None], new_t[None])[0]
        ref.backward(dflat[n])
        assert abs(float(oflat[n]) - float(ref.detach())) <= 1e-10 * max(1.0, case.scale), f"row {n}"
        assert_close_verbose(gflat[n][keep], compact.grad, atol=1e-10, what=f"row {n} dlogits")


@given(case=strategies.logits_cases(neg_inf=("row",)))
def test_all_neg_inf_row_is_neg_inf_with_zero_grad(case):
    """Rows that are `-inf` everywhere give `-inf` and a zero gradient; nothing is ever NaN."""
    logits, target = case.logits64(), case.target()
    logits.view(-1, case.vocab)[0] = -math.inf  # at least the first row, on every dtype
    logits = logits.to(case.dtype)
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(case.seed))
    dout = dout.to(lossfx._core.numerics.compute_dtype(case.dtype))
    out, lse, grad = sharded(logits, target, case.world, dout=dout, chunk=case.chunk)
    assert_no_nan(out, lse, grad)
    dead = torch.isneginf(logits).all(dim=-1)
    assert dead.view(-1)[0]
    assert torch.isneginf(out[dead]).all() and torch.isneginf(lse[dead]).all()
    assert (grad[dead] == 0).all()
    # the surviving rows are unaffected by the dead ones: compare with the reference
    ref, _ = reference_grad(logits, target, dout)
    tol = 1e-10 * max(1.0, case.scale) if case.dtype == F64 else 1e-2 * max(1.0, case.scale)
    assert_close_verbose(out, ref, atol=tol, rtol=tol, what="values")


@given(case=strategies.logits_cases())
def test_inputs_never_modified(case):
    logits, target = case.logits(), case.target()
    logits_before, target_before = logits.clone(), target.clone()
    sharded(logits, target, case.world, chunk=case.chunk)
    # also a direct call on the caller's own tensor (no slicing/cloning in between)
    x = logits.requires_grad_(True)
    lossfx.token_logprobs(x, target, chunk_size=case.chunk).sum().backward()
    assert torch.equal(logits.detach(), logits_before)
    assert torch.equal(target, target_before)


# ---------------------------------------------------------------------------------------------
# 4. Gradients: float64 gradcheck (1, 2, 4 ranks) and double backward
# ---------------------------------------------------------------------------------------------


def _gradcheck_rank_fn(rank, world, group, logits, target, chunk, fast_mode):
    """Each rank in turn is the one whose local shard gradcheck perturbs.

    All ranks call gradcheck in lockstep (the same number of forwards, hence of collectives).
    Only the checked rank's function depends on its input; the others feed their fixed shard into
    the collective and return a constant (their output moves with the checked rank's
    perturbations, which are not theirs), so the numerical Jacobian of the checked rank is
    exactly d out / d (its local shard).
    """
    vl = logits.shape[-1] // world
    shard = logits[..., rank * vl : (rank + 1) * vl].detach().clone()
    for checked in range(world):
        x = shard.clone().requires_grad_(True)

        def fn(inp, checked=checked):
            if rank == checked:
                return lossfx.token_logprobs(inp, target, group=group, chunk_size=chunk)
            out = lossfx.token_logprobs(shard, target, group=group, chunk_size=chunk)
            return out.detach() * 0.0 + 0.0 * inp.sum()

        assert torch.autograd.gradcheck(fn, (x,), check_undefined_grad=True, fast_mode=fast_mode)
    return True


# 4 ranks check one chunking by default (3: a partial last chunk); 4 ranks unchunked and with
# chunk 1 with -m slow: every chunking is checked on 1 and 2 ranks (test_gradcheck[1-*], [2-*])
@pytest.mark.parametrize(
    ("world", "chunk"),
    [(w, c) for w in (1, 2) for c in (None, 1, 3)]
    + [(4, 3), *(pytest.param(4, c, marks=pytest.mark.slow) for c in (None, 1))],
)
def test_gradcheck(world, chunk):
    vocab = {1: 33, 2: 16, 4: 32}[world]  # N = 4 ≤ 4 rows, V ≤ 33
    logits, target = make_inputs((1, 4, vocab), seed=11)
    assert all(run_ranks(world, _gradcheck_rank_fn, logits, target, chunk, False))


def test_gradcheck_fast_mode_medium():
    logits, target = make_inputs((2, 16, 64), seed=12)
    assert all(run_ranks(2, _gradcheck_rank_fn, logits, target, 5, True))


def test_double_backward_raises():
    """The backward is `once_differentiable` (proofs/logprobs.md §5): double backward must raise."""
    logits, target = make_inputs((2, 3, 5))
    x = logits.requires_grad_(True)
    out = lossfx.token_logprobs(x, target)
    (grad,) = torch.autograd.grad((out**2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


# ---------------------------------------------------------------------------------------------
# 6. Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [-1, 5, 99])
def test_target_out_of_range(bad_id):
    logits, target = make_inputs((2, 3, 5))
    target[1, 2] = bad_id
    with pytest.raises(ValueError, match=r"target") as info:
        lossfx.token_logprobs(logits, target)
    assert str(bad_id) in str(info.value)


def test_target_out_of_range_of_global_vocab_with_shard_args():
    """With an explicit `vocab_size`, ids are checked against the global vocabulary (without a
    group it must be the logits' width: a wider one is rejected, tests/test_vocab_range.py)."""
    logits, target = make_inputs((1, 4, 3))
    target[0, 0] = 7
    with pytest.raises(ValueError, match=r"target.*7"):
        lossfx.token_logprobs(logits, target, vocab_start=0, vocab_size=3)


def _oob_rank_fn(rank, world, group, logits, target):
    vl = logits.shape[-1] // world
    lossfx.token_logprobs(logits[..., rank * vl : (rank + 1) * vl], target, group=group)


def test_target_out_of_range_on_ranks():
    """Ids in [Vl, V) are fine on 2 ranks; an id >= V = R·Vl raises on every rank."""
    logits, target = make_inputs((1, 3, 8))
    target[0, 1] = 7  # >= Vl = 4, but < V = 8: valid
    run_ranks(2, _oob_rank_fn, logits, target)
    target[0, 1] = 8
    with pytest.raises(Exception, match=r"ValueError: target"):
        run_ranks(2, _oob_rank_fn, logits, target)


@pytest.mark.parametrize(
    ("logits_shape", "target_shape"),
    [((2, 3, 5), (2, 4)), ((2, 3, 5), (3, 2)), ((2, 3, 5), (2, 3, 5)), ((6,), (6,))],
)
def test_shape_mismatch(logits_shape, target_shape):
    logits = torch.zeros(logits_shape)
    target = torch.zeros(target_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=r"shape"):
        lossfx.token_logprobs(logits, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.complex64])
def test_non_integer_target(dtype):
    logits = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"target"):
        lossfx.token_logprobs(logits, torch.zeros(2, dtype=dtype))


def test_non_float_logits():
    with pytest.raises(TypeError, match=r"logits"):
        lossfx.token_logprobs(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_other_integer_target_dtypes_work(dtype):
    logits, target = make_inputs((2, 3, 5))
    out = lossfx.token_logprobs(logits, target.to(dtype))
    assert_close_verbose(out, reference.token_logprobs(logits, target), atol=1e-10)


@pytest.mark.parametrize(
    ("chunk", "exc"),
    [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError), ("4", TypeError)],
)
def test_bad_chunk_size(chunk, exc):
    logits, target = make_inputs((2, 3, 5))
    with pytest.raises(exc, match=r"chunk_size"):
        lossfx.token_logprobs(logits, target, chunk_size=chunk)


# ---------------------------------------------------------------------------------------------
# 7. Memory contract: saved bytes ≤ logits bytes + O(N), logits saved without a copy
# ---------------------------------------------------------------------------------------------


def _saved_tensors(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return saved, result


@pytest.mark.parametrize("chunk", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_saved_bytes_bound(dtype, chunk):
    logits, target = make_inputs((2, 8, 96), dtype=dtype)
    x = logits.requires_grad_(True)
    saved, out = _saved_tensors(lambda: lossfx.token_logprobs(x, target, chunk_size=chunk))
    n = target.numel()
    total = sum(t.numel() * t.element_size() for t in saved)
    # logits (no copy) + target ids (int64) + shift and log_s (compute dtype): ≤ logits + 24 B per token
    assert total <= x.numel() * x.element_size() + 24 * n, f"saved {total} bytes: {[t.shape for t in saved]}"
    assert any(t.data_ptr() == x.data_ptr() and t.dtype == x.dtype for t in saved), "logits were copied"
    big = [t for t in saved if t.numel() > 2 * n]
    assert len(big) == 1, f"only the logits may be O(N·V); saved {[tuple(t.shape) for t in saved]}"
    out.sum().backward()  # the saved tensors are enough for the backward


def _saved_rank_fn(rank, world, group, logits, target):
    vl = logits.shape[-1] // world
    x = logits[..., rank * vl : (rank + 1) * vl].detach().clone().requires_grad_(True)
    saved, out = _saved_tensors(lambda: lossfx.token_logprobs(x, target, group=group, chunk_size=3))
    total = sum(t.numel() * t.element_size() for t in saved)
    copied = not any(t.data_ptr() == x.data_ptr() for t in saved)
    out.sum().backward()
    return total, x.numel() * x.element_size(), copied


@pytest.mark.parametrize("world", [2, 4])
def test_saved_bytes_bound_sharded(world):
    logits, target = make_inputs((2, 5, 16))
    for total, local_bytes, copied in run_ranks(world, _saved_rank_fn, logits, target):
        assert total <= local_bytes + 24 * target.numel()
        assert not copied
