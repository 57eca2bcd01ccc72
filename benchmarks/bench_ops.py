"""Kernel launches per eager call (forward + backward) of every logits path, and its host reads.

    python -m benchmarks.bench_ops                    # [1, 16384, 151936] bf16 under the GPU policy
    python -m benchmarks.bench_ops --json out.json    # also write the table as JSON

On a GPU every eager aten op that computes launches (at least) one kernel, ~5 µs each, so the op
count of a call bounds its launch overhead from below. A `TorchDispatchMode` counts the aten ops of
one call and of its backward (from upstream gradients made outside the count). Excluded, since
they launch nothing on a GPU: views (`OpOverload.is_view`: `view`, `slice`, `select`, `unsqueeze`,
`expand`, `permute`, `transpose`, `as_strided`, `unbind`, ...), `_unsafe_view`, `alias`,
`detach`, `lift_fresh`, the allocations `empty*` / `new_empty*`, `scalar_tensor` (a Python
scalar wrapped as a 0-dim host tensor), ops that return no tensor (`promote_types`), and the host
reads, which are counted apart (`HOST_READS`, as in `bench_syncs`).

The full-size shape does not fit a CPU (one fp32 `[16384, 151936]` temporary is 10 GB), so the
calls run on the `meta` device: every op is dispatched with its real shape and nothing is
computed. `policy_for(meta)` is the GPU policy, so the chunk counts are those of a GPU. Checks that
read values are skipped on `meta`, so host reads are counted on a CPU call of the same path at a
small shape with the GPU policy forced (what they read does not depend on the size).
`tests/test_bench_ops.py` checks that a CPU call and a `meta` call at one shape and one chunking
dispatch the same ops, and pins the published counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import warnings
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import lossfx
from lossfx._core.chunking import GPU_POLICY, ChunkPolicy, chunk_policy, default_chunk_rows

HOST_READS = ("_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal")
NO_LAUNCH = (
    "scalar_tensor",  # a Python scalar wrapped as a 0-dim host tensor (`where(m, x, 0.0)`): no kernel
    "_unsafe_view",
    "alias",
    "detach",
    "lift_fresh",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
)
FULL = (1, 16384, 151936)  # [B, S, V]
K_DISTILL = 64  # teacher top-k of DISTILLATION, ids of gather_logprobs
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "ops.json"
BUDGET = 1000  # kernel launches per call, at most (issue 17)
SMALL = (1, 64, 1000)  # the pinned small shape: 4 chunks of 16 rows under SMALL_POLICY
SMALL_POLICY = ChunkPolicy(row_bytes=16 * 1000 * 4, min_rows=1, tile_bytes=1 << 20, max_block=2048)


def launches(op: torch._ops.OpOverload) -> bool:
    """Whether `op` launches a kernel on a GPU (see the module doc for what is excluded)."""
    name = op.overloadpacket.__name__
    return not (op.is_view or name in NO_LAUNCH or name in HOST_READS)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: `.launches` (kernel-launching), `.reads`, `.ops`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in HOST_READS:
            self.reads += 1
        elif launches(func) and any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):
            self.launches += 1  # (ops that return no tensor, e.g. `promote_types`, compute on the host)
            self.ops[name] += 1
        return out


def _float_outputs(out: Any) -> list[torch.Tensor]:
    """The differentiable tensors of a path's output (tensors, tuples, dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, list | tuple):
        return [t for x in out for t in _float_outputs(x)]
    return []


def count_call(call: Callable[[], Any]) -> OpCounter:
    """Ops of `call()` and of its backward (upstream gradients of ones, made outside the count)."""
    counter = OpCounter()
    with counter:
        out = call()
    outputs = _float_outputs(out)
    if outputs:
        grads = [torch.ones_like(t) for t in outputs]
        with counter:
            torch.autograd.backward(outputs, grads)
    return counter


