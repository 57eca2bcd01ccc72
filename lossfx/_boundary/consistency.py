"""Cross-rank consistency check: every rank of a group must make the same call.

A collective only works when every rank of its group calls it with matching sizes. When ranks
disagree (a different batch, dtype, `top_k` or shard width) gloo either aborts the process or,
worse, exchanges buffers that happen to have the same size and returns a silently wrong answer.
This module turns every such disagreement into the same `ValueError` on every rank.

How (one idea): each public function that runs collectives is wrapped by `boundary`.
Before the function runs, every rank encodes its call into a fixed-length int64 *signature*
(`[SIGNATURE_LEN]`: the function called, grad mode, every tensor argument's shape, dtype and
`requires_grad` (they decide the backward's collectives), the policy `lossfx.chunk_policy` forces
(process state that sizes the eager loops, or none), a `fingerprint` of the values of every
tensor that must be replicated over the group (floats as values: `-0.0` is `+0.0`), every scalar
argument, the fields of `sampling_params`, `loss_fn` and the `data` columns the call reads
(`Roles.reads`: the others are not encoded), this rank's vocabulary shard width and `vocab_start`;
the rows of a fused LM-head `weight [Vl, H]`), and one all-gather of it runs per process group
(tensor parallel first, then context parallel). The length is fixed, so ranks that disagree
about everything else still agree on the size of this one collective; the fields past its body
are compared through digests of all of them (computed on the device, or in a compiled graph). Every rank then compares
the same gathered matrix with the same rules, so every rank raises the same error (naming the
field and each rank's value) or none does; after an error the group is still in step.

Rules across the tensor-parallel group: every field must agree except the shard's own layout
(`vocab_start`, `vocab_parallel_rank`, the vocabulary width of the logits), which must tile
`[0, V)` as the kernels will read it (`vocab` policy of the wrapped function, see
`boundary`; traced, judged in the graph too). Tensors sharded per rank (vocabulary shards, `data`
shard columns, sequence-parallel rows) are not fingerprinted; a vocabulary-wide payload column
(`Roles.columns`) is fingerprinted over `[0, V)`. Across the context-parallel group every field must
agree but the fingerprints of the tensors that are this rank's sequence part (`Roles.cp_shards`);
canonical ids, masks and teacher payloads are compared, and so is the logits' `requires_grad` (their
backward all-reduces over CP).

Nested public calls are checked once: the outermost wrapped call checks, the calls it makes
inside its scope do not. There is no switch. Under `torch.compile` the check is traced into the
graph (`_check`, traced: a functional all-gather issued first, its wait and assertions just before
the kernel's first collective, which reads their token; no graph break, no host read).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lossfx._boundary import debug as _debug
from lossfx._boundary.compile_errors import raise_while_tracing, reraise_while_tracing
from lossfx._boundary.validation import assert_in_graph
from lossfx._core import chunking as _chunking
from lossfx._core import host_reads as _host_reads

__all__ = [
    "SIGNATURE_LEN",
    "ShardWidths",
    "boundary",
    "fingerprint",
]

F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------------------------------------
# Fingerprints of replicated tensors
# ---------------------------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# splitmix64's finaliser constants, as signed int64 (odd: multiplying by them is a bijection mod 2^64)
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _shift_right(h: Tensor, bits: int) -> Tensor:
    """`h >>> bits`, a logical shift of int64 (an arithmetic shift with the sign bits masked off)."""
    return (h >> bits) & ((1 << (64 - bits)) - 1)


def fingerprint(x: Tensor) -> Tensor:
    """A 0-d int64 fingerprint of `x`'s bits, computed on `x`'s device (no host read).

    With `x` bit-cast to integers and flattened (`v [N]`; a float compares as a value: `-0.0` is
    read as `+0.0` and every NaN as one NaN, whatever its sign and payload), each element and its position are
    mixed by splitmix64's finaliser `m` (xor-shifts and odd multiplies: a bijection of int64),
    and `fingerprint = Σ_i m(v_i + i) · (2i + 1) mod 2^64`. For a fixed position both steps are
    bijections (an odd weight is invertible mod 2^64), so changing any one element always changes
    it; the position enters nonlinearly, so moved, swapped or shifted elements (`[a,b,b,a]` against
    `[b,a,a,b]`, a 0/1 mask shifted) change it too, but for a chance collision (2^-64). Integer
    arithmetic wraps and the sum is associative: every rank and every reduction order (eager,
    Inductor) get the same value. The index arithmetic stays small (`i`, `2i + 1`: Inductor's
    index expressions must not overflow); the mixing is on values. Dense equivalent: a checksum
    of `x.flatten()`. Compiles (`fullgraph=True`) to one fused pass.
    """
    t = x.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.is_floating_point():  # values, not bits: -0.0 is +0.0, every NaN is one NaN (-1: NaN bits)
        t = torch.where(t == 0, 0, torch.where(t.isnan(), -1, t.contiguous().view(_INT_OF_SIZE[t.element_size()])))
    position = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
    h = t.reshape(-1).to(torch.int64) + position
    h = (h ^ _shift_right(h, 30)) * _MIX1
    h = (h ^ _shift_right(h, 27)) * _MIX2
    h = h ^ _shift_right(h, 31)
    return (h * (position * 2 + 1)).sum()


# ---------------------------------------------------------------------------------------------
# The signature: a fixed-length int64 vector
# ---------------------------------------------------------------------------------------------

SIGNATURE_LEN = 256
_MAGIC = 0x4C4F53534658_01  # "LOSSFX", format 1
# header slots. _H_TRACED: 1 in the signature of a compiled call (compared: eager and compiled calls run
# different collectives; its rank cannot join the error path's exchange of values). _H_REJECTED: 1 in the
# signature of a rank that rejected its call while it was traced (its graph never runs): sent by
# `_exchange_rejection` at trace time, so that its peers' check fails instead of waiting for it
_H_MAGIC, _H_PATH, _H_DIGEST, _H_COUNT, _H_VERDICT, _H_WIDTH, _H_START, _H_SIZE, _H_RANK, _H_VALUES = range(10)
_H_TRACED, _H_REJECTED, _HEADER = 10, 11, 12
_MAX_FIELDS = (SIGNATURE_LEN - _HEADER) // 2  # each field is (kind, value)
_NONE = -(2**63)  # a header value that was not given

# field kinds
# _K_VALUES: a fingerprint compared across both groups; _K_VALUES_TP: across the tensor-parallel group
# only (a tensor that is this rank's sequence part under context parallelism)
_K_NONE, _K_BOOL, _K_INT, _K_FLOAT, _K_STR, _K_DTYPE, _K_TYPE, _K_VALUES, _K_VALUES_TP = range(9)
_functions: dict[int, str] = {}  # crc32 of a checked function's name -> the name


@dataclasses.dataclass(frozen=True)
class Roles:
    """What the check must know of a public function's parameters, declared where the function is
    defined (`boundary(roles=...)`): this module knows no parameter name. Every other argument is
    compared across the group as it is (a tensor's shape, dtype, `requires_grad` and values).

    Attributes:
        tp: the tensor-parallel (vocabulary) group; cp: the context-parallel group.
        cp_from: an argument whose `.cp_group` is the context-parallel group when `cp` is not given
            (a sharder; only its type is compared).
        shards: `[..., Vl]` vocabulary shards: the last dim is this rank's width (the first one
            given sets it; the others must match it), their values are not compared.
        head: an LM-head shard `[Vl, H]`: its rows are this rank's width.
        start, rank, size: this rank's first vocabulary id and index in `tp` (per rank: may differ),
            and the vocabulary size `V`.
        heads: a mapping `{key: [rows, H]}` of LM heads (or one head, or a list) beside the shards:
            its rows are checked against this rank's shard, not across ranks.
        reads: `(argument, keys)`: the mapping `argument` (`data`, where the function has it) is compared on the keys
            `keys(bound arguments)` that the call reads, and only those (present or not; a
            column the call never reads may differ per rank).
        columns: keys, in a mapping argument, of vocabulary-wide columns (the last dim is padded
            per rank: not compared; the values are fingerprinted over `[0, V)`, the part every rank reads).
        attrs: `(argument, attribute paths)`: the object `argument` (`loss_fn`) is compared on the
            dotted attribute paths the call reads (`"opd_full.chunk_size"`), and only those.
        shard_columns: keys, in a mapping argument, of this rank's shard of a vocabulary (`DRAFT`'s
            `student_logits`, a shard of the draft vocabulary under tensor parallelism and this
            rank's part of the sequence under context parallelism): neither their last dim nor
            their values are compared.
        cp_shards: arguments holding this rank's part of the sequence under context parallelism:
            their values are compared across the tensor-parallel group only (every other tensor is
            canonical on every CP rank).
        rows: `(tensor, flag)`: `tensor` holds this rank's rows (not replicated) when the `flag`
            argument is true.
        hint: appended to a disagreement on `rows`' tensor (`local` may replace it).
    """

    tp: str | None = None
    cp: str | None = None
    cp_from: str | None = None
    shards: tuple[str, ...] = ()
    head: str | None = None
    start: str | None = None
    rank: str | None = None
    size: str | None = None
    heads: str | None = None
    reads: tuple[str, Callable[[Mapping[str, Any]], tuple[str, ...]]] | None = None
    attrs: tuple[str, tuple[str, ...]] | None = None
    columns: tuple[str, ...] = ()
    shard_columns: tuple[str, ...] = ()
    cp_shards: tuple[str, ...] = ()
    rows: tuple[str, str] | None = None

    def names(self) -> set[str]:
        """Every parameter name this declaration refers to (each must be a parameter)."""
        single = (self.tp, self.cp, self.cp_from, self.head, self.start, self.rank, self.size, self.heads)
        return {n for n in (*single, *self.shards, *(self.rows or ())) if n is not None}


_NO_ROLES = Roles()


def _crc(text: str) -> int:
    """A 32-bit code of `text` (the text itself is kept by the call's `_Fields`, for its messages)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


# Under torch.compile: run at trace time, a constant in the graph. This is what
# `torch.compiler.assume_constant_result` sets; calling it at import would import torch._dynamo
# (inductor, DTensor: ~1 s), as `_boundary.compile_errors.raise_while_tracing` explains.
_crc._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _encode(value: Any) -> tuple[int, int]:
    """`(kind, int64)` of a scalar-like value (an enum comes as its value, `_Fields.add`): a float
    as a value like the fingerprints (`-0.0` is `0.0`, a NaN is one NaN), a string by the code of
    its text, any other object by its type (as `_show` words it)."""
    if value is None:
        return _K_NONE, 0
    if isinstance(value, bool):
        return _K_BOOL, int(value)
    if isinstance(value, int):
        return _K_INT, max(min(value, 2**63 - 1), -(2**63))
    if isinstance(value, float):
        value = math.nan if math.isnan(value) else value + 0.0
        return _K_FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]
    if isinstance(value, torch.dtype):
        return _K_DTYPE, _crc(str(value))
    if isinstance(value, str):  # a description (`_Kind`) and a string of the same text differ in kind
        return (_K_TYPE if isinstance(value, _Kind) else _K_STR), _crc(str(value))
    return _K_TYPE, _crc(_show(value))


