"""`ignore_index` on the logits path: `token_logprobs` and `next_token_logprobs`.

Targets equal to `ignore_index` give 0 and a zero gradient and are no range error, against
`lossfx.reference` in float64 (values and gradients, TP 1 and 2 on rank threads, eager and one
compiled case); the default `None` keeps NeMo's contract (-100 raises), and
`prepare_loss_input` is unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from harness import compiled_for_rank, run_ranks

import lossfx
from lossfx import reference

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
VOCAB = 12


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 8, VOCAB, generator=gen, dtype=F64) * 3
    logits[1, 4] = float("-inf")  # an all -inf row whose target is ignored: 0, no NaN
    ids = torch.randint(0, VOCAB, (3, 8), generator=gen)
    ids[0, 2:5] = -100
    ids[1, 4:6] = -100  # the -inf row's target in both layouts (position t scores ids[:, t+1])
    ids[2, 0] = -100  # column 0 is never a next-token target
    dout = torch.randn(3, 8, generator=gen, dtype=F64)
    return logits, ids, dout


def _rank(rank, world, group, logits, ids, dout, next_token, compiled):
    vl = VOCAB // world
    z = logits[..., rank * vl : (rank + 1) * vl].clone().requires_grad_()
    if next_token:

        def fn(x):
            return lossfx.next_token_logprobs(
                x, ids, vocab_parallel_group=group, vocab_parallel_rank=rank if group else None, ignore_index=-100
            )

        d = dout[:, 1:]
    else:

        def fn(x):
            return lossfx.token_logprobs(x, ids, group=group, chunk_size=5, ignore_index=-100)

        d = dout
    if compiled:
        fn = compiled_for_rank(rank, ("ignore_index", next_token), fn, backend="aot_eager")[1]
    before = ids.clone()
    out = fn(z)
    out.backward(d)
    assert torch.equal(ids, before)
    return out.detach(), z.grad


@pytest.mark.parametrize(
    ("world", "next_token", "compiled"),
    [(1, False, False), (2, False, False), (1, True, False), (2, True, False), (2, True, True)],
)
def test_ignored_targets_give_zero_and_no_gradient(world, next_token, compiled):
    logits, ids, dout = _case()
    results = run_ranks(world, _rank, logits, ids, dout, next_token, compiled)
    z = logits.clone().requires_grad_()
    if next_token:
        want = reference.next_token_logprobs(z, ids, ignore_index=-100)
        ignored = ids[:, 1:] == -100
        (dz,) = torch.autograd.grad(want, z, dout[:, 1:])
    else:
        want = reference.token_logprobs(z, ids, ignore_index=-100)
        ignored = ids == -100
        (dz,) = torch.autograd.grad(want, z, dout)
    for out, _ in results:
        torch.testing.assert_close(out, want.detach(), **TIGHT)
    got = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(got, dz, **TIGHT)
    assert not torch.isnan(got).any()
    assert (want[ignored] == 0).all() and (want[~ignored] < 0).all()
    rows = dz[:, :-1] if next_token else dz
    assert (rows[ignored] == 0).all() and (rows[~ignored] != 0).any()  # ignored rows get no gradient


def test_default_keeps_nemos_contract_and_prepare_loss_input_is_unchanged():
    logits, ids, _ = _case(seed=1)
    logits[1, 4] = 0.0
    with pytest.raises(ValueError, match=r"target must lie in \[0, 12\).*-100"):
        lossfx.token_logprobs(logits, ids)
    with pytest.raises(ValueError, match="-100"):
        lossfx.next_token_logprobs(logits, ids)
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    with pytest.raises(ValueError, match="-100"):
        lossfx.prepare_loss_input(logits, {"input_ids": ids}, loss_fn)


@pytest.mark.parametrize("bad", [True, 1.5, "x"])
def test_bad_ignore_index_raises_naming_it(bad):
    logits, ids, _ = _case()
    for call in (lossfx.token_logprobs, lossfx.next_token_logprobs):
        with pytest.raises(TypeError, match=f"ignore_index must be an int or None, got {bad!r}"):
            call(logits, ids, ignore_index=bad)
