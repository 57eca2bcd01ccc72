"""Dense float64 references: the obvious, unsharded, unchunked maths of every public function.

Every function here takes full-vocabulary, canonical-order tensors, computes in float64 with plain
autograd-differentiable torch ops, and is what the tests, the benchmarks and the self-check compare
lossfx against. Users may import it to check their own kernels.

Conventions shared with the fast paths: a row whose logits are all `-inf` has log-probabilities
`-inf` and a zero gradient (never NaN); `0 · log 0 = 0`.

One module per capability (`_logprobs`, ...); everything is re-exported here.
"""

from lossfx.reference._logprobs import (
    log_softmax,
    next_token_logprobs,
    prepare_loss_input,
    token_logprobs,
)

__all__ = [
    "log_softmax",
    "next_token_logprobs",
    "prepare_loss_input",
    "token_logprobs",
]
