"""lossfx.integrations.trl: TRL's per-token log-probs and entropies through the fused head.

`per_token_logps_and_entropies` against its dense float64 definition (values and gradients at
1e-10: temperature, `logits_to_keep`, padding, `-100` labels, padding-free rows), against TRL's own
fused LM head on a tiny Qwen2 in fp32, the mixin against the stock `GRPOTrainer` method, the
DTensor head rules on 2 gloo ranks, and the lazy import. The TRL parts skip without `trl`.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from devices import DEVICE
from harness import gloo_pool

import lossfx
from lossfx import reference
from lossfx.integrations import trl as lossfx_trl

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-10}


def make_case(seed=0, batch=3, seq=10, hidden_size=6, vocab=20, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen, dtype=F64).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, dtype=F64) * 3 / math.sqrt(hidden_size)).to(dtype)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding
    return hidden, weight, input_ids, mask


def dense(hidden, weight, input_ids, mask, keep, temperature, labels=None, position_ids=None, **head):
    """The docstring's dense equivalent, float64 (TRL's definition; `head`: bias, logit_scale, softcap)."""
    if labels is None:
        labels = input_ids.masked_fill(mask == 0, -100)
    labels = labels[:, 1:]
    lp, ne = reference.linear_token_logprobs(hidden[:, :-1], weight, labels.clamp(min=0), temperature, **head)
    ok = (labels != -100) & (mask[:, 1:] != 0)
    if position_ids is not None:
        ok = ok & (position_ids[:, 1:] != 0)
    return torch.where(ok, lp, 0.0)[:, -keep:], torch.where(ok, -ne, 0.0)[:, -keep:]


@pytest.mark.parametrize(("keep", "temperature", "use_labels", "padding_free"), [
    (4, 1.0, False, False), (9, 0.7, False, False), (5, 1.3, True, False), (9, 1.0, False, True),
])  # fmt: skip
def test_matches_dense_definition(keep, temperature, use_labels, padding_free):
    hidden, weight, input_ids, mask = make_case()
    labels = position_ids = None
    if use_labels:
        labels = input_ids.clone()
        labels[:, -3] = -100  # a masked completion token
        labels[2, -1] = -100
    if padding_free:
        position_ids = torch.cat([torch.arange(4), torch.arange(6)]).expand(3, 10).clone()
        mask = torch.ones_like(mask)
    inputs_before = (input_ids.clone(), mask.clone(), None if labels is None else labels.clone())
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = lossfx_trl.per_token_logps_and_entropies(
        h, w, input_ids, mask, logits_to_keep=keep, temperature=temperature, compute_entropy=True,
        labels=labels, position_ids=position_ids, chunk_size=4,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    dlp, dent = torch.randn(lp.shape, generator=gen, dtype=F64), torch.randn(lp.shape, generator=gen, dtype=F64)
    dh, dw = torch.autograd.grad([lp, ent], [h, w], [dlp, dent])
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    rlp, rent = dense(h2, w2, input_ids, mask, keep, temperature, labels, position_ids)
    rdh, rdw = torch.autograd.grad([rlp, rent], [h2, w2], [dlp, dent])
    assert lp.shape == (3, keep)
    for got, want in ((lp, rlp), (ent, rent), (dh, rdh), (dw, rdw)):
        torch.testing.assert_close(got, want, **TIGHT)
    assert (rlp == 0).any() and (rlp != 0).any()  # masked and scored positions both present
    assert (ent >= 0).all()  # TRL's sign: entropy, not Σ p log p
    assert torch.equal(input_ids, inputs_before[0]) and torch.equal(mask, inputs_before[1])
    if labels is not None:
        assert torch.equal(labels, inputs_before[2])


@pytest.mark.parametrize(("top_k", "top_p", "with_head"), [(5, 1.0, False), (None, 0.8, False), (8, 0.9, True)])
def test_filtered_logps_match_the_dense_filtered_distribution(top_k, top_p, with_head):
    hidden, weight, input_ids, mask = make_case(seed=6)
    head = {}
    if with_head:  # bias, logit scale, soft-cap on the logits path too
        head = {"bias": torch.randn(20, generator=torch.Generator().manual_seed(9), dtype=F64), "logit_scale": 1.5}
        head["softcap"] = 2.0
    keep, temperature = 6, 0.8
    params = lossfx.TrainingSamplingParams(top_k=top_k, top_p=top_p)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = lossfx_trl.per_token_logps_and_entropies(
        h, w, input_ids, mask, logits_to_keep=keep, temperature=temperature, compute_entropy=True,
        sampling_params=params, **head,
    )  # fmt: skip
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = reference.linear_logits(
        h2, w2, temperature, head.get("bias"), head.get("logit_scale", 1.0), head.get("softcap")
    )
    ok = (input_ids.masked_fill(mask == 0, -100)[:, 1:] != -100)[:, -keep:]
    rlp = reference.next_token_filtered_logprobs(z, input_ids, top_k, top_p)[:, -keep:]
    rlp = torch.where(ok, rlp, 0.0)
    rent = dense(h2, w2, input_ids, mask, keep, temperature, **head)[1]
    torch.testing.assert_close(lp, rlp, **TIGHT)
    torch.testing.assert_close(ent, rent, **TIGHT)
    assert torch.isneginf(lp).any() and (lp[ok & torch.isfinite(lp)] < 0).all()  # some targets filtered out
    gen = torch.Generator().manual_seed(7)
    dlp = torch.randn(lp.shape, generator=gen, dtype=F64) * torch.isfinite(lp)  # no gradient into −inf
    dent = torch.randn(lp.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad([lp, ent], [h, w], [dlp, dent])
    finite = torch.where(torch.isfinite(rlp), rlp, 0.0)
    want = torch.autograd.grad([finite, rent], [h2, w2], [dlp, dent])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **TIGHT)


def test_head_options_match_dense_definition():
    """bias, logit scale and soft-cap: values and gradients (bias included) against float64."""
    hidden, weight, input_ids, mask = make_case(seed=3)
    bias = torch.randn(20, generator=torch.Generator().manual_seed(4), dtype=F64)
    labels = input_ids.clone()
    labels[1, -4] = -100
    head = {"logit_scale": 1.7, "softcap": 2.5}
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    lp, ent = lossfx_trl.per_token_logps_and_entropies(
        h, w, input_ids, mask, logits_to_keep=7, temperature=0.9, compute_entropy=True, labels=labels, bias=b,
        chunk_size=4, **head,
    )  # fmt: skip
    h2, w2, b2 = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    rlp, rent = dense(h2, w2, input_ids, mask, 7, 0.9, labels, bias=b2, **head)
    gen = torch.Generator().manual_seed(5)
    dlp, dent = torch.randn(lp.shape, generator=gen, dtype=F64), torch.randn(lp.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad([lp, ent], [h, w, b], [dlp, dent])
    want = torch.autograd.grad([rlp, rent], [h2, w2, b2], [dlp, dent])
    for g, r in zip((lp, ent, *got), (rlp, rent, *want)):
        torch.testing.assert_close(g, r, **TIGHT)
    plain = dense(hidden, weight, input_ids, mask, 7, 0.9, labels)[0]
    assert (plain - rlp).abs().max() > 0.1  # the options change the answer


@pytest.mark.parametrize(("hidden_dtype", "head_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, F64)])
def test_mixed_dtypes_need_no_cast(hidden_dtype, head_dtype):
    """A bf16 backbone with an fp32 head (or fp32 with float64): the matmuls run in the promoted
    dtype, the result is in it, and each input's gradient comes back in its own dtype."""
    hidden, weight, input_ids, mask = make_case(seed=2)
    hid, wt = hidden.to(hidden_dtype).requires_grad_(), weight.to(head_dtype).requires_grad_()
    lp, ent = lossfx_trl.per_token_logps_and_entropies(hid, wt, input_ids, mask, logits_to_keep=5, compute_entropy=True)
    assert lp.dtype == ent.dtype == head_dtype
    dh, dw = torch.autograd.grad(lp.sum() + ent.sum(), [hid, wt])
    assert dh.dtype == hidden_dtype and dw.dtype == head_dtype
    h2, w2 = hid.detach().double().requires_grad_(), wt.detach().double().requires_grad_()
    rlp, rent = dense(h2, w2, input_ids, mask, 5, 1.0)
    rdh, rdw = torch.autograd.grad(rlp.sum() + rent.sum(), [h2, w2])
    tol = TIGHT if head_dtype == F64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(lp.double(), rlp, **tol)
    torch.testing.assert_close(ent.double(), rent, **tol)
    torch.testing.assert_close(dw.double(), rdw, **tol)
    torch.testing.assert_close(dh, rdh.to(hidden_dtype), **({} if head_dtype != F64 else TIGHT))  # dtype's rounding


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logits_to_keep": 0}, ValueError, r"logits_to_keep must lie in \[1, S-1\] = \[1, 9\].*got 0"),
        ({"logits_to_keep": 10}, ValueError, r"logits_to_keep must lie in .* got 10"),
        ({"logits_to_keep": 2.0}, TypeError, "logits_to_keep must be an int"),
        ({"labels": torch.full((3, 9), 1).to(DEVICE)}, ValueError, r"labels must have input_ids' shape \(3, 10\)"),
        ({"labels": torch.full((3, 10), -5).to(DEVICE)}, ValueError, r"input_ids must lie in \[0, 20\).*-5"),
        ({"sharded_head": "shard"}, ValueError, "sharded_head must be"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    hidden, weight, input_ids, mask = make_case()
    with pytest.raises(error, match=match):
        lossfx_trl.per_token_logps_and_entropies(hidden, weight, input_ids, mask, **kwargs)


def test_importing_the_integration_imports_neither_trl_nor_transformers():
    code = "import sys, lossfx.integrations.trl; print(sorted({'trl', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# Against TRL itself (fp32, a tiny random Qwen2)
# ---------------------------------------------------------------------------------------------


def test_filtered_padding_free_rows_and_labels():
    """Padding-free rows (`position_ids`) and `-100` labels under a filter: a position scoring the
    next sequence's first token or a masked label gives 0 with a zero gradient, the rest are the
    float64 filtered log-probs (values and gradients at 1e-10)."""
    hidden, weight, input_ids, mask = make_case(seed=25)
    mask = torch.ones_like(mask)
    position_ids = torch.cat([torch.arange(4), torch.arange(6)]).expand(3, 10).clone()
    labels = input_ids.clone()
    labels[:, -2] = -100
    params = lossfx.TrainingSamplingParams(top_k=6, top_p=0.9, ties="sorted")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, _ = lossfx_trl.per_token_logps_and_entropies(
        h, w, input_ids, mask, logits_to_keep=9, temperature=0.9, labels=labels, position_ids=position_ids,
        sampling_params=params,
    )  # fmt: skip
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = reference.linear_logits(h2, w2, 0.9)
    ok = (labels[:, 1:] != -100) & (position_ids[:, 1:] != 0)
    rlp = torch.where(ok, reference.next_token_filtered_logprobs(z, input_ids, 6, 0.9, "sorted"), 0.0)
    torch.testing.assert_close(lp, rlp, **TIGHT)
    assert (lp[~ok] == 0).all() and torch.isneginf(lp).any() and torch.isfinite(lp[ok]).any()
    got = torch.autograd.grad(finite_sum(lp), [h, w])
    want = torch.autograd.grad(finite_sum(rlp), [h2, w2])
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **TIGHT)


