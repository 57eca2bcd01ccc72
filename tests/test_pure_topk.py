"""The pure top-k kernel (`lossfx._kernels.topk`) and its boundary.

Checked against the float64 reference (values, ids, ties by the smaller id) on 1 and 2 ranks,
`k` within and beyond a shard's width, compiled once; the public call enters the kernel once.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE
from harness import run_ranks
from test_pure_logprobs import _counting

import lossfx
from lossfx import reference
from lossfx._core.vocab import VocabRange
from lossfx._kernels import topk as kernel

pytestmark = pytest.mark.gpu_check  # the GPU check's subset: `pytest --device cuda -m gpu_check`

F64 = torch.float64
V = 12
GEN = torch.Generator().manual_seed(17)
Z = torch.randint(-3, 4, (2, 3, V), generator=GEN).to(DEVICE, F64)  # small integers: many ties


def _check(got, k):
    want_values, want_ids = reference.vocab_topk(Z, k)
    torch.testing.assert_close(got[0], want_values, rtol=0, atol=0)
    assert torch.equal(got[1], want_ids)


@pytest.mark.parametrize("k", [1, 5, V, V + 3])
def test_one_rank_matches_the_reference(k):
    _check(kernel.vocab_topk(Z, min(k, V), VocabRange.whole(V)), k)


def _on_rank(rank, world, group, k):
    width = V // world
    return kernel.vocab_topk(Z[..., rank * width : (rank + 1) * width], k, VocabRange.uniform(group, width))


@pytest.mark.distributed
@pytest.mark.parametrize("k", [1, 4, 8, V])  # 8 and V: wider than a shard
def test_two_ranks_match_the_reference(k):
    for got in run_ranks(2, _on_rank, k):
        _check(got, k)


def test_compiled_kernel_matches_the_reference():
    torch._dynamo.reset()

    def step(z):
        return kernel.vocab_topk(z, 5, VocabRange.whole(V))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            _check(compiled(Z), 5)


def test_one_public_call_enters_the_kernel_once(monkeypatch):
    entered = _counting(monkeypatch, kernel, ["vocab_topk"])
    _check(lossfx.vocab_topk(Z, 5), 5)
    assert entered["vocab_topk"] == 1
