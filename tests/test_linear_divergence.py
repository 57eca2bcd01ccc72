"""Tests of `lossfx.linear_divergence_to_teacher`: OPD_FULL's reverse KL, cross-entropy and
`Σ p log p` from hidden states on both sides (hidden x LM head, logits never materialised).

Sections: 1 float64 reference equivalence (both teacher forms, head options, tile sizes), values
and gradients of hidden, weight and bias; 2 the logits path's `-inf` rules (masked teacher entries,
all `-inf` teacher rows, masked head rows) and its dtypes; 3 low precision; 4 gradcheck and the
proof's backward formula; 5 TP on 2 (and, slow, 4) gloo ranks, uneven shards, compiled on 2 ranks,
`Shard(0)` DTensor heads, the cross-rank check; 6 compile; 7 errors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing
from devices import DEVICE, on_device
from harness import gloo_pool

import lossfx
from lossfx import reference
from lossfx.divergence import divergence_to_projected_teacher

F64 = torch.float64
TIGHT = {"rtol": 0.0, "atol": 1e-10}


def make_case(rows, hidden_size, vocab, *, seed=0, dtype=F64, teacher_hidden_size=5, scale=1.0):
    """Student hidden `[rows, H]`, weight `[V, H]`, bias `[V]`, teacher hidden `[rows, Ht]`, teacher
    weight `[V, Ht]`, teacher logits `[rows, V]` and three upstream gradients `[rows]`."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * s).to(dtype)

    case = {
        "hidden": draw(rows, hidden_size, s=scale),
        "weight": draw(vocab, hidden_size, s=3 / math.sqrt(hidden_size)),
        "bias": draw(vocab, s=0.5),
        "teacher_hidden": draw(rows, teacher_hidden_size),
        "teacher_weight": draw(vocab, teacher_hidden_size, s=3 / math.sqrt(teacher_hidden_size)),
    }
    case["teacher_logits"] = draw(rows, vocab, s=2.0)
    case["grads"] = torch.randn(3, rows, generator=gen, dtype=F64)
    return case


def teacher_kwargs(case, form):
    if form == "logits":
        return {"teacher_logits": case["teacher_logits"]}
    return {"teacher_hidden": case["teacher_hidden"], "teacher_weight": case["teacher_weight"]}


def run(case, form, *, grads=None, bias=True, **options):
    """-> ((kl, ce, ne), (dhidden, dweight, dbias)) of lossfx, upstream `grads [3, N]`."""
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    b = case["bias"].clone().requires_grad_() if bias else None
    out = lossfx.linear_divergence_to_teacher(h, w, bias=b, **teacher_kwargs(case, form), **options)
    grads = case["grads"] if grads is None else grads
    torch.autograd.backward(list(out), [g.to(o.dtype) for g, o in zip(grads, out)])
    return tuple(o.detach() for o in out), (h.grad, w.grad, None if b is None else b.grad)


def run_reference(case, form, *, grads=None, bias=True, **options):
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    b = case["bias"].clone().requires_grad_() if bias else None
    options.pop("chunk_size", None)
    out = reference.linear_divergence_to_teacher(h, w, bias=b, **teacher_kwargs(case, form), **options)
    grads = case["grads"] if grads is None else grads
    torch.autograd.backward(list(out), list(grads))
    return tuple(o.detach() for o in out), (h.grad, w.grad, None if b is None else b.grad)


def assert_close(got, expected, tol, what=""):
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if e is None:
            assert g is None, what
            continue
        torch.testing.assert_close(g.to(F64), e.to(F64), **tol, msg=lambda m, i=i: f"{what} [{i}]: {m}")


# ---------------------------------------------------------------------------------------------
# 1. float64 reference equivalence
# ---------------------------------------------------------------------------------------------

HEADS = [
    {},
    {"temperature": 0.7},
    {"temperature": 1.3, "logit_scale": 0.8, "softcap": 4.0},
]


@pytest.mark.parametrize("form", ["logits", "hidden"])
@pytest.mark.parametrize("head", HEADS, ids=["plain", "temperature", "scale-softcap"])
@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_matches_reference_float64(form, head, chunk):
    case = make_case(23, 6, 37, seed=1)
    got = run(case, form, chunk_size=chunk, **head)
    expected = run_reference(case, form, **head)
    assert_close(got[0], expected[0], TIGHT, "values")
    assert_close(got[1], expected[1], TIGHT, "grads")


