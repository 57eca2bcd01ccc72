"""OPD_FULL with a hidden-states teacher and vocabulary-sharded DTensor logits, uneven shards included.

The contract (docs/opd_full.md, docs/dtensor.md): each rank passes the teacher LM head split like the
student logits, as this rank's plain `[Vl, H]` rows or as a `Shard(0)` DTensor on the logits' mesh;
a short rank of an uneven split (V = 11 as 6 + 5) holds its real rows only. Every case runs on rank
threads and on real gloo processes and compares the outputs and the student gradient with
`lossfx.reference` in float64 at 1e-10; wrong heads raise the same `ValueError` on every rank.
"""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest
import torch
from harness import compiled_for_rank, gloo_pool, run_ranks

import lossfx
from lossfx import reference as ref

pytestmark = pytest.mark.distributed

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
B, S, S_P, H = 3, 6, 5, 4
PENALTY = 0.25


def _case(vocab):
    """Dense student `[B, S, V]`, ids, hidden states `[B, S_p, H]`, two heads `[V, H]`, row index."""
    g = torch.Generator().manual_seed(100 * vocab)
    return {
        "z": torch.randn(B, S, vocab, generator=g, dtype=F64) * 2,
        "ids": torch.randint(0, vocab, (B, S), generator=g),
        "hidden": torch.randn(B, S_P, H, generator=g, dtype=F64),
        "heads": {k: torch.randn(vocab, H, generator=g, dtype=F64) for k in (3, 7)},
        "index": torch.tensor([7, 3, 7]),
        "dout": torch.randn(B, S - 1, generator=g, dtype=F64),
    }


CFG = lossfx.OnPolicyDistillationFullConfig(enabled=True, teacher_payload="hidden_states", validate_decomposition=True)
# built outside any compiled function
LOSS_FN = SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=CFG, reference_policy_kl_penalty=PENALTY)
KEYS = ("opd_full_divergence", "opd_full_entropy", "opd_full_cross_entropy", "next_token_logprobs")


def _loss(out, dout):
    return (out["opd_full_divergence"] * dout).sum() + (out["next_token_logprobs"] * dout.flip(0)).sum()


def _teacher(c):
    """The dense teacher logits `[B, S, V]` projected by each row's head."""
    return ref.opd_full_teacher_logits(
        c["hidden"], S, teacher_payload="hidden_states", weights=c["heads"], teacher_index=c["index"]
    )


def _reference(vocab):
    c = _case(vocab)
    z = c["z"].clone().requires_grad_()
    want = ref.opd_full_loss_input(
        z, _teacher(c), c["ids"], validate_decomposition=True, reference_policy_kl_penalty=PENALTY
    )
    _loss(want, c["dout"]).backward()
    return {k: want[k].detach() for k in KEYS}, z.grad


# ---------------------------------------------------------------------------------------------
# Rank side (rank threads and gloo processes)
# ---------------------------------------------------------------------------------------------

_local = threading.local()


