"""DTensor inputs on every public function, on a real 2-process gloo `DeviceMesh`.

Each case runs a public function on its differentiable inputs placed over the mesh, backpropagates
a fixed weighting of its outputs, and compares the outputs and every input's full gradient (which
must keep that input's placement) with `lossfx.reference` in float64 at 1e-10. Logits are
`Shard(-1)` DTensors (an uneven vocabulary, 6 + 5 columns, unless stated) and the other arguments
plain tensors or `Replicate()` DTensors; results are plain tensors, except the vocabulary-sharded
ones (`VOCAB_SHARDED`), DTensors placed like the logits. The fused LM head is a `Shard(0)` DTensor
weight `[V, H]` (`hidden` plain, `Replicate()` or sequence-parallel). Every case also runs on even
shards (V = 12) or on the tp dim of a (dp=1, tp=2) mesh. A few cases, one per distinct path through
`lossfx/_boundary/dtensor.py` and the fused head, are also run under `torch.compile(fullgraph=True)`
with one compile each (aot_eager; `-m slow`: every path, aot_eager and inductor).
"""

from types import SimpleNamespace

import pytest
import torch
from harness import as_tuple as _as_tuple
from harness import compiled_for_rank, device_mesh, gloo_pool, value_error_messages

import lossfx
from lossfx import reference

pytestmark = pytest.mark.distributed

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
B, S, K, H = 2, 6, 3, 5
CU = [0, 3, 9]  # two packed sequences
TOP = {"top_k": 4, "top_p": 0.7}
T = 0.7  # temperature


def _case(vocab):
    gen = torch.Generator().manual_seed(vocab)
    z = torch.randn(B, S, vocab, generator=gen, dtype=F64) * 2
    hidden = torch.randn(B, S, H, generator=gen, dtype=F64)
    return {
        "z": z,
        "sampled": torch.cat([torch.zeros(B, 1, dtype=torch.int64), z[:, :-1].argmax(-1)], 1),  # inside any filter
        "ids": torch.randint(0, vocab, (B, S), generator=gen),
        "teacher": torch.randn(B, S, vocab, generator=gen, dtype=F64),
        "topk_logits": torch.randn(B, S, K, generator=gen, dtype=F64),
        "topk_ids": torch.randint(0, vocab, (B, S, K), generator=gen),
        "packed": torch.randn(1, CU[-1], vocab, generator=gen, dtype=F64),
        "mask": (torch.rand(B, S, generator=gen) > 0.3).to(torch.int64),
        "d2t": torch.tensor([0, 3, 1, 5]),
        "lp": -torch.rand(B, S, generator=gen, dtype=F64),
        "payload": torch.randn(B, 4, vocab, generator=gen, dtype=F64),
        "hidden": hidden,
        "hidden_rows": hidden.flatten(0, 1),
        "weight": torch.randn(vocab, H, generator=gen, dtype=F64),
        "a": torch.randn(B, S, generator=gen, dtype=F64),
        "b": torch.randn(B, S, generator=gen, dtype=F64),
    }


# ---------------------------------------------------------------------------------------------
# The cases: name -> (differentiable inputs, lossfx call on them, the dense reference).
# Inputs: ((key of _case, layout), ...); a layout is the dim sharded over the tensor-parallel
# (last) mesh dim, "rep" (`Replicate()`) or None (a plain tensor).
# `d` holds the DTensor helpers of the running rank: d.shard[key], d.rep[key], d.local[key].
# ---------------------------------------------------------------------------------------------

Z = (("z", 2),)
HEAD = (("hidden", None), ("weight", 0))
SP_ROWS = (("hidden_rows", 0), ("weight", 0))


def _logprob(kind, **extra):
    return SimpleNamespace(input_type=kind, **extra)


# built outside any compiled function (Dynamo does not construct SimpleNamespace)
LOGPROB = _logprob("logprob")
LOGPROB_KL = _logprob("logprob", reference_policy_kl_penalty=0.1)
SAMPLING = lossfx.TrainingSamplingParams(**TOP)


