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
from harness import device_mesh

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
    "requires_grad": True,  # the differentiable inputs (logits, hidden, weight rows) are leaves
    "ids": False,  # True: one entry of the replicated ids differs; "oob": one id is V (out of range)
    "hidden": False,  # True: one entry of the replicated hidden states differs; "zero"/"negzero": it is +0.0/-0.0
    "coef": False,  # True: one coefficient of the objective differs
    "mask": False,  # True: one entry of a replicated mask differs
    "teacher": False,  # True: one entry of the replicated teacher payload differs
    "layout": "even",  # "uneven": widths V/2 + 1 and V/2 - 1 with explicit vocab_start / vocab_size;
    # "overlap": every rank claims [0, V/2) (vocab_start=0 on every rank: shards that do not tile)
    "dtensor": False,  # True: the sharded input is a DTensor on the 2-rank mesh
    "fsdp2": False,  # True: the weight is a Shard(0) DTensor and hidden differs per rank
    "compiled": True,  # False: this rank runs eagerly in a compiled case (e.g. Dynamo's recompile limit hit)
    "grad_mode": True,  # False: this rank calls under torch.no_grad()
    "D": 6,  # draft vocabulary (map_to_draft_vocab)
    "d2t": "given",  # "moved": one entry of d2t differs; None: no d2t
    # packing: cu_seqlens as "list" or "tensor"; "moved": one boundary moves (see _packing)
    "cu_type": "list",
    "cu": "given",
    "cu_p": "given",
    "prepacked": False,  # True: data["input_ids"] is the packed row [1, T] (with data["cu_seqlens"])
    # OPD_FULL: how the teacher heads are passed ("rows", "dtensor", "full"), their dtype and keys
    "heads": "rows",
    "head_dtype": F64,
    "head_keys": "same",  # "other": the second head under another key
    "teacher_index": "given",  # "moved": one row routed to the other head
    "payload_extra": 0,  # extra columns of a logits payload beyond V (allowed: each rank slices its window)
    "validate": True,
    "opd_chunk": None,
    "penalty": 0.25,
    # fused LM-head options (linear_next_token_logprobs[options])
    "bias": True,  # this rank's rows of an LM-head bias [V]
    "logit_scale": 0.8,
    "softcap": 5.0,
    "ignore_index": -100,  # some targets are ignored (equal to it)
    "position_ids": "packed",  # "packed": padding-free rows (two sequences in row 0); "moved": another
    # boundary; None: not given
    "extra": False,  # True: one value of a data column the call never reads differs (prepare_loss_input[nemo])
}

# the differentiable inputs of the case being built: (this rank's leaf, the float64 leaf of the
# reference, full gradient -> the gradient this rank's leaf must get); reset by `run_case`
_LEAVES: list[tuple[torch.Tensor, torch.Tensor, Any]] = []


# for outputs that are this rank's part of one tensor whose parts depend on other ranks' inputs
# (a shift across CP ranks): (rank, () -> every rank's reference outputs); reset by `run_case`.
# Each rank weights its part with its own weights, and the reference gradient is that of the
# sum over ranks (what a loss summed over the ranks' parts differentiates).
_PER_RANK_REF: list[tuple[int, Any]] = []

# ids whose entry `flat[1]` becomes out of range (`high`) after the reference was computed; reset by `run_case`
_OUT_OF_RANGE: list[tuple[torch.Tensor, int]] = []


