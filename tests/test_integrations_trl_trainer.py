"""`LossfxGRPOTrainer` as a trainer: options per instance, unsupported trainers, the log line, and
the paths TRL runs through it (reference and old-policy log-probs, gradient checkpointing, TRL's
`torch_compile`, the mixin's own `lossfx_compile`), each against stock `trl.GRPOTrainer`.

The model is `examples.trl_grpo`'s tiny Qwen2 with a character tokenizer, both built in code;
for `beta > 0` TRL builds the reference model from the policy's path, so the policy is saved to
a temporary folder and passed by path (nothing is downloaded). Two GRPO steps with
`num_iterations=2`: step 1 computes the old policy's log-probs (and the reference's), step 2's
loss depends on the log-probs themselves (ratios ≠ 1). Tolerance: `examples.trl_grpo`'s.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings

import pytest
import torch

pytest.importorskip("trl")
import trl
from datasets import Dataset
from transformers import PrinterCallback, set_seed
from trl import GRPOConfig, GRPOTrainer

from examples.trl_grpo import (
    ATOL,
    FILTER,
    PROMPTS,
    RTOL,
    char_tokenizer,
    logits_filtered_trainer_class,
    reward_a_count,
    tiny_qwen2,
)
from lossfx.integrations import trl as lossfx_trl

METHOD = "_get_per_token_logps_and_entropies"


def _args(tmp_path, **extra):
    return GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        num_iterations=2, max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
        seed=0, data_seed=0, use_cpu=True, bf16=False, dataloader_num_workers=0, disable_tqdm=True,
        temperature=0.9, **extra,
    )  # fmt: skip


def _trainer(cls, tmp_path, by_path=False, **kwargs):
    extra = {k: kwargs.pop(k) for k in list(kwargs) if not k.startswith("lossfx_")}
    set_seed(0)
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), 0)
    if by_path:  # TRL builds the reference model (beta > 0) from the policy's path
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' advice about a CPU toy run
        trainer = cls(
            model=model, reward_funcs=reward_a_count, args=_args(tmp_path, **extra),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer, **kwargs,
        )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    return trainer


def _train(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]


def _assert_same_steps(stock, fused, keys=("loss", "grad_norm", "entropy")):
    assert len(stock) == len(fused) == 2
    for step, (a, b) in enumerate(zip(stock, fused), start=1):
        for key in keys:
            assert math.isclose(a[key], b[key], rel_tol=RTOL, abs_tol=ATOL), (step, key, a[key], b[key])


class _Spy:
    """Records each call of `lossfx_trl.per_token_logps_and_entropies`: the head weight, grad mode,
    whether Dynamo was tracing it, and its options."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = lossfx_trl.per_token_logps_and_entropies

        def spy(hidden, weight, *args, **kwargs):
            self.calls.append((weight, torch.is_grad_enabled(), torch.compiler.is_compiling(), kwargs))
            return real(hidden, weight, *args, **kwargs)

        monkeypatch.setattr(lossfx_trl, "per_token_logps_and_entropies", spy)


def _count_stock_calls(monkeypatch):
    """Counts the calls of TRL's own method (its signature kept: the mixin's check reads it)."""
    calls = []
    stock = GRPOTrainer._get_per_token_logps_and_entropies

    @functools.wraps(stock)
    def counted(*args, **kwargs):
        calls.append(1)
        return stock(*args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, METHOD, counted)
    return calls


# ---------------------------------------------------------------------------------------------
# Options per trainer
# ---------------------------------------------------------------------------------------------


def test_options_are_per_trainer(tmp_path, monkeypatch):
    cls = lossfx_trl.LossfxGRPOTrainer
    a = _trainer(
        cls, tmp_path, lossfx_sharded_head="gather", lossfx_filtered_logprobs=True, lossfx_filter_ties="sorted", top_k=5
    )
    b = _trainer(cls, tmp_path, lossfx_chunk_size=16)
    assert (a.lossfx_sharded_head, a.lossfx_filtered_logprobs, a.lossfx_chunk_size) == ("gather", True, None)
    assert (b.lossfx_sharded_head, b.lossfx_filtered_logprobs, b.lossfx_chunk_size) == ("raise", False, 16)
    assert (cls.lossfx_sharded_head, cls.lossfx_filtered_logprobs, cls.lossfx_chunk_size) == ("raise", False, None)
    spy = _Spy(monkeypatch)
    ids = torch.randint(3, 31, (2, 9), generator=torch.Generator().manual_seed(0))
    for trainer in (a, b, a):  # interleaved: each call reads its own trainer's options
        getattr(trainer, METHOD)(trainer.model, ids, torch.ones_like(ids), 4)
    seen = [(k["sharded_head"], k["chunk_size"], k["sampling_params"]) for _, _, _, k in spy.calls]
    filtered = lossfx_trl.TrainingSamplingParams(top_k=5, top_p=1.0, ties="sorted")
    assert seen == [("gather", None, filtered), ("raise", 16, None), ("gather", None, filtered)]