class _MaxNumel(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any op (forward or backward) returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _logits_path(hidden, weight, input_ids, mask, keep, temperature, params, bias=None, logit_scale=1.0, softcap=None):
    """The filtered log-probs as the integration computed them before the fused path (and as any
    user can): the `[B, S, V]` logits in the inputs' dtype, then `lossfx.next_token_logprobs`."""
    z = hidden.float() @ weight.T if hidden.dtype != weight.dtype else hidden @ weight.T
    z = (z if bias is None else z + bias) * logit_scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    labels = input_ids.masked_fill(mask == 0, -100)
    lp = lossfx.next_token_logprobs(z / temperature, labels.clamp(min=0), sampling_params=params)
    return torch.where(labels[:, 1:] != -100, lp, 0.0)[:, -keep:]


@pytest.mark.parametrize(
    ("top_k", "top_p", "ties", "hidden_dtype", "with_head"),
    [
        (20, 0.9, "together", torch.float32, False),
        (None, 0.8, "sorted", torch.float32, True),
        (8, 1.0, "together", torch.bfloat16, False),  # a bf16 backbone, an fp32 head (TRL's cast_lm_head_to_fp32)
    ],
)
def test_filtered_fused_fp32_matches_the_logits_path(top_k, top_p, ties, hidden_dtype, with_head):
    """The loss step in fp32: the fused filtered log-probs and their gradients against the logits
    path's (`[B, S, V]` logits, `lossfx.next_token_logprobs`). Tolerance: both are measured
    against the float64 answer from the same (rounded) inputs, and the fused path may be off by at
    most twice the logits path's own fp32 error plus 1e-6; the filter (which tokens are `-inf`) is
    the same. No op in the fused call, forward or backward, returns a `[B, K, V]`-sized tensor."""
    hidden, weight, input_ids, mask = make_case(seed=21, batch=4, seq=40, hidden_size=16, vocab=300)
    hidden, weight = hidden.to(hidden_dtype), weight.float()
    gen = torch.Generator().manual_seed(22)
    head = {"bias": torch.randn(300, generator=gen), "logit_scale": 1.3, "softcap": 6.0} if with_head else {}
    keep, temperature = 32, 0.7
    params = lossfx.TrainingSamplingParams(top_k=top_k, top_p=top_p, ties=ties)
    dlp = torch.randn(4, keep, generator=gen, dtype=F64)

    def loss_and_grads(fn, h, w, head):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp = fn(h, w, head)
        g = dlp.to(lp.dtype) * torch.isfinite(lp)  # no gradient into -inf
        dh, dw = torch.autograd.grad(torch.where(torch.isfinite(lp), lp, 0.0), [h, w], g)
        return lp.detach().double(), dh.double(), dw.double()

    def fused(h, w, head):
        return lossfx_trl.per_token_logps_and_entropies(
            h, w, input_ids, mask, logits_to_keep=keep, temperature=temperature, sampling_params=params,
            chunk_size=8, **head,
        )[0]  # fmt: skip

    def logits(h, w, head):
        return _logits_path(h, w, input_ids, mask, keep, temperature, params, **head)

    head64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in head.items()}
    want = loss_and_grads(logits, hidden.double(), weight.double(), head64)
    with _MaxNumel() as largest:
        got = loss_and_grads(fused, hidden, weight, head)
    base = loss_and_grads(logits, hidden, weight, head)
    assert got[0].dtype == base[0].dtype and torch.equal(torch.isneginf(got[0]), torch.isneginf(want[0]))
    assert torch.isneginf(want[0]).any() and (want[0] != 0).any()  # the filter drops some scored targets
    for name, g, b, w in zip(("logps", "dhidden", "dweight"), got, base, want):
        finite = torch.isfinite(w)
        err_base = float((b - w)[finite].abs().max())
        err = float((g - w)[finite].abs().max())
        assert err <= 2 * err_base + 1e-6, (name, err, err_base)
    assert largest.largest <= 4 * keep * 300 // 8  # an eighth of the [B, K, V] logits at most (dweight, a chunk)


