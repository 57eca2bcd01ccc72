"""The pure next-token pipeline (`lossfx._layouts.next_token`) against the float64 reference, and
the boundary of its public faces (`lossfx.next_token`, `lossfx.next_token_logprobs`,
`prepare_loss_input(LOGPROB)`): one public call validates once, range-checks its ids once, calls
no other public function and enters the pure pipeline once (twice for `LOGPROB` with a filter and a
reference-KL term: the filtered and the unfiltered log-probs).

Sections: 1 values and gradients (plain, TP, CP, an uneven `VocabRange`, a filter, padding-free
rows, `ignore_index`), 2 the boundary counts (1 and 2 rank threads, a real gloo pair), 3 one
compiled pure call.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from harness import mesh_groups, run_ranks

import lossfx
from lossfx import reference
from lossfx._core import host_reads
from lossfx._core.vocab import VocabRange
from lossfx._kernels import filtering as kernel_filtering
from lossfx._kernels import logprobs as kernel_logprobs
from lossfx._layouts import next_token as pure
from lossfx._layouts.sequence_layout import LoadBalancedLayout, PlainLayout
from lossfx.interfaces import TrainingSamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*valid tokens have -inf:UserWarning")

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-12}
B, S, V = 2, 8, 12


def _reference(z, ids, top, position_ids=None, ignore_index=None):
    """The dense float64 answer `[B, S-1]` of the pure pipeline's arguments."""
    if top is None:
        return reference.next_token_logprobs(z, ids, position_ids=position_ids, ignore_index=ignore_index)
    out = reference.next_token_filtered_logprobs(z, ids, top.top_k, top.top_p, top.ties)
    if position_ids is not None:
        out = torch.where(position_ids[:, 1:] == 0, 0.0, out)
    return out


def _finite_loss(out, weight):
    return torch.where(torch.isfinite(out), out * weight, torch.zeros_like(out)).sum()


# ---------------------------------------------------------------------------------------------
# 1. Values and gradients against the float64 reference
# ---------------------------------------------------------------------------------------------


def _pure_rank(rank, world, group, z, ids, weight, tp, widths, top, position_ids, ignore_index):
    tp_group, tp_rank, cp_group, _ = mesh_groups(rank, world, group, tp)
    start = sum(widths[:tp_rank])
    layout = LoadBalancedLayout(cp_group) if cp_group is not None else PlainLayout()
    local = z[..., start : start + widths[tp_rank]]
    local = layout.to_local(local, layout.local_len(S)).detach().requires_grad_()
    vocab = VocabRange(tp_group, start, V)
    out = pure.next_token_logprobs(
        local, ids, layout, vocab, top=top, chunk_size=3, position_ids=position_ids, ignore_index=ignore_index
    )
    _finite_loss(out, weight).backward()
    return out.detach(), local.grad, start


CASES = {  # (world, tp, widths)
    "plain": (1, 1, (V,)),
    "tp2": (2, 2, (6, 6)),
    "tp2-uneven": (2, 2, (7, 5)),  # an uneven VocabRange: this rank's start and V given explicitly
    "cp2": (2, 1, (V,)),
}
FILTERS = {"none": None, "top_k": pure.TopKTopP(3, 1.0), "top_p": pure.TopKTopP(None, 0.8, "sorted")}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("filt", FILTERS)
def test_pure_next_token_logprobs_against_reference(case, filt):
    world, tp, widths = CASES[case]
    top = FILTERS[filt]
    g = torch.Generator().manual_seed(7)
    z = torch.randn(B, S, V, generator=g, dtype=F64)
    ids = torch.randint(0, V, (B, S), generator=g)
    weight = torch.randn(B, S - 1, generator=g, dtype=F64)
    zr = z.clone().requires_grad_()
    want = _reference(zr, ids, top)
    _finite_loss(want, weight).backward()
    cp = world // tp
    for rank, (out, grad, start) in enumerate(
        run_ranks(world, _pure_rank, z, ids, weight, tp, widths, top, None, None)
    ):
        torch.testing.assert_close(out, want.detach(), **TIGHT)
        expected = zr.grad[..., start : start + grad.shape[-1]]
        if cp > 1:  # the summed-gradient convention: every CP rank computes the same loss
            expected = reference.cp_shard(cp * expected, rank // tp, cp)
        torch.testing.assert_close(grad, expected, **TIGHT)


@pytest.mark.parametrize("filt", ["none", "top_k"])
def test_pure_padding_free_rows_and_ignore_index(filt):
    top = FILTERS[filt]
    g = torch.Generator().manual_seed(3)
    z = torch.randn(B, S, V, generator=g, dtype=F64)
    ids = torch.randint(0, V, (B, S), generator=g)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 1]])
    weight = torch.randn(B, S - 1, generator=g, dtype=F64)
    zr = z.clone().requires_grad_()
    want = _reference(zr, ids, top, position_ids=position_ids)
    _finite_loss(want, weight).backward()
    ((out, grad, _),) = run_ranks(1, _pure_rank, z, ids, weight, 1, (V,), top, position_ids, None)
    torch.testing.assert_close(out, want.detach(), **TIGHT)
    torch.testing.assert_close(grad, zr.grad, **TIGHT)
    if top is None:  # ignore_index: 0 and a zero gradient where input_ids[:, t+1] is ignored
        ignored = ids.clone()
        ignored[0, 3] = ignored[1, 6] = -100
        zr.grad = None
        want = reference.next_token_logprobs(zr, ignored, ignore_index=-100)
        _finite_loss(want, weight).backward()
        ((out, grad, _),) = run_ranks(1, _pure_rank, z, ignored, weight, 1, (V,), None, None, -100)
        torch.testing.assert_close(out, want.detach(), **TIGHT)
        torch.testing.assert_close(grad, zr.grad, **TIGHT)


