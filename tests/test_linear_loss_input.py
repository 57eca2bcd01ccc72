"""The hidden-state front door (`lossfx.prepare_linear_loss_input` and its packed twin): values AND
gradients (hidden, weight, bias) against `prepare_loss_input(head(hidden @ W.T + b))` and against
the dense float64 reference, per branch, float64 tight and fp32, 1/2/4 gloo ranks (tensor-parallel
heads of uneven widths, load-balanced context parallelism), and compiled (fullgraph, pinned
recompiles). Top-k/top-p filtered LOGPROB against the logits path and the reference
(`test_filtered_*`). `LOGIT` raises a `ValueError` naming the logits path. OPD_FULL:
tests/test_linear_opd_full.py.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import harness
import pytest
import torch

import lossfx
from lossfx import LossInputType, reference

F64, F32 = torch.float64, torch.float32
B, S, H, V, K, D = 2, 8, 6, 13, 3, 4  # S a multiple of 2C for C = 2; V = 13: uneven TP shards
HEAD = {"temperature": 0.7, "logit_scale": 1.3, "softcap": 6.0}
# fp32 against float64: logits of magnitude <= 6/0.7 ≈ 9, V = 13 terms; fp32's eps 1.2e-7 times
# a few sums of that size stays well under 1e-5 (measured ~1e-6); float64: 1e-10
TOL = {F64: {"atol": 1e-10, "rtol": 0}, F32: {"atol": 2e-5, "rtol": 2e-5}}

BRANCHES = ("logprob", "distill_full", "distill_topk", "distill_forward", "draft", "draft_no_d2t")


def _loss_fn(branch: str) -> SimpleNamespace:
    if branch == "logprob":
        return SimpleNamespace(input_type=LossInputType.LOGPROB)
    if branch.startswith("distill"):
        return SimpleNamespace(
            input_type=LossInputType.DISTILLATION,
            zero_outside_topk=branch != "distill_topk",
            kl_type="forward" if branch == "distill_forward" else "mixed",
        )
    return SimpleNamespace(input_type=LossInputType.DRAFT)


def make_case(branch: str, seed: int = 0, seq: int = S):
    """(hidden [B, S, H], weight [V, H], bias [V], data, loss_fn, kwargs) in float64, canonical."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, seq, H, generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64)
    bias = torch.randn(V, generator=gen, dtype=F64)
    data: dict = {"input_ids": torch.randint(0, V, (B, seq), generator=gen)}
    kwargs: dict = {}
    if branch.startswith("distill"):
        data = {
            "teacher_topk_logits": torch.randn(B, seq, K, generator=gen, dtype=F64),
            "teacher_topk_indices": torch.randint(0, V, (B, seq, K), generator=gen),
        }
    elif branch.startswith("draft"):
        data = {
            "token_mask": (torch.rand(B, seq, generator=gen) > 0.2).to(F32),
            "student_logits": torch.randn(B, seq, D, generator=gen),
        }
        if branch == "draft":
            kwargs["d2t"] = torch.tensor([3, 0, 7, 2])  # target ids 3, 1, 9, 5
    return hidden, weight, bias, data, _loss_fn(branch), kwargs


head_logits = functools.partial(harness.head_logits, head=HEAD)
cotangents, _leaves, _assert_dicts = harness.cotangents, harness.leaves, harness.assert_dicts
grads = functools.partial(harness.grads, allow_unused=True)


