"""Test your own log-prob, entropy and KL kernels against lossfx's float64 reference.

Checkers (no extra dependency) — each raises `AssertionError` with the case, dtype, quantity and
worst entry on failure, and returns `None` on success:

* `check_logprob_fn(fn)`: `fn(logits [N, V], target [N]) -> log softmax(logits)[target] [N]`;
* `check_neg_entropy_fn(fn)`: `fn(logits [N, V]) -> Σ p log p [N]` (≤ 0, `lossfx.neg_entropy`;
  `check_entropy_fn` is its deprecated name);
* `check_kl_fn(fn)`: `fn(student [N, V], teacher [N, V]) -> KL(p_s ‖ p_t) [N]`, the teacher fixed;
  `divergence="cross_entropy"` checks `−Σ p_s log p_t` instead (the divergences lossfx ships).

Each runs `fn` on `CASES` (ties, `-inf` entries and targets, scales `1e-4` and `1e4`, an offset of
`1e4`, a 5003-wide and a one-column vocabulary, 65539 rows, a 131075-wide vocabulary with targets
at ids 2^15, 2^16 − 1, 2^16 and V − 1, non-contiguous inputs and upstream gradient; `CASE_NOTES`
says what each one catches) in every dtype of `dtypes`, backpropagates a fixed random upstream
gradient, and compares values and gradients with `lossfx.reference` in float64, computed on the
very (rounded) inputs `fn` saw. It also fails when `fn` returns an output dtype the contract
`out_dtype` does not allow, modifies its input, raises, returns NaN where the reference is
finite, or gives no gradient. Tolerances: `TOLERANCES`.

Strategies (need `hypothesis`, imported only when called): `logits()` draws `[N, V]` logits with
ties, `-inf` entries and extreme scales; `sharded_logits()` also splits the vocabulary over 1, 2 or
4 ranks, unevenly. Docs and examples: docs/testing.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lossfx import reference
from lossfx._boundary.deprecation import warn_renamed

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "CASES",
    "CASE_NOTES",
    "TOLERANCES",
    "ShardedLogits",
    "check_entropy_fn",
    "check_kl_fn",
    "check_logprob_fn",
    "check_neg_entropy_fn",
    "logits",
    "sharded_logits",
]

_F64 = torch.float64

# (atol, rtol) per input dtype: an entry passes when |got − reference| <= atol + rtol·|reference|.
# The reference is computed in float64 from the inputs after their rounding to the dtype, so the
# tolerance measures the kernel's own arithmetic only. Each allows a correct kernel in that dtype
# (a few roundings, a log-sum-exp over up to ~10⁵ columns) with a wide margin, and fails one that
# rounds through the next lower precision even once (`tests/test_testing_module.py` checks both):
#   float64  1e-10: unit roundoff 1.1e-16; one float32 rounding (6e-8 relative) fails it.
#   float32  1e-5:  unit roundoff 6e-8, so ~100 roundings; one bfloat16 rounding (4e-3) fails it.
#   bfloat16 1e-2:  the output or gradient may be rounded to bfloat16 once (≤ 3.9e-3 relative); a
#                   lost max shift (inf/NaN) or a sign error fails it.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
}
_DTYPES = (torch.float64, torch.float32, torch.bfloat16)
_SCALES = (1e-4, 1.0, 30.0, 1e4)  # near-uniform, normal, peaked, exp-overflowing (exp(1e4) = inf)
_MANY_ROWS = 65539  # a prime past 2^16
_WIDE_VOCAB = 131075  # past 2^17


# ---------------------------------------------------------------------------------------------
# Cases: small parameters, values materialised from a seed in float64
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """What a case is made of; `make()` turns it into float64 tensors (reproducible from the seed)."""

    name: str
    rows: int
    vocab: int
    scale: float = 1.0
    offset: float = 0.0
    ties: bool = False
    neg_inf: bool = False
    seed: int = 0
    peaks: tuple[int, ...] = ()  # the targets of the first rows, whose logits are set to `peak`
    peak: float = 0.0
    strided: bool = False  # fn sees non-contiguous views (`_strided`)

    def _draw(self, gen: torch.Generator) -> Tensor:
        shape = (self.rows, self.vocab)
        if self.ties:  # three distinct values: tied maxima and tied competitors
            x = torch.randint(0, 3, shape, generator=gen).to(_F64)
        else:
            x = torch.randn(shape, generator=gen, dtype=_F64)
        return x * self.scale + self.offset

    def make(self) -> _Case:
        gen = torch.Generator().manual_seed(self.seed)
        student, teacher = self._draw(gen), self._draw(gen)
        target = torch.randint(0, self.vocab, (self.rows,), generator=gen)
        if self.neg_inf and self.vocab > 1:
            masked = torch.rand(self.rows, self.vocab, generator=gen) < 0.4
            masked[torch.arange(self.rows), torch.randint(0, self.vocab, (self.rows,), generator=gen)] = False
            student = student.masked_fill(masked, float("-inf"))  # every row keeps a finite entry
            # the teacher is -inf only where the student is too, so KL(student ‖ teacher) stays finite
            teacher = teacher.masked_fill(masked & (torch.rand(masked.shape, generator=gen) < 0.5), float("-inf"))
            target[0] = int(masked[0].nonzero()[0, 0]) if masked[0].any() else target[0]  # a -inf target
        if self.peaks:  # about half of these rows' mass (student and teacher) sits on the probed ids
            rows, ids = torch.arange(len(self.peaks)), torch.tensor(self.peaks)
            target[rows] = ids
            student[rows, ids] = teacher[rows, ids] = self.peak
        dout = torch.randn(self.rows, generator=gen, dtype=_F64)
        return _Case(self.name, student, target, teacher, dout, self.strided)


@dataclass(frozen=True)
class _Case:
    name: str
    logits: Tensor  # [N, V] float64 (the student for KL)
    target: Tensor  # [N] int64
    teacher: Tensor  # [N, V] float64
    dout: Tensor  # [N] float64 upstream gradient
    strided: bool = False


def _strided(t: Tensor, fill: float) -> Tensor:
    """A non-contiguous copy of `t` (`[N]` or `[N, V]`): every other element of a larger buffer,
    at storage offset 1, `[N, V]` also column-major; the rest of the buffer holds `fill` (NaN, an
    out-of-range id), so a kernel that assumes contiguous strides reads it."""
    if t.dim() == 1:
        view = t.new_full((2 * t.shape[0] + 1,), fill)[1::2]
    else:
        view = t.new_full((t.shape[1], 2 * t.shape[0] + 1), fill)[:, 1::2].t()
    return view.copy_(t)


# The built-in cases, by name, with what each one catches (printed with a failure).
_RARE_IDS = (_WIDE_VOCAB - 1, 2**16, 2**16 - 1, 2**15, 5003, 5002)
CASE_NOTES: dict[str, str] = {
    "normal": "8 × 32 standard-normal logits",
    "ties": "few distinct values: tied maxima and tied competitors",
    "-inf": "-inf entries in every row but one finite; row 0's target is -inf",
    "scale 1e4": "exp overflows here unless the row max is subtracted first",
    "scale 1e-4": "near-uniform rows: the log-sum-exp is log V plus tiny terms",
    "offset 1e4": "a constant offset: lse = m + log s formed and then subtracted loses log s to rounding",
    "vocab 5003": "a wide vocabulary that is no multiple of a power of two (block and chunk edges)",
    "vocab 1": "a one-column vocabulary: log-prob 0, entropy 0, zero gradient",
    f"rows {_MANY_ROWS}": (
        f"{_MANY_ROWS} rows (a prime past 2^16) × 17: more rows than any row chunk, block or grid"
        " dimension, so every chunking leaves a partial last chunk"
    ),
    f"vocab {_WIDE_VOCAB}": (
        f"6 rows × {_WIDE_VOCAB} (past 2^17): targets {list(_RARE_IDS)}, each holding about half"
        " of its row's mass (student and teacher): 16-bit ids, vocabulary blocks and tables that stop early"
    ),
    "strided": (
        "non-contiguous inputs and upstream gradient (every other element, storage offset 1, the logits"
        " column-major; NaN / out-of-range ids in between): kernels that assume contiguous strides"
    ),
}
CASES: tuple[str, ...] = tuple(CASE_NOTES)
_SPECS = (
    _Spec("normal", 8, 32, seed=1),
    _Spec("ties", 8, 32, ties=True, seed=2),
    _Spec("-inf", 8, 32, neg_inf=True, seed=3),
    _Spec("scale 1e4", 8, 32, scale=1e4, seed=4),
    _Spec("scale 1e-4", 8, 32, scale=1e-4, seed=5),
    _Spec("offset 1e4", 8, 32, offset=1e4, seed=6),
    _Spec("vocab 5003", 2, 5003, scale=3.0, seed=7),
    _Spec("vocab 1", 3, 1, seed=8),
    _Spec(f"rows {_MANY_ROWS}", _MANY_ROWS, 17, scale=3.0, seed=9),
    # log V ≈ 11.8 plus the normal spread: a peak of 12.5 holds about half of the row's mass
    _Spec(f"vocab {_WIDE_VOCAB}", len(_RARE_IDS), _WIDE_VOCAB, peaks=_RARE_IDS, peak=12.5, seed=10),
    _Spec("strided", 13, 40, scale=3.0, neg_inf=True, strided=True, seed=11),
)


def _built_in(names: Sequence[str]) -> list[_Case]:
    if isinstance(names, str) or not set(names) <= set(CASE_NOTES):
        raise ValueError(f"cases must be names from lossfx.testing.CASES {list(CASES)}; got {names!r}")
    return [spec.make() for spec in _SPECS if spec.name in names]


def _given_case(logits: Tensor, target: Tensor | None, teacher: Tensor | None) -> _Case:
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"logits must be a floating-point tensor [..., V], got {logits!r}")
    gen = torch.Generator().manual_seed(0)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    if target is None:
        target = torch.randint(0, vocab, lead, generator=gen)
    if teacher is None:
        teacher = torch.randn(logits.shape, generator=gen, dtype=_F64)
    dout = torch.randn(lead, generator=gen, dtype=_F64)
    return _Case("given", logits.detach().cpu().to(_F64), target.cpu(), teacher.detach().cpu().to(_F64), dout)


# ---------------------------------------------------------------------------------------------
# Comparison with a readable diff
# ---------------------------------------------------------------------------------------------


def _fail(where: str, message: str) -> AssertionError:
    return AssertionError(f"{where}: {message}")


def _compare(where: str, quantity: str, got: Tensor, want: Tensor, dtype: torch.dtype, note: str = "") -> None:
    """Raise when `got` (any dtype) differs from the float64 `want` beyond `TOLERANCES[dtype]`."""
    atol, rtol = TOLERANCES[dtype]
    if tuple(got.shape) != tuple(want.shape):
        raise _fail(where, f"{quantity} have shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
    got = got.detach().cpu().to(_F64)
    finite = torch.isfinite(want)
    # non-finite reference entries (-inf log-probs) must be reproduced exactly; finite ones closely
    allowed = atol + rtol * want.abs().where(finite, 0)
    ok = torch.where(finite, (got - want).abs() <= allowed, got == want)
    if bool(ok.all()):
        return
    diff = (got - want).abs().where(finite, float("inf")).nan_to_num(nan=float("inf"))
    worst = tuple(int(i) for i in torch.nonzero(~ok & (diff == diff[~ok].max()))[0])
    g, w = float(got[worst]), float(want[worst])
    detail = f"|diff| {abs(g - w):.3g} > allowed {float(allowed[worst]):.3g}" if finite[worst] else "not equal"
    message = (
        f"{quantity} differ from lossfx.reference (float64) in {int((~ok).sum())} of {ok.numel()} entries "
        f"(atol={atol:g}, rtol={rtol:g} for {str(dtype).removeprefix('torch.')})\n"
        f"  worst at {list(worst)}: got {g!r}, reference {w!r} ({detail})"
    )
    if bool(torch.isnan(got).any()):
        message += f"\n  got NaN in {int(torch.isnan(got).sum())} entries"
    raise _fail(where, message + note)


# A formula someone may have meant instead, and what to say when `fn` computes exactly that.
_Lookalike = tuple[Callable[..., Tensor], str]

_OUT_DTYPES = ("either", "input", "promoted")


def _allowed_out_dtypes(dtype: torch.dtype, out_dtype: str) -> tuple[torch.dtype, ...]:
    """The output dtypes `out_dtype` allows for logits of `dtype`."""
    promoted = torch.promote_types(dtype, torch.float32)  # lossfx's contract: bf16 -> fp32
    return {"input": (dtype,), "promoted": (promoted,), "either": tuple({dtype: 0, promoted: 0})}[out_dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _call(where: str, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, with an exception of the kernel under test reported against the case."""
    try:
        return call(*args, **kwargs)
    except Exception as err:
        raise _fail(where, f"{what} raised {type(err).__name__}: {err}") from err


