"""The DTensor boundary: DTensor arguments in, plain local tensors and a process group out.

Every public function calls one of these at its top, then runs the group-based kernels on plain
tensors. Rules (docs/dtensor.md):

* a tensor sharded on its vocabulary dim `d` (`Shard(d)` on exactly one mesh dim, `Replicate()`
  on the others) is tensor parallel over that mesh dim: the group, the rank and this shard's
  `vocab_start` / width follow from the mesh, the placement and torch's sharding rule (uneven
  shards included); all-`Replicate()` means no tensor parallelism; any other placement raises;
* replicated arguments (ids, masks, teacher payloads) may be plain or all-`Replicate()` DTensors;
* replicated results are plain tensors; results sharded on the vocabulary come back as DTensors
  with the input's mesh and placements (`VocabShard.wrap`);
* `to_local()` is differentiable, so the gradient reaches the DTensor with its own placement.

The fused LM-head functions take a vocabulary-sharded weight `[Vl, H]` the same way:
``vocab_shard(weight, dim=0, name="weight", roles=ROLES, group=group, vocab_start=..., vocab_size=...)``.

This module knows no parameter name of the public functions: each caller names the sharded
argument (`name`) and passes the `Roles` it declares for the cross-rank check, whose `tp`,
`rank`, `start` and `size` are the parameters its messages name and its views fill in.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for  # (torch's own rule: imported by `import torch`)

from lossfx._boundary.consistency import _NO_ROLES, REJECTED, REJECTED_ERROR, Roles
from lossfx._boundary.consistency import Local as View
from lossfx._boundary.validation import check_group
from lossfx._core.host_reads import tracing

ProcessGroup = dist.ProcessGroup

__all__ = [
    "VocabShard",
    "is_dtensor",
    "local_view",
    "replicated",
    "resolved_shard",
    "vocab_shard",
]

# `torch.distributed.tensor` is never imported here: it costs ~0.5 s, more than the rest of
# lossfx. A DTensor can only exist once its module was imported by whoever built it, so the
# module is looked up in `sys.modules` (a dict read, which Dynamo also traces).
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(x: object) -> bool:
    """True iff `x` is a `torch.distributed.tensor.DTensor` (without importing that module)."""
    module = sys.modules.get(_DTENSOR_MODULE)  # `torch.distributed.tensor` if something imported it already
    return module is not None and isinstance(x, module.DTensor)


class VocabShard(NamedTuple):
    """A vocabulary-sharded argument as the group-based kernels see it.

    `local` is this rank's shard (a plain tensor; padded with `-inf` columns to the even width
    `ceil(V/R)` when asked for `even=True`), `group` the tensor-parallel group (`None` without TP),
    `rank` this rank's index in it, `vocab_start` / `vocab_size` the shard's first global id and
    the global `V`. `dtensor` is the DTensor it came from (`None` for a plain tensor).
    """

    local: Tensor
    group: ProcessGroup | None
    rank: int | None
    vocab_start: int | None
    vocab_size: int | None
    dtensor: Any = None
    padded: int = 0

    def pad_full(self, x: Any) -> Any:
        """A full-vocabulary tensor `[..., V]` (a teacher logits payload) padded with `-inf` to the
        padded global width `R · ceil(V/R)` the kernels see; identity when nothing is padded."""
        if not self.padded or not isinstance(x, Tensor) or x.shape[-1] != self.vocab_size or self.group is None:
            return x
        return _pad_columns(x, self.local.shape[-1] * self.group.size() - x.shape[-1], x.dim() - 1)

    def wrap(self, out: Tensor) -> Tensor:
        """A result `[..., Vl]` sharded like the input on its last (vocabulary) dim, back as a
        DTensor with the input's mesh and placements (padding removed); identity for a plain input."""
        if self.padded:
            out = out.narrow(-1, 0, out.shape[-1] - self.padded)
        return out if self.dtensor is None else self.wrap_other_vocab(out, self.dtensor.shape[-1])

    def wrap_other_vocab(self, out: Tensor, global_vocab: int) -> Tensor:
        """A result `[..., D/R]` on another vocabulary of `global_vocab = D` ids split evenly over
        the same ranks (a draft vocabulary), as a DTensor placed like the input."""
        if self.dtensor is None:
            return out
        shape = torch.Size([*out.shape[:-1], global_vocab])
        mesh, placements = self.dtensor.device_mesh, self.dtensor.placements
        return sys.modules[_DTENSOR_MODULE].DTensor.from_local(
            out, mesh, placements, shape=shape, stride=make_contiguous_strides_for(shape)
        )


