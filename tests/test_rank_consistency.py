"""Ranks that disagree get the same clear ValueError on every rank: never a hang, an abort or a
silently wrong answer (issue 10 items 4-6, `lossfx/_boundary/consistency.py`).

The mismatch cases run on a real gloo process pool (2 processes; 4 for the TP x CP grid). Each
rank catches its own ValueError and returns the message, then makes one consistent call on the
same group: the check leaves the collectives in step, so the pool is never restarted.
"""

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness import assert_every_rank_raises, gloo_pool, mesh_groups, thread_world, value_error

import lossfx
from lossfx import reference
from lossfx._boundary import consistency as _consistency
from lossfx.context_parallel import shard_for_cp_rank
from lossfx.next_token import LoadBalancedSharder

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("short_pool_timeout")]

F64 = torch.float64
LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
SECONDS = 20.0  # "within seconds": the slowest mismatch case must answer well inside this


def _logits(b, s, v, seed, dtype=F64):
    return torch.randn(b, s, v, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype) * 2


def _ids(b, s, high, seed):
    return torch.randint(0, high, (b, s), generator=torch.Generator().manual_seed(seed + 1))


def _call(case, rank, group):
    """This rank's side of a mismatch case: the same entry point, per-rank arguments."""
    tp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group}
    if case == "widths":  # issue item 4: widths 34 / 30 with the kernels' uniform default layout
        width, start = (34, 0) if rank == 0 else (30, 34)
        z = _logits(2, 6, 64, 0)[..., start : start + width]
        return lossfx.token_logprobs(z, _ids(2, 6, 60, 0), group=group)
    if case == "overlap":  # explicit but overlapping shards: [0, 34) and [30, 60)
        width, start = (34, 0) if rank == 0 else (30, 30)
        z = _logits(2, 6, 64, 0)[..., start : start + width]
        return lossfx.token_logprobs(z, _ids(2, 6, 60, 0), group=group, vocab_start=start, vocab_size=64)
    if case == "widths_distillation":  # equal shards needed: the top-k distillation path
        width, start = (34, 0) if rank == 0 else (30, 34)
        z = _logits(2, 6, 64, 0)[..., start : start + width]
        data = {
            "teacher_topk_logits": _logits(2, 6, 3, 1),
            "teacher_topk_indices": _ids(2, 6, 60, 2).unsqueeze(-1).expand(2, 6, 3).contiguous(),
        }
        loss_fn = SimpleNamespace(input_type="distillation", zero_outside_topk=False, kl_type="forward")
        return lossfx.prepare_loss_input(z, data, loss_fn, **tp)[0]["student_topk_logprobs"]
    if case == "topk_wider_than_uneven_shards":  # widths 3 / 7: k = 7 > world · 3
        start, width = (0, 3) if rank == 0 else (3, 7)
        return lossfx.vocab_topk(_logits(2, 6, 10, 0)[..., start : start + width], 7, group=group, vocab_start=start)
    z, ids = _logits(2, 6, 16, 0)[..., rank * 8 : (rank + 1) * 8], _ids(2, 6, 16, 0)
    sp = None
    if case == "sampling":  # issue item 5: rank 0 top_k=3, rank 1 no filter
        sp = lossfx.TrainingSamplingParams(top_k=3) if rank == 0 else None
    elif case == "top_k":  # item 6: top_k=5 against top_k=7
        sp = lossfx.TrainingSamplingParams(top_k=5 if rank == 0 else 7)
    elif case == "top_p":
        sp = lossfx.TrainingSamplingParams(top_p=0.9 if rank == 0 else 0.8)
    elif case == "batch":  # item 6: different B
        z, ids = z[: 2 - rank], ids[: 2 - rank]
    elif case == "seq":  # item 6: different S
        z, ids = z[:, : 6 - rank], ids[:, : 6 - rank]
    elif case == "dtype":  # item 6: fp32 on one rank, float64 on the other
        z = z.float() if rank == 0 else z
    elif case == "kernel":  # two kernels with different collectives
        return (lossfx.filtered_token_logprobs if rank == 0 else lossfx.token_logprobs)(
            z[:, :-1], ids[:, 1:], group=group, **({"top_k": 3} if rank == 0 else {})
        )
    return lossfx.prepare_loss_input(z, {"input_ids": ids}, LOGPROB, sampling_params=sp, **tp)[0]["next_token_logprobs"]