def test_vocabulary_blocks_and_leading_shape():
    """Several vocabulary blocks (a tight policy) and `[B, S, H]` inputs give the reference."""
    case = make_case(12, 4, 45, seed=2)
    shaped = {
        k: (v.reshape(3, 4, -1) if k in ("hidden", "teacher_hidden", "teacher_logits") else v) for k, v in case.items()
    }
    shaped["grads"] = case["grads"].reshape(3, 3, 4)
    policy = lossfx.ChunkPolicy(row_bytes=4096, min_rows=1, tile_bytes=24 * 8 * 16 * 5, max_block=16)
    for form in ("logits", "hidden"):
        with lossfx.chunk_policy(policy):  # blocks of 16 columns (3 per row), 5 rows per tile
            got = run(shaped, form)
        expected = run_reference(shaped, form)
        assert got[0][0].shape == (3, 4)
        assert_close(got[0], expected[0], TIGHT, form)
        assert_close(got[1], expected[1], TIGHT, form)


def test_only_the_used_outputs_reach_the_gradient():
    """A metric output (no gradient) costs no backward term: grads with g_ce = g_ne = 0."""
    case = make_case(9, 4, 11, seed=3)
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    out = lossfx.linear_divergence_to_teacher(h, w, teacher_logits=case["teacher_logits"])
    out.reverse_kl.backward(case["grads"][0])
    grads = case["grads"].clone()
    grads[1:] = 0
    expected = run_reference(case, "logits", grads=grads, bias=False)
    assert_close((h.grad, w.grad), expected[1][:2], TIGHT)


@pytest.mark.parametrize("chunk", [None, 3])
def test_several_teacher_heads_chosen_per_row(chunk):
    """OPD_FULL's per-row teacher heads (`opd_full_teacher_index`): row `n` through
    `teacher_weight[teacher_head[n]]`; rows of one head and of several heads in a tile."""
    case = make_case(11, 4, 17, seed=13)
    gen = torch.Generator().manual_seed(13)
    heads = [
        case["teacher_weight"],
        torch.randn(17, 5, generator=gen, dtype=F64),
        torch.randn(17, 5, generator=gen, dtype=F64),
    ]
    which = torch.tensor([0, 2, 2, 1, 0, 0, 2, 1, 1, 2, 0])
    h, w = case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
    th = case["teacher_hidden"]
    out = lossfx.linear_divergence_to_teacher(
        h, w, teacher_hidden=th, teacher_weight=heads, teacher_head=which, chunk_size=chunk
    )
    torch.autograd.backward(list(out), list(case["grads"]))
    rh, rw = case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
    ref = reference.linear_divergence_to_teacher(rh, rw, teacher_hidden=th, teacher_weight=heads, teacher_head=which)
    torch.autograd.backward(list(ref), list(case["grads"]))
    assert_close(out, ref, TIGHT, "values")
    assert_close((h.grad, w.grad), (rh.grad, rw.grad), TIGHT, "grads")
    with pytest.raises(ValueError, match="teacher_head"):
        lossfx.linear_divergence_to_teacher(h, w, teacher_hidden=th, teacher_weight=heads)
    with pytest.raises(ValueError, match="teacher_head"):
        lossfx.linear_divergence_to_teacher(h, w, teacher_hidden=th, teacher_weight=heads, teacher_head=which + 1)


def test_identical_teacher_gives_zero_kl_and_inputs_not_mutated():
    case = make_case(8, 4, 10, seed=4)
    h, w = case["hidden"], case["weight"]
    before = (h.clone(), w.clone())
    out = lossfx.linear_divergence_to_teacher(h, w, teacher_hidden=h, teacher_weight=w)
    assert torch.equal(out.reverse_kl, torch.zeros(8, dtype=F64))
    torch.testing.assert_close(out.cross_entropy, -out.neg_entropy, rtol=0, atol=1e-12)
    assert torch.equal(h, before[0]) and torch.equal(w, before[1])


# ---------------------------------------------------------------------------------------------
# 2. The logits path's rules: -inf, masked rows, dtypes
# ---------------------------------------------------------------------------------------------


