"""The pure packed layout, the pure fused next-token pipeline, and the boundary above them.

1. `lossfx._layouts.packing.packed_next_token_logprobs` against `lossfx.reference` in float64
   (values and the logits' gradient; 1 rank, 2 TP ranks with an uneven `VocabRange`, TP x CP,
   filtered and pre-packed);
2. `lossfx._layouts.linear_next_token.linear_next_token_logprobs` against the reference (values,
   hidden and weight gradients; 1 rank and 2 TP ranks with an uneven `VocabRange`);
3. one public call (`packed_next_token_logprobs`, `prepare_packed_loss_input`, the `DRAFT`
   branch of `prepare_loss_input`, `linear_next_token_logprobs`) range-checks its ids once,
   enters its pure code once and calls no other public function, on 1 and 2 ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE, on_device
from harness import mesh_groups, run_ranks

import lossfx
from lossfx import reference
from lossfx._boundary import validation
from lossfx._core import host_reads
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._layouts import draft as pure_draft
from lossfx._layouts import linear_next_token as pure_linear
from lossfx._layouts import packing as pure_packing
from lossfx._layouts.sequence_layout import PlainLayout
from lossfx.context_parallel import cp_positions

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
CU_Q, CU_P = [0, 5, 8, 12], [0, 8, 12, 16]  # lengths 5, 3, 4 padded to 8, 4, 4 (multiples of 2·2)
V = 11


def _case(seed: int, prepacked: bool = False, device: torch.device | str | None = None):
    """(packed logits `[1, T, V]`, ids) on `device` (default: the suite's `--device`)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, CU_P[-1], V, generator=g, dtype=F64) * 2
    if prepacked:
        ids = torch.randint(0, V, (1, CU_P[-1]), generator=g)
    else:
        ids = torch.randint(0, V, (len(CU_Q) - 1, 7), generator=g)  # rows wider than every length
    device = DEVICE if device is None else device
    return z.to(device), ids.to(device)


def _local_slots(cp_rank: int, cp: int) -> torch.Tensor:
    out: list[int] = []
    for i in range(len(CU_P) - 1):
        out += [CU_P[i] + p for p in cp_positions(CU_P[i + 1] - CU_P[i], cp_rank, cp)]
    return torch.tensor(out, device=DEVICE)


def _pure_packed_rank(rank, world, group, tp, widths, z, ids, prepacked, kw, cu_tensor):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    start = sum(widths[:tp_rank])
    local = z[:, _local_slots(cp_rank, cp), start : start + widths[tp_rank]].clone().requires_grad_()
    cu_q, cu_p = on_device((torch.tensor(CU_Q), torch.tensor(CU_P))) if cu_tensor else (CU_Q, CU_P)
    layout = pure_packing.PackedLayout(cu_q, cu_p, cp_group, prepacked)
    vocab = VocabRange(tp_group, start, sum(widths))
    out = pure_packing.packed_next_token_logprobs(local, ids, layout, vocab, **kw)
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=F64, device=DEVICE).view(out.shape)
    (torch.where(torch.isfinite(out), out, 0.0) * weights).sum().div(cp).backward()
    return out.detach(), local.grad, _local_slots(cp_rank, cp), start, widths[tp_rank]


