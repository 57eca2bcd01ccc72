"""The pure token log-prob kernel (`lossfx._kernels.logprobs`) and its boundary.

The kernel takes plain tensors and a `VocabRange`; it is checked against the float64 reference in
values and gradients on 1 and 2 ranks (an uneven split included), compiled once. The public
functions validate once and enter the kernel once per call.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE
from harness import run_ranks

import lossfx
import lossfx._boundary.validation as validation
from lossfx import reference
from lossfx._core.vocab import VocabRange
from lossfx._kernels import logprobs as kernel

pytestmark = pytest.mark.gpu_check  # the GPU check's subset: `pytest --device cuda -m gpu_check`

F64 = torch.float64
V = 11
GEN = torch.Generator().manual_seed(15)
Z = (torch.randn(2, 3, V, generator=GEN, dtype=F64) * 3).to(DEVICE)
T = torch.randint(0, V, (2, 3), generator=GEN).to(DEVICE)
DOUT = torch.randn(2, 3, generator=GEN, dtype=F64).to(DEVICE)


def _reference(z: torch.Tensor, target: torch.Tensor, ignore_index: int | None = None):
    z = z.detach().clone().requires_grad_(True)
    out = reference.token_logprobs(z, target, ignore_index=ignore_index)
    (out * DOUT).sum().backward()
    return out.detach(), z.grad


def _kernel_on_rank(rank, world, group, bounds, target, ignore_index):
    lo, hi = bounds[rank], bounds[rank + 1]
    z = Z[..., lo:hi].clone().requires_grad_(True)
    out = kernel.token_logprobs(z, target, VocabRange(group, lo, V), ignore_index=ignore_index, chunk_rows=2)
    (out * DOUT).sum().backward()
    return out.detach(), z.grad


@pytest.mark.parametrize("ignore_index", [None, 4])
def test_one_rank_matches_the_reference(ignore_index):
    want, want_grad = _reference(Z, T, ignore_index)
    z = Z.clone().requires_grad_(True)
    out = kernel.token_logprobs(z, T.to(torch.int32), VocabRange.whole(V), ignore_index=ignore_index)
    (out * DOUT).sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(z.grad, want_grad, rtol=0, atol=1e-12)
    if ignore_index is not None:
        assert (out[T == ignore_index] == 0).all() and (z.grad[T == ignore_index] == 0).all()


def test_with_lse_matches_the_reference():
    lp, lse = kernel.token_logprobs_with_lse(Z, T, VocabRange.whole(V), chunk_rows=1)
    torch.testing.assert_close(lp, reference.token_logprobs(Z, T), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, Z.logsumexp(-1), rtol=0, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("bounds", [(0, 6, 11), (0, 3, 11)], ids=["near-even", "uneven"])
@pytest.mark.parametrize("ignore_index", [None, 4])
def test_two_ranks_match_the_reference(bounds, ignore_index):
    want, want_grad = _reference(Z, T, ignore_index)
    results = run_ranks(2, _kernel_on_rank, bounds, T, ignore_index)
    for out, _ in results:
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([g for _, g in results], dim=-1), want_grad, rtol=0, atol=1e-12)


def test_compiled_kernel_matches_the_reference():
    torch._dynamo.reset()
    want, want_grad = _reference(Z, T)
    step = torch.compile(
        lambda z, t: kernel.token_logprobs(z, t, VocabRange.whole(V)), fullgraph=True, backend="aot_eager"
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            z = Z.clone().requires_grad_(True)
            out = step(z, T)
            (out * DOUT).sum().backward()
            torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
            torch.testing.assert_close(z.grad, want_grad, rtol=0, atol=1e-12)


def _counting(monkeypatch, module, names):
    """Count calls of `module.<name>` for each name (the original still runs)."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


@pytest.mark.parametrize(
    "call",
    [
        lambda: lossfx.token_logprobs(Z, T),
        lambda: lossfx.token_logprobs(Z, T.masked_fill(T == 4, -100), ignore_index=-100),
        lambda: lossfx.token_logprobs_with_lse(Z, T)[0],
    ],
    ids=["token_logprobs", "ignore_index", "with_lse"],
)
def test_one_public_call_checks_once_and_enters_the_kernel_once(monkeypatch, call):
    checks = _counting(monkeypatch, validation, ["check_ids_in_range"])
    local = _counting(monkeypatch, lossfx.logprobs, ["check_ids_in_range"])
    entered = _counting(monkeypatch, kernel, ["token_logprobs", "token_logprobs_with_lse"])
    applied = _counting(monkeypatch, kernel._TokenLogprobsFn, ["apply"])
    call()
    assert checks["check_ids_in_range"] + local["check_ids_in_range"] == 1
    assert sum(entered.values()) == 1 and applied["apply"] == 1