def _show(value: Any) -> str:
    """How a scalar-like value reads in this rank's part of a message."""
    if isinstance(value, str) and not isinstance(value, _Kind):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return str(value)
    return f"a {type(value).__qualname__}"


_VALUES = "the values of "  # a replicated tensor's values (`_COLUMN_VALUES`: a vocabulary-wide column's)


class _Fields:
    """The ordered fields of one call: `labels[i]`, `owners[i]` (its argument, or its tensor's
    values: the compiled messages), `codes[i] = (kind, int64)` and `shown[i]` (this rank's value,
    worded by `_show` in an eager message). The label of field `i` depends only
    on the values of fields before it (a tensor's `ndim` precedes its dims, a mapping's keys
    precede its entries), so ranks compare labels position by position."""

    def __init__(self, roles: Roles = _NO_ROLES) -> None:
        self.roles = roles  # the parts the keys of a mapping argument play (`columns`, `shard_columns`)
        self.columns: list[tuple[str, str, Tensor]] = []  # (owner, label, tensor): vocabulary-wide, last
        self.owner, self.cp_shard = "", False  # the argument whose fields are being added; its part is this rank's
        self.labels: list[str] = []
        self.owners: list[str] = []
        self.codes: list[tuple[int, int]] = []
        self.shown: list[Any] = []  # this rank's values, worded (`_show`) only on the error path
        # (field index, int64 known on the device or in the graph only: a fingerprint, a traced float's bits)
        self.on_device: list[tuple[int, Tensor]] = []
        self.tp_only: list[int] = []  # the fields compared across the tensor-parallel group only (`cp_shard`)

    def add(self, label: str, value: Any) -> None:
        """A field: an enum by its value (`LossInputType.LOGPROB` and `"logprob"` agree)."""
        value = value.value if isinstance(value, enum.Enum) else value
        self.labels.append(label)
        self.owners.append(self.owner or label)  # (before the arguments: the field is its own owner)
        self.shown.append(value)
        if isinstance(value, float) and _host_reads.tracing():  # maybe symbolic: its bits in the graph
            self.on_device.append((len(self.codes), torch.tensor(value, dtype=torch.float64).view(torch.int64)))
            self.codes.append((_K_FLOAT, 0))
        else:
            self.codes.append(_encode(value))

    def tensor(
        self, label: str, value: Tensor, dims: Any, replicated: bool, grad: bool = True, what: str = _VALUES
    ) -> None:
        """A tensor's fields: kind, ndim, the compared `dims` (`(i, size)` pairs), dtype, whether autograd tracks it
        (`grad`: it decides the backward's collectives), and for a `replicated` one its fingerprint, labelled
        `what` + `label` (of this rank's sequence part, `cp_shard`: compared across the tensor-parallel group only)."""
        self.add(label, _Kind("Tensor"))
        self.add(f"{label}.ndim", value.dim())
        for i, d in dims:
            self.add(f"{label}.shape[{i}]", int(d))
        self.add(f"{label}.dtype", value.dtype)
        if grad:
            self.add(f"{label}.requires_grad", value.requires_grad)
        if replicated and value.device.type != "meta" and value.numel():
            self.on_device.append((len(self.codes), fingerprint(value)))
            self.tp_only += [len(self.codes)] * self.cp_shard
            self.labels.append(f"{what}{label} (which must be the same on every rank)")
            self.owners.append(f"{what}{label}")
            self.shown.append(_FINGERPRINT)  # filled in on the device
            self.codes.append((_K_VALUES_TP if self.cp_shard else _K_VALUES, 0))

    def walk(self, label: str, value: Any, depth: int = 0, vocab_dim: bool = False, replicated: bool = True) -> None:
        """Fields of `value`; its first field is always labelled `label` (its kind or value), so
        ranks passing different kinds of values still disagree on a field of the same label.
        Tensors that are `replicated` (not a per-rank shard) are fingerprinted; `vocab_dim`: the last
        dim is a vocabulary (padded per rank: not compared). The keys of a mapping argument play the
        parts `roles` gives them (`columns`, `shard_columns`)."""
        if isinstance(value, Tensor):
            self.tensor(
                label, value, enumerate(value.shape[:-1] if vocab_dim else value.shape), replicated and not vocab_dim
            )
            if vocab_dim and replicated and value.dim():
                self.columns.append((self.owner, label, value))
        elif isinstance(value, dist.ProcessGroup):
            self.add(label, _Kind(f"process group of size {value.size()}"))
        elif depth >= 2 or value is None or isinstance(value, (bool, int, float, str, enum.Enum, torch.dtype)):
            self.add(label, value)
        elif isinstance(value, Mapping):
            keys = sorted(value.keys(), key=str)
            self.add(label, _Kind(f"mapping with keys {[str(k) for k in keys]}"))
            for key in keys:  # a vocabulary-wide column's last dim may differ (padded per rank), a shard's values too
                shard = depth == 0 and key in self.roles.shard_columns
                vocab = shard or (depth == 0 and key in self.roles.columns)
                self.walk(f"{label}[{key!r}]", value[key], depth + 1, vocab, replicated and not shard)
        elif isinstance(value, (list, tuple)):
            self.add(label, _Kind(f"sequence of length {len(value)}"))
            for i, item in enumerate(value[:32]):
                self.walk(f"{label}[{i}]", item, depth + 1, replicated=replicated)
        else:  # an object: its type, and a dataclass's fields (another object's attributes: `attributes`)
            self.add(label, value)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                for f in dataclasses.fields(value):
                    self.walk(f"{label}.{f.name}", getattr(value, f.name, None), depth + 1, replicated=replicated)

    def attributes(self, label: str, value: Any, paths: tuple[str, ...]) -> None:
        """Fields of the object `value` as the call reads it: its type, then each dotted attribute
        path of `paths` (`Roles.attrs`) as `getattr` reads it (`__dict__`, slots, a property alike;
        an absent one, or one whose getter raises, is recorded as such). Nothing else of `value`."""
        self.add(label, _Kind(f"a {type(value).__qualname__}"))
        for path in paths:
            item: Any = value
            try:
                for name in path.split("."):
                    item = getattr(item, name, _ABSENT)
                    if item is _ABSENT:
                        break
            except Exception as err:  # recorded as such: ranks whose getters differ disagree
                item = _Kind(f"an attribute that raises {type(err).__name__}")
            self.walk(f"{label}.{path}", _Kind("absent") if item is _ABSENT else item, 1)


