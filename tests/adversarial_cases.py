# ruff: noqa: E731
"""Per-rank side of the adversarial suite (`tests/test_adversarial.py`), importable by the gloo
workers.

`run_case(rank, world, group, target, perturbation, mode)` builds this rank's inputs from one
configuration (rank 0 the default, rank 1 the default with ONE field changed), calls the public
function, and returns what happened on this rank: `("error", type, message)` for a
ValueError/TypeError, `("other", type, traceback)` for any other exception, or
`("value", max_abs_error, inf_pattern_ok)` against the float64 reference computed from this
rank's own full view of the inputs. Afterwards every rank runs one probe all-reduce of
`rank + 1`, so a group left out of step (a rank that skipped or added a collective) shows.
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import lossfx
from lossfx import reference

F64 = torch.float64

# rank 0's configuration; rank 1 changes exactly one field (see test_adversarial.PERTURBATIONS)
DEFAULT: dict[str, Any] = {
    "B": 2,
    "S": 6,
    "V": 16,
    "H": 8,
    "K": 3,
    "dtype": F64,
    "temperature": 1.0,
    "chunk_size": 4,
    "top_k": 5,
    "top_p": 1.0,
    "ties": "together",
    "zero_outside_topk": False,
    "entropy": False,
    "requires_grad": False,
    "ids": False,  # True: one entry of the replicated ids differs
    "hidden": False,  # True: one entry of the replicated hidden states differs
    "coef": False,  # True: one coefficient of the objective differs
    "mask": False,  # True: one entry of a replicated mask differs
    "teacher": False,  # True: one entry of the replicated teacher payload differs
    "layout": "even",  # "uneven": widths V/2 + 1 and V/2 - 1 with explicit vocab_start / vocab_size
    "dtensor": False,  # True: the sharded input is a DTensor on the 2-rank mesh
    "fsdp2": False,  # True: the weight is a Shard(0) DTensor and hidden differs per rank
    "checks": True,  # False: set_consistency_checks(False) on this rank
}

_mesh: Any = None


def _device_mesh() -> Any:
    global _mesh
    if _mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        _mesh = init_device_mesh("cpu", (2,))
    return _mesh


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _shard(cfg: dict, rank: int) -> tuple[int, int]:
    """(start, width) of this rank's vocabulary shard."""
    half = -(-cfg["V"] // 2)  # torch.chunk's split (DTensor's Shard): 8 + 8 of 16, 8 + 7 of 15
    if cfg["layout"] == "uneven":
        return (0, half + 1) if rank == 0 else (half + 1, cfg["V"] - half - 1)
    return rank * half, min(half, cfg["V"] - rank * half)


def _ids(cfg: dict, shape: tuple[int, ...], high: int, seed: int, row: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Random ids; with cfg["ids"] the entry `ids.flat[1]` (a target of every path: token paths
    score it with logits row `row` = (0, 1), next-token paths with row (0, 0)) becomes that row's
    largest logit, or the second largest if it was the largest: a changed id that no top-k / top-p
    filter removes, so the answer must change."""
    ids = torch.randint(0, high, shape, generator=_gen(seed))
    if cfg["ids"]:
        flat = ids.view(-1)
        order = _logits(cfg)[row].argsort(descending=True)
        flat[1] = order[1] if order[0] == flat[1] else order[0]
    return ids


def _logits(cfg: dict) -> torch.Tensor:
    return torch.randn(cfg["B"], cfg["S"], cfg["V"], generator=_gen(0), dtype=F64) * 2


def _local(cfg: dict, full: torch.Tensor, rank: int) -> tuple[torch.Tensor, dict]:
    """This rank's shard of `full [..., V]` in cfg's dtype, and the shard arguments to pass."""
    start, width = _shard(cfg, rank)
    local = full[..., start : start + width].to(cfg["dtype"]).clone()
    if cfg["requires_grad"]:
        local.requires_grad_()
    extra = {"vocab_start": start, "vocab_size": cfg["V"]} if cfg["layout"] == "uneven" else {}
    if cfg["dtensor"]:
        from torch.distributed.tensor import DTensor, Shard

        sizes = [_shard(cfg, r)[1] for r in range(2)]
        shape = (*local.shape[:-1], sum(sizes))
        stride = tuple(torch.empty(shape).stride())
        local = DTensor.from_local(
            local, _device_mesh(), [Shard(local.dim() - 1)], run_check=False, shape=shape, stride=stride
        )
        extra = {}
    return local, extra


def _grp(cfg: dict, group: Any) -> Any:
    return None if cfg["dtensor"] else group


# ---------------------------------------------------------------------------------------------
# Logits paths: each returns (call: () -> outputs, reference outputs from this rank's full view)
# ---------------------------------------------------------------------------------------------


def _t_token_logprobs(cfg, rank, group):
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1)
    call = lambda: lossfx.token_logprobs(z, ids, group=_grp(cfg, group), chunk_size=cfg["chunk_size"], **extra)
    return call, [reference.token_logprobs(full, ids)]


def _t_token_logprobs_with_lse(cfg, rank, group):
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1)
    call = lambda: lossfx.token_logprobs_with_lse(z, ids, group=_grp(cfg, group), chunk_size=cfg["chunk_size"], **extra)
    return call, [reference.token_logprobs(full, ids), torch.logsumexp(full, -1)]


def _t_gather_logits(cfg, rank, group):
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"], cfg["K"]), cfg["V"], 1)
    call = lambda: lossfx.gather_logits(z, ids, group=_grp(cfg, group), **extra)
    return call, [full.gather(-1, ids)]


def _t_gather_logprobs(cfg, rank, group):
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"], cfg["K"]), cfg["V"], 1)
    call = lambda: lossfx.gather_logprobs(
        z, ids, with_entropy=cfg["entropy"], group=_grp(cfg, group), chunk_size=cfg["chunk_size"], **extra
    )
    lp, ent = reference.gather_logprobs(full, ids)
    return call, [lp, ent] if cfg["entropy"] else [lp]


def _filter_kw(cfg):
    return {"top_k": cfg["top_k"], "top_p": cfg["top_p"], "ties": cfg["ties"]}


def _t_filtered_token_logprobs(cfg, rank, group):
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1)
    call = lambda: lossfx.filtered_token_logprobs(
        z, ids, group=_grp(cfg, group), chunk_size=cfg["chunk_size"], **_filter_kw(cfg), **extra
    )
    return call, [reference.filtered_token_logprobs(full, ids, **_filter_kw(cfg))]


def _t_apply_top_k_top_p(cfg, rank, group):
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    call = lambda: lossfx.apply_top_k_top_p(
        z, group=_grp(cfg, group), chunk_size=cfg["chunk_size"], **_filter_kw(cfg), **extra
    )
    return call, list(reference.apply_top_k_top_p(full, **_filter_kw(cfg)))


def _t_next_token_filtered_logprobs(cfg, rank, group):
    full = _logits(cfg)
    z, _ = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1, row=(0, 0))
    kw = _filter_kw(cfg)
    call = lambda: lossfx.next_token_filtered_logprobs(
        z, ids, group=_grp(cfg, group), chunk_size=cfg["chunk_size"], **kw
    )
    return call, [reference.next_token_filtered_logprobs(full, ids, **kw)]


def _divergence(name):
    def build(cfg, rank, group):
        full = _logits(cfg)
        z, _ = _local(cfg, full, rank)
        fn = getattr(lossfx, name)
        if name == "entropy":
            return (lambda: fn(z, group=_grp(cfg, group), chunk_size=cfg["chunk_size"])), [reference.entropy(full)]
        teacher_full = torch.randn(full.shape, generator=_gen(7), dtype=F64)
        t, _ = _local({**cfg, "requires_grad": False}, teacher_full, rank)
        ref = getattr(reference, name)(full, teacher_full)
        return (lambda: fn(z, t, group=_grp(cfg, group), chunk_size=cfg["chunk_size"])), [ref]

    return build


def _teacher_topk(cfg):
    vals = torch.randn(cfg["B"], cfg["S"], cfg["K"], generator=_gen(3), dtype=F64)
    if cfg["teacher"]:
        vals[0, 0, 0] += 1.5
    idx = torch.stack([torch.randperm(cfg["V"], generator=_gen(4 + i))[: cfg["K"]] for i in range(cfg["B"] * cfg["S"])])
    idx = idx.view(cfg["B"], cfg["S"], cfg["K"])
    if cfg["ids"]:
        idx[0, 0, 0] = (idx[0, 0, 0] + cfg["V"] // 2 + 1) % cfg["V"]
        if (idx[0, 0, 0] == idx[0, 0, 1:]).any():
            idx[0, 0, 0] = (idx[0, 0, 0] + 1) % cfg["V"]
    return vals, idx


def _t_distillation_topk_logprobs(cfg, rank, group):
    full = _logits(cfg)
    z, _ = _local(cfg, full, rank)
    vals, idx = _teacher_topk(cfg)
    kw = {"zero_outside_topk": cfg["zero_outside_topk"], "calculate_entropy": cfg["entropy"]}
    call = lambda: lossfx.distillation_topk_logprobs(
        z, vals, idx, vocab_parallel_group=_grp(cfg, group), chunk_size=cfg["chunk_size"], **kw
    )
    return call, list(reference.distillation_topk_logprobs(full, vals, idx, **kw))


def _mask(cfg):
    mask = torch.ones(cfg["B"], cfg["S"], dtype=torch.bool)
    mask[:, -1] = False
    if cfg["mask"]:
        mask[0, 0] = False
    return mask


def _t_draft_targets(cfg, rank, group):
    full = _logits(cfg)
    z, _ = _local(cfg, full, rank)
    mask = _mask(cfg)
    g = _grp(cfg, group)
    call = lambda: lossfx.draft_targets(
        z, mask, None, vocab_parallel_rank=None if g is None else rank, vocab_parallel_group=g
    )
    return call, list(reference.draft_targets(full, mask, None))


def _t_vocab_topk(cfg, rank, group):
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    start = extra.get("vocab_start")
    call = lambda: lossfx.vocab_topk(z, cfg["K"], group=_grp(cfg, group), vocab_start=start)
    return call, list(reference.vocab_topk(full, cfg["K"]))


def _t_allgather_cp(cfg, rank, group):
    # 4·S long: the load-balanced layout of 2 ranks needs a multiple of 4 (a builder must not raise)
    full = torch.randn(cfg["B"], cfg["S"] * 4, cfg["V"], generator=_gen(0), dtype=F64)
    local = reference.cp_shard(full, rank, 2, seq_dim=1).to(cfg["dtype"])
    return (lambda: lossfx.allgather_cp(local, group, seq_dim=1)), [full]


def _sampling(cfg):
    if cfg["top_k"] is None and cfg["top_p"] == 1.0:
        return None
    return lossfx.TrainingSamplingParams(top_k=cfg["top_k"], top_p=cfg["top_p"])


def _t_next_token_logprobs(cfg, rank, group):
    full = _logits(cfg)
    z, _ = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1, row=(0, 0))
    g = _grp(cfg, group)
    call = lambda: lossfx.next_token_logprobs(
        z, ids, vocab_parallel_rank=None if g is None else rank, vocab_parallel_group=g, chunk_size=cfg["chunk_size"]
    )
    return call, [reference.next_token_logprobs(full, ids)]


def _t_prepare_loss_input_logprob(cfg, rank, group):
    full = _logits(cfg)
    z, _ = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1, row=(0, 0))
    g = _grp(cfg, group)
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    sp = _sampling(cfg)
    mask = torch.ones(cfg["B"], cfg["S"])

    def call():
        out, _ = lossfx.prepare_loss_input(
            z,
            {"input_ids": ids, "token_mask": mask, "sample_mask": torch.ones(cfg["B"])},
            loss_fn,
            vocab_parallel_rank=None if g is None else rank,
            vocab_parallel_group=g,
            sampling_params=sp,
            chunk_size=cfg["chunk_size"],
        )
        return out["next_token_logprobs"]

    ref = reference.next_token_filtered_logprobs(full, ids, top_k=cfg["top_k"], top_p=cfg["top_p"])
    return call, [reference.mask_out_neg_inf_logprobs(ref, torch.ones_like(ref))]


def _t_prepare_loss_input_distillation(cfg, rank, group):
    full = _logits(cfg)
    z, _ = _local(cfg, full, rank)
    vals, idx = _teacher_topk(cfg)
    g = _grp(cfg, group)
    loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=cfg["zero_outside_topk"], kl_type="forward")
    data = {"teacher_topk_logits": vals, "teacher_topk_indices": idx}

    def call():
        out, _ = lossfx.prepare_loss_input(
            z,
            dict(data),
            loss_fn,
            vocab_parallel_rank=None if g is None else rank,
            vocab_parallel_group=g,
            chunk_size=cfg["chunk_size"],
        )
        return out["student_topk_logprobs"]

    lp, _, _ = reference.distillation_topk_logprobs(full, vals, idx, cfg["zero_outside_topk"], False)
    return call, [lp]


# ---------------------------------------------------------------------------------------------
# Fused LM-head paths: hidden [B, S, H] replicated, weight rows [Vl, H] of this rank
# ---------------------------------------------------------------------------------------------


def _fused_inputs(cfg, rank):
    hidden = torch.randn(cfg["B"], cfg["S"], cfg["H"], generator=_gen(10), dtype=F64)
    if cfg["hidden"]:
        hidden[0, 0, 0] += 1.0
    if cfg["fsdp2"]:
        hidden = hidden + rank  # data parallel: a different batch on each rank
    weight = torch.randn(cfg["V"], cfg["H"], generator=_gen(11), dtype=F64)
    start, width = _shard(cfg, rank)
    rows = weight[start : start + width].to(cfg["dtype"]).clone()
    h = hidden.to(cfg["dtype"]).clone()
    if cfg["requires_grad"]:
        h.requires_grad_()
        rows.requires_grad_()
    extra = {"vocab_start": start, "vocab_size": cfg["V"]} if cfg["layout"] == "uneven" else {}
    group_kw = True
    if cfg["dtensor"] or cfg["fsdp2"]:
        from torch.distributed.tensor import DTensor, Shard

        sizes = [_shard(cfg, r)[1] for r in range(2)]
        rows = DTensor.from_local(
            rows, _device_mesh(), [Shard(0)], run_check=False, shape=(sum(sizes), cfg["H"]), stride=(cfg["H"], 1)
        )
        extra, group_kw = {}, False
    return hidden, weight, h, rows, extra, group_kw


def _fused(name):
    def build(cfg, rank, group):
        hidden, weight, h, rows, extra, group_kw = _fused_inputs(cfg, rank)
        kw = dict(extra, temperature=cfg["temperature"], chunk_size=cfg["chunk_size"])
        if group_kw:
            kw["group"] = group
        fn = getattr(lossfx, name)
        t = cfg["temperature"]
        if name == "linear_gather_logprobs":
            ids = _ids(cfg, (cfg["B"], cfg["S"], cfg["K"]), cfg["V"], 1)
            kw.update(zero_outside_topk=cfg["zero_outside_topk"], with_entropy=cfg["entropy"])
            lp, ent = reference.linear_gather_logprobs(
                hidden, weight, ids, zero_outside_topk=cfg["zero_outside_topk"], temperature=t
            )
            return (lambda: fn(h, rows, ids, **kw)), [lp, ent] if cfg["entropy"] else [lp]
        if name == "linear_logprob_objective":
            ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1)
            coef = torch.randn(cfg["B"], cfg["S"], generator=_gen(12), dtype=F64)
            if cfg["coef"]:
                coef[0, 0] += 1.0
            c = coef.to(cfg["dtype"])
            obj, lp, _ = reference.linear_logprob_objective(hidden, weight, ids, coef, temperature=t)
            return (lambda: fn(h, rows, ids, c, **kw)[:2]), [obj, lp]
        ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1)
        kw["return_entropy"] = cfg["entropy"]
        lp, ent = getattr(reference, name)(hidden, weight, ids, temperature=t)
        return (lambda: fn(h, rows, ids, **kw)), [lp, ent] if cfg["entropy"] else [lp]

    return build


TARGETS = {
    "token_logprobs": _t_token_logprobs,
    "token_logprobs_with_lse": _t_token_logprobs_with_lse,
    "gather_logits": _t_gather_logits,
    "gather_logprobs": _t_gather_logprobs,
    "filtered_token_logprobs": _t_filtered_token_logprobs,
    "apply_top_k_top_p": _t_apply_top_k_top_p,
    "next_token_filtered_logprobs": _t_next_token_filtered_logprobs,
    "entropy": _divergence("entropy"),
    "cross_entropy_to_fixed": _divergence("cross_entropy_to_fixed"),
    "reverse_kl_to_fixed": _divergence("reverse_kl_to_fixed"),
    "distillation_topk_logprobs": _t_distillation_topk_logprobs,
    "draft_targets": _t_draft_targets,
    "vocab_topk": _t_vocab_topk,
    "allgather_cp": _t_allgather_cp,
    "next_token_logprobs": _t_next_token_logprobs,
    "prepare_loss_input[LOGPROB]": _t_prepare_loss_input_logprob,
    "prepare_loss_input[DISTILLATION]": _t_prepare_loss_input_distillation,
    "linear_token_logprobs": _fused("linear_token_logprobs"),
    "linear_next_token_logprobs": _fused("linear_next_token_logprobs"),
    "linear_gather_logprobs": _fused("linear_gather_logprobs"),
    "linear_logprob_objective": _fused("linear_logprob_objective"),
}


def _outputs(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    res = []
    for o in outs:
        if o is None:
            continue
        if hasattr(o, "full_tensor"):
            o = o.full_tensor()
        res.append(o)
    return res


def _error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, bool]:
    """Largest |got - ref| over entries finite in both, and whether shapes and ±inf agree."""
    if len(got) != len(ref):
        return float("inf"), False
    worst, same = 0.0, True
    for g, r in zip(got, ref, strict=True):
        g = g.detach().to(F64) if g.is_floating_point() else g.detach().to(torch.int64)
        r = r.to(g.dtype)
        if g.shape != r.shape:
            return float("inf"), False
        finite = torch.isfinite(g) & torch.isfinite(r)
        same &= bool((torch.isfinite(g) == torch.isfinite(r)).all()) and bool((g[~finite] == r[~finite]).all())
        if finite.any():
            worst = max(worst, float((g[finite] - r[finite]).abs().max()))
    return worst, same


def run_case(rank: int, world: int, group: Any, target: str, both: dict, rank1: dict, mode: str) -> tuple:
    """This rank's outcome of `target`: every rank on DEFAULT updated by `both`, rank 1 also by
    `rank1` (the one perturbation); `mode` is "eager" or a torch.compile backend."""
    cfg = {**DEFAULT, **both, **(rank1 if rank == 1 else {})}
    previous = None
    outcome: tuple
    try:
        if not cfg["checks"]:
            switch = getattr(lossfx, "set_consistency_checks", None)  # a branch may remove the switch
            previous = switch(False) if switch is not None else None
        try:
            call, ref = TARGETS[target](cfg, rank, group)
            built = torch.tensor([1.0])
        except Exception:
            built, setup_error = torch.tensor([0.0]), traceback.format_exc()[-2000:]
        # every rank learns whether every rank could build its inputs: a test that cannot build
        # them on one rank must not leave the other waiting inside lossfx's collectives
        dist.all_reduce(built, op=dist.ReduceOp.MIN, group=group)
        if not built[0]:
            return ("setup", "test setup failed", setup_error if "setup_error" in locals() else "on a peer"), 3.0
        if mode != "eager":
            # the point is the cross-rank check in the graph, not codegen: aot_eager keeps it cheap
            call = torch.compile(call, backend=mode, fullgraph=True)
        got = _outputs(call())
        ref = [r for r in ref if r is not None]
        if target in ("apply_top_k_top_p", "draft_targets") and not cfg["dtensor"]:  # sharded outputs
            start, width = _shard(cfg, rank)
            ref = [r[..., start : start + width] if r.dim() == 3 else r for r in ref]
        err, same = _error(got, ref)
        outcome = ("value", err, same)
    except (ValueError, TypeError) as exc:
        outcome = ("error", type(exc).__name__, str(exc))
    except Exception as exc:
        outcome = ("other", type(exc).__name__, f"{str(exc)[:1000]}\n{traceback.format_exc()[-2000:]}")
    finally:
        if previous is not None:
            lossfx.set_consistency_checks(previous)
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe, group=group)
    return outcome, float(probe[0])
