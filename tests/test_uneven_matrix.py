"""Uneven vocabulary shards on every public path that takes one (issue 15 item 7), on real gloo ranks.

Every loop count and collective size must come from rank-independent quantities. Each case runs
V = 13 split unevenly, as plain shards with an explicit layout (7 + 6 on 2 ranks, 4 + 3 + 3 + 3
on 4; `vocab_start`/`vocab_size`, or `vocab_parallel_rank` for the entry point) or as uneven
`Shard` DTensors (torch's split: 7 + 6, 4 + 4 + 4 + 1), with one tiny `lossfx.ChunkPolicy` forced
on every rank, so that each rank's width-based chunk counts differ. Each must give the float64
reference's values and gradients or a clear error on every rank (`ERRORS`), never a hang: the
pool's timeout is 120 s. A few cases run by default; the full matrix is `-m slow`.
"""

from types import SimpleNamespace

import harness
import pytest
import torch
from harness import assert_every_rank_raises, gloo_pool

import lossfx
from lossfx import reference

pytestmark = pytest.mark.distributed

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
B, S, H, K, V = 2, 9, 5, 3, 13
# plain shards: any split; DTensors: torch's split of a `Shard` placement (ceil(V/R) per rank, the rest last)
WIDTHS = {("explicit", 2): (7, 6), ("explicit", 4): (4, 3, 3, 3), ("dtensor", 2): (7, 6), ("dtensor", 4): (4, 4, 4, 1)}
# 1 row of 7 float64 columns per logits chunk (8 rows of 6 would be 48 bytes): chunk counts differ by width
POLICY = lossfx.ChunkPolicy(row_bytes=56, min_rows=1, tile_bytes=56, max_block=2, chunk_bytes=56)
LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
DISTILLATION = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True, kl_type="reverse")
OPD_FULL = SimpleNamespace(
    input_type=lossfx.LossInputType.OPD_FULL,
    opd_full=lossfx.OnPolicyDistillationFullConfig(enabled=True, teacher_payload="logits"),
    reference_policy_kl_penalty=0.0,
)


@pytest.fixture(autouse=True)
def _short_pool_timeout(monkeypatch):
    """A hang fails the test after 120 s instead of the harness's default 600 s."""
    monkeypatch.setattr(harness, "_TIMEOUT_S", 120.0)


def _data():
    gen = torch.Generator().manual_seed(13)
    z = torch.randn(B, S, V, generator=gen, dtype=F64) * 2
    return {
        "z": z,
        "ids": torch.randint(0, V, (B, S), generator=gen),
        "top": z.argmax(-1),  # inside every filter
        "topk_ids": torch.randint(0, V, (B, S, K), generator=gen),
        "teacher": torch.randn(B, S, V, generator=gen, dtype=F64) * 2,
        "teacher_topk": torch.randn(B, S, K, generator=gen, dtype=F64),
        "hidden": torch.randn(B, S, H, generator=gen, dtype=F64),
        "weight": torch.randn(V, H, generator=gen, dtype=F64) / 2,
        "a": torch.randn(B * S, generator=gen, dtype=F64),
    }