def _grad_key(v) -> bool:
    return isinstance(v, torch.Tensor) and v.requires_grad


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("branch", BRANCHES)
def test_one_process_matches_logits_path_and_reference(branch, chunk_size, dtype):
    hidden, weight, bias, data, loss_fn, kwargs = make_case(branch)
    data = {k: v.to(dtype) if v.is_floating_point() and k != "token_mask" else v for k, v in data.items()}
    h, w, b = _leaves(dtype, hidden, weight, bias)
    out, returned = lossfx.prepare_linear_loss_input(
        h, w, data, loss_fn, bias=b, chunk_size=chunk_size, **HEAD, **kwargs
    )
    assert returned is data
    # the logits path, same dtype: same keys, dtypes, values and gradients
    h2, w2, b2 = _leaves(dtype, hidden, weight, bias)
    want, _ = lossfx.prepare_loss_input(head_logits(h2, w2, b2), data, loss_fn, **kwargs)
    _assert_dicts(out, want, TOL[dtype], f"{branch} vs logits path")
    cot = cotangents(want)
    assert set(cot) == {k for k, v in out.items() if _grad_key(v)}, (set(cot), out.keys())
    got_grads = grads(out, cot, (h, w, b)) if cot else ()
    if cot:
        for name, got_g, want_g in zip("hwb", got_grads, grads(want, cot, (h2, w2, b2))):
            torch.testing.assert_close(got_g, want_g, **TOL[dtype], msg=lambda m, n=name: f"{branch} d{n}: {m}")
    # the float64 reference
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    ref = reference.prepare_linear_loss_input(hr, wr, data, loss_fn, bias=br, **HEAD, **kwargs)
    for k in ref:
        if ref[k] is not None and k in out and out[k] is not None:
            torch.testing.assert_close(out[k].to(F64), ref[k].to(F64), **TOL[dtype], msg=lambda m, k=k: f"{k}: {m}")
    if cot:
        for name, got_g, want_g in zip("hwb", got_grads, grads(ref, cot, (hr, wr, br))):
            torch.testing.assert_close(
                got_g.to(F64), want_g, **TOL[dtype], msg=lambda m, n=name: f"{branch} ref d{n}: {m}"
            )


def test_no_head_options_and_no_bias_is_plain_matmul():
    hidden, weight, _, data, loss_fn, _ = make_case("logprob")
    out, _ = lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn)
    want, _ = lossfx.prepare_loss_input(hidden @ weight.T, data, loss_fn)
    torch.testing.assert_close(out["next_token_logprobs"], want["next_token_logprobs"], **TOL[F64])


def test_ignore_index_scores_zero_and_no_gradient():
    hidden, weight, bias, data, loss_fn, _ = make_case("logprob")
    ids = data["input_ids"].clone()
    ids[0, 3] = -1
    h = hidden.clone().requires_grad_(True)
    out, _ = lossfx.prepare_linear_loss_input(
        h, weight, {"input_ids": ids}, loss_fn, bias=bias, ignore_index=-1, **HEAD
    )
    lp = out["next_token_logprobs"]
    assert lp[0, 2] == 0
    lp.sum().backward()
    assert h.grad[0, 2].abs().max() == 0 and h.grad[0, 1].abs().max() > 0
    ref = reference.next_token_logprobs(head_logits(hidden, weight, bias), ids.clamp_min(0))
    keep = ids[:, 1:] != -1
    torch.testing.assert_close(lp[keep], ref[keep], **TOL[F64])


def test_packed_matches_logits_path_and_reference():
    gen = torch.Generator().manual_seed(3)
    cu, cu_p = [0, 3, 7, 12], [0, 4, 8, 13]
    hidden = torch.randn(1, 13, H, generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64)
    bias = torch.randn(V, generator=gen, dtype=F64)
    input_ids = torch.randint(0, V, (3, 5), generator=gen)
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB)
    h, w, b = _leaves(F64, hidden, weight, bias)
    out, _ = lossfx.prepare_linear_packed_loss_input(
        h, w, {"input_ids": input_ids}, loss_fn, cu, cu_p, bias=b, chunk_size=5, ignore_index=-7, **HEAD
    )
    h2, w2, b2 = _leaves(F64, hidden, weight, bias)
    want, _ = lossfx.prepare_packed_loss_input(head_logits(h2, w2, b2), {"input_ids": input_ids}, loss_fn, cu, cu_p)
    _assert_dicts(out, want, TOL[F64], "packed")
    ref = reference.prepare_linear_packed_loss_input(hidden, weight, input_ids, cu, cu_p, bias=bias, **HEAD)
    torch.testing.assert_close(out["next_token_logprobs"], ref, **TOL[F64])
    cot = cotangents(want)
    for name, got_g, want_g in zip("hwb", grads(out, cot, (h, w, b)), grads(want, cot, (h2, w2, b2))):
        torch.testing.assert_close(got_g, want_g, **TOL[F64], msg=lambda m, n=name: f"packed d{n}: {m}")


