"""DTensor inputs of the fused LM-head functions, on a real 2-process gloo `DeviceMesh`.

The LM head is a `Shard(0)` DTensor weight `[V, H]` (a `ColwiseParallel` head; V = 11 rows split
6 + 5, or 12 split 6 + 6); `hidden` is a plain tensor, a `Replicate()` DTensor or, with
`sequence_parallel=True`, sharded on its sequence dim over the same mesh. Each case
backpropagates a fixed weighting of its outputs and compares the outputs, the full weight
gradient (which must keep `Shard(0)`) and the hidden gradient with `lossfx.reference` in float64
at 1e-10, on a 1-D mesh and on the tp dim of a (dp=1, tp=2) mesh. One case runs under
`torch.compile(fullgraph=True)` (aot_eager, one compile).
"""

import pytest
import torch
from harness import as_tuple as _as_tuple
from harness import compiled_for_rank, device_mesh, gloo_pool, value_error_messages

import lossfx
from lossfx import reference

pytestmark = pytest.mark.distributed

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
B, S, H, K = 2, 6, 5, 3
T = 0.7  # temperature


def _case(vocab):
    gen = torch.Generator().manual_seed(vocab)
    return {
        "hidden": torch.randn(B, S, H, generator=gen, dtype=F64),
        "weight": torch.randn(vocab, H, generator=gen, dtype=F64),
        "target": torch.randint(0, vocab, (B, S), generator=gen),
        "ids": torch.randint(0, vocab, (B, S, K), generator=gen),
        "a": torch.randn(B, S, generator=gen, dtype=F64),
        "b": torch.randn(B, S, generator=gen, dtype=F64),
    }


# name -> (hidden layout, lossfx call, dense reference). Layouts: "plain", "rep" (Replicate()),
# "sp_rows" (the flattened [B·S, H] rows, Shard(0)), "sp_seq" ([B, S, H], Shard(1)).
CASES = {
    "token/plain_hidden": (
        "plain",
        lambda h, w, c: lossfx.linear_token_logprobs(h, w, c["target"], temperature=T, return_neg_entropy=True),
        lambda h, w, c: reference.linear_token_logprobs(h, w, c["target"], T),
    ),
    "token/replicated_hidden_and_target": (
        "rep",
        lambda h, w, c: lossfx.linear_token_logprobs(h, w, c["target_rep"], chunk_size=5),
        lambda h, w, c: reference.linear_token_logprobs(h, w, c["target"])[0],
    ),
    "gather/renormalised": (
        "plain",
        lambda h, w, c: lossfx.linear_gather_logprobs(
            h, w, c["ids"], zero_outside_topk=False, with_neg_entropy=True, temperature=T
        ),
        lambda h, w, c: reference.linear_gather_logprobs(h, w, c["ids"], False, T),
    ),
    "token/sequence_parallel_rows": (
        "sp_rows",
        lambda h, w, c: lossfx.linear_token_logprobs(h, w, c["target"].flatten(), sequence_parallel=True),
        lambda h, w, c: reference.linear_token_logprobs(h, w, c["target"].flatten())[0],
    ),
    "next_token/plain_hidden": (
        "plain",
        lambda h, w, c: lossfx.linear_next_token_logprobs(h, w, c["target"], return_neg_entropy=True),
        lambda h, w, c: reference.linear_next_token_logprobs(h, w, c["target"]),
    ),
    "next_token/sequence_parallel": (
        "sp_seq",
        lambda h, w, c: lossfx.linear_next_token_logprobs(h, w, c["target"], sequence_parallel=True, temperature=T),
        lambda h, w, c: reference.linear_next_token_logprobs(h, w, c["target"], T)[0],
    ),
    "objective/plain_hidden": (
        "plain",
        lambda h, w, c: lossfx.linear_logprob_objective(
            h, w, c["target"], c["a"], neg_entropy_weight=c["b"], chunk_size=3
        )[0],
        lambda h, w, c: reference.linear_logprob_objective(h, w, c["target"], c["a"], c["b"])[0],
    ),
    "objective/sequence_parallel_rows": (
        "sp_rows",
        lambda h, w, c: lossfx.linear_logprob_objective(
            h, w, c["target"].flatten(), c["a"].flatten(), sequence_parallel=True, temperature=T
        )[0],
        lambda h, w, c: reference.linear_logprob_objective(h, w, c["target"].flatten(), c["a"].flatten(), None, T)[0],
    ),
}
COMPILED = ["token/plain_hidden", "objective/plain_hidden"]