def _logits_path(z, teacher, grads):
    """The logits path (`lossfx.reverse_kl_to_fixed` & co.) on dense logits `z` (a leaf)."""
    out = (lossfx.reverse_kl_to_fixed(z, teacher), lossfx.cross_entropy_to_fixed(z, teacher), lossfx.neg_entropy(z))
    torch.autograd.backward(list(out), [g.to(o.dtype) for g, o in zip(grads, out)])
    return tuple(o.detach() for o in out), z.grad


def test_neg_inf_teacher_and_masked_head_rows_as_the_logits_path():
    """Teacher `-inf` entries (some under student mass: KL = CE = +inf, no gradient on that row),
    an all `-inf` teacher row, and head rows masked by a `-inf` bias (padding rows): the values and
    the gradient are the logits path's on the dense logits."""
    case = make_case(10, 4, 13, seed=5)
    teacher = case["teacher_logits"].clone()
    teacher[1, 3] = -math.inf  # under student mass: +inf
    teacher[2] = -math.inf  # all -inf row
    teacher[4, 11:] = -math.inf  # only where the student is masked: finite
    bias = case["bias"].clone()
    bias[11:] = -math.inf  # two padded head rows
    case = {**case, "teacher_logits": teacher, "bias": bias}
    (values, (dh, dw, db)) = run(case, "logits")
    z = (case["hidden"] @ case["weight"].T + bias).requires_grad_()
    expected, dz = _logits_path(z, teacher, case["grads"])
    assert_close(values, expected, TIGHT, "values")
    assert torch.isposinf(values[0][1]) and torch.isposinf(values[0][2]) and math.isfinite(values[0][4])
    dz = torch.nan_to_num(dz)  # (no NaN either way: checked below)
    assert not torch.isnan(dh).any() and not torch.isnan(dw).any()
    assert_close((dh, dw[:11], db[:11]), (dz @ case["weight"], dz.T[:11] @ case["hidden"], dz.sum(0)[:11]), TIGHT)


