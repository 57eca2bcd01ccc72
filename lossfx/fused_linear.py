"""The fused LM-head path: log-probs (and `Σ p log p`) from hidden states, logits never materialised.

    z = hidden @ weight.T / T                       (logits, [N, V]; only ever one [C, Cv] tile)
    out[n, k] = z[n, ids[n, k]] − logsumexp_v z[n, v]        neg_entropy[n] = Σ_v p log p

(with the options `bias`, `logit_scale`, `softcap`: `z = c · tanh(s · (hidden @ weight.T + bias) / c)
/ T`; ids equal to `ignore_index` give 0 and their rows are never computed) over a vocabulary
sharded across tensor-parallel (TP) ranks (`weight` is this rank's `[Vl, H]` rows of the LM head),
matmuls in `promote_types(hidden.dtype, weight.dtype)`. One kernel serves every entry point:
ids `[N, K]`, with token log-probs the `K = 1` case. Pipeline of the forward:

1. with `sequence_parallel=True`, all-gather this rank's `[N/R, H]` rows of `hidden`;
2. `lossfx::linear_local_stats` (`lossfx._kernels.linear_chunks`): per tile, one `[C, Cv]` block of logits
   (`Cv <= Vl`) and this shard's per-row statistics `(m, s, u)` and the logits at the ids it owns;
3. one all-gather of those per-row scalars `[R, 3 + K, N]`, merged exactly with the row max and
   the log-sum kept apart: `log p = (z − shift) − log_s` (`_core.numerics.merge_max_logsum`).

Saved for backward: `hidden` (the gathered rows under sequence parallelism), `weight`, the ids'
local columns, and three per-row scalars. The backward (`lossfx::linear_local_grads`) recomputes
each logits chunk and forms

    dz = g_ids scattered at the ids − p·Σ_k g_k + h·p ⊙ (log p − H),
    dhidden = dz W / T,   dweight = dzᵀ hidden / T                  (proofs/fused_linear.md)

then one all-reduce of `dhidden [N, H]` over the TP group (replicated hidden: every rank's
`hidden.grad` is the full gradient) or one reduce-scatter (sequence parallel: this rank's rows).
Reference: `lossfx.reference.linear_token_logprobs` and friends.

The boundary: this module is the public face. Each public function does its boundary work once,
at the top (the DTensor unwrap of `weight`/`bias`/`hidden`, argument validation, one range check
of the ids, the `VocabRange` of this rank's head rows), then calls the pure kernel in
`lossfx._kernels.fused_linear` once; the maths above lives there (and in
`lossfx._kernels.linear_chunks`). `linear_next_token_logprobs` calls the pure next-token
pipeline `lossfx._layouts.linear_next_token` once (its sequence layout work: shift, lay out,
gather).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Unpack

from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.deprecation import renamed_keywords
from lossfx._boundary.dtensor import View, VocabShard, _same_group, is_dtensor, vocab_shard
from lossfx._boundary.dtensor import local_view as _local_view
from lossfx._boundary.validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_float,
    check_positive_int,
)
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels import fused_linear as kernel
from lossfx._layouts import linear_next_token as _pure_next_token
from lossfx.next_token import validated_next_token_call
from lossfx.sequence_layout import sequence_layout

__all__ = ["linear_gather_logprobs", "linear_next_token_logprobs", "linear_token_logprobs"]


def _sequence_parallel(seq_dim: int, arguments: dict[str, Any], shard: VocabShard) -> None:
    """`hidden` under `sequence_parallel=True`, a DTensor sharded on its sequence dim `seq_dim`
    (`Shard(0)` of the token functions' rows, `Shard(1)` of `linear_next_token_logprobs`'
    `[B, S, H]`) over the weight's tensor-parallel group, in equal parts: this rank's rows. (Else
    `hidden` is plain or `Replicate()`: `local_view` unwraps it.)"""
    hidden, group = arguments["hidden"], shard.group
    if not is_dtensor(hidden) or not arguments["sequence_parallel"]:
        return
    if hidden.dim() <= seq_dim + 1:
        raise ValueError(f"hidden must have a sequence dim {seq_dim} before H, got shape {tuple(hidden.shape)}")
    h = vocab_shard(hidden, dim=seq_dim, name="hidden")  # the same placement rule: Shard(seq_dim) on one mesh dim
    if h.group is None:
        raise ValueError(
            f"with sequence_parallel=True, a DTensor hidden must be Shard({seq_dim}) over the tensor-parallel "
            f"mesh dim; got placements {tuple(hidden.placements)}"
        )
    if group is None or not _same_group(h.group, group):
        raise ValueError(
            f"hidden is sharded over a group of {h.group.size()} ranks, which is not the weight's tensor-parallel "
            f"group ({'none' if group is None else f'{group.size()} ranks'}); shard both over the same mesh dim"
        )
    if hidden.shape[seq_dim] % h.group.size():
        raise ValueError(
            f"with sequence_parallel=True, hidden's sequence dim {seq_dim} (global size {hidden.shape[seq_dim]}) must "
            f"split evenly over the {h.group.size()} tensor-parallel ranks"
        )
    arguments["hidden"] = h.local


_FSDP_HINT = (
    ". The LM head weight is a Shard(0) DTensor and the ranks hold different hidden states: if it is "
    "FSDP2's data-parallel sharding of the head (outside the forward), that is not vocabulary parallelism. "
    "Gather it with weight.full_tensor() and call without a group, or pass the tensor-parallel shard "
    "(docs/dtensor.md, FSDP2)"
)


def local_view(seq_dim: int) -> View:
    """The one unwrap of a fused call (`_boundary.dtensor.local_view` of its roles): local tensors
    and the group and offsets of the weight's placement (a `Shard(0)` DTensor head, uneven rows
    included; a `Shard(0)` bias like it), `hidden` sharded on `seq_dim` under sequence parallelism
    (`_sequence_parallel`), and the FSDP2 remedy to append when the ranks' hidden states differ
    under a DTensor weight."""
    return _local_view(_ROLES, hint=_FSDP_HINT, then=functools.partial(_sequence_parallel, seq_dim))


class HeadKeywords(typing.TypedDict, total=False):
    """The head options of every fused public function, written once: each takes them as
    `**head: Unpack[HeadKeywords]` (`head_keywords` spells them in its signature), checks them once
    (`resolved_head`) into the kernels' one value `HeadOptions`, whose defaults are theirs.
    Documented in `linear_token_logprobs` and docs/fused_linear.md ("Options")."""

    bias: Tensor | None
    temperature: float
    logit_scale: float
    softcap: float | None
    ignore_index: int


class LinearKeywords(HeadKeywords, total=False):
    """The head options and the vocabulary sharding and rows of the fused functions over ids
    (`**kw: Unpack[LinearKeywords]`, spelled by `linear_keywords`; `resolved_call` reads them),
    documented in `linear_token_logprobs`. Defaults: `_SHARDING`."""

    group: ProcessGroup | None
    vocab_start: int | None
    vocab_size: int | None
    sequence_parallel: bool
    chunk_size: int | None


_SHARDING = {"group": None, "vocab_start": None, "vocab_size": None, "sequence_parallel": False, "chunk_size": None}
F = typing.TypeVar("F", bound=typing.Callable[..., Any])


def _spelled(keywords: type, defaults: dict[str, Any]) -> typing.Callable[[F], F]:
    """The decorator that gives `fn(..., **kw: Unpack[keywords])` a signature spelling the keywords
    and their `defaults` as keyword-only parameters: what `inspect`, docs/api.md, the boundary's
    binding and its roles (`bias` is a vocabulary shard, `group` the tensor-parallel group) read.
    The body gets them in `kw`."""
    hints = {k: getattr(v, "__forward_arg__", v) for k, v in keywords.__annotations__.items()}

    def spell(fn: F) -> F:
        sig = inspect.signature(fn)
        options = [
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=hints[k])
            for k, d in defaults.items()
        ]
        rest = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        fn.__signature__ = sig.replace(parameters=[*rest, *options])  # type: ignore[attr-defined]
        return fn

    return spell


head_keywords = _spelled(HeadKeywords, HeadOptions._field_defaults)  # the head options (`HeadOptions`' defaults)
linear_keywords = _spelled(LinearKeywords, {**_SHARDING, **HeadOptions._field_defaults})  # and the sharding's


def resolved_head(head: typing.Mapping[str, Any], local_vocab: int) -> HeadOptions:
    """The head keywords checked (TypeError/ValueError naming the argument; an unknown keyword:
    `HeadOptions`' TypeError naming it) and resolved into `HeadOptions`; `bias` must be
    `[local_vocab]`, local."""
    options = HeadOptions(**head)
    bias, ignore_index = options.bias, options.ignore_index
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if bias is not None:
        check_floating("bias", bias)
        if tuple(bias.shape) != (local_vocab,):
            raise ValueError(
                f"bias must be [V_local] = [{local_vocab}] (this rank's rows of the head's bias, like weight's), "
                f"got shape {tuple(bias.shape)}"
            )
    return options._replace(
        temperature=check_positive_float("temperature", options.temperature),
        logit_scale=check_positive_float("logit_scale", options.logit_scale),
        softcap=check_positive_float("softcap", options.softcap, allow_none=True),
    )


class LinearCall(typing.NamedTuple):
    """The resolved arguments of one fused call, as the pure kernels take them (`resolved_call`)."""

    vocab: VocabRange  # this rank's rows of the head: group, first id, global V
    head: HeadOptions  # bias [Vl] (local), temperature, logit_scale, softcap, ignore_index
    chunk_rows: int  # 0: the loop picks its default
    sequence_parallel: bool = False  # hidden holds this rank's rows (all-gathered in the forward)

    @property
    def options(self) -> dict[str, Any]:
        """The keywords every fused kernel takes from the call: `head`, `chunk_rows`, `sequence_parallel`."""
        return {"head": self.head, "chunk_rows": self.chunk_rows, "sequence_parallel": self.sequence_parallel}


def resolved_call(
    hidden: Tensor,
    weight: Tensor,
    keywords: typing.Mapping[str, Any],
    ids: Tensor | None = None,
    name: str = "ids",
    *,
    per_row: bool = False,
) -> LinearCall:
    """The resolve of a fused call (local tensors; TypeError/ValueError naming the argument): hidden
    `[..., H]`, weight `[Vl, H]`, the `keywords` (`LinearKeywords`, those absent at `_SHARDING`'s
    defaults; the head's through `resolved_head`) into the kernels' `LinearCall`; with `ids`
    (named `name`: `[...]`, one per row, or `[..., K]` with `per_row`), their rows against
    hidden's (under sequence parallelism this rank's `N/R`) and their range `[0, V)` but for
    `ignore_index`."""
    head = {k: v for k, v in keywords.items() if k not in _SHARDING}
    group, vocab_start, vocab_size, sequence_parallel, chunk_size = (keywords.get(k, d) for k, d in _SHARDING.items())
    if ids is not None:
        check_integer_ids(name, ids)
    check_floating("hidden", hidden)
    check_floating("weight", weight)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [V_local, H] and hidden [..., H] with the same H; got "
            f"hidden.shape={tuple(hidden.shape)} and weight.shape={tuple(weight.shape)}"
        )
    local_vocab = weight.shape[0]
    if local_vocab < 1:
        raise ValueError(f"weight must hold at least one vocabulary row, got shape {tuple(weight.shape)}")
    vocab = VocabRange.of(group, local_vocab, vocab_start, vocab_size)  # default: equal shards in rank order
    call = LinearCall(vocab, resolved_head(head, local_vocab), chunk_size or 0, sequence_parallel)
    if ids is None:
        return call
    rows = ids if per_row else ids[..., None]  # [..., K]
    if rows.dim() < 1 or rows.shape[-1] < 1:
        raise ValueError(f"ids must be [..., K] with K >= 1, got shape {tuple(rows.shape)}")
    n_rows, hidden_rows = rows.shape[:-1].numel(), hidden.shape[:-1].numel()
    if sequence_parallel and hidden_rows * group_size(vocab.group) != n_rows:
        raise ValueError(
            f"with sequence_parallel=True, hidden holds this rank's rows: {group_size(vocab.group)} ranks x "
            f"{hidden_rows} rows (hidden.shape={tuple(hidden.shape)}) must equal the {n_rows} positions "
            f"of the ids/target (shape {tuple(rows.shape[:-1])})"
        )
    if not sequence_parallel and tuple(hidden.shape[:-1]) != tuple(rows.shape[:-1]):
        raise ValueError(
            f"hidden's leading dims must equal the target's; got hidden.shape={tuple(hidden.shape)} and "
            f"target/ids leading shape {tuple(rows.shape[:-1])}"
        )
    check_ids_in_range(name, rows.masked_fill(rows == call.head.ignore_index, 0), vocab.size)  # ignored: in range
    return call


# the cross-rank check's view of the parameters (`_boundary.consistency.Roles`)
_ROLES = Roles(
    tp="group",
    head="weight",
    shards=("bias",),
    start="vocab_start",
    size="vocab_size",
    rows=("hidden", "sequence_parallel"),
)
_ROLES_CP = dataclasses.replace(_ROLES, cp="context_parallel_group", cp_from="cp_sharder", cp_shards=("hidden",))


@renamed_keywords(signed=True, with_entropy="with_neg_entropy")
@boundary(roles=_ROLES, vocab="tiled", local=local_view(seq_dim=0))
@linear_keywords
def linear_gather_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    zero_outside_topk: bool = True,
    with_neg_entropy: bool = False,
    **kw: Unpack[LinearKeywords],
) -> tuple[Tensor, Tensor | None]:
    """Log-probs at `K` global ids per row from hidden states and an LM head (shard), fused.

    Equivalent, with `z = hidden @ weight_full.T / temperature`, to::

        lp = z.log_softmax(-1)
        out = lp.gather(-1, ids) if zero_outside_topk else z.gather(-1, ids).log_softmax(-1)
        return out, (lp.exp() * lp).sum(-1) if with_neg_entropy else None

    without materialising more than one `[C, Cv]` tile of `z` (`Cv <= Vl`; eager or compiled).

    Args:
        hidden: `[..., H]` last hidden states (replicated over the TP group), or with
            `sequence_parallel=True` this rank's rows: the flattened rows `[r·N/R, (r+1)·N/R)`.
        weight: `[Vl, H]` this rank's rows of the LM head (the whole head without a group), or
            a `Shard(0)` DTensor head (group and offsets from its placement; docs/dtensor.md);
            any floating dtype (matmuls in `promote_types(hidden.dtype, weight.dtype)`).
        ids: `[..., K]` integer global ids in `[0, V)` (the full `N` rows on every rank); duplicates
            allowed (their gradients add).
        zero_outside_topk: `True`: normalise over the full vocabulary (`log_softmax(z)[ids]`);
            `False`: renormalise over the `K` ids (`log_softmax(z[ids])`, a duplicated id counts
            twice), the two conventions of `prepare_loss_input(DISTILLATION)`. With `False`, a
            NaN or `+inf` logit outside a row's ids makes that row NaN (values and gradients)
            where the dense formula is finite: the renormalisation starts from the full softmax.
        with_neg_entropy: also return `Σ_v p log p` `[...]` (the negative entropy over the full
            vocabulary), from the same pass; else `None`.
            (Formerly `with_entropy=`, which still works with a FutureWarning.)
        group: TP group over the vocabulary, or `None`.
        vocab_start: first global id of this shard; default `rank · Vl`.
        vocab_size: global `V`; default `world_size · Vl`.
        bias, temperature, logit_scale, softcap, ignore_index: the head's options (`HeadKeywords`),
            as in `linear_token_logprobs` (an ignored id gets 0; a row whose ids all are is skipped).
        sequence_parallel: `hidden` is this rank's row slice (all-gathered in the forward; its
            gradient reduce-scattered in the backward).
        chunk_size: rows per logits chunk (memory bound; results do not depend on it). Default:
            a `[C, Cv]` tile of about 4 MiB.

    Returns:
        `(logprobs [..., K], neg_entropy [...] or None)` in `promote_types(dtype, float32)`,
        replicated over the TP group.

    Raises:
        TypeError: non-float hidden/weight/bias, non-integer ids, bad temperature/logit_scale/softcap/
            ignore_index type.
        ValueError: shape mismatches, `K = 0`, `temperature <= 0`, `chunk_size <= 0`, ids outside
            `[0, V)` (compiled: an in-graph `RuntimeError`).

    Example:
        >>> import torch, lossfx
        >>> lp, h = lossfx.linear_gather_logprobs(torch.zeros(1, 2), torch.ones(4, 2), torch.tensor([[0, 3]]),
        ...                                        with_neg_entropy=True)
        >>> lp, h
        (tensor([[-1.3863, -1.3863]]), tensor([-1.3863]))

    See also: proofs/fused_linear.md, lossfx.reference.linear_gather_logprobs.
    """
    # hidden, weight, ids: local tensors (the boundary's one unwrap, `local_view`)
    call = resolved_call(hidden, weight, kw, ids, per_row=True)
    return kernel.linear_gather_logprobs(
        hidden,
        weight,
        ids,
        call.vocab,
        with_neg_entropy=with_neg_entropy,
        zero_outside_topk=zero_outside_topk,
        **call.options,
    )


@typing.overload
def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    return_neg_entropy: typing.Literal[False] = ...,
    **kw: Unpack[LinearKeywords],
) -> Tensor: ...
@typing.overload
def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    return_neg_entropy: typing.Literal[True],
    **kw: Unpack[LinearKeywords],
) -> tuple[Tensor, Tensor]: ...
@typing.overload
def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    return_neg_entropy: bool = ...,
    **kw: Unpack[LinearKeywords],
) -> Tensor | tuple[Tensor, Tensor]: ...
@renamed_keywords(signed=True, return_entropy="return_neg_entropy")
@boundary(roles=_ROLES, vocab="tiled", local=local_view(seq_dim=0))
@linear_keywords
def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    return_neg_entropy: bool = False,
    **kw: Unpack[LinearKeywords],
) -> Tensor | tuple[Tensor, Tensor]:
    """Token log-probs of `softmax(hidden @ weight.T / temperature)`, logits never materialised.

    Equivalent, on the full LM head (all ranks' `weight` shards concatenated in rank order), to::

        lp = (hidden @ weight.T / temperature).log_softmax(-1)
        out = lp.gather(-1, target[..., None])[..., 0]
        return (out, (lp.exp() * lp).sum(-1)) if return_neg_entropy else out

    computed one `[C, Cv]` tile of logits at a time (`Cv <= Vl` columns of this shard), in eager
    mode and under `torch.compile` (`fullgraph=True`; each tile loop is one opaque op, so the graph
    does not grow with the number of tiles).

    .. math::
        \\mathrm{out}_n = z_{n, t_n} - \\log \\sum_v e^{z_{n,v}}, \\qquad z = h W^\\top / T

    Args:
        hidden: `[..., H]` last hidden states. Default: replicated on every TP rank, and each
            rank's `hidden.grad` is the full gradient (one all-reduce of `[N, H]` in the
            backward). `sequence_parallel=True`: this rank's rows of the flattened `[N, H]`
            (rows `[r·N/R, (r+1)·N/R)`, any leading shape); forward all-gathers them, backward
            reduce-scatters their gradient. A `Replicate()` DTensor, or with sequence
            parallelism a `Shard(0)` DTensor over the weight's mesh dim, is accepted.
        weight: `[Vl, H]` this rank's rows of the LM head (vocabulary-sharded; the whole head
            without a group), or a `Shard(0)` DTensor head (`ColwiseParallel`; group and offsets
            from its placement, docs/dtensor.md); any floating dtype. Its gradient is this shard's, accumulated
            across chunks in the compute dtype and returned in `weight`'s dtype.
        target: `[...]` integer global ids in `[0, V)`; the full `N` positions on every rank.
        group: tensor-parallel group over the vocabulary, or `None`.
        vocab_start: first global id of this shard; default `rank · Vl` (pass it with
            `vocab_size` for uneven shards).
        vocab_size: global vocabulary size `V`; default `world_size · Vl`.
        temperature: divides the logits (> 0); a parameter here because the caller has no logits.
        bias: `[Vl]` this rank's rows of the LM head's bias (or a `Shard(0)` DTensor), or `None`;
            its gradient is returned in its dtype.
        logit_scale: `s > 0`, multiplies `hidden @ weight.T + bias` (before the soft-cap).
        softcap: `c > 0` or `None`: the logits are `c · tanh(s · (hidden @ weight.T + bias) / c) / T`
            (TRL's order; without it `s · (hidden @ weight.T + bias) / T`).
        ignore_index: targets equal to it get log-prob 0, zero gradient and `Σ p log p = 0`,
            and their rows are never computed (docs/fused_linear.md, "Options").
        sequence_parallel: the hidden layout described above.
        chunk_size: rows per logits chunk (a memory bound; results do not depend on it).
        return_neg_entropy: also return `neg_entropy = Σ_v p log p` `[...]` (the negative entropy,
            ≤ 0: an entropy bonus is `−neg_entropy`) from the same pass.
            (Formerly `return_entropy=`, which still works with a FutureWarning.)

    Returns:
        `[...]` log-probs (or `(logprobs, neg_entropy)`) in the compute dtype (the matmul dtype, at least fp32),
        replicated over the TP group. Gradients reach `hidden` and `weight` through both.

    Precision: the matmuls run in `promote_types(hidden.dtype, weight.dtype)` (a bf16 `hidden`
    with an fp32 head: fp32, bit-identical to casting `hidden` up first). bf16/fp16 matmuls
    accumulate in fp32 inside the BLAS and round each product once (the logits of the unfused
    `hidden @ weight.T`, and per tile the products its backward forms from bf16 `dlogits`); the
    softmax statistics, `dlogits`, and the sums of the tile products into `dweight` and `dhidden`
    are fp32, each gradient rounded once to its input's dtype at the end. float64 stays float64
    end to end.

    Raises:
        TypeError: non-float `hidden`/`weight`/`bias`, non-integer `target`, a non-int `ignore_index`.
        ValueError: shape mismatches, `temperature <= 0`, `chunk_size <= 0`, target ids outside
            `[0, V)` (compiled: an in-graph `RuntimeError`).

    Example:
        >>> import torch, lossfx
        >>> h, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
        >>> lossfx.linear_token_logprobs(h, w, torch.tensor([2]))
        tensor([-0.4076])

    See also: docs/fused_linear.md, proofs/fused_linear.md, lossfx.reference.linear_token_logprobs.
    """
    # hidden, weight, target: local tensors (the boundary's one unwrap, `local_view`)
    call = resolved_call(hidden, weight, kw, target, "target")
    logprobs, neg_entropy = kernel.linear_token_logprobs(
        hidden, weight, target, call.vocab, with_neg_entropy=return_neg_entropy, **call.options
    )
    return (logprobs, neg_entropy) if neg_entropy is not None else logprobs


@renamed_keywords(signed=True, return_entropy="return_neg_entropy")
@boundary(roles=_ROLES_CP, vocab="tiled", local=local_view(seq_dim=1))
@linear_keywords
def linear_next_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    input_ids: Tensor,
    *,
    context_parallel_group: ProcessGroup | None = None,
    cp_sharder: Any = None,
    return_neg_entropy: bool = False,
    position_ids: Tensor | None = None,
    **kw: Unpack[LinearKeywords],
) -> Tensor | tuple[Tensor, Tensor]:
    """Next-token log-probs `[B, S−1]` from hidden states: position `t` scores `input_ids[:, t+1]`.

    Equivalent (no parallelism) to ``linear_token_logprobs(hidden[:, :-1], weight, input_ids[:, 1:])``
    and to ``lossfx.next_token_logprobs(hidden @ weight.T / temperature, input_ids)``, with the same
    sequence layouts as `next_token_logprobs`: the shift happens on the canonical `input_ids`
    (a roll), the targets are laid out like `hidden`, scored by the fused kernel, and gathered
    back to canonical order.

    Args:
        hidden: `[B, S_l, H]` this rank's hidden states: `S_l = S` without context parallelism,
            this rank's load-balanced part (chunks `r` and `2C−1−r` of `2C`, the sequence
            zero-padded to `C·S_l`) with `context_parallel_group`, or the sharder's layout with
            `cp_sharder`. With `sequence_parallel=True` (TP group `R`), `[B, S_l/R, H]`: this
            TP rank's contiguous `S_l/R` positions of that local sequence (as a DTensor:
            `Shard(1)` over the weight's mesh dim; else plain or `Replicate()`).
        weight: `[Vl, H]` this rank's LM-head rows, or a `Shard(0)` DTensor head.
        input_ids: `[B, S]` canonical token ids (the full sequence on every rank).
        group, vocab_start, vocab_size, chunk_size: as in `linear_token_logprobs`
            (`chunk_size` counts rows of the flattened `[B·S_l, H]`).
        bias, temperature, logit_scale, softcap, ignore_index: the head's options (`HeadKeywords`),
            as in `linear_token_logprobs` (an `ignore_index` at `input_ids[:, t+1]` skips position `t`).
        sequence_parallel: the hidden layout above; the gradient reaching `hidden` is this rank's
            positions' (reduce-scattered), else the full gradient on every TP rank.
        context_parallel_group: CP group for the load-balanced layout, or `None`. Gradients follow
            the summed convention (each CP rank's gradient sums every CP rank's upstream gradient:
            divide a loss that every CP rank computes by `C`).
        cp_sharder: an object with `shard_token_tensor` / `gather_token_tensor`
            (`lossfx.next_token.ContextParallelSharder`) or a `lossfx.sequence_layout.SequenceLayout`;
            takes precedence over `context_parallel_group`.
        return_neg_entropy: also return `Σ_v p log p` (the negative entropy) at the same `[B, S−1]`
            positions.
            (Formerly `return_entropy=`, which still works with a FutureWarning.)
        position_ids: `[B, S]` canonical positions of padding-free rows (several sequences per
            row, each restarting at 0), or `None`. Each sequence's last position (where
            `position_ids[:, t+1] == 0`) gets log-prob 0 and `Σ p log p` 0, with zero gradients,
            instead of scoring the next sequence's first token; dense equivalent:
            ``torch.where(position_ids[:, 1:] == 0, 0, out)`` for each output.

    Returns:
        `[B, S−1]` (or `(logprobs, neg_entropy)`) in the compute dtype, replicated on every TP and
        CP rank.

    Raises:
        ValueError: shape mismatches (`position_ids` must be `input_ids`' shape); with CP,
            `C·S_l < S` or an odd local length; with sequence
            parallelism, a local length not divisible by the TP size.

    Example:
        >>> import torch, lossfx
        >>> h, w = torch.zeros(1, 3, 2), torch.ones(4, 2)
        >>> lossfx.linear_next_token_logprobs(h, w, torch.tensor([[0, 1, 2]]))
        tensor([[-1.3863, -1.3863]])
    """
    # hidden, weight, input_ids: local tensors (the boundary's one unwrap, `local_view`)
    call = resolved_call(hidden, weight, kw)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, S_local, H], got shape {tuple(hidden.shape)}")
    # next_token's checks read shapes only: a zero-stride stand-in for this CP rank's [B, S_l, Vl] logits
    local_len = hidden.shape[1] * (group_size(call.vocab.group) if call.sequence_parallel else 1)
    checked = validated_next_token_call(
        hidden.new_empty(()).expand(hidden.shape[0], local_len, weight.shape[0]),
        input_ids,
        group=call.vocab.group,
        layout=sequence_layout(context_parallel_group, cp_sharder),
        chunk_size=None,
        position_ids=position_ids,
        vocab_start=call.vocab.start,
        vocab_size=call.vocab.size,
        ignore_index=call.head.ignore_index,
        logits_name="hidden states' logits",
    )
    outputs = _pure_next_token.linear_next_token_logprobs(
        hidden,
        weight,
        input_ids,
        checked.layout,
        call.vocab,
        with_neg_entropy=return_neg_entropy,
        position_ids=checked.position_ids,
        **call.options,
    )
    return (outputs[0], outputs[1]) if return_neg_entropy else outputs[0]
