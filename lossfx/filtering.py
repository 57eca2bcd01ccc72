"""Top-k / top-p filtered log-probabilities over a (possibly sharded) vocabulary, without sorting it.

The filter keeps, per row, the tokens whose logit is at least a threshold `τ`; the whole design is
to find `τ` exactly while communicating only per-row scalars. The rule (NeMo RL's filter with
the tie rules of docs/decisions.md §2.6):

* top-k: `τ_k` = the k-th largest logit (with multiplicity); keep `z ≥ τ_k` (ties all kept);
* top-p, after top-k, on the renormalised survivors `q = softmax(z | z ≥ τ_k)`: keep a survivor
  iff `M(z_v) = Σ_{u : z_u > z_v} q_u < top_p` (the mass of the tokens with a *strictly larger*
  logit). Equal logits have equal `M`, so tied tokens are kept or dropped together: the order is
  by value alone, the same on every run, at every tensor-parallel size and every shard layout.
  `M` is non-increasing in the value, so the kept set is `z ≥ τ` for one per-row threshold `τ`.

The boundary: each public function unwraps a DTensor argument (`vocab_shard`, `replicated`),
validates its arguments (types, shapes, `top_k` / `top_p` / `strategy` / `ties`, the targets'
range, the deprecated `chunk_size`) and resolves this rank's `VocabRange`, once, then calls its
pure kernel in `lossfx._kernels.filtering` once (which holds the exact threshold search: a
candidate all-gather for `k <= CANDIDATE_TOP_K_MAX`, else a bisection over the float bit
pattern, communicating only per-row scalars) and wraps a vocabulary-sharded result back into a
DTensor. The kernel saves the logits, `τ [N]` and the filtered `lse [N]` for a one-pass backward
with no collective: `dlogits = keep ⊙ (onehot(target) − exp(logits − lse)) · dout`.

Temperature is never applied here: divide the logits by it before calling.
Proof of exactness: proofs/filtering.md. Reference: lossfx.reference.filtered_token_logprobs.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import Tensor

from lossfx._boundary.consistency import boundary
from lossfx._boundary.dtensor import local_view, resolved_shard
from lossfx._boundary.validation import check_floating, check_positive_int
from lossfx._core.chunking import resolve_chunk_rows
from lossfx._core.distributed import ProcessGroup
from lossfx._core.vocab import VocabRange
from lossfx._kernels import filtering as _kernel
from lossfx._kernels.filtering import CANDIDATE_TOP_K_MAX
from lossfx.logprobs import _ROLES, _validated  # (token_logprobs' parameters, and its checks of a target)

__all__ = [
    "CANDIDATE_TOP_K_MAX",
    "apply_top_k_top_p",
    "filtered_token_logprobs",
    "top_k_top_p_threshold",
]

_STRATEGIES = ("auto", "candidates", "bisection")
# Tie rules of top-p: equal logits kept or dropped together, or cut in NeMo RL's sort order.
TIES = ("together", "sorted")


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def check_filter_params(top_k: object, top_p: object, ties: object = "together") -> tuple[int | None, float]:
    """Validate `(top_k, top_p, ties)`; return `(k or None when disabled, float(top_p))`: the one
    check of a filter's parameters (the filtering functions, `TrainingSamplingParams`).

    Raises `ValueError` for a non-integer `top_k`, a `top_p` outside `(0, 1]`, or a `ties` not
    one of `TIES` ("together", "sorted").
    """
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)):
        raise ValueError(f"top_k must be an integer or None, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise ValueError(f"top_p must be a real number in (0, 1], got {top_p!r}")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    if not isinstance(ties, str) or ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")
    k = int(top_k) if top_k is not None and int(top_k) > 0 else None
    return k, float(top_p)


def _validated_filter(
    logits: Tensor,
    top_k: object,
    top_p: object,
    strategy: str,
    ties: object,
    chunk_rows: int | None,
    chunk_size: int | None,
) -> tuple[int | None, float, int | None]:
    """The checks the three public functions share (`logits` `[..., V_local]`, `V_local >= 1`;
    `strategy="candidates"` needs top-k): `(k or None, top_p, chunk_rows)`."""
    check_floating("logits", logits)
    k, p = check_filter_params(top_k, top_p, ties)
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
    rows = check_positive_int("chunk_rows", resolve_chunk_rows(chunk_rows, chunk_size))
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V_local] with V_local >= 1, got shape {tuple(logits.shape)}")
    if strategy == "candidates" and k is None:
        raise ValueError("strategy='candidates' needs top-k enabled (top_k > 0)")
    return k, p, rows


# ---------------------------------------------------------------------------------------------
# Public functions: the boundary, then the pure kernel once
# ---------------------------------------------------------------------------------------------


@boundary(roles=_ROLES, vocab="sized", local=local_view(_ROLES))
def top_k_top_p_threshold(
    logits: Tensor,
    *,
    top_k: int | None = None,
    top_p: float = 1.0,
    group: ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    strategy: str = "auto",
    ties: str = "together",
    vocab_start: int | None = None,
    chunk_size: int | None = None,
) -> Any:
    """Per-row threshold `τ` of the top-k/top-p filter: the filter keeps exactly `logits ≥ τ`.

    Equivalent to ``where(keep, logits, inf).amin(-1)`` with
    ``keep = lossfx.reference.apply_top_k_top_p(logits, top_k, top_p)[1]`` on the dense logits.

    .. math::
        \\tau_k = z_{(k)}, \\quad M(v) = \\sum_{u:\\, z_u > v,\\, z_u \\ge \\tau_k} q_u,\\quad
        \\tau = \\min\\{z_v \\ge \\tau_k : M(z_v) < p\\}

    Args:
        logits: `[..., Vl]` this rank's vocabulary shard (the full vocabulary without a group).
            The threshold is found in the compute dtype (fp32, float64 for float64); the masses of
            top-p are accumulated in float64. Never modified; no gradient flows through `τ`.
        top_k: keep the `top_k` largest values (all values tied with the k-th are kept); `None`
            or `<= 0` disables it; `top_k >= V` keeps everything.
        top_p: after top-k, keep a token iff the renormalised mass of the tokens with a strictly
            larger logit is `< top_p`; `1.0` disables it. Must lie in `(0, 1]`.
        group: tensor-parallel group over the vocabulary, or `None`. Only per-row scalars and
            `[N, min(k, 1024)]` candidate values are communicated.
        vocab_size: global vocabulary size; default `world_size · Vl`.
        chunk_rows: rows of the flattened `[N, Vl]` logits per eager chunk (a memory bound;
            results do not depend on it); default: the device's `lossfx.ChunkPolicy`.
        strategy: `"auto"` (candidates for `top_k <= CANDIDATE_TOP_K_MAX`, else bisection),
            `"candidates"` (needs top-k) or `"bisection"`. All give the same `τ`.
        ties: top-p's rule among equal logits (docs/filtering.md): `"together"` (default; a tie
            group is kept or dropped as a whole) or `"sorted"` (NeMo RL's stable sort order: among
            equal values the larger token id ranks higher, so a tie group at the boundary may be
            cut by id).
        vocab_start: first global id of this shard; default `rank · Vl` (only `"sorted"` reads it).
        chunk_size: deprecated name of `chunk_rows` (same value; a FutureWarning).

    Returns:
        `[...]` thresholds in the compute dtype (`-inf` when nothing is filtered out, NaN for a
        row holding a NaN, which keeps nothing). With `ties="sorted"`, a pair `(τ, id_cut)`
        (`id_cut` int64): the filter keeps `z > τ`, and `z == τ` where the global id `≥ id_cut`.

    Raises:
        ValueError: `top_p` outside `(0, 1]`, non-integer `top_k`, unknown strategy, bad shapes.
        TypeError: non-float `logits`.

    Note:
        Temperature is not applied: divide the logits by it before calling. Either tie rule gives
        the same result on every run and at every TP size.

    Example:
        >>> import torch, lossfx
        >>> z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
        >>> lossfx.top_k_top_p_threshold(z, top_k=2)
        tensor([2.])
    """
    k, p, chunk_rows = _validated_filter(logits, top_k, top_p, strategy, ties, chunk_rows, chunk_size)
    vocab = VocabRange.of(group, logits.shape[-1], vocab_start, vocab_size)
    return _kernel.top_k_top_p_threshold(
        logits, vocab, top_k=k, top_p=p, chunk_rows=chunk_rows, strategy=strategy, ties=ties
    )


@boundary(roles=_ROLES, vocab="sized", local=local_view(_ROLES))
def apply_top_k_top_p(
    logits: Tensor,
    *,
    top_k: int | None = None,
    top_p: float = 1.0,
    group: ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    ties: str = "together",
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    _view: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor]:
    """`(filtered, keep)`: this shard with filtered-out entries set to `-inf`, and the keep mask.

    Equivalent to ``lossfx.reference.apply_top_k_top_p(logits, top_k, top_p, ties)`` on the dense
    logits (for this rank's columns), in the logits' dtype. The gradient is ``grad * keep`` (the
    mask is a constant). Arguments as in `top_k_top_p_threshold`.

    Returns:
        `filtered [..., Vl]` (the logits' dtype), `keep [..., Vl]` (bool).

    Example:
        >>> import torch, lossfx
        >>> lossfx.apply_top_k_top_p(torch.tensor([[3.0, 1.0, 2.0]]), top_k=2)[0]
        tensor([[3., -inf, 2.]])
    """
    shard = resolved_shard(_view)  # the boundary's one unwrap: the result is placed like the logits
    local = shard.local
    k, p, chunk_rows = _validated_filter(local, top_k, top_p, "auto", ties, chunk_rows, chunk_size)
    vocab = VocabRange.of(shard.group, local.shape[-1], shard.vocab_start, shard.vocab_size)
    filtered, keep = _kernel.apply_top_k_top_p(local, vocab, top_k=k, top_p=p, chunk_rows=chunk_rows, ties=ties)
    return shard.wrap(filtered), shard.wrap(keep)


@boundary(roles=_ROLES, vocab="tiled", local=local_view(_ROLES))
def filtered_token_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    top_k: int | None = None,
    top_p: float = 1.0,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    strategy: str = "auto",
    ties: str = "together",
    chunk_size: int | None = None,
) -> Tensor:
    """Log-probability of each target under the top-k/top-p filtered, renormalised distribution.

    Equivalent to ``log_softmax(where(keep, z, -inf), -1).gather(-1, target[..., None])[..., 0]``
    with ``keep`` from ``lossfx.reference.apply_top_k_top_p`` on the dense logits `z` (all
    shards concatenated in rank order), without sorting or moving the vocabulary.

    .. math::
        \\mathrm{out}_n = z_{n,t_n} - \\log \\sum_{v:\\, z_{n,v} \\ge \\tau_n} e^{z_{n,v}}
        \\quad (-\\infty \\text{ if } z_{n,t_n} < \\tau_n)

    Args:
        logits: `[..., Vl]` this rank's vocabulary shard (the full vocabulary without a group).
        target: `[...]` integer global token ids in `[0, V)`.
        top_k, top_p, group, vocab_size, chunk_rows, strategy, ties: as in
            `top_k_top_p_threshold`.
        vocab_start: first global id of this shard; default `rank · Vl`.
        chunk_size: deprecated name of `chunk_rows` (same value; a FutureWarning).

    Returns:
        `[...]` in the compute dtype (fp32, or float64 for float64 logits); `-inf` where the
        target was filtered out; NaN for a row holding a NaN (gradient NaN in every column of
        that row, as the unfiltered `log_softmax`'s: never a NaN with a zero gradient). Computed as
        `(z_t − m) − log s` with `m` the filtered row max: as accurate as `torch.log_softmax` at
        any magnitude. Gradient: `keep ⊙ (onehot − softmax(filter(z))) · dout` for this
        rank's shard, in the logits' dtype (no derivative through the thresholds).

    Raises:
        ValueError: bad `top_k`/`top_p`, shape mismatch, ids outside `[0, V)`
            (compiled: an in-graph `RuntimeError`).
        TypeError: non-float logits, non-integer target.

    Note:
        Temperature is not applied: divide the logits by it first. Either tie rule gives the same
        result at every TP size; `B·S` need not divide by the TP size.
        Double backward is not supported (`once_differentiable`).

    Example:
        >>> import torch, lossfx
        >>> z = torch.tensor([[0.0, 1.0, 2.0]])
        >>> lossfx.filtered_token_logprobs(z, torch.tensor([2]), top_k=2)
        tensor([-0.3133])

    See also: proofs/filtering.md, lossfx.reference.filtered_token_logprobs.
    """
    k, p, chunk_rows = _validated_filter(logits, top_k, top_p, strategy, ties, chunk_rows, chunk_size)
    vocab, _ = _validated(logits, target, group, vocab_start, vocab_size, None, None)
    return _kernel.filtered_token_logprobs(
        logits, target, vocab, top_k=k, top_p=p, chunk_rows=chunk_rows, strategy=strategy, ties=ties
    )
