"""The entropy as a metric (issue 27): requested, but reaching no loss, it costs only its forward.

TRL logs the entropy of every step without differentiating it. The fused functions' autograd
Function takes the entropy's gradient as None when no loss reads it (`set_materialize_grads(False)`)
and then skips the entropy's branch in every tile of the backward: the backward dispatches the ops
of a call without the entropy, and the gradients are bit for bit those of `return_neg_entropy=False`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lossfx
from benchmarks.bench_launches import LaunchCounter
from lossfx._core.chunking import CPU_POLICY, chunk_policy

BLOCKS = dataclasses.replace(CPU_POLICY, max_block=8)  # V = 32: four vocabulary blocks


def _inputs(seed=0, n=24, h=16, v=32, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=dtype)
    weight = torch.randn(v, h, generator=gen, dtype=dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    target[3] = -100
    return hidden, weight, target


def _step(entropy, use, *, fn=lossfx.linear_token_logprobs, seed=0):
    """Backward ops and gradients of `Σ g·lp` (`+ Σ e·neg_entropy` when `use`), the entropy
    requested when `entropy` (a metric when not `use`)."""
    hidden, weight, target = _inputs(seed)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    g = torch.linspace(-1, 1, target.numel())
    with chunk_policy(BLOCKS):
        out = fn(h, w, target, return_neg_entropy=entropy, chunk_size=5)
        lp, ne = out if entropy else (out, None)
        loss = (g * lp).sum() + ((g.flip(0) * ne).sum() if use else 0)
        counter = LaunchCounter()  # counts inside the tile loops' custom ops too
        with counter:
            loss.backward()
    return counter.total, h.grad, w.grad, ne


def test_metric_entropy_backward_is_the_backward_without_entropy():
    ops_plain, dh_plain, dw_plain, _ = _step(False, False)
    ops_metric, dh_metric, dw_metric, ne = _step(True, False)
    ops_loss, _, _, _ = _step(True, True)
    assert ne is not None and ne.requires_grad  # still a differentiable output: usable in a loss
    assert torch.equal(dh_metric, dh_plain) and torch.equal(dw_metric, dw_plain)
    assert ops_metric == ops_plain, (ops_metric, ops_plain)
    # the entropy's branch costs ops in every tile when it does reach the loss
    assert ops_loss > ops_metric + 4 * 5, (ops_loss, ops_metric)


def test_detached_entropy_is_a_metric_too():
    hidden, weight, target = _inputs(1)
    grads = []
    for entropy in (False, True):
        h = hidden.clone().requires_grad_()
        out = lossfx.linear_token_logprobs(h, weight, target, return_neg_entropy=entropy)
        lp = out[0] if entropy else out
        if entropy:
            assert out[1].detach().isfinite().all()
        lp.sum().backward()
        grads.append(h.grad)
    assert torch.equal(grads[0], grads[1])


def test_only_the_entropy_reaches_the_loss():
    """The log-probs unused: their gradient arrives as None too; the result is the reference's."""
    from lossfx import reference

    hidden, weight, target = _inputs(2, dtype=torch.float64)
    h = hidden.clone().requires_grad_()
    _, ne = lossfx.linear_token_logprobs(h, weight, target, return_neg_entropy=True)
    ne.sum().backward()
    h_ref = hidden.clone().requires_grad_()
    _, ne_ref = reference.linear_token_logprobs(h_ref, weight, target)
    ne_ref.sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=0, atol=1e-10)


@pytest.mark.compile
def test_compiled_metric_entropy():
    """Under torch.compile(fullgraph=True) the metric entropy changes no gradient either."""
    hidden, weight, target = _inputs(3)

    def loss(h, w, t):
        lp, ne = lossfx.linear_token_logprobs(h, w, t, return_neg_entropy=True)
        return lp.sum(), ne

    compiled = torch.compile(loss, fullgraph=True)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    value, ne = compiled(h, w, target)
    value.backward()
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lossfx.linear_token_logprobs(h0, w0, target).sum().backward()
    torch.testing.assert_close(h.grad, h0.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w0.grad, rtol=1e-6, atol=1e-6)
    assert ne.isfinite().all()