def _error_then_ok(rank, world, group, case):
    """`(message or None, seconds, a consistent call's result)` on this rank."""
    message, seconds = value_error(lambda: _call(case, rank, group))
    z = _logits(1, 4, 8, 5)[..., rank * 4 : (rank + 1) * 4]
    after = lossfx.token_logprobs(z, _ids(1, 4, 8, 5), group=group)  # the group is still in step
    return message, seconds, after


EXPECTED = {
    "widths": ["vocabulary size V (rank 0: 68, rank 1: 60", "widths rank 0: 34, rank 1: 30", "pass vocab_size"],
    "overlap": ["rank 0: [0, 34), rank 1: [30, 60)", "do not tile [0, 64)"],
    "widths_distillation": ["vocabulary shard width", "rank 0: 34, rank 1: 30", "equal shards"],
    "sampling": ["sampling_params (rank 0: a TrainingSamplingParams, rank 1: None)"],
    "top_k": ["sampling_params.top_k (rank 0: 5, rank 1: 7)"],
    "top_p": ["sampling_params.top_p (rank 0: 0.9, rank 1: 0.8)"],
    "batch": ["logits.shape[0] (rank 0: 2, rank 1: 1)"],
    "seq": ["logits.shape[1] (rank 0: 6, rank 1: 5)"],
    "dtype": ["logits.dtype (rank 0: torch.float32, rank 1: torch.float64)"],
    "topk_wider_than_uneven_shards": [
        "rank 0: 3, rank 1: 7",
        "this function needs k=7 <= world_size · the smallest width (6)",
    ],
    "kernel": ["the function called (rank 0: lossfx.filtered_token_logprobs, rank 1: lossfx.token_logprobs)"],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_gloo_mismatch_raises_on_every_rank(case):
    results = gloo_pool(2).run(_error_then_ok, case)
    messages = [m for m, _, _ in results]
    assert_every_rank_raises(messages, EXPECTED[case])
    assert max(s for _, s, _ in results) < SECONDS
    ref = reference.token_logprobs(_logits(1, 4, 8, 5), _ids(1, 4, 8, 5))
    for _, _, after in results:
        torch.testing.assert_close(after, ref, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Context parallelism: a CP-group mismatch, and a TP x CP grid where one TP group disagrees
# ---------------------------------------------------------------------------------------------


def _cp_mismatch(rank, world, group, layout):
    z, ids = _logits(2, 8, 6, 3), _ids(2, 8, 6, 3)
    local = shard_for_cp_rank(z, rank, world, seq_dim=1)
    sp = lossfx.TrainingSamplingParams(top_k=2 if rank == 0 else 3)
    cp = {"context_parallel_group": group} if layout == "group" else {"cp_sharder": LoadBalancedSharder(group)}
    return value_error(lambda: lossfx.prepare_loss_input(local, {"input_ids": ids}, LOGPROB, sampling_params=sp, **cp))[
        0
    ]


@pytest.mark.parametrize(("layout", "name"), [("group", "context_parallel_group"), ("sharder", "cp_sharder.cp_group")])
def test_gloo_context_parallel_mismatch(layout, name):
    messages = gloo_pool(2).run(_cp_mismatch, layout)
    assert messages[0] == messages[1]
    assert f"{name} disagree on sampling_params.top_k (rank 0: 2, rank 1: 3)" in messages[0]


def _grid_mismatch(rank, world, group):
    """TP=2 x CP=2; only ranks 0 and 1 (one TP group) disagree (on top_k)."""
    tp_group, tp_rank, cp_group, cp_rank = mesh_groups(rank, world, group, tp=2)
    z, ids = _logits(2, 8, 6, 4), _ids(2, 8, 6, 4)
    local = shard_for_cp_rank(z, cp_rank, 2, seq_dim=1)[..., tp_rank * 3 : (tp_rank + 1) * 3]
    sp = lossfx.TrainingSamplingParams(top_k=2 if rank == 0 else 3)
    groups = {"vocab_parallel_rank": tp_rank, "vocab_parallel_group": tp_group, "context_parallel_group": cp_group}
    return value_error(
        lambda: lossfx.prepare_loss_input(local, {"input_ids": ids}, LOGPROB, sampling_params=sp, **groups)
    )


@pytest.mark.xdist_group("gloo4")  # one 4-process pool per session (addopts: --dist loadgroup)
def test_gloo_tp_cp_grid_every_rank_raises():
    results = gloo_pool(4).run(_grid_mismatch)
    for rank, (message, seconds) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise"
        assert seconds < SECONDS
    # ranks 0 and 1 see it in their TP group; ranks 2 and 3 (whose TP group agrees) in their CP group
    assert results[0][0] == results[1][0]
    assert "vocab_parallel_group disagree on sampling_params.top_k (rank 0: 2, rank 1: 3)" in results[0][0]
    assert results[2][0] == results[0][0].replace("vocab_parallel_group", "context_parallel_group")
    assert "rank(s) [0] of context_parallel_group (size 2) found ranks of their vocab_parallel_group" in results[3][0]


# ---------------------------------------------------------------------------------------------
# Uneven vocabulary shards through the loss-input entry points (eager)
# ---------------------------------------------------------------------------------------------

WIDTHS = (34, 30)  # V = 64, the issue's case


def _uneven(rank, world, group, top_k, packed):
    start = sum(WIDTHS[:rank])
    z = _logits(2, 6, 64, 7)[..., start : start + WIDTHS[rank]].clone().requires_grad_()
    ids = _ids(2, 6, 64, 7)
    sp = None if top_k is None else lossfx.TrainingSamplingParams(top_k=top_k, top_p=0.9)
    tp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group, "sampling_params": sp}
    data = {"input_ids": ids, "token_mask": torch.ones(2, 6), "sample_mask": torch.ones(2)}  # required under a filter
    if packed:  # the two rows packed into one, cu_seqlens [0, 6, 12]
        flat = z.reshape(1, 12, -1)
        out, _ = lossfx.prepare_packed_loss_input(flat, data, LOGPROB, (0, 6, 12), (0, 6, 12), **tp)
    else:
        out, _ = lossfx.prepare_loss_input(z, data, LOGPROB, **tp)
    lp = out["next_token_logprobs"]
    lp.masked_fill(torch.isneginf(lp), 0.0).sum().backward()
    return lp.detach(), z.grad


@pytest.mark.parametrize(("top_k", "packed"), [(None, False), (5, False), (None, True)])
def test_gloo_uneven_widths_match_reference(top_k, packed):
    results = gloo_pool(2).run(_uneven, top_k, packed)
    z = _logits(2, 6, 64, 7).requires_grad_()
    ids = _ids(2, 6, 64, 7)
    if top_k is None:
        ref = reference.next_token_logprobs(z, ids)
    else:
        ref = reference.next_token_filtered_logprobs(z, ids, top_k, 0.9)
        ref = ref.masked_fill(torch.isneginf(ref), 0.0)
    ref.sum().backward()
    for out, _ in results:
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-10)
    grad = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(grad, z.grad, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Rank threads: one collective per entry call, nested calls unchecked, nothing under compile
# ---------------------------------------------------------------------------------------------


def _count_gathers(rank, world, group, counts):
    full = _logits(2, 6, 16, 0)
    # every scored id is its row's argmax, so the top-3 filter keeps it (no -inf warning)
    ids = torch.cat([torch.zeros_like(full[:, :1, 0], dtype=torch.long), full.argmax(-1)[:, :-1]], dim=1)
    z = full[..., rank * 8 : (rank + 1) * 8]
    sp = lossfx.TrainingSamplingParams(top_k=3)
    loss_fn = SimpleNamespace(input_type="logprob", reference_policy_kl_penalty=0.1)
    data = {"input_ids": ids, "token_mask": torch.ones(2, 6)}  # token_mask: required under a filter
    before = counts[rank]
    lossfx.prepare_loss_input(z, data, loss_fn, rank, group, sampling_params=sp)
    return counts[rank] - before


def test_one_signature_gather_per_entry_call(monkeypatch):
    counts = [0, 0]
    gather = _consistency._gather_on_device

    def counting(sig, group):
        counts[group.rank()] += 1
        return gather(sig, group)

    monkeypatch.setattr(_consistency, "_gather_on_device", counting)
    # prepare_loss_input -> next_token_logprobs (twice: filtered and unfiltered) -> target_logprobs
    # -> filtered_token_logprobs / token_logprobs: one check for all of them
    assert thread_world(2).run(_count_gathers, counts) == [1, 1]


def _ops_after_gather(rank, world, group, ops):
    z, ids = _logits(2, 3, 8, 6)[..., rank * 4 : (rank + 1) * 4], _ids(2, 3, 8, 6)
    before = len(ops[rank])
    lossfx.token_logprobs(z, ids, group=group)  # vocab="tiled": the most layout rules
    return ops[rank][before:]


def test_eager_check_judges_the_host_copy(monkeypatch):
    """Eagerly the check runs no op on the gathered signatures before the call's one host read:
    the read carries the gathered matrix, and the judgement (`_judged`) runs on the host copy (on a
    GPU, no launches); the ranks still agree (every call below passes the check)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self, seen):
            super().__init__()
            self.seen = seen

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    ops, modes = [[], []], {}
    gather, check = _consistency._gather_on_device, _consistency._check

    def gathering(sig, group):
        out = gather(sig, group)
        modes[group.rank()] = Ops(ops[group.rank()]).__enter__()  # counts until the check returns
        return out

    def checking(name, arguments, *args, **kwargs):
        try:
            return check(name, arguments, *args, **kwargs)
        finally:
            group = arguments["group"]
            modes.pop(group.rank()).__exit__(None, None, None)

    monkeypatch.setattr(_consistency, "_gather_on_device", gathering)
    monkeypatch.setattr(_consistency, "_check", checking)
    assert thread_world(2).run(_ops_after_gather, ops) == [[], []]


def _thread_batch_mismatch(rank, world, group):
    return value_error(lambda: _call("batch", rank, group))[0]


def test_rank_threads_mismatch():
    messages = thread_world(2).run(_thread_batch_mismatch)
    assert messages[0] == messages[1] and "logits.shape[0] (rank 0: 2, rank 1: 1)" in messages[0]


def _compiled_step(rank, world, group):
    from harness import compiled_for_rank

    def step(z, ids):
        return lossfx.token_logprobs(z, ids, group=group).sum()

    counter, compiled = compiled_for_rank(rank, "consistency", step, backend="eager")
    z, ids = _logits(2, 3, 8, 6)[..., rank * 4 : (rank + 1) * 4], _ids(2, 3, 8, 6)
    return compiled(z, ids), counter.frame_count


@pytest.mark.compile
def test_no_graph_break_under_compile(monkeypatch):
    def fail(sig, group):
        raise AssertionError("the signature gather ran inside compiled code")

    monkeypatch.setattr(_consistency, "_gather_on_device", fail)
    results = thread_world(2).run(_compiled_step)  # fullgraph=True: a graph break would raise
    ref = reference.token_logprobs(_logits(2, 3, 8, 6), _ids(2, 3, 8, 6)).sum()
    for value, frames in results:
        torch.testing.assert_close(value, ref, rtol=0, atol=1e-10)
        assert frames == 1


def test_every_checked_function_has_its_own_name():
    """The signature codes the function called by its name (`_consistency.boundary`): two checked
    functions of one name would pass for each other and be reported under one name (the layout
    pipeline in `next_token` was also called `next_token_logprobs`, like the public function)."""
    seen: dict[str, str] = {}
    for path in sorted(Path(lossfx.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
            if isinstance(node, ast.FunctionDef) and any(d.startswith("boundary") for d in decorators):
                assert node.name not in seen, f"{node.name} is checked in {seen[node.name]} and in {path.name}"
                seen[node.name] = path.name
    assert {"next_token_logprobs", "sharded_next_token_logprobs", "prepare_loss_input"} <= set(seen)


def test_signature_is_by_value_and_fixed_length():
    """An enum and its value agree; shapes and scalars are encoded; the length never changes."""
    as_enum = {"loss_fn": SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB), "logits": torch.zeros(2, 3, 5)}
    as_str = {"loss_fn": SimpleNamespace(input_type="logprob"), "logits": torch.zeros(2, 3, 7)}
    roles = _consistency.Roles(shards=("logits",), attrs=("loss_fn", ("input_type",)))  # as prepare_loss_input
    sig_enum, fields = _consistency._signature("prepare_loss_input", as_enum, roles=roles)
    sig_str, _ = _consistency._signature("prepare_loss_input", as_str, roles=roles)
    assert sig_enum.shape == sig_str.shape == (_consistency.SIGNATURE_LEN,)
    body = slice(_consistency._HEADER, None)
    assert torch.equal(sig_enum[body], sig_str[body])  # the shard width (5 vs 7) is per rank: header only
    assert "logits.shape[1]" in fields.labels and "loss_fn.input_type" in fields.labels
    many = {f"x{i}": i for i in range(500)}  # past the field budget: a digest, same length
    sig_many, _ = _consistency._signature("f", many)
    assert sig_many.shape == (_consistency.SIGNATURE_LEN,)


def _breaks_layout(sigs: list[list[int]], policy: str) -> bool:
    """The layout rules read densely (independent of `_layout_flags`): the ranks' spans must hold
    every id of `[0, V)` exactly once (after the width, top-k and size rules of `policy`)."""
    C = _consistency
    world, widths = len(sigs), [s[C._H_WIDTH] for s in sigs]
    if policy in ("free", "auto") or C._NONE in widths:
        return False
    if policy == "equal":
        return len(set(widths)) > 1
    sizes = [world * w if s[C._H_SIZE] == C._NONE else s[C._H_SIZE] for s, w in zip(sigs, widths, strict=True)]
    if policy.startswith("topk:"):
        if len({min(int(policy[5:]), world * w) for w in widths}) > 1:
            return True
        policy, sizes = "tiled", [sum(widths)] * world
    if len(set(sizes)) > 1:
        return True
    if policy == "sized":
        return sum(widths) != sizes[0]
    starts = [r * w if s[C._H_START] == C._NONE else s[C._H_START] for r, (s, w) in enumerate(zip(sigs, widths))]
    return sorted(i for a, w in zip(starts, widths, strict=True) for i in range(a, a + w)) != list(range(sizes[0]))


def _finding(rows: list[list[int]], fields, across_tp: bool, policy: str = "free"):
    """What the check finds in the gathered signatures `rows` (rank 0's view): the one judgement
    (`_judged`, which eager and compiled calls share) worded as an eager call words it: `(label,
    rank 0's value)`, the layout's message, or None."""
    C = _consistency
    _, how = C._assertions(tuple(fields.owners), tuple(fields.tp_only), across_tp, policy, "")
    failed, rules = C._judged(torch.tensor(rows), how)
    if not failed.any():
        return None
    found = C._worded(failed.tolist().index(True), how[0], rows, rows[0], fields, C._NO_ROLES)
    return found or C._tiling_error(*(t.tolist() for t in rules), policy)


@pytest.mark.parametrize("policy", ["free", "auto", "equal", "sized", "tiled", "topk:5", "topk:40"])
def test_one_judgement_of_fields_and_layout(policy):
    """The check decides once (`_judged`, tensor ops: eagerly on the host copy of the gathered
    signatures, on the device for the TP verdict, and in the compiled graph); the TP verdict that
    travels to the CP peers is that decision. Against a dense reading: it fails exactly when a
    field differs or the layout breaks `policy` (`_layout_flags`, against `_breaks_layout`), and
    a differing field is named before a broken layout."""
    C = _consistency
    gen = torch.Generator().manual_seed(len(policy))
    base, fields = C._signature("f", {"x": torch.ones(3), "k": 4})
    cases = 0
    for world in (2, 3):
        for _ in range(150):
            g = base.repeat(world, 1)
            widths = torch.randint(0, 4, (world,), generator=gen) * 3 + 1
            g[:, C._H_WIDTH] = widths
            if torch.rand(1, generator=gen) < 0.1:
                g[0, C._H_WIDTH] = C._NONE
            if torch.rand(1, generator=gen) < 0.5:  # explicit starts: the tiling, a gap or an overlap
                starts = torch.cumsum(widths, 0) - widths
                starts[torch.randint(0, world, (1,), generator=gen)] += int(torch.randint(-1, 2, (1,), generator=gen))
                g[:, C._H_START] = starts
            if torch.rand(1, generator=gen) < 0.5:
                g[:, C._H_SIZE] = int(widths.sum()) + int(torch.randint(-1, 2, (1,), generator=gen))
            field = bool(torch.rand(1, generator=gen) < 0.2)
            if field:  # a field disagrees
                g[-1, C._HEADER + 3] += 1
            sigs = g.tolist()
            tiling = None
            if policy not in ("free", "auto"):  # (the rules of a layout that has some)
                broken, spans = C._layout_flags(g, policy)
                tiling = C._tiling_error(broken.tolist(), spans.tolist(), policy) if broken.any() else None
            assert (tiling is not None) == _breaks_layout(sigs, policy), sigs
            found = _finding(sigs, fields, True, policy)
            assert (found is not None) == (field or tiling is not None), (policy, sigs[0][:10], [s[:10] for s in sigs])
            if field:
                assert found == (fields.labels[1], _consistency._show(fields.shown[1])), found
            elif tiling is not None:
                assert found == tiling
            cases += found is not None
    assert 0 < cases < 300 or policy in ("free", "auto")  # both outcomes were exercised


def test_boundary_roles_must_name_parameters_and_groups():
    """A typo in a declared role, or a function with collectives that declares no group (it would
    never be checked), fails when the function is defined, not silently at run time."""
    with pytest.raises(TypeError, match=r"names no parameter of it: \['logit'\]"):
        _consistency.boundary(roles=_consistency.Roles(tp="group", shards=("logit",)))(lambda logits, group: None)
    with pytest.raises(TypeError, match=r"declare its groups"):
        _consistency.boundary(vocab="tiled")(lambda logits, group: None)
    _consistency.boundary(collectives=False)(lambda logits: None)  # no collective: no group needed


def test_cp_shards_are_compared_across_tensor_parallel_only():
    """A tensor argument declared `Roles.cp_shards` is this CP rank's sequence part: its values may
    differ across the context-parallel group but not across the tensor-parallel one; a key of a
    mapping declared `Roles.shard_columns` (DRAFT's `student_logits`: a draft-vocabulary shard, and
    a sequence part) is compared in neither (nor is its last dim); every other replicated tensor
    must agree across both groups."""
    C = _consistency
    roles = C.Roles(cp_shards=("x",), shard_columns=("part",))

    def sigs(x: float, data_part: float, ids: int, width: int = 3) -> tuple[list[list[int]], C._Fields]:
        rows = []
        for rank in range(2):
            args = {
                "x": torch.full((2, 3), x if rank else 0.0),
                "data": {
                    "part": torch.full((2, width if rank else 3), data_part if rank else 0.0),
                    "ids": torch.full((2,), ids if rank else 0),
                },
            }
            sig, fields = C._signature("f", args, roles=roles)
            rows.append(sig.tolist())
        return rows, fields

    for x, part, ids, width, across_cp in [
        (0.0, 0.0, 0, 3, None),
        (1.0, 0.0, 0, 3, None),
        (0.0, 1.0, 0, 3, None),
        (0.0, 1.0, 0, 2, None),
        (0.0, 0.0, 1, 3, "ids"),
    ]:
        rows, fields = sigs(x, part, ids, width)
        cp, tp = _finding(rows, fields, across_tp=False), _finding(rows, fields, across_tp=True)
        assert (cp is None) == (across_cp is None) and (cp is None or across_cp in cp[0]), (x, part, ids, cp)
        assert (tp is not None) == bool(x or ids), (x, part, ids, tp)
        if x:
            assert tp is not None and tp[0].startswith("the values of x")


def _inductor_code_of_a_checked_call(rank, world, group, top_k):
    """Rank 0's Inductor wrapper code of a compiled `prepare_loss_input(LOGPROB)` over the group
    (top-k filtered when `top_k`), and rank 0's log-probs."""
    from torch._inductor.utils import run_and_get_code

    sampling = lossfx.TrainingSamplingParams(top_k=top_k) if top_k else None
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)

    def step(z, ids):
        data = {"input_ids": ids, "token_mask": torch.ones(ids.shape)}
        kw = {"vocab_parallel_rank": rank, "vocab_parallel_group": group, "sampling_params": sampling}
        return lossfx.prepare_loss_input(z, data, loss_fn, **kw)[0]["next_token_logprobs"]

    z, ids = _logits(2, 5, 64, 7, dtype=torch.float32), _ids(2, 5, 64, 7)
    width = 64 // world
    out, code = run_and_get_code(torch.compile(step, fullgraph=True), z[..., rank * width : (rank + 1) * width], ids)
    return out, code[0] if rank == 0 else None


def _calls(code: str) -> list[str]:
    """The wrapper's calls (kernels, extern ops, collectives), in the order it makes them."""
    return [line.strip() for line in code.splitlines() if line.startswith("        ") and "(" in line]


@pytest.mark.compile
@pytest.mark.parametrize("top_k", [None, 5])
def test_compiled_check_precedes_the_kernels_first_collective(top_k):
    """Safety, in the code Inductor generates: the check's all-gather is issued first, and its
    assertions (`lossfx::assert_agreement`, after the wait) come before the kernel's own first
    all-gather, which reads their token (`settle_before`): no compiler order can run a collective
    whose size may differ first. Overlap, where the kernel starts with an extern op (the top-k
    filter's `topk`): that op runs between the check's all-gather and its wait, so the round trip
    flies meanwhile. (A fused first pass may be fused into the fingerprint's kernel, ahead of the
    all-gather: no overlap then, and no loss.) Values checked against the float64 reference."""
    (out, code), _ = gloo_pool(2).run(_inductor_code_of_a_checked_call, top_k)
    ids = _ids(2, 5, 64, 7)
    ref = reference.next_token_filtered_logprobs(_logits(2, 5, 64, 7), ids, top_k=top_k)
    ref = ref.masked_fill(ref.isneginf(), 0.0)  # prepare_loss_input's filtered-out targets read 0
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)  # fp32 over 64 columns
    calls = _calls(code)

    def first(pred, after: int = -1) -> int:
        return next(i for i, line in enumerate(calls) if i > after and pred(line))

    check_gather = first(lambda s: "all_gather_into_tensor.default(" in s)
    wait = first(lambda s: "wait_tensor.default(" in s)
    asserts = first(lambda s: "lossfx.assert_agreement.default(" in s)
    kernel_gather = first(lambda s: "all_gather_into_tensor.default(" in s, after=check_gather)
    assert check_gather < wait < asserts < kernel_gather, calls
    if top_k:
        assert check_gather < first(lambda s: "aten.topk.default(" in s) < wait, calls


