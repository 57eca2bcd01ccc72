"""Pure kernels: plain tensors and value objects (`lossfx._core.vocab.VocabRange`) in, no
argument validation, no DTensor, no cross-rank check (those are the public functions' boundary)."""
