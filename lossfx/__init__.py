"""lossfx: exact, compile-first loss inputs from (sharded) language-model logits.

Public surface: the NeMo-RL-compatible entry points (`prepare_loss_input`,
`prepare_packed_loss_input`, `prepare_opd_full_loss_input`), their types, the stateless kernels
beneath them, and `lossfx.reference`, the dense float64 reference of everything.
"""

from lossfx import reference
from lossfx.interfaces import (
    LossFunction,
    LossInputType,
    TrainingSamplingParams,
    need_top_k_or_top_p_filtering,
)
from lossfx.logprobs import token_logprobs, token_logprobs_with_lse
from lossfx.loss_input import (
    next_token_logprobs,
    prepare_loss_input,
    prepare_opd_full_loss_input,
    prepare_packed_loss_input,
)

__version__ = "0.1.0"

__all__ = [
    "LossFunction",
    "LossInputType",
    "TrainingSamplingParams",
    "__version__",
    "need_top_k_or_top_p_filtering",
    "next_token_logprobs",
    "prepare_loss_input",
    "prepare_opd_full_loss_input",
    "prepare_packed_loss_input",
    "reference",
    "token_logprobs",
    "token_logprobs_with_lse",
]