def test_logit_and_unfused_branches_raise_naming_the_logits_path():
    hidden, weight, _, data, _, _ = make_case("logprob")
    data = {**data, "token_mask": torch.ones(B, S)}
    with pytest.raises(ValueError, match="prepare_loss_input") as err:
        lossfx.prepare_linear_loss_input(hidden, weight, data, SimpleNamespace(input_type=LossInputType.LOGIT))
    assert "LOGIT" in str(err.value)  # OPD_FULL is fused: tests/test_linear_opd_full.py
    with pytest.raises(ValueError, match=r"only supports LossInputType\.LOGPROB"):
        lossfx.prepare_linear_packed_loss_input(
            hidden[:1], weight, data, SimpleNamespace(input_type=LossInputType.DRAFT), [0, 8], [0, 8]
        )


FILTERS = {  # sampling params: the rows keep 1..V ids; V = 13, so top_k = 5 drops most of each row
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.8},
    "both_sorted": {"top_k": 6, "top_p": 0.9, "ties": "sorted"},
}


def _filtered_case(name: str, seed: int = 0):
    hidden, weight, bias, data, _, _ = make_case("logprob", seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    data["token_mask"] = (torch.rand(B, S, generator=gen) > 0.25).to(F32)
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB, reference_policy_kl_penalty=0.1)
    return hidden, weight, bias, data, loss_fn, FILTERS[name]


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("name", sorted(FILTERS))
def test_filtered_logprob_matches_logits_path_and_reference(name, dtype):
    """Filtered LOGPROB from hidden states equals the logits path: the filtered log-probs (a dropped
    target's -inf masked to 0 with a warning, as there), `data['curr_logprobs_unfiltered']`, values
    and gradients; the kept log-probs equal the float64 reference's."""
    hidden, weight, bias, data, loss_fn, params = _filtered_case(name)
    sampling = lossfx.TrainingSamplingParams(**params)
    h, w, b = _leaves(dtype, hidden, weight, bias)
    data_fused = dict(data)
    out, _ = lossfx.prepare_linear_loss_input(h, w, data_fused, loss_fn, bias=b, sampling_params=sampling, **HEAD)
    h2, w2, b2 = _leaves(dtype, hidden, weight, bias)
    data_logits = dict(data)
    want, _ = lossfx.prepare_loss_input(head_logits(h2, w2, b2), data_logits, loss_fn, sampling_params=sampling)
    _assert_dicts(out, want, TOL[dtype], f"filtered {name}")
    got_u, want_u = data_fused["curr_logprobs_unfiltered"], data_logits["curr_logprobs_unfiltered"]
    torch.testing.assert_close(got_u.to(F64), want_u.to(F64), **TOL[dtype])
    lp, lp_want = out["next_token_logprobs"], want["next_token_logprobs"]
    # the filter drops some targets (masked to 0 by the -inf rule) and keeps others (renormalised)
    assert ((lp == 0) & (got_u != 0)).any() and ((lp != 0) & (lp != got_u)).any()
    gen = torch.Generator().manual_seed(5)
    cot = torch.randn(lp.shape, generator=gen, dtype=F64)
    loss = lambda x, u: (x.to(F64) * cot).sum() + (u.to(F64) * cot.flip(0)).sum()  # noqa: E731
    got_g = torch.autograd.grad(loss(lp, got_u), (h, w, b))
    want_g = torch.autograd.grad(loss(lp_want, want_u), (h2, w2, b2))
    for n, g, wg in zip("hwb", got_g, want_g):
        torch.testing.assert_close(g, wg, **TOL[dtype], msg=lambda m, n=n: f"filtered {name} d{n}: {m}")
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    ref = reference.prepare_linear_loss_input(hr, wr, data, loss_fn, bias=br, **HEAD, **params)
    kept = lp != 0
    torch.testing.assert_close(lp[kept].to(F64), ref["next_token_logprobs"][kept], **TOL[dtype])


