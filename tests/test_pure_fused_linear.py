"""The pure fused LM-head kernels (`lossfx._kernels.fused_linear`, `lossfx._kernels.linear_objective`)
against the float64 reference, on 1 and 2 ranks (an uneven `VocabRange` split included), and the
boundary of the public functions: one public call enters its pure kernel once and range-checks its
ids once."""

from __future__ import annotations

import math

import pytest
import torch
from devices import on_device
from harness import compiled_for_rank, run_ranks

import lossfx
import lossfx._boundary.validation as validation
import lossfx.fused_linear as public_fused
from lossfx import reference
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels import fused_linear as kfused
from lossfx._kernels import linear_objective as kobjective

pytestmark = pytest.mark.gpu_check  # the GPU check's subset: `pytest --device cuda -m gpu_check`

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-11}
HEAD = HeadOptions(
    temperature=0.8, logit_scale=1.3, softcap=4.0
)  # temperature, logit_scale, softcap: every option of the head at once
OPTIONS = {"logit_scale": 1.3, "softcap": 4.0}


def _case(n=7, h=5, v=11, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=F64)
    weight = torch.randn(v, h, generator=gen, dtype=F64) / math.sqrt(h) * 3
    bias = torch.randn(v, generator=gen, dtype=F64)
    ids = torch.randint(0, v, (n, k), generator=gen)
    ids[1, 0] = -100  # one ignored id, and a row with nothing but ignored ids
    ids[4] = -100
    a = torch.randn(n, generator=gen, dtype=F64)
    b = torch.randn(n, generator=gen, dtype=F64)
    return on_device((hidden, weight, bias, ids, a, b))


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _reference_gather(hidden, weight, bias, ids, zero_outside_topk):
    """(logprobs, neg_entropy, dhidden, dweight, dbias) of the reference with a fixed upstream gradient."""
    h, w, bb = _leaves(hidden, weight, bias)
    lp, ne = reference.linear_gather_logprobs(h, w, ids, zero_outside_topk, 0.8, bias=bb, **OPTIONS)
    _backward(lp, ne)
    return lp.detach(), ne.detach(), h.grad, w.grad, bb.grad


def _backward(lp, ne):
    gen = torch.Generator().manual_seed(99)
    g = torch.randn(lp.shape, generator=gen, dtype=F64).to(lp.device)
    gn = torch.randn(ne.shape, generator=gen, dtype=F64).to(ne.device)
    ((lp * g).sum() + (ne * gn).sum()).backward()


def _gather_rank(rank, world, group, hidden, weight, bias, ids, bounds, zero_outside_topk, chunk_rows):
    start, stop = bounds[rank], bounds[rank + 1]
    h, w, bb = _leaves(hidden, weight[start:stop], bias[start:stop])
    vocab = VocabRange(group if world > 1 else None, start, weight.shape[0])
    lp, ne = kfused.linear_gather_logprobs(
        h, w, ids, vocab, head=HEAD._replace(bias=bb), with_neg_entropy=True, zero_outside_topk=zero_outside_topk,
        chunk_rows=chunk_rows,
    )  # fmt: skip
    _backward(lp, ne)
    return lp.detach(), ne.detach(), h.grad, w.grad, bb.grad


@pytest.mark.parametrize("zero_outside_topk", [True, False])
@pytest.mark.parametrize("bounds", [(0, 11), (0, 6, 11), (0, 3, 11)], ids=["1 rank", "even", "uneven"])
def test_pure_gather_matches_reference(bounds, zero_outside_topk):
    """Values and gradients (hidden: the full gradient on every rank; weight/bias: each rank's rows)."""
    hidden, weight, bias, ids, _, _ = _case()
    world = len(bounds) - 1
    results = run_ranks(world, _gather_rank, hidden, weight, bias, ids, bounds, zero_outside_topk, 2)
    expected = _reference_gather(hidden, weight, bias, ids, zero_outside_topk)
    for got in results:
        for name, x, y in zip(("logprobs", "neg_entropy", "dhidden"), got[:3], expected[:3], strict=True):
            torch.testing.assert_close(x, y, **TIGHT, msg=name)
    torch.testing.assert_close(torch.cat([r[3] for r in results]), expected[3], **TIGHT)
    torch.testing.assert_close(torch.cat([r[4] for r in results]), expected[4], **TIGHT)