class _Kind(str):
    """A description encoded as itself (a string field shown without quotes)."""


_ABSENT, _FINGERPRINT = object(), object()


def _signature(
    name: str, arguments: Mapping[str, Any], roles: Roles = _NO_ROLES, cp: bool = False, world: int = 1
) -> tuple[Tensor, _Fields]:
    """`(signature [SIGNATURE_LEN] int64, its fields)` of a call of `name` with bound `arguments`,
    whose parameters play the `roles` declared with the function.

    The static fields are known on the host; the fingerprints of replicated tensors are computed
    on their device and written into the vector there (no host read). `cp`: a context-parallel group takes
    part (the logits' `requires_grad` is then compared: their backward all-reduces); `world`:
    the tensor-parallel size (a vocabulary-wide column is fingerprinted over `[0, V)`)."""
    fields = _Fields(roles)
    header = [_MAGIC, _crc(name), 0, 0, 0, _NONE, _NONE, _NONE, _NONE, 0, 0, 0]  # width, start, size, rank: not given
    heads = []
    fields.add("torch.is_grad_enabled()", torch.is_grad_enabled())  # decides the backward's collectives
    # process state, not an argument: it sizes the loops (and collectives)
    fields.add("the forced lossfx.chunk_policy", _Kind(_policy_text(_chunking._forced)))
    own_rows = roles.rows[0] if roles.rows and arguments.get(roles.rows[1]) else None  # this rank's rows
    tp = arguments.get(roles.tp) if roles.tp else None
    layout = {roles.start: _H_START, roles.size: _H_SIZE, roles.rank: _H_RANK}  # their header slots (per rank)
    for arg, value in arguments.items():
        fields.owner, fields.cp_shard = arg, arg in roles.cp_shards
        if arg.startswith("_"):  # a view's own state (its `VocabShard`), not an argument
            continue
        if arg in layout:
            header[layout[arg]] = _NONE if value is None else int(value)
        if arg == roles.heads and (isinstance(value, (list, tuple)) or (isinstance(value, Tensor) and value.dim())):
            value = dict(enumerate([value] if isinstance(value, Tensor) else value))  # checked as a mapping
        if roles.attrs and arg == roles.attrs[0] and value is not None:  # what the call reads of it, no more
            fields.attributes(arg, value, roles.attrs[1])
        elif arg == roles.heads and isinstance(value, Mapping) and value:
            heads.append((arg, value))  # after the loop, when this rank's shard is known
        elif arg in (roles.start, roles.rank):
            if arg == roles.rank:  # compared: a rank whose body rejects it must not leave its peers waiting
                own = type(value) is int and isinstance(tp, dist.ProcessGroup) and value == tp.rank()
                fields.add(f"whether {arg} is this process's rank in {roles.tp}", own)
        elif arg == roles.cp_from:
            fields.add(arg, value)  # its state is this rank's: only its type is compared
        elif arg in roles.shards and isinstance(value, Tensor) and value.dim():
            # the shard width is per rank (header); a second shard (a teacher) must match the first
            if header[_H_WIDTH] == _NONE:
                header[_H_WIDTH] = int(value.shape[-1])
            fields.tensor(arg, value, enumerate(value.shape[:-1]), False, grad=cp)  # CP: their backward all-reduces
            fields.add(f"{arg}.shape[-1] == the shard width", int(value.shape[-1]) == header[_H_WIDTH])
        elif arg == roles.head and isinstance(value, Tensor) and value.dim():
            # an LM-head shard: its row count is this rank's vocabulary width; the other dims must agree
            header[_H_WIDTH] = int(value.shape[0])
            fields.tensor(arg, value, list(enumerate(value.shape))[1:], replicated=False)
        else:
            per_rank = arg in (own_rows, roles.heads)
            if roles.reads and arg == roles.reads[0] and isinstance(value, Mapping):  # what the call reads, no more
                read = roles.reads[1](arguments)
                value = {k: v for k, v in value.items() if k in read}
            fields.walk(arg, value, replicated=not per_rank)
    fields.cp_shard = False
    for arg, value in heads:
        fields.owner = arg
        _head_fields(fields, arg, value, header)
    for owner, label, column in fields.columns:  # replicated over [0, V); a wider payload's tail is never read
        fields.owner = owner
        width, size = header[_H_WIDTH], header[_H_SIZE]  # (neither given: the column's own width)
        vocab = size if size != _NONE else column.shape[-1] if width == _NONE else world * width
        column = column[..., : max(vocab, 0)]
        fields.tensor(f"{label}[..., :{vocab}]", column, [], replicated=True, grad=False, what=_COLUMN_VALUES)
    flat = [x for code in fields.codes for x in code]
    header[_H_COUNT], header[_H_TRACED] = len(fields.codes), int(_host_reads.tracing())
    devices = [v.device for _, v in fields.on_device if v.device.type != "cpu"]  # (a traced float's bits: CPU)
    device = devices[0] if devices else None
    length = max(SIGNATURE_LEN, _HEADER + len(flat))  # every field, then the ones past the body are digested
    sig = torch.tensor(header + flat + [0] * (length - _HEADER - len(flat)), dtype=torch.int64, device=device)
    if fields.on_device:  # values known on the device (or in the graph) only
        slots = torch.tensor([_HEADER + 2 * i + 1 for i, _ in fields.on_device], device=device)
        sig = sig.index_put((slots,), torch.stack([v.to(sig.device) for _, v in fields.on_device]))
    if length > SIGNATURE_LEN:  # the fields past the body, all of them, eager or compiled: two digests
        rest, sig = sig[SIGNATURE_LEN:], sig[:SIGNATURE_LEN]
        tp_only_slots = [2 * (i - _MAX_FIELDS) + 1 for i in fields.tp_only if i >= _MAX_FIELDS]
        canonical = rest.index_fill(0, torch.tensor(tp_only_slots, device=device), 0) if tp_only_slots else rest
        digests = torch.stack([fingerprint(canonical), fingerprint(rest)])  # across both groups; across TP
        sig = sig.index_put((torch.tensor([_H_DIGEST, _H_VALUES], device=device),), digests)
    return sig, fields