def test_filtered_packed_matches_logits_path():
    gen = torch.Generator().manual_seed(3)
    cu, cu_p = [0, 3, 7, 12], [0, 4, 8, 13]
    hidden = torch.randn(1, 13, H, generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64)
    bias = torch.randn(V, generator=gen, dtype=F64)
    data = {"input_ids": torch.randint(0, V, (3, 5), generator=gen), "token_mask": torch.ones(3, 5)}
    loss_fn = SimpleNamespace(input_type=LossInputType.LOGPROB)
    sampling = lossfx.TrainingSamplingParams(top_k=4, top_p=0.9)
    h, w, b = _leaves(F64, hidden, weight, bias)
    out, _ = lossfx.prepare_linear_packed_loss_input(
        h, w, dict(data), loss_fn, cu, cu_p, bias=b, sampling_params=sampling, **HEAD
    )
    h2, w2, b2 = _leaves(F64, hidden, weight, bias)
    want, _ = lossfx.prepare_packed_loss_input(
        head_logits(h2, w2, b2), dict(data), loss_fn, cu, cu_p, sampling_params=sampling
    )
    _assert_dicts(out, want, TOL[F64], "packed filtered")
    lp, lp_want = out["next_token_logprobs"], want["next_token_logprobs"]
    assert (lp == 0).any() and (lp != 0).any()  # some targets dropped (masked to 0), some kept
    got = torch.autograd.grad(lp.sum(), (h, w, b))
    for g, wg in zip(got, torch.autograd.grad(lp_want.sum(), (h2, w2, b2))):
        torch.testing.assert_close(g, wg, **TOL[F64])


def test_bad_arguments_raise_naming_them():
    hidden, weight, _, data, loss_fn, _ = make_case("logprob")
    with pytest.raises(ValueError, match=r"data\['input_ids'\]"):
        lossfx.prepare_linear_loss_input(hidden, weight, {"input_ids": data["input_ids"] + V}, loss_fn)
    with pytest.raises(ValueError, match="temperature"):
        lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn, temperature=0.0)
    with pytest.raises(ValueError, match="weight"):
        lossfx.prepare_linear_loss_input(hidden, weight[:, :-1], data, loss_fn)
    with pytest.raises(ValueError, match="bias"):
        lossfx.prepare_linear_loss_input(hidden, weight, data, loss_fn, bias=torch.zeros(V + 1, dtype=F64))
    with pytest.raises(ValueError, match="hidden"):
        lossfx.prepare_linear_loss_input(hidden[0], weight, data, loss_fn)
    _, _, _, ddata, dloss, _ = make_case("draft")
    with pytest.raises(ValueError, match="d2t"):
        lossfx.prepare_linear_loss_input(hidden, weight, ddata, dloss, d2t=torch.tensor([V, 0]))
    _, _, _, tdata, tloss, _ = make_case("distill_full")
    with pytest.raises(ValueError, match="teacher_topk_indices"):
        bad = {**tdata, "teacher_topk_indices": tdata["teacher_topk_indices"] - 1}
        lossfx.prepare_linear_loss_input(hidden, weight, bad, tloss)


# ---------------------------------------------------------------------------------------------
# Several ranks (gloo): tensor-parallel heads of uneven widths, load-balanced context parallelism
# ---------------------------------------------------------------------------------------------


_widths = functools.partial(harness.uneven_widths, V)


def _local_draft(full, rank, world):
    return full.chunk(world, dim=-1)[rank]


def ranked_case(rank, world, group, branch, mode, dtype_name):
    """One rank's call: `mode` "tp" (the head split in uneven rows) or "cp" (the sequence
    load-balanced over the world). Returns outputs and gradients (the cotangents are replicated)."""
    dtype = getattr(torch, dtype_name)
    hidden, weight, bias, data, loss_fn, kwargs = make_case(branch, seed=7)
    h_local, w_local, b_local, _, layout = harness.split_head_call(mode, rank, world, group, hidden, weight, bias)
    kw: dict = dict(HEAD, **kwargs, **layout)
    h, w, b = _leaves(dtype, h_local, w_local, b_local)
    out, _ = lossfx.prepare_linear_loss_input(h, w, data, loss_fn, bias=b, chunk_size=3, **kw)
    cot = cotangents({k: v for k, v in out.items() if v is not None})
    scale = 1 if mode == "tp" else world  # the summed CP convention: divide the loss by C
    dh = dw = db = None
    if cot:
        loss = sum((out[k].to(F64) * g).sum() for k, g in cot.items()) / scale
        dh, dw, db = torch.autograd.grad(loss, (h, w, b))
    values = {k: None if v is None else v.detach() for k, v in out.items()}
    return values, (dh, dw, db)


