"""Hypothesis profiles of the suite, and `examples(n)`: a property's example count under them.

"dev" (the default) and "ci" (when CI is set) are derandomised: every run draws the same examples,
so `python -m pytest` passes or fails the same way on every checkout. "nightly"
(`LOSSFX_HYPOTHESIS_PROFILE=nightly`) explores: new random draws every run (`--hypothesis-seed=N`
replays one), 2000 examples for a property without a count of its own, and `NIGHTLY_FACTOR` times
its count for one that sets it with `@settings(max_examples=examples(n))`.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

NIGHTLY_FACTOR = 20

settings.register_profile(
    "dev",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", settings.get_profile("dev"), max_examples=60)
settings.register_profile("nightly", settings.get_profile("dev"), max_examples=2000, derandomize=False)
PROFILE = os.getenv("LOSSFX_HYPOTHESIS_PROFILE", "ci" if os.getenv("CI") else "dev")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """`n` in the derandomised profiles, `NIGHTLY_FACTOR · n` when exploring."""
    return n * NIGHTLY_FACTOR if PROFILE == "nightly" else n
