"""The pure kernels and layouts with collectives on real gloo processes (issue 15).

The `tests/test_pure_*.py` files check each pure kernel exhaustively on rank threads; this file is
the real-backend check. One persistent pool of R gloo processes (R = 2 and 4) runs, in one job,
every pure function that talks to other ranks, on uneven `VocabRange`s (a shard narrower than the
top-k, a one-column shard at R = 4), eager, and each rank's values and gradients are compared with
the float64 reference (`lossfx.reference`) at 1e-12:

- `_kernels`: logprobs (with lse, an ignored id), gather (log-probs + negative entropy, logits),
  topk, filtering (the default tie rule; both strategies), divergence (all three kinds),
  fused_linear (gather with bias and the whole `HeadOptions`), linear_objective;
- `_layouts`: the CP all-gather (summed gradient), packing (plain and filtered) and top-k
  distillation on TP, CP and TP x CP meshes (`harness.mesh_groups`).

Gradients: a TP rank's is its vocabulary columns (or head rows) of the dense gradient, a
replicated input's (hidden) the whole one; under CP every rank's loss is the whole loss, so a
rank's gradient is `C x` the dense gradient at its positions (the summed convention).
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import gloo_pool, mesh_groups

from lossfx import reference
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels import divergence, filtering, fused_linear, gather, linear_objective, logprobs, topk
from lossfx._layouts import context_parallel, distillation, packing
from lossfx._layouts.sequence_layout import LoadBalancedLayout, PlainLayout

pytestmark = pytest.mark.distributed

F64 = torch.float64
ATOL = 1e-12
V, K, TOPK = 11, 4, 4  # TOPK = 4 is wider than the 3-, 2- and 1-column shards below
WIDTHS = {2: [3, 8], 4: [2, 4, 1, 4]}  # the TP split of the kernels' vocabulary, uneven
# the layouts' meshes: (tp, vocabulary widths over the TP ranks); tp < R leaves a CP group of R / tp
MESHES = {2: [(2, [3, 8]), (1, [V])], 4: [(2, [4, 7])]}
CU_Q, CU_P = [0, 5, 8, 12], [0, 8, 12, 16]  # packed lengths 5, 3, 4 padded to multiples of 2·CP
FILTERS = [(3, 1.0, "auto"), (5, 0.8, "candidates"), (None, 0.7, "bisection")]  # (top_k, top_p, strategy)
HEAD = HeadOptions(temperature=0.8, logit_scale=1.3, softcap=4.0)  # temperature, logit scale, soft-cap
HEAD_OPTIONS = {"logit_scale": 1.3, "softcap": 4.0}
IGNORE = 4  # an in-range id the log-prob kernel ignores


def _case(world: int) -> dict[str, torch.Tensor]:
    """The same inputs on every process (a seeded generator)."""
    g = torch.Generator().manual_seed(15)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=F64) * scale

    c = {"z": randn(2, 3, V, scale=3), "teacher": randn(2, 3, V, scale=3)}
    c["z"][0, 0, :3] = float("-inf")  # p = 0 columns, the whole first shard at R = 4
    c["target"] = torch.randint(0, V, (2, 3), generator=g)
    c["target"][0, 1] = IGNORE
    c["ids"] = torch.randint(3, V, (2, 3, K), generator=g)
    c["ids"][0, 0, 1] = c["ids"][0, 0, 0]  # a duplicated id: its gradients add
    c["dout"], c["dout_k"] = randn(2, 3), randn(2, 3, K)
    c["ties"] = torch.randint(-3, 4, (2, 3, V), generator=g).to(F64)  # small integers: tied values
    # filtering: tied logits at the boundary, a -inf column
    c["zf"] = torch.randint(0, 5, (6, V), generator=g).to(F64) + 0.3 * randn(6, V).round()
    c["zf"][0, 2] = float("-inf")
    c["target_f"], c["dout_f"] = torch.randint(0, V, (6,), generator=g), randn(6)
    # fused LM head: hidden [7, 5], head rows [V, 5], ignored ids (a row of nothing but them)
    c["hidden"], c["weight"], c["bias"] = randn(7, 5), randn(V, 5, scale=3 / math.sqrt(5)), randn(V)
    c["fids"] = torch.randint(0, V, (7, 3), generator=g)
    c["fids"][1, 0], c["fids"][4] = -100, -100
    c["a"], c["b"], c["dlp"], c["dne"] = randn(7), randn(7), randn(7, 3), randn(7)
    # layouts
    c["x"], c["up"] = randn(2, 4 * world, 3), randn(world, 2, 4 * world, 3)
    c["zp"], c["pids"] = randn(1, CU_P[-1], V, scale=2), torch.randint(0, V, (len(CU_Q) - 1, 7), generator=g)
    c["zd"], c["values"] = randn(2, 8, V, scale=3), randn(2, 8, 3)
    c["dids"] = torch.randint(0, V, (2, 8, 3), generator=g)
    c["dd"], c["dh"] = randn(2, 7, 3), randn(2, 7)
    return c


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def _packed_slots(cp_rank: int, cp: int) -> torch.Tensor:
    """This CP rank's rows of the packed tensor: each sequence's load-balanced positions."""
    slots: list[int] = []
    for lo, hi in zip(CU_P[:-1], CU_P[1:], strict=True):
        slots += [lo + p for p in context_parallel.positions(hi - lo, cp_rank, cp)]
    return torch.tensor(slots)


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


# ---------------------------------------------------------------------------------------------
# One rank's job: every pure function, this rank's part, outputs and gradients
# ---------------------------------------------------------------------------------------------


def _kernels_rank(rank: int, world: int, group, c: dict) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    widths = WIDTHS[world]
    lo = sum(widths[:rank])
    hi = lo + widths[rank]
    vocab = VocabRange(group, lo, V)

    z = _leaf(c["z"][..., lo:hi])
    lp = logprobs.token_logprobs(z, c["target"], vocab, ignore_index=IGNORE, chunk_rows=2)
    (lp * c["dout"]).sum().backward()
    out["logprobs"], out["logprobs.grad"] = lp.detach(), z.grad
    lp, lse = logprobs.token_logprobs_with_lse(c["z"][..., lo:hi], c["target"], vocab, chunk_rows=1)
    out["logprobs_lse"], out["lse"] = lp, lse

    z = _leaf(c["z"][..., lo:hi])
    glp, gne = gather.gather_logprobs(z, c["ids"], vocab, with_neg_entropy=True, chunk_rows=2)
    assert gne is not None
    ((glp * c["dout_k"]).sum() + (gne * c["dout"]).sum()).backward()
    out["gather"], out["gather_ne"], out["gather.grad"] = glp.detach(), gne.detach(), z.grad
    z = _leaf(c["z"][..., lo:hi])
    gl = gather.gather_logits(z, c["ids"], vocab)
    (_finite(gl) * c["dout_k"]).sum().backward()
    out["gather_logits"], out["gather_logits.grad"] = gl.detach(), z.grad

    out["topk_values"], out["topk_ids"] = topk.vocab_topk(c["ties"][..., lo:hi], TOPK, vocab)

    for i, (top_k, top_p, strategy) in enumerate(FILTERS):
        z = _leaf(c["zf"][:, lo:hi])
        flp = filtering.filtered_token_logprobs(z, c["target_f"], vocab, top_k=top_k, top_p=top_p, strategy=strategy)
        (_finite(flp) * c["dout_f"]).sum().backward()
        out[f"filtered{i}"], out[f"filtered{i}.grad"] = flp.detach(), z.grad
        filtered, keep = filtering.apply_top_k_top_p(c["zf"][:, lo:hi], vocab, top_k=top_k, top_p=top_p)
        out[f"filter{i}"], out[f"keep{i}"] = filtered, keep

    for kind in ("neg_entropy", "cross_entropy_to_fixed", "reverse_kl_to_fixed"):
        s = _leaf(c["z"][..., lo:hi])
        teacher = () if kind == "neg_entropy" else (c["teacher"][..., lo:hi],)
        d = getattr(divergence, kind)(s, *teacher, group, chunk_rows=2)
        (_finite(d) * c["dout"]).sum().backward()
        out[kind], out[f"{kind}.grad"] = d.detach(), s.grad

    h, w, b = _leaf(c["hidden"]), _leaf(c["weight"][lo:hi]), _leaf(c["bias"][lo:hi])
    flp, fne = fused_linear.linear_gather_logprobs(
        h, w, c["fids"], vocab, head=HEAD._replace(bias=b), with_neg_entropy=True, chunk_rows=2
    )
    assert fne is not None
    ((flp * c["dlp"]).sum() + (fne * c["dne"]).sum()).backward()
    out["fused"], out["fused_ne"] = flp.detach(), fne.detach()
    out["fused.grad_h"], out["fused.grad_w"], out["fused.grad_b"] = h.grad, w.grad, b.grad

    h, w, b = _leaf(c["hidden"]), _leaf(c["weight"][lo:hi]), _leaf(c["bias"][lo:hi])
    a, e = _leaf(c["a"]), _leaf(c["b"])
    obj, olp, one = linear_objective.linear_logprob_objective(
        h, w, c["fids"][:, 0], a, e, vocab, head=HEAD._replace(bias=b), chunk_rows=3
    )
    (obj * 0.7).backward()
    out["objective"], out["objective_lp"], out["objective_ne"] = obj.detach(), olp, one
    for name, t in (("h", h), ("w", w), ("b", b), ("a", a), ("e", e)):
        out[f"objective.grad_{name}"] = t.grad
    return out


def _layouts_rank(rank: int, world: int, group, c: dict) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    local = _leaf(reference.cp_shard(c["x"], rank, world))
    full = context_parallel.allgather(local, group, seq_dim=1)
    (full * c["up"][rank]).sum().backward()  # a different upstream gradient on every rank
    out["allgather"], out["allgather.grad"] = full.detach(), local.grad

    for m, (tp, widths) in enumerate(MESHES[world]):
        tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
        cp = world // tp
        lo = sum(widths[:tp_rank])
        hi = lo + widths[tp_rank]
        vocab = VocabRange(tp_group, lo, V)
        for f, kw in enumerate(({}, {"top_k": 4, "top_p": 0.9})):
            z = _leaf(c["zp"][:, _packed_slots(cp_rank, cp), lo:hi])
            layout = packing.PackedLayout(torch.tensor(CU_Q), torch.tensor(CU_P), cp_group, False)
            plp = packing.packed_next_token_logprobs(z, c["pids"], layout, vocab, chunk_rows=3, **kw)
            (_finite(plp) * torch.linspace(0.5, 1.5, plp.numel(), dtype=F64).view(plp.shape)).sum().backward()
            out[f"packed{m}.{f}"], out[f"packed{m}.{f}.grad"] = plp.detach(), z.grad

        layout = LoadBalancedLayout(cp_group) if cp_group is not None else PlainLayout()
        z = _leaf(reference.cp_shard(c["zd"], cp_rank, cp)[..., lo:hi])
        student, teacher, neg_entropy = distillation.distillation_topk_logprobs(
            z, c["values"], c["dids"], vocab, layout, zero_outside_topk=True, calculate_entropy=True, chunk_rows=3
        )
        assert neg_entropy is not None
        ((student * c["dd"]).sum() + (neg_entropy * c["dh"]).sum()).backward()
        out[f"distill{m}"], out[f"distill{m}_teacher"], out[f"distill{m}_ne"] = student.detach(), teacher, neg_entropy
        out[f"distill{m}.grad"] = z.grad
    return out


def gloo_job(rank: int, world: int, group, case: dict) -> dict[str, torch.Tensor | None]:
    return {**_kernels_rank(rank, world, group, case), **_layouts_rank(rank, world, group, case)}


# ---------------------------------------------------------------------------------------------
# The float64 reference, cut to each rank's part
# ---------------------------------------------------------------------------------------------


def _dense(c: dict) -> dict[str, torch.Tensor]:
    """Every output and dense gradient of the job, from the reference on the whole tensors."""
    ref: dict[str, torch.Tensor] = {}
    z = _leaf(c["z"])
    lp = reference.token_logprobs(z, c["target"], ignore_index=IGNORE)
    (lp * c["dout"]).sum().backward()
    ref["logprobs"], ref["logprobs.grad"] = lp.detach(), z.grad
    ref["logprobs_lse"], ref["lse"] = reference.token_logprobs(c["z"], c["target"]), c["z"].logsumexp(-1)

    z = _leaf(c["z"])
    glp, gne = reference.gather_logprobs(z, c["ids"])
    ((glp * c["dout_k"]).sum() + (gne * c["dout"]).sum()).backward()
    ref["gather"], ref["gather_ne"], ref["gather.grad"] = glp.detach(), gne.detach(), z.grad
    z = _leaf(c["z"])
    gl = z.gather(-1, c["ids"])
    (_finite(gl) * c["dout_k"]).sum().backward()
    ref["gather_logits"], ref["gather_logits.grad"] = gl.detach(), z.grad

    ref["topk_values"], ref["topk_ids"] = reference.vocab_topk(c["ties"], TOPK)

    for i, (top_k, top_p, _) in enumerate(FILTERS):
        z = _leaf(c["zf"])
        flp = reference.filtered_token_logprobs(z, c["target_f"], top_k, top_p)
        (_finite(flp) * c["dout_f"]).sum().backward()
        ref[f"filtered{i}"], ref[f"filtered{i}.grad"] = flp.detach(), z.grad
        ref[f"filter{i}"], ref[f"keep{i}"] = reference.apply_top_k_top_p(c["zf"], top_k, top_p)

    for kind in ("neg_entropy", "cross_entropy_to_fixed", "reverse_kl_to_fixed"):
        s = _leaf(c["z"])
        teacher = () if kind == "neg_entropy" else (c["teacher"],)
        d = getattr(reference, kind)(s, *teacher)
        (_finite(d) * c["dout"]).sum().backward()
        ref[kind], ref[f"{kind}.grad"] = d.detach(), s.grad

    h, w, b = _leaf(c["hidden"]), _leaf(c["weight"]), _leaf(c["bias"])
    flp, fne = reference.linear_gather_logprobs(h, w, c["fids"], True, 0.8, bias=b, **HEAD_OPTIONS)
    ((flp * c["dlp"]).sum() + (fne * c["dne"]).sum()).backward()
    ref["fused"], ref["fused_ne"] = flp.detach(), fne.detach()
    ref["fused.grad_h"], ref["fused.grad_w"], ref["fused.grad_b"] = h.grad, w.grad, b.grad

    h, w, b, a, e = (_leaf(c[k]) for k in ("hidden", "weight", "bias", "a", "b"))
    obj, olp, one = reference.linear_logprob_objective(h, w, c["fids"][:, 0], a, e, 0.8, bias=b, **HEAD_OPTIONS)
    (obj * 0.7).backward()
    ref["objective"], ref["objective_lp"], ref["objective_ne"] = obj.detach(), olp.detach(), one.detach()
    for name, t in (("h", h), ("w", w), ("b", b), ("a", a), ("e", e)):
        ref[f"objective.grad_{name}"] = t.grad

    for f, kw in enumerate(({}, {"top_k": 4, "top_p": 0.9})):
        z = _leaf(c["zp"])
        plp = reference.packed_next_token_logprobs(z, c["pids"], CU_Q, CU_P, **kw)
        (_finite(plp) * torch.linspace(0.5, 1.5, plp.numel(), dtype=F64).view(plp.shape)).sum().backward()
        ref[f"packed.{f}"], ref[f"packed.{f}.grad"] = plp.detach(), z.grad
        if kw:  # the filter drops some targets: the filtered path is exercised
            assert torch.isinf(plp).any()

    z = _leaf(c["zd"])
    student, teacher, neg_entropy = reference.distillation_topk_logprobs(z, c["values"], c["dids"], True, True)
    ((student * c["dd"]).sum() + (neg_entropy * c["dh"]).sum()).backward()
    ref["distill"], ref["distill_teacher"], ref["distill_ne"] = student.detach(), teacher, neg_entropy.detach()
    ref["distill.grad"] = z.grad
    return ref


def _expected(rank: int, world: int, c: dict, ref: dict) -> dict[str, torch.Tensor]:
    """What rank `rank` of `world` must return: replicated outputs whole, gradients its part."""
    widths = WIDTHS[world]
    lo = sum(widths[:rank])
    hi = lo + widths[rank]
    cols = slice(lo, hi)
    want = {k: v for k, v in ref.items() if not k.startswith(("packed", "distill"))}
    for key in [k for k in want if k.endswith(".grad")]:
        want[key] = want[key][..., cols]  # a TP rank's gradient: its vocabulary columns
    want["fused.grad_w"], want["fused.grad_b"] = ref["fused.grad_w"][cols], ref["fused.grad_b"][cols]
    want["objective.grad_w"], want["objective.grad_b"] = ref["objective.grad_w"][cols], ref["objective.grad_b"][cols]
    want["filter0"], want["filter1"], want["filter2"] = (ref[f"filter{i}"][:, cols] for i in range(3))
    want["keep0"], want["keep1"], want["keep2"] = (ref[f"keep{i}"][:, cols] for i in range(3))

    want["allgather"] = c["x"]
    want["allgather.grad"] = reference.cp_shard(c["up"].sum(0), rank, world)  # the summed convention
    for m, (tp, mesh_widths) in enumerate(MESHES[world]):
        cp, tp_rank, cp_rank = world // tp, rank % tp, rank // tp
        lo = sum(mesh_widths[:tp_rank])
        cols = slice(lo, lo + mesh_widths[tp_rank])
        for f in range(2):
            want[f"packed{m}.{f}"] = ref[f"packed.{f}"]
            want[f"packed{m}.{f}.grad"] = cp * ref[f"packed.{f}.grad"][:, _packed_slots(cp_rank, cp), cols]
        want[f"distill{m}"], want[f"distill{m}_teacher"] = ref["distill"], ref["distill_teacher"]
        want[f"distill{m}_ne"] = ref["distill_ne"]
        want[f"distill{m}.grad"] = cp * reference.cp_shard(ref["distill.grad"], cp_rank, cp)[..., cols]
    return want


@pytest.mark.parametrize("world", [2, 4])
def test_pure_functions_on_gloo_processes(world, monkeypatch):
    """Every pure function with collectives, R real gloo processes, uneven shards, vs float64."""
    import harness

    monkeypatch.setattr(harness, "_TIMEOUT_S", 120.0)  # a hung collective fails the test, not CI
    case = _case(world)
    ref = _dense(case)
    results = gloo_pool(world).run(gloo_job, case)
    for rank, got in enumerate(results):
        want = _expected(rank, world, case, ref)
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if value.dtype in (torch.bool, torch.int64):
                assert torch.equal(got[key], value), (rank, key)
            else:
                torch.testing.assert_close(
                    got[key], value, rtol=0, atol=ATOL, msg=lambda m, k=key, r=rank: f"rank {r}, {k}: {m}"
                )