def _pad_columns(x: Tensor, n: int, dim: int) -> Tensor:
    """`x` with `n` columns of `-inf` appended along `dim` (differentiable; they get no gradient)."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - dim % x.dim()) + (0, n), value=float("-inf"))


def _placement_error(name: str, x: Any, why: str) -> ValueError:
    return ValueError(
        f"{name} is a DTensor with placements {tuple(x.placements)} on a mesh of shape {tuple(x.device_mesh.shape)}: "
        f"{why}"
    )


def _vocab_mesh_dim(x: Any, dim: int, name: str) -> int | None:
    """The mesh dim that shards `x`'s dim `dim`, or `None` when every placement is `Replicate()`."""
    placements = sys.modules[_DTENSOR_MODULE]  # loaded: `x` is a DTensor
    found = None
    for mesh_dim, placement in enumerate(x.placements):
        if type(placement) is placements.Shard and placement.dim % x.dim() == dim:
            if found is not None:
                raise _placement_error(name, x, "the vocabulary may be sharded over one mesh dim only")
            found = mesh_dim
        elif not isinstance(placement, placements.Replicate):
            why = f"{placement} is not supported; lossfx accepts Shard({dim}) (the vocabulary dim) on one mesh dim"
            raise _placement_error(name, x, f"{why} and Replicate() on the others")
    return found


