"""The pure kernels of `lossfx._kernels.divergence` (issue 15: one boundary per public call).

The kernels take plain tensors and the tensor-parallel group, with no validation and no DTensor:
checked here against the float64 reference (values and gradients) on 1 and 2 rank threads, with
even and uneven column splits, eager and (once, small) compiled; and each public function of
`lossfx.divergence` validates once and enters its kernel exactly once.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE, on_device
from harness import compiled_for_rank, run_ranks

import lossfx
import lossfx.divergence as public
from benchmarks.bench_syncs import count_host_reads
from lossfx import reference
from lossfx._boundary import validation
from lossfx._kernels import divergence as kernel

pytestmark = pytest.mark.gpu_check  # the GPU check's subset: `pytest --device cuda -m gpu_check`

F64 = torch.float64
TIGHT = {"rtol": 1e-12, "atol": 1e-12}
KINDS = ("neg_entropy", "cross_entropy_to_fixed", "reverse_kl_to_fixed")
# column splits of V = 11 over 2 ranks: even-ish and uneven (any widths: ids are never mapped)
SPLITS = {1: [(0, 11)], 2: [(0, 6), (6, 11)], 3: [(0, 2), (2, 11)]}


def _data(seed: int, rows: tuple[int, ...] = (3, 4), vocab: int = 11) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(*rows, vocab, generator=gen, dtype=F64) * 3
    teacher = torch.randn(*rows, vocab, generator=gen, dtype=F64) * 3
    student[0, 0, :4] = float("-inf")  # p_s = 0 columns: 0 · log 0 = 0
    dout = torch.randn(rows, generator=gen, dtype=F64)
    return on_device((student, teacher, dout))


def _pure(kind: str, student, teacher, group, chunk_rows=None):
    fn = getattr(kernel, kind)
    if kind == "neg_entropy":
        return fn(student, group, chunk_rows=chunk_rows)
    return fn(student, teacher, group, chunk_rows=chunk_rows)


def _reference(kind: str, student, teacher):
    fn = getattr(reference, kind)
    return fn(student) if kind == "neg_entropy" else fn(student, teacher)


def _rank_pure(rank, world, group, kind, split, student, teacher, dout, chunk_rows):
    start, end = SPLITS[split][rank]
    s = student[..., start:end].clone().requires_grad_()
    out = _pure(kind, s, teacher[..., start:end], group, chunk_rows)
    (grad,) = torch.autograd.grad(out, s, dout)
    return out.detach(), grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "split", "chunk_rows"), [(1, 1, None), (1, 1, 5), (2, 2, 2), (2, 3, None)])
def test_pure_kernel_matches_the_reference(kind, world, split, chunk_rows):
    student, teacher, dout = _data(seed=len(kind) + split)
    dense = student.clone().requires_grad_()
    want = _reference(kind, dense, teacher)
    (want_grad,) = torch.autograd.grad(want, dense, dout)
    for rank, (out, grad) in enumerate(run_ranks(world, _rank_pure, kind, split, student, teacher, dout, chunk_rows)):
        start, end = SPLITS[split][rank]
        torch.testing.assert_close(out, want.detach(), **TIGHT)
        torch.testing.assert_close(grad, want_grad[..., start:end], **TIGHT)


@pytest.mark.parametrize("kind", KINDS)
def test_pure_kernel_no_grad_and_low_precision(kind):
    """bf16 in, fp32 out; without grad nothing is saved and the value is the same."""
    student, teacher, _ = _data(seed=7)
    s16, t16 = student.to(torch.bfloat16), teacher.to(torch.bfloat16)
    want = _reference(kind, s16.to(F64), t16.to(F64))
    with torch.no_grad():
        out = _pure(kind, s16, t16, None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.to(F64), want, rtol=1e-5, atol=1e-5)
    assert out.grad_fn is None


@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_pure_projected_teacher_matches_the_reference(kind):
    gen = torch.Generator().manual_seed(3)
    n, v, h = 7, 11, 4
    student = torch.randn(n, v, generator=gen, dtype=F64).to(DEVICE).requires_grad_()
    hidden = torch.randn(n, h, generator=gen, dtype=F64).to(DEVICE)
    heads = [torch.randn(v, h, generator=gen, dtype=F64).to(DEVICE) for _ in range(2)]
    head = torch.randint(0, 2, (n,), generator=gen).to(DEVICE)
    teacher = torch.stack([hidden[i] @ heads[int(head[i])].T for i in range(n)])  # [n, v]
    out = kernel.divergence_to_projected_teacher(
        kind, student, hidden, heads, head, None, chunk_rows=3, logits_dtype=F64
    )
    dense = student.detach().clone().requires_grad_()
    want = getattr(reference, f"{kind}_to_fixed")(dense, teacher)
    torch.testing.assert_close(out, want, **TIGHT)
    dout = torch.randn(n, generator=gen, dtype=F64).to(DEVICE)
    torch.testing.assert_close(
        torch.autograd.grad(out, student, dout)[0], torch.autograd.grad(want, dense, dout)[0], **TIGHT
    )


@pytest.mark.parametrize("kind", KINDS)
def test_pure_kernel_reads_nothing_on_the_host(kind):
    """Forward and backward of a kernel make no device→host read (the boundary owns them)."""
    student, teacher, dout = _data(seed=11)
    s = student.clone().requires_grad_()
    assert count_host_reads(lambda: torch.autograd.grad(_pure(kind, s, teacher, None, 2), s, dout)) == 0


def test_pure_kernel_compiles_without_graph_break():
    """One small compiled call of each pure kernel (aot_eager: the traced path), compiled once."""
    student, teacher, _ = _data(seed=5)

    def all_three(s, t):
        return torch.stack([_pure(kind, s, t, None) for kind in KINDS])

    counter, compiled = compiled_for_rank(0, "pure_divergence_all_three", all_three, backend="aot_eager")
    s = student.clone().requires_grad_()
    got = compiled(s, teacher)
    dense = student.clone().requires_grad_()
    want = torch.stack([_reference(kind, dense, teacher) for kind in KINDS])
    torch.testing.assert_close(got, want, **TIGHT)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(0), dtype=F64).to(DEVICE)
    torch.testing.assert_close(torch.autograd.grad(got, s, g)[0], torch.autograd.grad(want, dense, g)[0], **TIGHT)
    compiled(student.clone().requires_grad_(), teacher)  # same shapes: no recompile
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------------
# The boundary: one validation, one kernel entry per public call
# ---------------------------------------------------------------------------------------------


def _spy(monkeypatch, owner, name: str, calls: list[str], label: str | None = None) -> None:
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(label or name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


PUBLIC_CALLS = {
    "neg_entropy": (lambda s, t: lossfx.neg_entropy(s), "neg_entropy", 1),
    "entropy": (lambda s, t: lossfx.entropy(s), "neg_entropy", 1),
    "cross_entropy_to_fixed": (lambda s, t: lossfx.cross_entropy_to_fixed(s, t), "cross_entropy_to_fixed", 2),
    "reverse_kl_to_fixed": (lambda s, t: lossfx.reverse_kl_to_fixed(s, t, chunk_rows=2), "reverse_kl_to_fixed", 2),
}


@pytest.mark.filterwarnings("ignore:lossfx.entropy is deprecated:FutureWarning")
@pytest.mark.parametrize("name", sorted(PUBLIC_CALLS))
def test_one_public_call_validates_once_and_enters_its_kernel_once(monkeypatch, name):
    call, kernel_name, float_checks = PUBLIC_CALLS[name]
    calls: list[str] = []
    for fn in ("neg_entropy", "cross_entropy_to_fixed", "reverse_kl_to_fixed", "_divergence", "_divergence_fwd"):
        _spy(monkeypatch, kernel, fn, calls)
    _spy(monkeypatch, public, "check_floating", calls)
    _spy(monkeypatch, validation, "check_ids_in_range", calls)
    for fn in ("neg_entropy", "cross_entropy_to_fixed", "reverse_kl_to_fixed"):
        _spy(monkeypatch, public, fn, calls, label="public " + fn)
    student, teacher, dout = _data(seed=2)
    s = student.clone().requires_grad_()
    out = call(s, teacher)
    out.backward(dout)
    assert calls.count(kernel_name) == 1
    assert calls.count("_divergence") == 1 and calls.count("_divergence_fwd") == 1
    assert len([c for c in calls if c in KINDS]) == 1  # no other kernel entered
    assert calls.count("check_floating") == float_checks  # student (and teacher), once each
    assert calls.count("check_ids_in_range") == 0  # no ids here
    assert not [c for c in calls if c.startswith("public ")]  # no public function calls another
    want = _reference(kernel_name, student, teacher)
    torch.testing.assert_close(out.detach(), want, **TIGHT)


def test_projected_public_call_validates_once_and_enters_its_kernel_once(monkeypatch):
    calls: list[str] = []
    _spy(monkeypatch, kernel, "divergence_to_projected_teacher", calls)
    _spy(monkeypatch, kernel, "_projected_fwd", calls)
    _spy(monkeypatch, public, "check_floating", calls)
    _spy(monkeypatch, public, "check_integer_ids", calls)
    gen = torch.Generator().manual_seed(4)
    student = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    hidden = torch.randn(2, 3, 4, generator=gen, dtype=F64)
    heads = [torch.randn(5, 4, generator=gen, dtype=F64) for _ in range(2)]
    head = torch.randint(0, 2, (2, 3), generator=gen)
    out = public.divergence_to_projected_teacher("reverse_kl", student, hidden, heads, head)
    assert calls.count("divergence_to_projected_teacher") == 1 and calls.count("_projected_fwd") == 1
    assert calls.count("check_floating") == 4  # student, hidden, weights[0], weights[1]
    assert calls.count("check_integer_ids") == 1
    teacher = torch.stack([hidden[i, j] @ heads[int(head[i, j])].T for i in range(2) for j in range(3)])
    torch.testing.assert_close(out, reference.reverse_kl_to_fixed(student, teacher.view(2, 3, 5)), **TIGHT)


def test_public_errors_are_unchanged():
    """The boundary still names the argument (the kernels never validate)."""
    z = torch.randn(2, 5, dtype=F64)
    with pytest.raises(ValueError, match="student and teacher logits must share"):
        lossfx.reverse_kl_to_fixed(z, z[:, :4])
    with pytest.raises(TypeError, match="teacher"):
        lossfx.cross_entropy_to_fixed(z, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="chunk_rows"):
        lossfx.neg_entropy(z, chunk_rows=0)