def _check_ranked(results, branch, mode, dtype):
    world = len(results)
    hidden, weight, bias, data, loss_fn, kwargs = make_case(branch, seed=7)
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    ref = reference.prepare_linear_loss_input(hr, wr, data, loss_fn, bias=br, **HEAD, **kwargs)
    tol = TOL[dtype]
    for rank, (values, _) in enumerate(results):
        for k, want in ref.items():
            if want is None:
                assert values[k] is None, (rank, k)
                continue
            if branch.startswith("draft") and k != "student_logits":
                if mode == "tp" and k == "teacher_logits":
                    want = _local_draft(want, rank, world)
                if mode != "tp":
                    want = reference.cp_shard(want, rank, world)
            torch.testing.assert_close(
                values[k].to(F64), want.to(F64), **tol, msg=lambda m, k=k, r=rank: f"{mode} r{r} {k}: {m}"
            )
    cot = cotangents({k: v for k, v in results[0][0].items() if v is not None})
    if not cot:
        return
    harness.assert_head_grads(results, grads(ref, cot, (hr, wr, br)), mode, tol)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tp", "cp", "sharder"])
@pytest.mark.parametrize("branch", ["logprob", "distill_full", "distill_topk", "draft"])
def test_two_gloo_ranks(branch, mode):
    for dtype in (F64, F32):
        results = harness.gloo_pool(2).run(ranked_case, branch, mode, str(dtype).split(".")[-1])
        _check_ranked(results, branch, mode, dtype)


def ranked_filtered(rank, world, group, name):
    """One TP rank's filtered call (uneven head rows) and its gradients (hidden full, head rows local)."""
    hidden, weight, bias, data, loss_fn, params = _filtered_case(name, seed=7)
    widths = _widths(world)
    start = sum(widths[:rank])
    h, w, b = _leaves(F64, hidden, weight[start : start + widths[rank]], bias[start : start + widths[rank]])
    out, _ = lossfx.prepare_linear_loss_input(
        h, w, dict(data), loss_fn, bias=b, chunk_size=3, vocab_parallel_group=group, vocab_parallel_rank=rank,
        sampling_params=lossfx.TrainingSamplingParams(**params), **HEAD,
    )  # fmt: skip
    lp = out["next_token_logprobs"]
    return lp.detach(), torch.autograd.grad(lp.sum(), (h, w, b))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["top_k", "both_sorted"])
def test_filtered_two_gloo_ranks_uneven_heads(name):
    _check_filtered_ranks(name, 2)


@pytest.mark.xdist_group("gloo4")  # one 4-process pool per session (addopts: --dist loadgroup)
@pytest.mark.slow  # a 4-process gloo pool; 2 ranks cover TP by default
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["top_k", "both_sorted"])
def test_filtered_four_gloo_ranks_uneven_heads(name):
    _check_filtered_ranks(name, 4)


def _check_filtered_ranks(name, world):
    """Every rank's filtered log-probs and hidden gradient equal the one-process fused call's, and
    the head rows' gradients concatenate to its (that call is proven against the reference here
    and against the logits path by `test_filtered_logprob_matches_logits_path_and_reference`)."""
    results = harness.gloo_pool(world).run(ranked_filtered, name)
    hidden, weight, bias, data, loss_fn, params = _filtered_case(name, seed=7)
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    # the one-process fused call is the twin the test above proves against the logits path
    h1, w1, b1 = _leaves(F64, hidden, weight, bias)
    one, _ = lossfx.prepare_linear_loss_input(
        h1, w1, dict(data), loss_fn, bias=b1, sampling_params=lossfx.TrainingSamplingParams(**params), **HEAD
    )
    ref = reference.prepare_linear_loss_input(hr, wr, data, loss_fn, bias=br, **HEAD, **params)["next_token_logprobs"]
    want = one["next_token_logprobs"]
    kept = want != 0
    torch.testing.assert_close(want[kept], ref[kept], **TOL[F64])
    dh, dw, db = torch.autograd.grad(want.sum(), (h1, w1, b1))
    for lp, (gh, _, _) in results:
        torch.testing.assert_close(lp, want.detach(), **TOL[F64])
        torch.testing.assert_close(gh, dh, **TOL[F64])
    torch.testing.assert_close(torch.cat([r[1][1] for r in results]), dw, **TOL[F64])
    torch.testing.assert_close(torch.cat([r[1][2] for r in results]), db, **TOL[F64])