def _filtered_entry(z, c, d):
    data = {"input_ids": d.rep["sampled"], "token_mask": d.rep["mask"]}
    out, data_out = lossfx.prepare_loss_input(z, data, LOGPROB_KL, sampling_params=SAMPLING)
    assert data_out is data, "the caller's data comes back"
    return out["next_token_logprobs"], data["curr_logprobs_unfiltered"]


def _filtered_entry_ref(z, c):
    lp = reference.next_token_filtered_logprobs(z, c["sampled"], **TOP)
    return reference.mask_out_neg_inf_logprobs(lp, c["mask"][:, 1:]), reference.next_token_logprobs(z, c["sampled"])


def _logit_entry(z, c, d):
    out, _ = lossfx.prepare_loss_input(z, {"input_ids": c["ids"]}, _logprob("logit"))
    assert out["logits"] is z, "LOGIT returns the DTensor unchanged"
    return (out["logits"],)


def _detached(outs):
    return tuple(t.detach() for t in outs)


# prepare_opd_full_loss_input's keywords without defaults, for an unsharded (or DTensor) call
NO_GROUPS = dict.fromkeys(
    ["vocab_parallel_rank", "vocab_parallel_group", "context_parallel_group", "sampling_params", "chunk_size"]
)


def _opd_loss_fn():
    return _logprob("opd_full", opd_full=lossfx.OnPolicyDistillationFullConfig(enabled=True, teacher_payload="logits"))


