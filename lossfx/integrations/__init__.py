"""Integrations with training frameworks; each module imports its framework lazily.

`lossfx.integrations.trl`: TRL's per-token log-probs and entropies from hidden states and an LM
head through the fused path, and a `GRPOTrainer` mixin built on it.
"""
