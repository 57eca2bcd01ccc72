"""The host-read budget (issue 15): at most one device→host read per public call with the checks
on, eager, on 1 and 2 gloo ranks; none in a compiled graph. Counted with a `TorchDispatchMode`
(`benchmarks/bench_syncs.py`: `_local_scalar_dense`, `is_nonzero`, `item`, `nonzero`, `equal`,
and `Tensor.tolist`). The read-once collector (`lossfx/_core/host_reads.py`) keeps every check's
error: a deferred check still raises its own ValueError, in a nested call too.
"""

import contextlib
import inspect
import threading
from types import SimpleNamespace

import harness
import pytest
import torch
from harness import gloo_pool

import lossfx
from benchmarks.bench_syncs import compiled_host_reads, count_host_reads, entry_points
from lossfx import reference
from lossfx._boundary import consistency as _consistency
from lossfx._core import host_reads as _host_reads

NOT_CALLED = {"need_top_k_or_top_p_filtering", "chunk_policy"}  # take no tensor


def _public_functions_taking_tensors():
    functions = {name: getattr(lossfx, name) for name in lossfx.__all__ if name not in NOT_CALLED}
    return {name for name, obj in functions.items() if callable(obj) and not inspect.isclass(obj)}


@pytest.mark.compile
@pytest.mark.cpu_only("its calls come from benchmarks.bench_syncs.entry_points, which builds its inputs on the CPU")
def test_every_public_entry_point_reads_at_most_once():
    """One rank: every public function reads at most once eagerly; compiled graphs read nothing."""
    calls = entry_points(0, 1, None, every=True)
    calls["shard_for_cp_rank"] = lambda: lossfx.shard_for_cp_rank(torch.randn(2, 8, 3), 0, 1)
    calls["unshard"] = lambda: lossfx.unshard([torch.randn(2, 8, 3)])
    covered = {name.split(" ")[0].rstrip(",") for name in calls}
    assert _public_functions_taking_tensors() <= covered, _public_functions_taking_tensors() - covered
    counts = {}
    for name, call in calls.items():
        call()  # warm-up: lazy imports, first-call caches
        counts[name] = count_host_reads(call)
    assert {name: n for name, n in counts.items() if n > 1} == {}
    # the range checks read: a call that checks ids reads exactly once
    assert counts["token_logprobs"] == counts["prepare_loss_input LOGPROB top-k + KL"] == 1
    assert counts["linear_logprob_objective, ignored targets + backward"] == 1
    for name in ("token_logprobs", "linear_token_logprobs, ignored targets"):
        assert compiled_host_reads(calls[name]) == 0, name


_SORTED = ('filtered_token_logprobs top-p, ties="sorted"', 'top_k_top_p_threshold top-k + top-p, ties="sorted"')
_COMPILED = ("prepare_loss_input LOGPROB top-k + KL", "linear_logprob_objective", *_SORTED)


def _two_ranks(rank, world, group):
    """`(eager reads of each entry point, compiled reads of `_COMPILED`, the eager cross-rank
    check's own reads, {`_SORTED` name: rows whose tie group top-p cuts})` on this rank."""
    calls = entry_points(rank, world, group)
    eager = {}
    for name, call in calls.items():
        call()  # warm-up
        eager[name] = count_host_reads(call)
    fused = {"hidden": torch.ones(6, 4), "weight": torch.ones(6, 4), "target": torch.arange(6), "group": group}
    roles = lossfx.linear_token_logprobs._lossfx_roles
    check = count_host_reads(lambda: _consistency._check("linear_token_logprobs", fused, "free", roles))
    z = torch.randn(2, 8, 16 * world, generator=torch.Generator().manual_seed(0)).round()  # the tied logits, whole
    cut = {}
    for name in _SORTED:
        top_k = 6 if name.startswith("top_k") else None
        sorted_kept = reference.apply_top_k_top_p(z, top_k, 0.5, "sorted")[1].sum(-1)
        cut[name] = int((sorted_kept < reference.apply_top_k_top_p(z, top_k, 0.5)[1].sum(-1)).sum())
    return eager, {name: compiled_host_reads(calls[name]) for name in _COMPILED}, check, cut


