"""The pure filtering kernel (`lossfx._kernels.filtering`) against the float64 reference, and the
boundary of `lossfx.filtering`: one public call validates once and enters its pure kernel once.

The kernel takes already-validated arguments and a `VocabRange`; these tests give it the shards of
1 and 2 ranks (rank threads, `tests/harness.py`), equal and uneven, and compare values and
gradients with `lossfx.reference` on the dense float64 logits.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from devices import DEVICE, on_device
from harness import run_ranks

import lossfx
import lossfx._boundary.validation as validation
from lossfx import filtering, logprobs, reference
from lossfx._core.vocab import VocabRange
from lossfx._kernels import filtering as kernel

pytestmark = pytest.mark.gpu_check  # the GPU check's subset: `pytest --device cuda -m gpu_check`

F64 = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-10}
# (top_k, top_p, strategy, ties): top-k alone, top-p alone, both, both tie rules, both strategies
CASES = [
    (3, 1.0, "auto", "together"),
    (None, 0.7, "auto", "together"),
    (5, 0.8, "candidates", "together"),
    (5, 0.8, "bisection", "sorted"),
    (None, 0.6, "bisection", "sorted"),
    (4, 0.5, "candidates", "sorted"),
]


def _logits(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[rows, V]` float64 logits with ties (so tie groups sit at the boundary) and targets."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.randn(rows, vocab, generator=gen).round()
    z = torch.randint(0, 5, (rows, vocab), generator=gen).to(F64) + 0.3 * steps
    z[0, 2] = float("-inf")
    return on_device((z, torch.randint(0, vocab, (rows,), generator=gen)))


def _splits(world: int, vocab: int, uneven: bool) -> list[tuple[int, int]]:
    if world == 1:
        return [(0, vocab)]
    cut = vocab // 2 + (1 if uneven else 0)
    return [(0, cut), (cut, vocab)]


def _rank_pure(rank, world, group, z, target, dout, splits, top_k, top_p, strategy, ties):
    start, end = splits[rank]
    vocab = VocabRange(group, start, z.shape[-1]) if world > 1 else VocabRange.whole(z.shape[-1])
    shard = z[:, start:end].clone().requires_grad_(True)
    out = kernel.filtered_token_logprobs(shard, target, vocab, top_k=top_k, top_p=top_p, strategy=strategy, ties=ties)
    (grad,) = torch.autograd.grad(out, shard, dout)
    found = kernel.top_k_top_p_threshold(shard, vocab, top_k=top_k, top_p=top_p, strategy=strategy, ties=ties)
    filtered, keep = kernel.apply_top_k_top_p(shard, vocab, top_k=top_k, top_p=top_p, ties=ties)
    (grad_filtered,) = torch.autograd.grad(filtered, shard, torch.ones_like(filtered))
    return out.detach(), grad, found, filtered.detach(), keep, grad_filtered


@pytest.mark.parametrize("world,uneven", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("top_k,top_p,strategy,ties", CASES)
def test_pure_kernels_match_the_reference(world, uneven, top_k, top_p, strategy, ties):
    """Values and gradients of the three pure kernels, float64, 1 and 2 ranks, uneven shards."""
    z, target = _logits(6, 13, seed=world + 10 * uneven + (top_k or 0))
    dout = torch.randn(target.shape, generator=torch.Generator().manual_seed(3), dtype=F64).to(DEVICE)
    z_ref = z.clone().requires_grad_(True)
    want = reference.filtered_token_logprobs(z_ref, target, top_k, top_p, ties)
    (want_grad,) = torch.autograd.grad(want, z_ref, dout)
    want_filtered, want_keep = reference.apply_top_k_top_p(z, top_k, top_p, ties)
    splits = _splits(world, z.shape[-1], uneven)
    results = run_ranks(world, _rank_pure, z, target, dout, splits, top_k, top_p, strategy, ties)
    for out, *_ in results:
        torch.testing.assert_close(out, want.detach(), **TOL)
    for (start, end), (_, grad, found, filtered, keep, grad_filtered) in zip(splits, results, strict=True):
        torch.testing.assert_close(grad, want_grad[:, start:end], **TOL)
        assert torch.equal(keep, want_keep[:, start:end])
        assert torch.equal(filtered, want_filtered[:, start:end])
        assert torch.equal(grad_filtered, keep.to(F64))  # grad · keep
        tau, cut = (found, None) if ties == "together" else found
        ids = torch.arange(start, end, device=DEVICE)
        kept = (z[:, start:end] >= tau[:, None]) if cut is None else (z[:, start:end] > tau[:, None])
        if cut is not None:
            kept |= (z[:, start:end] == tau[:, None]) & (ids >= cut[:, None])
        assert torch.equal(kept, keep)


def test_pure_kernel_compiles_without_graph_breaks():
    """The pure log-prob kernel traces as one graph (`fullgraph=True`) and matches the reference."""
    z, target = _logits(4, 11, seed=5)
    vocab = VocabRange.whole(z.shape[-1])

    def fn(x, t):
        return kernel.filtered_token_logprobs(x, t, vocab, top_k=4, top_p=0.8, ties="sorted")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    want = reference.filtered_token_logprobs(z, target, 4, 0.8, "sorted")
    torch.testing.assert_close(compiled(z, target), want, **TOL)


# ---------------------------------------------------------------------------------------------
# The boundary: once per public call
# ---------------------------------------------------------------------------------------------

_PUBLIC = ("top_k_top_p_threshold", "apply_top_k_top_p", "filtered_token_logprobs")


def _count(monkeypatch) -> Counter:
    """Count, per thread, the pure kernels entered, the public functions re-entered, and the
    range checks of ids (wherever they are looked up from)."""
    counts: Counter = Counter()
    lock = threading.Lock()

    def counting(key, fn):
        def wrapped(*args, **kwargs):
            with lock:
                counts[(threading.get_ident(), *key)] += 1
            return fn(*args, **kwargs)

        return wrapped

    for name in _PUBLIC:
        monkeypatch.setattr(kernel, name, counting(("kernel", name), getattr(kernel, name)))
        monkeypatch.setattr(filtering, name, counting(("public", name), getattr(filtering, name)))
    check = counting(("range check", "ids"), validation.check_ids_in_range)
    monkeypatch.setattr(validation, "check_ids_in_range", check)
    monkeypatch.setattr(logprobs, "check_ids_in_range", check)  # the ids check the logits faces share
    return counts


def _calls(z, target, group=None, start=None, size=None):
    span = {"group": group, "vocab_start": start, "vocab_size": size}
    return {
        "top_k_top_p_threshold": lambda: lossfx.top_k_top_p_threshold(z, top_k=3, top_p=0.8, ties="sorted", **span),
        "apply_top_k_top_p": lambda: lossfx.apply_top_k_top_p(z, top_k=3, top_p=0.8, **span),
        "filtered_token_logprobs": lambda: lossfx.filtered_token_logprobs(z, target, top_k=3, top_p=0.8, **span),
    }


def _rank_counts(rank, world, group, z, target, splits, name):
    start, end = splits[rank]
    _calls(z[:, start:end], target, group, start, z.shape[-1])[name]()
    return threading.get_ident()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", _PUBLIC)
def test_one_public_call_enters_its_kernel_once_and_checks_ids_once(monkeypatch, world, name):
    """No public function calls another public function; its pure kernel runs once per call (the
    pure `apply_top_k_top_p` finds its thresholds with the pure threshold kernel), and the targets
    are range-checked once (the other two take no ids)."""
    z, target = _logits(4, 12, seed=1)
    counts = _count(monkeypatch)
    if world == 1:
        _calls(z, target)[name]()
        threads = [threading.get_ident()]
    else:
        threads = run_ranks(world, _rank_counts, z, target, _splits(world, 12, uneven=True), name)
    kernels = {name: 1, "top_k_top_p_threshold": 1} if name == "apply_top_k_top_p" else {name: 1}
    for thread in threads:
        mine = {(kind, what): n for (t, kind, what), n in counts.items() if t == thread}
        assert {what: n for (kind, what), n in mine.items() if kind == "kernel"} == kernels, mine
        assert not [what for kind, what in mine if kind == "public"], mine  # no public function re-entered
        assert mine.get(("range check", "ids"), 0) == (1 if name == "filtered_token_logprobs" else 0), mine
