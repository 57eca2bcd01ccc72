"""The hidden-states × LM-head providers every fused-head benchmark compares, written once.

`bench_linear`, `bench_grpo` and `gpu` take their providers from here. Two kinds:

- a **log-prob function** `fn(h [N, H], w [V, H], t [N]) -> (log p(t) [N], entropy [N] or None)`
  (`logprob_function(name)`): the loss is then built by the caller (e.g. `Σ c · log p`);
- an **objective function** `fn(h, w, t, c [N]) -> (Σ c · log p, entropy [N] or None)`
  (`objective_function(name)`): providers that need the coefficients up front (lossfx's objective,
  Liger's GRPO loss).

Names (`LOGPROB_PROVIDERS`, `OBJECTIVE_PROVIDERS`):

    naive            log_softmax((h @ Wᵀ).float()) gathered (+ entropy): the materialised baseline
    lossfx-unfused   lossfx.token_logprobs(h @ Wᵀ, t): lossfx's logits path on materialised logits
    lossfx-fused     lossfx.linear_token_logprobs(h, W, t) (+ return_neg_entropy)
    trl-fused        trl.kernels.ChunkedLogProbFunction (Triton on CUDA, torch ops elsewhere; TRL's chunk)
    cce              −cut_cross_entropy.linear_cross_entropy(reduction="none"): impl "cce" (Triton) on CUDA,
                     "torch_compile" elsewhere
    torch-linear-ce  −torch.nn.functional.linear_cross_entropy(reduction="none") (torch ≥ 2.13)
    liger-flce       −liger_kernel's fused linear cross entropy (Triton: CUDA only), reduction="none"
    lossfx-objective lossfx.linear_logprob_objective(h, W, t, c) (gradients formed in the forward)
    liger-grpo       liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (dapo, β = 0), its own torch.compile

`compiled=True` wraps a lossfx or naive function in `torch.compile(fullgraph=True)` (the peers
compile, or not, on their own). `unavailable(name, device)` says why a provider cannot run here
(`None` when it can).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

import lossfx

LOGPROB_PROVIDERS = ("naive", "lossfx-unfused", "lossfx-fused", "trl-fused", "cce", "torch-linear-ce", "liger-flce")
OBJECTIVE_PROVIDERS = ("lossfx-objective", "liger-grpo")
WITH_ENTROPY = {"naive", "lossfx-fused", "trl-fused", "lossfx-objective"}  # can return the entropy
_PACKAGES = {"trl-fused": "trl", "cce": "cut_cross_entropy", "liger-flce": "liger_kernel", "liger-grpo": "liger_kernel"}


def unavailable(name: str, device: str | torch.device = "cpu") -> str | None:
    """Why provider `name` cannot run on `device` here, or `None` when it can."""
    if name not in LOGPROB_PROVIDERS + OBJECTIVE_PROVIDERS:
        raise KeyError(f"unknown provider {name!r}; known: {', '.join(LOGPROB_PROVIDERS + OBJECTIVE_PROVIDERS)}")
    package = _PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    if name == "torch-linear-ce" and not hasattr(torch.nn.functional, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    if name == "liger-flce" and torch.device(device).type != "cuda":
        return "Liger's fused linear cross entropy is a Triton kernel (CUDA only)"
    return None


def _naive(entropy: bool) -> Callable[..., Any]:
    def fn(h, w, t):
        logp = torch.log_softmax((h @ w.T).float(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1).detach() if entropy else None
        return logp.gather(-1, t[:, None]).squeeze(-1), ent

    return fn


def _lossfx_unfused(h, w, t):
    return lossfx.token_logprobs(h @ w.T, t), None


def _lossfx_fused(entropy: bool, chunk_size: int | None) -> Callable[..., Any]:
    def fn(h, w, t):
        if not entropy:
            return lossfx.linear_token_logprobs(h, w, t, chunk_size=chunk_size), None
        lp, neg_entropy = lossfx.linear_token_logprobs(h, w, t, chunk_size=chunk_size, return_neg_entropy=True)
        return lp, -neg_entropy.detach()

    return fn


def _trl_fused(entropy: bool) -> Callable[..., Any]:
    def fn(h, w, t):
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
        lp, ent, *_ = ChunkedLogProbFunction.apply(h, w, None, t, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, outputs)
        return lp, None if ent is None else ent.detach()

    return fn


def _cce(h, w, t):
    from cut_cross_entropy import linear_cross_entropy

    impl = "cce" if h.is_cuda else "torch_compile"
    return -linear_cross_entropy(h, w, t, impl=impl, reduction="none"), None


def _torch_linear_ce(h, w, t):
    return -torch.nn.functional.linear_cross_entropy(h, w, t, reduction="none"), None


def _liger_flce(h, w, t):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return -liger_fused_linear_cross_entropy(h, w, t, reduction="none"), None


def logprob_function(
    name: str, *, entropy: bool = False, compiled: bool = False, chunk_size: int | None = None
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """`fn(h, w, t) -> (log p(t) [N], entropy [N] or None)` of provider `name` (module docstring).

    `entropy`: also return the per-token entropy (no gradient) where the provider computes it.
    """
    fns: dict[str, Callable[[], Callable[..., Any]]] = {
        "naive": lambda: _naive(entropy),
        "lossfx-unfused": lambda: _lossfx_unfused,
        "lossfx-fused": lambda: _lossfx_fused(entropy, chunk_size),
        "trl-fused": lambda: _trl_fused(entropy),
        "cce": lambda: _cce,
        "torch-linear-ce": lambda: _torch_linear_ce,
        "liger-flce": lambda: _liger_flce,
    }
    if name not in fns:
        raise KeyError(f"unknown log-prob provider {name!r}; known: {', '.join(fns)}")
    fn = fns[name]()
    return torch.compile(fn, fullgraph=True) if compiled else fn


def objective_function(
    name: str, *, sequences: int = 8, entropy: bool = False, compiled: bool = False, chunk_size: int | None = None
) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """`fn(h, w, t, c) -> (Σ c · log p(t), entropy [N] or None)` of provider `name`.

    `lossfx-objective` and `liger-grpo` take the coefficients into the call; any log-prob provider
    is turned into one as `Σ c · log p`. `sequences`: Liger's `[B, T]` rows (`N = B·T`, the
    coefficients constant per sequence: `c = −A_b / N`, an all-ones mask).
    """
    if name == "lossfx-objective":

        def objective(h, w, t, c):
            weight = torch.zeros_like(c) if entropy else None  # the entropy as a metric: zero weight
            value, _, neg_entropy = lossfx.linear_logprob_objective(
                h, w, t, c, neg_entropy_weight=weight, chunk_size=chunk_size
            )
            return value, None if neg_entropy is None else -neg_entropy.detach()

        return torch.compile(objective, fullgraph=True) if compiled else objective
    if name == "liger-grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        grpo = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=True, loss_type="dapo")

        def liger(h, w, t, c):
            # Liger takes [B, T] rows, a mask and per-sequence advantages: c = −A·mask/Σmask, all-ones mask.
            # It returns the ratio form −Σ A·r/N (r = 1 on-policy): another value, the same gradient.
            b = sequences
            mask = torch.ones(b, t.shape[0] // b, dtype=h.dtype, device=h.device)
            advantages = -c.view(b, -1)[:, 0] * mask.sum()
            return grpo(h.view(b, -1, h.shape[-1]), w, t.view(b, -1), mask, advantages)[0], None

        return liger
    logprob = logprob_function(name, entropy=entropy, compiled=compiled, chunk_size=chunk_size)

    def from_logprob(h, w, t, c):
        lp, ent = logprob(h, w, t)
        return (c * lp.float()).sum(), ent

    return from_logprob


def grpo_inputs(
    tokens: int,
    hidden: int,
    vocab: int,
    sequences: int = 8,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded `(h [N, H], W [V, H], t [N], c [N] fp32)` of the on-policy GRPO step (`c = −A_b / N`).

    `h` and `W` (leaves, requiring grad) in `dtype`; drawn on the CPU, so the values do not depend
    on the device.
    """
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 3).to(device=device, dtype=dtype)
    w.requires_grad_(True)
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    advantages = torch.randn(sequences, generator=gen)
    c = (-advantages[:, None] * torch.ones(sequences, tokens // sequences) / tokens).reshape(-1).to(device)
    return h, w, t, c


def _step(loss_fn: Callable[..., torch.Tensor], hidden, weight, target) -> Callable[[], Any]:
    def run():
        return torch.autograd.grad(loss_fn(hidden, weight, target), (hidden, weight))

    return run


def build_fused(
    n: int = 2048,
    hidden_size: int = 512,
    vocab: int = 32000,
    dtype: str = "float32",
    compiled: bool = False,
    chunk_size: int | None = None,
) -> Callable[[], Any]:
    """A `benchmarks.rss` builder: `−mean(lossfx.linear_token_logprobs)`, fwd + bwd -> `(dhidden, dweight)`."""
    fn = logprob_function("lossfx-fused", compiled=compiled, chunk_size=chunk_size)
    h, w, t, _ = grpo_inputs(n, hidden_size, vocab, 1, dtype=getattr(torch, dtype))
    return _step(lambda h, w, t: -fn(h, w, t)[0].mean(), h, w, t)


def build_unfused(
    n: int = 2048, hidden_size: int = 512, vocab: int = 32000, dtype: str = "float32", compiled: bool = False
) -> Callable[[], Any]:
    """A `benchmarks.rss` builder: `−mean(lossfx.token_logprobs(h @ Wᵀ))`, fwd + bwd -> `(dhidden, dweight)`."""
    fn = logprob_function("lossfx-unfused", compiled=compiled)
    h, w, t, _ = grpo_inputs(n, hidden_size, vocab, 1, dtype=getattr(torch, dtype))
    return _step(lambda h, w, t: -fn(h, w, t)[0].mean(), h, w, t)


def result_row(
    provider: str, tokens: int, hidden: int, vocab: int, dtype: str, timing: dict, first: float, peak: int, grads: int
) -> dict:
    """One benchmark row: time (ms), first call (s), the fresh-process peak beyond the inputs (MiB) and
    that peak less the gradients, in units of the `[tokens, vocab]` fp32 logits."""
    logits_fp32 = tokens * vocab * 4
    return {
        "provider": provider,
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "dtype": dtype,
        "median_ms": round(1e3 * timing["median_s"], 2),
        "p20_ms": round(1e3 * timing["p20_s"], 2),
        "p80_ms": round(1e3 * timing["p80_s"], 2),
        "first_call_s": round(first, 2),
        "peak_extra_mib": round(peak / 2**20, 1),
        "grads_mib": round(grads / 2**20, 1),
        "logits_fp32_mib": round(logits_fp32 / 2**20, 1),
        "beyond_grads_x_logits": round((peak - grads) / logits_fp32, 3),
    }