def _leaf(local: torch.Tensor, full: torch.Tensor, expected: Any) -> None:
    """Make `local` (this rank's input) and `full` (the reference's float64 input) leaves that
    require grad and register them: `expected(full.grad)` is the gradient `local` must get."""
    local.requires_grad_()
    if not full.requires_grad:
        full.requires_grad_()
    _LEAVES.append((local, full, expected))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _shard(cfg: dict, rank: int) -> tuple[int, int]:
    """(start, width) of this rank's vocabulary shard."""
    half = -(-cfg["V"] // 2)  # torch.chunk's split (DTensor's Shard): 8 + 8 of 16, 8 + 7 of 15
    if cfg["layout"] == "uneven":
        return (0, half + 1) if rank == 0 else (half + 1, cfg["V"] - half - 1)
    if cfg["layout"] == "overlap":
        return 0, half
    return rank * half, min(half, cfg["V"] - rank * half)


def _ids(cfg: dict, shape: tuple[int, ...], high: int, seed: int, row: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Random ids; with cfg["ids"] the entry `ids.flat[1]` (a target of every path: token paths
    score it with logits row `row` = (0, 1), next-token paths with row (0, 0)) becomes that row's
    largest logit, or the second largest if it was the largest: a changed id that no top-k / top-p
    filter removes, so the answer must change."""
    ids = torch.randint(0, high, shape, generator=_gen(seed))
    if cfg["ids"] == "oob":  # set to `high` once the reference is built (`run_case`)
        _OUT_OF_RANGE.append((ids, high))
    elif cfg["ids"]:
        flat = ids.view(-1)
        order = _logits(cfg)[row].argsort(descending=True)
        flat[1] = order[1] if order[0] == flat[1] else order[0]
    return ids


def _logits(cfg: dict) -> torch.Tensor:
    return torch.randn(cfg["B"], cfg["S"], cfg["V"], generator=_gen(0), dtype=F64) * 2


def _local(cfg: dict, full: torch.Tensor, rank: int) -> tuple[torch.Tensor, dict]:
    """This rank's shard of `full [..., V]` in cfg's dtype, and the shard arguments to pass."""
    start, width = _shard(cfg, rank)
    local = full.detach()[..., start : start + width].to(cfg["dtype"]).clone()
    if cfg["requires_grad"]:
        _leaf(local, full, lambda g: g[..., start : start + width])
    extra = {"vocab_start": start, "vocab_size": cfg["V"]} if cfg["layout"] in ("uneven", "overlap") else {}
    if cfg["dtensor"]:
        return _sharded(cfg, local, local.dim() - 1), {}
    return local, extra


def _sharded(cfg: dict, local: torch.Tensor, dim: int) -> Any:
    """`local` as a `Shard(dim)` DTensor on the 2-rank mesh (its global size the ranks' widths summed)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(local.shape)
    shape[dim] = sum(_shard(cfg, r)[1] for r in range(2))
    stride = torch.empty(shape).stride()
    return DTensor.from_local(
        local, device_mesh((2,)), [Shard(dim)], run_check=False, shape=tuple(shape), stride=stride
    )


def _grp(cfg: dict, group: Any) -> Any:
    return None if cfg["dtensor"] else group


def _tp(cfg: dict, rank: int, group: Any) -> dict:
    """NeMo RL's tensor-parallel keywords: the group and this rank's index in it (none: a DTensor)."""
    g = _grp(cfg, group)
    return {"vocab_parallel_group": g, "vocab_parallel_rank": None if g is None else rank}


# ---------------------------------------------------------------------------------------------
# Logits paths: each returns (call: () -> outputs, reference outputs from this rank's full view)
# ---------------------------------------------------------------------------------------------


def _inputs(cfg, rank, group, k=False, row=(0, 1), shard_args=True):
    """`(full, z, ids, kw)`: the float64 logits, this rank's shard `z` (a leaf), ids `[B, S]` (`[B, S, K]`
    with `k`; see `_ids` for `row`) and the keywords group, chunk_size and (`shard_args`: for the
    functions that take them) the shard arguments."""
    full = _logits(cfg)
    z, extra = _local(cfg, full, rank)
    ids = _ids(cfg, (cfg["B"], cfg["S"], cfg["K"])[: 3 if k else 2], cfg["V"], 1, row)
    return full, z, ids, dict(extra if shard_args else {}, group=_grp(cfg, group), chunk_size=cfg["chunk_size"])


def _t_token_logprobs(cfg, rank, group):
    full, z, ids, kw = _inputs(cfg, rank, group)
    return (lambda: lossfx.token_logprobs(z, ids, **kw)), [reference.token_logprobs(full, ids)]


def _t_token_logprobs_with_lse(cfg, rank, group):
    full, z, ids, kw = _inputs(cfg, rank, group)
    ref = [reference.token_logprobs(full, ids), torch.logsumexp(full, -1)]
    return (lambda: lossfx.token_logprobs_with_lse(z, ids, **kw)), ref


def _t_gather_logits(cfg, rank, group):
    full, z, ids, kw = _inputs(cfg, rank, group, k=True)
    kw.pop("chunk_size")
    return (lambda: lossfx.gather_logits(z, ids, **kw)), [full.gather(-1, ids)]


def _t_gather_logprobs(cfg, rank, group):
    full, z, ids, kw = _inputs(cfg, rank, group, k=True)
    lp, ent = reference.gather_logprobs(full, ids)
    call = lambda: lossfx.gather_logprobs(z, ids, with_entropy=cfg["entropy"], **kw)
    return call, [lp, ent] if cfg["entropy"] else [lp]


def _filter_kw(cfg):
    return {"top_k": cfg["top_k"], "top_p": cfg["top_p"], "ties": cfg["ties"]}


def _t_filtered_token_logprobs(cfg, rank, group):
    full, z, ids, kw = _inputs(cfg, rank, group)
    call = lambda: lossfx.filtered_token_logprobs(z, ids, **_filter_kw(cfg), **kw)
    return call, [reference.filtered_token_logprobs(full, ids, **_filter_kw(cfg))]


def _t_apply_top_k_top_p(cfg, rank, group):
    """Its outputs are this rank's vocabulary shard: the reference's columns of it (a DTensor's whole)."""
    full, z, _, kw = _inputs(cfg, rank, group)
    start, width = _shard(cfg, rank)
    ref = [
        r if cfg["dtensor"] else r[..., start : start + width]
        for r in reference.apply_top_k_top_p(full, **_filter_kw(cfg))
    ]
    return (lambda: lossfx.apply_top_k_top_p(z, **_filter_kw(cfg), **kw)), ref


def _t_next_token_filtered_logprobs(cfg, rank, group):
    full, z, ids, kw = _inputs(cfg, rank, group, row=(0, 0), shard_args=False)
    call = lambda: lossfx.next_token_filtered_logprobs(z, ids, **_filter_kw(cfg), **kw)
    return call, [reference.next_token_filtered_logprobs(full, ids, **_filter_kw(cfg))]


def _divergence(name):
    def build(cfg, rank, group):
        full, z, _, kw = _inputs(cfg, rank, group, shard_args=False)
        fn = getattr(lossfx, name)
        if name == "entropy":
            return (lambda: fn(z, **kw)), [reference.entropy(full)]
        teacher_full = torch.randn(full.shape, generator=_gen(7), dtype=F64)
        t, _ = _local({**cfg, "requires_grad": False}, teacher_full, rank)
        return (lambda: fn(z, t, **kw)), [getattr(reference, name)(full, teacher_full)]

    return build


def _teacher_topk(cfg):
    vals = torch.randn(cfg["B"], cfg["S"], cfg["K"], generator=_gen(3), dtype=F64)
    if cfg["teacher"]:
        vals[0, 0, 0] += 1.5
    idx = torch.stack([torch.randperm(cfg["V"], generator=_gen(4 + i))[: cfg["K"]] for i in range(cfg["B"] * cfg["S"])])
    idx = idx.view(cfg["B"], cfg["S"], cfg["K"])
    if cfg["ids"] is True:
        idx[0, 0, 0] = (idx[0, 0, 0] + cfg["V"] // 2 + 1) % cfg["V"]
        if (idx[0, 0, 0] == idx[0, 0, 1:]).any():
            idx[0, 0, 0] = (idx[0, 0, 0] + 1) % cfg["V"]
    return vals, idx


def _t_distillation_topk_logprobs(cfg, rank, group):
    full, z, _, kw = _inputs(cfg, rank, group)
    vals, idx = _teacher_topk(cfg)
    opts = {"zero_outside_topk": cfg["zero_outside_topk"], "calculate_entropy": cfg["entropy"]}
    call = lambda: lossfx.distillation_topk_logprobs(
        z, vals, idx, vocab_parallel_group=kw["group"], chunk_size=cfg["chunk_size"], **opts
    )
    return call, list(reference.distillation_topk_logprobs(full, vals, idx, **opts))


def _mask(cfg):
    mask = torch.ones(cfg["B"], cfg["S"], dtype=torch.bool)
    mask[:, -1] = False
    if cfg["mask"]:
        mask[0, 0] = False
    return mask


def _t_vocab_topk(cfg, rank, group):
    full, z, _, kw = _inputs(cfg, rank, group)
    call = lambda: lossfx.vocab_topk(z, cfg["K"], group=kw["group"], vocab_start=kw.get("vocab_start"))
    return call, list(reference.vocab_topk(full, cfg["K"]))


def _t_allgather_cp(cfg, rank, group):
    full, local = _cp_logits(cfg, rank)
    return (lambda: lossfx.allgather_cp(local, group, seq_dim=1)), [full]


def _sampling(cfg):
    if cfg["top_k"] is None and cfg["top_p"] == 1.0:
        return None
    return lossfx.TrainingSamplingParams(top_k=cfg["top_k"], top_p=cfg["top_p"])


def _t_next_token_logprobs(cfg, rank, group):
    full, z, ids, _ = _inputs(cfg, rank, group, row=(0, 0))
    call = lambda: lossfx.next_token_logprobs(z, ids, chunk_size=cfg["chunk_size"], **_tp(cfg, rank, group))
    return call, [reference.next_token_logprobs(full, ids)]


def _prepare(z, data, loss_fn, key, cfg, rank, group, **kw):
    """`() -> prepare_loss_input(z, data, loss_fn, ...)[0][key]` (a list of outputs: `key` a tuple),
    NeMo RL's tensor-parallel keywords and `kw`."""

    def call():
        out, _ = lossfx.prepare_loss_input(z, dict(data), loss_fn, **_tp(cfg, rank, group), **kw)
        return [out[k] for k in key] if isinstance(key, tuple) else out[key]

    return call


def _t_prepare_loss_input_logprob(cfg, rank, group, loss_fn=None, sp=None, **columns):
    """`prepare_loss_input(LOGPROB)`, `data`'s `input_ids` scored against the filtered float64
    reference (`loss_fn`, `sp` and extra data `columns`: see `_t_prepare_loss_input_nemo`)."""
    full, z, ids, _ = _inputs(cfg, rank, group, row=(0, 0))
    loss_fn = loss_fn or SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    data = {"input_ids": ids, "token_mask": torch.ones(cfg["B"], cfg["S"]), "sample_mask": torch.ones(cfg["B"])}
    sp = sp or _sampling(cfg)
    kw = {"sampling_params": sp, "chunk_size": cfg["chunk_size"]}
    call = _prepare(z, {**data, **columns}, loss_fn, "next_token_logprobs", cfg, rank, group, **kw)
    ref = reference.next_token_filtered_logprobs(full, ids, top_k=cfg["top_k"], top_p=cfg["top_p"])
    return call, [reference.mask_out_neg_inf_logprobs(ref, torch.ones_like(ref))]


def _t_prepare_loss_input_distillation(cfg, rank, group):
    full, z, _, _ = _inputs(cfg, rank, group)
    vals, idx = _teacher_topk(cfg)
    loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=cfg["zero_outside_topk"], kl_type="forward")
    data = {"teacher_topk_logits": vals, "teacher_topk_indices": idx}
    call = _prepare(z, data, loss_fn, "student_topk_logprobs", cfg, rank, group, chunk_size=cfg["chunk_size"])
    lp, _, _ = reference.distillation_topk_logprobs(full, vals, idx, cfg["zero_outside_topk"], False)
    return call, [lp]


def _t_prepare_loss_input_draft(cfg, rank, group):
    """`prepare_loss_input(DRAFT)` under tensor parallelism, as NeMo RL's draft loss calls it:
    `data["student_logits"]` is this rank's shard of the draft vocabulary `[B, S, D/2]` (its values
    differ per rank by design), passed through; the teacher comes back as this rank's draft shard."""
    full, z, _, _ = _inputs(cfg, rank, group)
    mask = _mask(cfg).to(cfg["dtype"])
    d2t, start, width = _draft(cfg, rank)
    student = torch.randn(cfg["B"], cfg["S"], 2 * width, generator=_gen(21), dtype=F64)[..., start : start + width]
    data = {"token_mask": mask, "student_logits": student}
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)
    call = _prepare(z, data, loss_fn, ("teacher_logits", "token_mask", "student_logits"), cfg, rank, group, d2t=d2t)
    teacher, shifted_mask = reference.draft_targets(full, mask, d2t)
    return call, [teacher[..., start : start + width], shifted_mask, student]


# 20 per-sample columns of a NeMo RL training microbatch that the LOGPROB branch never reads
_NEMO_COLUMNS = [f"column_{i:02d}" for i in range(20)]


def _t_prepare_loss_input_nemo(cfg, rank, group):
    """`prepare_loss_input(LOGPROB)` with a NeMo-sized call: 20 extra `[B, S]` columns in `data`
    (never read: not compared), float sampling parameters, and a loss function with 100 float
    options, so the sampling parameters come after the first 122 fields of the signature."""
    columns = {key: torch.randn(cfg["B"], cfg["S"], generator=_gen(40 + i)) for i, key in enumerate(_NEMO_COLUMNS)}
    if cfg["extra"]:
        columns[_NEMO_COLUMNS[3]][0, 0] += 1.0
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB, **{f"option_{i:03d}": 0.5 for i in range(100)})
    sp = lossfx.TrainingSamplingParams(top_k=cfg["top_k"], top_p=cfg["top_p"], temperature=0.7)
    return _t_prepare_loss_input_logprob(cfg, rank, group, loss_fn, sp, **columns)


# ---------------------------------------------------------------------------------------------
# Fused LM-head paths: hidden [B, S, H] replicated, weight rows [Vl, H] of this rank
# ---------------------------------------------------------------------------------------------


def _fused_inputs(cfg, rank, group, rows_shape=None):
    """`(hidden, weight, h, rows, kw)`: the float64 hidden states and LM head, this rank's copy `h`
    of the replicated hidden and its rows of the head (leaves: the full hidden gradient, the rows'
    slice), and `kw` the shard arguments and `group` (none for a DTensor head)."""
    shape = (cfg["B"], cfg["S"]) if rows_shape is None else rows_shape
    hidden = torch.randn(*shape, cfg["H"], generator=_gen(10), dtype=F64)
    if cfg["hidden"] in ("zero", "negzero"):  # equal values, other bits
        hidden[0, 0, 0] = 0.0 if cfg["hidden"] == "zero" else -0.0
    elif cfg["hidden"]:
        hidden[0, 0, 0] += 1.0
    if cfg["fsdp2"]:
        hidden = hidden + rank  # data parallel: a different batch on each rank
    weight = torch.randn(cfg["V"], cfg["H"], generator=_gen(11), dtype=F64)
    start, width = _shard(cfg, rank)
    rows = weight[start : start + width].to(cfg["dtype"]).clone()
    h = hidden.to(cfg["dtype"]).clone()
    if cfg["requires_grad"]:
        _leaf(h, hidden, lambda g: g)
        _leaf(rows, weight, lambda g: g[start : start + width])
    kw = {"vocab_start": start, "vocab_size": cfg["V"]} if cfg["layout"] in ("uneven", "overlap") else {}
    if cfg["dtensor"] or cfg["fsdp2"]:
        return hidden, weight, h, _sharded(cfg, rows, 0), {}
    return hidden, weight, h, rows, dict(kw, group=group)


def _fused(name):
    def build(cfg, rank, group):
        hidden, weight, h, rows, kw = _fused_inputs(cfg, rank, group)
        kw.update(temperature=cfg["temperature"], chunk_size=cfg["chunk_size"])
        fn, t = getattr(lossfx, name), cfg["temperature"]
        ids = _ids(cfg, (cfg["B"], cfg["S"], cfg["K"])[: 3 if name == "linear_gather_logprobs" else 2], cfg["V"], 1)
        if name == "linear_logprob_objective":
            coef = torch.randn(cfg["B"], cfg["S"], generator=_gen(12), dtype=F64)
            if cfg["coef"]:
                coef[0, 0] += 1.0
            c = coef.to(cfg["dtype"])
            obj, lp, _ = reference.linear_logprob_objective(hidden, weight, ids, coef, temperature=t)
            return (lambda: fn(h, rows, ids, c, **kw)[:2]), [obj, lp]
        if name == "linear_gather_logprobs":
            kw.update(zero_outside_topk=cfg["zero_outside_topk"], with_entropy=cfg["entropy"])
            lp, ent = reference.linear_gather_logprobs(hidden, weight, ids, cfg["zero_outside_topk"], temperature=t)
        else:
            kw["return_entropy"] = cfg["entropy"]
            lp, ent = getattr(reference, name)(hidden, weight, ids, temperature=t)
        return (lambda: fn(h, rows, ids, **kw)), [lp, ent] if cfg["entropy"] else [lp]

    return build


def _position_ids(cfg):
    if cfg["position_ids"] is None:
        return None
    pos = torch.arange(cfg["S"]).repeat(cfg["B"], 1)
    cut = 2 if cfg["position_ids"] == "packed" else 3  # row 0 holds two sequences, split at `cut`
    pos[0, cut:] = torch.arange(cfg["S"] - cut)
    return pos


def _bias(cfg, rank):
    """`(bias [V], this rank's part)` of the LM head (`(None, None)` without cfg["bias"]): its rows, a
    leaf, a Shard(0) DTensor next to a DTensor head."""
    if not cfg["bias"]:
        return None, None
    bias_full = torch.randn(cfg["V"], generator=_gen(13), dtype=F64)
    return bias_full, _local(cfg, bias_full, rank)[0]


def _t_linear_next_token_options(cfg, rank, group):
    """`linear_next_token_logprobs` with bias, logit scale, soft-cap, ignored targets and
    padding-free `position_ids`."""
    hidden, weight, h, rows, kw = _fused_inputs(cfg, rank, group)
    ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1, row=(0, 0))
    ids[1, 2] = ids[0, 4] = cfg["ignore_index"]  # ignored targets (a rank with another index ignores others)
    bias_full, bias = _bias(cfg, rank)
    pos = _position_ids(cfg)
    options = {"logit_scale": cfg["logit_scale"], "softcap": cfg["softcap"], "ignore_index": cfg["ignore_index"]}
    options["temperature"] = cfg["temperature"]
    lp, _ = reference.linear_next_token_logprobs(hidden, weight, ids, position_ids=pos, bias=bias_full, **options)
    call = lambda: lossfx.linear_next_token_logprobs(
        h, rows, ids, bias=bias, position_ids=pos, chunk_size=cfg["chunk_size"], **options, **kw
    )
    return call, [lp]