def test_filtered_tie_rules_on_tied_logits():
    """Integer logits with many ties at top-p's boundary: the fused path keeps exactly the logits
    path's tokens under each tie rule, and the two rules differ on some target (so the rule is
    really passed through)."""
    gen = torch.Generator().manual_seed(24)
    hidden = torch.randint(-1, 2, (3, 30, 8), generator=gen).float()
    weight = torch.randint(-2, 3, (12, 8), generator=gen).float().repeat(4, 1)  # V = 48: each logit 4 times
    input_ids = torch.randint(0, 48, (3, 30), generator=gen)
    mask = torch.ones_like(input_ids)
    masks = {}
    for ties in ("together", "sorted"):
        params = lossfx.TrainingSamplingParams(top_p=0.6, ties=ties)
        got, _ = lossfx_trl.per_token_logps_and_entropies(
            hidden, weight, input_ids, mask, logits_to_keep=24, sampling_params=params
        )
        want = _logits_path(hidden, weight, input_ids, mask, 24, 1.0, params)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), ties
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        masks[ties] = torch.isneginf(got)
    assert not torch.equal(masks["together"], masks["sorted"])


def test_filtered_compiles_fullgraph():
    """`per_token_logps_and_entropies` with a filter under `torch.compile(fullgraph=True)` (the
    mixin's `lossfx_compile`): one graph, the eager values."""
    from torch._dynamo.testing import CompileCounterWithBackend

    hidden, weight, input_ids, mask = make_case(seed=23, vocab=40)
    params = lossfx.TrainingSamplingParams(top_k=10, top_p=0.9)
    kwargs = {"logits_to_keep": 6, "temperature": 0.8, "compute_entropy": True, "sampling_params": params}
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lossfx_trl.per_token_logps_and_entropies, fullgraph=True, backend=counter)
    got = compiled(hidden, weight, input_ids, mask, **kwargs)
    want = lossfx_trl.per_token_logps_and_entropies(hidden, weight, input_ids, mask, **kwargs)
    assert counter.frame_count == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TIGHT)


