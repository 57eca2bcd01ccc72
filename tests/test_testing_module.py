"""`lossfx.testing`: the checkers accept correct kernels, reject wrong ones with a clear diff, and
the strategies draw what they promise; hypothesis stays optional; docs/testing.md runs."""

from __future__ import annotations

import doctest
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from hypothesis import given, settings

import lossfx
import lossfx.testing as lt
from lossfx import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
F64 = torch.float64
LOWER = {F64: torch.float32, torch.float32: torch.bfloat16}  # one rounding here must fail
# issue 10 item 1 (being fixed on its own branch): lossfx forms `lse = m + log s` and subtracts it,
# which loses `log s` to the rounding of a large max in float32.
EXACT_AT_ANY_OFFSET = [c for c in lt.CASES if c != "offset 1e4"]


def _logprobs_by_cross_entropy(logits, target):
    return -F.cross_entropy(logits, target, reduction="none")


def _expect_failure(check, fn, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(fn, *args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# Correct kernels pass
# ---------------------------------------------------------------------------------------------


def test_torch_cross_entropy_passes_every_case_and_dtype():
    lt.check_logprob_fn(_logprobs_by_cross_entropy, cases=lt.CASES, dtypes=(F64, torch.float32, torch.bfloat16))


def test_lossfx_kernels_pass_their_own_checkers():
    lt.check_logprob_fn(lossfx.token_logprobs, cases=EXACT_AT_ANY_OFFSET, device="cpu")
    lt.check_entropy_fn(lossfx.entropy, cases=EXACT_AT_ANY_OFFSET)
    lt.check_kl_fn(lossfx.reverse_kl_to_fixed, cases=EXACT_AT_ANY_OFFSET)


def test_lossfx_token_logprobs_is_exact_at_an_offset_of_1e4():  # issue 10 item 1 (was an xfail)
    lt.check_logprob_fn(lossfx.token_logprobs, cases=["offset 1e4"], dtypes=(torch.float32,))


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_tolerance_accepts_one_rounding_to_the_dtype_and_rejects_one_through_the_next_lower(dtype):
    """The justification of `TOLERANCES`, checked: the exact result rounded once passes..."""
    lt.check_logprob_fn(lambda z, t: reference.token_logprobs(z, t).to(z.dtype), dtypes=(dtype,))
    lt.check_entropy_fn(lambda z: reference.entropy(z).to(z.dtype), dtypes=(dtype,))
    lt.check_kl_fn(lambda s, t: reference.reverse_kl_to_fixed(s, t).to(s.dtype), dtypes=(dtype,))
    if dtype in LOWER:  # ...and rounded once through the next lower precision, it fails
        lower = LOWER[dtype]
        message = _expect_failure(
            lt.check_logprob_fn, lambda z, t: reference.token_logprobs(z, t).to(lower).to(z.dtype), dtypes=(dtype,)
        )
        assert "values differ" in message


def test_user_tensors_replace_the_built_in_cases():
    z = torch.randn(3, 4, 7, dtype=F64)
    target = torch.randint(0, 7, (3, 4))
    lt.check_logprob_fn(lossfx.token_logprobs, z, target, dtypes=(F64,))
    lt.check_entropy_fn(lossfx.entropy, z, dtypes=(F64,))
    lt.check_kl_fn(lossfx.reverse_kl_to_fixed, z, teacher=torch.randn(3, 4, 7), dtypes=(F64,))
    # the given target is the one used: a wrong one shows up
    message = _expect_failure(lt.check_logprob_fn, lambda x, t: lossfx.token_logprobs(x, (t + 1) % 7), z, target)
    assert "case 'given'" in message


# ---------------------------------------------------------------------------------------------
# Wrong kernels fail, and the message says where and how
# ---------------------------------------------------------------------------------------------


def test_bf16_log_softmax_fails_at_float32_tolerance():
    message = _expect_failure(
        lt.check_logprob_fn,
        lambda z, t: z.bfloat16().log_softmax(-1).gather(-1, t[:, None])[:, 0].float(),
        dtypes=(torch.float32,),
    )
    assert message.startswith("check_logprob_fn, case 'normal', float32: values differ")
    assert "worst at [" in message and "got " in message and "reference " in message


def test_missing_max_shift_fails_on_the_overflow_case_in_float64():
    message = _expect_failure(
        lt.check_logprob_fn,
        lambda z, t: (z - z.exp().sum(-1, keepdim=True).log()).gather(-1, t[:, None])[:, 0],
        dtypes=(F64,),
    )
    assert "case 'scale 1e4'" in message and "got -inf" in message
    assert "unless the row max is subtracted first" in message


def test_right_values_wrong_gradient_fails_on_gradients():
    message = _expect_failure(
        lt.check_logprob_fn,
        lambda z, t: z.gather(-1, t[:, None])[:, 0] - torch.logsumexp(z, -1).detach(),
        dtypes=(F64,),
    )
    assert "gradients differ" in message


def test_entropy_of_the_other_sign_gets_a_hint_and_nan_is_reported():
    message = _expect_failure(lt.check_entropy_fn, lambda z: -(z.softmax(-1) * z.log_softmax(-1)).sum(-1))
    assert "opposite sign" in message
    message = _expect_failure(lt.check_entropy_fn, lambda z: (z.softmax(-1) * z.log_softmax(-1)).sum(-1))
    assert "case '-inf'" in message and "got NaN" in message


def test_forward_kl_is_not_the_reverse_kl():
    forward = lambda s, t: (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1)  # noqa: E731
    assert "values differ" in _expect_failure(lt.check_kl_fn, forward, dtypes=(F64,))


def test_in_place_no_gradient_and_bad_return_are_reported():
    def in_place(z, t):
        out = lossfx.token_logprobs(z.detach().clone(), t)
        z.data.mul_(2)
        return out

    assert "modified its first argument" in _expect_failure(lt.check_logprob_fn, in_place, dtypes=(F64,))
    no_grad = lambda z, t: reference.token_logprobs(z.detach(), t)  # noqa: E731
    assert "no gradient" in _expect_failure(lt.check_logprob_fn, no_grad, dtypes=(F64,))
    assert "not a tensor" in _expect_failure(lt.check_logprob_fn, lambda z, t: 0.0, dtypes=(F64,))
    short = lambda z, t: lossfx.token_logprobs(z, t)[:1]  # noqa: E731
    assert "shape" in _expect_failure(lt.check_logprob_fn, short, dtypes=(F64,))


def test_bad_arguments_raise_value_and_type_errors():
    with pytest.raises(ValueError, match=r"no tolerance for torch\.float16"):
        lt.check_logprob_fn(lossfx.token_logprobs, dtypes=(torch.float16,))
    with pytest.raises(ValueError, match=r"names from lossfx\.testing\.CASES"):
        lt.check_logprob_fn(lossfx.token_logprobs, cases=["nope"])
    with pytest.raises(TypeError, match="callable"):
        lt.check_entropy_fn("entropy")


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(z=lt.logits(max_rows=4, max_vocab=16, dtype=torch.float32, scales=(1e-4, 1.0), ties=True, neg_inf=True))
def test_drawn_logits_check_lossfx_kernels(z):
    """Scales up to 1 here: larger logits hit issue 10 item 1 in float32 (found at 1e4; at 30 the
    rounded `lse` is within 2.5x of the tolerance), see the xfail above."""
    assert z.dtype == torch.float32 and z.dim() == 2 and 1 <= z.shape[0] <= 4 and 1 <= z.shape[1] <= 16
    assert bool(torch.isfinite(z).any(-1).all()), "every row keeps a finite entry"
    lt.check_logprob_fn(lossfx.token_logprobs, z, dtypes=(torch.float32,))


def _sharded_rank(rank, world, group, sharded, target):
    shard = sharded.shard(rank).clone().requires_grad_(True)
    vocab = sharded.logits.shape[-1]
    out = lossfx.token_logprobs(shard, target, group=group, vocab_start=sharded.vocab_starts[rank], vocab_size=vocab)
    out.backward(torch.ones_like(out))
    return out.detach(), shard.grad


@settings(max_examples=12, deadline=None)
@given(sharded=lt.sharded_logits(world_sizes=(1, 2), uneven=True, max_vocab=12, scales=(1.0,), neg_inf=False))
def test_sharded_logits_drive_a_sharded_kernel(sharded):
    z = sharded.logits
    assert sharded.vocab_starts[0] == 0 and sharded.vocab_starts[-1] == z.shape[-1]
    assert torch.equal(torch.cat([sharded.shard(r) for r in range(sharded.world)], -1), z)
    target = torch.randint(0, z.shape[-1], z.shape[:-1], generator=torch.Generator().manual_seed(0))
    results = run_ranks(sharded.world, _sharded_rank, sharded, target)
    x = z.clone().requires_grad_(True)
    want = reference.token_logprobs(x, target)
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(results[0][0], want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat([r[1] for r in results], -1), x.grad, atol=1e-10, rtol=1e-10)


def _widths(sharded):
    return [b - a for a, b in zip(sharded.vocab_starts, sharded.vocab_starts[1:])]


def test_uneven_and_even_splits_are_both_drawn():
    seen: set[tuple[int, bool]] = set()

    @settings(max_examples=80, deadline=None, database=None, derandomize=True)  # the same draws every run
    @given(lt.sharded_logits(world_sizes=(2, 4), max_vocab=9))
    def draw(sharded):
        assert min(_widths(sharded)) >= 1
        seen.add((sharded.world, len(set(_widths(sharded))) > 1))

    draw()
    assert seen == {(2, True), (2, False), (4, True), (4, False)}, seen


@settings(max_examples=10, deadline=None)
@given(lt.sharded_logits(world_sizes=(4,), uneven=False))
def test_even_splits_when_uneven_is_off(sharded):
    assert sharded.logits.shape[-1] % 4 == 0
    assert len({b - a for a, b in zip(sharded.vocab_starts, sharded.vocab_starts[1:])}) == 1


# ---------------------------------------------------------------------------------------------
# hypothesis stays optional; the docs page runs
# ---------------------------------------------------------------------------------------------


def test_import_lossfx_does_not_import_hypothesis_and_checkers_work_without_it():
    code = (
        "import sys\n"
        "sys.modules['hypothesis'] = None  # any import of hypothesis now raises ImportError\n"
        "import lossfx\n"
        "assert 'lossfx.testing' not in sys.modules\n"
        "import lossfx.testing as lt\n"
        "lt.check_logprob_fn(lossfx.token_logprobs, cases=['ties'])\n"
        "try:\n"
        "    lt.logits()\n"
        "except ImportError as err:\n"
        "    assert 'pip install' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('logits() without hypothesis must raise ImportError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr


def test_docs_testing_page_examples_run():
    failures, tried = doctest.testfile(
        str(ROOT / "docs" / "testing.md"), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False
    )
    assert tried >= 6 and failures == 0, f"{failures} of {tried} examples in docs/testing.md failed"