def test_pure_target_logprobs_against_reference():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(3, 4, V, generator=g, dtype=F64)
    target = torch.randint(0, V, (3, 4), generator=g, dtype=torch.int32)
    for top in FILTERS.values():
        got = pure.target_logprobs(z, target, VocabRange.whole(V), top=top, chunk_rows=5)
        if top is None:
            want = reference.token_logprobs(z, target.long())
        else:
            want = reference.filtered_token_logprobs(z, target.long(), top.top_k, top.top_p, top.ties)
        torch.testing.assert_close(got, want, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. The boundary: one validation, one range check, no nested public call, one pure call
# ---------------------------------------------------------------------------------------------


def _count(monkeypatch, counts):
    """Count range checks (wherever a lossfx module imported `check_ids_in_range`), nested public
    calls (a `boundary` entered inside another: `host_reads.nested`), the pure pipeline and the
    token kernels. Rank threads share the patched modules: `list.append` is atomic."""

    def counting(module, name, key):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            counts.setdefault(key, []).append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("lossfx") and hasattr(module, "check_ids_in_range"):
            counting(module, "check_ids_in_range", "range_checks")
    counting(host_reads, "nested", "nested_public_calls")
    counting(pure, "next_token_logprobs", "pure_pipeline")
    counting(kernel_logprobs, "token_logprobs", "token_kernel")
    counting(kernel_filtering, "filtered_token_logprobs", "filtered_kernel")


@pytest.fixture
def counts(monkeypatch):
    counts: dict[str, list[int]] = {}
    _count(monkeypatch, counts)
    return counts


def _loss_fn(kl):
    return SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB, reference_policy_kl_penalty=kl)


SAMPLING = {
    "none": None,
    "top_k": TrainingSamplingParams(top_k=3),
    "top_p": TrainingSamplingParams(top_p=0.8),
}


def _calls(rank, world, group):
    """The public calls of one rank, `name -> () -> result` (this rank's vocabulary shard)."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(B, S, V, generator=g, dtype=F64)
    ids = torch.randint(0, V, (B, S), generator=g)
    width = V // world
    local = z[..., rank * width : (rank + 1) * width]
    tp = {"vocab_parallel_group": group, "vocab_parallel_rank": rank} if group is not None else {}

    def prepare(sampling, kl):
        data = {"input_ids": ids, "token_mask": torch.ones(B, S)}
        return lambda: lossfx.prepare_loss_input(
            local, data, _loss_fn(kl), sampling_params=SAMPLING[sampling], chunk_size=2, **tp
        )

    calls = {f"LOGPROB-{s}": prepare(s, 0.0) for s in SAMPLING}
    calls.update({f"LOGPROB-{s}-kl": prepare(s, 0.1) for s in ("top_k", "top_p")})
    calls["next_token_logprobs"] = lambda: lossfx.next_token_logprobs(local, ids, chunk_size=2, **tp)
    calls["next_token_logprobs-ignore"] = lambda: lossfx.next_token_logprobs(
        local, ids.masked_fill(ids == 0, -100), ignore_index=-100, **tp
    )
    calls["sharded_next_token_logprobs"] = lambda: lossfx.next_token.sharded_next_token_logprobs(
        local, ids, vocab_parallel_group=group, sampling_params=SAMPLING["top_k"]
    )
    calls["next_token_filtered_logprobs"] = lambda: lossfx.next_token_filtered_logprobs(
        local, ids, top_k=3, top_p=0.9, group=group
    )
    calls["target_logprobs"] = lambda: lossfx.next_token.target_logprobs(local[:, :-1], ids[:, 1:], group=group)
    return calls


def _want(name):
    pipeline = 0 if name == "target_logprobs" else 2 if name.endswith("-kl") else 1
    filtered = int(any(key in name for key in ("top_k", "top_p", "sharded", "filtered")))
    token = (2 if name.endswith("-kl") else 1) - filtered
    want = {"range_checks": 1, "pure_pipeline": pipeline, "token_kernel": token, "filtered_kernel": filtered}
    return {key: value for key, value in want.items() if value}


NAMES = list(_calls(0, 1, None))


@pytest.mark.parametrize("name", NAMES)
def test_one_public_call_is_one_boundary(name, counts):
    _calls(0, 1, None)[name]()
    assert {k: len(v) for k, v in counts.items()} == _want(name)


def _grouped_rank(rank, world, group, name):
    _calls(rank, world, group)[name]()


@pytest.mark.parametrize("name", ["LOGPROB-none", "LOGPROB-top_p-kl", "next_token_logprobs", "target_logprobs"])
def test_one_public_call_is_one_boundary_on_two_ranks(name, counts):
    run_ranks(2, _grouped_rank, name)
    assert {k: len(v) / 2 for k, v in counts.items()} == _want(name)


def gloo_count_job(rank, world, group):
    """On a real gloo pair: every public call's counts `[calls, KEYS]`."""
    import pytest as _pytest

    counts: dict[str, list[int]] = {}
    got: list[torch.Tensor] = []
    with _pytest.MonkeyPatch.context() as monkeypatch:
        _count(monkeypatch, counts)
        for call in _calls(rank, world, group).values():
            counts.clear()
            call()
            got.append(torch.tensor([len(counts.get(key, [])) for key in KEYS]))
    return torch.stack(got)


