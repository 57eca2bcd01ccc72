"""A NaN or `+inf` in any floating input of a logits function with a custom backward: never made
finite (issue 25, item 4).

For every such public function (`token_logprobs`, `gather_logprobs` with and without `Σ p log p`,
`neg_entropy` / `entropy`, `cross_entropy_to_fixed`, `reverse_kl_to_fixed`,
`divergence_to_projected_teacher`, `filtered_token_logprobs`, `distillation_topk_logprobs`), one
entry of one input is made NaN or `+inf` (on the target column and off it), and the non-finite
pattern (NaN, `+inf`, `-inf` positions) of every output and every gradient must be the float64
reference's (`lossfx.reference`, autograd through the dense formula), with the reference's values
elsewhere; eager (in several row chunks), compiled, and on 2 gloo ranks (the non-finite entry on
one rank's shard, the merge of proofs/logprobs.md §3.1). `-inf` inputs are checked the same way.
The fused LM-head functions are covered by tests/test_fused_nonfinite.py.

Documented exceptions, asserted here as such:
* a teacher `-inf` under student mass (CE, reverse KL): `R = +inf` with a zero gradient for that
  row (proofs/divergence.md §4), where the reference's autograd gives `±inf` and NaN entries;
* (no longer one: `filtered_token_logprobs` of a row holding a NaN is NaN with a NaN gradient in
  every column of that row, as its reference now defines it; docs/filtering.md)
  defines it (the filter keeps nothing of such a row).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from devices import DEVICE
from harness import gloo_pool
from test_fused_nonfinite import assert_same_pattern

import lossfx
import lossfx.divergence
from lossfx import reference

F64 = torch.float64
N, V, K = 5, 12, 3
ROW = 2  # the row made non-finite
TARGET = torch.tensor([1, 4, 6, 9, 11]).to(DEVICE)  # import-time tensors follow --device by hand
IDS = torch.tensor([[1, 2, 3], [4, 0, 4], [6, 7, 2], [9, 10, 11], [11, 0, 5]]).to(DEVICE)
VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(N, V, generator=gen, dtype=F64) * 2
    teacher = torch.randn(N, V, generator=gen, dtype=F64) * 2
    ups = (torch.randn(N, generator=gen, dtype=F64), torch.randn(N, K, generator=gen, dtype=F64))
    return student, teacher, ups


def _spot(x, value, on_target):
    """`x` with `value` at row `ROW`, on that row's target column (also an id of `IDS`) or off it."""
    x = x.clone()
    x[ROW, TARGET[ROW] if on_target else 0] = value
    return x


def _grads(outs, ups, leaves):
    pairs = [(o, u) for o, u in zip(outs, ups, strict=True) if o is not None and o.requires_grad]
    return list(torch.autograd.grad([o for o, _ in pairs], leaves, [u for _, u in pairs]))