@pytest.mark.xdist_group("gloo4")  # one 4-process pool per session (addopts: --dist loadgroup)
@pytest.mark.slow  # a 4-process gloo pool (~30 s to start on the loaded 2-core VM); 2 ranks cover TP by default
@pytest.mark.distributed
@pytest.mark.parametrize("branch", ["logprob", "distill_full", "draft"])
def test_four_gloo_ranks_uneven_heads(branch):
    results = harness.gloo_pool(4).run(ranked_case, branch, "tp", "float64")
    _check_ranked(results, branch, "tp", F64)


def disagreeing_ranks(rank, world, group):
    hidden, weight, _, data, loss_fn, _ = make_case("logprob")
    ids = data["input_ids"].clone()
    ids[0, 1] = rank  # the replicated input_ids differ between the ranks
    calls = {
        "ids": lambda: lossfx.prepare_linear_loss_input(
            hidden,
            weight[rank::world],
            {"input_ids": ids},
            loss_fn,
            vocab_parallel_group=group,
            vocab_parallel_rank=rank,
        )
    }
    return harness.value_error_messages(calls)


@pytest.mark.distributed
def test_cross_rank_check_raises_on_every_rank():
    messages = harness.gloo_pool(2).run(disagreeing_ranks)
    assert all("input_ids" in m["ids"] for m in messages), messages
    assert messages[0]["ids"] == messages[1]["ids"], messages


# ---------------------------------------------------------------------------------------------
# Compiled: fullgraph, one compile per branch, no recompile on a second call of the same shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("branch", ["logprob", "distill_full", "draft"])
def test_compiled_fullgraph_matches_eager(branch):
    from torch._dynamo.testing import CompileCounterWithBackend

    hidden, weight, bias, data, loss_fn, kwargs = make_case(branch, seed=11)
    key = next(iter(sorted(k for k in data if k != "student_logits")))

    def step(h, w, b, column):
        out, _ = lossfx.prepare_linear_loss_input(h, w, {**data, key: column}, loss_fn, bias=b, **HEAD, **kwargs)
        return {k: v for k, v in out.items() if v is not None}

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter, dynamic=False)
    for seed in (11, 12):
        hidden, weight, bias, data2, _, _ = make_case(branch, seed=seed)
        h, w, b = _leaves(F64, hidden, weight, bias)
        out = compiled(h, w, b, data2[key])
        h2, w2, b2 = _leaves(F64, hidden, weight, bias)
        want = step(h2, w2, b2, data2[key])
        _assert_dicts(out, want, TOL[F64], f"compiled {branch}")
        cot = cotangents(want)
        if cot:
            for got_g, want_g in zip(grads(out, cot, (h, w, b)), grads(want, cot, (h2, w2, b2))):
                torch.testing.assert_close(got_g, want_g, **TOL[F64])
    assert counter.frame_count == 1, counter.frame_count


