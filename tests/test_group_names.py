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


RENAMED = {  # function: (its old keyword, this rank's part of its value on a whole `x` split over `world` CP ranks)
    "shift_left": ("cp_group", lambda x, rank, world: lossfx.shard_for_cp_rank(_dense_shift(x), rank, world)),
    "allgather_cp": ("group", lambda x, rank, world: x),
}


def _both_names(rank, world, group, name, x):
    fn, local = getattr(lossfx, name), lossfx.shard_for_cp_rank(x, rank, world)
    # (the warnings are checked on one thread below: the warnings filters are process-global)
    return fn(local, context_parallel_group=group), fn(local, **{RENAMED[name][0]: group})


@pytest.mark.filterwarnings("ignore:.* is deprecated:FutureWarning")
@pytest.mark.parametrize(("name", "world"), [("shift_left", 1), ("shift_left", 2), ("allgather_cp", 2)])
def test_old_keyword_keeps_its_value(name, world):
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    for rank, (new, old) in enumerate(run_ranks(world, _both_names, name, x)):
        assert torch.equal(new, old)
        torch.testing.assert_close(new, RENAMED[name][1](x, rank, world), atol=0, rtol=0)


@pytest.mark.parametrize("name", list(RENAMED))
def test_old_keyword_warns_once_and_compiles_silently(name):
    """Eagerly one FutureWarning (none for the new name), a TypeError when both names are passed;
    compiled, no warning and no graph break."""
    (old, value), fn = RENAMED[name], getattr(lossfx, name)
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn(x, context_parallel_group=None)
    with pytest.warns(FutureWarning, match=rf"{name}\({old}=\) is deprecated.*context_parallel_group=") as caught:
        out = fn(x, **{old: None})
    assert len(caught) == 1 and (out is x if name == "allgather_cp" else torch.equal(out, value(x, 0, 1)))
    with pytest.raises(TypeError, match=f"pass context_parallel_group only; {old} is its deprecated name"):
        fn(x, **{old: None}, context_parallel_group=None)
    compiled = torch.compile(lambda t: fn(t, **{old: None}), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(compiled(x), value(x, 0, 1), atol=0, rtol=0)
