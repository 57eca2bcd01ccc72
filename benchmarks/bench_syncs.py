"""Device→host synchronisations per public entry-point call, eager and compiled, 1 and 2 ranks.

    python -m benchmarks.bench_syncs            # prints a markdown table (world 1, then 2 gloo ranks)
    python -m benchmarks.bench_syncs --every    # also every other public function (one rank)

A `TorchDispatchMode` counts the aten ops that read a device value on the host
(`_local_scalar_dense`, `is_nonzero`, `item`, `nonzero`, `equal`); `Tensor.tolist` (which reads
without dispatching) is counted by a wrapper. On CPU nothing actually stalls, but every one of
these would wait for a GPU stream. Compiled calls: the host-read ops in their aten forward graph.
`tests/test_host_reads.py` pins the compiled count (0) and that the consistency check itself
adds exactly one read per group.
"""

from __future__ import annotations

import os
import socket
import sys
from types import SimpleNamespace

HOST_READS = ("_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal")


def count_host_reads(fn) -> int:
    """Host reads made by `fn()`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = [0]

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in HOST_READS:
                counts[0] += 1
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counts[0] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        with Counter():
            fn()
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    return counts[0]


def compiled_host_reads(fn) -> int:
    """Host-read ops in the forward graph of `torch.compile(fn, fullgraph=True)` (AOTAutograd's
    aten graph, the one Inductor would compile). A dispatch mode cannot count inside compiled
    code (Dynamo refuses to run under a user dispatch mode), so the graph is read instead."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    counts = [0]

    def forward(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in HOST_READS:
                counts[0] += 1
        return make_boxed_func(gm.forward)

    torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=forward))()
    return counts[0]