KEYS = ("range_checks", "nested_public_calls", "pure_pipeline", "token_kernel", "filtered_kernel")


@pytest.mark.distributed
def test_one_public_call_is_one_boundary_on_gloo():
    from harness import gloo_pool

    for got in gloo_pool(2).run(gloo_count_job):
        for name, row in zip(NAMES, got.tolist(), strict=True):
            assert {k: v for k, v in zip(KEYS, row, strict=True) if v} == _want(name), name


def gloo_dtensor_count_job(rank, world, group, z, ids):
    """Vocabulary-sharded DTensor logits on a real gloo mesh: each public call unwraps once (no
    re-entry on local tensors); per call its result and counts `[KEYS]`."""
    import pytest as _pytest
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(z, init_device_mesh("cpu", (world,)), [Shard(2)], src_data_rank=None)
    calls = {
        "next_token_logprobs": lambda: lossfx.next_token_logprobs(x, ids, chunk_size=2),
        "next_token_filtered_logprobs": lambda: lossfx.next_token_filtered_logprobs(x, ids, top_k=3, top_p=0.9),
    }
    counts: dict[str, list[int]] = {}
    got = []
    with _pytest.MonkeyPatch.context() as monkeypatch:
        _count(monkeypatch, counts)
        for call in calls.values():
            counts.clear()
            got.append((call(), torch.tensor([len(counts.get(key, [])) for key in KEYS])))
    return got


@pytest.mark.distributed
@pytest.mark.parametrize("vocab", [V, V - 1])  # V - 1: uneven shards (6 + 5 columns)
def test_dtensor_public_calls_are_one_boundary_on_gloo(vocab):
    from harness import gloo_pool

    g = torch.Generator().manual_seed(13)
    z, ids = torch.randn(B, S, vocab, generator=g, dtype=F64), torch.randint(0, vocab, (B, S), generator=g)
    want = {
        "next_token_logprobs": reference.next_token_logprobs(z, ids),
        "next_token_filtered_logprobs": reference.next_token_filtered_logprobs(z, ids, 3, 0.9),
    }
    for got in gloo_pool(2).run(gloo_dtensor_count_job, z, ids):
        for (name, ref), (out, row) in zip(want.items(), got, strict=True):
            torch.testing.assert_close(out, ref, **TIGHT)
            assert {k: v for k, v in zip(KEYS, row.tolist(), strict=True) if v} == _want(name), name


# ---------------------------------------------------------------------------------------------
# 3. Compiled
# ---------------------------------------------------------------------------------------------


def test_pure_next_token_logprobs_compiles_without_graph_breaks():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(
        lambda z, ids: pure.next_token_logprobs(z, ids, PlainLayout(), VocabRange.whole(V), top=FILTERS["top_k"]),
        backend=counter,
        fullgraph=True,
    )
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        z, ids = torch.randn(B, S, V, generator=g, dtype=F64), torch.randint(0, V, (B, S), generator=g)
        torch.testing.assert_close(fn(z, ids), _reference(z, ids, FILTERS["top_k"]), **TIGHT)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------------
# 4. The boundary's coverage check of a layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("local_len", [3, 4, 6, 8])
def test_check_covers_is_the_layout_rule(cp, local_len):
    """The boundary's question (the pure layouts have no check of their own): `C·S_l >= S` with an
    even `S_l` over `C > 1` ranks, equal lengths without context parallelism."""
    from lossfx.sequence_layout import check_covers

    layouts = [LoadBalancedLayout(None)]
    layouts[0].cp_size = cp  # the rule reads only the size (no collective)
    if cp == 1:
        layouts.append(PlainLayout())
    for layout in layouts:
        fits = local_len * cp >= 8 and local_len % 2 == 0 if cp > 1 else local_len == 8
        if fits:
            check_covers(layout, "logits", local_len, 8, "shapes")
        else:
            with pytest.raises(ValueError, match=r"logits .*cover input_ids' 8 positions.*got shapes"):
                check_covers(layout, "logits", local_len, 8, "shapes")
