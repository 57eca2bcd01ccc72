"""The compiled cross-rank check runs before every collective of the call, by data dependency.

Under `torch.compile` the check's all-gather is issued at the top of the call and its wait and
assertions are emitted just before the kernel's first collective (`settle_before`), inside the
opaque op `lossfx::assert_agreement`, whose token that collective reads. Safety then rests on one
property of the traced forward graph, tested here for every public entry point of the adversarial
suite (`adversarial_cases.TARGETS`, 2 gloo processes): every collective other than the check's own
all-gather, and every lossfx custom op passed a process group's name (it runs collectives inside),
is a descendant of the assertions: it reads their token (`where(token, 0, x)`). A collective that
does not could be scheduled before the assertions and, with ranks that disagree, abort or hang
before the check can raise. Read off the forward graph that
AOT autograd hands the compiler: functional, with autograd.Functions inlined, as Inductor sees it.
"""

from __future__ import annotations

import adversarial_cases
import pytest
import torch
from harness import gloo_pool

import lossfx  # noqa: F401  (registers the lossfx custom ops in this process)
from lossfx._boundary.consistency import SIGNATURE_LEN

COLLECTIVES = "_c10d_functional"
# one of each structure: plain logits, a top-k first pass (extern), fused LM head (autograd.Function,
# opaque op with collectives), a divergence, a CP layout, a packed CP layout
DEFAULT_TARGETS = [
    "token_logprobs",
    "prepare_loss_input[LOGPROB]",
    "linear_logprob_objective",
    "reverse_kl_to_fixed",
    "next_token_logprobs[cp]",
    "prepare_packed_loss_input[cp]",
]


def _forward_graph(rank, world, group, target):
    """The forward FX graph of the compiled call of `target` (AOT autograd's, as the compiler gets it)
    as `[(name, target, input names, numel of an int64 output or -1, whether a process group's
    name is an argument)]`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    cfg = dict(adversarial_cases.DEFAULT)
    call, _ = adversarial_cases.TARGETS[target](cfg, rank, group)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend=aot_autograd(fw_compiler=record), fullgraph=True)
    compiled()
    nodes = []
    for node in graphs[0].graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        numel = val.numel() if isinstance(val, torch.Tensor) and val.dtype == torch.int64 else -1
        inputs = [a.name for a in node.all_input_nodes]
        names = {g.group_name for g in (group, getattr(group, "cp_group", None)) if g is not None}
        grouped = any(isinstance(a, str) and a in names for a in (*node.args, *node.kwargs.values()))
        nodes.append((node.name, str(node.target), inputs, numel, grouped))
    return nodes


def _order_violations(nodes) -> list[str]:
    """What breaks the property (see the module doc) in one forward graph."""
    producers = {name: inputs for name, _, inputs, *_ in nodes}
    consumers: dict[str, list[str]] = {name: [] for name, *_ in nodes}
    for name, _, inputs, *_ in nodes:
        for i in inputs:
            consumers.setdefault(i, []).append(name)

    def closure(start: list[str], edges: dict[str, list[str]]) -> set[str]:
        seen, todo = set(), list(start)
        while todo:
            n = todo.pop()
            for m in edges.get(n, []):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    asserts = [name for name, t, *_ in nodes if t == "lossfx.assert_agreement.default"]
    ancestors = closure(asserts, producers)
    descendants = closure(asserts, consumers)
    signatures = 2 * SIGNATURE_LEN  # the check's own all-gather: [R·L] int64 signatures, R = 2
    bad = []
    for name, t, _, numel, grouped in nodes:
        collective = t.startswith(COLLECTIVES) and not t.endswith("wait_tensor.default")
        opaque = t.startswith("lossfx.") and t != "lossfx.assert_agreement.default" and grouped
        if not (collective or opaque):
            continue
        if collective and numel == signatures and (name in ancestors or not asserts):
            continue  # the check's exchange (without an assertions op: no collective follows it)
        if name not in descendants:
            bad.append(f"{name} ({t}) runs collectives and does not read the check's token")
    return bad


@pytest.mark.compile
@pytest.mark.parametrize(
    "target",  # the default tier: one of each structure; the others in the slow tier
    [t if t in DEFAULT_TARGETS else pytest.param(t, marks=pytest.mark.slow) for t in adversarial_cases.TARGETS],
)
def test_every_collective_waits_for_the_compiled_check(target):
    graphs = gloo_pool(2).run(_forward_graph, target)
    for rank, nodes in enumerate(graphs):
        assert any(t.startswith(COLLECTIVES) for _, t, *_ in nodes), f"{target}: no collective traced on rank {rank}"
        assert not _order_violations(nodes), (target, rank, _order_violations(nodes))


def test_the_order_rule_can_fail():
    """A graph with a collective beside the assertions (neither feeding them nor reading their
    token) is reported; the same graph with the token read is not."""
    sig = 2 * SIGNATURE_LEN
    gather = "_c10d_functional.all_gather_into_tensor.default"
    base = [
        ("sig_gather", gather, [], sig, True),
        ("wait", "_c10d_functional.wait_tensor.default", ["sig_gather"], sig, False),
        ("local", "aten.amax.default", [], -1, False),
        ("agree", "lossfx.assert_agreement.default", ["local", "wait"], -1, False),
        ("x", "aten.where.self", ["agree", "local"], -1, False),
    ]
    stray = [*base, ("kernel_gather", gather, ["local"], -1, True)]
    assert _order_violations(stray) and "kernel_gather" in _order_violations(stray)[0]
    opaque = [*base, ("rows", "lossfx.linear_objective_rows.default", ["local"], -1, True)]
    assert _order_violations(opaque) and "rows" in _order_violations(opaque)[0]
    local_op = [*base, ("stats", "lossfx.projected_teacher_stats.default", ["local"], -1, False)]
    ordered = [*local_op, ("kernel_gather", gather, ["x"], -1, True)]
    assert _order_violations(ordered) == []