def _compare(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_pattern(g, w, f"{what}: output/gradient {i}", atol=1e-9)


# ---------------------------------------------------------------------------------------------
# The calls: (lossfx, reference), each -> outputs + gradients of the differentiable inputs
# ---------------------------------------------------------------------------------------------


def _token(fn, s, t, ups, **kw):
    s = s.requires_grad_()
    out = fn(s, TARGET, **kw)
    return [out, *_grads([out], [ups[0]], [s])]


def _gather(entropy):
    def call(fn, s, t, ups, **kw):
        s = s.requires_grad_()
        if fn is reference.gather_logprobs:
            lp, ne = fn(s, IDS)
            ne = ne if entropy else None
        else:
            lp, ne = fn(s, IDS, with_neg_entropy=entropy, **kw)
        return [lp, ne, *_grads([lp, ne], [ups[1], ups[0]], [s])] if entropy else [lp, *_grads([lp], [ups[1]], [s])]

    return call


def _divergence(name):
    def call(fn, s, t, ups, **kw):
        s = s.requires_grad_()
        out = fn(s, **kw) if name in ("neg_entropy", "entropy") else fn(s, t, **kw)
        return [out, *_grads([out], [ups[0]], [s])]

    return call


def _filtered(**filt):
    def call(fn, s, t, ups, **kw):
        s = s.requires_grad_()
        out = fn(s, TARGET, **filt, **kw)
        return [out, *_grads([out], [ups[0]], [s])]

    return call


def _distill(zero_outside, entropy):
    def call(fn, s, t, ups, **kw):
        student = s.view(1, N, V).requires_grad_()
        tk = t[:, :K].reshape(1, N, K).clone().requires_grad_()
        ids = IDS.view(1, N, K)
        if fn is reference.distillation_topk_logprobs:
            outs = fn(student, tk, ids, zero_outside, entropy)
        else:
            outs = fn(student, tk, ids, zero_outside_topk=zero_outside, calculate_entropy=entropy, **kw)
        gens = torch.Generator().manual_seed(1)
        ups_ = [None if o is None else torch.randn(o.shape, generator=gens, dtype=F64) for o in outs]
        return [o for o in outs if o is not None] + _grads(list(outs), ups_, [student, tk])

    return call


CALLS = {
    "token_logprobs": (_token, lossfx.token_logprobs, reference.token_logprobs),
    "gather_logprobs": (_gather(False), lossfx.gather_logprobs, reference.gather_logprobs),
    "gather_logprobs+H": (_gather(True), lossfx.gather_logprobs, reference.gather_logprobs),
    "neg_entropy": (_divergence("neg_entropy"), lossfx.neg_entropy, reference.neg_entropy),
    "entropy": (_divergence("entropy"), lossfx.entropy, reference.entropy),
    "cross_entropy_to_fixed": (
        _divergence("ce"),
        lossfx.cross_entropy_to_fixed,
        reference.cross_entropy_to_fixed,
    ),
    "reverse_kl_to_fixed": (_divergence("kl"), lossfx.reverse_kl_to_fixed, reference.reverse_kl_to_fixed),
    "filtered top-k": (_filtered(top_k=4), lossfx.filtered_token_logprobs, reference.filtered_token_logprobs),
    "filtered top-p": (_filtered(top_p=0.8), lossfx.filtered_token_logprobs, reference.filtered_token_logprobs),
    "filtered top-k top-p": (
        _filtered(top_k=4, top_p=0.8),
        lossfx.filtered_token_logprobs,
        reference.filtered_token_logprobs,
    ),
    "filtered top-k bisection": (
        _filtered(top_k=4, top_p=0.8, strategy="bisection"),
        lossfx.filtered_token_logprobs,
        lambda s, t, top_k, top_p, strategy: reference.filtered_token_logprobs(s, t, top_k, top_p),
    ),
    "distillation": (_distill(True, True), lossfx.distillation_topk_logprobs, reference.distillation_topk_logprobs),
    "distillation renormalised": (
        _distill(False, False),
        lossfx.distillation_topk_logprobs,
        reference.distillation_topk_logprobs,
    ),
}
WITH_TEACHER = {"cross_entropy_to_fixed", "reverse_kl_to_fixed", "distillation", "distillation renormalised"}
CHUNKED = {"token_logprobs", "gather_logprobs", "gather_logprobs+H", "neg_entropy", "entropy"}
CHUNKED |= {"cross_entropy_to_fixed", "reverse_kl_to_fixed"} | {k for k in CALLS if k.startswith("filtered")}


def _run(name, where, value, on_target, **kw):
    make, fn, ref = CALLS[name]
    student, teacher, ups = _inputs()
    if where == "student":
        student = _spot(student, value, on_target)
    else:
        teacher = _spot(teacher, value, on_target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated `entropy` name; the -inf masking notice
        want = make(ref, student.clone(), teacher.clone(), ups)
        got = make(fn, student.clone(), teacher.clone(), ups, **kw)
    return got, want


def _is_exception(name, where, value):
    """The documented exceptions (module docstring)."""
    if where == "teacher" and value == -math.inf and name in ("cross_entropy_to_fixed", "reverse_kl_to_fixed"):
        return True
    return False


CASES = [
    (name, where, value, on_target)
    for name in CALLS
    for where in (("student", "teacher") if name in WITH_TEACHER else ("student",))
    for value in VALUES
    for on_target in (True, False)
]


@pytest.mark.parametrize(
    ("name", "where", "value", "on_target"),
    [c for c in CASES if not _is_exception(c[0], c[1], VALUES[c[2]])],
    ids=lambda x: str(x),
)
def test_non_finite_input_gives_the_reference_pattern(name, where, value, on_target):
    """Values and every gradient: the reference's NaN / `±inf` pattern, its values elsewhere, in
    one chunk and (where the function chunks its rows) in chunks of 2 rows."""
    x = VALUES[value]
    got, want = _run(name, where, x, on_target)
    _compare(got, want, f"{name}/{where}={value}/on_target={on_target}")
    if name in CHUNKED:
        got, _ = _run(name, where, x, on_target, chunk_size=2)
        _compare(got, want, f"{name}/{where}={value}/on_target={on_target}/chunked")
    if x != x or x == math.inf:  # NaN / +inf: the loss is NaN, so some gradient must be too
        grads = got[-2:] if name.startswith("distillation") else got[-1:]
        if got[0].isnan().any():
            assert any(g.isnan().any() for g in grads), f"{name}: a NaN output with finite gradients"


@pytest.mark.parametrize("name", ["cross_entropy_to_fixed", "reverse_kl_to_fixed"])
def test_teacher_neg_inf_under_student_mass_is_the_documented_exception(name):
    """`R = +inf` as the reference, and a zero gradient on that row (proofs/divergence.md §4)
    where the reference's autograd is non-finite; every other row is the reference's."""
    got, want = _run(name, "teacher", -math.inf, True)
    assert got[0][ROW] == math.inf and want[0][ROW] == math.inf
    assert torch.equal(got[1][ROW], torch.zeros_like(got[1][ROW]))
    assert not want[1][ROW].isfinite().all()
    rows = torch.arange(N) != ROW
    for g, w in zip(got, want, strict=True):
        assert_same_pattern(g[rows], w[rows], name, atol=1e-9)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_ignored_row_of_logits_keeps_its_nan(value):
    """`token_logprobs(..., ignore_index=-100)`: an ignored row's log-prob is 0, and a NaN or
    `+inf` logit in it still gives that row a NaN gradient, as the reference's autograd does (the
    logits exist: unlike the fused head, nothing is skipped, so there is no exception here)."""
    student, _, ups = _inputs()
    student = _spot(student, VALUES[value], False)
    target = TARGET.clone()
    target[ROW] = -100
    outs = []
    for fn in (lossfx.token_logprobs, reference.token_logprobs):
        s = student.clone().requires_grad_()
        out = fn(s, target, ignore_index=-100)
        outs.append([out, *_grads([out], [ups[0]], [s])])
    _compare(*outs, f"ignored row, {value}")
    assert outs[0][0][ROW] == 0 and outs[0][1][ROW].isnan().all()


@pytest.mark.parametrize("name", ["filtered top-k", "filtered top-p", "filtered top-k top-p"])
def test_filtered_nan_row_is_nan_with_nan_gradient(name):
    """The filter keeps nothing of a row holding a NaN: NaN log-prob and a NaN gradient in every
    column of that row (as `lossfx.reference.filtered_token_logprobs` defines it: the unfiltered
    `log_softmax` of the row), also where the row's upstream gradient is 0; other rows finite."""
    got, want = _run(name, "student", math.nan, False)
    assert got[0][ROW].isnan()
    assert got[1][ROW].isnan().all() and want[1][ROW].isnan().all()
    rows = torch.arange(N) != ROW
    assert got[1][rows].isfinite().all()
    student, _, _ = _inputs()
    s = _spot(student, math.nan, False).requires_grad_()
    filt = {"top_k": 4} if "top-k" in name else {}
    filt |= {"top_p": 0.8} if "top-p" in name else {}
    out = lossfx.filtered_token_logprobs(s, TARGET, **filt)
    (grad,) = torch.autograd.grad(out, s, torch.zeros_like(out))  # a zero upstream gradient
    assert grad[ROW].isnan().all() and (grad[rows] == 0).all()


# ---------------------------------------------------------------------------------------------
# divergence_to_projected_teacher: NaN / +inf in the student, the teacher's hidden states or head
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
@pytest.mark.parametrize("where", ["student", "hidden", "weight"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_projected_teacher(kind, where, value):
    gen = torch.Generator().manual_seed(3)
    student = torch.randn(N, V, generator=gen, dtype=F64)
    hidden = torch.randn(N, 4, generator=gen, dtype=F64)
    weight = torch.randn(V, 4, generator=gen, dtype=F64)
    up = torch.randn(N, generator=gen, dtype=F64)
    x = VALUES[value]
    if where == "student":
        student[ROW, 3] = x
    elif where == "hidden":
        hidden[ROW, 1] = x
    else:
        weight[5, 1] = x
    ref_fn = reference.cross_entropy_to_fixed if kind == "cross_entropy" else reference.reverse_kl_to_fixed
    s = student.clone().requires_grad_()
    want = ref_fn(s, hidden @ weight.T)
    want = [want, *_grads([want], [up], [s])]
    # an `inf` head entry makes a teacher logit `-inf` on the rows where its hidden entry is
    # negative: the documented exception there (R = +inf, zero gradient); the reference elsewhere
    teacher = hidden @ weight.T
    exception = teacher.isneginf().any(-1) & ~(teacher.isnan() | teacher.isposinf()).any(-1)
    exception &= ~(student.isnan() | student.isposinf()).any(-1)
    for chunk in (None, 2):
        s = student.clone().requires_grad_()
        got = lossfx.divergence.divergence_to_projected_teacher(kind, s, hidden, [weight], chunk_size=chunk)
        got = [got, *_grads([got], [up], [s])]
        what = f"projected {kind}/{where}={value}/chunk={chunk}"
        _compare([g[~exception] for g in got], [w[~exception] for w in want], what)
        assert (got[0][exception] == math.inf).all() and (got[1][exception] == 0).all(), what
        assert got[0].isnan().any() and got[1].isnan().any()


# ---------------------------------------------------------------------------------------------
# Compiled: the traced forward and backward (one fused expression each)
# ---------------------------------------------------------------------------------------------

# the divergences by default (their traced backward is its own expression); the rest under `slow`
# (their traced paths share the merge with the eager ones, checked above)
COMPILED = [
    pytest.param("neg_entropy"),
    pytest.param("cross_entropy_to_fixed"),
    pytest.param("reverse_kl_to_fixed"),
    pytest.param("token_logprobs", marks=pytest.mark.slow),
    pytest.param("gather_logprobs+H", marks=pytest.mark.slow),
    pytest.param("filtered top-k top-p", marks=pytest.mark.slow),
]


@pytest.mark.compile
@pytest.mark.parametrize("name", COMPILED)
def test_compiled(name):
    """Every value (NaN, `+inf`, `-inf`) and position through one compiled function: the
    reference's pattern (the documented teacher `-inf` exception left out)."""
    make, fn, ref = CALLS[name]
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    for where in ("student", "teacher") if name in WITH_TEACHER else ("student",):
        for value in VALUES:
            if _is_exception(name, where, VALUES[value]):
                continue
            for on_target in (True, False):
                student, teacher, ups = _inputs()
                if where == "student":
                    student = _spot(student, VALUES[value], on_target)
                else:
                    teacher = _spot(teacher, VALUES[value], on_target)
                want = make(ref, student.clone(), teacher.clone(), ups)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = make(compiled, student.clone(), teacher.clone(), ups)
                _compare(got, want, f"compiled {name}/{where}={value}/on_target={on_target}")


# ---------------------------------------------------------------------------------------------
# 2 gloo ranks: the vocabulary split in halves, the non-finite entry on one rank's shard, and an
# all -inf shard on the other rank for another row (the cross-rank merge of proofs/logprobs.md §3.1)
# ---------------------------------------------------------------------------------------------

GLOO_NAMES = ["token_logprobs", "gather_logprobs+H", "neg_entropy", "cross_entropy_to_fixed", "reverse_kl_to_fixed"]
GLOO_NAMES += ["filtered top-k top-p"]


def _gloo_inputs(value):
    student, teacher, ups = _inputs(seed=5)
    student[ROW, 9] = value  # on rank 1's half
    student[0, : V // 2] = -math.inf  # row 0: rank 0's whole shard -inf
    teacher[0, : V // 2] = -math.inf  # the teacher too (no +inf R on row 0)
    return student, teacher, ups


def gloo_nonfinite_rank(rank, world, group, value):
    results = []
    vl = V // world
    for name in GLOO_NAMES:
        make, fn, _ = CALLS[name]
        student, teacher, ups = _gloo_inputs(value)
        cols = slice(rank * vl, (rank + 1) * vl)
        kw = {"group": group}
        if name not in ("neg_entropy", "cross_entropy_to_fixed", "reverse_kl_to_fixed"):
            kw["vocab_start"], kw["vocab_size"] = rank * vl, V
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = make(fn, student[:, cols].contiguous(), teacher[:, cols].contiguous(), ups, **kw)
        results.append([g.detach() for g in got])
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_gloo_two_ranks(value):
    per_rank = gloo_pool(2).run(gloo_nonfinite_rank, VALUES[value])
    for i, name in enumerate(GLOO_NAMES):
        make, _, ref = CALLS[name]
        student, teacher, ups = _gloo_inputs(VALUES[value])
        want = make(ref, student.clone(), teacher.clone(), ups)
        r0, r1 = per_rank[0][i], per_rank[1][i]
        for j in range(len(want) - 1):  # the outputs: replicated on both ranks
            assert_same_pattern(r0[j], want[j], f"{name}/{value}: output {j}, rank 0", atol=1e-9)
            assert_same_pattern(r1[j], want[j], f"{name}/{value}: output {j}, rank 1", atol=1e-9)
        grad = torch.cat([r0[-1], r1[-1]], dim=-1)  # each rank's shard of the gradient
        assert grad.shape == want[-1].shape
        assert_same_pattern(grad, want[-1], f"{name}/{value}: gradient", atol=1e-9)