def _same_group(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """The same group (`None`: none); while tracing, the same group object."""
    if a is b:
        return True
    if a is None or b is None or tracing():  # the rank lists cannot be read while tracing; identity decides
        return False
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def vocab_shard(
    x: Any,
    *,
    name: str,
    roles: Roles = _NO_ROLES,
    dim: int = -1,
    group: ProcessGroup | None = None,
    rank: int | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    even: bool = False,
) -> VocabShard:
    """Split a possibly-DTensor argument sharded on its vocabulary dim `dim` into what the kernels take.

    A plain `x` passes through with the explicit arguments. A DTensor gives its local tensor and
    the group, rank, `vocab_start` and `vocab_size` of its placement; explicit arguments must
    agree with them (`ValueError` otherwise). `even=True` (for kernels that assume shards of one
    width, `vocab_start = rank · Vl`) pads an uneven local shard with `-inf` columns to the width
    `ceil(V/R)` of torch's sharding rule, so that assumption holds; `-inf` logits have zero
    probability and receive no gradient, and `wrap` strips the padding.

    `name` is `x`'s parameter; `roles` (the caller's `boundary` roles) names the parameters that
    `group` (`tp`), `rank`, `vocab_start` (`start`) and `vocab_size` (`size`) come from, for the
    messages: each one given must be declared there.

    Raises:
        TypeError: a `group` that is not a `ProcessGroup` (or `None`), a non-int `vocab_start` /
            `vocab_size`.
        ValueError: a placement other than `Shard(dim)` on one mesh dim and `Replicate()`
            elsewhere; an explicit argument that contradicts the DTensor; for a plain `x`, a
            vocabulary range it cannot hold (`_check_span`).
    """
    _check_declared(name, roles, group, rank, vocab_start, vocab_size)
    check_group(str(roles.tp), group)
    for arg, value in ((roles.start, vocab_start), (roles.size, vocab_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{arg} must be an int or None, got {value!r} ({type(value).__name__})")
    if not is_dtensor(x):
        _check_span(x, dim, name, group, roles, vocab_start, vocab_size)
        return VocabShard(x, group, rank, vocab_start, vocab_size)
    if x.dim() == 0:
        raise _placement_error(name, x, "a 0-d tensor has no vocabulary dim")
    vdim = dim % x.dim()
    mesh_dim = _vocab_mesh_dim(x, vdim, name)
    global_vocab = x.shape[vdim]
    local = x.to_local()
    if mesh_dim is None or x.device_mesh.size(mesh_dim) == 1:
        mesh_group, mesh_rank, start = None, None, 0
    else:
        mesh = x.device_mesh
        mesh_group, mesh_rank = mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim)
        start = _shard_start(global_vocab, mesh.size(mesh_dim), mesh_rank)
    if group is not None and not (group.size() == 1 if mesh_group is None else _same_group(group, mesh_group)):
        raise ValueError(
            f"the explicit process group (size {group.size()}) disagrees with the DTensor {name}, whose placements "
            f"{tuple(x.placements)} give {'no tensor parallelism' if mesh_group is None else 'another group'}; "
            "pass the DTensor alone"
        )
    for arg, given, derived in (
        (roles.rank, rank, mesh_rank),
        (roles.start, vocab_start, start),
        (roles.size, vocab_size, global_vocab),
    ):
        if given is not None and derived is not None and given != derived:
            raise ValueError(f"{arg}={given} disagrees with the DTensor {name}, whose placement gives {derived}")
    # torch's rule: every shard but the last ones is ceil(V/R) wide
    padded = -(-global_vocab // mesh_group.size()) - local.shape[vdim] if even and mesh_group is not None else 0
    if padded:
        local = _pad_columns(local, padded, vdim)
    return VocabShard(local, mesh_group, mesh_rank, start, global_vocab, x, padded)


def _check_declared(name: str, roles: Roles, *given: Any) -> None:
    """Every layout argument given to `vocab_shard` has its parameter declared (a lossfx bug if not)."""
    roles_given = zip(("tp", "rank", "start", "size"), given, strict=True)
    missing = ", ".join(role for role, value in roles_given if value is not None and getattr(roles, role) is None)
    if missing:
        raise TypeError(f"vocab_shard({name}): the caller's roles declare no parameter for {missing} ({roles})")


def _check_span(
    x: Any, dim: int, name: str, group: Any, roles: Roles, vocab_start: int | None, vocab_size: int | None
) -> None:
    """The explicit vocabulary range of a plain shard `x` (its dim `dim` holds `Vl` ids).

    Without a tensor-parallel group (or with a group of one rank) `x` is the whole vocabulary:
    `vocab_start` must be 0 and `vocab_size` must be `Vl`. With a group, this shard's ids
    `[vocab_start, vocab_start + Vl)` must lie inside `[0, vocab_size)` (without `vocab_size`:
    `vocab_start >= 0`); that the shards of all ranks tile `[0, V)` is the cross-rank check's business.
    """
    if (vocab_start is None and vocab_size is None) or not isinstance(x, Tensor) or x.dim() == 0:
        return  # nothing explicit to check, or the caller's own checks reject `x`
    width = x.shape[dim]
    group_arg, start_arg, size_arg = roles.tp, roles.start, roles.size
    if group is None or group.size() == 1:
        if vocab_start not in (None, 0):
            raise ValueError(
                f"{start_arg}={vocab_start} without a tensor-parallel group ({group_arg} of one rank or None): "
                f"{name} then holds the whole vocabulary [0, {width}), which starts at 0; pass {group_arg} for a shard"
            )
        if vocab_size not in (None, width):
            raise ValueError(
                f"{size_arg}={vocab_size} without a tensor-parallel group ({group_arg} of one rank or None) must "
                f"equal the {width} vocabulary entries of {name} (its dim {dim}), which hold the whole vocabulary"
            )
        return
    if vocab_size is not None and vocab_size < width:
        raise ValueError(
            f"{size_arg}={vocab_size} is smaller than this rank's shard: {name} has {width} vocabulary entries"
        )
    high = None if vocab_size is None else vocab_size - width  # without vocab_size the cross-rank check bounds it
    if vocab_start is not None and (vocab_start < 0 or (high is not None and vocab_start > high)):
        raise ValueError(
            f"{start_arg}={vocab_start} puts this rank's {width} vocabulary entries of {name} at "
            f"[{vocab_start}, {vocab_start + width}), outside [0, {'V' if vocab_size is None else vocab_size}); "
            f"{start_arg} must lie in [0, {'V - ' + str(width) if high is None else high}]"
        )


def _shard_start(size: int, parts: int, rank: int) -> int:
    """The first index of shard `rank` of `size` entries split in `parts` by torch's `Shard` rule
    (`torch.chunk`: shards of `ceil(size/parts)`, the last ones shorter or empty).

    A Python int from the mesh coordinate, so a compiled graph specialises on it per rank: torch's
    `compute_local_shape_and_global_offset` reads the offset back from an index tensor, which
    under `torch.compile` is a data-dependent (unbacked) value that no check can branch on.
    """
    return min(rank * -(-size // parts), size)


def replicated(x: Any, name: str) -> Any:
    """A replicated argument (ids, masks, teacher payloads): a plain tensor (or anything else)
    passes through; an all-`Replicate()` DTensor gives its local (full) tensor; others raise."""
    if not is_dtensor(x):
        return x
    if not all(isinstance(p, sys.modules[_DTENSOR_MODULE].Replicate) for p in x.placements):
        raise _placement_error(name, x, "this argument must be a plain tensor or a Replicate() DTensor")
    return x.to_local()


SHARD = "_shard"  # the key of a view's `VocabShard` (a leading `_`: the cross-rank check skips it)
CALLER = "_caller"  # the key of the caller's own `data` mapping in a view (returned, and written to)


def resolved_shard(view: Mapping[str, Any] | None) -> VocabShard:
    """The `VocabShard` a function's view resolved (`local_view`; `boundary(local=...)` hands
    the body its view as `_view`): a DTensor's, whose `wrap` places results like it, or a plain one."""
    assert view is not None, "boundary(local=...) hands the body its view"
    return view[SHARD]


def _holds_dtensor(value: Any) -> bool:
    """A DTensor, or a mapping or sequence holding one (`data`, teacher heads)."""
    values = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else (value,)
    return any(map(is_dtensor, values))


def local_view(
    roles: Roles,
    *,
    even: bool | Callable[[Mapping[str, Any]], bool] = False,
    hint: str = "",
    when_dtensor: bool = False,
    then: Callable[[dict[str, Any], VocabShard], None] | None = None,
) -> View:
    """The one unwrap of a public call, driven by its `Roles`
    (`boundary(roles=roles, local=local_view(roles))`): the cross-rank check
    compares what it returns and the body runs on it, once.

    * the vocabulary shard: the LM head `roles.head` (its rows), else the first DTensor of
      `roles.shards` (their last dim; else the first of them, plain), resolved by `vocab_shard`
      with the explicit `roles.tp`, `rank`, `start`, `size` arguments, which it fills in; its
      `VocabShard` under `SHARD` (`resolved_shard`: results are placed back like it);
    * the other `roles.shards` split like it (`split_like`), each of `roles.heads` its rows
      (`local_heads`);
    * the mapping `roles.reads` names (`data`), as a new dict: the columns the call reads
      (`roles.reads`, but this rank's shards `roles.shard_columns`) their replicated local tensors
      (`replicated`: any other DTensor raises, naming the column), `roles.columns` padded like the
      shard, the columns it never reads as they are; the caller's own mapping under `CALLER`;
    * `then(arguments, shard)`: what a function unwraps its own way (sequence-parallel rows);
    * every other DTensor: its replicated local tensor (`replicated`).

    Which arguments held DTensors is one more compared field: a rank passing a DTensor where its
    peer passes a plain tensor takes another path (DTensor outputs, their collectives). `even`:
    uneven DTensor shards are padded (`vocab_shard`; or a function of the arguments); `hint`:
    appended to a disagreement on `roles.rows` when the shard is a DTensor; `when_dtensor`:
    without any DTensor the arguments are as given. An argument it rejects is a compared field,
    then the boundary's error (`_rejected`)."""
    candidates = (roles.head,) if roles.head is not None else roles.shards
    # `vocab_shard`'s layout keywords (`VocabShard`'s fields of the same names) and their parameters
    layout = dict(zip(VocabShard._fields[1:5], (roles.tp, roles.rank, roles.start, roles.size), strict=True))

    def view(call: dict[str, Any]) -> tuple[dict[str, Any], str]:
        arguments = dict(call)
        given = tuple(name for name, value in arguments.items() if _holds_dtensor(value))
        if when_dtensor and not given:
            return {REJECTED: None, **arguments}, ""
        try:
            first = next((name for name in candidates if is_dtensor(arguments[name])), candidates[0])
            shard = vocab_shard(
                arguments[first],
                name=first,
                roles=roles,
                dim=0 if roles.head is not None else -1,
                even=even(arguments) if callable(even) else even,
                **{keyword: arguments.get(arg) for keyword, arg in layout.items()},  # type: ignore[arg-type]
            )
            arguments.update({name: split_like(shard, arguments[name], name) for name in roles.shards if name != first})
            if roles.heads is not None:
                student = "the student logits are" if roles.head is None else "the student head is"
                arguments[roles.heads] = local_heads(arguments[roles.heads], shard, roles.heads, student)
            if roles.reads is not None and isinstance(arguments.get(roles.reads[0]), Mapping):
                key, reads = roles.reads
                read = set(reads(arguments)) - set(roles.shard_columns)
                data = {k: replicated(v, f"{key}[{k!r}]") if k in read else v for k, v in arguments[key].items()}
                data.update({column: shard.pad_full(data[column]) for column in roles.columns if column in data})
                arguments.update({CALLER: arguments[key], key: data})
            if then is not None:
                then(arguments, shard)
            arguments.update({k: replicated(v, k) for k, v in arguments.items() if k != first and is_dtensor(v)})
        except (ValueError, TypeError) as err:
            return _rejected(call, err, roles.tp, (*candidates, *roles.shards)), ""
        arguments.update({first: shard.local, SHARD: shard})
        arguments.update({arg: getattr(shard, keyword) for keyword, arg in layout.items() if arg in arguments})
        if given:
            arguments["DTensor arguments"] = given
        return {REJECTED: None, **arguments}, hint if shard.dtensor is not None else ""

    return view


def split_like(shard: VocabShard, x: Any, name: str) -> Any:
    """`x` split on its last (vocabulary) dim like `shard` (a teacher beside the logits, a bias
    beside the head's rows), local: a DTensor over the same group, on the same range; a plain
    tensor is this rank's part already. Padded like the shard (`even`)."""
    if is_dtensor(x):
        other = vocab_shard(x, name=name)
        if shard.dtensor is None or not _same_group(other.group, shard.group) or other.vocab_start != shard.vocab_start:
            where = "a plain tensor" if shard.dtensor is None else f"placements {tuple(shard.dtensor.placements)}"
            raise ValueError(
                f"{name} is a DTensor with placements {tuple(x.placements)} on {x.device_mesh}; it must be split "
                f"like the vocabulary shard ({where}): over the same group, on the same vocabulary range"
            )
        x = other.local
    if shard.padded and isinstance(x, Tensor) and x.dim():
        return _pad_columns(x, shard.padded, x.dim() - 1)
    return x


def local_heads(heads: Any, shard: VocabShard, name: str, student: str) -> Any:
    """Each LM head of `heads` (a mapping, a list or one tensor, as given) as this rank's rows
    `[Vl, H]`, beside the student's `shard` (`student`: "the student logits are", in messages).

    A `Shard(0)` DTensor head over the shard's vocabulary group gives its local rows (torch's
    split, uneven included: the same rows as the shard's); a `Replicate()` one gives the full
    `[V, H]`; a plain tensor is this rank's rows already. The row counts are checked against the
    shard afterwards (by the function; across ranks by the consistency check).

    Raises:
        ValueError: a head placement other than `Shard(0)` / `Replicate()`; a head sharded over
            another group than the shard, or over a group when the DTensor shard is not
            vocabulary-parallel.
    """

    def rows(weight: Any, label: str) -> Any:
        if not is_dtensor(weight):
            return weight
        head = vocab_shard(weight, dim=0, name=label)
        tied = shard.group is not None or shard.dtensor is not None  # (a plain shard without a group: any head)
        if head.group is not None and tied and not _same_group(head.group, shard.group):
            where = "not vocabulary-parallel" if shard.group is None else "sharded over another group"
            raise ValueError(
                f"{label} is a DTensor sharded on its rows over {head.group.size()} ranks (placements "
                f"{tuple(weight.placements)}), but {student} {where}: shard the teacher head "
                "like it (Shard(0) over its vocabulary mesh dim), or pass this rank's rows as a plain tensor"
            )
        return head.local

    if isinstance(heads, Mapping):
        return {key: rows(w, f"{name}[{key!r}]") for key, w in heads.items()} if _holds_dtensor(heads) else heads
    if isinstance(heads, (list, tuple)):
        return [rows(w, f"{name}[{i}]") for i, w in enumerate(heads)]
    return rows(heads, name)


def _rejected(
    arguments: dict[str, Any], err: Exception, group_arg: str | None, first: tuple[str, ...]
) -> dict[str, Any]:
    """The view of `arguments` when the view rejected one of them (a placement, or an explicit
    argument that contradicts it) with `err`, a `ValueError` / `TypeError` not raised here, before
    the check's collective, where the peers would wait for this rank: the error's text becomes one
    more field (`REJECTED`), so ranks that disagree about it raise the check's error together, and
    ranks that agree pass the check, then `boundary` raises the error itself (kept under
    `REJECTED_ERROR`) in place of the body, each the same. Every DTensor is dropped (also the
    values of a mapping argument); without an explicit `group_arg` the group checked is the mesh
    group of the first DTensor (of the arguments `first`, else of any): the group of its first
    `Shard` mesh dim (or a 1-D mesh's only dim), none when it has one rank."""
    found = [arguments[name] for name in first if is_dtensor(arguments.get(name))]

    def drop(value: Any) -> Any:
        if is_dtensor(value):
            found.append(value)
            return None
        if isinstance(value, Mapping) and _holds_dtensor(value):
            return {k: drop(v) for k, v in value.items()}
        return value

    rejected = {k: drop(v) for k, v in arguments.items()}
    if group_arg is not None and rejected.get(group_arg) is None and found:  # meet the peers over the mesh's group
        mesh, placements = found[0].device_mesh, found[0].placements
        dims = [d for d, p in enumerate(placements) if type(p).__name__ == "Shard"] or ([0] if mesh.ndim == 1 else [])
        rejected[group_arg] = mesh.get_group(dims[0]) if dims and mesh.size(dims[0]) > 1 else None
    # traced, the message is not a constant Dynamo can hash: the error's type stands for it
    why = type(err).__name__ if tracing() else f"{type(err).__name__}: {err}"
    return {REJECTED: why, REJECTED_ERROR: err, **rejected}