@pytest.mark.gpu_check
@pytest.mark.parametrize("prepacked", [False, True], ids=["unpacked", "prepacked"])
@pytest.mark.parametrize("kw", [{}, {"top_k": 4}, {"top_p": 0.7}, {"chunk_rows": 3}], ids=["plain", "k", "p", "chunk"])
@pytest.mark.parametrize(
    ("world", "tp", "widths"),
    [(1, 1, [V]), (2, 2, [6, 5]), (2, 1, [V]), (4, 2, [4, 7])],
    ids=["one", "tp2-uneven", "cp2", "tp2xcp2-uneven"],
)
def test_pure_packed_against_reference(world, tp, widths, kw, prepacked):
    z, ids = _case(world + len(kw), prepacked)
    z.requires_grad_()
    filt = {k: v for k, v in kw.items() if k in ("top_k", "top_p")}
    want = reference.packed_next_token_logprobs(z, ids, CU_Q, CU_P, prepacked=prepacked, **filt)
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=F64, device=DEVICE).view(want.shape)
    (torch.where(torch.isfinite(want), want, 0.0) * weights).sum().backward()
    results = run_ranks(world, _pure_packed_rank, tp, widths, z.detach(), ids, prepacked, kw, world == 2)
    for out, grad, slots, start, width in results:
        torch.testing.assert_close(out, want.detach(), **TIGHT)
        torch.testing.assert_close(grad, z.grad[:, slots, start : start + width], **TIGHT)
    if filt:  # the filter drops some targets, so that the filtered path is exercised
        assert torch.isinf(want).any()


def _pure_linear_rank(rank, world, group, widths, hidden, weight, ids, position_ids, with_neg_entropy):
    start = sum(widths[:rank])
    h = hidden.clone().requires_grad_()
    w = weight[start : start + widths[rank]].clone().requires_grad_()
    vocab = VocabRange(group, start, sum(widths))
    outs = pure_linear.linear_next_token_logprobs(
        h,
        w,
        ids,
        PlainLayout(),
        vocab,
        head=HeadOptions(temperature=0.7),
        with_neg_entropy=with_neg_entropy,
        position_ids=position_ids,
    )
    sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs], h.grad, w.grad


