"""Tests of the fused LM head's options: `bias`, `logit_scale`, `softcap`, `ignore_index` and mixed
hidden/weight dtypes, on every fused function (`linear_token_logprobs`, `linear_gather_logprobs`
in both conventions, `linear_next_token_logprobs`, `linear_logprob_objective`).

Sections: 0 helpers; 1 reference equivalence (float64, 1e-10, TP 1/2 rank threads, both hidden
layouts, uneven shards); 2 gradcheck of the soft-cap/scale/bias backward; 3 compile (fullgraph,
few small cases); 4 real gloo processes; 5 ignored rows are skipped (matmul rows counted);
6 mixed dtypes; 7 errors and the cross-rank check of the new arguments; 8 the negative entropy's
names (the deprecated ones keep their meaning and warn).

Rank `r` holds rows `[r·Vl, (r+1)·Vl)` of the head and of its bias; concatenated in rank order,
their gradients must equal the reference's, and every rank's `hidden.grad` the reference's (or,
with `sequence_parallel=True`, rank `r`'s rows of it).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from devices import DEVICE
from harness import compiled_for_rank, gloo_pool, run_ranks, shard_rows

import lossfx
from lossfx import reference
from lossfx._core.chunking import CPU_POLICY, chunk_policy

F64 = torch.float64
TIGHT = {"rtol": 0.0, "atol": 1e-10}
FUNCTIONS = ("token", "gather", "gather_renorm", "next", "objective")
OPTIONS = {
    "bias_scale": {"logit_scale": 0.37, "temperature": 0.8},
    "softcap": {"logit_scale": 1.7, "softcap": 2.5, "temperature": 1.3},
    "ignore": {"softcap": 4.0},
}

# ---------------------------------------------------------------------------------------------
# 0. Helpers
# ---------------------------------------------------------------------------------------------


def make_case(name, rows, hidden_size, vocab, *, seed=0, ignored=0.3, scale=3.0):
    """(hidden, weight, bias, ids, extra) for function `name`, with a fraction `ignored` of the ids
    equal to -100 (`extra`: the objective's coefficients `(a, b)`, else None). The logits reach
    a few units (so the soft-cap bends them)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (2, rows // 2) if name == "next" else (rows,)
    hidden = torch.randn(*lead, hidden_size, generator=gen, dtype=F64)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=F64) * scale / math.sqrt(hidden_size)
    bias = torch.randn(vocab, generator=gen, dtype=F64)
    id_shape = (*lead, 3) if name.startswith("gather") else lead
    ids = torch.randint(0, vocab, id_shape, generator=gen)
    ids[torch.rand(id_shape, generator=gen) < ignored] = -100
    if name.startswith("gather"):
        ids[0] = -100  # a row with every id ignored, and (likely) rows with some
    extra = None
    if name == "objective":
        extra = (torch.randn(lead, generator=gen, dtype=F64), torch.randn(lead, generator=gen, dtype=F64))
    return hidden, weight, bias, ids, extra


def call(name, hidden, weight, ids, extra, **kw):
    """The fused function `name` -> its outputs as a tuple of tensors (differentiable ones first)."""
    if name == "token":
        return lossfx.linear_token_logprobs(hidden, weight, ids, return_neg_entropy=True, **kw)
    if name.startswith("gather"):
        topk = name == "gather"
        return lossfx.linear_gather_logprobs(hidden, weight, ids, zero_outside_topk=topk, with_neg_entropy=True, **kw)
    if name == "next":
        return lossfx.linear_next_token_logprobs(hidden, weight, ids, return_neg_entropy=True, **kw)
    a, b = extra
    return lossfx.linear_logprob_objective(
        hidden, weight, ids, a, neg_entropy_weight=b, allow_repeated_backward=True, **kw
    )


def call_reference(name, hidden, weight, ids, extra, temperature=1.0, **kw):
    if name == "token":
        return reference.linear_token_logprobs(hidden, weight, ids, temperature, **kw)
    if name.startswith("gather"):
        return reference.linear_gather_logprobs(hidden, weight, ids, name == "gather", temperature, **kw)
    if name == "next":
        return reference.linear_next_token_logprobs(hidden, weight, ids, temperature, **kw)
    return reference.linear_logprob_objective(hidden, weight, ids, *extra, temperature, **kw)


def upstream(name, outputs, seed=1):
    """Random upstream gradients of the differentiable outputs (the objective: its scalar only)."""
    gen = torch.Generator().manual_seed(seed)
    outs = outputs[:1] if name == "objective" else outputs
    return [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs]


def expected(name, case, opts, use_bias=True):
    """(values, (dhidden, dweight, dbias)) of the float64 reference."""
    hidden, weight, bias, ids, extra = case
    h, w, b = (x.detach().clone().requires_grad_() for x in (hidden, weight, bias))
    outs = call_reference(name, h, w, ids, extra, bias=b if use_bias else None, **opts)
    diff = list(outs[:1] if name == "objective" else outs)
    grads = torch.autograd.grad(diff, [h, w, b], upstream(name, outs), allow_unused=True)
    return [o.detach() for o in outs], grads


def _rank(rank, world, group, name, case, opts, sp, chunk, compiled=None):
    hidden, weight, bias, ids, extra = case
    vl = weight.shape[0] // world
    w = weight[rank * vl : (rank + 1) * vl].clone().requires_grad_()
    b = bias[rank * vl : (rank + 1) * vl].clone().requires_grad_()
    h = (shard_rows(hidden, rank, world) if sp else hidden).clone().requires_grad_()

    def fn(h, w, b, ids):
        return call(name, h, w, ids, extra, bias=b, group=group, sequence_parallel=sp, chunk_size=chunk, **opts)

    counter = None
    if compiled is not None:
        counter, fn = compiled_for_rank(rank, (compiled, name, world, sp, chunk, tuple(opts.items())), fn, compiled)
    outs = fn(h, w, b, ids)
    diff = list(outs[:1] if name == "objective" else outs)
    torch.autograd.backward(diff, upstream(name, outs))
    frames = None if counter is None else counter.frame_count
    return [o.detach() for o in outs], (h.grad, w.grad, b.grad), frames


def check_ranks(results, expected_values, expected_grads, sp, tol=TIGHT):
    for rank, (values, grads, _) in enumerate(results):
        for i, (v, e) in enumerate(zip(values, expected_values, strict=True)):
            torch.testing.assert_close(v.to(F64), e, **tol, msg=lambda m, i=i, r=rank: f"rank {r} output {i}: {m}")
        if not sp:
            torch.testing.assert_close(grads[0].to(F64), expected_grads[0], **tol, msg=lambda m: f"dhidden: {m}")
    if sp:
        dh = torch.cat([res[1][0] for res in results]).view(expected_grads[0].shape)
        torch.testing.assert_close(dh.to(F64), expected_grads[0], **tol)
    for i, what in ((1, "dweight"), (2, "dbias")):
        got = torch.cat([res[1][i] for res in results]).to(F64)
        torch.testing.assert_close(got, expected_grads[i], **tol, msg=lambda m, what=what: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------
# 1. Reference equivalence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("opts_name", list(OPTIONS))
@pytest.mark.parametrize("name", FUNCTIONS)
def test_options_match_reference(name, opts_name, world):
    opts = OPTIONS[opts_name]
    case = make_case(name, 10, 6, 14, seed=hash((name, opts_name)) % 1000, ignored=0.4 if opts_name == "ignore" else 0)
    values, grads = expected(name, case, opts)
    results = run_ranks(world, _rank, name, case, opts, False, 3)
    check_ranks(results, values, grads, sp=False)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["token", "gather_renorm", "objective"])
def test_options_over_vocabulary_blocks(name, world):
    """Several vocabulary blocks per shard (5 columns each): the bias and the soft-cap factor are
    taken per block, and the ignored rows skipped in each."""
    opts = OPTIONS["softcap"]
    case = make_case(name, 10, 4, 24, seed=18, ignored=0.3)
    values, grads = expected(name, case, opts)
    with chunk_policy(dataclasses.replace(CPU_POLICY, max_block=5)):
        results = run_ranks(world, _rank, name, case, opts, False, 3)
    check_ranks(results, values, grads, sp=False)


@pytest.mark.parametrize("name", ["token", "gather_renorm", "objective"])
def test_options_sequence_parallel_two_ranks(name):
    opts = OPTIONS["softcap"]
    case = make_case(name, 12, 5, 16, seed=3, ignored=0.3)
    values, grads = expected(name, case, opts)
    check_ranks(run_ranks(2, _rank, name, case, opts, True, 4), values, grads, sp=True)


def _uneven_rank(rank, world, group, case, opts):
    hidden, weight, bias, ids, _ = case
    cut = 5  # rank 0: ids [0, 5), rank 1: [5, V)
    rows = slice(0, cut) if rank == 0 else slice(cut, weight.shape[0])
    w, b = weight[rows].clone().requires_grad_(), bias[rows].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    lp, ne = lossfx.linear_token_logprobs(
        h,
        w,
        ids,
        bias=b,
        group=group,
        vocab_start=rows.start,
        vocab_size=weight.shape[0],
        return_neg_entropy=True,
        **opts,
    )
    torch.autograd.backward([lp, ne], upstream("token", (lp, ne)))
    return [lp.detach(), ne.detach()], (h.grad, w.grad, b.grad), None


def test_uneven_shards_with_bias():
    opts = OPTIONS["softcap"]
    case = make_case("token", 8, 4, 13, seed=5, ignored=0.25)
    values, grads = expected("token", case, opts)
    check_ranks(run_ranks(2, _uneven_rank, case, opts), values, grads, sp=False)


def test_no_bias_and_defaults_unchanged():
    """Without options the new keywords change nothing; `bias=None` has no bias gradient."""
    hidden, weight, _, ids, _ = make_case("token", 8, 4, 11, seed=6, ignored=0)
    plain = lossfx.linear_token_logprobs(hidden, weight, ids)
    explicit = lossfx.linear_token_logprobs(hidden, weight, ids, bias=None, logit_scale=1.0, softcap=None)
    assert torch.equal(plain, explicit)
    torch.testing.assert_close(plain, reference.linear_token_logprobs(hidden, weight, ids)[0], **TIGHT)


def test_ignored_rows_are_zero_with_zero_gradient():
    """Ignored targets: log-prob 0, `Σ p log p` 0, and no gradient from any upstream value there."""
    hidden, weight, bias, ids, _ = make_case("token", 9, 4, 10, seed=7, ignored=0.5)
    assert (ids == -100).any() and (ids != -100).any()
    h = hidden.clone().requires_grad_()
    lp, ne = lossfx.linear_token_logprobs(h, weight, ids, bias=bias, return_neg_entropy=True)
    ignored = ids == -100
    assert torch.equal(lp[ignored], torch.zeros_like(lp[ignored]))
    assert torch.equal(ne[ignored], torch.zeros_like(ne[ignored]))
    (lp.sum() + ne.sum()).backward()
    assert torch.equal(h.grad[ignored], torch.zeros_like(h.grad[ignored]))
    assert h.grad[~ignored].abs().sum() > 0
    # a custom ignore_index: an in-range id can be ignored too (e.g. a pad id)
    pad = int(ids[~ignored][0])
    targets = ids.masked_fill(ignored, pad)  # -100 is an ordinary (out-of-range) id here
    lp_pad = lossfx.linear_token_logprobs(hidden, weight, targets, ignore_index=pad)
    assert (lp_pad[targets == pad] == 0).all() and (lp_pad[targets != pad] < 0).all()
    torch.testing.assert_close(
        lp_pad, reference.linear_token_logprobs(hidden, weight, targets, ignore_index=pad)[0], **TIGHT
    )


def test_every_row_ignored():
    hidden, weight, bias, ids, extra = make_case("objective", 6, 3, 7, seed=8)
    ids = torch.full_like(ids, -100)
    h = hidden.clone().requires_grad_()
    objective, lp, ne = lossfx.linear_logprob_objective(
        h, weight, ids, extra[0], neg_entropy_weight=extra[1], bias=bias
    )
    objective.backward()
    assert objective.item() == 0 and not lp.any() and not ne.any() and not h.grad.any()


# ---------------------------------------------------------------------------------------------
# 2. gradcheck of the new backward terms (soft-cap, scale, bias; float64)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["token", "objective"])
def test_gradcheck_softcap_scale_bias(name):
    hidden, weight, bias, ids, extra = make_case(name, 5, 3, 6, seed=9, ignored=0.2)
    opts = {"logit_scale": 1.4, "softcap": 1.5, "temperature": 0.9, "chunk_size": 2}

    def fn(h, w, b):
        outs = call(name, h, w, ids, extra, bias=b, **opts)
        return outs[0] if name == "objective" else outs

    inputs = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# 3. Compiled (fullgraph): few, small cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "world", "backend"), [("token", 1, "inductor"), ("objective", 2, "aot_eager")])
def test_compiled_options_match_reference(name, world, backend):
    opts = {**OPTIONS["softcap"], "ignore_index": -100}
    case = make_case(name, 8, 4, 12, seed=10, ignored=0.3)
    values, grads = expected(name, case, opts)
    results = run_ranks(world, _rank, name, case, opts, False, 3, compiled=backend)
    check_ranks(results, values, grads, sp=False)
    assert all(res[2] == 1 for res in results)  # one graph, no break


# ---------------------------------------------------------------------------------------------
# 4. Real gloo processes
# ---------------------------------------------------------------------------------------------


def gloo_rank(rank, world, group, case, opts):
    return _rank(rank, world, group, "token", case, opts, False, 4)


def gloo_dtensor_rank(rank, world, group, case, opts):
    """A `Shard(0)` DTensor head and bias (uneven rows 6 + 5) -> (values, full grads, grad placements)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    hidden, weight, bias, ids, _ = case
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    b = distribute_tensor(bias, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    h = hidden.clone().requires_grad_()
    outs = lossfx.linear_token_logprobs(h, w, ids, bias=b, return_neg_entropy=True, **opts)
    torch.autograd.backward(list(outs), upstream("token", outs))
    grads = (h.grad, w.grad.full_tensor(), b.grad.full_tensor())
    return [o.detach() for o in outs], grads, str(tuple(b.grad.placements))


@pytest.mark.distributed
def test_gloo_two_ranks_with_every_option():
    opts = OPTIONS["softcap"]
    case = make_case("token", 10, 4, 12, seed=11, ignored=0.3)
    values, grads = expected("token", case, opts)
    check_ranks(gloo_pool(2).run(gloo_rank, case, opts), values, grads, sp=False)
    # DTensor head and bias (a ColwiseParallel LM head with a bias), uneven shards
    case = make_case("token", 10, 4, 11, seed=19, ignored=0.3)
    values, grads = expected("token", case, opts)
    for got_values, got_grads, placement in gloo_pool(2).run(gloo_dtensor_rank, case, opts):
        assert placement == "(Shard(dim=0),)"
        for got, want in zip([*got_values, *got_grads], [*values, *grads], strict=True):
            torch.testing.assert_close(got, want, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 5. Ignored rows cost no logits
# ---------------------------------------------------------------------------------------------


def _matmul_flops(fn):
    """Σ `a·b·c` over the `[a, b] @ [b, c]` products (aten mm, addmm, addmm_) `fn` runs, profiled."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        fn()
    total = 0
    for event in prof.events():
        operands = {"aten::mm": slice(0, 2), "aten::addmm": slice(1, 3), "aten::addmm_": slice(1, 3)}.get(event.name)
        if operands is not None:
            (a, b), (_, c) = event.input_shapes[operands]
            total += a * b * c
    return total


@pytest.mark.parametrize("name", ["token", "objective"])
def test_half_ignored_rows_halve_the_matmul_flops(name):
    hidden, weight, bias, ids, extra = make_case(name, 64, 8, 40, seed=12, ignored=0)

    def run(targets):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def step():
            outs = call(name, h, w, targets, extra, bias=bias, chunk_size=8)
            outs[0].sum().backward()

        return _matmul_flops(step)

    half = ids.clone()
    half[::2] = -100
    full, halved = run(ids), run(half)
    assert full > 0 and halved * 2 == full, (full, halved)


# ---------------------------------------------------------------------------------------------
# 6. Mixed dtypes: matmuls in the promoted dtype, each gradient in its input's dtype
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("h_dtype", "w_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("name", ["token", "objective"])
def test_mixed_dtypes_equal_the_promoted_path(name, h_dtype, w_dtype):
    """A bf16 hidden with an fp32 head (or the reverse) gives exactly what the caller would get by
    casting the lower one to fp32, and each gradient comes back in its own input's dtype."""
    hidden, weight, bias, ids, extra = make_case(name, 12, 8, 20, seed=13, ignored=0.2)
    h, w, b = hidden.to(h_dtype), weight.to(w_dtype), bias.float()

    def run(h, w):
        h, w, bb = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        outs = call(name, h, w, ids, extra, bias=bb, softcap=3.0, chunk_size=5)
        diff = list(outs[:1] if name == "objective" else outs)
        # the objective's weight gradient is scaled by its upstream value in weight's dtype: 1 is exact
        grads = [torch.ones(())] if name == "objective" else [g.float() for g in upstream(name, outs)]
        torch.autograd.backward(diff, grads)
        return outs, h.grad, w.grad, bb.grad

    outs, dh, dw, db = run(h, w)
    outs32, dh32, dw32, db32 = run(h.float(), w.float())
    assert dh.dtype == h_dtype and dw.dtype == w_dtype and db.dtype == torch.float32
    for o, o32 in zip(outs, outs32, strict=True):
        assert o.dtype == torch.float32 and torch.equal(o, o32)
    assert torch.equal(dh, dh32.to(h_dtype)) and torch.equal(dw, dw32.to(w_dtype)) and torch.equal(db, db32)
    # and the float64 truth of those inputs, to fp32 rounding
    values, _ = expected(name, (h.double(), w.double(), b.double(), ids, extra), {"softcap": 3.0})
    for o, e in zip(outs, values, strict=True):
        torch.testing.assert_close(o.double(), e, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# 7. Errors, and the cross-rank check of the new arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"bias": torch.zeros(5).to(DEVICE)}, ValueError, r"bias must be \[V_local\] = \[7\].*\(5,\)"),
        ({"bias": torch.zeros(7, dtype=torch.int64).to(DEVICE)}, TypeError, "bias"),
        ({"logit_scale": 0.0}, ValueError, "logit_scale must be a finite number > 0, got 0.0"),
        ({"logit_scale": "2"}, TypeError, "logit_scale"),
        ({"softcap": -1.0}, ValueError, "softcap must be a finite number > 0, got -1.0"),
        ({"softcap": float("inf")}, ValueError, "softcap"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int, got 1.5"),
        ({"ignore_index": True}, TypeError, "ignore_index"),
    ],
)
@pytest.mark.parametrize("name", ["token", "gather", "next", "objective"])
def test_bad_options_raise_naming_the_argument(name, change, error, match):
    hidden, weight, _, ids, extra = make_case(name, 4, 3, 7, seed=14, ignored=0)
    with pytest.raises(error, match=match):
        call(name, hidden, weight, ids, extra, **change)


HEAD_KEYWORD_FUNCTIONS = (
    "linear_token_logprobs",
    "linear_next_token_logprobs",
    "linear_gather_logprobs",
    "linear_filtered_token_logprobs",
    "linear_logprob_objective",
    "prepare_linear_loss_input",
    "prepare_linear_packed_loss_input",
)


@pytest.mark.parametrize("fn_name", HEAD_KEYWORD_FUNCTIONS)
def test_head_keywords_are_one_value_in_every_signature(fn_name):
    """Every fused public function spells the head options of `HeadKeywords` as keyword-only
    parameters with `HeadOptions`' defaults (one place: `head_keywords`), and its body gets them."""
    import inspect

    from lossfx._core.tiles import HeadOptions
    from lossfx.fused_linear import HeadKeywords

    params = inspect.signature(getattr(lossfx, fn_name)).parameters
    assert set(HeadKeywords.__annotations__) == set(HeadOptions._fields)
    for name, default in HeadOptions._field_defaults.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (fn_name, name)
        assert params[name].default == default, (fn_name, name)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@pytest.mark.parametrize("name", ["token", "gather", "next", "objective"])
def test_an_unknown_head_keyword_raises_naming_it(name):
    hidden, weight, _, ids, extra = make_case(name, 4, 3, 7, seed=14, ignored=0)
    with pytest.raises(TypeError, match="soft_cap"):
        call(name, hidden, weight, ids, extra, soft_cap=2.0)


def test_out_of_range_ids_other_than_ignore_index_still_raise():
    hidden, weight, _, ids, _ = make_case("token", 4, 3, 7, seed=15, ignored=0)
    ids[1], ids[2] = -100, -1
    with pytest.raises(ValueError, match=r"target must lie in \[0, 7\); 1 entries do not, e.g. values \[-1\]"):
        lossfx.linear_token_logprobs(hidden, weight, ids)


def _disagreeing_rank(rank, world, group, hidden, weight, ids, key, values):
    w = weight[rank * 4 : (rank + 1) * 4]
    try:
        lossfx.linear_token_logprobs(hidden, w, ids, group=group, **{key: values[rank]})
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("key", "values"), [("softcap", (None, 2.0)), ("logit_scale", (1.0, 0.5)), ("ignore_index", (-100, 3))]
)
def test_ranks_that_disagree_on_an_option_all_raise(key, values):
    hidden, weight, _, ids, _ = make_case("token", 4, 3, 8, seed=16, ignored=0)
    messages = run_ranks(2, _disagreeing_rank, hidden, weight, ids, key, values)
    assert all(m is not None and key in m for m in messages), messages


def _bad_bias_rank(rank, world, group, hidden, weight, ids):
    w = weight[rank * 4 : (rank + 1) * 4]
    try:
        lossfx.linear_token_logprobs(hidden, w, ids, bias=torch.zeros(4 + rank), group=group)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_bias_that_is_not_the_shard_width_raises_on_every_rank():
    """The cross-rank check reads `bias` as a vocabulary shard: its width must be the head's rows."""
    hidden, weight, _, ids, _ = make_case("token", 4, 3, 8, seed=20, ignored=0)
    messages = run_ranks(2, _bad_bias_rank, hidden, weight, ids)
    assert all(m is not None and "bias" in m for m in messages), messages


# ---------------------------------------------------------------------------------------------
# 8. The negative entropy's names
# ---------------------------------------------------------------------------------------------

RENAMED = [
    ("token", "return_neg_entropy", "return_entropy", True),
    ("next", "return_neg_entropy", "return_entropy", True),
    ("gather", "with_neg_entropy", "with_entropy", True),
    ("objective", "neg_entropy_weight", "entropy_weight", None),
]


def _call_flag(name, hidden, weight, ids, extra, key, value):
    if name == "token":
        return lossfx.linear_token_logprobs(hidden, weight, ids, **{key: value})
    if name == "next":
        return lossfx.linear_next_token_logprobs(hidden, weight, ids, **{key: value})
    if name == "gather":
        return lossfx.linear_gather_logprobs(hidden, weight, ids, **{key: value})
    return lossfx.linear_logprob_objective(hidden, weight, ids, extra[0], **{key: extra[1] if value is None else value})


@pytest.mark.parametrize(("name", "new", "old", "value"), RENAMED)
def test_old_entropy_names_keep_their_value_and_warn(name, new, old, value):
    """The value is Σ p log p (≤ 0, the reference's) under the new name; the old name gives the same
    value with a FutureWarning naming the sign; both names together are a TypeError."""
    hidden, weight, _, ids, extra = make_case(name, 6, 3, 9, seed=17, ignored=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = _call_flag(name, hidden, weight, ids, extra, new, value)
    legacy_call = {  # each former name spelled out as a caller writes it
        "token": lambda: lossfx.linear_token_logprobs(hidden, weight, ids, return_entropy=True),
        "next": lambda: lossfx.linear_next_token_logprobs(hidden, weight, ids, return_entropy=True),
        "gather": lambda: lossfx.linear_gather_logprobs(hidden, weight, ids, with_entropy=True),
        "objective": lambda: lossfx.linear_logprob_objective(hidden, weight, ids, extra[0], entropy_weight=extra[1]),
    }[name]
    with pytest.warns(FutureWarning, match=f"{old} is deprecated: its value is Σ p log p, the NEGATIVE entropy"):
        legacy = legacy_call()
    for a, b in zip(fresh, legacy, strict=True):
        assert torch.equal(a, b)
    neg_entropy = fresh[-1]
    assert (neg_entropy <= 0).all()
    ref = call_reference(name, hidden, weight, ids, extra)[-1]
    torch.testing.assert_close(neg_entropy, ref, **TIGHT)
    with pytest.raises(TypeError, match=f"pass {new} only; {old} is its deprecated name"):
        both = {new: extra[1] if value is None else value, old: extra[1] if value is None else value}
        call_name = {"token": "linear_token_logprobs", "next": "linear_next_token_logprobs"}.get(name)
        if call_name:
            getattr(lossfx, call_name)(hidden, weight, ids, **both)
        elif name == "gather":
            lossfx.linear_gather_logprobs(hidden, weight, ids, **both)
        else:
            lossfx.linear_logprob_objective(hidden, weight, ids, extra[0], **both)