CASES = {
    "token_logprobs": (
        Z,
        lambda z, c, d: lossfx.token_logprobs(z, d.rep["ids"]),
        lambda z, c: reference.token_logprobs(z, c["ids"]),
    ),
    "token_logprobs_with_lse": (
        Z,
        lambda z, c, d: lossfx.token_logprobs_with_lse(z, c["ids"]),
        lambda z, c: (reference.token_logprobs(z, c["ids"]), z.detach().logsumexp(-1)),
    ),
    "filtered_token_logprobs": (
        Z,
        lambda z, c, d: lossfx.filtered_token_logprobs(z, c["ids"], **TOP),
        lambda z, c: reference.filtered_token_logprobs(z, c["ids"], **TOP),
    ),
    "top_k_top_p_threshold": (
        Z,
        lambda z, c, d: lossfx.top_k_top_p_threshold(z, **TOP),
        lambda z, c: torch.where(reference.apply_top_k_top_p(z, **TOP)[1], z, torch.inf).amin(-1).detach(),
    ),
    "apply_top_k_top_p": (
        Z,
        lambda z, c, d: lossfx.apply_top_k_top_p(z, **TOP),
        lambda z, c: reference.apply_top_k_top_p(z, **TOP),
    ),
    "next_token_filtered_logprobs": (
        Z,
        lambda z, c, d: lossfx.next_token_filtered_logprobs(z, d.rep["ids"], **TOP),
        lambda z, c: reference.next_token_filtered_logprobs(z, c["ids"], **TOP),
    ),
    "mask_out_neg_inf_logprobs": (
        Z,
        lambda z, c, d: lossfx.mask_out_neg_inf_logprobs(d.rep["lp"], d.rep["mask"]),
        lambda z, c: reference.mask_out_neg_inf_logprobs(c["lp"], c["mask"]),
    ),
    "gather_logprobs": (
        Z,
        lambda z, c, d: lossfx.gather_logprobs(z, d.rep["topk_ids"], with_neg_entropy=True),
        lambda z, c: reference.gather_logprobs(z, c["topk_ids"]),
    ),
    "gather_logits": (
        Z,
        lambda z, c, d: lossfx.gather_logits(z, c["topk_ids"]),
        lambda z, c: z.gather(-1, c["topk_ids"]),
    ),
    "entropy": (Z, lambda z, c, d: lossfx.neg_entropy(z), lambda z, c: reference.neg_entropy(z)),
    "cross_entropy_to_fixed": (
        Z,
        lambda z, c, d: lossfx.cross_entropy_to_fixed(z, d.shard["teacher"]),
        lambda z, c: reference.cross_entropy_to_fixed(z, c["teacher"]),
    ),
    "reverse_kl_to_fixed": (  # a plain teacher is this rank's shard (the process-group convention)
        Z,
        lambda z, c, d: lossfx.reverse_kl_to_fixed(z, d.local["teacher"]),
        lambda z, c: reference.reverse_kl_to_fixed(z, c["teacher"]),
    ),
    # vocab_topk's values carry no gradient (lossfx's contract)
    "vocab_topk": (Z, lambda z, c, d: lossfx.vocab_topk(z, 4), lambda z, c: _detached(reference.vocab_topk(z, 4))),
    "vocab_topk_all": (
        Z,
        lambda z, c, d: lossfx.vocab_topk(z, 99),
        lambda z, c: _detached(reference.vocab_topk(z, 99)),
    ),
    "distillation_topk_logprobs": (
        Z,
        lambda z, c, d: lossfx.distillation_topk_logprobs(
            z, d.rep["topk_logits"], d.rep["topk_ids"], zero_outside_topk=True, calculate_entropy=True
        ),
        lambda z, c: reference.distillation_topk_logprobs(z, c["topk_logits"], c["topk_ids"], True, True),
    ),
    "shift_left": (
        Z,
        lambda z, c, d: lossfx.shift_left(z),
        lambda z, c: torch.cat([z[:, 1:], torch.zeros_like(z[:, :1])], 1),
    ),
    "map_to_draft_vocab": (
        Z,
        lambda z, c, d: lossfx.map_to_draft_vocab(z, c["d2t"]),
        lambda z, c: z[..., torch.arange(4) + c["d2t"]],
    ),
    "draft_targets": (
        Z,
        lambda z, c, d: lossfx.draft_targets(z, d.rep["mask"], c["d2t"])[0],
        lambda z, c: reference.draft_targets(z, c["mask"], c["d2t"])[0],
    ),
    "next_token_logprobs": (
        Z,
        lambda z, c, d: lossfx.next_token_logprobs(z, d.rep["ids"]),
        lambda z, c: reference.next_token_logprobs(z, c["ids"]),
    ),
    "prepare_loss_input/logprob": (
        Z,
        lambda z, c, d: lossfx.prepare_loss_input(z, {"input_ids": c["ids"]}, LOGPROB)[0]["next_token_logprobs"],
        lambda z, c: reference.next_token_logprobs(z, c["ids"]),
    ),
    "prepare_loss_input/logprob_filtered": (Z, _filtered_entry, _filtered_entry_ref),
    "prepare_loss_input/logit": (Z, _logit_entry, lambda z, c: (z,)),
    "prepare_loss_input/distillation": (
        Z,
        lambda z, c, d: tuple(
            lossfx.prepare_loss_input(
                z,
                {"teacher_topk_logits": d.rep["topk_logits"], "teacher_topk_indices": c["topk_ids"]},
                _logprob("distillation", zero_outside_topk=True, kl_type="reverse"),
            )[0].values()
        ),
        lambda z, c: reference.distillation_topk_logprobs(z, c["topk_logits"], c["topk_ids"], True, True),
    ),
    "prepare_loss_input/draft": (
        Z,
        lambda z, c, d: lossfx.prepare_loss_input(
            z, {"token_mask": c["mask"], "student_logits": c["z"]}, _logprob("draft"), d2t=c["d2t"]
        )[0]["teacher_logits"],
        lambda z, c: reference.draft_targets(z, c["mask"], c["d2t"])[0],
    ),
    "prepare_loss_input/opd_full": (
        Z,
        lambda z, c, d: lossfx.prepare_loss_input(
            z, {"input_ids": c["ids"], "teacher_full_logits": d.rep["teacher"]}, _opd_loss_fn()
        )[0]["opd_full_divergence"],
        lambda z, c: reference.opd_full_loss_input(z, c["teacher"], c["ids"])["opd_full_divergence"],
    ),
    "prepare_opd_full_loss_input": (
        Z,
        lambda z, c, d: lossfx.prepare_opd_full_loss_input(
            z, {"input_ids": c["ids"], "teacher_full_logits": c["teacher"]}, _opd_loss_fn(), **NO_GROUPS
        )["opd_full_divergence"],
        lambda z, c: reference.opd_full_loss_input(z, c["teacher"], c["ids"])["opd_full_divergence"],
    ),
    "reconstruct_opd_full_teacher_logits": (
        Z,
        lambda z, c, d: lossfx.reconstruct_opd_full_teacher_logits(
            d.rep["payload"],
            teacher_payload="logits",
            student_logits=z,
            vocab_parallel_rank=None,
            context_parallel_group=None,
        ),
        lambda z, c: reference.opd_full_teacher_logits(c["payload"], S, teacher_payload="logits"),
    ),
    "prepare_packed_loss_input": (
        (("packed", 2),),
        lambda z, c, d: lossfx.prepare_packed_loss_input(z, {"input_ids": d.rep["ids"]}, _logprob("logprob"), CU, CU)[
            0
        ]["next_token_logprobs"],
        lambda z, c: reference.packed_next_token_logprobs(z, c["ids"], CU, CU),
    ),
    "shard_for_cp_rank": (
        Z,
        lambda z, c, d: lossfx.shard_for_cp_rank(d.rep["teacher"], 1, 3),
        lambda z, c: reference.cp_shard(c["teacher"], 1, 3),
    ),
    # the fused LM head: a `Shard(0)` weight (a `ColwiseParallel` head), `hidden` plain, `Replicate()`
    # or, with `sequence_parallel=True`, sharded like the head (rows of `[B·S, H]`, or `[B, S, H]` on S)
    "fused/token/plain_hidden": (
        HEAD,
        lambda h, w, c, d: lossfx.linear_token_logprobs(h, w, c["ids"], temperature=T, return_neg_entropy=True),
        lambda h, w, c: reference.linear_token_logprobs(h, w, c["ids"], T),
    ),
    "fused/token/replicated_hidden_and_target": (
        (("hidden", "rep"), ("weight", 0)),
        lambda h, w, c, d: lossfx.linear_token_logprobs(h, w, d.rep["ids"], chunk_size=5),
        lambda h, w, c: reference.linear_token_logprobs(h, w, c["ids"])[0],
    ),
    "fused/gather/renormalised": (
        HEAD,
        lambda h, w, c, d: lossfx.linear_gather_logprobs(
            h, w, c["topk_ids"], zero_outside_topk=False, with_neg_entropy=True, temperature=T
        ),
        lambda h, w, c: reference.linear_gather_logprobs(h, w, c["topk_ids"], False, T),
    ),
    "fused/token/sequence_parallel_rows": (
        SP_ROWS,
        lambda h, w, c, d: lossfx.linear_token_logprobs(h, w, c["ids"].flatten(), sequence_parallel=True),
        lambda h, w, c: reference.linear_token_logprobs(h, w, c["ids"].flatten())[0],
    ),
    "fused/next_token/plain_hidden": (
        HEAD,
        lambda h, w, c, d: lossfx.linear_next_token_logprobs(h, w, c["ids"], return_neg_entropy=True),
        lambda h, w, c: reference.linear_next_token_logprobs(h, w, c["ids"]),
    ),
    "fused/next_token/sequence_parallel": (
        (("hidden", 1), ("weight", 0)),
        lambda h, w, c, d: lossfx.linear_next_token_logprobs(h, w, c["ids"], sequence_parallel=True, temperature=T),
        lambda h, w, c: reference.linear_next_token_logprobs(h, w, c["ids"], T)[0],
    ),
    "fused/objective/plain_hidden": (
        HEAD,
        lambda h, w, c, d: lossfx.linear_logprob_objective(
            h, w, c["ids"], c["a"], neg_entropy_weight=c["b"], chunk_size=3
        )[0],
        lambda h, w, c: reference.linear_logprob_objective(h, w, c["ids"], c["a"], c["b"])[0],
    ),
    "fused/objective/sequence_parallel_rows": (
        SP_ROWS,
        lambda h, w, c, d: lossfx.linear_logprob_objective(
            h, w, c["ids"].flatten(), c["a"].flatten(), sequence_parallel=True, temperature=T
        )[0],
        lambda h, w, c: reference.linear_logprob_objective(h, w, c["ids"].flatten(), c["a"].flatten(), None, T)[0],
    ),
}


