"""Process-group keywords follow one rule (docs/design.md "Names"): `group` is the tensor-parallel
group over the vocabulary (kernels), a context-parallel group is `context_parallel_group`, and the
entry points use NeMo's `vocab_parallel_group` / `context_parallel_group`.

Renamed keywords (`shift_left(cp_group=)`, `allgather_cp(group=)`) give the same result as their new name, against the
dense float64 shift, with one FutureWarning in eager mode and none, without a graph break, under
`torch.compile(fullgraph=True)`; passing both names is a TypeError.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from harness import run_ranks

import lossfx

F64 = torch.float64
GROUP_NAMES = {"group", "vocab_parallel_group", "context_parallel_group"}


def _public_functions():
    for name in sorted(lossfx.__all__):
        obj = getattr(lossfx, name)
        if inspect.isfunction(obj):
            yield name, inspect.signature(obj).parameters


def test_every_public_group_keyword_follows_the_rule():
    seen = set()
    for name, params in _public_functions():
        groups = {p for p in params if p.endswith("group")}
        assert groups <= GROUP_NAMES, f"lossfx.{name} takes {sorted(groups - GROUP_NAMES)}"
        assert not {"group", "vocab_parallel_group"} <= groups, f"lossfx.{name}: two names for its TP group"
        seen |= groups
    assert seen == GROUP_NAMES  # the probe sees all three
    for name in ("allgather_cp", "shift_left"):  # their one group is a CP group
        assert "context_parallel_group" in inspect.signature(getattr(lossfx, name)).parameters


def _dense_shift(x):
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def _shift_both_names(rank, world, group, x):
    local = lossfx.shard_for_cp_rank(x, rank, world) if world > 1 else x
    # (the warnings are checked on one thread below: the warnings filters are process-global)
    return lossfx.shift_left(local, context_parallel_group=group), lossfx.shift_left(local, cp_group=group)


@pytest.mark.filterwarnings("ignore:shift_left.cp_group=. is deprecated:FutureWarning")
@pytest.mark.parametrize("world", [1, 2])
def test_shift_left_old_keyword_keeps_its_value(world):
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    results = run_ranks(world, _shift_both_names, x)
    for new, old in results:
        assert torch.equal(new, old)
    torch.testing.assert_close(lossfx.unshard([new for new, _ in results], seq_dim=1), _dense_shift(x), atol=0, rtol=0)


def test_shift_left_old_keyword_warns_once_and_not_beside_the_new_one():
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lossfx.shift_left(x, context_parallel_group=None)
    with pytest.warns(FutureWarning, match=r"shift_left\(cp_group=\) is deprecated.*context_parallel_group=") as caught:
        lossfx.shift_left(x, cp_group=None)
    assert len(caught) == 1
    with pytest.raises(TypeError, match="pass context_parallel_group only; cp_group is its deprecated name"):
        lossfx.shift_left(x, cp_group=None, context_parallel_group=None)


def test_old_group_keywords_compile_without_a_graph_break_or_warning():
    x = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    compiled = torch.compile(lambda t: lossfx.shift_left(t, cp_group=None), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compiled(x)
    torch.testing.assert_close(got, _dense_shift(x), atol=0, rtol=0)


def _allgather_both_names(rank, world, group, x):
    local = lossfx.shard_for_cp_rank(x, rank, world)
    return lossfx.allgather_cp(local, context_parallel_group=group), lossfx.allgather_cp(local, group=group)


@pytest.mark.filterwarnings("ignore:allgather_cp.group=. is deprecated:FutureWarning")
def test_allgather_cp_old_keyword_keeps_its_value():
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    for new, old in run_ranks(2, _allgather_both_names, x):
        assert torch.equal(new, x) and torch.equal(old, x)


def test_allgather_cp_old_keyword_warns_and_compiles_silently():
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(4), dtype=F64)
    with pytest.warns(FutureWarning, match=r"allgather_cp\(group=\) is deprecated.*context_parallel_group="):
        assert lossfx.allgather_cp(x, group=None) is x
    with pytest.raises(TypeError, match="pass context_parallel_group only; group is its deprecated name"):
        lossfx.allgather_cp(x, group=None, context_parallel_group=None)
    compiled = torch.compile(lambda t: lossfx.allgather_cp(t, group=None), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(compiled(x), x, atol=0, rtol=0)
