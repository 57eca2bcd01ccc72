"""Context parallelism and packed sequences: next-token log-probs in every layout.

Sections: 0 helpers; 1 reference equivalence over CP x TP (values and gradients, float64 1e-10),
unpacked CP and packed; 2 packed equals unpacked sequence by sequence; 3 properties (random
lengths and paddings); 5 compile (fullgraph, recompiles when the layout changes); 6 errors.
"""

import warnings
from types import SimpleNamespace

import pytest
import torch
from harness import compiled_for_rank, mesh_groups, run_ranks
from hypothesis import given
from hypothesis import strategies as st

import lossfx
from lossfx import reference
from lossfx.context_parallel import cp_positions, shard_for_cp_rank
from lossfx.next_token import LoadBalancedSharder, sharded_next_token_logprobs
from lossfx.packing import packed_next_token_logprobs

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}
LAYOUTS = [(1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (8, 2)]  # (world, tp): cp = world // tp
LAYOUT_IDS = ["tp1", "tp2", "cp2", "tp2xcp2", "cp4", "tp2xcp4"]

# ---------------------------------------------------------------------------------------------
# 0. Helpers
# ---------------------------------------------------------------------------------------------


def _tp_slice(x, tp_rank, tp):
    vl = x.shape[-1] // tp
    return x[..., tp_rank * vl : (tp_rank + 1) * vl]


def _packed_positions(cu_p, cp_rank, cp):
    """Canonical packed slots held by a CP rank, in local order (each sequence sharded alone)."""
    out = []
    for i in range(len(cu_p) - 1):
        out += [cu_p[i] + p for p in cp_positions(cu_p[i + 1] - cu_p[i], cp_rank, cp)]
    return torch.tensor(out, dtype=torch.long)


def _case(lengths, pads, width, vocab, seed, cp):
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_p = [0], [0]
    for n, extra in zip(lengths, pads):
        padded = n + extra
        padded += (-padded) % (2 * cp)
        cu_q.append(cu_q[-1] + n)
        cu_p.append(cu_p[-1] + padded)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    z = torch.randn(1, cu_p[-1], vocab, generator=gen, dtype=F64) * 3
    return z, ids, cu_q, cu_p


def _packed_rank(rank, world, group, tp, z, ids, cu_q, cu_p, g, kw, compiled=None):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    local = _tp_slice(z[:, _packed_positions(cu_p, cp_rank, cp)], tp_rank, tp).clone().requires_grad_()

    def step(logits, ids, cu_q, cu_p, g):
        out = packed_next_token_logprobs(
            logits, ids, cu_q, cu_p, vocab_parallel_group=tp_group, context_parallel_group=cp_group, **kw
        )
        return out, (torch.where(torch.isfinite(out), out, 0.0) * g).sum() / cp

    fn = step
    if compiled:
        _, fn = compiled_for_rank(rank, ("packed", world, tp, compiled, tuple(sorted(kw))), step, backend=compiled)
    if compiled:  # inside compiled code the layout travels as tensors: tuples of ints specialise
        cu_q, cu_p = torch.tensor(cu_q), torch.tensor(cu_p)
    out, loss = fn(local, ids, cu_q, cu_p, g)
    loss.backward()
    return out.detach(), local.grad


def _check_packed(world, tp, z, ids, cu_q, cu_p, kw, compiled=None, prepacked=False):
    cp = world // tp
    zr = z.clone().requires_grad_()
    ref_kw = {"prepacked": prepacked}
    if kw.get("sampling_params") is not None:
        ref_kw.update(top_k=kw["sampling_params"].top_k, top_p=kw["sampling_params"].top_p)
    ref = reference.packed_next_token_logprobs(zr, ids, cu_q, cu_p, **ref_kw)
    g = torch.randn(ref.shape, dtype=F64)
    (torch.where(torch.isfinite(ref), ref, 0.0) * g).sum().backward()
    results = run_ranks(world, _packed_rank, tp, z, ids, cu_q, cu_p, g, {**kw, "prepacked": prepacked}, compiled)
    for rank, (out, grad) in enumerate(results):
        torch.testing.assert_close(out, ref.detach(), **TIGHT)
        expected = _tp_slice(zr.grad[:, _packed_positions(cu_p, rank // tp, cp)], rank % tp, tp)
        torch.testing.assert_close(grad, expected, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 1. Reference equivalence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "tp"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("filtered", [False, True])
def test_packed_matches_reference(world, tp, chunk, filtered):
    cp = world // tp
    z, ids, cu_q, cu_p = _case([5, 9, 1, 7], [3, 0, 2, 1], width=9, vocab=8, seed=world + tp, cp=cp)
    sp = lossfx.TrainingSamplingParams(top_k=5, top_p=0.8) if filtered else None
    _check_packed(world, tp, z, ids, cu_q, cu_p, {"chunk_size": chunk, "sampling_params": sp})


@pytest.mark.parametrize(("world", "tp"), LAYOUTS, ids=LAYOUT_IDS)
def test_prepacked_layout_matches_reference(world, tp):
    """Pre-packed input returns [1, T-1] with every sequence's last slot 0 (decisions.md item 8)."""
    cp = world // tp
    z, _, cu_q, cu_p = _case([6, 3, 8], [2, 1, 0], width=8, vocab=8, seed=3, cp=cp)
    packed_ids = torch.randint(0, 8, (1, cu_p[-1]), generator=torch.Generator().manual_seed(4))
    _check_packed(world, tp, z, packed_ids, cu_q, cu_p, {}, prepacked=True)


def test_bin_padding_longer_than_row_is_clamped():
    """A packer may fold bin padding into the last sequence: its length exceeds the row width."""
    width, vocab = 6, 5
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, width), generator=gen)
    cu_q, cu_p = [0, 6, 16], [0, 6, 16]  # second sequence "has" 10 tokens in a row of 6
    z = torch.randn(1, 16, vocab, generator=gen, dtype=F64)
    out = packed_next_token_logprobs(z, ids, cu_q, cu_p)
    torch.testing.assert_close(out, reference.packed_next_token_logprobs(z, ids, cu_q, cu_p), **TIGHT)
    # the real tokens of the long sequence are scored as in the unpacked path; the phantom tail is
    # scored against token 0 and must be masked by the caller
    unpacked = lossfx.reference.next_token_logprobs(z[:, 6:12], ids[1:2])
    torch.testing.assert_close(out[1, :5], unpacked[0], **TIGHT)


# ---------------------------------------------------------------------------------------------
# 2. Packed equals the unpacked path, sequence by sequence (and unpacked CP equals reference)
# ---------------------------------------------------------------------------------------------


def test_packed_equals_unpacked_sequence_by_sequence():
    lengths = [7, 3, 10, 2]
    z, ids, cu_q, cu_p = _case(lengths, [1, 0, 2, 0], width=10, vocab=9, seed=5, cp=1)
    packed = packed_next_token_logprobs(z, ids, cu_q, cu_p)
    for i, n in enumerate(lengths):
        one = lossfx.next_token_logprobs(z[:, cu_p[i] : cu_p[i] + n], ids[i : i + 1, :n])
        torch.testing.assert_close(packed[i, : n - 1], one[0], **TIGHT)


def _cp_rank(rank, world, group, tp, z, ids, g, kw, use_sharder):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    pad = (-z.shape[1]) % (2 * cp) if cp > 1 else 0
    zp = torch.nn.functional.pad(z, (0, 0, 0, pad))
    local = _tp_slice(shard_for_cp_rank(zp, cp_rank, cp, seq_dim=1), tp_rank, tp).clone().requires_grad_()
    if use_sharder:
        kw = {**kw, "cp_sharder": LoadBalancedSharder(cp_group)}
    else:
        kw = {**kw, "context_parallel_group": cp_group}
    out = sharded_next_token_logprobs(local, ids, vocab_parallel_group=tp_group, **kw)
    ((torch.where(torch.isfinite(out), out, 0.0) * g).sum() / cp).backward()
    return out.detach(), local.grad, pad


@pytest.mark.parametrize(("world", "tp"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("use_sharder", [False, True])
def test_unpacked_context_parallel_matches_reference(world, tp, filtered, use_sharder):
    cp = world // tp
    b, s, v = 2, 11, 8  # S = 11 is not a multiple of 2C: the logits are padded, the ids are not
    gen = torch.Generator().manual_seed(world * 3 + tp)
    z = torch.randn(b, s, v, generator=gen, dtype=F64) * 2
    ids = torch.randint(0, v, (b, s), generator=gen)
    sp = lossfx.TrainingSamplingParams(top_k=4, top_p=0.9) if filtered else None
    zr = z.clone().requires_grad_()
    if filtered:
        ref = reference.next_token_filtered_logprobs(zr, ids, 4, 0.9)
    else:
        ref = reference.next_token_logprobs(zr, ids)
    g = torch.randn(ref.shape, dtype=F64)
    (torch.where(torch.isfinite(ref), ref, 0.0) * g).sum().backward()
    results = run_ranks(world, _cp_rank, tp, z, ids, g, {"sampling_params": sp, "chunk_size": 2}, use_sharder)
    for rank, (out, grad, pad) in enumerate(results):
        torch.testing.assert_close(out, ref.detach(), **TIGHT)
        full_grad = torch.nn.functional.pad(zr.grad, (0, 0, 0, pad))
        expected = _tp_slice(shard_for_cp_rank(full_grad, rank // tp, cp, seq_dim=1), rank % tp, tp)
        torch.testing.assert_close(grad, expected, **TIGHT)


# ---------------------------------------------------------------------------------------------
# 3. Properties: random lengths and paddings
# ---------------------------------------------------------------------------------------------


@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    data=st.data(),
    layout=st.sampled_from(LAYOUTS),
    chunk=st.one_of(st.none(), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
)
def test_property_packed_any_layout(lengths, data, layout, chunk, seed):
    world, tp = layout
    pads = data.draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
    width = max(lengths) + data.draw(st.integers(0, 2))
    z, ids, cu_q, cu_p = _case(lengths, pads, width=width, vocab=4 * tp, seed=seed, cp=world // tp)
    _check_packed(world, tp, z, ids, cu_q, cu_p, {"chunk_size": chunk})


# ---------------------------------------------------------------------------------------------
# 5. Compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_packed_compiles_fullgraph_and_recompiles_at_most_once_on_layout_change():
    world, tp = 2, 1
    layouts = [([5, 3, 6], [1, 1, 2]), ([2, 7, 4], [2, 1, 0]), ([6, 6, 1], [0, 2, 3])]
    for lengths, pads in layouts:
        z, ids, cu_q, cu_p = _case(lengths, pads, width=8, vocab=8, seed=sum(lengths), cp=world // tp)
        _check_packed(world, tp, z, ids, cu_q, cu_p, {}, compiled="aot_eager")
    for rank in range(world):
        counter, _ = compiled_for_rank(rank, ("packed", world, tp, "aot_eager", ("prepacked",)), None, "aot_eager")
        assert counter.frame_count <= 2, f"{counter.frame_count} compiles for 3 pack layouts"


# ---------------------------------------------------------------------------------------------
# 6. Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cu_q", "cu_p", "match"),
    [
        ([1, 4, 8], [0, 4, 8], r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
        ([0, 5, 3], [0, 5, 8], r"non-decreasing.*\(1, 5, 3\)"),
        ([0, 4, 8], [0, 3, 8], r"padded sequence lengths must be >= unpadded.*\(0, 3, 4\)"),
        ([0, 4, 8], [0, 4, 9], r"cu_seqlens_q_padded\[-1\] = 9 must equal .* 8"),
        ([0, 4], [0, 8], r"B\+1 = 3 entries, got 2"),
    ],
)
def test_malformed_cu_seqlens_raise(cu_q, cu_p, match):
    z = torch.zeros(1, 8, 4)
    with pytest.raises(ValueError, match=match):
        packed_next_token_logprobs(z, torch.zeros(2, 6, dtype=torch.long), cu_q, cu_p)


def _odd_cp(rank, world, group):
    try:
        packed_next_token_logprobs(
            torch.zeros(1, 3, 4),
            torch.zeros(2, 4, dtype=torch.long),
            [0, 3, 6],
            [0, 3, 6],
            context_parallel_group=group,
        )
    except ValueError as exc:
        return str(exc)
    return None


def test_packed_cp_lengths_not_multiple_of_2c_raise():
    for message in run_ranks(2, _odd_cp):
        assert message is not None and "multiple of 2·2" in message


def _short_cp(rank, world, group):
    try:
        sharded_next_token_logprobs(
            torch.zeros(1, 3, 4), torch.zeros(1, 8, dtype=torch.long), context_parallel_group=group
        )
    except ValueError as exc:
        return str(exc)
    return None


def test_unpacked_cp_bad_local_length_raises():
    for message in run_ranks(2, _short_cp):
        assert message is not None and "even local length" in message


# ---------------------------------------------------------------------------------------------
# 8. The entry points: prepare_packed_loss_input, prepare_loss_input with context parallelism
# ---------------------------------------------------------------------------------------------


def _entry_rank(rank, world, group, tp, z, data, cu_q, cu_p, kl, sp):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    local = _tp_slice(z[:, _packed_positions(cu_p, cp_rank, cp)], tp_rank, tp).clone().requires_grad_()
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB, reference_policy_kl_penalty=kl)
    data = dict(data)
    out, returned = lossfx.prepare_packed_loss_input(
        local,
        data,
        loss_fn,
        cu_q,
        cu_p,
        vocab_parallel_rank=tp_rank if tp_group is not None else None,
        vocab_parallel_group=tp_group,
        context_parallel_group=cp_group,
        sampling_params=sp,
    )
    lp = out["next_token_logprobs"]
    assert returned is data
    (lp.sum() / cp).backward()
    return lp.detach(), data.get("curr_logprobs_unfiltered"), local.grad


@pytest.mark.parametrize(("world", "tp"), LAYOUTS, ids=LAYOUT_IDS)
def test_prepare_packed_loss_input_filtered_with_unfiltered_copy(world, tp):
    cp = world // tp
    z, ids, cu_q, cu_p = _case([6, 4, 7], [2, 1, 0], width=7, vocab=8, seed=world, cp=cp)
    token_mask = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) > 0.2).float()
    data = {"input_ids": ids, "token_mask": token_mask, "sample_mask": torch.tensor([1.0, 0.0, 1.0])}
    sp = lossfx.TrainingSamplingParams(top_k=3, top_p=0.85)
    zr = z.clone().requires_grad_()
    filtered = reference.packed_next_token_logprobs(zr, ids, cu_q, cu_p, top_k=3, top_p=0.85)
    mask = (token_mask * data["sample_mask"][:, None])[:, 1:]
    expected = reference.mask_out_neg_inf_logprobs(filtered, mask)
    expected.sum().backward()
    unfiltered = reference.packed_next_token_logprobs(z, ids, cu_q, cu_p)
    with warnings.catch_warnings():  # the -inf warning itself is tested in test_filtering.py
        warnings.simplefilter("ignore", UserWarning)
        results = run_ranks(world, _entry_rank, tp, z, data, cu_q, cu_p, 0.1, sp)
    for rank, (lp, copy, grad) in enumerate(results):
        assert torch.isfinite(lp).all() and torch.isfinite(grad).all()
        torch.testing.assert_close(lp, expected.detach(), **TIGHT)
        torch.testing.assert_close(copy.detach(), unfiltered, **TIGHT)
        want = _tp_slice(zr.grad[:, _packed_positions(cu_p, rank // tp, cp)], rank % tp, tp)
        torch.testing.assert_close(grad, want, **TIGHT)


def test_prepare_packed_loss_input_prepacked_and_errors():
    z, _, cu_q, cu_p = _case([5, 3], [1, 1], width=5, vocab=6, seed=2, cp=1)
    packed_ids = torch.randint(0, 6, (1, cu_p[-1]), generator=torch.Generator().manual_seed(3))
    loss_fn = SimpleNamespace(input_type="logprob")
    data = {"input_ids": packed_ids, "cu_seqlens": torch.tensor(cu_p)}
    out, _ = lossfx.prepare_packed_loss_input(z, data, loss_fn, cu_q, cu_p)
    expected = reference.packed_next_token_logprobs(z, packed_ids, cu_q, cu_p, prepacked=True)
    torch.testing.assert_close(out["next_token_logprobs"], expected, **TIGHT)
    with pytest.raises(ValueError, match=r"only supports LossInputType\.LOGPROB"):
        lossfx.prepare_packed_loss_input(z, data, SimpleNamespace(input_type="logit"), cu_q, cu_p)
    with pytest.raises(ValueError, match="vocab_parallel_rank must be provided"):
        lossfx.prepare_packed_loss_input(z, data, loss_fn, cu_q, cu_p, vocab_parallel_group=object())
    with pytest.raises(ValueError, match="input_ids"):
        lossfx.prepare_packed_loss_input(z, {}, loss_fn, cu_q, cu_p)


def _logprob_cp_rank(rank, world, group, tp, z, ids, sp):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    local = _tp_slice(shard_for_cp_rank(z, cp_rank, cp, seq_dim=1), tp_rank, tp).clone().requires_grad_()
    out, _ = lossfx.prepare_loss_input(
        local,
        {"input_ids": ids},
        SimpleNamespace(input_type="logprob"),
        vocab_parallel_rank=tp_rank if tp_group is not None else None,
        vocab_parallel_group=tp_group,
        context_parallel_group=cp_group,
        sampling_params=sp,
        chunk_size=3,
    )
    (out["next_token_logprobs"].sum() / cp).backward()
    return out["next_token_logprobs"].detach(), local.grad


@pytest.mark.parametrize(("world", "tp"), LAYOUTS, ids=LAYOUT_IDS)
def test_prepare_loss_input_logprob_with_context_parallelism(world, tp):
    cp = world // tp
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(2, 8, 8, generator=gen, dtype=F64)
    ids = torch.randint(0, 8, (2, 8), generator=gen)
    zr = z.clone().requires_grad_()
    ref = reference.prepare_loss_input(zr, {"input_ids": ids}, SimpleNamespace(input_type="logprob"))
    ref["next_token_logprobs"].sum().backward()
    for rank, (lp, grad) in enumerate(run_ranks(world, _logprob_cp_rank, tp, z, ids, None)):
        torch.testing.assert_close(lp, ref["next_token_logprobs"].detach(), **TIGHT)
        want = _tp_slice(shard_for_cp_rank(zr.grad, rank // tp, cp, seq_dim=1), rank % tp, tp)
        torch.testing.assert_close(grad, want, **TIGHT)


@pytest.mark.compile
# cp2 is slow: tp2xcp2 compiles the same CP layout (2 CP ranks) with TP beside it
@pytest.mark.parametrize(("world", "tp"), [pytest.param(2, 1, marks=pytest.mark.slow), (4, 2)], ids=["cp2", "tp2xcp2"])
def test_prepare_loss_input_logprob_cp_compiles(world, tp):
    """LOGPROB with context parallelism under fullgraph=True (aot_eager): two sequence lengths on
    CP 2 (a recompile at most), one on TP 2 x CP 2 (4 ranks compiling on 2 cores: its second
    length, a second compile of every rank, adds nothing CP 2 does not check)."""
    for seq in (8, 16) if tp == 1 else (16,):
        gen = torch.Generator().manual_seed(seq)
        z = torch.randn(2, seq, 8, generator=gen, dtype=F64)
        ids = torch.randint(0, 8, (2, seq), generator=gen)
        zr = z.clone().requires_grad_()
        ref = reference.next_token_logprobs(zr, ids)
        ref.sum().backward()
        results = run_ranks(world, _logprob_cp_compiled_rank, tp, z, ids)
        for rank, (lp, grad, compiles) in enumerate(results):
            torch.testing.assert_close(lp, ref.detach(), **TIGHT)
            want = _tp_slice(shard_for_cp_rank(zr.grad, rank // tp, world // tp, seq_dim=1), rank % tp, tp)
            torch.testing.assert_close(grad, want, **TIGHT)
            assert compiles <= 2


def _logprob_cp_compiled_rank(rank, world, group, tp, z, ids):
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp)
    cp = world // tp
    local = _tp_slice(shard_for_cp_rank(z, cp_rank, cp, seq_dim=1), tp_rank, tp).clone().requires_grad_()
    loss_fn = SimpleNamespace(input_type="logprob")

    def step(logits, ids):
        out, _ = lossfx.prepare_loss_input(
            logits,
            {"input_ids": ids},
            loss_fn,
            vocab_parallel_rank=tp_rank if tp_group is not None else None,
            vocab_parallel_group=tp_group,
            context_parallel_group=cp_group,
        )
        return out["next_token_logprobs"]

    counter, fn = compiled_for_rank(rank, ("logprob-cp", world, tp), step, backend="aot_eager")
    lp = fn(local, ids)
    (lp.sum() / cp).backward()
    return lp.detach(), local.grad, counter.frame_count


# ---------------------------------------------------------------------------------------------
# Uneven shards, tensor cu_seqlens, a filter and a KL term on real gloo processes: one host read
# ---------------------------------------------------------------------------------------------

_PACKED_WIDTHS = (6, 5)  # V = 11: rank 0 alone would take R·Vl = 12


def _packed_uneven_case():
    gen = torch.Generator().manual_seed(21)
    z = torch.randn(1, 8, sum(_PACKED_WIDTHS), dtype=torch.float64, generator=gen)
    ids = torch.randint(0, sum(_PACKED_WIDTHS), (2, 5), generator=gen)
    return z, ids


def _packed_uneven_rank(rank, world, group, bad_id):
    from benchmarks.bench_syncs import count_host_reads

    z, ids = _packed_uneven_case()
    if bad_id:
        ids[1, 2] = sum(_PACKED_WIDTHS)  # scored; below 12, so only V of the check catches it
    start = sum(_PACKED_WIDTHS[:rank])
    local = z[..., start : start + _PACKED_WIDTHS[rank]]
    cu = torch.tensor([0, 5, 8])
    kl = SimpleNamespace(input_type="logprob", reference_policy_kl_penalty=0.1)
    data = {"input_ids": ids, "token_mask": torch.ones(2, 5)}
    sp = lossfx.TrainingSamplingParams(top_k=3)

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the -inf warning: filtered-out targets are expected
            return lossfx.prepare_packed_loss_input(local, dict(data), kl, cu, cu, rank, group, sampling_params=sp)

    if bad_id:
        try:
            call()
        except ValueError as exc:
            return str(exc)
        return None
    reads = count_host_reads(call)
    out, new_data = call()
    return reads, out["next_token_logprobs"], new_data["curr_logprobs_unfiltered"]


@pytest.mark.distributed
def test_gloo_uneven_packed_filter_with_kl_reads_once():
    """Tensor `cu_seqlens`, 6 + 5 vocabulary columns, top-k and a KL term on 2 gloo processes:
    the packed checks are read with the cross-rank check (one read per call, not 2), the results
    equal the float64 reference, and an id of 11 (inside rank 0's `R·Vl = 12`, outside `V = 11`)
    is named on every rank."""
    from harness import assert_every_rank_raises, gloo_pool

    z, ids = _packed_uneven_case()
    cu = (0, 5, 8)
    filtered = reference.packed_next_token_logprobs(z, ids, cu, cu, top_k=3)
    want = reference.mask_out_neg_inf_logprobs(filtered, torch.ones(2, 4))
    unfiltered = reference.packed_next_token_logprobs(z, ids, cu, cu)
    for reads, lp, lp_unfiltered in gloo_pool(2).run(_packed_uneven_rank, False):
        assert reads == 1
        torch.testing.assert_close(lp, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(lp_unfiltered, unfiltered, rtol=0, atol=1e-12)
    messages = gloo_pool(2).run(_packed_uneven_rank, True)
    assert_every_rank_raises(messages, ["data['input_ids'] must lie in [0, 11)", "values [11] at positions [[1, 2]]"])