# results that are DTensors placed like the logits (every other result is a plain tensor)
VOCAB_SHARDED = {
    "apply_top_k_top_p",
    "shift_left",
    "map_to_draft_vocab",
    "draft_targets",
    "prepare_loss_input/logit",
    "prepare_loss_input/draft",
    "reconstruct_opd_full_teacher_logits",
}
FUSED = [n for n in CASES if n.startswith("fused/")]
EVEN_AND_2D = ["token_logprobs", "prepare_loss_input/logprob_filtered", "apply_top_k_top_p"]
FUSED_2D = ["fused/token/replicated_hidden_and_target", "fused/token/sequence_parallel_rows"]
FUSED_2D += ["fused/next_token/sequence_parallel"]

# one compiled case per distinct path through lossfx/_boundary/dtensor.py and the fused head; the
# default suite compiles the cheap ones with aot_eager (an inductor compile costs ~20-40 s here),
# `-m slow` all of them with both backends
COMPILED = [
    "token_logprobs",  # kernel with offsets from the placement
    "prepare_loss_input/logprob",  # entry point, uneven shard padded to the even width
    "fused/token/plain_hidden",  # a Shard(0) head
    "fused/objective/plain_hidden",
]
COMPILED_SLOW = [
    *COMPILED,
    "next_token_logprobs",  # uneven shard padded to the even width
    "apply_top_k_top_p",  # vocabulary-sharded results wrapped back into DTensors
    "cross_entropy_to_fixed",  # a teacher sharded like the logits
    "prepare_loss_input/logprob_filtered",  # DTensor data columns, written column
]