def entry_points(rank: int, world: int, group, every: bool = False):
    """`{name: zero-argument call}`: this rank's side of one call of each public entry point.
    `every`: also the other public functions of `lossfx.__all__` that take tensors (one rank)."""
    import torch

    import lossfx

    gen = torch.Generator().manual_seed(0)
    b, s, v, h = 2, 8, 16 * world, 8
    logits = torch.randn(b, s, v, generator=gen)[..., rank * 16 : (rank + 1) * 16]
    ids = torch.randint(0, v, (b, s), generator=gen)
    hidden = torch.randn(b * s, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)[rank * 16 : (rank + 1) * 16]
    ignored = ids.reshape(-1).clone()
    ignored[::3] = -100  # a third of the targets ignored: the fused kernels skip those rows
    tp = {"group": group} if group is not None else {}
    vp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group} if group is not None else {}
    logprob = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    kl = SimpleNamespace(input_type="logprob", reference_policy_kl_penalty=0.1)
    sp = lossfx.TrainingSamplingParams(top_k=4)
    sp_p = lossfx.TrainingSamplingParams(top_k=6, top_p=0.8)
    data = {"input_ids": ids}
    masked = {"input_ids": ids, "token_mask": torch.ones(b, s)}
    packed = torch.randn(1, s, v, generator=gen)[..., rank * 16 : (rank + 1) * 16]  # two sequences of 5 and 3
    cu = torch.tensor([0, 5, 8])
    tied = logits.round()  # integer values: top-p cuts tie groups under ties="sorted"
    teacher_values = torch.randn(b, s, 3, generator=gen)
    teacher_ids = torch.randint(0, v, (b, s, 3), generator=gen)
    distill = SimpleNamespace(input_type="distillation", zero_outside_topk=False, kl_type="forward")
    draft = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)
    mask = torch.ones(b, s)
    teacher_full = torch.randn(b, 6, v, generator=gen)  # OPD_FULL's replicated payloads: 6 of 8 positions
    teacher_hidden = torch.randn(b, 6, h, generator=gen)

    def opd(payload: str) -> SimpleNamespace:
        cfg = SimpleNamespace(enabled=True, teacher_payload=payload, chunk_size=None, validate_decomposition=True)
        return SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=cfg, reference_policy_kl_penalty=0.1)

    opd_logits, opd_hidden = opd("logits"), opd("hidden_states")
    calls = {
        "token_logprobs": lambda: lossfx.token_logprobs(logits[:, :-1], ids[:, 1:], **tp),
        "next_token_logprobs": lambda: lossfx.next_token_logprobs(logits, ids, **vp),
        "prepare_loss_input LOGPROB": lambda: lossfx.prepare_loss_input(logits, data, logprob, **vp),
        "prepare_loss_input LOGPROB top-k + KL": lambda: lossfx.prepare_loss_input(
            logits, masked, kl, sampling_params=sp, **vp
        ),
        "prepare_loss_input LOGPROB top-k + top-p": lambda: lossfx.prepare_loss_input(
            logits, masked, logprob, sampling_params=sp_p, **vp
        ),
        "prepare_packed_loss_input, tensor cu_seqlens": lambda: lossfx.prepare_packed_loss_input(
            packed, {"input_ids": ids[:, :5], "token_mask": torch.ones(b, 5)}, logprob, cu, cu, **vp
        ),
        "prepare_packed_loss_input top-k + KL, tensor cu_seqlens": lambda: lossfx.prepare_packed_loss_input(
            packed, {"input_ids": ids[:, :5], "token_mask": torch.ones(b, 5)}, kl, cu, cu, sampling_params=sp, **vp
        ),
        'filtered_token_logprobs top-p, ties="sorted"': lambda: lossfx.filtered_token_logprobs(
            tied, ids, top_p=0.5, ties="sorted", **tp
        ),
        'top_k_top_p_threshold top-k + top-p, ties="sorted"': lambda: lossfx.top_k_top_p_threshold(
            tied, top_k=6, top_p=0.5, ties="sorted", **tp
        ),
        "linear_token_logprobs": lambda: lossfx.linear_token_logprobs(hidden, weight, ids.reshape(-1), **tp),
        "linear_token_logprobs, ignored targets": lambda: lossfx.linear_token_logprobs(hidden, weight, ignored, **tp),
        "linear_logprob_objective": lambda: lossfx.linear_logprob_objective(
            hidden, weight, ids.reshape(-1), torch.ones(b * s), **tp
        ),
        "linear_logprob_objective, ignored targets + backward": lambda: lossfx.linear_logprob_objective(
            hidden.clone().requires_grad_(), weight, ignored, torch.ones(b * s), **tp
        )[0].backward(),
        # the hidden-state front door with a plain head shard: the check's shard widths (uneven
        # plain heads are allowed) and the kernel's count of active rows share the one read
        "prepare_linear_loss_input LOGPROB": lambda: lossfx.prepare_linear_loss_input(
            hidden.view(b, s, -1), weight, data, logprob, **vp
        ),
        "prepare_linear_loss_input DISTILLATION": lambda: lossfx.prepare_linear_loss_input(
            hidden.view(b, s, -1),
            weight,
            {"input_ids": ids, "teacher_topk_logits": teacher_values, "teacher_topk_indices": teacher_ids},
            distill,
            **vp,
        ),
        # DRAFT: `student_logits` passed through as this rank's vocabulary shard (no d2t: D = V)
        "prepare_linear_loss_input DRAFT": lambda: lossfx.prepare_linear_loss_input(
            hidden.view(b, s, -1), weight, {"token_mask": mask, "student_logits": logits}, draft, **vp
        ),
        "prepare_linear_loss_input OPD_FULL, teacher logits": lambda: lossfx.prepare_linear_loss_input(
            hidden.view(b, s, -1), weight, {"input_ids": ids, "teacher_full_logits": teacher_full}, opd_logits, **vp
        ),
        # the teacher head: this rank's rows, like the student's
        "prepare_linear_loss_input OPD_FULL, teacher from hidden states": lambda: lossfx.prepare_linear_loss_input(
            hidden.view(b, s, -1),
            weight,
            {"input_ids": ids, "teacher_full_hidden_states": teacher_hidden},
            opd_hidden,
            teacher_output_layer_weight_by_index={0: weight},
            **vp,
        ),
        "prepare_linear_packed_loss_input, tensor cu_seqlens": lambda: lossfx.prepare_linear_packed_loss_input(
            hidden.view(b, s, -1)[:1], weight, {"input_ids": ids[:, :5]}, logprob, cu, cu, **vp
        ),
    }
    if every:
        calls.update(_every_other(logits, ids, hidden, weight, ignored))
    return calls