def inputs(shape: tuple[int, int, int], dtype: torch.dtype, device: str) -> SimpleNamespace:
    """Fresh inputs of every path at `[B, S, V]` (seeded; on `meta`: shapes only)."""
    b, s, v = shape
    k = min(K_DISTILL, v)
    gen = torch.Generator().manual_seed(0)

    def randn(*size: int, grad: bool = False) -> torch.Tensor:
        x = torch.empty(size, dtype=dtype, device=device)
        if device != "meta":
            x.copy_(torch.randn(size, generator=gen))
        return x.requires_grad_(grad)

    def ids(*size: int) -> torch.Tensor:
        if device == "meta":
            return torch.empty(size, dtype=torch.int64, device=device)
        return torch.randint(0, v, size, generator=gen).to(device)

    return SimpleNamespace(
        z=randn(b * s, v, grad=True),  # [N, V] kernels' logits
        teacher=randn(b * s, v),
        target=ids(b * s),
        ids=ids(b * s, k),
        logits=randn(b, s, v, grad=True),  # [B, S, V] entry points' logits
        teacher_logits=randn(b, s, v),
        input_ids=ids(b, s),
        mask=torch.ones(b, s, device=device),
        topk_logits=randn(b, s, k),
        topk_ids=ids(b, s, k),
        packed_ids=ids(2, s // 2),
        packed_mask=torch.ones(2, s // 2, device=device),
        cu_seqlens=(0, s // 2, s),
    )


_LOGPROB = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
_KL = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB, reference_policy_kl_penalty=0.1)
_TOP_KP = lossfx.TrainingSamplingParams(top_k=50, top_p=0.9)
_TOP_P = lossfx.TrainingSamplingParams(top_p=0.9)
_DISTILL = SimpleNamespace(input_type=lossfx.LossInputType.DISTILLATION, zero_outside_topk=True, kl_type="forward")
_DRAFT = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)
_OPD = SimpleNamespace(
    input_type=lossfx.LossInputType.OPD_FULL,
    opd_full=SimpleNamespace(enabled=True, teacher_payload="logits", chunk_size=None, validate_decomposition=False),
    reference_policy_kl_penalty=0.0,
)


def _prepare(x: SimpleNamespace, loss_fn: Any, sampling_params: Any = None, **columns: Any) -> Any:
    data = {"input_ids": x.input_ids, "token_mask": x.mask, **columns}
    return lossfx.prepare_loss_input(x.logits, data, loss_fn, sampling_params=sampling_params)


# {path: call on the inputs}; every logits path of the library, eager.
PATHS: dict[str, Callable[[SimpleNamespace], Any]] = {
    "token_logprobs": lambda x: lossfx.token_logprobs(x.z, x.target),
    f"gather_logprobs (K = {K_DISTILL}, + Σ p log p)": lambda x: lossfx.gather_logprobs(
        x.z, x.ids, with_neg_entropy=True
    ),
    "filtered_token_logprobs top-k 50, top-p 0.9": lambda x: lossfx.filtered_token_logprobs(
        x.z, x.target, top_k=50, top_p=0.9
    ),
    "filtered_token_logprobs top-p 0.9 (bisection)": lambda x: lossfx.filtered_token_logprobs(x.z, x.target, top_p=0.9),
    "neg_entropy": lambda x: lossfx.neg_entropy(x.z),
    "reverse_kl_to_fixed": lambda x: lossfx.reverse_kl_to_fixed(x.z, x.teacher),
    "cross_entropy_to_fixed": lambda x: lossfx.cross_entropy_to_fixed(x.z, x.teacher),
    "prepare_loss_input LOGPROB": lambda x: _prepare(x, _LOGPROB),
    "prepare_loss_input LOGPROB top-k 50, top-p 0.9": lambda x: _prepare(x, _LOGPROB, _TOP_KP),
    "prepare_loss_input LOGPROB top-p 0.9": lambda x: _prepare(x, _LOGPROB, _TOP_P),
    "prepare_loss_input LOGPROB + reference KL": lambda x: _prepare(x, _KL),
    f"prepare_loss_input DISTILLATION (K = {K_DISTILL})": lambda x: _prepare(
        x, _DISTILL, teacher_topk_logits=x.topk_logits, teacher_topk_indices=x.topk_ids
    ),
    "prepare_loss_input DRAFT (targets: no backward)": lambda x: _prepare(x, _DRAFT, student_logits=x.teacher_logits),
    "prepare_loss_input OPD_FULL": lambda x: _prepare(x, _OPD, teacher_full_logits=x.teacher_logits),
    "prepare_packed_loss_input (2 sequences)": lambda x: lossfx.prepare_packed_loss_input(
        x.logits, {"input_ids": x.packed_ids, "token_mask": x.packed_mask}, _LOGPROB, x.cu_seqlens, x.cu_seqlens
    ),
}


def count_paths(
    shape: tuple[int, int, int] = FULL,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "meta",
    policy: ChunkPolicy = GPU_POLICY,
) -> dict[str, OpCounter]:
    """`{path: OpCounter}` of one eager forward + backward of every path, `policy` forced."""
    return dict(_counted(shape, dtype, device, policy))


def value_checks(shape: tuple[int, int, int] = SMALL, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """`{path: kernel-launching ops of its value checks}`: a CPU call minus a `meta` call at one
    shape and one chunking (the checks that read ids are skipped on `meta`; they run once per call,
    whatever the chunking: `tests/test_bench_ops.py`)."""
    cpu, meta = count_paths(shape, dtype, "cpu", SMALL_POLICY), count_paths(shape, dtype, "meta", SMALL_POLICY)
    return {name: cpu[name].launches - meta[name].launches for name in PATHS}


def host_reads(shape: tuple[int, int, int] = SMALL, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """`{path: host reads of one eager call + backward}` on CPU tensors (values: the checks run).
    `Tensor.tolist` reads without dispatching an op: it is counted by a wrapper."""
    tolist = torch.Tensor.tolist
    counts: Counter[str] = Counter()
    current = [""]

    def counted_tolist(self):
        counts[current[0]] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        for name, c in _counted(shape, dtype, "cpu", SMALL_POLICY, current):
            counts[name] += c.reads
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    return {name: counts[name] for name in PATHS}


def _counted(shape, dtype, device, policy, current=None):
    """`(path, OpCounter)` of every path, `policy` forced (`current[0]`: the path being run)."""
    with chunk_policy(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the -inf masking notice of filtered LOGPROB on random data
        for name, call in PATHS.items():
            x = inputs(shape, dtype, device)
            if current is not None:
                current[0] = name
            yield name, count_call(lambda call=call, x=x: call(x))


def table() -> dict[str, Any]:
    """The published table: every path at `FULL` under the GPU policy (`meta` + its value checks),
    and, pinned by the tests, every path at `SMALL` under `SMALL_POLICY` on CPU."""
    full = count_paths()
    checks = value_checks()
    reads = host_reads()
    small = count_paths(SMALL, torch.bfloat16, "cpu", SMALL_POLICY)
    rows = default_chunk_rows(FULL[2], torch.float32, torch.device("meta"))
    return {
        "shape": list(FULL),
        "dtype": "bf16",
        "policy": dataclasses.asdict(GPU_POLICY),
        "chunk_rows": rows,
        "chunks": -(-FULL[0] * FULL[1] // rows),
        "budget": BUDGET,
        "full": {
            n: {"launches": c.launches + checks[n], "checks": checks[n], "host_reads": reads[n], "ops": dict(c.ops)}
            for n, c in full.items()
        },
        "small_shape": list(SMALL),
        "small_policy": dataclasses.asdict(SMALL_POLICY),
        "small": {n: c.launches for n, c in small.items()},
    }


def main() -> None:
    from benchmarks.measure import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(RESULTS), help=f"write the table here (default {RESULTS})")
    args = parser.parse_args()
    doc = {"environment": environment(), **table()}
    print(" · ".join(f"{k}: {v}" for k, v in doc["environment"].items()), "\n")
    print(
        f"`{doc['shape']}` bf16, GPU policy (`row_bytes` {GPU_POLICY.row_bytes >> 20} MiB, `min_rows` "
        f"{GPU_POLICY.min_rows}): {doc['chunks']} chunks of {doc['chunk_rows']} rows; eager forward + backward\n"
    )
    print("| path | kernel launches | of which value checks | host reads | most frequent ops |")
    print("|---|---:|---:|---:|---|")
    for name, row in doc["full"].items():
        top = ", ".join(f"`{op}` {n}" for op, n in Counter(row["ops"]).most_common(4))
        print(f"| {name} | {row['launches']} | {row['checks']} | {row['host_reads']} | {top} |")
    pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