def test_pure_token_logprobs_matches_reference_leading_shape():
    """`[2, 3]` targets of any int dtype, `K = 1`, through `linear_token_logprobs`."""
    hidden, weight, bias, ids, _, _ = _case(n=6)
    target = ids[:, 0].view(2, 3).to(torch.int32)
    h, w, bb = _leaves(hidden.view(2, 3, -1), weight, bias)
    lp, ne = kfused.linear_token_logprobs(
        h, w, target, VocabRange.whole(11), head=HEAD._replace(bias=bb), with_neg_entropy=True
    )
    _backward(lp, ne)
    hr, wr, br = _leaves(hidden.view(2, 3, -1), weight, bias)
    lp_ref, ne_ref = reference.linear_token_logprobs(hr, wr, target.long(), 0.8, bias=br, **OPTIONS)
    _backward(lp_ref, ne_ref)
    for x, y in zip((lp, ne, h.grad, w.grad, bb.grad), (lp_ref, ne_ref, hr.grad, wr.grad, br.grad), strict=True):
        torch.testing.assert_close(x, y, **TIGHT)
    lp_only, none = kfused.linear_token_logprobs(hidden, weight, ids[:, 0], VocabRange.whole(11), head=HEAD)
    assert none is None and lp_only.shape == (6,)


def _objective_rank(rank, world, group, hidden, weight, bias, target, a, b, bounds, chunk_rows):
    start, stop = bounds[rank], bounds[rank + 1]
    h, w, bb, aa, be = _leaves(hidden, weight[start:stop], bias[start:stop], a, b)
    vocab = VocabRange(group if world > 1 else None, start, weight.shape[0])
    obj, lp, ne = kobjective.linear_logprob_objective(
        h, w, target, aa, be, vocab, head=HEAD._replace(bias=bb), chunk_rows=chunk_rows
    )
    (obj * 0.7).backward()
    return obj.detach(), lp, ne, h.grad, w.grad, bb.grad, aa.grad, be.grad


@pytest.mark.parametrize("bounds", [(0, 11), (0, 3, 11)], ids=["1 rank", "uneven"])
def test_pure_objective_matches_reference(bounds):
    hidden, weight, bias, ids, a, b = _case(seed=3)
    target = ids[:, 0]
    world = len(bounds) - 1
    results = run_ranks(world, _objective_rank, hidden, weight, bias, target, a, b, bounds, 3)
    h, w, bb, aa, be = _leaves(hidden, weight, bias, a, b)
    obj, lp, ne = reference.linear_logprob_objective(h, w, target, aa, be, 0.8, bias=bb, **OPTIONS)
    (obj * 0.7).backward()
    for got in results:
        for x, y in zip(got[:4], (obj, lp, ne, h.grad), strict=True):
            torch.testing.assert_close(x, y.detach(), **TIGHT)
        torch.testing.assert_close(got[6], aa.grad, **TIGHT)
        torch.testing.assert_close(got[7], be.grad, **TIGHT)
    torch.testing.assert_close(torch.cat([r[4] for r in results]), w.grad, **TIGHT)
    torch.testing.assert_close(torch.cat([r[5] for r in results]), bb.grad, **TIGHT)