def _loss(outs, case):
    """A fixed weighting of every output, to backpropagate (the objective: itself; its log-probs and
    entropies are detached diagnostics)."""
    if case == "objective":
        return outs[0] * 3
    gen = torch.Generator().manual_seed(5)
    return sum((o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() for o in outs if o.is_floating_point())


def _logits_outs(case, z, d, span, entry):
    """The outputs of a logits path on `z` (`[B, S, V]` or this rank's shard; `span`: layout keywords)."""
    flat = z.reshape(B * S, -1)
    ids, top = d["ids"].reshape(-1), d["top"].reshape(-1)
    if case == "token":
        return [lossfx.token_logprobs(flat, ids, **span)]
    if case == "filtered":
        return [lossfx.filtered_token_logprobs(flat, top, top_k=4, top_p=0.9, **span)]
    if case == "gather":
        lp, ne = lossfx.gather_logprobs(flat, d["topk_ids"].reshape(-1, K), with_neg_entropy=True, **span)
        return [lp, ne]
    group = {"group": span["group"]} if "group" in span else {}
    if case == "entropy":
        return [lossfx.neg_entropy(flat, **group)]
    if case in ("cross_entropy", "reverse_kl"):
        fn = lossfx.cross_entropy_to_fixed if case == "cross_entropy" else lossfx.reverse_kl_to_fixed
        return [fn(flat, d["teacher_shard"].reshape(B * S, -1), **group)]
    if case == "vocab_topk":
        start = {"vocab_start": span["vocab_start"]} if "vocab_start" in span else {}
        values, ids = lossfx.vocab_topk(flat, K, **group, **start)
        return [values, ids]
    data = {"input_ids": d["ids"], "token_mask": torch.ones(B, S)}
    if case == "distillation":
        data.update(teacher_topk_logits=d["teacher_topk"], teacher_topk_indices=d["topk_ids"])
    if case == "opd_full":
        data["teacher_full_logits"] = d["teacher"]
    loss_fn = {"logprob": LOGPROB, "distillation": DISTILLATION, "opd_full": OPD_FULL}[case]
    out, _ = lossfx.prepare_loss_input(z, data, loss_fn, **entry)
    keys = {
        "logprob": ["next_token_logprobs"],
        "distillation": ["student_topk_logprobs", "teacher_topk_logprobs", "H_all"],
        "opd_full": ["opd_full_divergence"],
    }[case]
    return [out[k] for k in keys]


def _reference_logits(case, z, d):
    flat = z.reshape(B * S, V)
    ids, top = d["ids"].reshape(-1), d["top"].reshape(-1)
    if case == "token":
        return [reference.token_logprobs(flat, ids)]
    if case == "filtered":
        return [reference.filtered_token_logprobs(flat, top, top_k=4, top_p=0.9)]
    if case == "gather":
        return list(reference.gather_logprobs(flat, d["topk_ids"].reshape(-1, K)))
    if case == "entropy":
        return [reference.neg_entropy(flat)]
    if case == "cross_entropy":
        return [reference.cross_entropy_to_fixed(flat, d["teacher"].reshape(B * S, V))]
    if case == "reverse_kl":
        return [reference.reverse_kl_to_fixed(flat, d["teacher"].reshape(B * S, V))]
    if case == "vocab_topk":
        return list(reference.vocab_topk(flat, K))
    if case == "logprob":
        return [reference.next_token_logprobs(z, d["ids"])]
    if case == "distillation":
        data = {"teacher_topk_logits": d["teacher_topk"], "teacher_topk_indices": d["topk_ids"]}
        out = reference.prepare_distillation_input(z, data, DISTILLATION)
        return [out["student_topk_logprobs"], out["teacher_topk_logprobs"], out["H_all"]]
    out = reference.opd_full_loss_input(z, d["teacher"], d["ids"])
    return [out["opd_full_divergence"]]


def _fused_outs(case, hidden, w, d, span):
    flat, ids = hidden.reshape(B * S, H), d["ids"].reshape(-1)
    if case == "fused_token":
        return [lossfx.linear_token_logprobs(flat, w, ids, **span)]
    if case == "fused_gather":
        lp, ne = lossfx.linear_gather_logprobs(flat, w, d["topk_ids"].reshape(-1, K), with_neg_entropy=True, **span)
        return [lp, ne]
    if case == "fused_next_token":
        return list(lossfx.linear_next_token_logprobs(hidden, w, d["ids"], return_neg_entropy=True, **span))
    return list(lossfx.linear_logprob_objective(flat, w, ids, d["a"], neg_entropy_weight=d["a"].flip(0), **span))


def _reference_fused(case, hidden, w, d):
    flat, ids = hidden.reshape(B * S, H), d["ids"].reshape(-1)
    if case == "fused_token":
        return [reference.linear_token_logprobs(flat, w, ids)[0]]
    if case == "fused_gather":
        return list(reference.linear_gather_logprobs(flat, w, d["topk_ids"].reshape(-1, K)))
    if case == "fused_next_token":
        return list(reference.linear_next_token_logprobs(hidden, w, d["ids"]))
    return list(reference.linear_logprob_objective(flat, w, ids, d["a"], d["a"].flip(0)))


_meshes: dict = {}


def _dtensor(local, rank, world, dim, full_shape):
    """An uneven `Shard(dim)` DTensor over all ranks whose local part is `local`."""
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard

    mesh = _meshes.get(world)
    if mesh is None:
        mesh = _meshes[world] = DeviceMesh("cpu", list(range(world)))
    stride = torch.empty(full_shape).stride()
    return DTensor.from_local(local, mesh, [Shard(dim)], shape=torch.Size(full_shape), stride=stride)


def _plain(outs):
    return [o.full_tensor() if type(o).__name__ == "DTensor" else o for o in outs]


def _uneven(rank, world, group, case, mode):
    """`(values, [gradients of this rank's leaves])` of one case on this rank, or its ValueError's message."""
    try:
        return _uneven_values(rank, world, group, case, mode)
    except ValueError as err:
        return str(err)


def _uneven_values(rank, world, group, case, mode):
    d = _data()
    widths = WIDTHS[mode, world]
    start = sum(widths[:rank])
    cols = slice(start, start + widths[rank])
    d["teacher_shard"] = d["teacher"][..., cols]
    with lossfx.chunk_policy(POLICY):
        if case in FUSED:
            hidden = d["hidden"].clone().requires_grad_()
            w = d["weight"][cols].clone().requires_grad_()
            if mode == "dtensor":
                outs = _fused_outs(case, hidden, _dtensor(w, rank, world, 0, (V, H)), d, {})
            else:
                outs = _fused_outs(case, hidden, w, d, {"group": group, "vocab_start": start, "vocab_size": V})
            outs = _plain(outs)
            _loss(outs, case).backward()
            return [o.detach() for o in outs], [hidden.grad, w.grad]
        z = d["z"][..., cols].clone().requires_grad_()
        if mode == "dtensor":
            if case in ("cross_entropy", "reverse_kl"):
                d["teacher_shard"] = _dtensor(d["teacher_shard"], rank, world, 2, (B, S, V))
            outs = _logits_outs(case, _dtensor(z, rank, world, 2, (B, S, V)), d, {}, {})
        else:
            span = {"group": group, "vocab_start": start, "vocab_size": V}
            entry = {"vocab_parallel_group": group, "vocab_parallel_rank": rank}
            outs = _logits_outs(case, z, d, span, entry)
        outs = _plain(outs)
        loss = _loss(outs, case)
        if loss.requires_grad:
            loss.backward()
        return [o.detach() for o in outs], [z.grad]


def _reference(case, mode, world, rank):
    d = _data()
    start = sum(WIDTHS[mode, world][:rank])
    cols = slice(start, start + WIDTHS[mode, world][rank])
    if case in FUSED:
        hidden = d["hidden"].clone().requires_grad_()
        w = d["weight"].clone().requires_grad_()
        outs = _reference_fused(case, hidden, w, d)
        _loss(outs, case).backward()
        return [o.detach() for o in outs], [hidden.grad, w.grad[cols]]
    z = d["z"].clone().requires_grad_()
    outs = _reference_logits(case, z, d)
    loss = _loss(outs, case)
    if case == "vocab_topk":  # its values carry no gradient through lossfx's integer ids
        return [o.detach() for o in outs], [None]
    loss.backward()
    return [o.detach() for o in outs], [z.grad[..., cols]]


LOGITS = ["token", "filtered", "gather", "entropy", "cross_entropy", "reverse_kl", "vocab_topk"]
ENTRY = ["logprob", "distillation", "opd_full"]
FUSED = ["fused_token", "fused_gather", "fused_next_token", "objective"]
MODES = ("explicit", "dtensor")
MATRIX = [(case, mode, world) for case in LOGITS + ENTRY + FUSED for mode in MODES for world in (2, 4)]
DEFAULT = {("filtered", "dtensor", 2), ("opd_full", "explicit", 2), ("objective", "dtensor", 2)}


# OPD_FULL (its logits payload sliced at rank · Vl) and DISTILLATION take plain shards of equal
# widths only (uneven ones go through the DTensor boundary, which pads them): a clear error that
# names the widths (for OPD_FULL, not the payload's fingerprint read over each rank's own [0, V))
WIDTH_ERROR = "the vocabulary shard width (rank 0: "
ERRORS = {("opd_full", "explicit"): WIDTH_ERROR, ("distillation", "explicit"): WIDTH_ERROR}


def _check(case, mode, world):
    results = gloo_pool(world).run(_uneven, case, mode)
    if (case, mode) in ERRORS:
        assert_every_rank_raises(results, [ERRORS[case, mode], "vocab_parallel_group"])
        return
    for rank, result in enumerate(results):
        assert not isinstance(result, str), f"rank {rank} raised: {result}"
        values, grads = result
        want_values, want_grads = _reference(case, mode, world, rank)
        assert len(values) == len(want_values)
        for got, want in zip(values, want_values, strict=True):
            torch.testing.assert_close(got, want.to(got.dtype), **TIGHT)
        if case == "vocab_topk":
            continue  # values and ids only: compared above
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize(("case", "mode", "world"), sorted(DEFAULT))
def test_uneven_widths_match_the_reference(case, mode, world):
    _check(case, mode, world)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "mode", "world"), [c for c in MATRIX if c not in DEFAULT])
def test_uneven_widths_matrix_matches_the_reference(case, mode, world):
    _check(case, mode, world)