@dataclass(frozen=True)
class _Checker:
    """What one checker compares: `fn`'s arguments, the reference, the output dtype contract."""

    name: str
    ref_fn: Callable[..., Tensor]
    with_target: bool
    with_teacher: bool
    out_dtype: str
    lookalikes: Sequence[_Lookalike] = ()


def _check(
    checker: _Checker,
    fn: Callable[..., Tensor],
    cases: Sequence[_Case],
    dtypes: Sequence[torch.dtype],
    device: torch.device | str,
) -> None:
    if not callable(fn):
        raise TypeError(f"{checker.name}: fn must be callable, got {fn!r}")
    for dtype in dtypes:
        if dtype not in TOLERANCES:
            raise ValueError(f"{checker.name}: no tolerance for {dtype}; dtypes must be among {list(TOLERANCES)}")
    if checker.out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{checker.name}: out_dtype must be one of {list(_OUT_DTYPES)}, got {checker.out_dtype!r}")
    for dtype in dtypes:
        for case in cases:
            _check_case(checker, fn, case, dtype, device)


def _check_case(checker: _Checker, fn: Callable[..., Tensor], case: _Case, dtype: torch.dtype, device: Any) -> None:
    """Run `fn` on one case in one dtype and compare values and gradients with the reference."""
    where = f"{checker.name}, case {case.name!r}, {_dtype_name(dtype)}"
    note = f"\n  case {case.name!r}: {CASE_NOTES[case.name]}" if case.name in CASE_NOTES else ""

    def lay_out(t: Tensor, fill: float) -> Tensor:
        return _strided(t, fill) if case.strided else t

    x = lay_out(case.logits.to(dtype).to(device), float("nan")).requires_grad_(True)
    args: list[Tensor] = [x]
    if checker.with_target:
        args.append(lay_out(case.target.to(device), case.logits.shape[-1]))
    if checker.with_teacher:
        args.append(lay_out(case.teacher.to(dtype).to(device), float("nan")))
    inputs = [a.detach().clone() for a in args]
    out = _call(where, "fn", fn, *args)
    if not isinstance(out, Tensor):
        raise _fail(where, f"fn returned {type(out).__name__}, not a tensor")
    for name, before, after in zip(("first", "second", "third"), inputs, args):
        if not torch.equal(before, after.detach()):
            raise _fail(where, f"fn modified its {name} argument in place")
    allowed = _allowed_out_dtypes(dtype, checker.out_dtype)
    if out.dtype not in allowed:
        names = " or ".join(_dtype_name(d) for d in allowed)
        message = f"fn returned {_dtype_name(out.dtype)} for {_dtype_name(dtype)} logits"
        raise _fail(where, f"{message}; out_dtype={checker.out_dtype!r} allows {names}")
    # the reference sees exactly what fn saw: the rounded inputs, upcast exactly
    x_ref = x.detach().cpu().to(_F64).requires_grad_(True)
    ref_args: list[Tensor] = [x_ref]
    if checker.with_target:
        ref_args.append(case.target)
    if checker.with_teacher:
        ref_args.append(args[-1].detach().cpu().to(_F64))
    want = checker.ref_fn(*ref_args)
    try:
        _compare(where, "values", out, want.detach(), dtype)
    except AssertionError as err:  # say so when fn computes a known other formula
        got = out.detach().cpu().to(_F64)
        for formula, message in checker.lookalikes:
            other = formula(*(a.detach() for a in ref_args))
            if got.shape == other.shape and torch.allclose(got, other, equal_nan=True):
                raise AssertionError(f"{err}\n  {message}{note}") from None
        raise AssertionError(f"{err}{note}") from None
    # gradients, with no upstream gradient where the value is infinite (a loss masks those)
    dout = torch.where(torch.isfinite(want.detach()), case.dout, 0).to(out.dtype).to(out.device)
    if not out.requires_grad:
        raise _fail(where, "no gradient reaches the logits (the output does not require grad)")
    (x_grad,) = _call(
        where, "the backward of fn", torch.autograd.grad, out, x, lay_out(dout, float("nan")), allow_unused=True
    )
    if x_grad is None:
        raise _fail(where, "no gradient reaches the logits")
    (want_grad,) = torch.autograd.grad(want, x_ref, dout.cpu().to(_F64))
    _compare(where, "gradients", x_grad, want_grad, dtype, note)


