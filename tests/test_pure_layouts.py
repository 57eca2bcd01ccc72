"""The pure sequence layouts (`lossfx._layouts`) against the float64 reference, and the boundary
of their public faces (`lossfx.context_parallel`, `lossfx.draft`): one public call validates once,
range-checks its ids once and enters the pure code once.

Sections: 1 the load-balanced split, its inverse and the all-gather (values and the summed
gradient, 1 and 2 ranks); 2 the layouts' shift; 3 the draft targets (plain, TP, CP, TP×CP and an
uneven `VocabRange`; a real gloo pair); 4 the boundary counts; 5 one compiled pure call.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE
from harness import mesh_groups, run_ranks

import lossfx
from lossfx import reference
from lossfx._core.vocab import VocabRange
from lossfx._layouts import context_parallel as pure_cp
from lossfx._layouts import draft as pure_draft
from lossfx._layouts.sequence_layout import LoadBalancedLayout, PlainLayout

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-12}


def _shift(x):
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


# ---------------------------------------------------------------------------------------------
# 1. The split, its inverse and the gather
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("seq_dim", [0, 1, 2])
def test_shard_and_unshard_against_reference(cp, seq_dim):
    shape = [3, 4, 5]
    shape[seq_dim] = 2 * cp * 2
    x = torch.randn(*shape, dtype=F64)
    shards = [pure_cp.shard(x, r, cp, seq_dim) for r in range(cp)]
    for r, s in enumerate(shards):
        assert torch.equal(s, reference.cp_shard(x, r, cp, seq_dim))
        assert torch.equal(s, x.index_select(seq_dim, torch.tensor(pure_cp.positions(shape[seq_dim], r, cp))))
    assert torch.equal(pure_cp.unshard(shards, seq_dim), x)


def _allgather_rank(rank, world, group, x, upstream):
    local = reference.cp_shard(x, rank, world).clone().requires_grad_()
    full = pure_cp.allgather(local, group, seq_dim=1)
    (full * upstream[rank]).sum().backward()  # a different upstream gradient on every rank
    return full.detach(), local.grad


@pytest.mark.parametrize("world", [1, 2])
def test_allgather_values_and_summed_gradient(world):
    x = torch.randn(2, 8, 3, dtype=F64)
    upstream = torch.randn(world, 2, 8, 3, dtype=F64)
    for rank, (full, grad) in enumerate(run_ranks(world, _allgather_rank, x, upstream)):
        torch.testing.assert_close(full, x, rtol=0, atol=0)
        # the summed-gradient convention: the sum over ranks of their upstream at this rank's positions
        torch.testing.assert_close(grad, reference.cp_shard(upstream.sum(0), rank, world), **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. The layouts' shift
# ---------------------------------------------------------------------------------------------


def _shift_rank(rank, world, group, x, seq):
    layout = LoadBalancedLayout(group) if world > 1 else PlainLayout()
    local_len = layout.local_len(seq)
    local = layout.to_local(x, local_len)
    return pure_draft.shift_left(local, layout), layout.shift_left(local, seq)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("seq", [8, 7])  # 7: the layout pads (the gather path), 8: the two-row path
def test_shift_left_against_reference(world, seq):
    x = torch.randn(2, seq, 3, dtype=F64)
    padded = seq + (-seq) % (2 * world) if world > 1 else seq
    want = torch.nn.functional.pad(_shift(x), (0, 0, 0, padded - seq))
    for rank, (whole, cut) in enumerate(run_ranks(world, _shift_rank, x, seq)):
        full_pad = torch.nn.functional.pad(x, (0, 0, 0, padded - seq))
        torch.testing.assert_close(whole, reference.cp_shard(_shift(full_pad), rank, world), rtol=0, atol=0)
        torch.testing.assert_close(cut, reference.cp_shard(want, rank, world), rtol=0, atol=0)


def test_plain_shift_gradient():
    x = torch.randn(2, 5, 3, dtype=F64, requires_grad=True)
    g = torch.randn(2, 5, 3, dtype=F64)
    (pure_draft.shift_left(x, PlainLayout()) * g).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1), **TIGHT)


# ---------------------------------------------------------------------------------------------
# 3. Draft targets
# ---------------------------------------------------------------------------------------------

B, S, V, D = 2, 8, 8, 4
D2T = torch.tensor([0, 2, 3, 3]).to(DEVICE)  # draft id i -> target id i + d2t[i]: 0, 3, 5, 6


def _draft_rank(rank, world, group, tp, z, mask, d2t):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    layout = LoadBalancedLayout(cp_group) if cp_group is not None else PlainLayout()
    local = reference.cp_shard(z.chunk(tp, -1)[tp_rank], cp_rank, world // tp)
    vocab = VocabRange.uniform(tp_group, local.shape[-1])
    ids = None if d2t is None else torch.arange(D) + d2t
    return pure_draft.draft_targets(local, mask, ids, vocab, layout)


@pytest.mark.parametrize("with_d2t", [True, False])
@pytest.mark.parametrize(("world", "tp"), [(1, 1), (2, 1), (2, 2), (4, 2)], ids=["one", "cp2", "tp2", "tp2xcp2"])
def test_draft_targets_against_reference(world, tp, with_d2t):
    g = torch.Generator().manual_seed(world + tp)
    z = torch.randn(B, S, V, generator=g, dtype=F64)
    mask = (torch.rand(B, S, generator=g) > 0.3).to(F64)
    d2t = D2T if with_d2t else None
    want_teacher, want_mask = reference.draft_targets(z, mask, d2t)
    cp = world // tp
    for rank, (teacher, got_mask) in enumerate(run_ranks(world, _draft_rank, tp, z, mask, d2t)):
        tp_rank, cp_rank = rank % tp, rank // tp
        torch.testing.assert_close(
            teacher, reference.cp_shard(want_teacher.chunk(tp, -1)[tp_rank], cp_rank, cp), rtol=0, atol=0
        )
        torch.testing.assert_close(got_mask, reference.cp_shard(want_mask, cp_rank, cp), rtol=0, atol=0)
        assert not teacher.requires_grad


def _uneven_rank(rank, world, group, z, ids, widths):
    start = sum(widths[:rank])
    vocab = VocabRange(group, start, sum(widths))
    return pure_draft.map_to_draft_vocab(z[..., start : start + widths[rank]], ids, vocab)


def test_map_to_draft_vocab_uneven_vocab_range():
    """Shards of 5 and 3 columns (`VocabRange` with explicit starts): each rank's draft half."""
    z = torch.randn(B, S, V, dtype=F64)
    ids = torch.arange(D) + D2T  # 0, 3 on rank 0's shard; 5, 6 on rank 1's
    want = z[..., ids]
    for rank, out in enumerate(run_ranks(2, _uneven_rank, z, ids, [5, 3])):
        torch.testing.assert_close(out, want.chunk(2, -1)[rank], rtol=0, atol=0)


