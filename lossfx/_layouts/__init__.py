"""Pure sequence layouts around the kernels: plain tensors, a `SequenceLayout` and a
`VocabRange` in; no argument validation, no DTensor, no cross-rank check."""