def check_logprob_fn(
    fn: Callable[[Tensor, Tensor], Tensor],
    logits: Tensor | None = None,
    target: Tensor | None = None,
    *,
    cases: Sequence[str] = CASES,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    device: torch.device | str = "cpu",
    out_dtype: str = "either",
) -> None:
    """Check `fn(logits, target)` = `log_softmax(logits)[..., target]`, values and gradients.

    Equivalent to comparing with ``lossfx.reference.token_logprobs(logits, target)`` on every case
    of `CASES` (or on `logits`/`target` when given) in every dtype of `dtypes`, within
    `TOLERANCES`. A `-inf` reference (a target whose logit is `-inf`) must be returned as `-inf`.

    Args:
        fn: the function under test: `[..., V]` logits in the case dtype, `[...]` int64 target ->
            `[...]` log-probs, differentiable in the logits.
        logits: a float `[..., V]` case of your own instead of `CASES` (e.g. drawn by `logits()`).
        target: `[...]` int64 ids for `logits` (default: seeded random ids).
        cases: names from `CASES` to run (all by default); ignored when tensors are given.
        dtypes: the dtypes the logits are cast to before `fn` sees them.
        device: where `fn` runs; the reference runs on the CPU.
        out_dtype: the dtype contract of the output: `"input"` (the logits' dtype, as
            `torch.log_softmax`), `"promoted"` (`torch.promote_types(dtype, float32)`, lossfx's:
            bf16 -> fp32) or `"either"` of the two.

    Raises:
        AssertionError: the first case, dtype and quantity that differ, with the worst entry (or
            the wrong output dtype, an in-place change, an exception raised by `fn`).

    Example:
        >>> import torch, lossfx.testing
        >>> lossfx.testing.check_logprob_fn(lambda z, t: z.log_softmax(-1).gather(-1, t[..., None])[..., 0])
    """
    chosen = _built_in(cases) if logits is None else [_given_case(logits, target, None)]
    checker = _Checker("check_logprob_fn", reference.token_logprobs, True, False, out_dtype)
    _check(checker, fn, chosen, dtypes, device)