def _every_other(logits, ids, hidden, weight, ignored):
    """The other public functions of `lossfx.__all__` that take tensors, one call each (one rank)."""
    import torch

    import lossfx

    gen = torch.Generator().manual_seed(1)
    b, s, v = logits.shape
    teacher = torch.randn(b, s, v, generator=gen)
    topk_logits = torch.randn(b, s, 3, generator=gen)
    topk_ids = torch.randint(0, v, (b, s, 3), generator=gen)
    mask = torch.ones(b, s)
    sp = lossfx.TrainingSamplingParams(top_k=4)
    distill = SimpleNamespace(input_type="distillation", zero_outside_topk=False, kl_type="forward")
    draft = SimpleNamespace(input_type=lossfx.LossInputType.DRAFT)
    packed_ids = torch.randint(0, v, (2, 5), generator=gen)  # two sequences of 5 and 3 tokens, packed
    packed_logits = torch.randn(1, 8, v, generator=gen)
    opd_cfg = SimpleNamespace(enabled=True, teacher_payload="logits", chunk_size=None, validate_decomposition=True)
    opd = SimpleNamespace(input_type=lossfx.LossInputType.OPD_FULL, opd_full=opd_cfg, reference_policy_kl_penalty=0.0)
    payload = torch.randn(b, 6, v + 3, generator=gen)
    return {
        "token_logprobs_with_lse": lambda: lossfx.token_logprobs_with_lse(logits, ids),
        "filtered_token_logprobs": lambda: lossfx.filtered_token_logprobs(logits, ids, top_k=4, top_p=0.9),
        "next_token_filtered_logprobs": lambda: lossfx.next_token_filtered_logprobs(logits, ids, top_k=4),
        "gather_logits": lambda: lossfx.gather_logits(logits, topk_ids),
        "gather_logprobs": lambda: lossfx.gather_logprobs(logits, topk_ids, with_neg_entropy=True),
        "vocab_topk": lambda: lossfx.vocab_topk(logits, 3),
        "apply_top_k_top_p": lambda: lossfx.apply_top_k_top_p(logits, top_k=4, top_p=0.9),
        "top_k_top_p_threshold": lambda: lossfx.top_k_top_p_threshold(logits, top_k=4, top_p=0.9),
        "neg_entropy": lambda: lossfx.neg_entropy(logits),
        "entropy": lambda: lossfx.entropy(logits),  # the deprecated name (a FutureWarning)
        "cross_entropy_to_fixed": lambda: lossfx.cross_entropy_to_fixed(logits, teacher),
        "reverse_kl_to_fixed": lambda: lossfx.reverse_kl_to_fixed(logits, teacher),
        "distillation_topk_logprobs": lambda: lossfx.distillation_topk_logprobs(
            logits, topk_logits, topk_ids, zero_outside_topk=False, calculate_entropy=True
        ),
        "prepare_loss_input DISTILLATION": lambda: lossfx.prepare_loss_input(
            logits, {"input_ids": ids, "teacher_topk_logits": topk_logits, "teacher_topk_indices": topk_ids}, distill
        ),
        "draft_targets": lambda: lossfx.draft_targets(teacher, mask),
        "map_to_draft_vocab": lambda: lossfx.map_to_draft_vocab(teacher, None),
        "prepare_loss_input DRAFT": lambda: lossfx.prepare_loss_input(
            logits, {"input_ids": ids, "teacher_logits": teacher, "student_logits": logits, "token_mask": mask}, draft
        ),
        "mask_out_neg_inf_logprobs": lambda: lossfx.mask_out_neg_inf_logprobs(logits[..., 0], mask),
        "prepare_packed_loss_input": lambda: lossfx.prepare_packed_loss_input(
            packed_logits,
            {"input_ids": packed_ids, "token_mask": torch.ones(2, 5)},
            SimpleNamespace(input_type="logprob"),
            (0, 5, 8),
            (0, 5, 8),
            sampling_params=sp,
        ),
        "prepare_opd_full_loss_input": lambda: lossfx.prepare_opd_full_loss_input(
            logits,
            {"input_ids": ids, "token_mask": mask, "teacher_full_logits": payload},
            opd,
            vocab_parallel_rank=None,
            vocab_parallel_group=None,
            context_parallel_group=None,
            sampling_params=None,
            chunk_size=None,
        ),
        "reconstruct_opd_full_teacher_logits": lambda: lossfx.reconstruct_opd_full_teacher_logits(
            payload, teacher_payload="logits", student_logits=logits, vocab_parallel_rank=0, context_parallel_group=None
        ),
        "reconstruct_opd_full_teacher_logits, two heads": lambda: lossfx.reconstruct_opd_full_teacher_logits(
            torch.randn(b, 6, hidden.shape[1], generator=gen),
            teacher_payload="hidden_states",
            student_logits=logits,
            vocab_parallel_rank=0,
            context_parallel_group=None,
            teacher_output_layer_weight_by_index={3: weight, 7: weight * 2},
            teacher_index=torch.tensor([7, 3]),
        ),
        "linear_next_token_logprobs": lambda: lossfx.linear_next_token_logprobs(hidden.view(b, s, -1), weight, ids),
        "linear_divergence_to_teacher": lambda: lossfx.linear_divergence_to_teacher(
            hidden, weight, teacher_logits=torch.randn(hidden.shape[0], weight.shape[0], generator=gen)
        ),
        "linear_filtered_token_logprobs": lambda: lossfx.linear_filtered_token_logprobs(
            hidden, weight, ids.reshape(-1), top_k=3, top_p=0.9
        ),
        "linear_gather_logprobs": lambda: lossfx.linear_gather_logprobs(
            hidden, weight, torch.where(topk_ids.reshape(-1, 3) % 2 == 0, -100, topk_ids.reshape(-1, 3))
        ),
        "allgather_cp": lambda: lossfx.allgather_cp(logits, None),
        "shift_left": lambda: lossfx.shift_left(ids),
    }