def _loss(outs):
    """A fixed weighting of every differentiable output (non-finite entries count as 0)."""
    total = torch.zeros((), dtype=F64)
    for t in outs:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.numel():
            weight = torch.linspace(-1, 1, t.numel(), dtype=F64).view(t.shape)
            total = total + (torch.where(torch.isfinite(t), t, torch.zeros_like(t)).to(F64) * weight).sum()
    return total


def _placements(layout, mesh_ndim):
    """`layout` (see CASES) as DTensor placements on a mesh of `mesh_ndim` dims."""
    from torch.distributed.tensor import Replicate, Shard

    on_tp = Replicate() if layout == "rep" else Shard(layout)
    return [Replicate()] * (mesh_ndim - 1) + [on_tp]


def _place(x, layout, mesh):
    """`x` as this rank's input of `layout`: a fresh plain tensor (None) or a DTensor on `mesh`."""
    from torch.distributed.tensor import distribute_tensor

    return (
        x.clone() if layout is None else distribute_tensor(x, mesh, _placements(layout, mesh.ndim), src_data_rank=None)
    )


# ---------------------------------------------------------------------------------------------
# Worker side (runs in each gloo process)
# ---------------------------------------------------------------------------------------------


def _helpers(mesh, case):
    """The case's tensors as DTensors, built before any compiled call (`d.rep["ids"]`, ...)."""
    shard = {k: _place(v, 2, mesh) for k, v in case.items() if v.dim() == 3}
    return SimpleNamespace(
        placements=_placements(2, mesh.ndim),  # the logits' vocabulary dim
        rep={k: _place(v, "rep", mesh) for k, v in case.items()},
        shard=shard,
        local={k: v.to_local() for k, v in shard.items()},
    )


def _run_cases(rank, world, group, vocab, names, backend=None, mesh_shape=(2,)):
    from torch.distributed.tensor import DTensor

    mesh = device_mesh(tuple(mesh_shape), None if len(mesh_shape) == 1 else ("dp", "tp"))
    c = _case(vocab)
    d = _helpers(mesh, c)
    results = {}
    for name in names:
        inputs, call, _ = CASES[name]
        leaves = [_place(c[key], layout, mesh).requires_grad_() for key, layout in inputs]
        fn, counter = call, None
        if backend is not None:
            counter, fn = compiled_for_rank(rank, (name, vocab, tuple(mesh_shape)), call, backend)
        outs = _as_tuple(fn(*leaves, c, d))
        for o in outs:
            placed = tuple(o.placements) if isinstance(o, DTensor) else None
            assert placed == (tuple(d.placements) if name in VOCAB_SHARDED else None), (name, type(o), placed)
        outs = tuple(o.full_tensor() if isinstance(o, DTensor) else o for o in outs)
        loss = _loss(outs)
        if loss.requires_grad:
            loss.backward()
        grads = [
            (g.full_tensor(), str(tuple(g.placements))) if isinstance(g, DTensor) else (g, "plain")
            for g in (leaf.grad for leaf in leaves)
        ]
        frames = None if counter is None else counter.frame_count
        results[name] = ([o.detach() if isinstance(o, torch.Tensor) else o for o in outs], grads, frames)
    return results