def check_neg_entropy_fn(
    fn: Callable[[Tensor], Tensor],
    logits: Tensor | None = None,
    *,
    cases: Sequence[str] = CASES,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    device: torch.device | str = "cpu",
    out_dtype: str = "either",
) -> None:
    """Check `fn(logits)` = `Σ p log p` (≤ 0, `lossfx.neg_entropy`), values and gradients.

    Equivalent to comparing with ``lossfx.reference.neg_entropy(logits)`` on `CASES` (or `logits`) in
    every dtype of `dtypes`, within `TOLERANCES`. For an `H = −Σ p log p` function pass
    ``lambda z: -fn(z)``; a result of the opposite sign says so in the failure.

    Args:
        fn: the function under test: `[..., V]` logits -> `[...]`, differentiable.
        logits: a float `[..., V]` case of your own instead of `CASES`.
        cases: names from `CASES` to run (all by default); ignored when tensors are given.
        dtypes: the dtypes the logits are cast to before `fn` sees them.
        device: where `fn` runs; the reference runs on the CPU.
        out_dtype: `"input"`, `"promoted"` or `"either"`, as in `check_logprob_fn`.

    Raises:
        AssertionError: the first case, dtype and quantity that differ, with the worst entry.
    """
    chosen = _built_in(cases) if logits is None else [_given_case(logits, None, None)]
    hint = "the values have the opposite sign: check_neg_entropy_fn checks Σ p log p (≤ 0); pass lambda z: -fn(z)"
    lookalikes: list[_Lookalike] = [(lambda z: -reference.neg_entropy(z), hint)]
    checker = _Checker("check_neg_entropy_fn", reference.neg_entropy, False, False, out_dtype, lookalikes)
    _check(checker, fn, chosen, dtypes, device)


