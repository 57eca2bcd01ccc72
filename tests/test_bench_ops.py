"""The published kernel-launch counts (`benchmarks/bench_ops.py`, `benchmarks/results/ops.json`,
`benchmarks/README.md`) are current, and the method behind them holds.

1. `meta` and CPU dispatch the same ops but the value checks (skipped on `meta`), whatever the
   chunking: so a `meta` count at full size plus the checks counted on CPU is a CPU-free count.
2. Every path's count at `[1, 64, 1000]` under a forced 4-chunk policy (CPU tensors) equals the
   pinned one in `results/ops.json`, and the full-size GPU-policy counts (recomputed on `meta`)
   equal the published table: a change of any loop's op count fails here until
   `python -m benchmarks.bench_ops` is rerun and its table republished.
3. The count is affine in the chunk count (a fixed cost per chunk): the full-size count follows
   from the chunk count alone.
"""

from __future__ import annotations

import json
import pathlib
from collections import Counter

import pytest
import torch

import lossfx
from benchmarks import bench_ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLISHED = json.loads((ROOT / "benchmarks" / "results" / "ops.json").read_text())
# Known over the budget (issue 17): none since the top-p-only filter searches its threshold in 4
# histogram passes instead of 32 bisection steps (benchmarks/README.md, "Kernel launches per call").
OVER_BUDGET: set[str] = set()
CHECK_OPS = {"min", "max", "stack", "cat", "sum", "bitwise_and", "bitwise_not", "arange", "zeros", "ge", "lt"}
CHECK_OPS |= {"bitwise_or", "copy_", "_to_copy", "sub", "minimum"}  # packed: cu_seqlens checked on the device
CHECK_OPS |= {"where", "zeros_like"}  # packed: the scored ids' min/max (unscored positions read as 0)


def _policy(rows: int) -> lossfx.ChunkPolicy:
    return lossfx.ChunkPolicy(row_bytes=rows * 1000 * 4, min_rows=1, tile_bytes=1 << 20, max_block=2048)


def test_meta_and_cpu_differ_by_the_value_checks_only_whatever_the_chunking():
    diffs = {}
    for rows in (64, 16):  # one chunk, four chunks
        cpu = bench_ops.count_paths(bench_ops.SMALL, torch.bfloat16, "cpu", _policy(rows))
        meta = bench_ops.count_paths(bench_ops.SMALL, torch.bfloat16, "meta", _policy(rows))
        for name in bench_ops.PATHS:
            extra = Counter(cpu[name].ops)
            extra.subtract(meta[name].ops)
            assert min(extra.values(), default=0) >= 0, (name, extra)  # meta runs nothing the CPU does not
            assert {op for op, n in extra.items() if n} <= CHECK_OPS, (name, extra)
            diffs.setdefault(name, []).append(+extra)
    for name, (one, four) in diffs.items():
        assert one == four, name  # the checks run once per call
    assert diffs["token_logprobs"][0], "the CPU call must run its range check"


def test_small_shape_counts_are_the_pinned_ones():
    got = bench_ops.count_paths(bench_ops.SMALL, torch.bfloat16, "cpu", bench_ops.SMALL_POLICY)
    assert PUBLISHED["small_shape"] == list(bench_ops.SMALL)
    assert {n: c.launches for n, c in got.items()} == PUBLISHED["small"]


def test_full_size_counts_are_the_published_ones_and_under_the_budget():
    meta = bench_ops.count_paths()  # [1, 16384, 151936] bf16 on meta, GPU policy
    checks = bench_ops.value_checks()
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    policy = lossfx.GPU_POLICY
    assert (PUBLISHED["policy"]["row_bytes"], PUBLISHED["policy"]["min_rows"]) == (policy.row_bytes, policy.min_rows)
    for name, counter in meta.items():
        launches = counter.launches + checks[name]
        assert launches == PUBLISHED["full"][name]["launches"], name
        assert checks[name] == PUBLISHED["full"][name]["checks"], name
        assert f"| {name} | {launches} |" in readme, name
        assert (launches < bench_ops.BUDGET) != (name in OVER_BUDGET), (name, launches)


@pytest.mark.parametrize(
    "name", ["token_logprobs", "reverse_kl_to_fixed", "filtered_token_logprobs top-k 50, top-p 0.9"]
)
def test_the_count_is_affine_in_the_chunk_count(name):
    counts = {}
    for rows in (64, 32, 16, 8):
        counts[64 // rows] = bench_ops.count_paths(bench_ops.SMALL, torch.bfloat16, "meta", _policy(rows))[
            name
        ].launches
    per_chunk = counts[4] - counts[2]
    assert per_chunk > 0
    assert counts[8] - counts[4] == 2 * per_chunk
    assert counts[2] - counts[1] <= per_chunk  # the first extra chunk also adds the concatenations