def test_dtypes_match_the_logits_path():
    """Output dtypes: `promote(hidden @ W.T, teacher, fp32)`, as the logits path and the projected teacher."""
    case = make_case(6, 4, 9, seed=6, dtype=torch.float32)
    h, w = case["hidden"].to(torch.bfloat16), case["weight"].to(torch.bfloat16)
    for teacher, expected in (
        (case["teacher_logits"].to(torch.bfloat16), torch.float32),
        (case["teacher_logits"].to(F64), F64),
    ):
        out = lossfx.linear_divergence_to_teacher(h, w, teacher_logits=teacher)
        assert out.reverse_kl.dtype == lossfx.reverse_kl_to_fixed(h @ w.T, teacher).dtype == expected
    tw = case["teacher_weight"].to(torch.bfloat16)
    for logits_dtype in (None, torch.float32, F64):
        out = lossfx.linear_divergence_to_teacher(
            h, w, teacher_hidden=case["teacher_hidden"], teacher_weight=tw, teacher_logits_dtype=logits_dtype
        )
        ref = divergence_to_projected_teacher(
            "reverse_kl", h @ w.T, case["teacher_hidden"], [tw], logits_dtype=logits_dtype
        )
        assert out.reverse_kl.dtype == ref.dtype
        # the same projected teacher (hidden rounded to bf16, products rounded to logits_dtype)
        torch.testing.assert_close(out.reverse_kl, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 3. Low precision
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_float32_against_float64_reference(form):
    """fp32 inputs: the float64 truth of the same (upcast) inputs to 2e-5 absolute. Justification:
    each logit carries ~|z|·2^-24 ≈ 1e-6 of matmul rounding (H = 64, |z| ≤ ~10); the statistics of a
    row of V = 300 sum ~V terms (cascade sums, ~log2(V)·2^-24 relative); KL, CE and Σ p log p are
    O(1-10), so ~1e-5 absolute is a few ulps of the fp32 result. The gradients are O(1/N)-scaled
    sums of the same terms (2e-5 as well)."""
    case = make_case(64, 64, 300, seed=7, dtype=torch.float32)
    got = run(case, form, chunk_size=16)
    up = {k: v.to(F64) for k, v in case.items()}
    expected = run_reference(up, form)
    assert got[0][0].dtype == torch.float32
    assert_close(got[0], expected[0], {"rtol": 1e-5, "atol": 2e-5}, "values")
    assert_close(got[1], expected[1], {"rtol": 1e-5, "atol": 2e-5}, "grads")


def test_bfloat16_matches_the_logits_path_to_fp32_rounding():
    """bf16 hidden and head: the fused values equal the logits path on the bf16 logits
    `hidden @ W.T` (the same rounded products) to fp32 rounding."""
    case = make_case(32, 16, 200, seed=8)
    h = case["hidden"].to(torch.bfloat16).requires_grad_()
    w = case["weight"].to(torch.bfloat16).requires_grad_()
    teacher = case["teacher_logits"].to(torch.bfloat16)
    out = lossfx.linear_divergence_to_teacher(h, w, teacher_logits=teacher)
    z = h.detach() @ w.detach().T  # [N, V] bf16: what prepare_loss_input would see
    expected = (
        lossfx.reverse_kl_to_fixed(z, teacher),
        lossfx.cross_entropy_to_fixed(z, teacher),
        lossfx.neg_entropy(z),
    )
    for got, exp in zip(out, expected):
        assert got.dtype == exp.dtype == torch.float32
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 4. gradcheck, and the proof's backward formula (proofs/linear_divergence.md)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_gradcheck(form):
    case = make_case(5, 3, 7, seed=9)
    kwargs = teacher_kwargs(case, form)

    def fn(h, w, b):
        out = lossfx.linear_divergence_to_teacher(h, w, bias=b, softcap=3.0, temperature=0.9, chunk_size=2, **kwargs)
        return out.reverse_kl, out.cross_entropy, out.neg_entropy

    inputs = tuple(case[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    assert torch.autograd.gradcheck(fn, inputs)


def test_proof_backward_formula():
    """proofs/linear_divergence.md §2: `dz = p_s ⊙ (a·log p_s − b·log p_t − c)` with `a = g_kl + g_ne`,
    `b = g_kl + g_ce`, `c = g_kl·KL + g_ce·CE + g_ne·NE` equals autograd through the dense reference."""
    gen = torch.Generator().manual_seed(10)
    z = torch.randn(6, 17, generator=gen, dtype=F64).requires_grad_()
    t = torch.randn(6, 17, generator=gen, dtype=F64) * 2
    g_kl, g_ce, g_ne = torch.randn(3, 6, generator=gen, dtype=F64)
    kl, ce, ne = reference.reverse_kl_to_fixed(z, t), reference.cross_entropy_to_fixed(z, t), reference.neg_entropy(z)
    (dz,) = torch.autograd.grad((g_kl * kl + g_ce * ce + g_ne * ne).sum(), z)
    log_ps, log_pt = z.detach().log_softmax(-1), t.log_softmax(-1)
    a, b = g_kl + g_ne, g_kl + g_ce
    c = g_kl * kl.detach() + g_ce * ce.detach() + g_ne * ne.detach()
    formula = log_ps.exp() * (a[:, None] * log_ps - b[:, None] * log_pt - c[:, None])
    torch.testing.assert_close(formula, dz, **TIGHT)
    # ... and the row constants moved into c (§3): a·x_s − b·x_t − (c + a·log S − b·log T), x = z − max
    ms, mt = z.detach().amax(-1, keepdim=True), t.amax(-1, keepdim=True)
    log_s = (z.detach() - ms).exp().sum(-1).log()
    log_t = (t - mt).exp().sum(-1).log()
    shifted = (
        (z.detach() - ms).exp()
        / log_s.exp()[:, None]
        * (a[:, None] * (z.detach() - ms) - b[:, None] * (t - mt) - (c + a * log_s - b * log_t)[:, None])
    )
    torch.testing.assert_close(shifted, dz, **TIGHT)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_merge_parts_identity(parts):
    """proofs/linear_divergence.md §1: the parts of any column partition (with `-inf` columns, a dead
    part and a teacher `-inf` under student mass) merge to the whole row's part."""
    from lossfx._kernels.linear_divergence import merge_parts

    gen = torch.Generator().manual_seed(12 + parts)
    z = torch.randn(5, 11, generator=gen, dtype=F64) * 4
    t = torch.randn(5, 11, generator=gen, dtype=F64) * 3
    z[0, :4] = -math.inf  # a dead part for the first block(s)
    z[1, 5] = -math.inf
    t[2, 6] = -math.inf  # under student mass: B = U = -inf
    t[3, 5] = -math.inf

    def part(zs, zt):
        m_s, m_t = zs.amax(-1), zt.amax(-1)
        xs = zs - torch.nan_to_num(m_s, neginf=0.0)[:, None]
        xt = zt - torch.nan_to_num(m_t, neginf=0.0)[:, None]
        e = xs.exp()
        terms = [torch.where(e > 0, e * x, 0.0).sum(-1) for x in (xs, xt, xs - xt)]
        return torch.stack([m_s, e.sum(-1), m_t, xt.exp().sum(-1), *terms])

    bounds = torch.linspace(0, 11, parts + 1).round().long().tolist()
    pieces = torch.stack([part(z[:, a:b], t[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
    merged, whole = merge_parts(pieces), part(z, t)
    assert torch.equal(torch.isinf(merged), torch.isinf(whole)) and not torch.isnan(merged).any()
    finite = torch.isfinite(whole)
    torch.testing.assert_close(merged[finite], whole[finite], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# 5. Tensor parallelism on 2 gloo processes, uneven shards
# ---------------------------------------------------------------------------------------------

BOUNDS = [0, 5, 13]  # shards of 5 and 8 vocabulary rows


def gloo_rank(rank, world, group, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_logits, grads):
    cols = slice(BOUNDS[rank], BOUNDS[rank + 1])
    out = []
    for form in ("logits", "hidden"):
        h = hidden.clone().requires_grad_()
        w = weight[cols].clone().requires_grad_()
        b = bias[cols].clone().requires_grad_()
        if form == "logits":
            teacher = {"teacher_logits": teacher_logits[:, cols]}
        else:
            teacher = {"teacher_hidden": teacher_hidden, "teacher_weight": teacher_weight[cols]}
        res = lossfx.linear_divergence_to_teacher(h, w, bias=b, group=group, chunk_size=3, softcap=5.0, **teacher)
        torch.autograd.backward(list(res), list(grads))
        out.append((*(r.detach() for r in res), h.grad, w.grad, b.grad))
    return out


def logits_path_expected(case, form, **head):
    """Values and gradients of the logits path (`lossfx.reverse_kl_to_fixed` & co., one rank) on the
    dense float64 logits `reference.linear_logits(...)`: the expectation where a teacher `-inf` makes
    the dense reference's own gradient NaN (0·inf inside its autograd)."""
    h, w, b = (case[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    z = reference.linear_logits(
        h, w, head.get("temperature", 1.0), b, head.get("logit_scale", 1.0), head.get("softcap")
    )
    t = case["teacher_logits"] if form == "logits" else case["teacher_hidden"] @ case["teacher_weight"].T
    out = (lossfx.reverse_kl_to_fixed(z, t), lossfx.cross_entropy_to_fixed(z, t), lossfx.neg_entropy(z))
    torch.autograd.backward(list(out), list(case["grads"]))
    return tuple(o.detach() for o in out), (h.grad, w.grad, b.grad)


@pytest.mark.distributed
def test_gloo_two_ranks_uneven_shards():
    case = make_case(7, 6, 13, seed=11)
    teacher = case["teacher_logits"].clone()
    teacher[3, 2] = -math.inf  # a masked teacher entry on rank 0's shard: KL = CE = +inf on row 3
    teacher[5, 7:] = -math.inf  # rank 1's whole shard masked on row 5
    case["teacher_logits"] = teacher
    args = [case[k] for k in ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_logits")]
    results = gloo_pool(2).run(gloo_rank, *args, case["grads"])
    for i, form in enumerate(("logits", "hidden")):
        values, (dh, dw, db) = logits_path_expected(case, form, softcap=5.0)
        assert_close(values, run_reference(case, form, softcap=5.0)[0], TIGHT, f"{form} values vs reference")
        r0, r1 = results[0][i], results[1][i]
        assert_close(r0[:3], values, TIGHT, f"{form} values")
        for k in range(3):
            torch.testing.assert_close(r1[k], r0[k], rtol=0, atol=0)  # replicated, bit for bit
        assert_close((r0[3], r1[3]), (dh, dh), TIGHT, f"{form} dhidden")
        assert_close((torch.cat([r0[4], r1[4]]), torch.cat([r0[5], r1[5]])), (dw, db), TIGHT, f"{form} dweight")


def gloo_widths_rank(rank, world, group, case, form, compiled):
    """TP over `world` ranks in uneven widths (the first rank the widest), plain shards; with
    `compiled`, under torch.compile(fullgraph=True) (aot_eager), compiled once per rank."""
    vocab = case["weight"].shape[0]
    widths = [vocab // world] * world
    widths[0] += vocab - sum(widths)
    cols = slice(sum(widths[:rank]), sum(widths[: rank + 1]))
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"][cols].clone().requires_grad_()
    b = case["bias"][cols].clone().requires_grad_()
    if form == "logits":
        teacher = {"teacher_logits": case["teacher_logits"][:, cols]}
    else:
        teacher = {"teacher_hidden": case["teacher_hidden"], "teacher_weight": case["teacher_weight"][cols]}

    def fn(h, w, b, teacher):
        return tuple(lossfx.linear_divergence_to_teacher(h, w, bias=b, group=group, chunk_size=3, **teacher))

    frames = None
    if compiled:
        import harness

        counter, fn = harness.compiled_for_rank(rank, ("linear_divergence", world, form), fn, "aot_eager")
    res = fn(h, w, b, teacher)
    torch.autograd.backward(list(res), list(case["grads"]))
    if compiled:
        frames = counter.frame_count
    return (*(r.detach() for r in res), h.grad, w.grad, b.grad, frames)


def _check_widths(results, case, form):
    values, (dh, dw, db) = logits_path_expected(case, form)
    for r in results:
        assert_close(r[:3], values, TIGHT, f"{form} values")
        assert_close((r[3],), (dh,), TIGHT, f"{form} dhidden (each rank's is the full one)")
    assert_close((torch.cat([r[4] for r in results]), torch.cat([r[5] for r in results])), (dw, db), TIGHT, form)


@pytest.mark.slow  # compiles in both gloo workers: 1-2 min on the loaded 2-core VM
@pytest.mark.distributed
@pytest.mark.compile
@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_gloo_two_ranks_compiled_fullgraph_once(form):
    results = [gloo_pool(2).run(gloo_widths_rank, make_case(6, 5, 13, seed=s), form, True) for s in (3, 4)]
    for seed, res in zip((3, 4), results):
        _check_widths(res, make_case(6, 5, 13, seed=seed), form)
    assert [r[-1] for r in results[1]] == [1, 1], "one compile per rank, no recompile for new values"


@pytest.mark.xdist_group("gloo4")  # one 4-process pool per session (addopts: --dist loadgroup)
@pytest.mark.slow  # a 4-process gloo pool (~30 s to start on the loaded 2-core VM)
@pytest.mark.distributed
@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_gloo_four_ranks_uneven_shards(form):
    case = make_case(7, 6, 13, seed=12)  # widths 4, 3, 3, 3
    _check_widths(gloo_pool(4).run(gloo_widths_rank, case, form, False), case, form)


_meshes: dict = {}


def dtensor_rank(rank, world, group, case, form):
    """`Shard(0)` DTensor weight, bias and teacher head, `Shard(1)` teacher logits (V = 13 over 2
    ranks: torch's split 7 + 6), `Replicate()` hidden states; no group argument."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if world not in _meshes:
        _meshes[world] = init_device_mesh("cpu", (world,))
    mesh = _meshes[world]

    def dt(x, placement):
        return distribute_tensor(x, mesh, [placement], src_data_rank=None)

    h = dt(case["hidden"], Replicate()).requires_grad_()
    w = dt(case["weight"], Shard(0)).requires_grad_()
    b = dt(case["bias"], Shard(0)).requires_grad_()
    if form == "logits":
        teacher = {"teacher_logits": dt(case["teacher_logits"], Shard(1))}
    else:
        teacher = {
            "teacher_hidden": dt(case["teacher_hidden"], Replicate()),
            "teacher_weight": dt(case["teacher_weight"], Shard(0)),
        }
    res = lossfx.linear_divergence_to_teacher(h, w, bias=b, chunk_size=3, softcap=5.0, **teacher)
    assert not any(is_dtensor(r) for r in res)
    torch.autograd.backward(list(res), list(case["grads"]))
    hgrad = h.grad.full_tensor() if is_dtensor(h.grad) else h.grad
    return (*(r.detach() for r in res), hgrad, w.grad.full_tensor(), b.grad.full_tensor())


def is_dtensor(x):
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


@pytest.mark.distributed
@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_dtensor_shard0_heads_two_gloo_ranks(form):
    case = make_case(7, 6, 13, seed=21)
    results = gloo_pool(2).run(dtensor_rank, case, form)
    values, (dh, dw, db) = logits_path_expected(case, form, softcap=5.0)
    for r in results:
        assert_close(r[:3], values, TIGHT, f"{form} values")
        assert_close(r[3:], (dh, dw, db), TIGHT, f"{form} gradients")


def disagreeing_rank(rank, world, group):
    """The replicated hidden states differ between the ranks: every rank raises the same error."""
    case = make_case(4, 3, 8, seed=rank)
    hidden = case["hidden"] if rank == 0 else case["hidden"] + 1
    cols = slice(4 * rank, 4 * rank + 4)
    w, t = make_case(4, 3, 8)["weight"][cols], make_case(4, 3, 8)["teacher_logits"][:, cols]
    try:
        lossfx.linear_divergence_to_teacher(hidden, w, teacher_logits=t, group=group)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.distributed
def test_cross_rank_check_raises_on_every_rank():
    messages = gloo_pool(2).run(disagreeing_rank)
    assert all(m is not None and "hidden" in m for m in messages), messages
    assert messages[0] == messages[1], messages


# ---------------------------------------------------------------------------------------------
# 6. Compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_compiled_fullgraph_matches_reference_and_recompiles_once():
    def step(h, w, th, tw):
        out = lossfx.linear_divergence_to_teacher(h, w, teacher_hidden=th, teacher_weight=tw, temperature=0.7)
        return out.reverse_kl.mean() + 0.1 * out.neg_entropy.mean()

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    counts = []
    for rows in (20, 27, 33):
        case = make_case(rows, 8, 24, seed=rows)
        h, w = case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
        loss = compiled(h, w, case["teacher_hidden"], case["teacher_weight"])
        loss.backward()
        rh, rw = case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
        kl, _, ne = reference.linear_divergence_to_teacher(
            rh, rw, teacher_hidden=case["teacher_hidden"], teacher_weight=case["teacher_weight"], temperature=0.7
        )
        ref = kl.mean() + 0.1 * ne.mean()
        ref.backward()
        torch.testing.assert_close(loss, ref, **TIGHT)
        torch.testing.assert_close(h.grad, rh.grad, **TIGHT)
        torch.testing.assert_close(w.grad, rw.grad, **TIGHT)
        counts.append(counter.frame_count)
    assert counts == [1, 2, 2], counts  # one compile, one automatic-dynamic recompile, then none


# ---------------------------------------------------------------------------------------------
# 7. Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"teacher_logits": None}, ValueError, "exactly one form"),
        ({"teacher_hidden": "h"}, ValueError, "exactly one form"),
        ({"teacher_logits": torch.zeros(4, 6, dtype=F64).to(DEVICE)}, ValueError, "teacher_logits must be"),
        ({"teacher_logits": torch.zeros(4, 7, dtype=torch.int64).to(DEVICE)}, TypeError, "teacher_logits"),
        ({"teacher_logits_dtype": torch.float32}, ValueError, "teacher_logits_dtype"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
    ],
)
def test_bad_arguments(change, error, match):
    case = make_case(4, 3, 7)
    kwargs = {"teacher_logits": case["teacher_logits"], **change}
    if kwargs.get("teacher_hidden") == "h":
        kwargs["teacher_hidden"], kwargs["teacher_weight"] = case["teacher_hidden"], case["teacher_weight"]
    with pytest.raises(error, match=match):
        lossfx.linear_divergence_to_teacher(case["hidden"], case["weight"], **kwargs)


def test_bad_teacher_head():
    case = make_case(4, 3, 7)
    h, w = case["hidden"], case["weight"]
    with pytest.raises(ValueError, match="teacher_weight must be"):
        lossfx.linear_divergence_to_teacher(h, w, teacher_hidden=case["teacher_hidden"], teacher_weight=w[:5])
    with pytest.raises(ValueError, match="go together"):
        lossfx.linear_divergence_to_teacher(h, w, teacher_hidden=case["teacher_hidden"])
    with pytest.raises(TypeError, match="teacher_logits_dtype"):
        lossfx.linear_divergence_to_teacher(
            h, w, teacher_hidden=case["teacher_hidden"], teacher_weight=case["teacher_weight"], teacher_logits_dtype=1
        )


@pytest.mark.parametrize(
    ("teacher", "error", "match"),
    on_device(
        [
            ({"teacher_weight": []}, ValueError, "must hold at least one"),
            ({"teacher_hidden": torch.zeros(3, 5, dtype=F64)}, ValueError, "leading dims"),
            ({"teacher_weight": [torch.zeros(7, 5, dtype=F64), torch.zeros(7, 5)]}, ValueError, "of one dtype"),
            ({"teacher_weight": [torch.zeros(7, 5, dtype=F64)] * 2}, ValueError, "is required with 2 teacher heads"),
            ({"teacher_head": torch.zeros(3, dtype=torch.int64)}, ValueError, r"must be \[\.\.\.\] = \(4,\)"),
            ({"teacher_head": torch.tensor([0, 0, 1, 0])}, ValueError, r"must lie in \[0, 1\)"),
            ({"teacher_head": torch.zeros(4)}, TypeError, "integer token ids"),
            ({"teacher_logits_dtype": torch.int32}, TypeError, "floating torch.dtype"),
        ]
    ),
)
def test_projected_teacher_one_rule(teacher, error, match):
    """`linear_divergence_to_teacher`'s projected teacher and `divergence_to_projected_teacher`'s are
    checked by one rule (`lossfx.divergence.projected_teacher`): the same verdict, each naming its own
    arguments. A `teacher_head` is checked whenever given (with one head too: the logits path's kernel
    reads it then, and it must be a position in the list)."""
    case = make_case(4, 3, 7)
    kw = {"teacher_hidden": case["teacher_hidden"], "teacher_weight": [case["teacher_weight"]], **teacher}
    with pytest.raises(error, match=match.replace("teacher_", "")) as fused:
        lossfx.linear_divergence_to_teacher(case["hidden"], case["weight"], **kw)
    student = (case["hidden"] @ case["weight"].T).detach()
    names = {"teacher_hidden": "hidden", "teacher_weight": "weights", "teacher_head": "head"}
    args = {names.get(k, "logits_dtype"): v for k, v in kw.items()}
    with pytest.raises(error, match=match.replace("teacher_", "")) as logits:
        divergence_to_projected_teacher("reverse_kl", student, **args)
    spelled = str(fused.value).replace("teacher_logits_dtype", "logits_dtype")
    for fused_name, name in names.items():
        spelled = spelled.replace(fused_name, name)
    assert spelled == str(logits.value)


def test_fixed_teacher_one_rule():
    """A teacher given as logits is checked by one rule (`lossfx.divergence.fixed_teacher`) in
    `linear_divergence_to_teacher` (against hidden × weight) and the logits path's divergences."""
    case = make_case(4, 3, 7)
    student = (case["hidden"] @ case["weight"].T).detach()
    cases = [
        (torch.zeros(4, 6, dtype=F64), ValueError, "must be [..., V_local] = (4, 7): the student and teacher logits"),
        (torch.zeros(4, 7, dtype=torch.int64), TypeError, "must be a floating-point tensor"),
    ]
    for bad, error, text in cases:
        with pytest.raises(error) as fused:
            lossfx.linear_divergence_to_teacher(case["hidden"], case["weight"], teacher_logits=bad)
        assert str(fused.value).startswith("teacher_logits " + text), fused.value
        for fn in (lossfx.reverse_kl_to_fixed, lossfx.cross_entropy_to_fixed):
            with pytest.raises(error) as logits:
                fn(student, bad)
            assert str(logits.value) == str(fused.value).replace("teacher_logits ", "teacher ")


def test_benchmark_script_quick_run(tmp_path):
    """benchmarks/bench_linear_divergence.py runs (eager provider, tiny shapes) and writes its table."""
    import json

    from benchmarks import bench_linear_divergence

    args = ["--quick", "--no-memory", "--min-run-time", "0", "--min-runs", "1", "--providers", "fused-eager"]
    bench_linear_divergence.main([*args, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "linear_divergence.json").read_text())["rows"]
    assert [r["provider"] for r in rows] == ["fused-eager"] and rows[0]["median_s"] > 0
    assert "fused-eager" in (tmp_path / "linear_divergence.md").read_text()