def check_entropy_fn(fn: Callable[[Tensor], Tensor], logits: Tensor | None = None, **kwargs: Any) -> None:
    """Deprecated name of `check_neg_entropy_fn` (the same check of `Σ p log p` ≤ 0; a FutureWarning).

    Equivalent to ``check_neg_entropy_fn(fn, logits, **kwargs)``.

    Args:
        fn: the function under test, as in `check_neg_entropy_fn`.
        logits: a case of your own, as in `check_neg_entropy_fn`.
        kwargs: `cases`, `dtypes`, `device`, `out_dtype` of `check_neg_entropy_fn`.
    """
    warn_renamed("lossfx.testing.check_entropy_fn", "lossfx.testing.check_neg_entropy_fn")
    check_neg_entropy_fn(fn, logits, **kwargs)


def _forward_kl(student: Tensor, teacher: Tensor) -> Tensor:
    """`KL(p_t ‖ p_s) = Σ p_t log p_t − Σ p_t log p_s` (values only: a lookalike, not a reference)."""
    return reference.neg_entropy(teacher) + reference.cross_entropy_to_fixed(teacher, student)


# the divergences lossfx ships (the entropy has its own checker), and one it does not, as a lookalike
_DIVERGENCES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "reverse_kl": reference.reverse_kl_to_fixed,
    "cross_entropy": reference.cross_entropy_to_fixed,
}
_KL_LOOKALIKES = {**_DIVERGENCES, "forward KL(p_t ‖ p_s)": _forward_kl}


