"""Bad input under `torch.compile(fullgraph=True)` raises the eager error (issue 15 item 9).

Dynamo turns an exception raised while it traces into `Unsupported: Observed exception`;
`lossfx._boundary.consistency.boundary` (with `lossfx._boundary.compile_errors`) re-raises a public
function's ValueError / TypeError
so that the compiled call raises the same type with the same message as the eager call.
Good input still compiles into one graph (no graph break). The `eager` backend: Dynamo alone.
"""

import re
from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE
from torch._dynamo.testing import CompileCounter

import lossfx

F64 = torch.float64
GEN = torch.Generator().manual_seed(9)
Z = torch.randn(2, 5, 12, generator=GEN, dtype=F64).to(DEVICE)
IDS = torch.randint(0, 12, (2, 5), generator=GEN).to(DEVICE)
HID = torch.randn(2, 5, 4, generator=GEN, dtype=F64).to(DEVICE)
W = torch.randn(12, 4, generator=GEN, dtype=F64).to(DEVICE)
pytestmark = pytest.mark.compile

LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)

# name -> (call with keyword overrides, the overrides that are bad input)
CASES = {
    "token_logprobs/chunk_size": (lambda **kw: lossfx.token_logprobs(Z, IDS, **kw), {"chunk_size": 0}),
    "token_logprobs/float target": (lambda **kw: lossfx.token_logprobs(Z, IDS.float(), **kw), {}),
    "token_logprobs/vocab_start": (lambda **kw: lossfx.token_logprobs(Z, IDS, **kw), {"vocab_start": 3}),
    "filtered_token_logprobs/top_p": (lambda **kw: lossfx.filtered_token_logprobs(Z, IDS, **kw), {"top_p": 1.5}),
    "entropy/group": (lambda **kw: lossfx.neg_entropy(Z, **kw), {"group": "tp"}),
    "gather_logprobs/ids shape": (lambda **kw: lossfx.gather_logprobs(Z, IDS[0], **kw), {}),
    "vocab_topk/k": (lambda **kw: lossfx.vocab_topk(Z, **kw), {"k": 0}),
    "linear_token_logprobs/temperature": (
        lambda **kw: lossfx.linear_token_logprobs(HID, W, IDS, **kw),
        {"temperature": -1.0},
    ),
    "linear_logprob_objective/vocab_size": (
        lambda **kw: lossfx.linear_logprob_objective(HID, W, IDS, torch.ones(2, 5, dtype=F64), **kw),
        {"vocab_size": 20},
    ),
    "prepare_loss_input/input_ids": (
        lambda **kw: lossfx.prepare_loss_input(Z, {"input_ids": IDS[:, :3]}, LOGPROB, **kw),
        {},
    ),
}


def _eager_error(call, bad):
    with pytest.raises((ValueError, TypeError)) as info:
        call(**bad)
    return info.value


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_bad_input_raises_the_eager_error_type_and_message(case):
    call, bad = CASES[case]
    eager = _eager_error(call, bad)
    compiled = torch.compile(lambda: call(**bad), fullgraph=True, backend="eager")
    with pytest.raises(type(eager), match=re.escape(str(eager))) as info:
        compiled()
    assert not isinstance(info.value, torch._dynamo.exc.Unsupported)


@pytest.mark.parametrize(
    "call",
    [
        lambda z, ids: lossfx.token_logprobs(z, ids),
        lambda z, ids: lossfx.filtered_token_logprobs(z, ids, top_k=3, top_p=0.9),
        lambda z, ids: lossfx.prepare_loss_input(z, {"input_ids": ids}, LOGPROB)[0]["next_token_logprobs"],
    ],
    ids=["token_logprobs", "filtered_token_logprobs", "prepare_loss_input"],
)
def test_good_input_compiles_into_one_graph_and_matches_eager(call):
    counter = CompileCounter()
    compiled = torch.compile(call, fullgraph=True, backend=counter)
    torch.testing.assert_close(compiled(Z, IDS), call(Z, IDS), rtol=0, atol=1e-12)
    assert counter.frame_count == 1


def test_the_error_is_raised_in_eager_mode_unchanged():
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0") as info:
        lossfx.token_logprobs(Z, IDS, chunk_size=0)
    assert type(info.value) is ValueError