def _linear_front_door(packed: bool):
    def build(cfg, rank, group):
        """`prepare_linear_loss_input` (LOGPROB; `packed`: `prepare_linear_packed_loss_input`) with
        the head options: bias (a Shard(0) DTensor next to a DTensor head), logit scale, soft-cap,
        temperature. Uneven widths are read from the ranks (no vocab_start argument)."""
        cu_q, cu_p = _packing(cfg)
        hidden, weight, h, rows, kw = _fused_inputs(cfg, rank, group, (1, cu_p[-1]) if packed else None)
        ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1, row=(0, 0))
        bias_full, bias = _bias(cfg, rank)
        options = {"temperature": cfg["temperature"], "logit_scale": cfg["logit_scale"], "softcap": cfg["softcap"]}
        tp = {"vocab_parallel_group": group, "vocab_parallel_rank": rank} if "group" in kw else {}
        kw = dict(options, bias=bias, chunk_size=cfg["chunk_size"], **tp)
        loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
        data = {"input_ids": ids}
        if packed:
            z = hidden @ weight.T + (0 if bias_full is None else bias_full)
            cap = cfg["softcap"]
            z = z * cfg["logit_scale"] if cap is None else cap * torch.tanh(z * cfg["logit_scale"] / cap)
            want = reference.packed_next_token_logprobs(z / cfg["temperature"], ids, cu_q, cu_p)
            call = lambda: lossfx.prepare_linear_packed_loss_input(h, rows, dict(data), loss_fn, cu_q, cu_p, **kw)
        else:
            want, _ = reference.linear_next_token_logprobs(hidden, weight, ids, bias=bias_full, **options)
            call = lambda: lossfx.prepare_linear_loss_input(h, rows, dict(data), loss_fn, **kw)
        return (lambda: call()[0]["next_token_logprobs"]), [want]

    return build