def check_kl_fn(
    fn: Callable[[Tensor, Tensor], Tensor],
    student: Tensor | None = None,
    teacher: Tensor | None = None,
    *,
    cases: Sequence[str] = CASES,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    device: torch.device | str = "cpu",
    divergence: str = "reverse_kl",
    out_dtype: str = "either",
) -> None:
    """Check `fn(student, teacher)` against a student/teacher divergence lossfx ships, values and gradients.

    `divergence="reverse_kl"` (default): `KL(p_s ‖ p_t) = Σ p_s (log p_s − log p_t)`, compared with
    ``lossfx.reference.reverse_kl_to_fixed(student, teacher)``; `divergence="cross_entropy"`:
    `−Σ p_s log p_t`, compared with ``lossfx.reference.cross_entropy_to_fixed``. On `CASES` (or
    `student`/`teacher`) in every dtype of `dtypes`, within `TOLERANCES`; the gradient is the
    student's (the teacher is a fixed tensor without gradient). A result that is another of these
    divergences, or the forward KL `KL(p_t ‖ p_s)`, says so in the failure. For the entropy use
    `check_neg_entropy_fn`.

    Args:
        fn: the function under test: `[..., V]` student and teacher logits -> `[...]`,
            differentiable in the student.
        student: a float `[..., V]` case of your own instead of `CASES`.
        teacher: `[..., V]` teacher logits for `student` (default: seeded random logits).
        cases: names from `CASES` to run (all by default); ignored when tensors are given.
        dtypes: the dtypes both logits are cast to before `fn` sees them.
        device: where `fn` runs; the reference runs on the CPU.
        divergence: `"reverse_kl"` or `"cross_entropy"`.
        out_dtype: `"input"`, `"promoted"` or `"either"`, as in `check_logprob_fn`.

    Raises:
        AssertionError: the first case, dtype and quantity that differ, with the worst entry.
    """
    if divergence not in _DIVERGENCES:
        raise ValueError(f"check_kl_fn: divergence must be one of {list(_DIVERGENCES)}, got {divergence!r}")
    lookalikes: list[_Lookalike] = [
        (formula, f"the values are the {name}; lossfx ships {' and '.join(map(repr, _DIVERGENCES))}")
        if name not in _DIVERGENCES
        else (formula, f"the values are the {name}: pass divergence={name!r} if fn is meant to compute that")
        for name, formula in _KL_LOOKALIKES.items()
        if name != divergence
    ]
    chosen = _built_in(cases) if student is None else [_given_case(student, None, teacher)]
    _check(
        _Checker("check_kl_fn", _DIVERGENCES[divergence], False, True, out_dtype, lookalikes),
        fn,
        chosen,
        dtypes,
        device,
    )