@pytest.mark.compile
def test_two_gloo_ranks_read_once(monkeypatch):
    """On 2 gloo ranks, each entry point reads once eagerly: the cross-rank check's gathered
    signatures (the check alone: one read, fingerprints included), the range checks (against the
    vocabulary size the check reports), the packed `cu_seqlens` checks and the fused functions'
    count of active rows share one read, taken before the call's first collective; the -inf
    warning's count (filtered rows) is copied to the host without a read
    (`_host_reads.when_landed`). Compiled graphs (the check in the graph) read nothing. Top-p with
    `ties="sorted"` (calls where it cuts tie groups): its id cut needs no host value (it read
    whether a tie is cut, a second read after the filter's collectives, then ran an id bisection)."""
    monkeypatch.setattr(harness, "_TIMEOUT_S", 300.0)
    for eager, compiled, check, cut in gloo_pool(2).run(_two_ranks):
        assert eager == dict.fromkeys(eager, 1)
        assert set(_SORTED) <= set(eager)
        assert compiled == dict.fromkeys(_COMPILED, 0)
        assert check == 1
        assert min(cut.values()) >= 4, cut


def test_deferred_range_check_raises_from_a_nested_call():
    """`token_logprobs` checks through the public `token_logprobs_with_lse` it calls."""
    logits = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"target must lie in \[0, 5\); 1 entries do not, e\.g\. values \[7\]"):
        lossfx.token_logprobs(logits, torch.tensor([1, 2, 7]))
    good = torch.tensor([1, 2, 4])
    torch.testing.assert_close(lossfx.token_logprobs(logits, good), reference.token_logprobs(logits, good))


def test_fused_ignored_rows_match_the_reference_with_one_read():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, generator=gen)
    target = torch.tensor([1, -100, 8, 0, -100, -100, 5])
    keep = target != -100

    def call():
        return lossfx.linear_token_logprobs(hidden, weight, target, chunk_size=2)

    assert count_host_reads(call) == 1
    out = call()
    out.sum().backward()
    zh = hidden.detach().clone().requires_grad_()
    ref = reference.token_logprobs(zh @ weight.T, target.clamp(min=0))
    ref = torch.where(keep, ref, torch.zeros_like(ref))
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, zh.grad, rtol=0, atol=1e-12)
    assert bool((hidden.grad[~keep] == 0).all())


def test_collector_reads_once_and_runs_handlers_in_order():
    seen = []
    with _host_reads.outermost():
        _host_reads.defer(torch.tensor([3, 4]), seen.append)
        _host_reads.defer(torch.tensor(True), seen.append)
        assert seen == []
        assert _host_reads.read_now(torch.tensor(5)) == [5]
        assert seen == [[3, 4], [1]]
        _host_reads.defer(torch.tensor(6), seen.append)  # waits for the next settle (here: the exit)
        assert seen[-1] == [1]
    assert seen[-1] == [6]
    _host_reads.defer(torch.tensor(7), seen.append)  # outside a call: at once
    assert seen[-1] == [7]


class _Event:
    """A device event that completes when told to (the copy in flight of `when_landed`)."""

    def __init__(self):
        self.done, self.waited = False, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True


def test_a_landed_report_runs_without_a_read_and_in_order(monkeypatch):
    """`when_landed`: CPU values are on the host, the handler runs at once with no counted read;
    a copy in flight (a GPU's, its event not complete) waits for a poll that finds it landed, at
    the latest the next public call's entry, and never blocks unless asked to (`wait`)."""
    seen = []
    assert count_host_reads(lambda: _host_reads.when_landed(torch.tensor([2, 9]), seen.append)) == 0
    assert seen == [[2, 9]]
    first, second = _Event(), _Event()
    monkeypatch.setattr(_host_reads._state, "landing", [(torch.tensor([1]), first, seen.append)])
    _host_reads.when_landed(torch.tensor(3), seen.append)  # queued behind the copy in flight
    _host_reads.poll()
    assert seen == [[2, 9]]
    first.done = True
    with _host_reads.outermost():  # the next public call polls on entry
        assert seen == [[2, 9], [1], [3]]
    _host_reads._state.landing.append((torch.tensor([4]), second, seen.append))
    _host_reads.poll(wait=True)
    assert second.waited and seen[-1] == [4]