_COLUMN_VALUES = "the values over [0, V) of "  # a vocabulary-wide column's label: V is of this rank's layout


def _policy_text(policy: _chunking.ChunkPolicy | None) -> str:
    """How `policy` (forced by `lossfx.chunk_policy`, or `None`) reads in a disagreement. Traced,
    the fields are read one by one (Dynamo guards on each: another policy retraces the check)."""
    if policy is None:
        return "none (each device's default)"
    return (
        f"ChunkPolicy(row_bytes={policy.row_bytes}, min_rows={policy.min_rows}, tile_bytes={policy.tile_bytes}, "
        f"max_block={policy.max_block}, chunk_bytes={policy.chunk_bytes}, compile_tiles={policy.compile_tiles})"
    )


def _head_fields(fields: _Fields, arg: str, heads: Mapping[Any, Any], header: list[int]) -> None:
    """Fields of `{key: W [rows, H]}` LM-head shards beside the logits: every dim but the rows, and
    whether the rows are this rank's vocabulary rows (the logits' width, or with `vocab_size` the
    real part `clamp(V - rank·width, 0, width)` of a shard padded to the even width)."""
    width, size, rank = header[_H_WIDTH], header[_H_SIZE], header[_H_RANK]
    rows = width if _NONE in (width, size, rank) else min(max(size - rank * width, 0), width)
    keys = sorted(heads, key=str)
    fields.add(arg, _Kind(f"mapping with keys {[str(k) for k in keys]}"))
    for key in keys:
        label, w = f"{arg}[{key!r}]", heads[key]
        if not isinstance(w, Tensor) or not w.dim():
            fields.walk(label, w, 1)
            continue
        fields.tensor(label, w, list(enumerate(w.shape))[1:], replicated=False, grad=False)
        n = int(w.shape[0])
        fields.add(
            f"{label}.shape[0], this rank's vocabulary rows",
            _Kind("as the shard" if n == rows else f"{n} rows, the shard has {rows}"),
        )


# ---------------------------------------------------------------------------------------------
# Judging the gathered signatures: one decision, eager and compiled
# ---------------------------------------------------------------------------------------------


_REJECTED_WHAT = "whether the call is valid (a rank rejected it while compiling: its own error says why)"
# the header fields judged first, in this order: (what, slots)
_HEAD = (
    ("the function called", (_H_MAGIC, _H_PATH)),
    (_REJECTED_WHAT, (_H_REJECTED,)),
    ("how the call runs, compiled or eagerly (they run different collectives)", (_H_TRACED,)),
)
# across the context-parallel group the shard layout must agree too (after the header): {slot: what}
_CP_LAYOUT = {
    _H_WIDTH: "the vocabulary shard width",
    _H_START: "the first vocabulary id",
    _H_SIZE: "the vocabulary size",
    _H_RANK: "the vocabulary-parallel rank",
}
_IN_GRAPH = (
    "{} disagree on {}. Every rank of a group must make the same call (compiled: each rank's value is not shown; "
    "the same call run eagerly shows it)"
)
_LAYOUT_WHAT = "the vocabulary shard layout (each rank's width, first id and V: the shards must tile [0, V))"


_How = tuple[tuple[int, ...], tuple[bool, ...], str]  # how `_judged` judges one group: (group_of, columns, layout)


def _assertions(
    owners: tuple[str, ...], tp_only: tuple[int, ...], across_tp: bool, layout: str, where: str
) -> tuple[tuple[str, ...], _How]:
    """The check's assertions over one group, in the order they are judged: `(the compiled message
    of each, how `_judged` judges them: (the assertion comparing each signature slot (none: the
    number of assertions), whether each compares a vocabulary-wide column's values, `layout`))`.
    The header (`_HEAD`); across the context-parallel group the shard layout (`_CP_LAYOUT`: the
    same on every rank); each run of consecutive fields of one argument (`owners`: the call's
    `_Fields`; a replicated tensor's values a run of their own; across CP not the fingerprints of
    sequence shards, `tp_only`); the fields past the body; last, the vocabulary-layout rules as
    `layout` needs (`_layout_flags`: no slots). The runs before the first disagreeing field are the
    same on every rank (labels depend only on earlier fields), so every rank fails the same
    assertion first. `where`: the messages' `lossfx.<function>: the ranks of <group>`. Run for real
    under torch.compile (a constant of the graph: Dynamo interprets each Python step it traces,
    ~35k steps here); cached (`_assertions_of`)."""
    return _assertions_of(owners, tp_only, across_tp, layout, where)


