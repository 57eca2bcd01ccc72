"""The kernel and `prepare_loss_input` on a real gloo backend: worlds 2 and 4 in worker processes.

Each rank slices its vocabulary shard of the full logits, runs eagerly, and sends back its output
and its shard's gradient; the outputs must be replicated and equal the dense float64 reference,
and the gradients concatenated in rank order must equal the reference gradient (1e-10 in
float64). Uniform shards use the default `rank · Vl` layout; uneven shards pass `vocab_start` /
`vocab_size` explicitly. Rank functions are module-level so the workers can import them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import harness
import pytest
import strategies
import torch
from hypothesis import given, settings

import lossfx
from lossfx import reference

pytestmark = pytest.mark.distributed

F64 = torch.float64
LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)


def _bounds(vocab: int, sizes: list[int] | None, world: int) -> list[tuple[int, int]]:
    sizes = sizes or [vocab // world] * world
    starts = [sum(sizes[:r]) for r in range(world)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def gloo_token_logprobs(rank, world, group, logits, target, dout, chunk, sizes=None):
    """Worker: token log-probs of this rank's shard (explicit bounds when `sizes` is given)."""
    start, end = _bounds(logits.shape[-1], sizes, world)[rank]
    shard = logits[..., start:end].clone().requires_grad_(True)
    kwargs = {} if sizes is None else {"vocab_start": start, "vocab_size": logits.shape[-1]}
    out, lse = lossfx.token_logprobs_with_lse(shard, target, group=group, chunk_size=chunk, **kwargs)
    out.backward(dout)
    return out.detach(), lse, shard.grad


def gloo_prepare_loss_input(rank, world, group, logits, input_ids, dout, chunk):
    """Worker: the LOGPROB branch with `vocab_parallel_group` / `vocab_parallel_rank`."""
    vl = logits.shape[-1] // world
    shard = logits[..., rank * vl : (rank + 1) * vl].clone().requires_grad_(True)
    data = {"input_ids": input_ids}
    out, data_back = lossfx.prepare_loss_input(
        shard, data, LOGPROB, vocab_parallel_rank=rank, vocab_parallel_group=group, chunk_size=chunk
    )
    assert data_back is data and set(data) == {"input_ids"}
    out["next_token_logprobs"].backward(dout)
    return out["next_token_logprobs"].detach(), shard.grad


def run_gloo(world, fn, *args):
    """Run on the gloo pool; check the replicated output; concatenate the gradients."""
    results = harness.gloo_pool(world).run(fn, *args)
    for rank, result in enumerate(results[1:], start=1):
        assert torch.equal(result[0], results[0][0]), f"rank {rank} output differs from rank 0"
    return results[0][0], torch.cat([r[-1] for r in results], dim=-1), results


def reference_grad(logits, target, dout, next_token=False):
    x = logits.detach().to(F64).requires_grad_(True)
    fn = reference.next_token_logprobs if next_token else reference.token_logprobs
    out = fn(x, target)
    out.backward(dout.to(F64))
    return out.detach(), x.grad


def make_inputs(shape, seed=0, scale=1.0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=gen, dtype=F64) * scale).to(dtype)
    target = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    dout = torch.randn(shape[:-1], generator=gen, dtype=F64)
    return logits, target, dout