def _compiled_rank(rank, world, group, hidden, weight, ids):
    vl = weight.shape[0] // world
    w = weight[rank * vl : (rank + 1) * vl]
    vocab = VocabRange.uniform(group, vl)

    def fn(h, w, ids):
        return kfused.linear_gather_logprobs(h, w, ids, vocab, head=HEAD, with_neg_entropy=True)

    counter, compiled = compiled_for_rank(rank, ("pure gather", world), fn, "aot_eager")
    out = compiled(hidden, w, ids)
    return out, counter.frame_count


def test_pure_gather_compiles_fullgraph_on_two_ranks():
    hidden, weight, _, ids, _, _ = _case(v=12)
    results = run_ranks(2, _compiled_rank, hidden, weight, ids)
    lp_ref, ne_ref = reference.linear_gather_logprobs(hidden, weight, ids, True, 0.8, **OPTIONS)
    for (lp, ne), frames in results:
        assert frames == 1
        torch.testing.assert_close(lp, lp_ref, **TIGHT)
        torch.testing.assert_close(ne, ne_ref, **TIGHT)


# -- the boundary: one public call, one kernel entry, one range check ------------------------------


def _counting(monkeypatch, module, name, counts):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize(
    "call, kernel_name",
    [
        (lambda h, w, ids, a: lossfx.linear_token_logprobs(h, w, ids[:, 0]), "linear_token_logprobs"),
        (lambda h, w, ids, a: lossfx.linear_gather_logprobs(h, w, ids), "linear_gather_logprobs"),
        (
            lambda h, w, ids, a: lossfx.linear_next_token_logprobs(h[None], w, ids[None, :, 0], return_entropy=None),
            "linear_token_logprobs",
        ),
        (lambda h, w, ids, a: lossfx.linear_logprob_objective(h, w, ids[:, 0], a), "linear_logprob_objective"),
    ],
    ids=["token", "gather", "next_token", "objective"],
)
def test_one_public_call_enters_the_kernel_once_and_checks_ids_once(monkeypatch, call, kernel_name):
    hidden, weight, _, ids, a, _ = _case()
    counts: dict[str, int] = {}
    for name in ("linear_token_logprobs", "linear_gather_logprobs", "linear_rows"):
        _counting(monkeypatch, kfused, name, counts)
    for name in ("linear_logprob_objective", "linear_rows"):  # the objective's kernel and its row preparation
        _counting(monkeypatch, kobjective, name, counts)
    # the name at its source, and as the boundary's modules imported it (the fused next-token call is
    # checked by the logits path's `validated_next_token_call`, in lossfx.next_token)
    for module in (validation, public_fused, lossfx.next_token):
        _counting(monkeypatch, module, "check_ids_in_range", counts)
    call(hidden, weight, ids, a)
    assert counts.pop(kernel_name) == 1, counts
    assert counts.pop("linear_rows") == 1, counts  # the kernel's row preparation: once
    assert counts.pop("check_ids_in_range") == 1, counts
    assert counts == {}, counts  # no other kernel entered


def test_the_kernel_call_is_the_public_result():
    """The boundary adds nothing to the kernel's values: bit-identical results."""
    hidden, weight, bias, ids, a, b = _case(seed=5)
    public = lossfx.linear_gather_logprobs(
        hidden, weight, ids, bias=bias, temperature=0.8, with_neg_entropy=True, zero_outside_topk=False, **OPTIONS
    )
    pure = kfused.linear_gather_logprobs(
        hidden,
        weight,
        ids,
        VocabRange.whole(11),
        head=HEAD._replace(bias=bias),
        with_neg_entropy=True,
        zero_outside_topk=False,
    )
    assert all(torch.equal(x, y) for x, y in zip(public, pure, strict=True))
    public_objective = lossfx.linear_logprob_objective(hidden, weight, ids[:, 0], a, neg_entropy_weight=b)
    pure_objective = kobjective.linear_logprob_objective(
        hidden, weight, ids[:, 0], a, b, VocabRange.whole(11), head=HeadOptions()
    )
    assert all(torch.equal(x, y) for x, y in zip(public_objective, pure_objective, strict=True))