def compiled_ranked_case(rank, world, group, mode, branches=("logprob", "distill_full", "draft")):
    """One rank's compiled (aot_eager, fullgraph) front-door call of each of `branches` (LOGPROB,
    DISTILLATION and DRAFT) against its own eager call (proven against the reference by `test_two_gloo_ranks`):
    values and gradients to float64 rounding, one compile per branch. TP splits a 12-row head in
    equal shards (a traced call gathers no widths: uneven plain shards are an eager-only layout)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    frames = {}
    for branch in branches:
        hidden, weight, bias, data, loss_fn, kwargs = make_case(branch, seed=5)
        weight, bias = weight[:12], bias[:12]
        data = {k: v.clamp(max=11) if k in ("input_ids", "teacher_topk_indices") else v for k, v in data.items()}
        kw: dict = dict(HEAD, **kwargs)
        if mode == "tp":
            weight, bias = weight.chunk(world)[rank], bias.chunk(world)[rank]
            kw.update(vocab_parallel_group=group, vocab_parallel_rank=rank)
        else:
            hidden = reference.cp_shard(hidden, rank, world)
            kw.update(context_parallel_group=group)

        def step(h, w, b, data=data, loss_fn=loss_fn, kw=kw):
            out, _ = lossfx.prepare_linear_loss_input(h, w, data, loss_fn, bias=b, chunk_size=3, **kw)
            return {k: v for k, v in out.items() if v is not None}

        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step, fullgraph=True, backend=counter, dynamic=False)
        h, w, b = _leaves(F64, hidden, weight, bias)
        got = compiled(h, w, b)
        h2, w2, b2 = _leaves(F64, hidden, weight, bias)
        want = step(h2, w2, b2)
        _assert_dicts(got, want, TOL[F64], f"compiled {mode} r{rank} {branch}")
        cot = cotangents(want)
        if cot:
            for got_g, want_g in zip(grads(got, cot, (h, w, b)), grads(want, cot, (h2, w2, b2)), strict=True):
                torch.testing.assert_close(got_g, want_g, **TOL[F64])
        frames[branch] = counter.frame_count
    return frames


@pytest.mark.distributed
@pytest.mark.compile
# by default TP compiles every branch and CP compiles DRAFT (it gathers before it shards); CP's
# LOGPROB and DISTILLATION with -m slow: by default the fused head's next-token path compiles under
# CP 2 (tests/test_fused_linear.py::test_compiled_next_token_context_parallel), DISTILLATION compiles
# under CP 2 on the logits path (tests/test_sequence_layout.py::test_sharder_layout_compiles_on_every_branch)
# and eagerly through this front door (test_two_gloo_ranks[cp])
@pytest.mark.parametrize(
    ("mode", "branches"),
    [
        ("tp", ("logprob", "distill_full", "draft")),
        ("cp", ("draft",)),
        pytest.param("cp", ("logprob", "distill_full"), marks=pytest.mark.slow),
    ],
    ids=["tp", "cp", "cp-logprob-distill"],
)
def test_compiled_two_gloo_ranks_match_eager(mode, branches):
    for frames in harness.gloo_pool(2).run(compiled_ranked_case, mode, branches):
        assert frames == dict.fromkeys(branches, 1), frames


def dtensor_case(rank, world, group, branch):
    """A `Shard(0)` DTensor head and bias (V = 13 over 2 ranks: 7 and 6 rows), no group arguments."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = harness.device_mesh((world,))
    hidden, weight, bias, data, loss_fn, kwargs = make_case(branch, seed=7)
    h = hidden.clone().requires_grad_(True)
    w = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_(True)
    b = distribute_tensor(bias, mesh, [Shard(0)], src_data_rank=None).requires_grad_(True)
    out, _ = lossfx.prepare_linear_loss_input(h, w, data, loss_fn, bias=b, chunk_size=3, **HEAD, **kwargs)
    cot = cotangents({k: v for k, v in out.items() if v is not None})
    grads_ = (None, None, None)
    if cot:
        loss = sum((out[k].to(F64) * g).sum() for k, g in cot.items())
        loss.backward()
        grads_ = (h.grad, w.grad.full_tensor(), b.grad.full_tensor())
    return {k: None if v is None else v.detach() for k, v in out.items()}, grads_


@pytest.mark.distributed
@pytest.mark.parametrize("branch", ["logprob", "distill_full", "draft"])
def test_dtensor_head_two_gloo_ranks(branch):
    results = harness.gloo_pool(2).run(dtensor_case, branch)
    # the DTensor's rows are torch's chunks (7, 6): the uneven "tp" split of _widths
    hidden, weight, bias, data, loss_fn, kwargs = make_case(branch, seed=7)
    hr, wr, br = _leaves(F64, hidden, weight, bias)
    ref = reference.prepare_linear_loss_input(hr, wr, data, loss_fn, bias=br, **HEAD, **kwargs)
    for rank, (values, _) in enumerate(results):
        for k, want in ref.items():
            if want is None:
                assert values[k] is None
                continue
            if k == "teacher_logits":
                want = _local_draft(want, rank, 2)
            torch.testing.assert_close(values[k].to(F64), want.to(F64), **TOL[F64])
    cot = cotangents({k: v for k, v in results[0][0].items() if v is not None})
    if cot:
        for rank, (_, got) in enumerate(results):
            for name, g, want in zip("hwb", got, grads(ref, cot, (hr, wr, br))):
                torch.testing.assert_close(g.to(F64), want, **TOL[F64], msg=lambda m, n=name, r=rank: f"r{r} d{n}: {m}")


