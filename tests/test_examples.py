"""examples/grpo_step.py, run as a client would: GRPO steps on a tiny Hugging Face Llama.

Each lossfx step is checked against the same step with `lossfx.reference` (dense float64) on an
identical model: the loss and every parameter gradient at 1e-10, for two optimizer steps (the
second one has importance ratios away from 1, so the clipping is live). Eager with the top-k/top-p
filter of the sampler, compiled (`fullgraph=True`, the lossfx part and the loss only: one graph, no
graph break), and tensor parallel on 2 gloo ranks with `parallelize_module` and a `Shard(-1)`
DTensor of logits fed to lossfx. No warning may be emitted. Skipped without `transformers`
(the `examples` extra).
"""

import copy
import os
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from harness import gloo_pool

from examples import grpo_step

TIGHT = {"rtol": 0, "atol": 1e-10}


def _steps(model, reference, batch, loss_fns):
    """`model` (lossfx) and `reference` (an identical model, `lossfx.reference`) take the same SGD
    steps; returns per step `(loss, reference loss, grads, reference grads)`, gradients before
    each update."""
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=1.0), torch.optim.SGD(reference.parameters(), lr=1.0)
    out = []
    for loss_fn, filtered in loss_fns:
        loss = grpo_step.train_step(model, opt, batch, lambda z, b, f=loss_fn, k=filtered: f(z, b, k))
        grads = grpo_step.full_grads(model)
        ref_loss = grpo_step.train_step(
            reference, ref_opt, batch, lambda z, b, k=filtered: grpo_step.reference_loss(z, b, k)
        )
        out.append((loss, ref_loss, grads, grpo_step.full_grads(reference)))
    return out


def _max_errors(steps):
    return [(abs(float(loss - ref)), max(float((g[n] - rg[n]).abs().max()) for n in rg)) for loss, ref, g, rg in steps]


def test_grpo_step_eager_and_compiled_match_reference():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    model = grpo_step.tiny_model()
    batch = grpo_step.sample(model)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(grpo_step.lossfx_loss, backend=counter, fullgraph=True)
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", DeprecationWarning)  # hidden by Python's defaults (torch's own)
        steps = _steps(
            model, copy.deepcopy(model), batch, [(grpo_step.lossfx_loss, True), (compiled, False), (compiled, False)]
        )
    assert [str(w.message) for w in caught] == []
    for loss_err, grad_err in _max_errors(steps):
        assert loss_err <= 1e-10 and grad_err <= 1e-10, (loss_err, grad_err)
    assert steps[1][0] != steps[2][0], "the second compiled step ran on updated weights"
    assert counter.frame_count == 1, "one graph for both compiled steps"
    assert not counters["graph_break"], dict(counters["graph_break"])


def _tp_steps(rank, world, group, backend):
    from torch.distributed.device_mesh import init_device_mesh

    model = grpo_step.tiny_model()
    batch = grpo_step.sample(model)  # same seed on every rank: the same rollouts
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", DeprecationWarning)  # hidden by Python's defaults (torch's own)
        tp_model = grpo_step.tensor_parallel(model, mesh)
        compiled = torch.compile(grpo_step.lossfx_loss, backend=backend, fullgraph=True)
        steps = _steps(tp_model, reference, batch, [(grpo_step.lossfx_loss, True), (compiled, True)])
    logits = grpo_step.logits_of(tp_model, batch.input_ids)
    return {
        "errors": torch.tensor(_max_errors(steps), dtype=torch.float64),
        "warnings": [str(w.message) for w in caught],
        "placements": str(tuple(logits.placements)),
        "lm_head_grad": str(tuple(tp_model.lm_head.weight.grad.placements)),
    }


@pytest.mark.distributed
def test_grpo_step_tensor_parallel_dtensor_logits_match_reference():
    for rank, result in enumerate(gloo_pool(2).run(_tp_steps, "aot_eager")):
        assert result["placements"] == "(Shard(dim=2),)", result["placements"]
        assert result["lm_head_grad"] == "(Shard(dim=0),)", result["lm_head_grad"]
        assert result["warnings"] == [], result["warnings"]
        assert (result["errors"] <= 1e-10).all(), (rank, result["errors"])


def test_trl_grpo_example_agrees_with_stock_trl():
    """examples/trl_grpo.py in its own process: stock TRL and LossfxGRPOTrainer, 3 steps, exit 0."""
    import subprocess

    pytest.importorskip("trl")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-m", "examples.trl_grpo"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK: 3 GRPO steps" in out.stdout, out.stdout
    assert "lossfx calls)" in out.stdout and "(0 lossfx calls)" not in out.stdout


def test_trl_grpo_example_check_can_fail():
    from examples import trl_grpo

    logs = [{"loss": -0.1, "grad_norm": 2.0, "entropy": 3.4} for _ in range(trl_grpo.STEPS)]
    assert len(trl_grpo.compare(logs, [dict(x) for x in logs])) == trl_grpo.STEPS + 1
    off = [dict(x) for x in logs]
    off[1]["grad_norm"] *= 1 + 10 * trl_grpo.RTOL
    with pytest.raises(AssertionError, match="step 2 grad_norm"):
        trl_grpo.compare(logs, off)
    with pytest.raises(AssertionError, match="expected 3 logged steps"):
        trl_grpo.compare(logs, logs[:2])
