"""Dense float64 references: the obvious, unsharded, unchunked maths of every public function.

Every function here takes full-vocabulary, canonical-order tensors, computes in float64 with plain
autograd-differentiable torch ops, and is what the tests, the benchmarks and the self-check compare
lossfx against. Users may import it to check their own kernels.

Conventions shared with the fast paths: a row whose logits are all `-inf` has log-probabilities
`-inf` and a zero gradient (never NaN); `0 · log 0 = 0`.

One module per capability (`_logprobs`, ...); everything is re-exported here.
"""

from lossfx.reference._distillation import (
    distillation_topk_logprobs,
    draft_targets,
    gather_logprobs,
    prepare_distillation_input,
    prepare_draft_input,
    vocab_topk,
)
from lossfx.reference._divergence import (
    cp_shard,
    cross_entropy_to_fixed,
    entropy,
    neg_entropy,
    opd_full_loss_input,
    opd_full_teacher_logits,
    reverse_kl_to_fixed,
)
from lossfx.reference._filtering import (
    apply_top_k_top_p,
    filtered_token_logprobs,
    mask_out_neg_inf_logprobs,
    next_token_filtered_logprobs,
    prepare_filtered_logprob_input,
)
from lossfx.reference._linear import (
    linear_gather_logprobs,
    linear_logits,
    linear_logprob_objective,
    linear_next_token_logprobs,
    linear_token_logprobs,
)
from lossfx.reference._linear_divergence import linear_divergence_to_teacher
from lossfx.reference._linear_filtering import linear_filtered_token_logprobs
from lossfx.reference._linear_loss_input import prepare_linear_loss_input, prepare_linear_packed_loss_input
from lossfx.reference._logprobs import (
    log_softmax,
    next_token_logprobs,
    prepare_loss_input,
    token_logprobs,
)
from lossfx.reference._packing import packed_cp_shard, packed_next_token_logprobs

__all__ = [
    "apply_top_k_top_p",
    "cp_shard",
    "cross_entropy_to_fixed",
    "distillation_topk_logprobs",
    "draft_targets",
    "entropy",
    "filtered_token_logprobs",
    "gather_logprobs",
    "linear_divergence_to_teacher",
    "linear_filtered_token_logprobs",
    "linear_gather_logprobs",
    "linear_logits",
    "linear_logprob_objective",
    "linear_next_token_logprobs",
    "linear_token_logprobs",
    "log_softmax",
    "mask_out_neg_inf_logprobs",
    "neg_entropy",
    "next_token_filtered_logprobs",
    "next_token_logprobs",
    "opd_full_loss_input",
    "opd_full_teacher_logits",
    "packed_cp_shard",
    "packed_next_token_logprobs",
    "prepare_distillation_input",
    "prepare_draft_input",
    "prepare_filtered_logprob_input",
    "prepare_linear_loss_input",
    "prepare_linear_packed_loss_input",
    "prepare_loss_input",
    "reverse_kl_to_fixed",
    "token_logprobs",
    "vocab_topk",
]
