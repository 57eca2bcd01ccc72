"""What tracing the cross-rank check costs `torch.compile`: Dynamo interprets every Python step
of the check it traces (tens of µs each), so the check's Python decides much of a compile's time.

Pinned in steps, not seconds (load-independent): a compiled 2-rank `prepare_loss_input` call's
check took ~8k steps in `_boundary/consistency.py`; building the compiled check's assertion
groups symbolically (a `[groups, 256]` membership list comprehension) once took ~48k and doubled
the compile time of every checked call (`_assertions` now runs for real at trace time).
"""

from __future__ import annotations

import collections
import threading
import types
from types import SimpleNamespace

import pytest
import torch
from harness import run_ranks

import lossfx

pytestmark = pytest.mark.compile

_STEP_BOUND = 15_000  # consistency.py steps of one traced call (~8k today)
_LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)


def _rank_steps(rank, world, group, counts):
    gen = torch.Generator().manual_seed(0)  # the same ids on every rank
    z = torch.randn(2, 6, 8, dtype=torch.float64, generator=gen)
    ids = torch.randint(0, 8 * world, (2, 6), generator=gen)

    def call(logits, input_ids):
        out, _ = lossfx.prepare_loss_input(
            logits, {"input_ids": input_ids}, _LOGPROB, vocab_parallel_rank=rank, vocab_parallel_group=group
        )
        return out["next_token_logprobs"]

    code = call.__code__.replace(co_name=f"trace_cost_rank{rank}")  # its own Dynamo cache entry
    fn = types.FunctionType(code, call.__globals__, code.co_name, call.__defaults__, call.__closure__)
    torch.compile(fn, backend="eager", fullgraph=True)(z, ids)
    return counts[threading.get_ident()]


def test_compiled_check_trace_steps(monkeypatch):
    """The traced check stays cheap for Dynamo: each rank's compile steps through
    `_boundary/consistency.py` fewer than `_STEP_BOUND` times."""
    sc = pytest.importorskip("torch._dynamo.symbolic_convert")
    step = getattr(sc.InstructionTranslatorBase, "step", None)
    if step is None:
        pytest.skip("this torch's Dynamo has no InstructionTranslatorBase.step")
    counts: collections.Counter[int] = collections.Counter()

    def counting(self):
        if self.f_code.co_filename.endswith("consistency.py"):
            counts[threading.get_ident()] += 1
        return step(self)

    monkeypatch.setattr(sc.InstructionTranslatorBase, "step", counting)
    for steps in run_ranks(2, _rank_steps, counts):
        assert 1_000 < steps < _STEP_BOUND, steps