def test_a_subclass_attribute_is_the_default_and_the_keyword_wins(tmp_path):
    class GatherTrainer(lossfx_trl.LossfxGRPOTrainer):
        lossfx_sharded_head = "gather"

    assert _trainer(GatherTrainer, tmp_path).lossfx_sharded_head == "gather"
    assert _trainer(GatherTrainer, tmp_path, lossfx_sharded_head="raise").lossfx_sharded_head == "raise"


def test_an_option_set_on_the_shared_class_still_applies_and_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(lossfx_trl.LossfxGRPOTrainer, "lossfx_sharded_head", "gather", raising=False)
    with pytest.warns(FutureWarning, match="LossfxGRPOTrainer.lossfx_sharded_head set on the class"):
        trainer = _trainer_warnings_kept(tmp_path)
    assert trainer.lossfx_sharded_head == "gather"


def _trainer_warnings_kept(tmp_path):
    set_seed(0)
    tokenizer = char_tokenizer()
    return lossfx_trl.LossfxGRPOTrainer(
        model=tiny_qwen2(len(tokenizer), 0), reward_funcs=reward_a_count, args=_args(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value", "error", "match"),
    [
        ("lossfx_sharded_head", "shard", ValueError, "lossfx_sharded_head must be 'raise', 'gather' or"),
        ("lossfx_sharded_head", None, ValueError, "lossfx_sharded_head must be .* got None"),
        ("lossfx_filtered_logprobs", "yes", TypeError, "lossfx_filtered_logprobs must be a bool, got 'yes'"),
        ("lossfx_filter_ties", "first", ValueError, "lossfx_filter_ties must be 'together' or 'sorted', got 'first'"),
        ("lossfx_chunk_size", 0, ValueError, "lossfx_chunk_size must be positive, got 0"),
        ("lossfx_chunk_size", 2.5, TypeError, "lossfx_chunk_size must be a positive int"),
        ("lossfx_compile", "max-autotune", TypeError, "lossfx_compile must be a bool or a dict"),
    ],
)
def test_bad_option_values_raise_naming_the_option(option, value, error, match):
    with pytest.raises(error, match=match):  # before TRL's own __init__: no model needed
        lossfx_trl.LossfxGRPOTrainer(**{option: value})


# ---------------------------------------------------------------------------------------------
# Unsupported trainers: a clear error, never a silent no-op
# ---------------------------------------------------------------------------------------------


def test_a_class_that_is_not_a_grpo_trainer_raises():
    class NotGRPO(lossfx_trl.LossfxGRPOMixin, trl.SFTTrainer):
        pass

    with pytest.raises(TypeError, match="NotGRPO is not a GRPOTrainer"):
        NotGRPO()


def test_the_mixin_after_grpo_trainer_in_the_bases_raises_at_class_creation():
    with pytest.raises(TypeError, match=r"_get_per_token_logps_and_entropies comes before LossfxGRPOMixin"):

        class Backwards(GRPOTrainer, lossfx_trl.LossfxGRPOMixin):
            pass


def test_a_trl_without_the_method_raises(monkeypatch):
    monkeypatch.delattr(GRPOTrainer, METHOD)
    with pytest.raises(TypeError, match=rf"GRPOTrainer of TRL {trl.__version__} .* has no such method"):
        lossfx_trl.LossfxGRPOTrainer()


def test_a_trl_whose_method_takes_other_parameters_raises(monkeypatch):
    def renamed(self, model, input_ids, attention_mask, completion_length, batch_size=None, compute_entropy=False):
        raise AssertionError("never called")

    monkeypatch.setattr(GRPOTrainer, METHOD, renamed)
    with pytest.raises(TypeError, match="takes \\('self', 'model', 'input_ids', 'attention_mask', 'completion_length'"):
        lossfx_trl.LossfxGRPOTrainer()


# ---------------------------------------------------------------------------------------------
# The log line
# ---------------------------------------------------------------------------------------------


def test_logs_once_per_trainer(tmp_path, caplog):
    a = _trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path, lossfx_sharded_head="gather")
    b = _trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path)
    ids = torch.randint(3, 31, (2, 9), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="lossfx.integrations.trl"):
        for trainer in (a, a, b, a, b):
            getattr(trainer, METHOD)(trainer.model, ids, torch.ones_like(ids), 4)
    lines = [r.getMessage() for r in caplog.records if r.name == "lossfx.integrations.trl"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("lossfx computes LossfxGRPOTrainer's per-token log-probs") and "'gather'" in lines[0]
    assert "sharded_head='raise'" in lines[1]


# ---------------------------------------------------------------------------------------------
# What TRL runs through the method, against stock TRL
# ---------------------------------------------------------------------------------------------


def test_reference_and_old_policy_logps_go_through_lossfx(tmp_path, monkeypatch):
    """beta > 0: the reference model's log-probs (no grad), the old policy's (no grad, step 1) and
    the loss's (grad) are all lossfx's; the KL metric and the loss equal stock TRL's."""
    stock = _train(_trainer(GRPOTrainer, tmp_path, by_path=True, beta=0.1))
    stock_calls = _count_stock_calls(monkeypatch)
    spy = _Spy(monkeypatch)
    trainer = _trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path, by_path=True, beta=0.1)
    fused = _train(trainer)
    _assert_same_steps(stock, fused, keys=("loss", "grad_norm", "entropy", "kl"))
    assert fused[1]["kl"] > 1e-4  # step 2: the policy moved away from the reference
    policy = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings().weight
    reference = trainer.ref_model.get_output_embeddings().weight
    kinds = [("ref" if w is reference else "policy" if w is policy else "?", grad) for w, grad, _, _ in spy.calls]
    # step 1: old policy, reference, loss; step 2 (rollouts reused): loss
    assert kinds == [("policy", False), ("ref", False), ("policy", True), ("policy", True)]
    assert stock_calls == []