def test_map_to_draft_vocab_gradient_one_rank():
    z = torch.randn(B, S, V, dtype=F64, requires_grad=True)
    z_ref = z.detach().clone().requires_grad_()
    ids = torch.arange(D) + D2T
    g = torch.randn(B, S, D, dtype=F64)
    (pure_draft.map_to_draft_vocab(z, ids, VocabRange.whole(V)) * g).sum().backward()
    (z_ref[..., ids] * g).sum().backward()
    torch.testing.assert_close(z.grad, z_ref.grad, **TIGHT)


def gloo_draft_job(rank, world, group, z, mask, d2t):
    """The pure draft targets under tensor parallelism (one reduce-scatter) on a real gloo group."""
    return _draft_rank(rank, world, group, world, z, mask, d2t)


@pytest.mark.distributed
def test_draft_targets_on_gloo():
    from harness import gloo_pool

    z, mask = torch.randn(B, S, V, dtype=F64), (torch.rand(B, S) > 0.3).to(F64)
    want_teacher, want_mask = reference.draft_targets(z, mask, D2T)
    for rank, (teacher, got_mask) in enumerate(gloo_pool(2).run(gloo_draft_job, z, mask, D2T)):
        torch.testing.assert_close(teacher, want_teacher.chunk(2, -1)[rank], rtol=0, atol=0)
        torch.testing.assert_close(got_mask, want_mask, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# 4. The boundary: once per public call
# ---------------------------------------------------------------------------------------------


def _counting(monkeypatch, module, name, counts):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts.setdefault(name, []).append(1)  # (atomic: rank threads share the patched module)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.fixture
def counts(monkeypatch):
    counts: dict[str, list[int]] = {}
    for name in ("shard", "unshard", "allgather"):
        _counting(monkeypatch, pure_cp, name, counts)
    for name in ("shift_left", "map_to_draft_vocab", "draft_targets"):
        _counting(monkeypatch, pure_draft, name, counts)
    _counting(monkeypatch, lossfx.draft, "check_ids_in_range", counts)
    return counts


def _public_calls():
    z = torch.randn(B, S, V, dtype=F64)
    mask = torch.ones(B, S, dtype=F64)
    return {
        "shard_for_cp_rank": (lambda: lossfx.shard_for_cp_rank(z, 0, 2), {"shard": 1}),
        "unshard": (lambda: lossfx.unshard([z[:, :4], z[:, 4:]]), {"unshard": 1}),
        "allgather_cp": (lambda: lossfx.allgather_cp(z, None), {}),  # no group: `x` itself
        "shift_left": (lambda: lossfx.shift_left(z), {"shift_left": 1}),
        "map_to_draft_vocab": (
            lambda: lossfx.map_to_draft_vocab(z, D2T),
            {"map_to_draft_vocab": 1, "check_ids_in_range": 1},
        ),
        "draft_targets": (
            lambda: lossfx.draft_targets(z, mask, D2T),
            # the pure draft_targets calls the pure map_to_draft_vocab once, inside
            {"draft_targets": 1, "map_to_draft_vocab": 1, "check_ids_in_range": 1},
        ),
    }


@pytest.mark.parametrize("name", list(_public_calls()))
def test_one_public_call_enters_the_pure_code_once(name, counts):
    call, want = _public_calls()[name]
    call()
    assert {k: len(v) for k, v in counts.items()} == want


def _grouped_calls_rank(rank, world, group):
    z = torch.randn(B, S // 2, V, dtype=F64)
    lossfx.allgather_cp(z, group)
    lossfx.draft_targets(z, torch.ones(B, S, dtype=F64), D2T, context_parallel_group=group)
    lossfx.map_to_draft_vocab(z, D2T, vocab_parallel_rank=rank, vocab_parallel_group=group)
    return True


@pytest.mark.distributed
def test_grouped_public_calls_enter_the_pure_code_once_per_rank(counts):
    """With a group (the cross-rank check runs too): still one pure call and one range check per
    public call on each of the 2 ranks."""
    assert all(run_ranks(2, _grouped_calls_rank))
    per_rank = {k: len(v) / 2 for k, v in counts.items()}
    # draft_targets: its pure shift gathers no whole tensor (the two-row path), its map is pure
    assert per_rank == {"allgather": 1, "draft_targets": 1, "map_to_draft_vocab": 2, "check_ids_in_range": 2}


COUNTED = ("shift_left", "map_to_draft_vocab", "draft_targets", "check_ids_in_range")


def gloo_dtensor_count_job(rank, world, group, z, mask, d2t):
    """Vocabulary-sharded DTensor logits on a real gloo mesh: each public call unwraps once and
    enters the pure code once (no re-entry on local tensors); the results, gathered, and the counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(z, mesh, [Shard(2)], src_data_rank=None)
    counts = dict.fromkeys(COUNTED, 0)
    modules = {name: lossfx.draft if name == "check_ids_in_range" else pure_draft for name in COUNTED}
    originals = {name: getattr(modules[name], name) for name in COUNTED}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(modules[name], name, counted(name))
    try:
        outs = [
            lossfx.shift_left(x).full_tensor(),
            lossfx.map_to_draft_vocab(x, d2t).full_tensor(),
            lossfx.draft_targets(x, mask, d2t)[0].full_tensor(),
        ]
    finally:
        for name in COUNTED:
            setattr(modules[name], name, originals[name])
    return [*outs, torch.tensor([counts[name] for name in COUNTED])]


@pytest.mark.distributed
def test_dtensor_public_calls_enter_the_pure_code_once():
    from harness import gloo_pool

    z, mask = torch.randn(B, S, V, dtype=F64), (torch.rand(B, S) > 0.3).to(F64)
    want = [_shift(z), z[..., torch.arange(D) + D2T], reference.draft_targets(z, mask, D2T)[0]]
    for shifted, mapped, teacher, got in gloo_pool(2).run(gloo_dtensor_count_job, z, mask, D2T):
        for out, ref in zip((shifted, mapped, teacher), want, strict=True):
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
        # map_to_draft_vocab: the public call, and once inside the pure draft_targets
        assert dict(zip(COUNTED, got.tolist(), strict=True)) == {
            "shift_left": 1,
            "map_to_draft_vocab": 2,
            "draft_targets": 1,
            "check_ids_in_range": 2,
        }


# ---------------------------------------------------------------------------------------------
# 5. Compiled
# ---------------------------------------------------------------------------------------------


def test_pure_draft_targets_compiles_without_graph_breaks():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    ids, vocab = torch.arange(D) + D2T, VocabRange.whole(V)
    fn = torch.compile(
        lambda z, m: pure_draft.draft_targets(z, m, ids, vocab, PlainLayout()), backend=counter, fullgraph=True
    )
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        z, mask = torch.randn(B, S, V, generator=g, dtype=F64), torch.ones(B, S, dtype=F64)
        want = reference.draft_targets(z, mask, D2T)
        for got, ref in zip(fn(z, mask), want, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert counter.frame_count == 1