def packed_ranked_case(rank, world, group, mode):
    gen = torch.Generator().manual_seed(5)
    cu, cu_p = [0, 3, 7, 12], [0, 4, 8, 16]  # padded lengths multiples of 2C = 4
    hidden = torch.randn(1, 16, H, generator=gen, dtype=F64)
    weight = torch.randn(V, H, generator=gen, dtype=F64)
    input_ids = torch.randint(0, V, (3, 5), generator=gen)
    kw: dict = {}
    if mode == "tp":
        widths = _widths(world)
        start = sum(widths[:rank])
        weight = weight[start : start + widths[rank]]
        kw.update(vocab_parallel_group=group, vocab_parallel_rank=rank)
    else:
        hidden = reference.packed_cp_shard(hidden, cu_p, rank, world)
        kw.update(context_parallel_group=group)
    h = hidden.clone().requires_grad_(True)
    out, _ = lossfx.prepare_linear_packed_loss_input(
        h, weight, {"input_ids": input_ids}, SimpleNamespace(input_type=LossInputType.LOGPROB), cu, cu_p, **HEAD, **kw
    )
    lp = out["next_token_logprobs"]
    (dh,) = torch.autograd.grad((lp * torch.arange(lp.numel(), dtype=F64).view_as(lp)).sum(), (h,))
    return lp.detach(), dh


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tp", "cp"])
def test_packed_two_gloo_ranks(mode):
    results = harness.gloo_pool(2).run(packed_ranked_case, mode)
    gen = torch.Generator().manual_seed(5)
    cu, cu_p = [0, 3, 7, 12], [0, 4, 8, 16]
    hidden = torch.randn(1, 16, H, generator=gen, dtype=F64).requires_grad_(True)
    weight = torch.randn(V, H, generator=gen, dtype=F64)
    input_ids = torch.randint(0, V, (3, 5), generator=gen)
    ref = reference.prepare_linear_packed_loss_input(hidden, weight, input_ids, cu, cu_p, **HEAD)
    (dh,) = torch.autograd.grad((ref * torch.arange(ref.numel(), dtype=F64).view_as(ref)).sum(), (hidden,))
    for rank, (lp, got_dh) in enumerate(results):
        torch.testing.assert_close(lp, ref, **TOL[F64])
        want = dh if mode == "tp" else 2 * reference.packed_cp_shard(dh, cu_p, rank, 2)  # summed over CP ranks
        torch.testing.assert_close(got_dh, want, **TOL[F64])


@pytest.mark.slow  # Inductor compiles (~30 s); the aot_eager cases above pin one compile per branch by default
@pytest.mark.compile
def test_compiled_inductor_logprob_pinned_recompiles():
    """Inductor, fullgraph: one compile, a new sequence length at most one recompile, a third none."""
    from torch._dynamo.testing import CompileCounterWithBackend

    loss_fn = _loss_fn("logprob")

    def step(h, w, b, ids):
        out, _ = lossfx.prepare_linear_loss_input(h, w, {"input_ids": ids}, loss_fn, bias=b, **HEAD)
        return out["next_token_logprobs"]

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    counts = []
    for seq in (6, 8, 10):
        hidden, weight, bias, data, _, _ = make_case("logprob", seed=seq, seq=seq)
        h, w, b = _leaves(F64, hidden, weight, bias)
        out = compiled(h, w, b, data["input_ids"])
        ref = reference.prepare_linear_loss_input(*_leaves(F64, hidden, weight), data, loss_fn, bias=bias, **HEAD)
        torch.testing.assert_close(out, ref["next_token_logprobs"], **TOL[F64])
        counts.append(counter.frame_count)
    assert counts[0] == 1 and counts[1] <= 2 and counts[2] == counts[1], counts


@pytest.mark.parametrize("branch", ["logprob", "distill_full", "distill_topk"])
def test_gradcheck(branch):
    hidden, weight, bias, data, loss_fn, kwargs = make_case(branch, seed=2, seq=4)
    hidden, weight, bias = hidden[:, :, :3], weight[:, :3], bias  # small: gradcheck is O(inputs)

    def fn(h, w, b):
        out, _ = lossfx.prepare_linear_loss_input(h, w, data, loss_fn, bias=b, chunk_size=1, **HEAD, **kwargs)
        return tuple(v for k, v in sorted(out.items()) if v is not None and v.requires_grad)

    assert torch.autograd.gradcheck(fn, tuple(_leaves(F64, hidden, weight, bias)))