@pytest.mark.gpu_check
@pytest.mark.parametrize("with_neg_entropy", [False, True])
@pytest.mark.parametrize(("world", "widths"), [(1, [V]), (2, [7, 4])], ids=["one", "tp2-uneven"])
def test_pure_linear_next_token_against_reference(world, widths, with_neg_entropy):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 6, 5, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    weight = torch.randn(V, 5, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    ids = torch.randint(0, V, (2, 6), generator=g).to(DEVICE)
    ids[0, 3] = -100  # ignored: 0 and no gradient
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], device=DEVICE)  # a sequence ends at t = 2
    logits = hidden @ weight.T / 0.7
    lp = logits.log_softmax(-1)
    target = ids[:, 1:].clamp_min(0)
    want = [lp[:, :-1].gather(-1, target[..., None])[..., 0]]
    if with_neg_entropy:
        want.append((lp.exp() * lp).sum(-1)[:, :-1])
    skipped = (ids[:, 1:] == -100) | (position_ids[:, 1:] == 0)
    want = [torch.where(skipped, 0.0, x) for x in want]
    sum(o.sum() * (i + 1) for i, o in enumerate(want)).backward()
    results = run_ranks(world, _pure_linear_rank, widths, hidden.detach(), weight.detach(), ids, position_ids,
                        with_neg_entropy)  # fmt: skip
    grad_w = torch.cat([r[2] for r in results])
    for outs, grad_h, _ in results:
        assert len(outs) == len(want)
        for got, ref in zip(outs, want):
            torch.testing.assert_close(got, ref.detach(), **TIGHT)
        torch.testing.assert_close(grad_h, hidden.grad, **TIGHT)
    torch.testing.assert_close(grad_w, weight.grad, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 3. One public call: one range check, one pure call, no nested public call
# ---------------------------------------------------------------------------------------------

COUNTED = {
    "check_ids_in_range": validation,
    "nested": host_reads,  # the boundary enters `nested()` for every public call inside a public call
    "check_packed_input_ids": lossfx.packing,
}
PURE = {
    "packed": (pure_packing, "packed_next_token_logprobs"),
    "draft": (pure_draft, "draft_targets"),
    "linear": (pure_linear, "linear_next_token_logprobs"),
}


@pytest.fixture
def counts(monkeypatch):
    counts: dict[str, list[int]] = {}

    def count(module, name, key):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            counts.setdefault(key, []).append(1)  # (atomic: rank threads share the patched module)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for name, module in COUNTED.items():
        count(module, name, name)
    for key, (module, name) in PURE.items():
        count(module, name, key)
    # the range checks as the public modules call them (imported by name)
    for module in (lossfx.draft, lossfx.fused_linear, lossfx.next_token):
        count(module, "check_ids_in_range", "check_ids_in_range")
    return counts


class _Fn(SimpleNamespace):
    pass


def _public_calls(rank: int, group):
    """`name -> (call, expected counts)` on this rank's shards (`group` of 1 or 2 ranks)."""
    world = 1 if group is None else group.size()
    z, ids = _case(3, device="cpu")  # counts of the boundary's calls: on the CPU whatever --device
    local = z[..., rank * 6 : (rank + 1) * 6] if world == 2 else z  # [1, 16, 6|5]: uneven under TP
    logprob = _Fn(input_type=lossfx.LossInputType.LOGPROB, reference_policy_kl_penalty=0.1)
    draft = _Fn(input_type=lossfx.LossInputType.DRAFT)
    sampling = lossfx.TrainingSamplingParams(top_k=3)
    tp = {"vocab_parallel_group": group, "vocab_start": 6 * rank, "vocab_size": V}  # explicit: uneven shards
    entry_tp = {"vocab_parallel_group": group, "vocab_parallel_rank": rank if group is not None else None}
    g = torch.Generator().manual_seed(1)
    draft_logits = torch.randn(2, 6, 8, generator=g, dtype=F64)
    draft_data = {"student_logits": draft_logits, "token_mask": torch.ones(2, 6)}
    d2t = torch.tensor([0, 2, 3, 3] if world == 1 else [0, 2, 3, 3, 5, 5, 6, 7])
    hidden = torch.randn(2, 6, 5, generator=g, dtype=F64)
    weight = torch.randn(6, 5, generator=g, dtype=F64)
    next_ids = torch.randint(0, 6 * world, (2, 6), generator=g)
    return {
        "packed_next_token_logprobs": (
            lambda: lossfx.packing.packed_next_token_logprobs(local, ids, CU_Q, CU_P, sampling_params=sampling, **tp),
            {"check_packed_input_ids": 1, "packed": 1},
        ),
        "prepare_packed_loss_input": (  # a filter and a KL term: the pure pipeline twice, one check
            lambda: lossfx.prepare_packed_loss_input(
                local,
                {"input_ids": ids, "token_mask": torch.ones_like(ids)},
                logprob,
                CU_Q,
                CU_P,
                sampling_params=sampling,
                **entry_tp,
            ),
            {"check_packed_input_ids": 1, "packed": 2},
        ),
        "prepare_packed_loss_input tensors": (
            lambda: lossfx.prepare_packed_loss_input(
                local, {"input_ids": ids}, logprob, torch.tensor(CU_Q), torch.tensor(CU_P), **entry_tp
            ),
            {"check_packed_input_ids": 1, "packed": 1},
        ),
        "prepare_loss_input DRAFT": (
            lambda: lossfx.prepare_loss_input(draft_logits, draft_data, draft, d2t=d2t, **entry_tp),
            {"check_ids_in_range": 1, "draft": 1},
        ),
        "linear_next_token_logprobs": (
            lambda: lossfx.linear_next_token_logprobs(hidden, weight, next_ids, return_neg_entropy=True, group=group),
            {"check_ids_in_range": 1, "linear": 1},
        ),
    }


CALLS = list(_public_calls(0, None))


@pytest.mark.parametrize("name", CALLS)
def test_one_public_call_checks_once_and_enters_the_pure_code_once(name, counts):
    call, want = _public_calls(0, None)[name]
    call()
    assert {k: len(v) for k, v in counts.items()} == want


def _rank_calls(rank, world, group, name):
    call, want = _public_calls(rank, group)[name]
    call()
    return want


@pytest.mark.distributed
@pytest.mark.parametrize("name", CALLS)
def test_one_public_call_on_two_ranks(name, counts):
    """With a group of 2 (uneven 6 + 5 packed vocabulary shards; the cross-rank check runs too):
    per rank, still one range check, one pure call (two for a filtered call with a KL term) and
    no nested public call."""
    (want, _) = run_ranks(2, _rank_calls, name)
    assert {k: len(v) / 2 for k, v in counts.items()} == want


def gloo_dtensor_packed_job(rank, world, group, z, ids):
    """`prepare_packed_loss_input` with `Shard(2)` DTensor logits on a real gloo mesh: unwrapped
    once (no re-entry of the public function), one range check, one pure call, no nested public
    call; the log-probs and the counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(z, mesh, [Shard(2)], src_data_rank=None)
    names = ("check_packed_input_ids", "nested", "packed_next_token_logprobs")
    modules = (lossfx.packing, host_reads, pure_packing)
    counts = dict.fromkeys(names, 0)
    originals = [getattr(m, n) for m, n in zip(modules, names)]

    def counted(name, original):
        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return call

    for module, name, original in zip(modules, names, originals):
        setattr(module, name, counted(name, original))
    try:
        loss_fn = _Fn(input_type=lossfx.LossInputType.LOGPROB)
        out, _ = lossfx.prepare_packed_loss_input(x, {"input_ids": ids}, loss_fn, CU_Q, CU_P)
    finally:
        for module, name, original in zip(modules, names, originals):
            setattr(module, name, original)
    return out["next_token_logprobs"], torch.tensor([counts[n] for n in names])


@pytest.mark.distributed
def test_dtensor_prepare_packed_loss_input_unwraps_once_on_gloo():
    from harness import gloo_pool

    z, ids = _case(5)
    z = z[..., :10]  # Shard(2) of 10 columns over 2 ranks
    want = reference.packed_next_token_logprobs(z, ids, CU_Q, CU_P)
    for out, got in gloo_pool(2).run(gloo_dtensor_packed_job, z, ids):
        torch.testing.assert_close(out, want, **TIGHT)
        assert got.tolist() == [1, 0, 1]


def test_pure_packed_compiles_without_graph_breaks():
    """The pure pipeline with tensor `cu_seqlens` under `fullgraph=True`: one graph, reused for
    another layout of the same shapes, and the reference's values."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def fn(z, ids, cu_q, cu_p):
        layout = pure_packing.PackedLayout(cu_q, cu_p, None, False)
        return pure_packing.packed_next_token_logprobs(z, ids, layout, VocabRange.whole(z.shape[-1]), top_k=5)

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    z, ids = _case(9)
    for cu_q, cu_p in ((CU_Q, CU_P), ([0, 4, 8, 10], [0, 4, 12, 16])):
        got = compiled(z, ids, torch.tensor(cu_q, device=z.device), torch.tensor(cu_p, device=z.device))
        torch.testing.assert_close(got, reference.packed_next_token_logprobs(z, ids, cu_q, cu_p, top_k=5), **TIGHT)
    assert counter.frame_count == 1


def test_scored_slots_are_each_sequences_tokens_after_its_first():
    """`scored_slots` against its definition, element by element: unpacked `1 <= t < min(len, padded)`
    per sequence (an empty one scores nothing); pre-packed, the slots strictly inside a sequence's span."""
    cu_q, cu_p = torch.tensor([0, 3, 3, 9]), torch.tensor([0, 4, 6, 12])
    spans = list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_p[:-1].tolist(), cu_p[1:].tolist()))
    want = [[1 <= t < min(q1 - q0, p1 - p0) for t in range(8)] for q0, q1, p0, p1 in spans]
    assert pure_packing.scored_slots(8, cu_q, cu_p, prepacked=False).tolist() == want
    inside = [[any(p0 < t < p1 for _, _, p0, p1 in spans) for t in range(12)]]
    assert pure_packing.scored_slots(12, cu_q, cu_p, prepacked=True).tolist() == inside
