"""lossfx: exact, compile-first loss inputs from (sharded) language-model logits.

Public surface: the NeMo-RL-compatible entry points (`prepare_loss_input`,
`prepare_packed_loss_input`, `prepare_opd_full_loss_input`), their types, the stateless kernels
beneath them, and `lossfx.reference`, the dense float64 reference of everything.
"""

from lossfx import reference
from lossfx._core.chunking import CPU_POLICY, GPU_POLICY, ChunkPolicy, chunk_policy
from lossfx.context_parallel import allgather_cp, shard_for_cp_rank, unshard
from lossfx.distillation import distillation_topk_logprobs
from lossfx.divergence import cross_entropy_to_fixed, entropy, neg_entropy, reverse_kl_to_fixed
from lossfx.draft import draft_targets, map_to_draft_vocab, shift_left
from lossfx.filtering import apply_top_k_top_p, filtered_token_logprobs, top_k_top_p_threshold
from lossfx.fused_linear import linear_gather_logprobs, linear_next_token_logprobs, linear_token_logprobs
from lossfx.gather import gather_logits, gather_logprobs
from lossfx.interfaces import (
    LossFunction,
    LossInputType,
    TrainingSamplingParams,
    need_top_k_or_top_p_filtering,
)
from lossfx.linear_divergence import LinearDivergence, linear_divergence_to_teacher
from lossfx.linear_filtering import linear_filtered_token_logprobs
from lossfx.linear_loss_input import prepare_linear_loss_input, prepare_linear_packed_loss_input
from lossfx.linear_objective import linear_logprob_objective
from lossfx.logprobs import token_logprobs, token_logprobs_with_lse
from lossfx.loss_input import (
    next_token_logprobs,
    prepare_loss_input,
    prepare_opd_full_loss_input,
    prepare_packed_loss_input,
)
from lossfx.loss_masks import mask_out_neg_inf_logprobs
from lossfx.next_token import next_token_filtered_logprobs
from lossfx.opd_full import OnPolicyDistillationFullConfig, reconstruct_opd_full_teacher_logits
from lossfx.topk import vocab_topk

__version__ = "0.1.0"

__all__ = [
    "CPU_POLICY",
    "GPU_POLICY",
    "ChunkPolicy",
    "LinearDivergence",
    "LossFunction",
    "LossInputType",
    "OnPolicyDistillationFullConfig",
    "TrainingSamplingParams",
    "__version__",
    "allgather_cp",
    "apply_top_k_top_p",
    "chunk_policy",
    "cross_entropy_to_fixed",
    "distillation_topk_logprobs",
    "draft_targets",
    "entropy",
    "filtered_token_logprobs",
    "gather_logits",
    "gather_logprobs",
    "linear_divergence_to_teacher",
    "linear_filtered_token_logprobs",
    "linear_gather_logprobs",
    "linear_logprob_objective",
    "linear_next_token_logprobs",
    "linear_token_logprobs",
    "map_to_draft_vocab",
    "mask_out_neg_inf_logprobs",
    "need_top_k_or_top_p_filtering",
    "neg_entropy",
    "next_token_filtered_logprobs",
    "next_token_logprobs",
    "prepare_linear_loss_input",
    "prepare_linear_packed_loss_input",
    "prepare_loss_input",
    "prepare_opd_full_loss_input",
    "prepare_packed_loss_input",
    "reconstruct_opd_full_teacher_logits",
    "reference",
    "reverse_kl_to_fixed",
    "shard_for_cp_rank",
    "shift_left",
    "token_logprobs",
    "token_logprobs_with_lse",
    "top_k_top_p_threshold",
    "unshard",
    "vocab_topk",
]