@functools.lru_cache(maxsize=64)
def _assertions_of(
    owners: tuple[str, ...], tp_only: tuple[int, ...], across_tp: bool, layout: str, where: str
) -> tuple[tuple[str, ...], _How]:
    groups = [(what, list(slots)) for what, slots in _HEAD]
    if not across_tp:
        groups.append(("the vocabulary shard layout (this rank's width, first id, V and rank)", list(_CP_LAYOUT)))
    for i, owner in enumerate(owners[:_MAX_FIELDS]):
        slots = [_HEADER + 2 * i] + [_HEADER + 2 * i + 1] * (across_tp or i not in tp_only)
        if groups[-1][0] == owner:
            groups[-1][1].extend(slots)
        else:
            groups.append((owner, slots))
    rest = [_H_COUNT, _H_DIGEST] + [_H_VALUES] * across_tp
    groups.append((f"an argument past the first {_MAX_FIELDS} fields (or the values of a replicated tensor)", rest))
    if layout not in ("free", "auto"):
        groups.append((_LAYOUT_WHAT + ("; compiled, this function needs equal widths" * (layout == "equal")), []))
    where_is = {slot: g for g, (_, slots) in enumerate(groups) for slot in slots}  # each slot in one assertion at most
    group_of = tuple(where_is.get(slot, len(groups)) for slot in range(SIGNATURE_LEN))
    messages = tuple(_IN_GRAPH.format(where, what) for what, _ in groups)
    return messages, (group_of, tuple(what.startswith(_COLUMN_VALUES) for what, _ in groups), layout)


_assertions._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _judged(g: Tensor, how: _How) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """`(failed [n] bool, the layout)`: which of a group's `n` assertions (`_assertions`; `how`:
    their `(group_of, columns)` and the `layout` policy) the gathered signatures
    `g [R, SIGNATURE_LEN]` fail, and the layout as `_layout_flags` reads it
    (`(broken rules, spans)`; None when `layout` has no rules): the one decision of the check,
    tensor ops on a host copy of the gathered signatures (eager: read in the call's one host read,
    then judged with no device op; the first failed assertion worded by `_worded` or
    `_tiling_error`), on the device (the tensor-parallel verdict sent to the context-parallel
    peers) or in the graph (compiled: asserted). An assertion fails when the ranks differ in one
    of its slots; a field past the fewest any rank has is left to the count (a peer has another
    field there, or none); the values of a vocabulary-wide column (read over `[0, V)` of each
    rank's own layout) pass when the layout is broken, its cause; the layout rules fail the last
    assertion."""
    (group_of, columns, layout), constants = how, _constants if _host_reads.tracing() else _cached_constants
    member, field_of, kept, last = constants(group_of, columns, g.device)
    failed = (member & ((g != g[0]).any(0) & (field_of < g[:, _H_COUNT].min()))).any(1)
    if layout in ("free", "auto"):
        return failed, None
    broken, spans = _layout_flags(g, layout)
    return torch.where(broken.any(), (failed & kept) | last, failed), (broken, spans)


def _constants(group_of: tuple[int, ...], columns: tuple[bool, ...], device: torch.device) -> tuple[Tensor, ...]:
    """`_judged`'s constants for one group's assertions: which slots each compares `[n, L]`, the
    field of each slot (negative: the header), the assertions that still fail when the layout is
    broken (not a vocabulary-wide column's values) and the layout's own (the last)."""
    n = len(columns)
    member = torch.tensor(group_of, device=device) == torch.arange(n, device=device)[:, None]
    field_of = torch.arange(-_HEADER, SIGNATURE_LEN - _HEADER, device=device).div(2, rounding_mode="floor")
    return member, field_of, ~torch.tensor(columns, device=device), torch.arange(n, device=device) == n - 1


_cached_constants = functools.lru_cache(maxsize=64)(_constants)  # eager: built once per group's assertions


def _worded(
    failed: int, group_of: tuple[int, ...], sigs: list[list[int]], own: list[int], fields: _Fields, roles: Roles
) -> tuple[str, str] | None:
    """`(label, this rank's value)` of the first slot of the failed assertion `failed` (`_judged`)
    that the gathered signatures `sigs` disagree on (eager, on the error path), or None for the
    layout rules (no slots: `_tiling_error` words them). The label is this rank's, which is every
    rank's (labels depend only on the fields before the first difference)."""

    def differs(slot: int) -> bool:
        return len({s[slot] for s in sigs}) > 1

    slot = next((s for s, g in enumerate(group_of) if g == failed and differs(s)), None)
    if slot is None:
        return None
    if failed < len(_HEAD):
        version = " (another lossfx version)" * (own[_H_MAGIC] != _MAGIC)
        called = f"lossfx.{_functions.get(own[_H_PATH], '?')}{version}"
        shown = (called, "rejected" if own[_H_REJECTED] else "accepted", "compiled" if own[_H_TRACED] else "eager")
        return _HEAD[failed][0], shown[failed]
    if slot >= _HEADER:
        i, value = (slot - _HEADER) // 2, fields.shown[(slot - _HEADER) // 2]
        digest = f"fingerprint {own[_HEADER + 2 * i + 1] & (2**64 - 1):016x}"
        return fields.labels[i], digest if value is _FINGERPRINT else _show(value)
    if slot in _CP_LAYOUT:
        label = {_H_START: roles.start, _H_SIZE: roles.size, _H_RANK: roles.rank}.get(slot) or _CP_LAYOUT[slot]
        return label, "not given" if own[slot] == _NONE else str(own[slot])
    count = min(s[_H_COUNT] for s in sigs)  # the fields past the body
    if differs(_H_COUNT) and count < _MAX_FIELDS:  # the fields agree as far as every rank has them
        extra = f", the next: {fields.labels[count]}" if len(fields.labels) > count else ""
        what = "how many argument fields the call has (a DTensor or a column on some ranks only?)"
        return what, f"{own[_H_COUNT]} fields{extra}"
    digests = "/".join(f"{own[s] & (2**64 - 1):016x}" for s in (_H_DIGEST, _H_VALUES))  # (all, all but CP shards)
    what = f"an argument field past the first {_MAX_FIELDS} (or the values of a replicated tensor)"
    return what, f"digests {digests}"


def _describe(disagreement: tuple[str, str], group: dist.ProcessGroup, sigs: list[list[int]]) -> str:
    """`"label (rank 0: v0, rank 1: v1, ...)"`: every rank's own value, exchanged once. Runs on
    every rank of `group` together (they all found the same disagreement), only on the error path;
    with a compiled peer (it raises in its graph and exchanges nothing) only this rank's value."""
    label, value = disagreement
    if any(s[_H_TRACED] for s in sigs):
        return f"{label} (rank {group.rank()}: {value}; a peer runs compiled)"
    values: list[Any] = [None] * group.size()
    dist.all_gather_object(values, value, group=group)
    return f"{label} ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))})"


_RULES = 5  # the layout rules of `_layout_flags`


