"""lossfx.sequence_layout: every branch in every sequence layout, against the float64 reference.

Sections: 0 helpers (an external sharder with a layout of its own: contiguous blocks); 1 the
layouts themselves (`to_local` / `to_canonical` against `lossfx.reference.cp_shard` /
`packed_cp_shard`, values and the gradient rule); 2 every branch (LOGPROB plain and filtered,
DISTILLATION, DRAFT, OPD_FULL, the fused `linear_next_token_logprobs`) x every layout (a CP group,
a `LoadBalancedLayout` object and an external sharder as `cp_sharder=`) on 1, 2 and 4 ranks with
TP mixes, values and gradients at float64 1e-10, and on a real gloo group; 3 compile (the einops
patterns and every branch with a sharder layout under `fullgraph=True`, recompiles pinned);
4 errors.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE
from harness import compiled_for_rank, mesh_groups, run_ranks

import lossfx
from lossfx import reference
from lossfx._core.distributed import all_gather_stack_summed_grad, group_rank, group_size
from lossfx.context_parallel import cp_positions
from lossfx.opd_full import OnPolicyDistillationFullConfig
from lossfx.packing import PackedLayout
from lossfx.sequence_layout import (
    LoadBalancedLayout,
    PlainLayout,
    SequenceLayout,
    ShardedLayout,
    sequence_layout,
)

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
WORLDS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]  # (world, tp): cp = world // tp
WORLD_IDS = ["one", "cp2", "tp2", "cp4", "tp2xcp2"]
KINDS = ["group", "layout", "sharder"]  # context_parallel_group=, cp_sharder=LoadBalancedLayout, cp_sharder=<external>

# ---------------------------------------------------------------------------------------------
# 0. Helpers
# ---------------------------------------------------------------------------------------------


class ContiguousSharder:
    """An external `ContextParallelSharder` with another layout than lossfx's: the sequence,
    padded with `fill` to a multiple of `C`, in `C` contiguous blocks (rank `r` holds block `r`).
    Its gather follows the summed-gradient convention; it trims to the last sharded length."""

    def __init__(self, cp_group):
        self.cp_group = cp_group
        self.size, self.rank = group_size(cp_group), group_rank(cp_group)
        self._length = None

    def shard_token_tensor(self, x, seq_dim=1, fill=0):
        self._length = length = x.shape[seq_dim]
        pad = (-length) % self.size
        if pad:
            x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - seq_dim) + [0, pad], value=fill)
        n = x.shape[seq_dim] // self.size
        return x.narrow(seq_dim, self.rank * n, n)

    def gather_token_tensor(self, x, seq_dim=1, trim=True):
        stacked = all_gather_stack_summed_grad(x, self.cp_group)  # [C, ...]
        full = torch.cat(list(stacked.unbind(0)), dim=seq_dim)
        return full.narrow(seq_dim, 0, self._length) if trim and self._length is not None else full


def _positions(kind, seq, cp, cp_rank):
    """`(padded length, canonical positions this CP rank holds in local order)` of a layout kind."""
    if kind == "sharder":
        padded = seq + (-seq) % cp
        n = padded // cp
        return padded, torch.arange(cp_rank * n, (cp_rank + 1) * n)
    padded = seq + (-seq) % (2 * cp) if cp > 1 else seq
    return padded, torch.tensor(cp_positions(padded, cp_rank, cp))


def _local(x, kind, seq, cp, cp_rank):
    """This CP rank's part of canonical `x [B, S', ...]` (zero-padded first) in the kind's layout."""
    padded, pos = _positions(kind, seq, cp, cp_rank)
    x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, padded - x.shape[1]])
    return x[:, pos]


def _tp_slice(x, tp_rank, tp, dim=-1):
    return x.chunk(tp, dim=dim)[tp_rank]


def _cp_kwargs(kind, cp_group):
    if kind == "group":
        return {"context_parallel_group": cp_group}
    if kind == "layout":
        return {"cp_sharder": LoadBalancedLayout(cp_group)}
    return {"cp_sharder": ContiguousSharder(cp_group)}


B, S, V, K, H, D = 2, 11, 8, 3, 4, 4  # S = 11: no layout splits it evenly, every one pads
D2T = torch.tensor([0, 2, 3, 4]).to(DEVICE)  # draft id i -> target id i + d2t[i]


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    return {
        "z": torch.randn(B, S, V, generator=g, dtype=F64) * 2,
        "hidden": torch.randn(B, S, H, generator=g, dtype=F64),
        "weight": torch.randn(V, H, generator=g, dtype=F64),
        "data": {
            "input_ids": ids,
            "token_mask": (torch.rand(B, S, generator=g) > 0.2).to(F64),
            "teacher_topk_logits": torch.randn(B, S, K, generator=g, dtype=F64),
            "teacher_topk_indices": torch.randint(0, V, (B, S, K), generator=g),
            "teacher_full_logits": torch.randn(B, S - 2, V, generator=g, dtype=F64),  # shorter: zero-padded
            "student_logits": torch.randn(B, S, D, generator=g, dtype=F64),
        },
        "g": torch.randn(4, B, S - 1, generator=g, dtype=F64),  # upstream gradients
    }


def _loss_fn(branch):
    opd = OnPolicyDistillationFullConfig(enabled=True, teacher_payload="logits", validate_decomposition=True)
    kinds = {
        "logprob": {"input_type": lossfx.LossInputType.LOGPROB},
        "filtered": {"input_type": lossfx.LossInputType.LOGPROB, "reference_policy_kl_penalty": 0.0},
        "distillation": {
            "input_type": lossfx.LossInputType.DISTILLATION,
            "zero_outside_topk": True,
            "kl_type": "mixed",
        },
        "draft": {"input_type": lossfx.LossInputType.DRAFT},
        "opd_full": {"input_type": lossfx.LossInputType.OPD_FULL, "opd_full": opd, "reference_policy_kl_penalty": 0.5},
    }
    return SimpleNamespace(**kinds[branch])


SAMPLING = lossfx.TrainingSamplingParams(top_k=4, top_p=0.9)
# the differentiable outputs of each branch, weighted by g[0], g[1], ... in the loss
GRAD_KEYS = {
    "logprob": ["next_token_logprobs"],
    "filtered": ["next_token_logprobs"],
    "distillation": ["student_topk_logprobs", "H_all"],
    "draft": [],
    "opd_full": ["opd_full_divergence", "next_token_logprobs"],
}


def _weighted(x, g):
    return (x * (g if x.dim() == 2 else g[..., None])).sum()


def _reference(branch, case):
    """Dense canonical outputs and the gradient of the same loss w.r.t. the canonical logits."""
    z = case["z"].clone().requires_grad_()
    data = case["data"]
    if branch == "logprob":
        out = {"next_token_logprobs": reference.next_token_logprobs(z, data["input_ids"])}
    elif branch == "filtered":
        out = reference.prepare_filtered_logprob_input(z, data, _loss_fn(branch), 4, 0.9)[0]
    elif branch == "distillation":
        out = reference.prepare_distillation_input(z, data, _loss_fn(branch))
    elif branch == "draft":
        out = reference.prepare_draft_input(z, data, D2T)
    else:
        teacher = reference.opd_full_teacher_logits(data["teacher_full_logits"], S, teacher_payload="logits")
        out = reference.opd_full_loss_input(
            z, teacher, data["input_ids"], validate_decomposition=True, reference_policy_kl_penalty=0.5
        )
    loss = sum(_weighted(out[key], case["g"][i]) for i, key in enumerate(GRAD_KEYS[branch]))
    if GRAD_KEYS[branch]:
        loss.backward()
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}, z.grad


def _branch_step(branch, tp_rank, tp_group, cp_kw):
    """The branch as a function of (logits, data, g) -> (outputs, loss): what ranks run (and compile)."""
    loss_fn = _loss_fn(branch)
    cp_group = cp_kw.get("context_parallel_group", getattr(cp_kw.get("cp_sharder"), "cp_group", None))
    cp = group_size(cp_group)

    def step(logits, data, g):
        out, _ = lossfx.prepare_loss_input(
            logits,
            data,
            loss_fn,
            vocab_parallel_rank=tp_rank if tp_group is not None or branch == "opd_full" else None,
            vocab_parallel_group=tp_group,
            sampling_params=SAMPLING if branch == "filtered" else None,
            d2t=D2T if branch == "draft" else None,
            chunk_size=2,
            **cp_kw,
        )
        loss = sum(_weighted(out[key], g[i]) for i, key in enumerate(GRAD_KEYS[branch]))
        return out, loss / cp  # the summed-gradient convention: divide by C

    return step


def _branch_rank(rank, world, group, tp, kind, branch, case, backend=None):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    local = _tp_slice(_local(case["z"], kind, S, cp, cp_rank), tp_rank, tp).clone().requires_grad_()
    step = _branch_step(branch, tp_rank, tp_group, _cp_kwargs(kind, cp_group))
    if backend is not None:
        counter, step = compiled_for_rank(rank, ("layout-branch", world, tp, kind, branch), step, backend)
    out, loss = step(local, case["data"], case["g"])
    if GRAD_KEYS[branch]:
        loss.backward()
    out = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out, local.grad, counter.frame_count if backend is not None else None


def _check_branch(world, tp, kind, branch, seed=0, backend=None):
    cp = world // tp
    case = _case(seed)
    want, want_grad = _reference(branch, case)
    results = run_ranks(world, _branch_rank, tp, kind, branch, case, backend)
    for rank, (out, grad, _) in enumerate(results):
        tp_rank, cp_rank = rank % tp, rank // tp
        assert set(out) == set(want), (set(out), set(want))
        for key, value in want.items():
            if key == "student_logits":  # passed through (detached by the rank function)
                assert torch.equal(out[key], case["data"]["student_logits"])
            elif value is None:
                assert out[key] is None, key
            elif branch == "draft":  # the draft targets stay in this rank's layout
                expected = _local(value, kind, S, cp, cp_rank)
                expected = expected if key == "token_mask" else _tp_slice(expected, tp_rank, tp)
                torch.testing.assert_close(out[key], expected)
            else:
                torch.testing.assert_close(out[key], value, **TIGHT, msg=lambda m, key=key: f"{key}: {m}")
        if want_grad is not None:
            expected = _tp_slice(_local(want_grad, kind, S, cp, cp_rank), tp_rank, tp)
            torch.testing.assert_close(grad, expected, **TIGHT)
    return results


# ---------------------------------------------------------------------------------------------
# 1. The layouts themselves
# ---------------------------------------------------------------------------------------------


def test_sequence_layout_builds_each_class_once():
    assert isinstance(sequence_layout(), PlainLayout)
    layout = LoadBalancedLayout(None)
    assert sequence_layout(None, layout) is layout  # handed down: never rebuilt
    sharded = sequence_layout(None, ContiguousSharder(None))
    assert isinstance(sharded, ShardedLayout) and sequence_layout(None, sharded) is sharded
    assert lossfx.next_token.LoadBalancedSharder is LoadBalancedLayout
    for cls in (PlainLayout, LoadBalancedLayout, ShardedLayout, PackedLayout):  # every layout is a sharder
        assert issubclass(cls, SequenceLayout)
        assert isinstance(cls.__new__(cls), lossfx.next_token.ContextParallelSharder)


def _layout_rank(rank, world, group, kind, x, upstream):
    layout = sequence_layout(None, _cp_kwargs(kind, group)["cp_sharder"]) if kind != "group" else None
    layout = layout or sequence_layout(group)
    seq = x.shape[1]
    padded, _ = _positions(kind, seq, world, rank)
    assert layout.local_len(seq) == (None if kind == "sharder" else padded // world)
    local = layout.to_local(x, padded // world).clone().requires_grad_()
    full = layout.to_canonical(local, seq)
    ((full * upstream).sum() / world).backward()
    shifted = layout.shift_left(local.detach(), seq)
    return local.detach(), full.detach(), local.grad, shifted


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_to_local_and_to_canonical_against_reference(world, kind):
    """`to_local` is `reference.cp_shard` of the padded canonical tensor (the sharder: its blocks),
    `to_canonical` inverts it on every rank with the summed gradient, `shift_left` is the canonical
    shift laid out again; extra dims ride along."""
    x = torch.randn(2, 11, 3, dtype=F64)
    upstream = torch.randn(2, 11, 3, dtype=F64)
    shifted = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
    for rank, (local, full, grad, shift) in enumerate(run_ranks(world, _layout_rank, kind, x, upstream)):
        padded, _ = _positions(kind, 11, world, rank)
        pad = torch.nn.functional.pad(x, (0, 0, 0, padded - 11))
        want = reference.cp_shard(pad, rank, world) if kind != "sharder" else _local(x, kind, 11, world, rank)
        torch.testing.assert_close(local, want, rtol=0, atol=0)
        torch.testing.assert_close(full, x, rtol=0, atol=0)
        torch.testing.assert_close(grad, _local(upstream, kind, 11, world, rank), **TIGHT)
        torch.testing.assert_close(shift, _local(shifted, kind, 11, world, rank), rtol=0, atol=0)


def _packed_rank(rank, world, group, x, upstream, cu_q, cu_p):
    layout = PackedLayout(cu_q, cu_p, group, prepacked=True)
    assert layout.local_len(len(cu_q) - 1) == cu_p[-1] // world
    local = layout.to_local(x, cu_p[-1] // world).clone().requires_grad_()
    full = layout.to_canonical(local)
    ((full * upstream).sum() / world).backward()
    return local.detach(), full.detach(), local.grad


@pytest.mark.parametrize("world", [1, 2, 4])
def test_packed_layout_against_reference(world):
    cu_q, cu_p = [0, 3, 10, 11], [0, 8, 16, 24]  # padded lengths multiples of 2·4
    x, upstream = torch.randn(1, 24, 2, dtype=F64), torch.randn(1, 24, 2, dtype=F64)
    for rank, (local, full, grad) in enumerate(run_ranks(world, _packed_rank, x, upstream, cu_q, cu_p)):
        torch.testing.assert_close(local, reference.packed_cp_shard(x, cu_p, rank, world), rtol=0, atol=0)
        torch.testing.assert_close(full, x, rtol=0, atol=0)
        torch.testing.assert_close(grad, reference.packed_cp_shard(upstream, cu_p, rank, world), **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. Every branch x every layout x 1/2/4 ranks (TP x CP)
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:.*valid tokens have -inf")  # the filtered branch's -inf rule, by design
@pytest.mark.parametrize(("world", "tp"), WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("branch", ["logprob", "filtered", "distillation", "draft", "opd_full"])
def test_branch_in_every_layout_matches_reference(world, tp, kind, branch):
    _check_branch(world, tp, kind, branch, seed=world + tp)


def _fused_rank(rank, world, group, tp, kind, case, sequence_parallel, backend=None):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    hidden = _local(case["hidden"], kind, S, cp, cp_rank)
    if sequence_parallel:  # this TP rank's contiguous part of the CP-local positions
        hidden = hidden.chunk(tp, dim=1)[tp_rank]
    hidden = hidden.clone().requires_grad_()
    weight = _tp_slice(case["weight"], tp_rank, tp, dim=0).clone().requires_grad_()
    cp_kw = _cp_kwargs(kind, cp_group)

    def step(hidden, weight, ids):
        return lossfx.linear_next_token_logprobs(
            hidden,
            weight,
            ids,
            group=tp_group,
            sequence_parallel=sequence_parallel,
            return_neg_entropy=True,
            chunk_size=3,
            **cp_kw,
        )

    counter = None
    if backend is not None:
        counter, step = compiled_for_rank(rank, ("layout-fused", world, tp, kind, sequence_parallel), step, backend)
    lp, neg_h = step(hidden, weight, case["data"]["input_ids"])
    ((_weighted(lp, case["g"][0]) + _weighted(neg_h, case["g"][1])) / cp).backward()
    frames = None if counter is None else counter.frame_count
    return lp.detach(), neg_h.detach(), hidden.grad, weight.grad, frames


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "tp"), WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fused_next_token_in_every_layout_matches_reference(world, tp, kind, sequence_parallel):
    if sequence_parallel and _positions(kind, S, world // tp, 0)[0] // (world // tp) % tp:
        pytest.skip("the local length does not split over the TP ranks")
    _check_fused(world, tp, kind, sequence_parallel)


def _check_fused(world, tp, kind, sequence_parallel, backend=None, seed=0):
    """The fused next-token path on every rank against the reference; returns the compile counts."""
    cp = world // tp
    case = _case(world * 5 + tp + seed)
    h, w = case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
    lp, neg_h = reference.linear_next_token_logprobs(h, w, case["data"]["input_ids"])
    (_weighted(lp, case["g"][0]) + _weighted(neg_h, case["g"][1])).backward()
    results = run_ranks(world, _fused_rank, tp, kind, case, sequence_parallel, backend)
    weight_grads: dict[int, torch.Tensor] = {}
    for rank, (out_lp, out_h, grad_h, grad_w, _) in enumerate(results):
        tp_rank, cp_rank = rank % tp, rank // tp
        torch.testing.assert_close(out_lp, lp.detach(), **TIGHT)
        torch.testing.assert_close(out_h, neg_h.detach(), **TIGHT)
        want = _local(h.grad, kind, S, cp, cp_rank)
        torch.testing.assert_close(grad_h, want.chunk(tp, dim=1)[tp_rank] if sequence_parallel else want, **TIGHT)
        weight_grads[tp_rank] = weight_grads.get(tp_rank, 0) + grad_w  # each CP rank: its positions' share
    for tp_rank, grad_w in weight_grads.items():
        torch.testing.assert_close(grad_w, _tp_slice(w.grad, tp_rank, tp, dim=0), **TIGHT)
    return [frames for *_, frames in results]


def _public_rank(rank, world, group, case):
    """The public functions below the dispatch, called with `cp_sharder=` directly."""
    sharder, data = ContiguousSharder(group), case["data"]
    local = _local(case["z"], "sharder", S, world, rank)
    student, teacher, neg_h = lossfx.distillation_topk_logprobs(
        local,
        data["teacher_topk_logits"],
        data["teacher_topk_indices"],
        zero_outside_topk=True,
        calculate_entropy=True,
        cp_sharder=sharder,
    )
    draft, mask = lossfx.draft_targets(local, data["token_mask"], D2T, cp_sharder=sharder)
    opd = lossfx.prepare_opd_full_loss_input(
        local,
        data,
        _loss_fn("opd_full"),
        vocab_parallel_rank=0,
        vocab_parallel_group=None,
        context_parallel_group=None,
        sampling_params=None,
        chunk_size=None,
        cp_sharder=sharder,
    )
    payload = data["teacher_full_logits"]  # the sharder pads by itself: hand it the full S positions
    aligned = lossfx.reconstruct_opd_full_teacher_logits(
        torch.nn.functional.pad(payload, (0, 0, 0, S - payload.shape[1])),
        teacher_payload="logits",
        student_logits=local,
        vocab_parallel_rank=0,
        context_parallel_group=None,
        cp_sharder=ContiguousSharder(group),
    )
    return (student, teacher, neg_h), (draft, mask), opd, aligned


@pytest.mark.distributed
def test_public_functions_take_cp_sharder():
    case = _case(3)
    z, data = case["z"], case["data"]
    want_distill = reference.distillation_topk_logprobs(
        z, data["teacher_topk_logits"], data["teacher_topk_indices"], True, True
    )
    want_draft = reference.draft_targets(z, data["token_mask"], D2T)
    teacher = reference.opd_full_teacher_logits(data["teacher_full_logits"], S, teacher_payload="logits")
    want_opd = reference.opd_full_loss_input(
        z, teacher, data["input_ids"], validate_decomposition=True, reference_policy_kl_penalty=0.5
    )
    for rank, (distill, draft, opd, aligned) in enumerate(run_ranks(2, _public_rank, case)):
        for got, want in zip(distill, want_distill):
            torch.testing.assert_close(got, want, **TIGHT)
        for got, want in zip(draft, want_draft):
            torch.testing.assert_close(got, _local(want, "sharder", S, 2, rank), **TIGHT)
        for key, want in want_opd.items():
            torch.testing.assert_close(opd[key], want, **TIGHT)
        torch.testing.assert_close(aligned, _local(teacher, "sharder", S, 2, rank), **TIGHT)


def gloo_branches_job(rank, world, group, kind, case):
    """Every branch, eager, in one layout kind, on a real gloo group (CP over all ranks)."""
    return {branch: _branch_rank(rank, world, group, 1, kind, branch, case)[:2] for branch in GRAD_KEYS}


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:.*valid tokens have -inf")
@pytest.mark.parametrize("kind", ["layout", "sharder"])
def test_every_branch_in_a_sharder_layout_on_gloo(kind):
    """The real backend: a layout object and an external sharder as `cp_sharder=` on 2 gloo
    processes, every branch equal to the reference (values and gradients)."""
    from harness import gloo_pool

    case = _case(7)
    results = gloo_pool(2).run(gloo_branches_job, kind, case)
    for branch in GRAD_KEYS:
        want, want_grad = _reference(branch, case)
        for rank, per_rank in enumerate(results):
            out, grad = per_rank[branch]
            for key, value in want.items():
                if value is None or key == "student_logits":
                    continue
                expected = _local(value, kind, S, 2, rank) if branch == "draft" else value
                torch.testing.assert_close(out[key], expected, **TIGHT)
            if want_grad is not None:
                torch.testing.assert_close(grad, _local(want_grad, kind, S, 2, rank), **TIGHT)


# ---------------------------------------------------------------------------------------------
# 3. Compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_einops_layouts_compile_without_graph_break():
    """The load-balanced split and its inverse (einops patterns, in the layout and in the
    reference) and the packed index maps trace with `fullgraph=True`: one graph, no recompile for
    new values of one shape, one more for a new sequence dim."""
    from torch._dynamo.testing import CompileCounter

    def fn(x, seq_dim: int):
        local = lossfx.shard_for_cp_rank(x, 1, 2, seq_dim=seq_dim)
        return local, reference.cp_shard(x, 1, 2, seq_dim), lossfx.unshard([local, local], seq_dim)

    counter = CompileCounter()
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for seed in range(2):
        x = torch.randn(3, 8, 2, generator=torch.Generator().manual_seed(seed))
        for got, want in zip(compiled(x, 1), fn(x, 1)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1
    compiled(torch.randn(8, 3), 0)
    assert counter.frame_count == 2

    layout = PackedLayout(torch.tensor([0, 3, 9]), torch.tensor([0, 4, 12]), None, prepacked=True)
    packed = CompileCounter()
    to_local = torch.compile(lambda x: layout.to_canonical(layout.to_local(x, 12)), backend=packed, fullgraph=True)
    x = torch.randn(1, 12, 2)
    assert torch.equal(to_local(x), x) and packed.frame_count == 1


@pytest.mark.compile
@pytest.mark.distributed
# opd_full with -m slow: by default it compiles under CP 2 in tests/test_opd_full.py
@pytest.mark.parametrize(
    "branch", ["logprob", "distillation", "draft", pytest.param("opd_full", marks=pytest.mark.slow)]
)
def test_sharder_layout_compiles_on_every_branch(branch):
    """An external sharder's layout under `fullgraph=True` (aot_eager) on CP 2: equal to the
    reference, one compile for three calls with new values. DRAFT gathers before it shards, so
    its first call sees the test sharder without a remembered length and the second with one (a
    guard on the sharder's state): two compiles, then none."""
    for seed in (0, 1, 2):
        results = _check_branch(2, 1, "sharder", branch, seed=seed, backend="aot_eager")
    assert [frames for _, _, frames in results] == [2 if branch == "draft" else 1] * 2


# with -m slow: by default the sharder layout compiles on the logits branches (above) and the fused
# next-token path compiles under CP 2 in tests/test_fused_linear.py (test_compiled_next_token_context_parallel)
@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.distributed
def test_fused_next_token_with_sharder_compiles():
    """The fused head's next-token path in an external sharder's layout, `fullgraph=True`
    (aot_eager) on CP 2: equal to the reference, one compile for three calls."""
    for seed in (0, 1, 2):
        frames = _check_fused(2, 1, "sharder", False, "aot_eager", seed)
    assert frames == [1, 1]


# ---------------------------------------------------------------------------------------------
# 4. Errors
# ---------------------------------------------------------------------------------------------


class _NoGather:
    def shard_token_tensor(self, x, seq_dim=1, fill=0):
        return x


@pytest.mark.parametrize("branch", ["logprob", "distillation", "draft", "opd_full"])
def test_sharder_without_methods_raises_type_error(branch):
    case = _case(0)
    with pytest.raises(TypeError, match=r"cp_sharder must have .*_NoGather.*lacks \['gather_token_tensor'\]"):
        _branch_step(branch, 0, None, {"cp_sharder": _NoGather()})(case["z"], case["data"], case["g"])
    with pytest.raises(TypeError, match="cp_sharder"):
        lossfx.linear_next_token_logprobs(case["hidden"], case["weight"], case["data"]["input_ids"], cp_sharder=3)
    with pytest.raises(TypeError, match="cp_sharder"):
        lossfx.shift_left(case["z"], cp_sharder=object())


def _uncovered_rank(rank, world, group, branch, kind):
    case = _case(0)
    local = case["z"][:, :4]  # 4 positions on each of 2 ranks: 8 < S = 11 (the sharder: blocks of 6)
    try:
        _branch_step(branch, 0, None, _cp_kwargs(kind, group))(local, case["data"], case["g"])
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("branch", ["logprob", "distillation", "draft", "opd_full"])
def test_sequence_not_covered_raises_on_every_rank(branch, kind):
    for message in run_ranks(2, _uncovered_rank, branch, kind):
        assert message is not None
        if kind == "sharder":
            # DRAFT gathers first (the shift), the others lay the canonical ids out first
            assert "cp_sharder=ContiguousSharder" in message
            assert ("returned 8 canonical positions" if branch == "draft" else "local logits hold 4") in message
        elif branch == "opd_full":
            assert "more than the student window" in message
        else:
            assert "hold 4 positions on each of 2 ranks" in message and "(2, 4, 8)" in message


def test_plain_layout_length_mismatch_names_the_canonical_tensor():
    case = _case(0)
    with pytest.raises(ValueError, match="student_logits must cover teacher_topk_indices' 11 positions"):
        _branch_step("distillation", 0, None, {})(case["z"][:, :9], case["data"], case["g"])
    with pytest.raises(ValueError, match="logits must cover token_mask' 11 positions"):
        _branch_step("draft", 0, None, {})(case["z"][:, :9], case["data"], case["g"])


def _odd_shift_rank(rank, world, group):
    with pytest.raises(ValueError, match="even length"):
        lossfx.shift_left(torch.zeros(1, 3, 4), group)
    with pytest.raises(ValueError, match="even length"):
        lossfx.shift_left(torch.zeros(1, 3, 4), cp_sharder=LoadBalancedLayout(group))
    return True


@pytest.mark.distributed
def test_shift_left_of_an_odd_load_balanced_shard_raises():
    assert all(run_ranks(2, _odd_shift_rank))


def test_every_entry_point_checks_the_context_parallel_group_type():
    """`sequence_layout` checks `context_parallel_group` for every entry point that builds a layout
    (a group name instead of the group was an AttributeError from deep inside before)."""
    from types import SimpleNamespace

    import lossfx
    from lossfx.next_token import sharded_next_token_logprobs

    z, ids = torch.zeros(1, 4, 5), torch.zeros(1, 4, dtype=torch.long)
    hidden, weight = torch.zeros(1, 4, 3), torch.zeros(5, 3)
    values, top_ids = torch.zeros(1, 4, 2), torch.zeros(1, 4, 2, dtype=torch.long)
    logprob = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    calls = {
        "next_token_logprobs": lambda cp: lossfx.next_token_logprobs(z, ids, context_parallel_group=cp),
        "sharded_next_token_logprobs": lambda cp: sharded_next_token_logprobs(z, ids, context_parallel_group=cp),
        "linear_next_token_logprobs": lambda cp: lossfx.linear_next_token_logprobs(
            hidden, weight, ids, context_parallel_group=cp
        ),
        "distillation_topk_logprobs": lambda cp: lossfx.distillation_topk_logprobs(
            z, values, top_ids, zero_outside_topk=True, calculate_entropy=False, context_parallel_group=cp
        ),
        "prepare_loss_input": lambda cp: lossfx.prepare_loss_input(
            z, {"input_ids": ids}, logprob, context_parallel_group=cp
        ),
        "prepare_linear_loss_input": lambda cp: lossfx.prepare_linear_loss_input(
            hidden, weight, {"input_ids": ids}, logprob, context_parallel_group=cp
        ),
    }
    for name, call in calls.items():
        call(None)  # valid without the bad group
        with pytest.raises(
            TypeError, match=r"context_parallel_group must be a torch\.distributed\.ProcessGroup"
        ) as err:
            call("cp")
        assert "got 'cp'" in str(err.value), name
