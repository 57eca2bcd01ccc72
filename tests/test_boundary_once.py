"""One boundary per call (issue 15): every public call does its boundary work once, at its top.

On 2 real gloo ranks, each public function of the adversarial suite's targets
(`tests/adversarial_cases.py`, agreeing ranks) is called once, plain, with uneven shards and with
DTensors, while the boundary's steps are counted:

- **entries**: `boundary`-wrapped functions entered (eager: each entry asks `_host_reads.depth()`
  once). One per call: no public function calls another one, and none re-enters itself on the
  local tensors of a DTensor argument;
- **checks**: cross-rank checks run (`consistency._check`): one;
- **repeated range checks**: range checks of ids this call had already checked (or marked as
  checked), skipped by `_host_reads.seen`: none — each id tensor is checked once;
- **repeated unwraps**: `to_local()` calls on a DTensor argument this call had already unwrapped
  (the check's view and the body are one unwrap, handed from the boundary to the body): none.

A variant the function rejects (uneven shards where it needs equal ones) must raise on every rank,
after one boundary.
"""

from __future__ import annotations

import sys

import adversarial_cases
import harness
import pytest

from lossfx._boundary import consistency
from lossfx._core import host_reads

pytestmark = pytest.mark.distributed

VARIANTS = {"plain": {}, "uneven": {"layout": "uneven"}, "dtensor": {"dtensor": True}}
# public functions whose body still unwraps its DTensors again after the check's view (issue 25): none
UNWRAPPED_TWICE: set[str] = set()


def _counted_call(rank: int, world: int, group, target: str, variant: dict) -> dict[str, int] | None:
    """This rank's counts for one call of `target` (None: the target does not take the variant)."""
    cfg = {**adversarial_cases.DEFAULT, **variant}
    try:
        call, _ = adversarial_cases.TARGETS[target](cfg, rank, group)
    except Exception:
        return None
    counts = {"entries": 0, "checks": 0, "repeated range checks": 0, "repeated unwraps": 0, "raised": 0}
    depth, check, seen = host_reads.depth, consistency._check, host_reads.seen
    dtensor_class = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # when an input is one
    to_local, unwrapped = dtensor_class.to_local if dtensor_class else None, set()

    def counting_depth() -> int:
        counts["entries"] += 1
        return depth()

    def counting_check(*args, **kwargs):
        counts["checks"] += 1
        return check(*args, **kwargs)

    def counting_seen(key: object) -> bool:
        repeated = seen(key)
        if repeated and isinstance(key, tuple) and key[0] == "ids in range":
            counts["repeated range checks"] += 1
        return repeated

    def counting_to_local(self, *args, **kwargs):
        counts["repeated unwraps"] += id(self) in unwrapped
        unwrapped.add(id(self))
        return to_local(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_reads, "depth", counting_depth)
        mp.setattr(consistency, "_check", counting_check)
        mp.setattr(host_reads, "seen", counting_seen)
        if dtensor_class:
            mp.setattr(dtensor_class, "to_local", counting_to_local)
        try:
            call()
        except ValueError:  # a variant the function rejects (e.g. uneven shards where equal ones are needed)
            counts["raised"] = 1
    return counts


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("target", list(adversarial_cases.TARGETS))
def test_one_boundary_per_public_call(target, variant):
    results = harness.gloo_pool(2).run(_counted_call, target, VARIANTS[variant])
    if any(r is None for r in results):
        pytest.skip(f"{target} takes no {variant} input in the adversarial suite")
    assert len({counts.pop("raised") for counts in results}) == 1, "the ranks must raise together"
    for rank, counts in enumerate(results):
        unwraps = counts.pop("repeated unwraps")
        assert counts == {"entries": 1, "checks": 1, "repeated range checks": 0}, f"rank {rank}: {counts}"
        if target in UNWRAPPED_TWICE and variant == "dtensor":  # the list shrinks as they move to one unwrap
            assert unwraps > 0, f"{target} now unwraps once: remove it from UNWRAPPED_TWICE"
        else:
            assert unwraps == 0, f"rank {rank}: {unwraps} repeated DTensor unwraps"