def test_a_report_still_in_flight_at_exit_is_shown_then(monkeypatch):
    """A copy in flight when the program ends (no later lossfx call polls it) runs at exit."""
    seen, event = [], _Event()
    monkeypatch.setattr(_host_reads._state, "landing", [(torch.tensor([7]), event, seen.append)])
    _host_reads._poll_at_exit()
    assert event.waited and seen == [[7]]


def test_the_neg_inf_warning_names_the_callers_line():
    lp, mask = torch.tensor([[-1.0, float("-inf"), -2.0]]), torch.ones(1, 3)
    with pytest.warns(UserWarning, match="1/3 valid tokens have -inf in logprobs") as record:
        out = lossfx.mask_out_neg_inf_logprobs(lp, mask)
    assert record[0].filename == __file__
    torch.testing.assert_close(out, reference.mask_out_neg_inf_logprobs(lp, mask).float())


def test_a_deferred_error_replaces_the_error_it_provoked():
    def fail(values):
        raise ValueError(f"the check's error {values}")

    with pytest.raises(ValueError, match=r"the check's error \[1\]"):
        with _host_reads.outermost():
            _host_reads.defer(torch.tensor(1), fail)
            raise RuntimeError("index out of range, caused by the bad input")


# ---------------------------------------------------------------------------------------------
# Another thread compiling: torch's is_compiling() flag is process-wide, `tracing()` is not
# ---------------------------------------------------------------------------------------------

_V_UNEVEN = 11  # two rank threads hold 6 + 5 vocabulary columns: the layout is read from the check


def _uneven_logprobs(rank, world, group, z, ids):
    lo, hi = (0, 6) if rank == 0 else (6, _V_UNEVEN)
    loss_fn = type("LossFn", (), {"input_type": "logprob"})()
    out, _ = lossfx.prepare_loss_input(z[..., lo:hi], {"input_ids": ids}, loss_fn, rank, group)
    return out["next_token_logprobs"], _host_reads.tracing(), torch.compiler.is_compiling()


@contextlib.contextmanager
def _compiling_in_another_thread():
    """A real `torch.compile` in a background thread, held inside its backend (so inside Dynamo's
    compile session) for the duration of the block."""
    started, release = threading.Event(), threading.Event()

    def blocking_backend(gm, example_inputs):
        started.set()
        release.wait(timeout=120)
        return gm.forward

    def compile_in_background():
        torch.compile(lambda x: x + 1, backend=blocking_backend, fullgraph=True)(torch.ones(2))

    thread = threading.Thread(target=compile_in_background, daemon=True)
    thread.start()
    try:
        assert started.wait(timeout=120), "the background compile did not reach its backend"
        assert torch.compiler.is_compiling(), "torch's flag is no longer process-wide: the scenario is not exercised"
        yield
    finally:
        release.set()
        thread.join(timeout=120)


def test_eager_calls_beside_a_compiling_thread_are_eager():
    """While one thread is inside `torch.compile` (its backend blocks), torch's `is_compiling()`
    is True in every thread. Eager calls in other threads took the traced branches: log-probs off
    by 2.5 nats with uneven shards (the uniform layout assumed), other chunks than their peers.
    Now they are exact; `_host_reads.tracing()` is False there."""
    gen = torch.Generator().manual_seed(15)
    z = torch.randn(2, 5, _V_UNEVEN, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, _V_UNEVEN, (2, 5), generator=gen)
    want = reference.next_token_logprobs(z, ids)
    with _compiling_in_another_thread():
        results = harness.run_ranks(2, _uneven_logprobs, z, ids)
    for lp, tracing, flag in results:
        assert flag
        assert not tracing
        torch.testing.assert_close(lp, want, rtol=0, atol=1e-12)