def _mesh(world):
    """This rank's 1-D `DeviceMesh` over the world (cached per thread / process)."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = _local.__dict__.setdefault("meshes", {})
    if world not in meshes:
        meshes[world] = init_device_mesh("cpu", (world,))
    return meshes[world]


def _inputs(rank, world, group, vocab, layout, heads_as):
    """`(logits, prepare_loss_input kwargs, the case)` for one layout.

    layout: "dtensor" (`Shard(-1)` logits over the mesh), "group" (this rank's even shard, plain,
    with `vocab_parallel_group`), "replicate" (`Replicate()` DTensor logits: no tensor parallelism),
    "plain" (full plain logits, world 1). heads_as: "rows" (this rank's plain rows), "dtensor"
    (`Shard(0)` DTensor), "full" (`[V, H]`).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    c = _case(vocab)
    heads = c["heads"]
    kwargs = {}
    if layout in ("group", "plain"):
        z = c["z"].chunk(world, dim=-1)[rank].clone().requires_grad_()
        kwargs = {"vocab_parallel_group": group, "vocab_parallel_rank": rank} if layout == "group" else {}
    else:
        placement = Shard(2) if layout == "dtensor" else Replicate()
        z = distribute_tensor(c["z"], _mesh(world), [placement], src_data_rank=None).requires_grad_()
    if heads_as != "full":
        heads = {k: distribute_tensor(w, _mesh(world), [Shard(0)], src_data_rank=None) for k, w in heads.items()}
        heads = {k: w.to_local() if heads_as == "rows" else w for k, w in heads.items()}
    kwargs["teacher_output_layer_weight_by_index"] = heads
    return z, kwargs, c


def _data(c):
    return {"input_ids": c["ids"], "teacher_full_hidden_states": c["hidden"], "opd_full_teacher_index": c["index"]}


def _run(rank, world, group, vocab, layout, heads_as, entry="prepare_loss_input", backend=None):
    """One rank: the OPD_FULL outputs and this rank's student gradient (full, for DTensor logits)."""
    from torch.distributed.tensor import DTensor

    z, kwargs, c = _inputs(rank, world, group, vocab, layout, heads_as)
    data = _data(c)
    snapshot = {k: v.clone() for k, v in data.items()}

    def fn(logits, data, kwargs):
        if entry == "prepare_loss_input":
            return lossfx.prepare_loss_input(logits, data, LOSS_FN, **kwargs)[0]
        group_kw = {"vocab_parallel_group": None, "vocab_parallel_rank": None, **kwargs}
        return lossfx.prepare_opd_full_loss_input(
            logits, data, LOSS_FN, context_parallel_group=None, sampling_params=None, chunk_size=None, **group_kw
        )

    counter = None
    if backend is not None:
        counter, fn = compiled_for_rank(rank, ("opd_full_dtensor", vocab, layout, heads_as, entry), fn, backend)
    out = fn(z, data, kwargs)
    _loss(out, c["dout"]).backward()
    assert all(torch.equal(data[k], snapshot[k]) for k in snapshot), "data is not modified"
    grad = z.grad.full_tensor() if isinstance(z.grad, DTensor) else z.grad
    where = str(tuple(z.grad.placements)) if isinstance(z.grad, DTensor) else "plain"
    frames = None if counter is None else counter.frame_count
    return {k: out[k].detach() for k in KEYS}, grad, where, frames


def _check(results, vocab, layout, world, what=""):
    want, want_grad = _reference(vocab)
    for rank, (out, grad, where, frames) in enumerate(results):
        for key in KEYS:
            torch.testing.assert_close(
                out[key], want[key], **TIGHT, msg=lambda m, k=key, r=rank: f"{what}{k} rank {r}: {m}"
            )
        expected = want_grad.chunk(world, dim=-1)[rank] if layout == "group" else want_grad
        torch.testing.assert_close(grad, expected, **TIGHT, msg=lambda m, r=rank: f"{what}grad rank {r}: {m}")
        assert where == {"dtensor": "(Shard(dim=2),)", "replicate": "(Replicate(),)"}.get(layout, "plain"), what
        assert frames in (None, 1), f"{what}rank {rank}: {frames} compiles"


# ---------------------------------------------------------------------------------------------
# Values and gradients against the float64 reference
# ---------------------------------------------------------------------------------------------

CASES = [  # (V, world): uneven 6 + 5, 7 + 6, 4 + 4 + 4 + 1; even 6 + 6, 3 · 4
    (11, 2),
    (13, 2),
    (13, 4),
    (12, 2),
    (12, 4),
]


@pytest.mark.parametrize("heads_as", ["rows", "dtensor"])
@pytest.mark.parametrize(("vocab", "world"), CASES)
def test_dtensor_logits_rank_threads(vocab, world, heads_as):
    _check(run_ranks(world, _run, vocab, "dtensor", heads_as), vocab, "dtensor", world)


# 4 gloo processes with -m slow (a further point of the world size): by default 2 gloo ranks
# (11 = 6 + 5, the kernel and prepare_opd_full_loss_input) and, on 4 rank threads, the uneven
# 4 + 4 + 4 + 1 and even 3 · 4 DTensor shards (test_dtensor_logits_rank_threads)
@pytest.mark.parametrize(("vocab", "world"), [(11, 2), pytest.param(13, 4, marks=pytest.mark.slow)])
def test_dtensor_logits_gloo(vocab, world):
    variants = [("rows", "prepare_loss_input"), ("dtensor", "prepare_loss_input"), ("rows", "opd_full")]
    per_rank = gloo_pool(world).run(_runs, vocab, variants)  # one launch
    for i, variant in enumerate(variants):
        _check([r[i] for r in per_rank], vocab, "dtensor", world, what=f"{variant} ")


def _runs(rank, world, group, vocab, variants):
    return [_run(rank, world, group, vocab, "dtensor", heads_as, entry) for heads_as, entry in variants]


@pytest.mark.parametrize("heads_as", ["rows", "dtensor"])
@pytest.mark.parametrize("world", [2, 4])
def test_plain_group_even_shards(world, heads_as):
    """The process-group dialect: plain even logits shards; heads as plain rows or `Shard(0)` DTensors."""
    _check(run_ranks(world, _run, 12, "group", heads_as), 12, "group", world)


def test_full_logits_full_head():
    """No tensor parallelism: `Replicate()` DTensor logits with the full `[V, H]` head on every rank,
    and plain full logits with the full head (world 1)."""
    _check(run_ranks(2, _run, 11, "replicate", "full"), 11, "replicate", 2)
    _check(run_ranks(1, _run, 11, "plain", "full"), 11, "plain", 1)


def test_reconstruct_teacher_logits_from_sharded_heads():
    """`reconstruct_opd_full_teacher_logits` on uneven DTensor logits: the projected teacher is a
    DTensor placed like the logits, equal to the dense reference."""
    results = run_ranks(2, _reconstruct, 11)
    want = _teacher(_case(11))
    for got in results:
        torch.testing.assert_close(got["rows"], want, **TIGHT)
        torch.testing.assert_close(got["dtensor"], want, **TIGHT)


def _reconstruct(rank, world, group, vocab):
    from torch.distributed.tensor import DTensor

    results = {}
    for heads_as in ("rows", "dtensor"):
        logits, kwargs, c = _inputs(rank, world, group, vocab, "dtensor", heads_as)
        teacher = lossfx.reconstruct_opd_full_teacher_logits(
            c["hidden"],
            teacher_payload="hidden_states",
            student_logits=logits,
            vocab_parallel_rank=None,
            context_parallel_group=None,
            teacher_output_layer_weight_by_index=kwargs["teacher_output_layer_weight_by_index"],
            teacher_index=c["index"],
        )
        assert isinstance(teacher, DTensor) and teacher.placements == logits.placements
        results[heads_as] = teacher.full_tensor()
    return results


@pytest.mark.compile
def test_compiled_fullgraph_uneven():
    """One `torch.compile(fullgraph=True)` (aot_eager) of the uneven 6 + 5 case with `Shard(0)` heads."""
    results = run_ranks(2, _run, 11, "dtensor", "dtensor", "prepare_loss_input", "aot_eager")
    _check(results, 11, "dtensor", 2)


# ---------------------------------------------------------------------------------------------
# Heads that do not match the student's shard: the same ValueError on every rank
# ---------------------------------------------------------------------------------------------


def _error(rank, world, group, vocab, bad):
    """The error message of a call with a wrong head `bad` (`None` if it did not raise)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    layout, heads_as = ("replicate", "dtensor") if bad == "sharded_head_full_logits" else ("dtensor", "rows")
    logits, kwargs, c = _inputs(rank, world, group, vocab, layout, heads_as)
    mine, w = kwargs["teacher_output_layer_weight_by_index"][3], c["heads"][3]  # head 3 as the layout gives it
    heads = {  # bad -> the head passed instead of `mine`
        "padded_rows": lambda: torch.cat([mine, mine.new_zeros(-(-vocab // world) - mine.shape[0], H)]),  # to Vl
        "full_head": lambda: w,
        "other_vocab": lambda: distribute_tensor(torch.cat([w, w[:1]]), _mesh(world), [Shard(0)], src_data_rank=None),
        "replicate_head_tp_logits": lambda: distribute_tensor(w, _mesh(world), [Replicate()], src_data_rank=None),
    }
    kwargs["teacher_output_layer_weight_by_index"] = {3: heads.get(bad, lambda: mine)()}
    data = {"input_ids": c["ids"], "teacher_full_hidden_states": c["hidden"]}
    try:
        lossfx.prepare_loss_input(logits, data, LOSS_FN, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("bad", "world", "match"),
    [
        ("padded_rows", 2, r"teacher_output_layer_weight_by_index\[3\]\.shape\[0\], this rank's vocabulary rows "
         r"\(rank 0: as the shard, rank 1: 6 rows, the shard has 5\)"),
        ("padded_rows", 4, r"rank 3: 4 rows, the shard has 1"),
        ("full_head", 2, r"rank 0: 11 rows, the shard has 6, rank 1: 11 rows, the shard has 5"),
        ("other_vocab", 2, r"rank 0: as the shard, rank 1: 6 rows, the shard has 5"),
        ("replicate_head_tp_logits", 2, r"rank 0: 11 rows, the shard has 6"),
        ("sharded_head_full_logits", 2, r"sharded on its rows over 2 ranks .* the student logits are not "
         r"vocabulary-parallel"),
        # V = 9 over 4 ranks is 3 + 3 + 3 + 0: an empty rank cannot hold a projected teacher
        ("none", 4, r"V=9 split over 4 ranks leaves the last rank\(s\) no rows"),
    ],
)  # fmt: skip
def test_heads_that_do_not_match_the_shard_raise_on_every_rank(bad, world, match):
    vocab = {2: 11, 4: 9 if bad == "none" else 13}[world]
    messages = run_ranks(world, _error, vocab, bad)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        assert re.search(match, message), f"rank {rank}: {message}"