def _layout_flags(g: Tensor, policy: str) -> tuple[Tensor, Tensor]:
    """The vocabulary-layout rules, written once: `(broken [_RULES] bool, spans [3, R] int64)`.
    `broken`: which of them the shards of the gathered tensor-parallel signatures `g [R, L]`
    break as `policy` needs: equal widths (`"equal"`), one count of top-k candidates
    `min(k, R·Vl)` (`"topk:<k>"`), one size `V`, widths summing to `V` (`"sized"`), spans
    `[start, start + width)` tiling `[0, V)` (`"tiled"`, `"topk"`: `V = Σ widths`); a width not
    given (no shard argument) breaks nothing. `spans`: each rank's width, first id and `V` as the
    rules read them (a first id not given is `rank · width`, a size `R · width`), which
    `_tiling_error` words. Tensor ops (`_judged`'s: on a host copy, the device or in a graph)."""
    world, w = g.shape[0], g[:, _H_WIDTH]
    broken = [torch.zeros((), dtype=torch.bool, device=g.device)] * _RULES
    if policy == "equal":  # the spans as given: it reads the widths alone
        broken[0], spans = (w != w[0]).any(), g[:, _H_WIDTH : _H_SIZE + 1].T
    else:
        start = torch.where(g[:, _H_START] == _NONE, torch.arange(world, device=g.device) * w, g[:, _H_START])
        size = torch.where(g[:, _H_SIZE] == _NONE, world * w, g[:, _H_SIZE])
        if policy.startswith("topk:"):  # every rank sends min(k, R·Vl) candidates, then tiled with V = Σ widths
            m = torch.clamp(world * w, max=int(policy.removeprefix("topk:")))
            broken[1] = (m != m[0]).any()
            policy, size = "tiled", w.sum().expand(world)
        broken[2] = (size != size[0]).any()
        if policy == "sized":
            broken[3] = w.sum() != size[0]
        else:  # sorted by (start, width), each span starts where the ones before it end (a gap or an overlap breaks it)
            order = torch.argsort(start * (1 << 32) + w, stable=True)
            ends = torch.cumsum(w[order], 0)
            broken[4] = (start[order] != ends - w[order]).any() | (ends[-1] != size[0])
        spans = torch.stack([w, start, size])
    return torch.stack(broken) & ~(w == _NONE).any(), spans


def _tiling_error(broken: list[bool], spans: list[list[int]], policy: str, roles: Roles = _NO_ROLES) -> str:
    """The first layout rule the ranks' shards break, in words: `_layout_flags`' `broken` rules
    and `spans` (each rank's width, first id and `V`), formatted."""
    start_name, size_name = roles.start or "the first vocabulary id", roles.size or "the vocabulary size"
    widths, starts, sizes = spans
    shown = ", ".join(f"rank {r}: {w}" for r, w in enumerate(widths))
    spans_shown = ", ".join(f"rank {r}: [{s}, {s + w})" for r, (s, w) in enumerate(zip(starts, widths, strict=True)))
    return [
        f"the vocabulary shard width ({shown}); this function needs equal shards",
        f"the vocabulary shard width ({shown}): with uneven shards this function needs "
        f"k={policy.removeprefix('topk:')} <= world_size · the smallest width ({len(widths) * min(widths)})",
        f"the vocabulary size V ({', '.join(f'rank {r}: {v}' for r, v in enumerate(sizes))}; without {size_name} it is "
        f"world_size · the shard width, shard widths {shown}); pass {size_name} (and {start_name}) for uneven shards",
        f"the vocabulary: the shard widths ({shown}) sum to {sum(widths)}, not {size_name}={sizes[0]}",
        f"the vocabulary shards ({spans_shown}) which do not tile [0, {sizes[0]}); without {start_name} a "
        f"shard starts at rank · the shard width: pass {start_name} and {size_name} for uneven shards",
    ][broken.index(True)]