def tiny_qwen2(vocab=96, seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).float()


class _FakeTrainer(lossfx_trl.LossfxGRPOMixin):
    """What both methods read of a trainer: `accelerator` (unwrap, autocast) and `temperature`."""

    def __init__(self, temperature):
        self.accelerator = SimpleNamespace(
            unwrap_model=lambda m: m, autocast=contextlib.nullcontext, is_main_process=True
        )
        self.temperature = temperature


def _fake_trainer(temperature):
    return _FakeTrainer(temperature)


def test_mixin_matches_stock_grpo_method_values_and_gradients():
    pytest.importorskip("trl")
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_qwen2()
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 96, (4, 12), generator=gen)
    mask = torch.ones_like(input_ids)
    mask[0, :4] = 0
    mask[3, -3:] = 0
    trainer = _fake_trainer(0.8)
    results = []
    for method in (
        GRPOTrainer._get_per_token_logps_and_entropies,
        lossfx_trl.LossfxGRPOMixin._get_per_token_logps_and_entropies,
    ):
        model.zero_grad()
        lp, ent, aux = method(trainer, model, input_ids, mask, 7, batch_size=3, compute_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), aux, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_t, ent_t, aux_t, g_t), (lp_l, ent_l, aux_l, g_l) = results
    assert aux_t is None and aux_l is None and lp_l.shape == (4, 7)
    # fp32 both; different summation orders: rounding-level agreement
    torch.testing.assert_close(lp_l, lp_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_l, ent_t, rtol=1e-5, atol=1e-5)
    for name in g_t:
        torch.testing.assert_close(g_l[name], g_t[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert (lp_t == 0).any() and (lp_t != 0).any()


def test_mixin_filtered_mode_scores_the_samplers_distribution():
    model = tiny_qwen2()
    trainer = _fake_trainer(0.9)
    trainer.top_k, trainer.top_p, trainer.lossfx_filtered_logprobs = 10, 0.95, True
    input_ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(input_ids)
    lp, _, _ = lossfx_trl.LossfxGRPOMixin._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, 5)
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    z = hidden.double() @ model.lm_head.weight.double().T / 0.9
    expected = reference.next_token_filtered_logprobs(z, input_ids, 10, 0.95)[:, -5:]
    torch.testing.assert_close(lp.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(expected).any()


_HEADS = {  # model class, config class, the config's logit transform (and Phi's LM-head bias)
    "gemma2-softcap": ("Gemma2ForCausalLM", "Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 2.0}),
    "cohere-logit-scale": ("CohereForCausalLM", "CohereConfig", {"logit_scale": 0.5}),
    "granite-logits-scaling": ("GraniteForCausalLM", "GraniteConfig", {"logits_scaling": 4.0}),
    "phi-bias": ("PhiForCausalLM", "PhiConfig", {}),
}


def tiny_model(kind, vocab=96, seed=0):
    transformers = pytest.importorskip("transformers")
    model_cls, config_cls, extra = _HEADS[kind]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers has no {model_cls}")
    config = getattr(transformers, config_cls)(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).float()


@pytest.mark.parametrize("kind", sorted(_HEADS))
def test_mixin_applies_the_heads_bias_scale_and_softcap(kind):
    """The head's options reach the fused path: equal to the model's own logits and to stock TRL."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    model, temperature = tiny_model(kind), 0.8
    options = lossfx_trl.head_options(model)
    assert (options["bias"] is not None) == (kind == "phi-bias")
    assert (options["softcap"], options["logit_scale"]) == {
        "gemma2-softcap": (2.0, 1.0), "cohere-logit-scale": (None, 0.5),
        "granite-logits-scaling": (None, 0.25), "phi-bias": (None, 1.0),
    }[kind]  # fmt: skip
    input_ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    mask[2, -2:] = 0
    trainer = _fake_trainer(temperature)
    mixin = lossfx_trl.LossfxGRPOMixin._get_per_token_logps_and_entropies
    lp, ent, _ = mixin(trainer, model, input_ids, mask, 6, compute_entropy=True)
    with torch.no_grad():  # the model's own logits (its forward applies the transform), float64
        z = model(input_ids=input_ids, attention_mask=mask).logits.double()[:, -7:-1] / temperature
    ref = z.log_softmax(-1).gather(-1, input_ids[:, -6:, None])[..., 0]
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    ok = mask[:, -6:] != 0
    torch.testing.assert_close(lp.double(), torch.where(ok, ref, 0.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), torch.where(ok, ref_ent, 0.0), rtol=1e-5, atol=1e-5)
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    results = []
    for method in (GRPOTrainer._get_per_token_logps_and_entropies, mixin):
        model.zero_grad()
        lp, ent, _ = method(trainer, model, input_ids, mask, 6, batch_size=2, compute_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_t, ent_t, g_t), (lp_l, ent_l, g_l) = results
    torch.testing.assert_close(lp_l, lp_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_l, ent_t, rtol=1e-5, atol=1e-5)
    assert "lm_head.bias" in g_t or kind != "phi-bias"
    for name in g_t:
        torch.testing.assert_close(g_l[name], g_t[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_trainer_class_is_built_lazily_on_grpo_trainer():
    trl = pytest.importorskip("trl")
    cls = lossfx_trl.LossfxGRPOTrainer
    assert issubclass(cls, trl.GRPOTrainer) and issubclass(cls, lossfx_trl.LossfxGRPOMixin)
    assert cls is lossfx_trl.LossfxGRPOTrainer
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lossfx_trl.Nope  # noqa: B018


# ---------------------------------------------------------------------------------------------
# DTensor heads (FSDP2-style Shard(0) over ranks with different data): never a silent wrong answer
# ---------------------------------------------------------------------------------------------


def _bias():
    return torch.randn(20, generator=torch.Generator().manual_seed(12), dtype=F64)


FILTER = {"top_k": 8, "top_p": 0.7}  # the DTensor heads' filtered cases (V = 20)


def dense_filtered(hidden, weight, input_ids, mask, keep, temperature, bias=None, softcap=None):
    """The filtered log-probs' dense float64 definition: 0 where nothing is scored, `-inf` outside
    the filter, a zero gradient into `-inf` (callers sum `dense_finite`)."""
    z = reference.linear_logits(hidden, weight, temperature, bias, 1.0, softcap)
    lp = reference.next_token_filtered_logprobs(z, input_ids, FILTER["top_k"], FILTER["top_p"])
    return torch.where(input_ids.masked_fill(mask == 0, -100)[:, 1:] != -100, lp, 0.0)[:, -keep:]


def finite_sum(lp):
    return torch.where(torch.isfinite(lp), lp, 0.0).sum()


def _dtensor_heads(rank, world, group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    hidden, weight, input_ids, mask = make_case(seed=5, vocab=20)
    own = make_case(seed=10 + rank, vocab=20)[0]  # data parallel: each rank its own hidden states
    out = {}
    sharded = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    try:
        lossfx_trl.per_token_logps_and_entropies(own, sharded, input_ids, mask, logits_to_keep=4)
        out["raised"] = ""
    except ValueError as e:
        out["raised"] = str(e)
    lp, _ = lossfx_trl.per_token_logps_and_entropies(
        own, sharded, input_ids, mask, logits_to_keep=4, sharded_head="gather"
    )
    lp.sum().backward()
    out["gather"], out["gather_grad"] = lp.detach(), sharded.grad.to_local()
    out["gather_ref"] = dense(own, weight, input_ids, mask, 4, 1.0)[0]
    tp = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None)
    out["tp"] = lossfx_trl.per_token_logps_and_entropies(
        hidden, tp, input_ids, mask, logits_to_keep=4, sharded_head="tensor_parallel"
    )[0]
    out["tp_ref"] = dense(hidden, weight, input_ids, mask, 4, 1.0)[0]
    # a sharded bias follows the weight's rule: gathered (mean gradient) or a vocabulary shard
    bias = _bias()
    w2 = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    b2 = distribute_tensor(bias, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    lp, _ = lossfx_trl.per_token_logps_and_entropies(
        own, w2, input_ids, mask, logits_to_keep=4, sharded_head="gather", bias=b2, softcap=3.0
    )
    lp.sum().backward()
    out["bias_gather"], out["bias_grad"] = lp.detach(), b2.grad.to_local()
    out["bias_gather_ref"] = dense(own, weight, input_ids, mask, 4, 1.0, bias=bias, softcap=3.0)[0]
    tb = distribute_tensor(bias, mesh, [Shard(0)], src_data_rank=None)
    out["bias_tp"] = lossfx_trl.per_token_logps_and_entropies(
        hidden, tp, input_ids, mask, logits_to_keep=4, sharded_head="tensor_parallel", bias=tb, softcap=3.0
    )[0]
    out["bias_tp_ref"] = dense(hidden, weight, input_ids, mask, 4, 1.0, bias=bias, softcap=3.0)[0]
    # the sampler's filter: the fused filtered kernel under either sharded-head rule
    params = lossfx.TrainingSamplingParams(**FILTER)
    w3 = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    lp, _ = lossfx_trl.per_token_logps_and_entropies(
        own, w3, input_ids, mask, logits_to_keep=4, sharded_head="gather", sampling_params=params, chunk_size=2
    )
    finite_sum(lp).backward()
    out["filtered_gather"], out["filtered_grad"] = lp.detach(), w3.grad.to_local()
    out["filtered_gather_ref"] = dense_filtered(own, weight, input_ids, mask, 4, 1.0)
    h4 = hidden.clone().requires_grad_()
    w4 = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    b4 = distribute_tensor(bias, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    lp, ent = lossfx_trl.per_token_logps_and_entropies(
        h4, w4, input_ids, mask, logits_to_keep=4, sharded_head="tensor_parallel", bias=b4, softcap=3.0,
        temperature=0.8, sampling_params=params, compute_entropy=True,
    )  # fmt: skip
    (finite_sum(lp) + 0.5 * ent.sum()).backward()
    out["filtered_tp"], out["filtered_tp_ent"] = lp.detach(), ent.detach()
    out["filtered_tp_grads"] = (h4.grad, w4.grad.to_local(), b4.grad.to_local())
    rep = distribute_tensor(weight, mesh, [Replicate()], src_data_rank=None)
    out["replicated"] = lossfx_trl.per_token_logps_and_entropies(hidden, rep, input_ids, mask, logits_to_keep=4)[0]
    return out


@pytest.mark.distributed
def test_dtensor_heads_raise_gather_or_run_tensor_parallel():
    results = gloo_pool(2).run(_dtensor_heads)
    w = make_case(seed=5, vocab=20)[1].clone().requires_grad_()
    # gather: the head's gradient is the mean over ranks (FSDP2's reduction), each rank its own data
    total = sum(
        dense(make_case(seed=10 + r, vocab=20)[0], w, *make_case(seed=5, vocab=20)[2:], 4, 1.0)[0].sum()
        for r in range(2)
    )
    (dw,) = torch.autograd.grad(total / 2, w)
    b = _bias().requires_grad_()
    total_b = sum(
        dense(make_case(seed=10 + r, vocab=20)[0], w.detach(), *make_case(seed=5, vocab=20)[2:], 4, 1.0, bias=b,
              softcap=3.0)[0].sum()
        for r in range(2)
    )  # fmt: skip
    (db,) = torch.autograd.grad(total_b / 2, b)
    # filtered, gather: the mean over both ranks' data; tensor parallel: one batch, the full gradients
    _, _, input_ids, mask = make_case(seed=5, vocab=20)
    total_f = sum(
        finite_sum(dense_filtered(make_case(seed=10 + r, vocab=20)[0], w, input_ids, mask, 4, 1.0)) for r in range(2)
    )
    (dw_filtered,) = torch.autograd.grad(total_f / 2, w)
    h = make_case(seed=5, vocab=20)[0].clone().requires_grad_()
    w, b = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    lp_tp = dense_filtered(h, w, input_ids, mask, 4, 0.8, bias=b, softcap=3.0)
    ent_tp = dense(h, w, input_ids, mask, 4, 0.8, bias=b, softcap=3.0)[1]
    (finite_sum(lp_tp) + 0.5 * ent_tp.sum()).backward()
    lp_tp, ent_tp = lp_tp.detach(), ent_tp.detach()
    for rank, res in enumerate(results):
        assert "placements (Shard(dim=0),)" in res["raised"] and "sharded_head='gather'" in res["raised"]
        torch.testing.assert_close(res["gather"], res["gather_ref"], **TIGHT)
        torch.testing.assert_close(res["gather_grad"], dw[rank * 10 : (rank + 1) * 10], **TIGHT)
        torch.testing.assert_close(res["tp"], res["tp_ref"], **TIGHT)
        torch.testing.assert_close(res["replicated"], res["tp_ref"], **TIGHT)
        torch.testing.assert_close(res["bias_gather"], res["bias_gather_ref"], **TIGHT)
        torch.testing.assert_close(res["bias_grad"], db[rank * 10 : (rank + 1) * 10], **TIGHT)
        torch.testing.assert_close(res["bias_tp"], res["bias_tp_ref"], **TIGHT)
        torch.testing.assert_close(res["filtered_gather"], res["filtered_gather_ref"], **TIGHT)
        torch.testing.assert_close(res["filtered_grad"], dw_filtered[rank * 10 : (rank + 1) * 10], **TIGHT)
        torch.testing.assert_close(res["filtered_tp"], lp_tp, **TIGHT)
        torch.testing.assert_close(res["filtered_tp_ent"], ent_tp, **TIGHT)
        for got, want in zip(
            res["filtered_tp_grads"], (h.grad, w.grad[rank * 10 : (rank + 1) * 10], b.grad[rank * 10 : (rank + 1) * 10])
        ):
            torch.testing.assert_close(got, want, **TIGHT)
    assert torch.isneginf(lp_tp).any()  # the filter drops some scored targets
