"""A GRPO training step on a Hugging Face causal LM, with lossfx computing the log-probs.

The model is a tiny `LlamaConfig` with random weights (nothing is downloaded). One step:

1. rollouts: sample responses from the model with a top-k/top-p filter (`sample`);
2. forward: logits `[B, S, V]`; divide by the sampling temperature (1 here) before lossfx;
3. `lossfx.prepare_loss_input` (`LOGPROB`, with the same `sampling_params` as the sampler so
   the log-probs are those of the distribution the tokens were drawn from);
4. a clipped policy-gradient (GRPO) loss over the response tokens with group-normalised
   advantages (`grpo_loss`); backward; optimizer step.

`lossfx_loss` is step 3 + 4; compile it alone with `torch.compile(lossfx_loss, fullgraph=True)`.
`reference_loss` is the same loss with `lossfx.reference` (dense float64), for checking.

Tensor parallelism (`tensor_parallel`): PyTorch's native `parallelize_module` shards the MLPs and
the LM head; the LM head is `ColwiseParallel(use_local_output=False)`, so the logits are a
`Shard(-1)` DTensor over the vocabulary, which lossfx takes directly (docs/dtensor.md).

Run it: ``python -m examples.grpo_step`` (one process) or
``torchrun --nproc-per-node 2 -m examples.grpo_step`` (tensor parallel over gloo).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

import lossfx

VOCAB = 255  # odd on purpose: two tensor-parallel ranks get uneven shards (128 + 127)
PROMPT, RESPONSE, GROUP = 4, 6, 4  # prompt and response lengths, rollouts per prompt
SAMPLING = lossfx.TrainingSamplingParams(top_k=50, top_p=0.9)
LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
CLIP = 0.2


def tiny_model(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama with random weights (seeded: every rank builds the same model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()  # eval: no dropout, so the step is deterministic


def logits_of(model: torch.nn.Module, input_ids: Tensor) -> Tensor:
    """`[B, S, V]` logits (a `Shard(-1)` DTensor under `tensor_parallel`), temperature 1."""
    return model(input_ids=input_ids, use_cache=False).logits


@dataclass
class Rollouts:
    input_ids: Tensor  # [B, S] prompt then response
    token_mask: Tensor  # [B, S] 1 on response tokens
    advantages: Tensor  # [B] group-normalised rewards
    old_logprobs: Tensor  # [B, S-1] the sampler's log-probs (filtered distribution)


@torch.no_grad()
def sample(model: torch.nn.Module, seed: int = 0) -> Rollouts:
    """`GROUP` responses to one random prompt, sampled with `SAMPLING`'s top-k/top-p filter.

    The filter is lossfx's own (`lossfx.reference.apply_top_k_top_p`), so the training log-probs
    with the same `sampling_params` are exactly those of the sampling distribution.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=gen).repeat(GROUP, 1)  # [B, P]
    for _ in range(RESPONSE):
        last = logits_of(model, ids)[:, -1].to(torch.float64)  # [B, V]
        filtered, _ = lossfx.reference.apply_top_k_top_p(last, SAMPLING.top_k, SAMPLING.top_p)
        ids = torch.cat([ids, torch.multinomial(filtered.softmax(-1), 1, generator=gen)], dim=1)
    token_mask = torch.zeros_like(ids)
    token_mask[:, PROMPT:] = 1
    reward = (ids[:, PROMPT:] % 2 == 0).to(torch.float64).mean(-1)  # a toy reward: even token ids
    advantages = (reward - reward.mean()) / (reward.std() + 1e-6)
    z = logits_of(model, ids).to(torch.float64)
    old = lossfx.reference.next_token_filtered_logprobs(z, ids, SAMPLING.top_k, SAMPLING.top_p)
    old = torch.where(token_mask[:, 1:] > 0, old, torch.zeros_like(old))
    return Rollouts(ids, token_mask, advantages, old)


def grpo_loss(logprobs: Tensor, batch: Rollouts) -> Tensor:
    """Clipped policy-gradient loss, averaged over response tokens: `[B, S-1]` log-probs -> scalar.

    ``-mean_t min(r_t A, clip(r_t, 1-ε, 1+ε) A)`` with `r_t = exp(logp_t - logp_old_t)`.
    """
    mask = batch.token_mask[:, 1:].to(logprobs.dtype)  # [B, S-1]: scores of response tokens
    ratio = torch.exp(logprobs - batch.old_logprobs.to(logprobs.dtype))
    adv = batch.advantages.to(logprobs.dtype)[:, None]
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    return -(objective * mask).sum() / mask.sum()


def lossfx_loss(logits: Tensor, batch: Rollouts, filtered: bool = True) -> Tensor:
    """lossfx log-probs (plain tensor or DTensor logits) -> GRPO loss. Compile this part alone."""
    data = {"input_ids": batch.input_ids, "token_mask": batch.token_mask}
    loss_input, _ = lossfx.prepare_loss_input(logits, data, LOGPROB, sampling_params=SAMPLING if filtered else None)
    return grpo_loss(loss_input["next_token_logprobs"], batch)


def reference_loss(logits: Tensor, batch: Rollouts, filtered: bool = True) -> Tensor:
    """The same loss from dense float64 `lossfx.reference` log-probs (full, plain logits)."""
    z, ids = logits.to(torch.float64), batch.input_ids
    if filtered:
        lp = lossfx.reference.next_token_filtered_logprobs(z, ids, SAMPLING.top_k, SAMPLING.top_p)
        lp = lossfx.reference.mask_out_neg_inf_logprobs(lp, batch.token_mask[:, 1:])
    else:
        lp = lossfx.reference.next_token_logprobs(z, ids)
    return grpo_loss(lp, batch)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Rollouts, loss_fn: Any) -> Tensor:
    """forward, `loss_fn(logits, batch)`, backward, optimizer step; returns the loss (detached)."""
    optimizer.zero_grad()
    loss = loss_fn(logits_of(model, batch.input_ids), batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def tensor_parallel(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """PyTorch-native tensor parallelism on a 1-D mesh: MLPs column/row-parallel, and the LM head
    column-parallel with DTensor output, so the logits are a `Shard(-1)` DTensor."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {"lm_head": ColwiseParallel(use_local_output=False)}
    for i in range(len(model.model.layers)):
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def full_grads(model: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient as a full plain tensor (DTensor gradients gathered)."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return grads


def main() -> None:
    """One GRPO step (eager, then compiled loss) per process; under torchrun, tensor parallel."""
    import os

    model = tiny_model()
    batch = sample(model)
    loss_fn: Any = lossfx_loss
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        model = tensor_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    print("eager GRPO loss", float(train_step(model, optimizer, batch, loss_fn)))
    compiled = torch.compile(lossfx_loss, fullgraph=True)
    print("compiled GRPO loss", float(train_step(model, optimizer, batch, compiled)))


if __name__ == "__main__":
    main()