def _gather_on_device(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's `x` (1-D int64) stacked in rank order, `[R, L]`, still on the device. The same
    collective as the compiled check's functional all-gather, so an eager rank and a compiled
    one (e.g. past Dynamo's recompile limit) meet in it."""
    out = x.new_empty(group.size() * x.shape[0])
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name warns in 2.13
    gather(out, x, group=group)
    return out.view(group.size(), x.shape[0])


def _is_distributed(group: Any) -> TypeGuard[dist.ProcessGroup]:
    return isinstance(group, dist.ProcessGroup) and group.size() > 1


def _groups(arguments: Mapping[str, Any], roles: Roles) -> tuple[Any, str | None, Any, str | None]:
    """`(tp group, its argument, cp group, its argument)` of a call (`cp_from`'s `.cp_group`
    when `cp` is not given); a group of one rank, or none, is None."""
    tp_arg, cp_arg = roles.tp, roles.cp
    tp = arguments.get(tp_arg) if tp_arg else None
    cp = arguments.get(cp_arg) if cp_arg else None
    if cp is None and roles.cp_from and arguments.get(roles.cp_from) is not None:  # `LoadBalancedSharder(cp_group)`
        cp, cp_arg = getattr(arguments[roles.cp_from], "cp_group", None), f"{roles.cp_from}.cp_group"
    return (tp if _is_distributed(tp) else None), tp_arg, (cp if _is_distributed(cp) else None), cp_arg


def _check(
    name: str,
    arguments: Mapping[str, Any],
    policy: str,
    roles: Roles,
    hint: str = "",
    widths: ShardWidths | None = None,
) -> None:
    """All-gather this call's signature over its groups (tensor parallel, then context parallel)
    and judge it (`_judged`, the one decision); raise on any disagreement, on every rank.

    Eager: every rank runs the same collectives whatever it finds (the context-parallel signature
    carries the TP verdict, judged on the device), so no rank is left waiting; the gathered
    matrices are read with the call's other host reads (`_core.host_reads.defer`, settled before
    the call's first collective): one read (no device op between the gather and that read, but
    the TP verdict's when a CP group takes part). Each is then judged on its host copy (`_judged`
    on CPU tensors, constants cached) and worded (`_worded`, `_tiling_error`, each rank's value
    exchanged once on the error path). The tensor-parallel widths the ranks report are written
    into `widths` (the call's `ShardWidths`).

    Traced (`torch.compile`): the signature (static fields a constant of the graph, fingerprints
    computed in it) is all-gathered with a functional collective, issued here for every group
    before any assertion (a rank that rejected the call while tracing, `_exchange_rejection`,
    sends to each group in turn, then stops); the wait and the assertions (`_asserted`) are emitted
    just before the kernel's first collective (`_core.host_reads.defer_traced`: the round trip may
    overlap the kernel's first local pass): no graph break, no host read. A mismatch raises
    `RuntimeError` naming the argument, the same on every rank; each rank's value is not shown
    (that would be a host read). `"auto"` needs equal widths (traced `ShardWidths.range` has no
    gathered widths).
    """
    traced = _host_reads.tracing()
    tp, tp_arg, cp, cp_arg = _groups(arguments, roles)
    if tp is None and cp is None:
        return
    sig, fields = _signature(name, arguments, roles=roles, cp=cp is not None, world=tp.size() if tp is not None else 1)
    errors: list[str] = []
    in_graph = []

    def judge(group: dist.ProcessGroup, group_name: str | None, how: _How, values: list[int]) -> None:
        across_tp, (group_of, _, layout) = group is tp, how
        # the one judgement, of the host copy (no device op); its CPU tensors are read as host memory
        host = torch.tensor(values, device="cpu").view(group.size(), -1)  # (whatever the default device)
        verdict, rules = _judged(host, how)
        failed, sigs = verdict.numpy().tolist(), host.numpy().tolist()
        if any(failed):
            found = _worded(failed.index(True), group_of, sigs, sigs[group.rank()], fields, roles)  # None: the layout
            rows = roles.rows[0] if roles.rows else None
            shown = hint if found and rows and found[0].startswith((rows, f"the values of {rows}")) else ""
            if found:
                problem = _describe(found, group, sigs) + shown
            else:  # the last assertion, a layout rule (`_worded` finds no slot of it)
                assert rules is not None, "only a layout with rules has that assertion"
                broken, spans = (t.numpy().tolist() for t in rules)
                problem = _tiling_error(broken, spans, layout, roles)
            where = "lossfx" if found and found[0] == _HEAD[0][0] else f"lossfx.{name}"  # the same on every rank
            errors.append(f"{where}: the {group.size()} ranks of {group_name} disagree on {problem}")
        elif across_tp and widths is not None:
            widths.by_group[id(group)] = [s[_H_WIDTH] for s in sigs]
        bad = [r for r, s in enumerate(sigs) if s[_H_VERDICT]]  # across CP: a peer's tensor-parallel group failed
        if bad:
            errors.append(
                f"lossfx.{name}: rank(s) {bad} of {cp_arg} (size {group.size()}) found ranks of their "
                f"{tp_arg} disagreeing (see the error there)"
            )
        if errors and (cp is None or not across_tp):
            raise ValueError(
                f"{errors[0]}. Every rank of a group must make the same call (raised on every rank by "
                "lossfx's cross-rank consistency check; see docs/design.md)"
            )

    for group, group_name, across_tp in ((tp, tp_arg, True), (cp, cp_arg, False)):
        if group is None:
            continue
        layout = ("equal" if traced and policy == "auto" else policy) if across_tp else "free"
        where = f"lossfx.{name}: the ranks of {group_name}"
        messages, how = _assertions(tuple(fields.owners), tuple(fields.tp_only), across_tp, layout, where)
        if traced:  # issued only: the wait is the assertions', so the round trip flies while the kernel computes
            in_flight = torch.ops._c10d_functional.all_gather_into_tensor(sig, group.size(), group.group_name)
            in_graph.append((in_flight, messages, how))
            continue
        gathered = _gather_on_device(sig, group)
        _host_reads.defer(gathered, functools.partial(judge, group, group_name, how))
        if across_tp and cp is not None:  # the TP verdict, judged on the device too: carried to the CP peers
            sig = sig.clone()
            sig[_H_VERDICT] = _judged(gathered, how)[0].any().to(torch.int64)
    if in_graph:
        _host_reads.defer_traced(functools.partial(_asserted, in_graph))


def _asserted(checks: list[tuple[Any, ...]], before: Tensor | None) -> Tensor | None:
    """Traced, just before the kernel's first collective (`before`: its input; None when none
    follows): wait for each group's gathered signatures and assert `_judged`'s decision in the
    graph, inside `lossfx::assert_agreement`, whose token every collective of the call reads (so
    they run after it in any compiled order). Returns that token."""
    token = None
    for in_flight, messages, how in checks:
        gathered = torch.ops._c10d_functional.wait_tensor(in_flight).view(-1, SIGNATURE_LEN)  # [R, SIGNATURE_LEN]
        done = assert_in_graph(~_judged(gathered, how)[0], list(messages), before)
        token = done if token is None or done is None else token | done
    return token


def _tell_peers(name: str, arguments: Mapping[str, Any], roles: Roles, err: ValueError | TypeError) -> None:
    """Traced, a rejected call (`err`): its graph, with the check's all-gathers, never runs, so
    its groups' peers are sent a signature saying so (`_exchange_rejection`)."""
    tp, tp_arg, cp, cp_arg = _groups(arguments, roles)
    to = [(g.group_name, str(a)) for g, a in ((tp, tp_arg), (cp, cp_arg)) if g is not None]
    if to:
        device = next((str(v.device) for v in arguments.values() if isinstance(v, Tensor)), "cpu")
        kind = type(err).__name__ if isinstance(err, ValueError) else "TypeError"
        _exchange_rejection(name, tuple(n for n, _ in to), " and ".join(a for _, a in to), device, kind, str(err))


def _exchange_rejection(name: str, groups: tuple[str, ...], told: str, device: str, kind: str, message: str) -> bool:
    """Run for real at trace time by a rank whose traced call raises `kind(message)` (a bad
    argument found while tracing: its graph, with the check's all-gathers, will never run): send
    a signature saying so to each of the call's `groups` (by name, in the check's order; `told`
    names their arguments) as the
    compiled check of its peers would, so their check fails instead of waiting for this rank; then
    raise (`lossfx.<name>: <message> ...`). A host read, on the error path only (this rank stops anyway)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.distributed_c10d import _resolve_process_group

    with unset_fake_temporarily():
        sig = torch.zeros(SIGNATURE_LEN, dtype=torch.int64, device=device)
        sig[_H_MAGIC], sig[_H_PATH], sig[_H_TRACED], sig[_H_REJECTED] = _MAGIC, _crc(name), 1, 1
        for group_name in groups:
            _gather_on_device(sig, _resolve_process_group(group_name))  # type: ignore[arg-type]
    return raise_while_tracing(
        kind,
        f"lossfx.{name}: {message} (found while compiling this rank's call; the cross-rank check of its peers in "
        f"{told} fails with it)",
    )


# Under torch.compile: Dynamo runs it for real at trace time (see `_compile_errors.raise_while_tracing`)
_exchange_rejection._dynamo_marked_constant = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# The decorator and the shard layout it learns
# ---------------------------------------------------------------------------------------------


def _has_dtensor(arg: Any) -> bool:
    if isinstance(arg, Mapping):
        return any(type(v).__name__ == "DTensor" for v in arg.values())
    return type(arg).__name__ == "DTensor"


def _is_group_or_sharder(arg: Any) -> bool:  # a group, or a sharder's `.cp_group`
    return not isinstance(arg, Tensor) and isinstance(getattr(arg, "cp_group", arg), dist.ProcessGroup)


Local = Callable[[dict[str, Any]], tuple[dict[str, Any], str]]
# nesting of checked calls being traced by Dynamo (tracing is serialised by a lock). Only traced
# code changes it (symbolically; the replay after a graph writes 0 back): an eager call, in any
# thread, never does, so a thread tracing never reads another's state (tests/test_host_reads.py)
_traced_depth = [0]


def boundary(
    *,
    vocab: str | Callable[[Mapping[str, Any]], str] = "free",
    roles: Roles = _NO_ROLES,
    local: Local | None = None,
    collectives: bool = True,
) -> Callable[[F], F]:
    """The boundary of a public function, once per outermost call: the cross-rank consistency
    check (eager, or traced into the graph), the read-once scope of its host reads
    (`_core.host_reads.outermost`), and under `torch.compile` its `ValueError` / `TypeError` kept as
    such (`_boundary.compile_errors`). Nested public calls go straight to their body.

    Args:
        vocab: how the tensor-parallel shards must relate (or a function of the bound arguments
            returning it): `"free"` (any widths: no ids are mapped, e.g. entropy), `"equal"`
            (equal widths), `"tiled"` (the kernels' first id and size, defaults `rank · Vl` and
            `R · Vl`, must tile `[0, V)`), `"sized"` (widths sum to the size), `"topk:<k>"` (tiled,
            and `min(k, R·Vl)` equal on every rank) or `"auto"` (any widths: the function reads
            its layout from the call's `ShardWidths`, its `_widths` argument).
        roles: which parameters are the groups, the vocabulary shards and their layout
            (`Roles`), declared with the function; each must be one of its parameters.
        local: the view of a function that takes DTensors: maps the bound arguments to
            `(arguments with local tensors and the group and offsets of their placements, a hint
            appended to a disagreement on `roles.rows`)`. The check compares the view, and the
            body runs on its arguments (computed once per call: the view the check compared, or
            else the view run for the body alone, in a plain or nested call) and never sees a
            DTensor. A view that rejected its arguments (`REJECTED`, its error under
            `REJECTED_ERROR`) raises that error here, once the check passed (every rank rejected
            alike) and in place of the body. Without it, a call with DTensors is checked when the
            function re-enters itself with local tensors.
        collectives: False for a function that runs no collective of its own (no cross-rank
            check; the rest of the boundary applies).
    """

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)
        unknown = roles.names() - set(sig.parameters) - {roles.size if local else None}  # (a view may fill it in)
        if unknown:
            raise TypeError(f"boundary(roles=...) of {fn.__name__} names no parameter of it: {sorted(unknown)}")
        if collectives and not (roles.tp or roles.cp or roles.cp_from):  # it would never be checked
            raise TypeError(f"boundary of {fn.__name__}: declare its groups (roles=Roles(tp=..., cp=...))")
        checked_roles = roles if collectives else _NO_ROLES
        name = fn.__name__
        # a body that reads the shard widths takes the call's `ShardWidths` as `_widths`, one that
        # unwraps from the check's view takes it as `_view` (the view, or None): neither is public
        public = sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in (_WIDTHS, _VIEW)])
        _functions[_crc(name)] = name

        def body(*args: Any, widths: ShardWidths | None = None, view: Any = None, **kwargs: Any) -> Any:
            if local is not None:  # the body runs on the view's local arguments
                if view is None:
                    bound = public.bind(*args, **kwargs)
                    bound.apply_defaults()
                    view = local(dict(bound.arguments))[0]
                if view.get(REJECTED):  # the check passed (the ranks agree on it): the view's own error
                    raise view[REJECTED_ERROR]
                call = inspect.BoundArguments(public, {k: v for k, v in view.items() if k in public.parameters})
                args, kwargs = call.args, call.kwargs
            hidden = {_WIDTHS: widths or ShardWidths(), _VIEW: view}  # for a body that declares them
            return fn(*args, **kwargs, **{k: v for k, v in hidden.items() if k in sig.parameters})

        def run(traced: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not traced and _host_reads.depth():
                with _host_reads.nested():  # checked by the outermost call
                    return body(*args, **kwargs)
            values = (*args, *kwargs.values())
            dtensors = any(map(_has_dtensor, values))
            if (traced and _traced_depth[0]) or (dtensors and local is None):
                # traced inside a checked call; or the function re-enters itself with local tensors (checked then)
                return body(*args, **kwargs)
            if not traced and not dtensors and not any(map(_is_group_or_sharder, values)):
                with _host_reads.outermost():  # no group, no collective: its range checks read once
                    return body(*args, **kwargs)
            try:
                bound = public.bind(*args, **kwargs)
            except TypeError:
                return body(*args, **kwargs)  # raises the call's own TypeError
            bound.apply_defaults()
            viewed = local is not None and (dtensors or traced)  # traced: the view serves the body too
            if not traced:
                with _host_reads.outermost():
                    arguments, hint = local(dict(bound.arguments)) if local and viewed else (bound.arguments, "")
                    widths = ShardWidths()  # filled by the check, read by the body
                    _check(name, arguments, vocab(arguments) if callable(vocab) else vocab, checked_roles, hint, widths)
                    return body(*args, widths=widths, view=dict(arguments) if viewed else None, **kwargs)
            arguments = local(dict(bound.arguments))[0] if local else bound.arguments
            try:
                _check(name, arguments, vocab(arguments) if callable(vocab) else vocab, checked_roles)
                _traced_depth[0] += 1
                try:
                    out = body(*args, view=dict(arguments) if local else None, **kwargs)
                    _host_reads.end_traced()  # the check's assertions, if the call ran no collective
                    return out
                finally:
                    _traced_depth[0] -= 1
            except (ValueError, TypeError) as err:  # this rank's graph never runs: tell the peers' checks
                _tell_peers(name, arguments, checked_roles, err)
                raise

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            _debug.before_call(name, sig, checked_roles, args, kwargs)  # opt-in: LOSSFX_DISTRIBUTED_DEBUG
            if not _host_reads.tracing():
                return run(False, args, kwargs)
            try:
                return run(True, args, kwargs)
            except (ValueError, TypeError) as err:  # Dynamo would turn it into `Unsupported`
                reraise_while_tracing(err)

        checked._lossfx_roles = roles  # type: ignore[attr-defined]  # (tests and benchmarks read it)
        checked._lossfx_unchecked = body  # type: ignore[attr-defined]  # the call without its check (benchmarks)
        checked.__signature__ = public  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return wrap


_WIDTHS, _VIEW = "_widths", "_view"
REJECTED = "DTensor arguments rejected"  # the field of a `local` view that rejected a DTensor (its error's text)
REJECTED_ERROR = "_rejected"  # the error itself (a leading `_`: not compared), which `boundary` raises


@dataclasses.dataclass
class ShardWidths:
    """The vocabulary shard widths every rank reported to one call's cross-rank check,
    `{id(group): [w_0, ..., w_R-1]}`: part of the resolved call, written by the check when its
    gathered signatures are read (`_core.host_reads.settle`) and handed to the body by `boundary`
    (the keyword `_widths` of a function that declares it; not in its public signature)."""

    by_group: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # what the body defers before `range` reads the widths (the fused kernels' count of active
    # rows, `lossfx.linear_loss_input`): run once, first thing, so that one read carries both
    before_read: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def range(self, local_vocab: int, group: dist.ProcessGroup | None) -> tuple[int | None, int | None]:
        """`(vocab_start, vocab_size)` of this rank's shard when shards may have uneven widths.

        Eager: the widths the ranks reported to the check (or, outside a checked call, one
        all-gather of the widths); this rank's shard starts after the lower ranks' shards (rank
        order) and `V` is their sum. Under `torch.compile` and without a group: `(None, None)`,
        which the kernels read as uniform shards (`rank · Vl`, `R · Vl`).
        """
        if _host_reads.tracing() or not _is_distributed(group):
            return None, None
        while self.before_read:
            self.before_read.pop(0)()
        _host_reads.settle()  # the check of the enclosing call reports the widths
        widths = self.by_group.get(id(group))
        if widths is None:
            widths = _gather_on_device(torch.tensor([local_vocab], dtype=torch.int64), group).view(-1).tolist()
        return sum(widths[: group.rank()]), sum(widths)

    def size_when_read(self, local_vocab: int, group: dist.ProcessGroup | None) -> Callable[[], int]:
        """The vocabulary size `V` (`range`'s, else `R · Vl`) as a function to call once the
        call's host reads are settled: a range check of ids is then read with the cross-rank
        check instead of after it."""

        world = group.size() if isinstance(group, dist.ProcessGroup) else 1
        return lambda: self.range(local_vocab, group)[1] or world * local_vocab