@_consistency.boundary(collectives=False)
def _probe_nesting(x):
    return _consistency._traced_depth[0], x


def test_an_eager_call_beside_a_compiling_thread_leaves_the_trace_state_alone():
    """The test_packing tp2xcp2 flake: a rank thread ran an eager public function
    (`shard_for_cp_rank`) while another rank thread was compiling; the process-wide flag sent it
    down the traced path, which really set the module-global nesting counter `_traced_depth` to 1
    while it ran, and a rank tracing at that moment read 1 and traced its entry point as nested:
    a graph without the cross-rank check, whose kernel all-gather then met its peer's signature
    all-gather. Eager calls no longer touch the counter."""
    with _compiling_in_another_thread():
        depth, _ = _probe_nesting(torch.ones(1))
    assert depth == 0


# ---------------------------------------------------------------------------------------------
# The hidden-state front door with uneven plain head shards on 2 gloo ranks: the check's widths
# and the fused kernel's count of active rows in one read (it was two: the widths, then the count)
# ---------------------------------------------------------------------------------------------

_HEAD_ROWS = (10, 6)  # rank 0 holds head rows [0, 10), rank 1 rows [10, 16): widths from the check


def _front_door_calls(hidden, weight, ids, teacher_ids, tp):
    """`{name: call}`: each front-door branch that runs the fused kernel (ids with some `-100`:
    rows the kernel skips) on `weight`, this rank's head rows with `tp`, else the whole head."""
    logprob = SimpleNamespace(input_type="logprob")
    kl = SimpleNamespace(input_type="logprob", reference_policy_kl_penalty=0.1)
    distill = SimpleNamespace(input_type="distillation", zero_outside_topk=True, kl_type="mixed")
    teacher = {
        "teacher_topk_logits": torch.ones(teacher_ids.shape, dtype=hidden.dtype),
        "teacher_topk_indices": teacher_ids,
    }
    top_k = lossfx.TrainingSamplingParams(top_k=5)
    cu = torch.tensor([0, 4, 7])  # two packed sequences of 4 and 3 tokens
    opd_cfg = SimpleNamespace(teacher_payload="logits", validate_decomposition=True)
    opd = SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=opd_cfg, reference_policy_kl_penalty=0.1)
    payload = torch.linspace(-2, 2, ids.numel() * 16, dtype=hidden.dtype).reshape(*ids.shape, 16)  # replicated
    return {
        "LOGPROB": lambda: lossfx.prepare_linear_loss_input(hidden, weight, {"input_ids": ids}, logprob, **tp),
        "LOGPROB top-k + KL": lambda: lossfx.prepare_linear_loss_input(
            hidden, weight, {"input_ids": ids, "token_mask": torch.ones(ids.shape)}, kl, sampling_params=top_k, **tp
        ),
        "DISTILLATION": lambda: lossfx.prepare_linear_loss_input(
            hidden, weight, {"input_ids": ids, **teacher}, distill, **tp
        ),
        # its reference-KL log-probs' rows: each sequence's last position skipped (ids in range: it checks them)
        "OPD_FULL + KL, teacher logits": lambda: lossfx.prepare_linear_loss_input(
            hidden, weight, {"input_ids": ids.clamp(min=0), "teacher_full_logits": payload}, opd, **tp
        ),
        "packed (no ignored ids: the packed rows reject them)": lambda: lossfx.prepare_linear_packed_loss_input(
            hidden[:1], weight, {"input_ids": ids[:, :4].clamp(min=0)}, logprob, cu, cu, **tp
        ),
    }


