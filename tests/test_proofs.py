"""Numeric checks of the identities claimed in proofs/ (float64, random upstream gradient)."""

import pytest
import torch

import lossfx
from lossfx import reference
from lossfx._core.numerics import merge_max_logsum, row_max_sumexp

F64 = torch.float64


def _logits(n, v, seed, neg_inf=False):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen, dtype=F64) * 4
    if neg_inf:
        z[torch.rand(n, v, generator=gen) < 0.3] = float("-inf")
        z[0] = float("-inf")  # one all -inf row
    return z


@pytest.mark.parametrize("seed", range(3))
def test_logprobs_vjp_formula(seed):
    """proofs/logprobs.md §2: ∂L/∂z = g (onehot(t) − softmax(z)), against dense autograd."""
    n, v = 6, 13
    z = _logits(n, v, seed).requires_grad_()
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    g = torch.randn(n, dtype=F64)
    (reference.token_logprobs(z, t) * g).sum().backward()
    formula = g[:, None] * (torch.nn.functional.one_hot(t, v).to(F64) - torch.softmax(z.detach(), -1))
    torch.testing.assert_close(z.grad, formula, rtol=0, atol=1e-12)
    # and lossfx's own backward equals it
    z2 = z.detach().clone().requires_grad_()
    (lossfx.token_logprobs(z2, t, chunk_size=2) * g).sum().backward()
    torch.testing.assert_close(z2.grad, formula, rtol=0, atol=1e-12)
    # each row of the gradient sums to zero
    torch.testing.assert_close(z2.grad.sum(-1), torch.zeros(n, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("neg_inf", [False, True])
def test_logprobs_merge_identity(shards, neg_inf):
    """proofs/logprobs.md §3: merging per-shard (max, sumexp) over any partition gives the lse."""
    n, v = 5, 11
    z = _logits(n, v, 7 + shards, neg_inf)
    bounds = torch.linspace(0, v, shards + 1).round().long().tolist()
    stats = [row_max_sumexp(z[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    shift, log_s = merge_max_logsum(torch.stack([m for m, _ in stats]), torch.stack([s for _, s in stats]))
    lse = shift + log_s
    expected = torch.logsumexp(z, -1)
    assert not torch.isnan(lse).any()
    torch.testing.assert_close(lse, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_logprobs_chunk_independence(chunk):
    """proofs/logprobs.md §2: chunking along rows does not change any row's result."""
    n, v = 7, 9
    z = _logits(n, v, 3, neg_inf=True)
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    out_chunked, lse_chunked = lossfx.token_logprobs_with_lse(z, t, chunk_size=chunk)
    out_whole, lse_whole = lossfx.token_logprobs_with_lse(z, t, chunk_size=n)
    torch.testing.assert_close(lse_chunked, lse_whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(out_chunked, out_whole, rtol=0, atol=1e-12)


def test_gather_vjp_formula_with_duplicates():
    """proofs/gather.md §2: scatter_add(i, g) − p Σg + h p (log p − H), against autograd."""
    n, v = 5, 9
    z = _logits(n, v, 11).requires_grad_()
    ids = torch.randint(0, v, (n, 4), generator=torch.Generator().manual_seed(2))
    ids[:, 1] = ids[:, 0]  # duplicates
    g, h = torch.randn(n, 4, dtype=F64), torch.randn(n, dtype=F64)
    lp_ref, neg_h_ref = reference.gather_logprobs(z, ids)
    ((lp_ref * g).sum() + (neg_h_ref * h).sum()).backward()
    p = torch.softmax(z.detach(), -1)
    log_p = torch.log_softmax(z.detach(), -1)
    neg_h = (p * log_p).sum(-1, keepdim=True)
    formula = torch.zeros(n, v, dtype=F64).scatter_add(-1, ids, g) - p * g.sum(-1, keepdim=True)
    formula = formula + h[:, None] * p * (log_p - neg_h)
    torch.testing.assert_close(z.grad, formula, rtol=0, atol=1e-12)
    z2 = z.detach().clone().requires_grad_()
    lp, nh = lossfx.gather_logprobs(z2, ids, with_neg_entropy=True, chunk_size=2)
    ((lp * g).sum() + (nh * h).sum()).backward()
    torch.testing.assert_close(z2.grad, formula, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_gather_entropy_merge_identity(shards):
    """proofs/gather.md §3: H = Σ_r w_r (u_r + (m_r − m) s_r) / S − log S from per-shard (m, s, u)."""
    from lossfx._core.numerics import merge, merge_max_logsum, merge_moment
    from lossfx._kernels.gather import _shifted_terms

    n, v = 4, 10
    z = _logits(n, v, 5 + shards, neg_inf=True)[1:]  # drop the all -inf row: H is defined as 0 there
    bounds = torch.linspace(0, v, shards + 1).round().long().tolist()
    ms, ss, us = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = z[:, a:b]
        m = part.amax(-1)
        e, ed = _shifted_terms(part, torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        ms.append(m)
        ss.append(e.sum(-1))
        us.append(ed.sum(-1))
    m, s, u = torch.stack(ms), torch.stack(ss), torch.stack(us)
    shift, log_s = merge_max_logsum(m, s)
    torch.testing.assert_close(shift + log_s, torch.logsumexp(z, -1), rtol=0, atol=1e-12)
    _, neg_h_ref = reference.gather_logprobs(z, torch.zeros(z.shape[0], 1, dtype=torch.long))
    neg_h = merge_moment(merge(m, s), s, u) / merge(m, s).total - log_s
    torch.testing.assert_close(neg_h, neg_h_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_packing_index_maps_are_inverse_bijections(cp, seed):
    """proofs/packing.md §2: (rank, local slot) -> canonical slot is a bijection, with the inverse."""
    from lossfx._layouts.packing import _local_of_canonical, _slot_of_local

    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(0, 4, (5,), generator=gen) * 2 * cp).tolist()  # empty sequences too
    cu_p = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(cu_p[-1])
    local_len = total // cp
    canonical_of = torch.empty(cp, local_len, dtype=torch.long)
    for r in range(cp):
        seg, j, _ = _slot_of_local(cu_p, local_len, r, cp)
        canonical_of[r] = cu_p[seg] + j
    assert sorted(canonical_of.reshape(-1).tolist()) == list(range(total))
    inverse = _local_of_canonical(cu_p, local_len, cp)
    assert torch.equal(canonical_of.reshape(-1)[inverse], torch.arange(total))


def test_packing_summed_gradient_convention():
    """proofs/packing.md §4: d(Σ_s L_s)/dx_r = Π_r^T Σ_s G_s, emulated for C = 3 ranks."""
    torch.manual_seed(0)
    cp, n = 3, 4
    xs = [torch.randn(n, dtype=F64, requires_grad=True) for _ in range(cp)]
    perm = torch.randperm(cp * n)
    weights = [torch.randn(cp * n, dtype=F64) for _ in range(cp)]
    gathered = torch.cat(xs)[perm]
    sum((w * gathered**2).sum() for w in weights).backward()
    upstream = [w * 2 * gathered.detach() for w in weights]  # G_s
    total = torch.stack(upstream).sum(0)
    back = torch.empty(cp * n, dtype=F64)
    back[perm] = total
    for r in range(cp):
        torch.testing.assert_close(xs[r].grad, back[r * n : (r + 1) * n], rtol=0, atol=1e-12)


# proofs/fused_linear.md ----------------------------------------------------------------------


def _linear_case(seed, n=6, hidden=5, vocab=11, k=3):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=F64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=F64)
    ids = torch.randint(0, vocab, (n, k), generator=gen)
    ids[0, 1] = ids[0, 0]  # a duplicate
    return h, w, ids, torch.randn(n, k, generator=gen, dtype=F64), torch.randn(n, generator=gen, dtype=F64)


@pytest.mark.parametrize("seed", range(3))
def test_fused_linear_vjp_through_the_linear_map(seed):
    """proofs/fused_linear.md §2–3: dh = dz W / T and dW = dzᵀ h / T with
    dz = scatter(i, g) − p Σ_k g + e p (log p − E), against dense autograd and the fused backward."""
    h, w, ids, g, e = _linear_case(seed)
    temperature = 0.6
    z = h @ w.T / temperature
    lp = z.log_softmax(-1)
    p = lp.exp()
    neg_entropy = (p * lp).sum(-1)
    dz = torch.zeros_like(z).scatter_add_(1, ids, g) - p * g.sum(-1, keepdim=True)
    dz += e[:, None] * p * (lp - neg_entropy[:, None])
    formula = (dz @ w / temperature, dz.T @ h / temperature)
    for fn in (
        lambda hh, ww: reference.linear_gather_logprobs(hh, ww, ids, True, temperature),
        lambda hh, ww: lossfx.linear_gather_logprobs(
            hh, ww, ids, with_neg_entropy=True, temperature=temperature, chunk_size=4
        ),
    ):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        y, ent = fn(hh, ww)
        torch.autograd.backward([y, ent], [g, e])
        torch.testing.assert_close(hh.grad, formula[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(ww.grad, formula[1], rtol=0, atol=1e-12)
    # K = 1 without entropy: (g ⊙ (onehot − p)) W / T and its transpose form
    t = ids[:, 0]
    r = g[:, :1] * (torch.nn.functional.one_hot(t, w.shape[0]).to(F64) - p)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lossfx.linear_token_logprobs(hh, ww, t, temperature=temperature).backward(g[:, 0])
    torch.testing.assert_close(hh.grad, r @ w / temperature, rtol=0, atol=1e-12)
    torch.testing.assert_close(ww.grad, r.T @ h / temperature, rtol=0, atol=1e-12)


@pytest.mark.parametrize("entropy", [False, True])
def test_fused_linear_renormalised_gather_vjp(entropy):
    """proofs/fused_linear.md §12: zero_outside_topk=False, y' = log_softmax_k(z_i): dz =
    scatter(i, ĝ) + e p (log p − E) with ĝ = g − softmax_k(z_i) Σ_k g (no − p Σ_k g term), against
    dense autograd and the fused backward (which skips the logits without the entropy)."""
    h, w, ids, g, e = _linear_case(3)
    temperature = 0.7
    z = h @ w.T / temperature
    lp = z.log_softmax(-1)
    p = lp.exp()
    q = z.gather(1, ids).softmax(-1)
    dz = torch.zeros_like(z).scatter_add_(1, ids, g - q * g.sum(-1, keepdim=True))
    if entropy:
        dz += e[:, None] * p * (lp - (p * lp).sum(-1, keepdim=True))
    formula = (dz @ w / temperature, dz.T @ h / temperature)
    for fn in (
        lambda hh, ww: reference.linear_gather_logprobs(hh, ww, ids, False, temperature),
        lambda hh, ww: lossfx.linear_gather_logprobs(
            hh, ww, ids, zero_outside_topk=False, with_neg_entropy=True, temperature=temperature, chunk_size=4
        ),
    ):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        y, ent = fn(hh, ww)
        torch.testing.assert_close(y, z.gather(1, ids).log_softmax(-1), rtol=0, atol=1e-12)
        torch.autograd.backward([y, ent] if entropy else [y], [g, e] if entropy else [g])
        torch.testing.assert_close(hh.grad, formula[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(ww.grad, formula[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 0.8, 3.0])
def test_fused_linear_softcap_scale_bias_chain_rule(softcap):
    """proofs/fused_linear.md §9: with z = c·tanh(s·(hWᵀ + b)/c)/T, dr = dz ⊙ (1 − (zT/c)²) and
    dh = (s/T) dr W, dW = (s/T) drᵀ h, db = (s/T) Σ_n dr, against dense autograd and the fused backward."""
    h, w, ids, g, e = _linear_case(7)
    b = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(8), dtype=F64) * 2
    scale, temperature = 1.9, 0.7
    raw = h @ w.T + b
    z = (softcap * torch.tanh(scale * raw / softcap) if softcap else scale * raw) / temperature
    lp = z.log_softmax(-1)
    p = lp.exp()
    neg_entropy = (p * lp).sum(-1)
    dz = torch.zeros_like(z).scatter_add_(1, ids, g) - p * g.sum(-1, keepdim=True)
    dz += e[:, None] * p * (lp - neg_entropy[:, None])  # §2, unchanged
    phi = 1 - (z * temperature / softcap) ** 2 if softcap else torch.ones_like(z)
    dr = dz * phi
    k = scale / temperature
    formula = (k * dr @ w, k * dr.T @ h, k * dr.sum(0))
    opts = {"bias": None, "logit_scale": scale, "softcap": softcap}
    for fn in (
        lambda hh, ww, bb: reference.linear_gather_logprobs(hh, ww, ids, True, temperature, **{**opts, "bias": bb}),
        lambda hh, ww, bb: lossfx.linear_gather_logprobs(
            hh, ww, ids, with_neg_entropy=True, temperature=temperature, chunk_size=4, **{**opts, "bias": bb}
        ),
    ):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        y, ent = fn(hh, ww, bb)
        torch.testing.assert_close(y, lp.gather(-1, ids), rtol=0, atol=1e-12)
        torch.autograd.backward([y, ent], [g, e])
        for got, want in zip((hh.grad, ww.grad, bb.grad), formula, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_fused_linear_merge_identity(shards, scale):
    """proofs/fused_linear.md §5: per-shard (m, s, u, z at owned ids) over any partition of the
    vocabulary merge into log p = (z − shift) − log_s and E = Σ_r w_r(u_r + (m_r − shift)s_r)/S − log_s."""
    from lossfx._core.distributed import local_columns
    from lossfx._kernels.linear_chunks import linear_local_stats
    from lossfx._kernels.linear_chunks import merge_row_stats as _merge_stats

    h, w, ids, _, _ = _linear_case(10 + shards)
    h = h * scale
    bounds = torch.linspace(0, w.shape[0], shards + 1).round().long().tolist()
    stats = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        idx, owned = local_columns(ids, a, b - a)
        stats.append(linear_local_stats(h, w[a:b], None, idx, owned, None, 1.0, 1.0, None, True, 2))
    logprobs, neg_entropy, shift, log_s = _merge_stats(torch.stack(stats), ids.shape[1])
    z = h @ w.T
    lp_dense = z - torch.logsumexp(z, -1, keepdim=True)  # rounding ~ eps·|z|
    tol = 1e-12 * max(1.0, scale)
    torch.testing.assert_close(logprobs, lp_dense.gather(1, ids), rtol=0, atol=tol)
    torch.testing.assert_close(shift + log_s, torch.logsumexp(z, -1), rtol=0, atol=tol)
    lp64 = torch.log_softmax(z, -1)
    torch.testing.assert_close(neg_entropy, (lp64.exp() * lp64).sum(-1), rtol=0, atol=tol)
    assert (log_s >= 0).all()  # S >= 1: the max shard contributes exp(0)·s_r >= 1


@pytest.mark.parametrize("rows", [1, 2, 5, 100])
def test_fused_linear_tiles_partition_the_sums(rows):
    """proofs/fused_linear.md §4: any row chunking (and vocabulary blocking) of the backward gives
    the same dh and dW, to rounding."""
    import dataclasses

    from lossfx._core.chunking import CPU_POLICY, chunk_policy

    h, w, ids, g, e = _linear_case(20)
    results = []
    for block in (w.shape[0], 3):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with chunk_policy(dataclasses.replace(CPU_POLICY, max_block=block)):
            y, ent = lossfx.linear_gather_logprobs(hh, ww, ids, with_neg_entropy=True, chunk_size=rows)
        torch.autograd.backward([y, ent], [g, e])
        results.append((hh.grad, ww.grad))
    for a, b in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_fused_linear_tp_layouts_sum_over_shards():
    """proofs/fused_linear.md §6: dh = Σ_r dz_r W_r / T (all-reduce, replicated hidden); the
    sequence-parallel rank q keeps rows block q of that sum (reduce-scatter); dW_r = dz_rᵀ h / T."""
    h, w, ids, g, e = _linear_case(30, n=8, vocab=12)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    y, ent = reference.linear_gather_logprobs(hh, ww, ids, True, 0.9)
    torch.autograd.backward([y, ent], [g, e])
    z = h @ w.T / 0.9
    lp = z.log_softmax(-1)
    p = lp.exp()
    dz = torch.zeros_like(z).scatter_add_(1, ids, g) - p * g.sum(-1, keepdim=True)
    dz += e[:, None] * p * (lp - (p * lp).sum(-1, keepdim=True))
    for world in (2, 4):
        vl, nl = 12 // world, 8 // world
        partial = [dz[:, r * vl : (r + 1) * vl] @ w[r * vl : (r + 1) * vl] / 0.9 for r in range(world)]
        torch.testing.assert_close(sum(partial), hh.grad, rtol=0, atol=1e-12)  # all-reduce
        scattered = [sum(partial)[q * nl : (q + 1) * nl] for q in range(world)]  # reduce-scatter
        torch.testing.assert_close(torch.cat(scattered), hh.grad, rtol=0, atol=1e-12)
        dw = [dz[:, r * vl : (r + 1) * vl].T @ h / 0.9 for r in range(world)]
        torch.testing.assert_close(torch.cat(dw), ww.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("offset", [1e2, 1e3, 1e4])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_fused_linear_backward_row_sums_at_large_offsets(offset, temperature):
    """proofs/fused_linear.md §8: with z = c + y (h_0 = 1, W_0 = c + b), dh = dz W₀/T + (c/T)(Σ dz) e₀;
    `exp(z − shift)·exp(−log_s)` keeps Σ p = 1 to O(ε), `exp(z − (shift + log_s))` does not (its
    error grows with c), and the fused fp32 backward's offset column is off by O(ε c/T) only."""
    from lossfx._core.distributed import local_columns
    from lossfx._kernels.linear_chunks import linear_local_stats, merge_row_stats

    f32, eps = torch.float32, torch.finfo(torch.float32).eps
    gen = torch.Generator().manual_seed(0)
    n, hidden, vocab = 8, 6, 64
    h = torch.randn(n, hidden, generator=gen, dtype=F64)
    h[:, 0] = 1
    w = torch.randn(vocab, hidden, generator=gen, dtype=F64)
    w[:, 0] += offset
    h, w = h.to(f32), w.to(f32)
    w0 = w.to(F64)
    w0[:, 0] -= offset  # exact: the unshifted head of the same fp32 inputs
    t = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.randn(n, generator=gen, dtype=F64)
    # the identity (float64): the offset enters dh only through the row sums of dz
    z0 = h.to(F64) @ w0.T / temperature
    dz = torch.nn.functional.one_hot(t, vocab).to(F64) * g[:, None] - z0.softmax(-1) * g[:, None]
    shifted = w0.clone()
    shifted[:, 0] += offset
    e0 = torch.nn.functional.one_hot(torch.tensor(0), hidden).to(F64)
    split = dz @ w0 / temperature + (offset / temperature) * dz.sum(-1, keepdim=True) * e0
    torch.testing.assert_close(dz @ shifted / temperature, split, rtol=0, atol=1e-9)
    assert dz.sum(-1).abs().max() < 1e-14
    # the two forms of p in fp32, from the kernel's own row statistics
    idx, owned = local_columns(t[:, None], 0, vocab)
    stats = linear_local_stats(h, w, None, idx, owned, None, temperature, 1.0, None, False, 0)
    _, _, shift, log_s = merge_row_stats(stats[None], 1)
    z = (h @ w.T) / temperature
    p_split = torch.exp(z - shift[:, None]) * torch.exp(-log_s)[:, None]
    p_merged = torch.exp(z - (shift + log_s)[:, None])
    # each p_v: one rounding of z − shift (scaled by |z − shift| <= ~20 here), of exp, of 1/S
    assert (p_split.to(F64).sum(-1) - 1).abs().max() < 8 * eps
    assert (p_merged.to(F64).sum(-1) - 1).abs().max() > 0.05 * eps * offset / temperature
    # the fused backward: its offset column is off by a few ε·(c/T)·Σ|dz|, not ε·(c/T)²
    hh = h.clone().requires_grad_()
    lossfx.linear_token_logprobs(hh, w, t, temperature=temperature).backward(g.to(f32))
    truth = dz @ w0 / temperature  # Σ dz = 0: the exact gradient of the shifted inputs
    bound = 8 * eps * (offset / temperature) * dz.abs().sum(-1)
    assert ((hh.grad[:, 0].to(F64) - truth[:, 0]).abs() <= bound).all()


# proofs/linear_objective.md ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_linear_objective_gradient_formula_and_chunk_sums(chunk):
    """proofs/linear_objective.md §1–3: D = p ⊙ (b (log p − E) − a) + a·onehot(t); with upstream G,
    dh = G·D W / T, dW = G·Σ_c D_cᵀ h_c / T, da = G·ℓ, db = G·E, whatever the row chunking."""
    h, w, ids, _, _ = _linear_case(40, n=7)
    t = ids[:, 0]
    gen = torch.Generator().manual_seed(41)
    a, b = torch.randn(7, generator=gen, dtype=F64), torch.randn(7, generator=gen, dtype=F64)
    temperature, upstream = 0.8, -2.5
    lp = (h @ w.T / temperature).log_softmax(-1)
    p, ell = lp.exp(), lp.gather(1, t[:, None])[:, 0]
    neg_entropy = (p * lp).sum(-1)
    d = p * (b[:, None] * (lp - neg_entropy[:, None]) - a[:, None])
    d = d + a[:, None] * torch.nn.functional.one_hot(t, w.shape[0]).to(F64)
    dw_chunks = sum(d[c : c + chunk].T @ h[c : c + chunk] for c in range(0, 7, chunk)) / temperature
    hh, ww, aa, bb = (x.clone().requires_grad_() for x in (h, w, a, b))
    objective, _, _ = lossfx.linear_logprob_objective(
        hh, ww, t, aa, neg_entropy_weight=bb, temperature=temperature, chunk_size=chunk
    )
    (upstream * objective).backward()
    torch.testing.assert_close(objective, (a * ell).sum() + (b * neg_entropy).sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(hh.grad, upstream * d @ w / temperature, rtol=0, atol=1e-12)
    torch.testing.assert_close(ww.grad, upstream * dw_chunks, rtol=0, atol=1e-12)
    torch.testing.assert_close(aa.grad, upstream * ell, rtol=0, atol=1e-12)
    torch.testing.assert_close(bb.grad, upstream * neg_entropy, rtol=0, atol=1e-12)


def test_linear_objective_shards_form_their_own_columns():
    """proofs/linear_objective.md §4: after the per-chunk merge each shard's columns of D give its
    dW_r = D_{𝒱_r}ᵀ h / T, and Σ_r D_{𝒱_r} W_r / T is the full dh (all-reduce or reduce-scatter)."""
    h, w, ids, _, _ = _linear_case(42, n=8, vocab=12)
    t, a = ids[:, 0], torch.linspace(-1, 1, 8, dtype=F64)
    lp = (h @ w.T).log_softmax(-1)
    d = a[:, None] * (torch.nn.functional.one_hot(t, 12).to(F64) - lp.exp())
    for world in (2, 3, 4):
        vl = 12 // world
        shards = [slice(r * vl, (r + 1) * vl) for r in range(world)]
        dw = torch.cat([d[:, s].T @ h for s in shards])
        dh = sum(d[:, s] @ w[s] for s in shards)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lossfx.linear_logprob_objective(hh, ww, t, a)[0].backward()
        torch.testing.assert_close(dw, ww.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(dh, hh.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("offset", [0.0, 1e4, -1e16, 1e30, -1e300])
def test_divergence_split_shift_is_exact_at_any_magnitude(offset):
    """proofs/divergence.md §8: `(z − M) − log S` matches log_softmax at any offset; `z − (M + log S)`
    does not once `ulp(M)` exceeds `log S`."""
    from lossfx._core.numerics import merge_max_logsum

    z = offset + torch.tensor([[0.0, 0.0, -1.0, -3.0, -80.0]], dtype=F64)
    halves = [z[:, :2], z[:, 2:]]  # two "ranks"
    m = torch.stack([h.amax(-1) for h in halves])  # [2, 1]
    s = torch.stack([(h - hm[:, None]).exp().sum(-1) for h, hm in zip(halves, m)])  # [2, 1]
    shift, log_s = merge_max_logsum(m, s)
    split = (z - shift[:, None]) - log_s[:, None]
    torch.testing.assert_close(split, z.log_softmax(-1), rtol=0, atol=4e-16 * (1 + split.abs()).max().item())
    merged = z - (shift + log_s)[:, None]
    if abs(offset) >= 1e16:  # ulp(offset) ≥ 2 > log S: the merged form rounds log S away
        assert not torch.allclose(merged, z.log_softmax(-1))
    # and the divergence backward uses the split: the entropy gradient matches dense autograd
    zz = z.clone().requires_grad_()
    lossfx.neg_entropy(zz).sum().backward()
    dense = z.log_softmax(-1)
    p = dense.exp()
    want = p * (dense - (p * dense).sum(-1, keepdim=True))
    torch.testing.assert_close(zz.grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_projected_teacher_rows_equal_the_dense_projection(chunk):
    """proofs/divergence.md §9: per-chunk projection with per-row routing gives every row the same
    teacher statistics as the materialised teacher logits."""
    from lossfx._kernels.divergence import _projected_teacher_stats, _stats_eager

    gen = torch.Generator().manual_seed(chunk)
    n, v, h = 7, 11, 4
    student = torch.randn(n, v, generator=gen, dtype=F64)
    hidden = torch.randn(n, h, generator=gen, dtype=F64)
    heads = [torch.randn(v, h, generator=gen, dtype=F64) for _ in range(2)]
    head = torch.randint(0, 2, (n,), generator=gen)
    teacher = torch.stack([hidden[i] @ heads[int(head[i])].T for i in range(n)])  # [n, v]
    projected = _projected_teacher_stats(student, hidden, heads, head, "reverse_kl", chunk, F64)
    dense = _stats_eager(student, lambda a, b: teacher[a:b], 1, 1, n, F64)
    torch.testing.assert_close(projected, dense, rtol=1e-14, atol=1e-14)


def test_logprobs_exact_at_any_magnitude():
    """proofs/logprobs.md §4.1: `(z_t − m) − log s` is within a few ulps at any offset; `z_t − (m + log s)` is not.

    fp32 rows `c + y`, with `y` a few exact levels (multiples of `ulp(c)`, so `c + y` is exact);
    the truth is the float64 log-softmax of `y` (log-softmax is shift-invariant).
    """
    u = torch.finfo(torch.float32).eps / 2
    levels = torch.tensor([0.0, 0.0, 0.0, -1.0, -3.0], dtype=F64)
    lost = []
    for k in range(0, 121, 4):
        c = 2.0**k
        y = levels * max(1.0, 2.0 ** (k - 23))  # exact levels at this offset
        z = (c + y).to(torch.float32)
        assert torch.equal(z.to(F64) - c, y)
        truth = torch.log_softmax(y, -1)[0].item()
        m = z.max()
        log_s = torch.log(torch.exp(z - m).sum())
        split = ((z[0] - m) - log_s).item()  # lossfx's order
        summed = (z[0] - (m + log_s)).item()  # the textbook order
        bound = 4 * u * (abs(truth) + abs((z[0] - m).item()) + len(levels) * 2)
        assert abs(split - truth) <= bound, (k, split, truth)
        assert abs(lossfx.token_logprobs(z[None], torch.tensor([0])).item() - truth) <= bound, k
        # the textbook order: once log s < ulp(m)/2 the sum rounds to m and log s is lost entirely
        if 2.0 ** (k - 24) > log_s.item():
            assert summed == (z[0] - m).item() == 0.0
            lost.append(k)
            assert abs(summed - truth) == pytest.approx(-truth, rel=1e-6)
    assert lost and lost[0] <= 28, "the textbook order must lose log s from offset ~2^25 in fp32"


@pytest.mark.parametrize("vocab_start", [0, 4])
def test_gather_compiled_backward_overwrite_identity(vocab_start):
    """proofs/gather.md §5: dense term everywhere, then `D_c + G_c` written over the id columns,
    equals §2's scatter-add formula (duplicate ids, ids owned by another shard), in float64."""
    from unittest import mock

    from lossfx._core.numerics import merge_max_logsum
    from lossfx._kernels.gather import _gather_logprobs_bwd

    n, v, k = 5, 9, 4
    z = _logits(n, v, 21)
    ids = torch.randint(0, v + 4, (n, k), generator=torch.Generator().manual_seed(3))  # global ids, V = v + 4
    ids[:, 1] = ids[:, 0]  # duplicates
    g, h = torch.randn(n, k, dtype=F64), torch.randn(n, dtype=F64)
    shift, log_s = merge_max_logsum(z.amax(-1)[None], torch.exp(z - z.amax(-1, keepdim=True)).sum(-1)[None])
    log_p = torch.log_softmax(z, -1)
    neg_h = (log_p.exp() * log_p).sum(-1)
    local = ids - vocab_start
    owned = (local >= 0) & (local < v)
    expected = torch.zeros(n, v, dtype=F64).scatter_add(-1, torch.where(owned, local, 0), torch.where(owned, g, 0.0))
    expected += log_p.exp() * (h[:, None] * (log_p - neg_h[:, None]) - g.sum(-1, keepdim=True))
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        compiled_form = _gather_logprobs_bwd(z, ids, shift, log_s, neg_h, g, h, vocab_start, None)
    eager_form = _gather_logprobs_bwd(z, ids, shift, log_s, neg_h, g, h, vocab_start, 2)
    torch.testing.assert_close(compiled_form, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(eager_form, expected, rtol=0, atol=1e-12)


def test_filtering_exact_ceil_of_top_p_times_count():
    """proofs/filtering.md §3.3: `top_p = hi + lo` exactly with both products exact for counts up
    to 2^26, and `_ceil_top_p_times` equals `⌈Fraction(top_p)·t⌉` (where `fl(p·t)` does not)."""
    import math
    import random
    from fractions import Fraction

    from lossfx._kernels.filtering import EXACT_TIES_MAX, _ceil_top_p_times, _split_top_p

    rng = random.Random(0)
    tricky = [math.nextafter(1 / 3, 1.0), 1 / 3, 0.5, 0.3, 0.9, 0.1, math.nextafter(1.0, 0.0), 1e-300, 5e-324]
    ps = (
        tricky
        + [rng.random() for _ in range(300)]
        + [rng.randint(1, 999) / rng.randint(1000, 5000) for _ in range(300)]
    )
    counts = [1, 2, 3, 5, 7, 10, 1000, 2**20 - 1, EXACT_TIES_MAX - 1, EXACT_TIES_MAX]
    counts += [rng.randint(1, EXACT_TIES_MAX) for _ in range(40)]
    t = torch.tensor(counts)
    for p in ps:
        hi, lo = _split_top_p(p)
        if p > 2.0**-900:  # (a tiny p keeps 1 of any group: `lo` may then round, harmlessly)
            assert Fraction(hi) + Fraction(lo) == Fraction(p) and 0 <= lo < 2.0**-26 * p
            for c in (counts[-1], EXACT_TIES_MAX):
                assert Fraction(hi * c) == Fraction(hi) * c and Fraction(lo * c) == Fraction(lo) * c
        assert _ceil_top_p_times(p, t).tolist() == [math.ceil(Fraction(p) * c) for c in counts]
    # the rounded product fails here: p·3 = 1 + 2^-53 rounds to 1, but two of three are kept
    p = math.nextafter(1 / 3, 1.0)
    assert p * 3 == 1.0 and _ceil_top_p_times(p, torch.tensor([3])).item() == 2


def test_filtering_nemo_cumsum_on_uniform_rows():
    """proofs/filtering.md §3.3: NeMo RL's ascending `cumsum(softmax) > 1 − p` (`1 − p` a Python
    float) on a uniform row is off by one on 14 (fp32) and 25 (float64) of 640 (t, p) pairs;
    lossfx keeps `⌈p·t⌉`."""
    import math
    from fractions import Fraction

    ps = (0.1, 0.25, 0.3, 0.5, 0.6, 0.7, 0.75, 0.9, 0.95, 0.99)
    for dtype, expected_misses in ((torch.float32, 14), (F64, 25)):
        misses = 0
        for t in range(1, 65):
            cumsum = torch.cumsum(torch.softmax(torch.zeros(t, dtype=dtype), dim=-1), dim=-1)
            for p in ps:
                keep_nemo = cumsum > 1 - p
                keep_nemo[-1] = True  # the largest is always kept
                exact = math.ceil(Fraction(p) * t)
                misses += int(keep_nemo.sum()) != exact
                kept = lossfx.apply_top_k_top_p(torch.zeros(1, t, dtype=dtype), top_p=p, ties="sorted")[1]
                assert int(kept.sum()) == exact
        assert misses == expected_misses


@pytest.mark.parametrize("seed", range(4))
def test_filtering_id_cut_from_rank_counts(seed):
    """proofs/filtering.md §1, "Finding t*": from every rank's tie count and first id, rank r keeps
    its `k_r = clamp(n − a_r, 0, c_r)` largest tied ids, found by one cumulative count
    (`J_r`); over any shard layout (ranks in any order, widths 1..9) the kept ties are the n
    largest ids, and `t*` (the n-th largest) is the least kept id over the ranks."""
    from lossfx._kernels.filtering import _count_eq, _id_cut

    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        world = int(torch.randint(1, 5, (1,), generator=gen))
        widths = torch.randint(1, 10, (world,), generator=gen).tolist()
        vocab = sum(widths)
        order = torch.randperm(world, generator=gen).tolist()  # rank order[i] holds the i-th block
        starts = [0] * world
        for i, r in enumerate(order):
            starts[r] = sum(widths[order[j]] for j in range(i))
        z = torch.randint(0, 3, (6, vocab), generator=gen).to(F64)
        z[5] = 7.0  # one row: all tied
        tau = torch.randint(0, 3, (6,), generator=gen).to(F64)
        tau[4] = 5.0  # a row without ties at τ
        tied = z == tau[:, None]
        c = tied.sum(-1)
        n = torch.minimum((torch.rand(6, generator=gen) * c).long() + 1, c.clamp(min=1))  # 1 ≤ n ≤ c
        shards = [z[:, s : s + w] for s, w in zip(starts, widths, strict=True)]
        counts = torch.stack([_count_eq(x, tau, [(0, 6)]) for x in shards])  # [R, N]
        kept = torch.zeros_like(tied)
        first_kept = torch.full((6,), vocab)  # min over the ranks that keep a tie of s_r + J_r
        for r in range(world):
            mine_first = [r] + [q for q in range(world) if q != r]  # `counts[rank]` is row 0 without a group
            cut = _id_cut(
                shards[r],
                tau,
                n,
                counts[mine_first],
                torch.tensor(starts)[mine_first],
                starts[r],
                vocab,
                [(0, 2), (2, 6)],
                None,
                shared=False,
            )
            ids = torch.arange(starts[r], starts[r] + widths[r])
            kept[:, ids] = tied[:, ids] & (ids >= cut[:, None])
            first_kept = torch.where(kept[:, ids].any(-1), torch.minimum(first_kept, cut), first_kept)
        ids = torch.arange(vocab)
        for row in range(6):
            tied_ids = ids[tied[row]].flip(0)  # largest first
            assert kept[row].sum() == min(int(n[row]), len(tied_ids))
            assert torch.equal(ids[kept[row]].flip(0), tied_ids[: int(n[row])])
            if len(tied_ids):  # t* = the n-th largest tied id = the least s_r + J_r of the ranks keeping one
                assert int(first_kept[row]) == int(tied_ids[int(n[row]) - 1])