def close(actual, expected, atol, what):
    torch.testing.assert_close(actual.to(F64), expected.to(F64), atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------
# Kernel, uniform shards
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 4, 1000])
@pytest.mark.parametrize("shape", [(2, 5, 8), (3, 7, 40), (1, 1, 4)])
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_token_logprobs_float64(world, shape, chunk):
    logits, target, dout = make_inputs(shape, seed=world + shape[1], scale=4.0)
    out, grad, results = run_gloo(world, gloo_token_logprobs, logits, target, dout, chunk)
    ref, ref_grad = reference_grad(logits, target, dout)
    close(out, ref, 1e-10, "values")
    close(grad, ref_grad, 1e-10, "dlogits")
    close(results[0][1], torch.logsumexp(logits, dim=-1), 1e-10, "lse")


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_neg_inf_rows_and_targets(world):
    logits, target, dout = make_inputs((2, 6, 8), seed=5)
    logits[0, 1] = -math.inf  # a whole row
    logits[1, 2, target[1, 2]] = -math.inf  # the target's entry
    logits[1, 3, :4] = -math.inf  # all of rank 0's shard (world 2)
    out, grad, _ = run_gloo(world, gloo_token_logprobs, logits, target, dout, 2)
    ref, ref_grad = reference_grad(logits, target, dout)
    assert not torch.isnan(out).any() and not torch.isnan(grad).any()
    assert out[0, 1] == -math.inf and out[1, 2] == -math.inf and (grad[0, 1] == 0).all()
    close(out, ref, 1e-10, "values")
    close(grad, ref_grad, 1e-10, "dlogits")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gloo_low_precision_grads(dtype, world):
    """bf16/fp32 logits: gradients come back in the logits' dtype and are as close to the float64
    truth as the dense fp32 baseline's (log_softmax of `x.float()`, gradient cast back), up to one
    rounding step of the dtype (eps·|g|) plus a few fp32 ulps of the logit magnitude."""
    logits, target, dout = make_inputs((3, 5, 16), seed=7, scale=5.0, dtype=dtype)
    dout = dout.float()
    out, grad, _ = run_gloo(world, gloo_token_logprobs, logits, target, dout, 3)
    assert grad.dtype == dtype and out.dtype == torch.float32
    truth, truth_grad = reference_grad(logits, target, dout)
    x = logits.clone().requires_grad_(True)
    base = torch.log_softmax(x.float(), -1).gather(-1, target[..., None])[..., 0]
    base.backward(dout)
    mag = logits.to(F64).abs().amax(-1, keepdim=True) + math.log(16) + 1
    eps32 = torch.finfo(torch.float32).eps
    gtol = torch.finfo(dtype).eps * truth_grad.abs() + 16 * eps32 * mag * dout.abs().to(F64)[..., None]
    worse = (grad.to(F64) - truth_grad).abs() > (x.grad.to(F64) - truth_grad).abs() + gtol
    assert not worse.any(), f"{int(worse.sum())} gradient entries worse than the baseline"
    vtol = 16 * eps32 * mag[..., 0]
    worse_v = (out.to(F64) - truth).abs() > (base.detach().to(F64) - truth).abs() + vtol
    assert not worse_v.any()


# ---------------------------------------------------------------------------------------------
# Kernel, uneven shards (explicit vocab_start / vocab_size)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "vocab", "sizes"),
    [(2, 7, [4, 3]), (2, 7, [1, 6]), (2, 5, [2, 3]), (4, 10, [3, 3, 2, 2]), (4, 9, [1, 4, 3, 1])],
)
@pytest.mark.parametrize("chunk", [None, 2])
def test_gloo_uneven_shards(world, vocab, sizes, chunk):
    logits, target, dout = make_inputs((2, 5, vocab), seed=vocab + world, scale=3.0)
    out, grad, _ = run_gloo(world, gloo_token_logprobs, logits, target, dout, chunk, sizes)
    ref, ref_grad = reference_grad(logits, target, dout)
    assert grad.shape == logits.shape
    close(out, ref, 1e-10, "values")
    close(grad, ref_grad, 1e-10, "dlogits")


# ---------------------------------------------------------------------------------------------
# prepare_loss_input over gloo
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_prepare_loss_input(world, chunk):
    logits, input_ids, _ = make_inputs((2, 9, 12), seed=world * 10 + (chunk or 0), scale=2.0)
    dout = torch.randn(2, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    out, grad, _ = run_gloo(world, gloo_prepare_loss_input, logits, input_ids, dout, chunk)
    ref, ref_grad = reference_grad(logits, input_ids, dout, next_token=True)
    assert out.shape == (2, 8)
    close(out, ref, 1e-10, "values")
    close(grad, ref_grad, 1e-10, "dlogits")


# ---------------------------------------------------------------------------------------------
# Property over gloo (fewer examples: a pool round trip costs ~20-40 ms)
# ---------------------------------------------------------------------------------------------


@settings(max_examples=max(5, settings.default.max_examples // 3))
@given(case=strategies.logits_cases(dtypes=(F64,), worlds=(2, 4)))
def test_gloo_property_matches_reference(case):
    logits, target = case.logits(), case.target()
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(case.seed), dtype=F64)
    out, grad, _ = run_gloo(case.world, gloo_token_logprobs, logits, target, dout, case.chunk)
    ref, ref_grad = reference_grad(logits, target, dout)
    assert not torch.isnan(out).any() and not torch.isnan(grad).any()
    close(out, ref, 1e-10 * max(1.0, case.scale), "values")
    close(grad, ref_grad, 1e-10, "dlogits")
