"""TRL's `GRPOTrainer` with lossfx's fused LM head, checked step by step against stock TRL.

A tiny Qwen2 with random weights and a character-level tokenizer built in code (nothing is
downloaded) trains for 3 GRPO steps on CPU, twice from the same seed: once with stock
`trl.GRPOTrainer` (TRL's own fused LM head) and once with `lossfx.integrations.trl.LossfxGRPOTrainer`
(the per-token log-probs and entropies from `lossfx.linear_next_token_logprobs`). Each step's
loss, gradient norm and mean entropy (TRL's metric, `−Σ p log p`) must agree to fp32 rounding;
the script exits non-zero otherwise.

`num_iterations=2`, so step 2 reuses step 1's rollouts on updated weights: its importance ratios
differ from 1 and its loss depends on the log-probs themselves (step 1's and step 3's do not:
their ratios are exactly 1, and only the gradients carry the log-probs).

Tolerance: both heads compute fp32 log-softmaxes of the same fp32 logits in different summation
orders, so each log-prob and each gradient entry differ by a few fp32 ulps (relative 1e-7..1e-6);
after an Adam step the weights differ by about that much relative, and it does not grow in 3
steps (measured: at most 3e-6 relative). `RTOL = 1e-4` leaves a wide margin above that and is far below what any real
difference moves (a wrong token, a missed mask, a temperature applied twice: 1e-2 or more).

`--filtered`: the rollouts are sampled with `top_k=10, top_p=0.9`, and both runs score the
completions under that filter, as the sampler (vLLM, or `generate`) drew them, so the importance
ratios compare like with like: `LossfxGRPOTrainer(lossfx_filtered_logprobs=True)` from the hidden
states (`lossfx.linear_filtered_token_logprobs`, the logits never materialised) against
`LogitsFilteredGRPOTrainer` below, which holds the completion's `[B, K, V]` logits and filters
them (`lossfx.next_token_logprobs(..., sampling_params=...)`). Same tolerance.

Run it: ``python -m examples.trl_grpo [--filtered]`` (needs the `trl` extra: ``pip install -e '.[trl]'``).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import warnings
from typing import Any

import torch

RTOL = 1e-4  # loss, gradient norm and entropy, relative (see the module docstring)
ATOL = 1e-6  # absolute floor for values near 0 (fp32 loss of a batch with tiny advantages)
STEPS = 3
CHARS = "abcdefghijklmnopqrstuvwxyz ."
PROMPTS = ["say a", "count b", "spell cab", "an apple", "be brave", "a cat sat", "aaa", "b."]
FILTER = {"top_k": 10, "top_p": 0.9}  # --filtered: the sampler's filter (GRPOConfig's top_k, top_p)


def char_tokenizer() -> Any:
    """A character-level fast tokenizer made in code: ids 0-2 are pad/bos/eos, then one per char."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def tiny_qwen2(vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A 2-layer Qwen2 with random weights, fp32, built from a config in code."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def reward_a_count(completions: list[str], **_: Any) -> list[float]:
    """Reward: the fraction of 'a' in the completion (varies within a group: advantages are not 0)."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def logits_filtered_trainer_class() -> type:
    """A `GRPOTrainer` scoring the completions under its own `top_k` / `top_p` on the logits path:
    the model's `[B, K+1, V]` logits, divided by the temperature, then
    `lossfx.next_token_logprobs(..., sampling_params=...)`; the entropies are the unfiltered
    distribution's (TRL's metric). What `lossfx_filtered_logprobs=True` computes without the logits."""
    from trl import GRPOTrainer

    import lossfx

    class LogitsFilteredGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _get_per_token_logps_and_entropies(
            self, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, batch_size: Any = None,
            compute_entropy: bool = False, compute_aux_loss: bool = False, **_: Any,
        ) -> Any:  # fmt: skip
            params = lossfx.TrainingSamplingParams(top_k=self.top_k or None, top_p=self.top_p)
            keep = logits_to_keep + 1
            with self.accelerator.autocast():
                out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep)
            logits = out.logits.float() / self.temperature  # [B, K+1, V]
            labels = input_ids.masked_fill(attention_mask == 0, -100)[:, -keep:]
            scored = labels[:, 1:] != -100
            logps = lossfx.next_token_logprobs(logits, labels.clamp(min=0), sampling_params=params)
            full = logits[:, :-1].log_softmax(-1)
            entropies = -(full.exp() * full).sum(-1)
            zero = logps.new_zeros(())
            return torch.where(scored, logps, zero), torch.where(scored, entropies, zero), None

    return LogitsFilteredGRPOTrainer


def train(
    trainer_cls: type, seed: int = 0, filtered: bool = False, **trainer_kwargs: Any
) -> tuple[list[dict[str, float]], Any]:
    """`STEPS` GRPO steps with `trainer_cls` from `seed` (sampling with `FILTER` if `filtered`);
    returns the per-step logs and the trainer."""
    from datasets import Dataset
    from transformers import PrinterCallback, set_seed
    from trl import GRPOConfig

    set_seed(seed)
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), seed)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=8,
            num_iterations=2,
            max_steps=STEPS,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=seed,
            data_seed=seed,
            use_cpu=True,
            bf16=False,
            dataloader_num_workers=0,
            disable_tqdm=True,
            temperature=0.9,
            **(FILTER if filtered else {}),
        )
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward_a_count,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=tokenizer,
            **trainer_kwargs,
        )
        trainer.remove_callback(PrinterCallback)  # the table below says what matters
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h and "entropy" in h]
    return logs, trainer


def lossfx_trainer_class() -> type:
    """`LossfxGRPOTrainer`, counting its calls to the lossfx path (so the check is not vacuous)."""
    from lossfx.integrations import trl as lossfx_trl

    class CountingLossfxGRPOTrainer(lossfx_trl.LossfxGRPOTrainer):  # type: ignore[name-defined,misc]
        lossfx_calls = 0

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
            type(self).lossfx_calls += 1
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    return CountingLossfxGRPOTrainer


def compare(stock: list[dict[str, float]], fused: list[dict[str, float]]) -> list[str]:
    """Per-step table lines; raises `AssertionError` listing every step out of tolerance."""
    if len(stock) != STEPS or len(fused) != STEPS:
        raise AssertionError(f"expected {STEPS} logged steps, got {len(stock)} (stock) and {len(fused)} (lossfx)")
    lines, bad = (
        [
            f"{'step':>4} {'loss TRL':>14} {'loss lossfx':>14} {'grad_norm TRL':>14} {'grad_norm lossfx':>16} "
            f"{'entropy TRL':>12} {'entropy lossfx':>14}"
        ],
        [],
    )
    for step, (a, b) in enumerate(zip(stock, fused), start=1):
        lines.append(
            f"{step:>4} {a['loss']:>14.8g} {b['loss']:>14.8g} {a['grad_norm']:>14.8g} {b['grad_norm']:>16.8g} "
            f"{a['entropy']:>12.8g} {b['entropy']:>14.8g}"
        )
        for key in ("loss", "grad_norm", "entropy"):
            if not math.isclose(a[key], b[key], rel_tol=RTOL, abs_tol=ATOL):
                bad.append(f"step {step} {key}: TRL {a[key]!r} vs lossfx {b[key]!r}")
    if bad:
        raise AssertionError("lossfx and stock TRL disagree beyond fp32 rounding:\n" + "\n".join(lines + bad))
    return lines


def main() -> int:
    from trl import GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore")  # TRL's and transformers' advice about a CPU toy run
    filtered = "--filtered" in sys.argv[1:]
    counting = lossfx_trainer_class()
    if filtered:  # both score the sampler's filtered distribution; the baseline holds the logits
        stock, _ = train(logits_filtered_trainer_class(), filtered=True)
        fused, _ = train(counting, filtered=True, lossfx_filtered_logprobs=True)
    else:
        stock, _ = train(GRPOTrainer)
        fused, _ = train(counting)
    if counting.lossfx_calls == 0:
        raise AssertionError("the lossfx trainer never called its per-token log-prob method")
    try:
        lines = compare(stock, fused)
    except AssertionError as e:
        print(e, file=sys.stderr)
        return 1
    if filtered:
        print(f"--filtered {FILTER}: 'TRL' is LogitsFilteredGRPOTrainer (the logits path), 'lossfx' the fused one")
    print("\n".join(lines))
    print(f"OK: {STEPS} GRPO steps, loss, grad_norm, entropy within rtol={RTOL} ({counting.lossfx_calls} lossfx calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