def measure(rank: int, world: int, group, every: bool = False) -> dict[str, tuple[int, int | None]]:
    """`{entry point: (eager host reads, compiled host reads)}` on this rank (`every`: each public
    function, `entry_points(every=True)`)."""
    import torch._dynamo

    out = {}
    for name, call in entry_points(rank, world, group, every=every).items():
        call()  # warm-up (lazy imports, first-call caches)
        compiled = None
        if not name.endswith("backward"):  # Dynamo: no .backward()
            try:
                compiled = compiled_host_reads(call)
            except torch._dynamo.exc.Unsupported:  # `--every`: a call whose lambda builds its config
                if not every:
                    raise
        out[name] = (count_host_reads(call), compiled)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = measure(rank, world, dist.group.WORLD)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import multiprocessing as mp

    from benchmarks.measure import environment

    every = "--every" in sys.argv
    single = measure(0, 1, None, every=every)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    double = queue.get(timeout=1800)
    for p in procs:
        p.join()
    print(" · ".join(f"{k}: {v}" for k, v in environment().items()), "\n")
    print("| entry point | 1 rank eager | 1 rank compiled | 2 ranks eager | 2 ranks compiled |")
    print("|---|---:|---:|---:|---:|")
    for name, (eager, compiled) in single.items():
        both = double.get(name, ("—", "—"))  # `--every`: the functions beyond the entry points, one rank
        shown = ["—" if c is None else c for c in (compiled, both[1])]
        print(f"| {name} | {eager} | {shown[0]} | {both[0]} | {shown[1]} |")


if __name__ == "__main__":
    main()