def _front_door_uneven_calls(rank, group):
    """(this rank's `_front_door_calls` with its rows of the uneven head, the whole head's on one rank)."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, 4, dtype=torch.float64, generator=gen)
    weight = torch.randn(sum(_HEAD_ROWS), 4, dtype=torch.float64, generator=gen)
    ids = torch.randint(0, sum(_HEAD_ROWS), (2, 7), generator=gen)
    ids[0, 2] = ids[1, 5] = ids[1, 6] = -100  # ignored: the kernel's active rows are fewer than its rows
    teacher_ids = torch.randint(0, sum(_HEAD_ROWS), (2, 7, 2), generator=gen)
    lo = sum(_HEAD_ROWS[:rank])
    tp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group}
    calls = _front_door_calls(hidden, weight[lo : lo + _HEAD_ROWS[rank]], ids, teacher_ids, tp)
    return calls, _front_door_calls(hidden, weight, ids, teacher_ids, {})


def _front_door_uneven(rank, world, group):
    """`{branch: (reads off, reads on, largest difference on vs off, (with `defer_active_rows`
    deferring its count - 1, a front door that lays out other targets than the kernel's) largest
    difference off and the error on, largest difference off vs the whole head's on one rank)}`:
    `LOSSFX_DISTRIBUTED_DEBUG` off, then on (the kernel also reads its own count)."""
    from lossfx._boundary import debug
    from lossfx._kernels import fused_linear

    def one_too_few(ids, ignore_index, into):
        _host_reads.defer((ids != ignore_index).any(dim=-1).sum() - 1, into.extend)

    def largest_difference(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    calls, whole = _front_door_uneven_calls(rank, group)
    out = {}
    for name, call in calls.items():
        call()  # warm-up
        off, off_out = count_host_reads(call), call()[0]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(debug.ENV, "1")
            on, on_out = count_host_reads(call), call()[0]
            mp.setattr(fused_linear, "defer_active_rows", one_too_few)
            try:
                call()
                error = "no error"
            except RuntimeError as exc:
                error = str(exc)
            mp.delenv(debug.ENV)
            wrong_off = largest_difference(call()[0], off_out)  # the default path runs on
        exact = largest_difference(off_out, whole[name]()[0])
        out[name] = (off, on, largest_difference(on_out, off_out), wrong_off, error, exact)
    return out


def test_front_door_uneven_head_reads_once_and_debug_mode_checks_its_count(monkeypatch):
    """`prepare_linear_loss_input` (LOGPROB, filtered with a KL term, DISTILLATION, OPD_FULL with
    a KL term: it read twice before, the widths and then its log-probs' count) and
    `prepare_linear_packed_loss_input` with uneven plain head shards (10 + 6 rows) on 2 gloo
    processes: the check's shard widths and the fused kernel's count of active rows (deferred
    before the widths are read, `fused_linear.defer_active_rows`) share one read; the results
    (with ignored ids, so the count matters) are the whole head's on one rank.

    The debug mode (`LOSSFX_DISTRIBUTED_DEBUG=1`) compares the count of active rows that the
    front door defers for the fused kernel (`linear_loss_input._rows_ahead`) with the kernel's own
    count of its targets (`_kernels.fused_linear.CheckedCount`: one more read per kernel, on only).
    A wrong count (forced: one too few), which the default path (off: one read) turns into a
    silently wrong answer (a row dropped: 3 nats off in LOGPROB and OPD_FULL here), raises a
    `RuntimeError` naming both counts on every rank."""
    monkeypatch.setattr(harness, "_TIMEOUT_S", 300.0)
    results = gloo_pool(2).run(_front_door_uneven)
    for result in results:
        silent = {name for name, (*_, wrong_off, _, _) in result.items() if wrong_off > 0.1}
        assert {"LOGPROB", "OPD_FULL + KL, teacher logits"} <= silent  # (elsewhere the row dropped is cut)
        for name, (off, on, diff, _, error, exact) in result.items():
            assert off == 1, name
            assert exact < 1e-12, name
            assert on > off, name  # the kernel's own count read too
            assert diff == 0.0, name
            assert "LOSSFX_DISTRIBUTED_DEBUG" in error and "active rows" in error, (name, error)
            assert "handed a count of" in error and "but its targets have" in error, (name, error)
    assert results[0] == results[1]