def _objective_chunk_mismatch_compiled(rank, world, group):
    """`linear_logprob_objective` compiled with a different `chunk_size` per rank: its collectives
    run inside an opaque op, which the deferred in-graph check must precede."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(2, 8, 16, generator=gen, dtype=F64), torch.randn(32, 16, generator=gen, dtype=F64)
    ids, coef = torch.randint(0, 32, (2, 8), generator=gen), torch.randn(2, 8, generator=gen, dtype=F64)
    rows = weight[rank * 16 : (rank + 1) * 16].clone().requires_grad_()

    def step(h, w):
        return lossfx.linear_logprob_objective(h, w, ids, coef, group=group, chunk_size=4 + 4 * rank)[0]

    try:
        torch.compile(step, fullgraph=True, backend="aot_eager")(hidden.clone().requires_grad_(), rows)
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.compile
def test_compiled_check_precedes_an_opaque_ops_collectives():
    messages = gloo_pool(2).run(_objective_chunk_mismatch_compiled)
    assert_every_rank_raises(messages, ["lossfx.linear_logprob_objective", "disagree on chunk_size"])


# a config of 300 fields (a dataclass: the check compares its fields; of another object only the attributes
# the call reads, `Roles.attrs`)
_Config300 = dataclasses.make_dataclass("_Config300", [f"option_{i:03d}" for i in range(300)])


@pytest.mark.slow  # ~45 s (a 300-field config traced twice); the default run has the adversarial nemo cases
@pytest.mark.compile
def test_every_field_past_the_body_is_compared_eager_and_compiled():
    """Issue 25: fields past the first 122 (a loss config with 300 options, tensors after them)
    are compared through two digests computed on the device, eagerly and in a compiled graph (they
    were not compared at all under compile: ranks whose `top_p` differed returned different
    answers): any one changed field changes the digest compared across every group; the values of
    a sequence shard (`Roles.cp_shards`) only the one compared across the tensor-parallel group."""
    C = _consistency
    roles = C.Roles(cp_shards=("x",))

    def signature(cfg, x, ids):
        return C._signature("f", {"cfg": cfg, "ids": ids, "x": x}, roles=roles)[0]

    options, x, ids = [0.5] * 300, torch.zeros(2, 3), torch.arange(4)
    compiled = torch.compile(signature, fullgraph=True, backend="aot_eager")
    for fn in (signature, compiled):

        def sig(options, x, ids, fn=fn):
            return fn(_Config300(*options), x, ids)

        base = sig(options, x, ids)
        for i in (130, 299) if fn is signature else (299,):  # a float far past the body (each a recompile)
            changed = sig([*options[:i], 0.25, *options[i + 1 :]], x, ids)
            assert changed[C._H_DIGEST] != base[C._H_DIGEST] and changed[C._H_VALUES] != base[C._H_VALUES], i
        changed = sig(options, x, ids.flip(0))  # a canonical tensor's values: both digests
        assert changed[C._H_DIGEST] != base[C._H_DIGEST] and changed[C._H_VALUES] != base[C._H_VALUES]
        changed = sig(options, x + 1, ids)  # a sequence shard's values: across TP only
        assert changed[C._H_DIGEST] == base[C._H_DIGEST] and changed[C._H_VALUES] != base[C._H_VALUES]
    cfg = _Config300(*options)
    eager, traced = signature(cfg, x, ids), compiled(cfg, x, ids)
    assert traced[C._H_TRACED] == 1 and eager[C._H_TRACED] == 0
    traced[C._H_TRACED] = 0
    assert torch.equal(eager, traced)  # the same signature, compiled or not