def test_gradient_checkpointing(tmp_path, monkeypatch):
    stock = _train(_trainer(GRPOTrainer, tmp_path, gradient_checkpointing=True))
    spy = _Spy(monkeypatch)
    trainer = _trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path, gradient_checkpointing=True)
    fused = _train(trainer)
    _assert_same_steps(stock, fused)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # TRL turned it on
    assert sum(grad for _, grad, _, _ in spy.calls) == 2


def test_trl_torch_compile_compiles_the_forward_not_the_lossfx_call(tmp_path, monkeypatch):
    """TRL's `torch_compile=True` compiles the model's forward (accelerate's `torch.compile(model)`):
    the lossfx call after it runs eagerly (`lossfx_compile` compiles it)."""
    compiled = {"torch_compile": True, "torch_compile_backend": "eager"}  # Dynamo only: cheap
    stock = _train(_trainer(GRPOTrainer, tmp_path, **compiled))
    spy = _Spy(monkeypatch)
    trainer = _trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path, **compiled)
    fused = _train(trainer)
    _assert_same_steps(stock, fused)
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert spy.calls and not any(tracing for _, _, tracing, _ in spy.calls)


def _lossfx_compile_against_stock(tmp_path, monkeypatch, backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    stock = _train(_trainer(GRPOTrainer, tmp_path))
    counter = CompileCounterWithBackend(backend)
    trainer = _trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path, lossfx_compile={"backend": counter})
    eager_calls = []
    monkeypatch.setattr(lossfx_trl, "_check_ranks_agree", lambda *a, **k: eager_calls.append(1))
    fused = _train(trainer)
    _assert_same_steps(stock, fused)
    # fullgraph; the completion length varies per rollout: one more graph with dynamic shapes at most
    assert 1 <= counter.frame_count <= 2
    assert len(eager_calls) == 3  # the ranks' check runs eagerly before each compiled call


def test_lossfx_compile_runs_the_call_compiled(tmp_path, monkeypatch):
    _lossfx_compile_against_stock(tmp_path, monkeypatch, "eager")


@pytest.mark.slow  # Inductor: ~45 s of compiling on 2 cores; the default suite traces with the "eager" backend above
def test_lossfx_compile_inductor(tmp_path, monkeypatch):
    _lossfx_compile_against_stock(tmp_path, monkeypatch, "inductor")


# ---------------------------------------------------------------------------------------------
# The sampler's filter (top_k / top_p), fused, against the logits path
# ---------------------------------------------------------------------------------------------


def test_filtered_logprobs_match_the_logits_path_run(tmp_path, monkeypatch):
    """Rollouts sampled with top-k/top-p: `lossfx_filtered_logprobs=True` (the fused filtered
    kernel) trains as `examples.trl_grpo`'s logits-path trainer does (the `[B, K+1, V]` logits,
    `lossfx.next_token_logprobs` under the same filter), step for step; every lossfx call got the
    filter, and it matters: the unfiltered scoring of the same rollouts has another gradient norm."""
    logits = _train(_trainer(logits_filtered_trainer_class(), tmp_path, **FILTER))
    spy = _Spy(monkeypatch)
    fused = _train(_trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path, lossfx_filtered_logprobs=True, **FILTER))
    _assert_same_steps(logits, fused)
    params = lossfx_trl.TrainingSamplingParams(**FILTER)
    assert len(spy.calls) == 3 and all(k["sampling_params"] == params for _, _, _, k in spy.calls)
    unfiltered = _train(_trainer(lossfx_trl.LossfxGRPOTrainer, tmp_path, **FILTER))
    assert not math.isclose(unfiltered[0]["grad_norm"], fused[0]["grad_norm"], rel_tol=100 * RTOL)


@pytest.mark.slow  # Inductor compiling the filtered kernel: ~2 min on 2 loaded cores
def test_filtered_lossfx_compile_inductor(tmp_path):
    """`lossfx_filtered_logprobs=True` under `lossfx_compile` with Inductor: fullgraph, at most one
    recompile for the varying completion length, and the logits-path run's steps."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    logits = _train(_trainer(logits_filtered_trainer_class(), tmp_path, **FILTER))
    counter = CompileCounterWithBackend("inductor")
    fused = _train(
        _trainer(
            lossfx_trl.LossfxGRPOTrainer,
            tmp_path,
            lossfx_filtered_logprobs=True,
            lossfx_compile={"backend": counter},
            **FILTER,
        )
    )
    _assert_same_steps(logits, fused)
    assert 1 <= counter.frame_count <= 2