# ---------------------------------------------------------------------------------------------
# Hypothesis strategies (hypothesis is imported only here, when a strategy is built)
# ---------------------------------------------------------------------------------------------


def _hypothesis_strategies() -> Any:
    try:
        from hypothesis import strategies
    except ImportError as err:  # exercised by a subprocess in tests/test_testing_module.py
        raise ImportError(
            "lossfx.testing's strategies need hypothesis: pip install 'lossfx[test]' (or hypothesis)"
        ) from err
    return strategies


def logits(
    *,
    max_rows: int = 8,
    max_vocab: int = 64,
    dtype: torch.dtype = torch.float64,
    scales: Sequence[float] = _SCALES,
    ties: bool = True,
    neg_inf: bool = True,
) -> SearchStrategy[Tensor]:
    """A hypothesis strategy of `[N, V]` logits (`1 <= N <= max_rows`, `1 <= V <= max_vocab`).

    Draws small parameters (shape, scale from `scales`, ties, `-inf` entries, a seed) and builds the
    values from the seed in float64, then casts to `dtype`: failures shrink to small, readable cases.
    With `neg_inf`, some rows have `-inf` entries (every row keeps a finite one).

    Args:
        max_rows, max_vocab: upper bounds of `N` and `V`.
        dtype: the dtype of the drawn logits.
        scales: multipliers of the standard-normal values (`1e4` overflows `exp` without a max shift).
        ties: also draw logits with few distinct values (tied maxima).
        neg_inf: also draw `-inf` entries.
    """
    st = _hypothesis_strategies()
    specs = st.builds(
        _Spec,
        name=st.just("drawn"),
        rows=st.integers(1, max_rows),
        vocab=st.integers(1, max_vocab),
        scale=st.sampled_from(list(scales)),
        ties=st.booleans() if ties else st.just(False),
        neg_inf=st.booleans() if neg_inf else st.just(False),
        seed=st.integers(0, 2**16),
    )
    return specs.map(lambda spec: spec.make().logits.to(dtype))


@dataclass(frozen=True)
class ShardedLogits:
    """Full `[N, V]` logits and their split over `world` ranks along the vocabulary.

    Rank `r` holds columns `[vocab_starts[r], vocab_starts[r + 1])` (`shard(r)`); pass
    `vocab_start=vocab_starts[r]`, `vocab_size=V` to a lossfx kernel for uneven shards.
    """

    logits: Tensor
    vocab_starts: tuple[int, ...]  # world + 1 boundaries: 0, ..., V

    @property
    def world(self) -> int:
        return len(self.vocab_starts) - 1

    def shard(self, rank: int) -> Tensor:
        """`[N, Vl_r]` rank `rank`'s columns (a view)."""
        start, end = self.vocab_starts[rank], self.vocab_starts[rank + 1]
        return self.logits[..., start:end]


def sharded_logits(
    *, world_sizes: Sequence[int] = (1, 2, 4), uneven: bool = True, **logits_kwargs: Any
) -> SearchStrategy[ShardedLogits]:
    """A hypothesis strategy of `ShardedLogits`: `logits(**logits_kwargs)` split over a drawn world size.

    Args:
        world_sizes: the tensor-parallel sizes to draw from (`V >= world` is ensured).
        uneven: also draw uneven splits (every shard keeps at least one column); otherwise `V` is a
            multiple of the world size and the shards are equal.
        logits_kwargs: passed to `logits()`.
    """
    st = _hypothesis_strategies()

    @st.composite
    def draw(draw_fn):
        world = draw_fn(st.sampled_from(list(world_sizes)))
        z = draw_fn(logits(**logits_kwargs))
        vocab = z.shape[-1]
        if vocab < world:  # widen by repeating columns (ties across shards, a hard case anyway)
            z = z.repeat(1, -(-world // vocab))[:, :world] if vocab else z
            vocab = world
        if world > 1 and uneven and draw_fn(st.booleans()):
            cuts = draw_fn(st.lists(st.integers(1, vocab - 1), min_size=world - 1, max_size=world - 1, unique=True))
            starts = (0, *sorted(cuts), vocab)
        else:
            vocab -= vocab % world
            z = z[:, :vocab]
            starts = tuple(r * vocab // world for r in range(world + 1))
        return ShardedLogits(z, starts)

    return draw()
