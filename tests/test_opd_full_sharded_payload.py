"""OPD_FULL with a teacher logits payload `data['teacher_full_logits']` that is a vocabulary-sharded
DTensor (`Shard(-1)` on the logits' mesh): not supported (the payload is a canonical, replicated
column), so the one unwrap of the call (`_boundary.dtensor.local_view`: the columns the call reads) rejects it
with the same clear ValueError on both gloo ranks, naming the column and its placement, on the
logits path (`prepare_loss_input`, `prepare_opd_full_loss_input`) and the front door
(`prepare_linear_loss_input`); a `Replicate()` payload next to it is the control that works.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from harness import gloo_pool

import lossfx

pytestmark = pytest.mark.distributed

B, S, V, H = 2, 5, 8, 4
MATCH = re.escape("data['teacher_full_logits'] is a DTensor with placements (Shard(dim=2),)") + r".*Replicate\(\)"


def _call(rank, world, group, entry, placement):
    """This rank's error message of an OPD_FULL call whose logits payload has `placement`
    (`"shard"` or `"replicate"`), or `None` when it returned finite outputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(B, S, H, generator=gen), torch.randn(V, H, generator=gen)
    payload, ids = torch.randn(B, S, V, generator=gen), torch.randint(0, V, (B, S), generator=gen)
    mesh = init_device_mesh("cpu", (world,))
    column = distribute_tensor(payload, mesh, [Shard(-1) if placement == "shard" else Replicate()], src_data_rank=None)
    cfg = lossfx.OnPolicyDistillationFullConfig(enabled=True, teacher_payload="logits")
    loss_fn = SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=cfg)
    data = {"input_ids": ids, "teacher_full_logits": column}
    try:
        if entry == "front_door":
            w = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None)
            out, _ = lossfx.prepare_linear_loss_input(hidden, w, data, loss_fn)
        else:
            logits = distribute_tensor(hidden @ weight.T, mesh, [Shard(-1)], src_data_rank=None)
            if entry == "prepare_loss_input":
                out, _ = lossfx.prepare_loss_input(logits, data, loss_fn)
            else:
                none = dict.fromkeys(("vocab_parallel_rank", "vocab_parallel_group", "context_parallel_group"))
                out = lossfx.prepare_opd_full_loss_input(
                    logits, data, loss_fn, sampling_params=None, chunk_size=None, **none
                )
    except ValueError as err:
        return str(err)
    assert torch.isfinite(out["opd_full_divergence"]).all()
    return None


@pytest.mark.parametrize("entry", ["prepare_loss_input", "prepare_opd_full_loss_input", "front_door"])
def test_a_vocabulary_sharded_logits_payload_raises_on_both_ranks(entry):
    for rank, message in enumerate(gloo_pool(2).run(_call, entry, "shard")):
        assert message is not None, f"rank {rank} did not raise"
        assert re.search(MATCH, message), f"rank {rank}: {message}"


@pytest.mark.parametrize("entry", ["prepare_loss_input", "front_door"])
def test_a_replicated_logits_payload_works(entry):
    assert gloo_pool(2).run(_call, entry, "replicate") == [None, None]
