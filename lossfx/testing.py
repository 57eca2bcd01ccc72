"""Test your own log-prob, entropy and KL kernels against lossfx's float64 reference.

Checkers (no extra dependency) — each raises `AssertionError` with the case, dtype, quantity and
worst entry on failure, and returns `None` on success:

* `check_logprob_fn(fn)`: `fn(logits [N, V], target [N]) -> log softmax(logits)[target] [N]`;
* `check_entropy_fn(fn)`: `fn(logits [N, V]) -> Σ p log p [N]` (≤ 0: lossfx's sign, `lossfx.entropy`);
* `check_kl_fn(fn)`: `fn(student [N, V], teacher [N, V]) -> KL(p_s ‖ p_t) [N]`, the teacher fixed.

Each runs `fn` on `CASES` (ties, `-inf` entries and targets, scales `1e-4` and `1e4`, an offset of
`1e4`, a 5003-wide vocabulary, a one-column vocabulary; `CASE_NOTES` says what each one catches)
in every dtype of `dtypes`, backpropagates
a fixed random upstream gradient, and compares values and gradients with `lossfx.reference` in
float64, computed on the very (rounded) inputs `fn` saw. It also fails when `fn` modifies its
input, returns NaN where the reference is finite, or gives no gradient. Tolerances: `TOLERANCES`.

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
    "logits",
    "sharded_logits",
]

_F64 = torch.float64

# (atol, rtol) per input dtype: an entry passes when |got − reference| <= atol + rtol·|reference|.
# The reference is computed in float64 from the inputs after their rounding to the dtype, so the
# tolerance measures the kernel's own arithmetic only. Each allows a correct kernel in that dtype
# (a few roundings, a log-sum-exp over up to ~10⁴ columns) with a wide margin, and fails one that
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
        dout = torch.randn(self.rows, generator=gen, dtype=_F64)
        return _Case(self.name, student, target, teacher, dout)


@dataclass(frozen=True)
class _Case:
    name: str
    logits: Tensor  # [N, V] float64 (the student for KL)
    target: Tensor  # [N] int64
    teacher: Tensor  # [N, V] float64
    dout: Tensor  # [N] float64 upstream gradient


# The built-in cases, by name, with what each one catches (printed with a failure).
CASE_NOTES: dict[str, str] = {
    "normal": "8 × 32 standard-normal logits",
    "ties": "few distinct values: tied maxima and tied competitors",
    "-inf": "-inf entries in every row but one finite; row 0's target is -inf",
    "scale 1e4": "exp overflows here unless the row max is subtracted first",
    "scale 1e-4": "near-uniform rows: the log-sum-exp is log V plus tiny terms",
    "offset 1e4": "a constant offset: lse = m + log s formed and then subtracted loses log s to rounding",
    "vocab 5003": "a wide vocabulary that is no multiple of a power of two (block and chunk edges)",
    "vocab 1": "a one-column vocabulary: log-prob 0, entropy 0, zero gradient",
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


def _compare(where: str, quantity: str, got: Tensor, want: Tensor, dtype: torch.dtype, hint: str = "") -> None:
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
    raise _fail(where, message + hint)


def _check(
    checker: str,
    fn: Callable[..., Tensor],
    ref_fn: Callable[..., Tensor],
    with_target: bool,
    with_teacher: bool,
    cases: Sequence[_Case],
    dtypes: Sequence[torch.dtype],
    device: torch.device | str,
    sign_hint: str = "",
) -> None:
    if not callable(fn):
        raise TypeError(f"{checker}: fn must be callable, got {fn!r}")
    for dtype in dtypes:
        if dtype not in TOLERANCES:
            raise ValueError(f"{checker}: no tolerance for {dtype}; dtypes must be among {list(TOLERANCES)}")
    for dtype in dtypes:
        for case in cases:
            where = f"{checker}, case {case.name!r}, {str(dtype).removeprefix('torch.')}"
            note = f"\n  case {case.name!r}: {CASE_NOTES[case.name]}" if case.name in CASE_NOTES else ""
            x = case.logits.to(dtype).to(device).requires_grad_(True)
            args: list[Tensor] = [x]
            if with_target:
                args.append(case.target.to(device))
            if with_teacher:
                args.append(case.teacher.to(dtype).to(device))
            inputs = [a.detach().clone() for a in args]
            out = fn(*args)
            if not isinstance(out, Tensor):
                raise _fail(where, f"fn returned {type(out).__name__}, not a tensor")
            for name, before, after in zip(("first", "second", "third"), inputs, args):
                if not torch.equal(before, after.detach()):
                    raise _fail(where, f"fn modified its {name} argument in place")
            # the reference sees exactly what fn saw: the rounded inputs, upcast exactly
            x_ref = x.detach().cpu().to(_F64).requires_grad_(True)
            ref_args: list[Tensor] = [x_ref]
            if with_target:
                ref_args.append(case.target)
            if with_teacher:
                ref_args.append(args[-1].detach().cpu().to(_F64))
            want = ref_fn(*ref_args)
            hint = ""
            if sign_hint and out.shape == want.shape and torch.allclose(out.detach().cpu().to(_F64), -want):
                hint = "\n  " + sign_hint
            _compare(where, "values", out, want.detach(), dtype, hint + note)
            # gradients, with no upstream gradient where the value is infinite (a loss masks those)
            dout = torch.where(torch.isfinite(want.detach()), case.dout, 0).to(out.dtype).to(out.device)
            if not out.requires_grad:
                raise _fail(where, "no gradient reaches the logits (the output does not require grad)")
            (x_grad,) = torch.autograd.grad(out, x, dout, allow_unused=True)
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
) -> None:
    """Check `fn(logits, target)` = `log_softmax(logits)[..., target]`, values and gradients.

    Equivalent to comparing with ``lossfx.reference.token_logprobs(logits, target)`` on every case
    of `CASES` (or on `logits`/`target` when given) in every dtype of `dtypes`, within
    `TOLERANCES`. A `-inf` reference (a target whose logit is `-inf`) must be returned as `-inf`.

    Args:
        fn: the function under test: `[..., V]` logits in the case dtype, `[...]` int64 target ->
            `[...]` log-probs (any float dtype), differentiable in the logits.
        logits: a float `[..., V]` case of your own instead of `CASES` (e.g. drawn by `logits()`).
        target: `[...]` int64 ids for `logits` (default: seeded random ids).
        cases: names from `CASES` to run (all by default); ignored when tensors are given.
        dtypes: the dtypes the logits are cast to before `fn` sees them.
        device: where `fn` runs; the reference runs on the CPU.

    Raises:
        AssertionError: the first case, dtype and quantity that differ, with the worst entry.

    Example:
        >>> import torch, lossfx.testing
        >>> lossfx.testing.check_logprob_fn(lambda z, t: z.log_softmax(-1).gather(-1, t[..., None])[..., 0])
    """
    chosen = _built_in(cases) if logits is None else [_given_case(logits, target, None)]
    _check("check_logprob_fn", fn, reference.token_logprobs, True, False, chosen, dtypes, device)


def check_entropy_fn(
    fn: Callable[[Tensor], Tensor],
    logits: Tensor | None = None,
    *,
    cases: Sequence[str] = CASES,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    device: torch.device | str = "cpu",
) -> None:
    """Check `fn(logits)` = `Σ p log p` (≤ 0, the sign of `lossfx.entropy`), values and gradients.

    Equivalent to comparing with ``lossfx.reference.entropy(logits)`` on `CASES` (or `logits`) in
    every dtype of `dtypes`, within `TOLERANCES`. For an `H = −Σ p log p` function pass
    ``lambda z: -fn(z)``; a result of the opposite sign says so in the failure.

    Args:
        fn: the function under test: `[..., V]` logits -> `[...]`, differentiable.
        logits: a float `[..., V]` case of your own instead of `CASES`.
        cases: names from `CASES` to run (all by default); ignored when tensors are given.
        dtypes: the dtypes the logits are cast to before `fn` sees them.
        device: where `fn` runs; the reference runs on the CPU.

    Raises:
        AssertionError: the first case, dtype and quantity that differ, with the worst entry.
    """
    chosen = _built_in(cases) if logits is None else [_given_case(logits, None, None)]
    hint = "the values have the opposite sign: lossfx's entropy is Σ p log p (≤ 0); pass lambda z: -fn(z)"
    _check("check_entropy_fn", fn, reference.entropy, False, False, chosen, dtypes, device, hint)


def check_kl_fn(
    fn: Callable[[Tensor, Tensor], Tensor],
    student: Tensor | None = None,
    teacher: Tensor | None = None,
    *,
    cases: Sequence[str] = CASES,
    dtypes: Sequence[torch.dtype] = _DTYPES,
    device: torch.device | str = "cpu",
) -> None:
    """Check `fn(student, teacher)` = `KL(p_s ‖ p_t) = Σ p_s (log p_s − log p_t)`, values and gradients.

    Equivalent to comparing with ``lossfx.reference.reverse_kl_to_fixed(student, teacher)`` on
    `CASES` (or `student`/`teacher`) in every dtype of `dtypes`, within `TOLERANCES`; the
    gradient is the student's (the teacher is a fixed tensor without gradient).

    Args:
        fn: the function under test: `[..., V]` student and teacher logits -> `[...]`,
            differentiable in the student.
        student: a float `[..., V]` case of your own instead of `CASES`.
        teacher: `[..., V]` teacher logits for `student` (default: seeded random logits).
        cases: names from `CASES` to run (all by default); ignored when tensors are given.
        dtypes: the dtypes both logits are cast to before `fn` sees them.
        device: where `fn` runs; the reference runs on the CPU.

    Raises:
        AssertionError: the first case, dtype and quantity that differ, with the worst entry.
    """
    chosen = _built_in(cases) if student is None else [_given_case(student, None, teacher)]
    _check("check_kl_fn", fn, reference.reverse_kl_to_fixed, False, True, chosen, dtypes, device)


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
