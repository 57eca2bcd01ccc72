"""The pure gather kernels (`lossfx._kernels.gather`) and their boundary.

`gather_logprobs` (with and without the negative entropy) and `gather_logits` take plain tensors
and a `VocabRange`; checked against the float64 reference in values and gradients on 1 and 2
ranks (an uneven split included), compiled once. The public functions validate once and enter the
kernel once per call.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE
from harness import run_ranks
from test_pure_logprobs import _counting

import lossfx
import lossfx._boundary.validation as validation
from lossfx import reference
from lossfx._core.vocab import VocabRange
from lossfx._kernels import gather as kernel

pytestmark = pytest.mark.gpu_check  # the GPU check's subset: `pytest --device cuda -m gpu_check`

F64 = torch.float64
V = 11
GEN = torch.Generator().manual_seed(16)
Z = (torch.randn(2, 3, V, generator=GEN, dtype=F64) * 3).to(DEVICE)
IDS = torch.randint(0, V, (2, 3, 4), generator=GEN).to(DEVICE)
IDS[0, 0, 1] = IDS[0, 0, 0]  # a duplicate id: its gradients add
G = torch.randn(2, 3, 4, generator=GEN, dtype=F64).to(DEVICE)
H = torch.randn(2, 3, generator=GEN, dtype=F64).to(DEVICE)


def _reference(z: torch.Tensor, what: str):
    z = z.detach().clone().requires_grad_(True)
    if what == "logits":
        outs = (z.gather(-1, IDS),)
    else:
        lp, neg_entropy = reference.gather_logprobs(z, IDS)
        outs = (lp, neg_entropy) if what == "entropy" else (lp,)
    _backward(outs)
    return [o.detach() for o in outs], z.grad


def _backward(outs):
    loss = (outs[0] * G).sum() + ((outs[1] * H).sum() if len(outs) > 1 else 0)
    loss.backward()


def _run(z: torch.Tensor, vocab: VocabRange, what: str):
    z = z.clone().requires_grad_(True)
    if what == "logits":
        outs = (kernel.gather_logits(z, IDS.to(torch.int32), vocab),)
    else:
        lp, neg_entropy = kernel.gather_logprobs(
            z, IDS.to(torch.int32), vocab, with_neg_entropy=what == "entropy", chunk_rows=2
        )
        assert (neg_entropy is None) == (what != "entropy")
        outs = (lp,) if neg_entropy is None else (lp, neg_entropy)
    _backward(outs)
    return [o.detach() for o in outs], z.grad


def _on_rank(rank, world, group, bounds, what):
    lo, hi = bounds[rank], bounds[rank + 1]
    return _run(Z[..., lo:hi], VocabRange(group, lo, V), what)


WHAT = ["logprobs", "entropy", "logits"]


@pytest.mark.parametrize("what", WHAT)
def test_one_rank_matches_the_reference(what):
    want, want_grad = _reference(Z, what)
    got, grad = _run(Z, VocabRange.whole(V), what)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("bounds", [(0, 6, 11), (0, 3, 11)], ids=["near-even", "uneven"])
@pytest.mark.parametrize("what", WHAT)
def test_two_ranks_match_the_reference(bounds, what):
    want, want_grad = _reference(Z, what)
    results = run_ranks(2, _on_rank, bounds, what)
    for got, _ in results:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([g for _, g in results], dim=-1), want_grad, rtol=0, atol=1e-12)


def test_compiled_kernel_matches_the_reference():
    torch._dynamo.reset()
    want, want_grad = _reference(Z, "entropy")

    def step(z, ids):
        return kernel.gather_logprobs(z, ids, VocabRange.whole(V), with_neg_entropy=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            z = Z.clone().requires_grad_(True)
            outs = compiled(z, IDS)
            _backward(outs)
            for g, w in zip(outs, want, strict=True):
                torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-12)
            torch.testing.assert_close(z.grad, want_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "call",
    [
        lambda: lossfx.gather_logprobs(Z, IDS)[0],
        lambda: lossfx.gather_logprobs(Z, IDS, with_neg_entropy=True)[1],
        lambda: lossfx.gather_logits(Z, IDS),
    ],
    ids=["gather_logprobs", "with_neg_entropy", "gather_logits"],
)
def test_one_public_call_checks_once_and_enters_the_kernel_once(monkeypatch, call):
    checks = _counting(monkeypatch, validation, ["check_ids_in_range"])
    local = _counting(monkeypatch, lossfx.logprobs, ["check_ids_in_range"])  # the ids check the logits faces share
    entered = _counting(monkeypatch, kernel, ["gather_logprobs", "gather_logits"])
    call()
    assert checks["check_ids_in_range"] + local["check_ids_in_range"] == 1
    assert sum(entered.values()) == 1