def _reference(name, vocab):
    inputs, _, ref = CASES[name]
    c = _case(vocab)
    leaves = [c[key].clone().requires_grad_() for key, _ in inputs]
    outs = _as_tuple(ref(*leaves, c))
    loss = _loss(outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    return [o.detach() for o in outs], grads


def _check(results, vocab, mesh_ndim=1, frames=None):
    for name in results[0]:
        ref_outs, ref_grads = _reference(name, vocab)
        for rank, per_rank in enumerate(results):
            outs, grads, n_frames = per_rank[name]
            msg = f"{name} V={vocab} rank {rank}"
            say = lambda m, msg=msg: f"{msg}: {m}"  # noqa: E731
            assert len(outs) == len(ref_outs), msg
            for out, ref in zip(outs, ref_outs):
                torch.testing.assert_close(out, ref.to(out.dtype), **TIGHT, equal_nan=True, msg=say)
            for (key, layout), (grad, where), ref_grad in zip(CASES[name][0], grads, ref_grads):
                if ref_grad is None:
                    assert grad is None, f"{msg}: d{key}"
                    continue
                torch.testing.assert_close(grad, ref_grad, **TIGHT, msg=lambda m, k=key, s=msg: f"{s} d{k}: {m}")
                want = "plain" if layout is None else str(tuple(_placements(layout, mesh_ndim)))
                assert where == want, f"{msg}: d{key} placement {where}"
            if frames is not None:
                assert n_frames == frames, f"{msg}: {n_frames} compiles"


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_every_public_function_on_uneven_shard_dtensor():
    _check(gloo_pool(2).run(_run_cases, 11, list(CASES)), 11)


def test_even_shards():
    names = EVEN_AND_2D + FUSED
    _check(gloo_pool(2).run(_run_cases, 12, names), 12)


def test_one_dim_of_a_2d_mesh():
    """mesh (dp=1, tp=2): the vocabulary (logits, head) sharded over the second mesh dim."""
    _check(gloo_pool(2).run(_run_cases, 11, EVEN_AND_2D + FUSED_2D, mesh_shape=(1, 2)), 11, mesh_ndim=2)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_fullgraph(backend):
    _check(gloo_pool(2).run(_run_cases, 11, COMPILED, backend), 11, frames=1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_every_path(backend):
    _check(gloo_pool(2).run(_run_cases, 11, COMPILED_SLOW, backend), 11, frames=1)


def _host_reads_in_compiled_graph(rank, world, group):
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch.distributed.tensor import Shard, distribute_tensor

    c = _case(11)
    z = distribute_tensor(c["z"], device_mesh((2,)), [Shard(2)], src_data_rank=None)
    targets = []

    def backend(gm, inputs):
        def forward(graph, _):
            targets.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            return graph

        return aot_module_simplified(gm, inputs, fw_compiler=forward)

    out = torch.compile(lambda z: lossfx.token_logprobs(z, c["ids"]), backend=backend, fullgraph=True)(z)
    torch.testing.assert_close(out, reference.token_logprobs(c["z"], c["ids"]), **TIGHT)
    return [t for t in targets if "_local_scalar_dense" in t]


def test_compiled_dtensor_offset_is_not_read_from_a_tensor():
    # the shard's vocab_start comes from the mesh coordinate: no host read in the graph (torch's
    # compute_local_shape_and_global_offset put one there, an unbacked value checks cannot branch on)
    assert gloo_pool(2).run(_host_reads_in_compiled_graph) == [[], []]


# name -> what its ValueError says (every part), on every rank
ERRORS = {
    "partial": ["Partial"],
    "shard_batch": ["Shard(dim=0)"],
    "group_without_tp": ["disagrees"],
    "rank": ["vocab_parallel_rank=", "disagrees"],  # the caller's name
    "vocab_start": ["vocab_start=3"],
    "vocab_size": ["vocab_size=8"],
    "teacher": ["teacher", "Replicate"],
    "ids_sharded": ["target", "Shard(dim=0)"],
    "fused/weight_shard1": ["Shard(dim=1)"],
    "fused/vocab_size": ["vocab_size=12"],
    "fused/sp_replicated_hidden": ["sequence_parallel=True"],
    "fused/sharded_hidden_without_sp": ["hidden", "Shard(dim=0)"],
    "fused/sp_hidden_uneven": ["split evenly"],
    "fused/sp_hidden_plain_weight": ["not the weight's tensor-parallel group"],
}


def _errors(rank, world, group):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = device_mesh((2,))
    z = torch.randn(2, 3, 8, dtype=F64)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    sharded = DTensor.from_local(z, mesh, [Shard(2)])  # global vocabulary 16
    h, w, target = torch.randn(4, 3, dtype=F64), torch.randn(5, 3, dtype=F64), torch.zeros(4, dtype=torch.int64)
    w_sharded = DTensor.from_local(w, mesh, [Shard(0)])  # V = 10
    calls = {
        "partial": lambda: lossfx.token_logprobs(DTensor.from_local(z, mesh, [Partial()]), ids),
        "shard_batch": lambda: lossfx.neg_entropy(DTensor.from_local(z, mesh, [Shard(0)])),
        "group_without_tp": lambda: lossfx.token_logprobs(DTensor.from_local(z, mesh, [Replicate()]), ids, group=group),
        "rank": lambda: lossfx.next_token_logprobs(
            sharded, ids, vocab_parallel_rank=1 - rank, vocab_parallel_group=group
        ),
        "vocab_start": lambda: lossfx.token_logprobs(sharded, ids, group=group, vocab_start=3),
        "vocab_size": lambda: lossfx.gather_logits(sharded, ids[..., None], vocab_size=8),
        "teacher": lambda: lossfx.cross_entropy_to_fixed(sharded, DTensor.from_local(z, mesh, [Replicate()])),
        "ids_sharded": lambda: lossfx.token_logprobs(sharded, DTensor.from_local(ids, mesh, [Shard(0)])),
        "fused/weight_shard1": lambda: lossfx.linear_token_logprobs(h, DTensor.from_local(w, mesh, [Shard(1)]), target),
        "fused/vocab_size": lambda: lossfx.linear_token_logprobs(h, w_sharded, target, vocab_size=12),
        "fused/sp_replicated_hidden": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h, mesh, [Replicate()]), w_sharded, target, sequence_parallel=True
        ),
        "fused/sharded_hidden_without_sp": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h, mesh, [Shard(0)]), w_sharded, target
        ),
        "fused/sp_hidden_uneven": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h[: 3 - rank], mesh, [Shard(0)], shape=torch.Size([5, 3]), stride=(3, 1)),
            w_sharded,
            torch.zeros(5, dtype=torch.int64),
            sequence_parallel=True,
        ),
        "fused/sp_hidden_plain_weight": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h, mesh, [Shard(0)]), w, torch.zeros(8, dtype=torch.int64), sequence_parallel=True
        ),
    }
    messages = value_error_messages(calls)
    # an explicit group that agrees is accepted
    lossfx.token_logprobs(sharded, ids, group=group, vocab_start=8 * rank, vocab_size=16)
    return messages


def test_bad_placements_and_contradicting_arguments_raise():
    for rank, messages in enumerate(gloo_pool(2).run(_errors)):
        for name, parts in ERRORS.items():
            assert all(part in messages[name] for part in parts), (name, rank, parts, messages[name])


def test_shard_start_follows_torchs_shard_rule():
    # the offset is computed from the mesh coordinate (a Python int, static under compile); it
    # must be torch's: uneven sizes, more parts than entries (empty last shards), size 0
    from torch.distributed.tensor import Shard

    from lossfx._boundary.dtensor import _shard_start

    for size in range(0, 14):
        for parts in range(1, 7):
            starts = [_shard_start(size, parts, r) for r in range(parts)]
            for r in range(parts):
                width, offset = Shard.local_shard_size_and_offset(size, parts, r)
                assert starts[r] == offset, (size, parts, r)
                assert (starts[r + 1] if r + 1 < parts else size) - starts[r] == width, (size, parts, r)