def _loss(outs):
    total = torch.zeros((), dtype=F64)
    for t in outs:
        total = total + (t.to(F64) * torch.linspace(-1, 1, t.numel(), dtype=F64).view(t.shape)).sum()
    return total


def _mesh(shape=(2,)):
    return device_mesh(shape, None if len(shape) == 1 else ("dp", "tp"))


def _on_tp(mesh, placement):
    """`placement` on the last (tensor-parallel) mesh dim, `Replicate()` on the others."""
    from torch.distributed.tensor import Replicate

    return [Replicate()] * (mesh.ndim - 1) + [placement]


def _hidden(layout, full, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout == "plain":
        return full.clone().requires_grad_()
    if layout == "rep":
        return distribute_tensor(full, mesh, [Replicate()] * mesh.ndim, src_data_rank=None).requires_grad_()
    if layout == "sp_rows":
        return distribute_tensor(full.flatten(0, 1), mesh, _on_tp(mesh, Shard(0)), src_data_rank=None).requires_grad_()
    return distribute_tensor(full, mesh, _on_tp(mesh, Shard(1)), src_data_rank=None).requires_grad_()


def _run(rank, world, group, vocab, names, backend=None, mesh_shape=(2,)):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = _mesh(tuple(mesh_shape))
    c = _case(vocab)
    c["target_rep"] = distribute_tensor(c["target"], mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
    results = {}
    for name in names:
        layout, call, _ = CASES[name]
        w = distribute_tensor(c["weight"], mesh, _on_tp(mesh, Shard(0)), src_data_rank=None).requires_grad_()
        h = _hidden(layout, c["hidden"], mesh)
        fn, counter = call, None
        if backend is not None:
            counter, fn = compiled_for_rank(rank, ("fused", name, vocab), call, backend)
        outs = _as_tuple(fn(h, w, c))
        assert not any(isinstance(o, DTensor) for o in outs), "replicated results are plain tensors"
        _loss(outs).backward()
        hgrad = h.grad.full_tensor() if isinstance(h.grad, DTensor) else h.grad
        hwhere = str(tuple(h.grad.placements)) if isinstance(h.grad, DTensor) else "plain"
        results[name] = (
            [o.detach() for o in outs],
            w.grad.full_tensor(),
            str(tuple(w.grad.placements)),
            hgrad,
            hwhere,
            None if counter is None else counter.frame_count,
        )
    return results


def _reference(name, vocab):
    layout, _, ref = CASES[name]
    c = _case(vocab)
    h = (c["hidden"].flatten(0, 1) if layout == "sp_rows" else c["hidden"]).clone().requires_grad_()
    w = c["weight"].clone().requires_grad_()
    outs = _as_tuple(ref(h, w, c))
    hgrad, wgrad = torch.autograd.grad(_loss(outs), (h, w))
    return [o.detach() for o in outs], wgrad, hgrad


def _placements(layout, mesh_ndim):
    """The expected `str(tuple(grad.placements))` of the weight (`"weight"`) or of a hidden layout."""
    from torch.distributed.tensor import Replicate, Shard

    on_tp = {"weight": Shard(0), "rep": Replicate(), "sp_rows": Shard(0), "sp_seq": Shard(1)}
    return "plain" if layout == "plain" else str((Replicate(),) * (mesh_ndim - 1) + (on_tp[layout],))


def _check(results, vocab, frames=None, mesh_ndim=1):
    for name in results[0]:
        ref_outs, ref_wgrad, ref_hgrad = _reference(name, vocab)
        for rank, per_rank in enumerate(results):
            outs, wgrad, wwhere, hgrad, hwhere, n_frames = per_rank[name]
            msg = f"{name} V={vocab} rank {rank}"
            assert len(outs) == len(ref_outs), msg
            for out, ref in zip(outs, ref_outs):
                torch.testing.assert_close(out, ref, **TIGHT, msg=lambda m, msg=msg: f"{msg}: {m}")
            torch.testing.assert_close(wgrad, ref_wgrad, **TIGHT, msg=lambda m, msg=msg: f"{msg} dweight: {m}")
            torch.testing.assert_close(hgrad, ref_hgrad, **TIGHT, msg=lambda m, msg=msg: f"{msg} dhidden: {m}")
            assert wwhere == _placements("weight", mesh_ndim), f"{msg}: weight gradient placement {wwhere}"
            assert hwhere == _placements(CASES[name][0], mesh_ndim), f"{msg}: hidden gradient placement {hwhere}"
            if frames is not None:
                assert n_frames == frames, f"{msg}: {n_frames} compiles"


@pytest.mark.parametrize("vocab", [11, 12])  # uneven 6 + 5 rows, even 6 + 6
def test_fused_functions_on_shard0_dtensor_weight(vocab):
    _check(gloo_pool(2).run(_run, vocab, list(CASES)), vocab)


def test_fused_functions_on_one_dim_of_a_2d_mesh():
    """mesh (dp=1, tp=2): the head sharded over the second mesh dim, `Replicate()` on the first."""
    names = ["token/replicated_hidden_and_target", "token/sequence_parallel_rows", "next_token/sequence_parallel"]
    _check(gloo_pool(2).run(_run, 11, names, mesh_shape=(1, 2)), 11, mesh_ndim=2)


def test_fused_compiled_fullgraph_aot_eager():
    _check(gloo_pool(2).run(_run, 11, COMPILED, "aot_eager"), 11, frames=1)


def _errors(rank, world, group):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = _mesh()
    h = torch.randn(4, 3, dtype=F64)
    w = torch.randn(5, 3, dtype=F64)
    target = torch.zeros(4, dtype=torch.int64)
    w_sharded = DTensor.from_local(w, mesh, [Shard(0)])  # V = 10
    calls = {
        "weight_shard1": lambda: lossfx.linear_token_logprobs(h, DTensor.from_local(w, mesh, [Shard(1)]), target),
        "vocab_size": lambda: lossfx.linear_token_logprobs(h, w_sharded, target, vocab_size=12),
        "sp_replicated_hidden": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h, mesh, [Replicate()]), w_sharded, target, sequence_parallel=True
        ),
        "sharded_hidden_without_sp": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h, mesh, [Shard(0)]), w_sharded, target
        ),
        "sp_hidden_uneven": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h[: 3 - rank], mesh, [Shard(0)], shape=torch.Size([5, 3]), stride=(3, 1)),
            w_sharded,
            torch.zeros(5, dtype=torch.int64),
            sequence_parallel=True,
        ),
        "sp_hidden_plain_weight": lambda: lossfx.linear_token_logprobs(
            DTensor.from_local(h, mesh, [Shard(0)]), w, torch.zeros(8, dtype=torch.int64), sequence_parallel=True
        ),
    }
    return value_error_messages(calls)


def test_bad_placements_raise():
    for messages in gloo_pool(2).run(_errors):
        assert "Shard(dim=1)" in messages["weight_shard1"], messages
        assert "vocab_size=12" in messages["vocab_size"], messages
        assert "sequence_parallel=True" in messages["sp_replicated_hidden"], messages
        assert "hidden" in messages["sharded_hidden_without_sp"], messages
        assert "Shard(dim=0)" in messages["sharded_hidden_without_sp"], messages
        assert "split evenly" in messages["sp_hidden_uneven"], messages
        assert "not the weight's tensor-parallel group" in messages["sp_hidden_plain_weight"], messages