def _t_shift_left(cfg, rank, group):
    """`shift_left` over the CP group: `x [B, L/2, V]` this rank's load-balanced part of `[B, L, V]`."""
    full, local = _cp_logits(cfg, rank, summed=1)

    def refs(f=full):
        shifted = torch.cat([f[:, 1:], torch.zeros_like(f[:, :1])], dim=1)
        return [[reference.cp_shard(shifted, r, 2)] for r in range(2)]

    if cfg["requires_grad"]:
        _PER_RANK_REF.append((rank, refs))
    return (lambda: lossfx.shift_left(local, group)), refs()[rank]


def _draft(cfg, rank) -> tuple[torch.Tensor | None, int, int]:
    """`(d2t, start, width)`: `d2t [D]` (draft id `i` maps to target id `i + d2t[i]`, distinct target
    ids in `[0, V)`; None with cfg["d2t"] None) and this rank's columns of the draft vocabulary."""
    if cfg["d2t"] is None:
        return None, *_shard(cfg, rank)
    targets = torch.randperm(cfg["V"], generator=_gen(20))[: cfg["D"]].sort().values
    d2t = targets - torch.arange(cfg["D"])
    if cfg["d2t"] == "moved":  # one draft id maps elsewhere
        d2t[1] = (targets[1] + cfg["V"] // 2) % cfg["V"] - 1
    return d2t, rank * cfg["D"] // 2, cfg["D"] // 2


def _t_map_to_draft_vocab(cfg, rank, group):
    """`map_to_draft_vocab` of this rank's (detached) target-vocabulary shard: its draft shard."""
    full = _logits(cfg)
    z, _ = _local({**cfg, "requires_grad": False}, full, rank)
    d2t, start, width = _draft(cfg, rank)
    call = lambda: lossfx.map_to_draft_vocab(z, d2t, **_tp(cfg, rank, group))
    want = full if d2t is None else full[..., torch.arange(cfg["D"]) + d2t]
    return call, [want if cfg["dtensor"] else want[..., start : start + width]]


def _t_draft_targets(cfg, rank, group):
    """`draft_targets` (with a draft vocabulary: `d2t`): this rank's draft shard and the mask."""
    full, z, _, _ = _inputs(cfg, rank, group)
    mask = _mask(cfg)
    d2t, start, width = _draft(cfg, rank)
    call = lambda: lossfx.draft_targets(z, mask, d2t, **_tp(cfg, rank, group))
    teacher, shifted_mask = reference.draft_targets(full, mask, d2t)
    return call, [teacher if cfg["dtensor"] else teacher[..., start : start + width], shifted_mask]


def _t_linear_next_token_cp(cfg, rank, group):
    """`linear_next_token_logprobs` under context parallelism over the 2 ranks: `hidden` this
    rank's load-balanced part, the full LM head (no TP), canonical `input_ids`."""
    length = 4 * (cfg["S"] // 2)
    hidden = torch.randn(cfg["B"], length, cfg["H"], generator=_gen(10), dtype=F64)
    weight = torch.randn(cfg["V"], cfg["H"], generator=_gen(11), dtype=F64)
    ids = _ids(cfg, (cfg["B"], length), cfg["V"], 1)
    h = reference.cp_shard(hidden, rank, 2).to(cfg["dtype"]).clone()
    w = weight.to(cfg["dtype"])
    if cfg["requires_grad"]:  # the summed-gradient convention over CP ranks
        _leaf(h, hidden, lambda g: 2 * reference.cp_shard(g, rank, 2))
    lp, _ = reference.linear_next_token_logprobs(hidden, weight, ids, cfg["temperature"])
    call = lambda: lossfx.linear_next_token_logprobs(
        h, w, ids, context_parallel_group=group, temperature=cfg["temperature"], chunk_size=cfg["chunk_size"]
    )
    return call, [lp]


def _cp_logits(cfg, rank, summed=2):
    """`(full [B, L, V], this rank's load-balanced part [B, L/2, V])` for 2 CP ranks (L a multiple
    of 4), a leaf whose gradient is `summed` times its part (2: the summed convention)."""
    length = 4 * (cfg["S"] // 2)
    full = torch.randn(cfg["B"], length, cfg["V"], generator=_gen(0), dtype=F64) * 2
    local = reference.cp_shard(full, rank, 2).to(cfg["dtype"]).clone()
    if cfg["requires_grad"]:
        _leaf(local, full, lambda g: summed * reference.cp_shard(g, rank, 2))
    return full, local


def _t_next_token_logprobs_cp(cfg, rank, group):
    """`next_token_logprobs` under context parallelism over the 2 ranks (canonical `input_ids`)."""
    full, local = _cp_logits(cfg, rank)
    ids = _ids(cfg, (cfg["B"], full.shape[1]), cfg["V"], 1, row=(0, 0))
    call = lambda: lossfx.next_token_logprobs(local, ids, context_parallel_group=group, chunk_size=cfg["chunk_size"])
    return call, [reference.next_token_logprobs(full, ids)]


def _t_distillation_cp(cfg, rank, group):
    """`distillation_topk_logprobs` under context parallelism (canonical teacher top-k)."""
    full, local = _cp_logits(cfg, rank)
    vals, idx = _teacher_topk({**cfg, "S": full.shape[1]})
    kw = {"zero_outside_topk": cfg["zero_outside_topk"], "calculate_entropy": cfg["entropy"]}
    call = lambda: lossfx.distillation_topk_logprobs(
        local, vals, idx, context_parallel_group=group, chunk_size=cfg["chunk_size"], **kw
    )
    return call, list(reference.distillation_topk_logprobs(full, vals, idx, **kw))


def _packing(cfg) -> tuple[list[int], list[int]]:
    """`(cu_seqlens_q, cu_seqlens_q_padded)` of B sequences of lengths S, S-2, S-1, ... (each at
    most S), padded to multiples of 4 (2·C for C = 2). `cu` "moved": the first sequence one
    token shorter; `cu_p` "moved": one padding slot moves from the second sequence to the first
    (still valid without context parallelism)."""
    lengths = [cfg["S"] - (2, 1)[i % 2] if i else cfg["S"] for i in range(cfg["B"])]
    if cfg["cu"] == "moved":
        lengths[0] -= 1
    padded = [-(-max(n, 1) // 4) * 4 for n in lengths]
    if cfg["cu_p"] == "moved":
        padded[0], padded[1] = padded[0] - 1, padded[1] + 1
    cu_q, cu_p = [0], [0]
    for n, m in zip(lengths, padded, strict=True):
        cu_q.append(cu_q[-1] + n)
        cu_p.append(cu_p[-1] + m)
    return cu_q, cu_p


def _packed_cp_shard(x: torch.Tensor, cu_p: list[int], rank: int) -> torch.Tensor:
    """Rank `rank`'s packed part of `x [1, T, ...]` for 2 CP ranks: every sequence's load-balanced part."""
    return torch.cat([reference.cp_shard(x[:, a:b], rank, 2) for a, b in zip(cu_p[:-1], cu_p[1:])], dim=1)


def _packed(cp: bool):
    def build(cfg, rank, group):
        """`prepare_packed_loss_input`: TP over the 2 ranks (`cp` False) or CP (`cp` True)."""
        cu_q, cu_p = _packing(cfg)
        total = cu_p[-1]
        full = torch.randn(1, total, cfg["V"], generator=_gen(0), dtype=F64) * 2
        if cfg["prepacked"]:  # the physical packed row: the result is in the packed layout [1, T-1]
            ids = _ids(cfg, (1, total), cfg["V"], 1, row=(0, 0))
        else:
            ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1, row=(0, 0))
        if cp:
            local = _packed_cp_shard(full, cu_p, rank).to(cfg["dtype"]).clone()
            if cfg["requires_grad"]:  # the summed-gradient convention over CP ranks
                _leaf(local, full, lambda g: 2 * _packed_cp_shard(g, cu_p, rank))
            layout = {"context_parallel_group": group}
        else:
            local, _ = _local(cfg, full, rank)  # uneven widths: read from the ranks ("auto")
            layout = _tp(cfg, rank, group)
        if cfg["cu_type"] == "tensor":
            cu_q, cu_p = torch.tensor(cu_q), torch.tensor(cu_p)
        sp = _sampling(cfg)
        loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
        data = {"input_ids": ids, "token_mask": torch.ones(ids.shape)}
        if cfg["prepacked"]:
            data["cu_seqlens"] = torch.tensor(list(map(int, cu_q)))

        def call():
            out, _ = lossfx.prepare_packed_loss_input(
                local, dict(data), loss_fn, cu_q, cu_p, sampling_params=sp, chunk_size=cfg["chunk_size"], **layout
            )
            return out["next_token_logprobs"]

        want = reference.packed_next_token_logprobs(
            full,
            ids,
            list(map(int, cu_q)),
            list(map(int, cu_p)),
            prepacked=cfg["prepacked"],
            top_k=cfg["top_k"],
            top_p=cfg["top_p"],
        )
        return call, [reference.mask_out_neg_inf_logprobs(want, torch.ones_like(want))]

    return build


def _opd_full(entry: str, payload: str):
    def build(cfg, rank, group):
        """OPD_FULL with a hidden-states teacher (two LM heads, rows routed by
        `opd_full_teacher_index`) or a logits payload, TP over the 2 ranks."""
        full = _logits(cfg)
        z, _ = _local(cfg, full, rank)
        ids = _ids(cfg, (cfg["B"], cfg["S"]), cfg["V"], 1, row=(0, 0))
        s_p = cfg["S"] - 1
        gen = _gen(30)
        hidden = torch.randn(cfg["B"], s_p, cfg["H"], generator=gen, dtype=F64)
        heads = {k: torch.randn(cfg["V"], cfg["H"], generator=gen, dtype=F64) for k in (3, 7)}
        index = torch.tensor([7, 3, 7, 3][: cfg["B"]])
        teacher_logits = torch.randn(cfg["B"], s_p, cfg["V"], generator=gen, dtype=F64)
        if cfg["teacher"]:
            hidden[0, 0, 0] += 1.5
            teacher_logits[0, 0, -1] += 1.5  # in rank 1's window
        if cfg["teacher_index"] == "moved":
            index[0] = 3
        key2 = 7 if cfg["head_keys"] == "same" else 8
        heads = {3: heads[3], key2: heads[7]}
        index = torch.where(index == 7, key2, index)
        start, width = _shard(cfg, rank)
        if cfg["heads"] == "full":
            mine = {k: w.to(cfg["head_dtype"]) for k, w in heads.items()}
        else:
            mine = {k: w[start : start + width].to(cfg["head_dtype"]).clone() for k, w in heads.items()}
            if cfg["heads"] == "dtensor":
                mine = {k: _sharded(cfg, w, 0) for k, w in mine.items()}
        opd = lossfx.OnPolicyDistillationFullConfig(
            enabled=True,
            teacher_payload="hidden_states" if payload == "hidden" else "logits",
            validate_decomposition=cfg["validate"],
            chunk_size=cfg["opd_chunk"],
        )
        loss_fn = SimpleNamespace(
            input_type=lossfx.LossInputType.OPD_FULL, opd_full=opd, reference_policy_kl_penalty=cfg["penalty"]
        )
        if payload == "hidden":
            data = {"input_ids": ids, "teacher_full_hidden_states": hidden, "opd_full_teacher_index": index}
            heads_kw = {"teacher_output_layer_weight_by_index": mine}
            teacher = reference.opd_full_teacher_logits(
                hidden,
                cfg["S"],
                teacher_payload="hidden_states",
                weights={k: w.to(cfg["head_dtype"]) for k, w in heads.items()},
                teacher_index=index,
            )
        else:
            wide = torch.cat([teacher_logits, torch.zeros(cfg["B"], s_p, cfg["payload_extra"], dtype=F64)], -1)
            data = {"input_ids": ids, "teacher_full_logits": wide}
            heads_kw = {}
            teacher = reference.opd_full_teacher_logits(teacher_logits, cfg["S"], teacher_payload="logits")
        kw = dict(_tp(cfg, rank, group), chunk_size=cfg["chunk_size"], **heads_kw)
        if entry == "prepare_opd_full_loss_input":
            kw.update(context_parallel_group=None, sampling_params=None)

        def call():
            out = getattr(lossfx, entry)(z, dict(data), loss_fn, **kw)
            out = out[0] if isinstance(out, tuple) else out  # prepare_loss_input: (inputs, the loss's keywords)
            return [out[k] for k in _OPD_KEYS if k in out]

        want = reference.opd_full_loss_input(
            full, teacher, ids, validate_decomposition=cfg["validate"], reference_policy_kl_penalty=cfg["penalty"]
        )
        return call, [want[k] for k in _OPD_KEYS if k in want]

    return build


_OPD_KEYS = ("opd_full_divergence", "opd_full_entropy", "opd_full_cross_entropy", "next_token_logprobs")


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
    "draft_targets": lambda cfg, rank, group: _t_draft_targets({**cfg, "d2t": None}, rank, group),
    "vocab_topk": _t_vocab_topk,
    "allgather_cp": _t_allgather_cp,
    "next_token_logprobs": _t_next_token_logprobs,
    "prepare_loss_input[LOGPROB]": _t_prepare_loss_input_logprob,
    "prepare_loss_input[DISTILLATION]": _t_prepare_loss_input_distillation,
    "prepare_loss_input[DRAFT]": _t_prepare_loss_input_draft,
    "prepare_loss_input[nemo]": _t_prepare_loss_input_nemo,
    "linear_token_logprobs": _fused("linear_token_logprobs"),
    "linear_next_token_logprobs": _fused("linear_next_token_logprobs"),
    "linear_gather_logprobs": _fused("linear_gather_logprobs"),
    "linear_logprob_objective": _fused("linear_logprob_objective"),
    "linear_next_token_logprobs[options]": _t_linear_next_token_options,
    "prepare_linear_loss_input": _linear_front_door(packed=False),
    "prepare_linear_packed_loss_input": _linear_front_door(packed=True),
    "shift_left": _t_shift_left,
    "map_to_draft_vocab": _t_map_to_draft_vocab,
    "draft_targets[d2t]": _t_draft_targets,
    "linear_next_token_logprobs[cp]": _t_linear_next_token_cp,
    "next_token_logprobs[cp]": _t_next_token_logprobs_cp,
    "distillation_topk_logprobs[cp]": _t_distillation_cp,
    "prepare_packed_loss_input": _packed(cp=False),
    "prepare_packed_loss_input[cp]": _packed(cp=True),
    "prepare_opd_full_loss_input": _opd_full("prepare_opd_full_loss_input", "hidden"),
    "prepare_opd_full_loss_input[logits]": _opd_full("prepare_opd_full_loss_input", "logits"),
    "prepare_loss_input[OPD_FULL]": _opd_full("prepare_loss_input", "hidden"),
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
        r = r.detach().to(g.dtype)
        if g.shape != r.shape:
            return float("inf"), False
        finite = torch.isfinite(g) & torch.isfinite(r)
        same &= bool((torch.isfinite(g) == torch.isfinite(r)).all()) and bool((g[~finite] == r[~finite]).all())
        if finite.any():
            worst = max(worst, float((g[finite] - r[finite]).abs().max()))
    return worst, same


# outputs that carry no gradient by contract (targets are detached, the objective's log-probs are values)
NO_GRAD_OUTPUTS: dict[str, set[int]] = {
    "token_logprobs_with_lse": {1},  # the log-sum-exp is documented as not differentiable
    "vocab_topk": {0, 1},  # a selection
    "draft_targets": {0, 1},
    "prepare_loss_input[DRAFT]": {0, 1, 2},  # detached targets, the mask, the student passed through
    "map_to_draft_vocab": {0},
    "linear_logprob_objective": {1},
}


def _weights(ref: list[torch.Tensor], seed: int = 99) -> list[torch.Tensor]:
    """The random weighting of the outputs: the same on every rank (a replicated output gets the
    same upstream gradient everywhere, as a loss computed on every rank does)."""
    gen = _gen(seed)
    return [torch.randn(r.shape, generator=gen, dtype=F64) for r in ref]


def _weighted(outs: list[torch.Tensor], ref: list[torch.Tensor], skip: set[int], seed: int = 99) -> torch.Tensor | None:
    """`Σ_i Σ w_i · out_i` over the float outputs not in `skip`, entries finite in the reference."""
    total = None
    for i, (o, r, w) in enumerate(zip(outs, ref, _weights(ref, seed), strict=True)):
        if i in skip or not o.is_floating_point() or not (o.requires_grad or r.requires_grad):
            continue
        keep = torch.isfinite(r.detach())
        term = (torch.where(keep, o, torch.zeros((), dtype=o.dtype)) * torch.where(keep, w, 0).to(o.dtype)).sum()
        total = term.to(F64) if total is None else total + term.to(F64)
    return total


def _gradient_error(target: str, got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, str]:
    """Backward of a random weighting of this rank's outputs against the float64 reference's
    gradient of the same weighting: `(largest relative error, detail)`. Runs a backward on
    every rank whose inputs require grad (the backward's collectives run then)."""
    leaves = [(loc, full, exp) for loc, full, exp in _LEAVES if loc.requires_grad]
    if not leaves:
        return 0.0, "no input requires grad"
    skip = NO_GRAD_OUTPUTS.get(target, set())
    missing = [i for i, (o, r) in enumerate(zip(got, ref, strict=True)) if r.requires_grad and not o.requires_grad]
    missing = [i for i in missing if i not in skip]
    if missing:
        return float("inf"), f"outputs {missing} carry no gradient"
    if _PER_RANK_REF:  # outputs that are this rank's part of one tensor: weights per rank, loss summed
        rank, refs_of = _PER_RANK_REF[0]
        loss = _weighted(got, ref, skip, seed=100 + rank)
        ref_loss = sum(_weighted(refs, refs, skip, seed=100 + r) for r, refs in enumerate(refs_of()))
    else:
        loss = _weighted(got, ref, skip)
        ref_loss = _weighted(ref, ref, skip)
    if loss is None or ref_loss is None:
        return 0.0, "no differentiable output"
    grads = torch.autograd.grad(loss, [loc for loc, _, _ in leaves], allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, [full for _, full, _ in leaves], allow_unused=True)
    worst = 0.0
    for (loc, full, expected), g, rg in zip(leaves, grads, ref_grads, strict=True):
        want = expected(torch.zeros_like(full) if rg is None else rg).detach()
        if g is None:
            g = torch.zeros_like(loc)
        if hasattr(g, "to_local"):
            g = g.to_local()
        g = g.detach().to(F64)
        if g.shape != want.shape or not bool(torch.isfinite(g).all()):
            finite = bool(torch.isfinite(g).all())
            return float("inf"), f"gradient of shape {tuple(g.shape)} (want {tuple(want.shape)}), finite: {finite}"
        scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
        if g.numel():
            worst = max(worst, float((g - want).abs().max()) / scale)
    return worst, f"gradient error {worst:.1e}"


def _attempt(fn: Any) -> tuple[Any, tuple | None]:
    """`(fn(), None)`, or `(None, outcome)` for an exception (see the module doc)."""
    try:
        return fn(), None
    except (ValueError, TypeError) as exc:
        return None, ("error", type(exc).__name__, str(exc))
    except Exception as exc:
        return None, ("other", type(exc).__name__, f"{str(exc)[:1000]}\n{traceback.format_exc()[-2000:]}")


def outcome(rank: int, group: Any, build: Any, kind: str, mode: str, grad_mode: bool = True) -> tuple:
    """This rank's outcome (see the module doc) of `build() -> (call, reference outputs)`, the call
    run in `mode` ("eager" or a torch.compile backend) with grad mode `grad_mode`, and the probe.
    When every rank has an answer, each runs the backward of a random weighting of its outputs
    (`_gradient_error` of `kind`); the outcome's value error is then the larger of the two."""
    _LEAVES.clear()
    _PER_RANK_REF.clear()
    _OUT_OF_RANGE.clear()
    try:
        call, ref = build()
        ref = [r for r in ref if r is not None]
        for ids, high in _OUT_OF_RANGE:  # the call sees them, the reference (built) did not
            ids.view(-1)[1] = high
        setup_error = None
    except Exception:
        setup_error = traceback.format_exc()[-2000:]
    # every rank learns whether every rank could build its inputs: a test that cannot build
    # them on one rank must not leave the other waiting inside lossfx's collectives
    built = torch.tensor([float(setup_error is None)])
    dist.all_reduce(built, op=dist.ReduceOp.MIN, group=group)
    if not built[0]:
        return ("setup", "test setup failed", setup_error or "on a peer"), 3.0
    if mode != "eager":
        # the point is the cross-rank check in the graph, not codegen: aot_eager keeps it cheap
        call = torch.compile(call, backend=mode, fullgraph=True)
    with torch.set_grad_enabled(grad_mode):
        got, result = _attempt(lambda: _outputs(call()))
    if result is None:
        err, same = _error(got, ref)
    # the backward runs only when every rank has an answer (a rank that raised runs no backward)
    answered = torch.tensor([float(result is None)])
    dist.all_reduce(answered, op=dist.ReduceOp.MIN, group=group)
    if result is None and answered[0]:
        grad, result = _attempt(lambda: _gradient_error(kind, got, ref))
        if result is None:
            gerr, gdetail = grad
            result = ("value", max(err, gerr), same, f"values {err:.1e}, {gdetail}")
    elif result is None:
        result = ("value", err, same, "no backward: a peer raised")
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe, group=group)
    return result, float(probe[0])


def run_case(rank: int, world: int, group: Any, target: str, both: dict, rank1: dict, mode: str) -> tuple:
    """This rank's `outcome` of `target`: every rank on DEFAULT updated by `both`, rank 1 also by
    `rank1` (the one perturbation); `mode` is "eager" or a torch.compile backend."""
    cfg = {**DEFAULT, **both, **(rank1 if rank == 1 else {})}
    mode = mode if cfg["compiled"] else "eager"
    return outcome(rank, group, lambda: TARGETS[target](cfg, rank, group), target, mode, cfg["grad_mode"])
