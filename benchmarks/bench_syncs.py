"""Device→host synchronisations per public entry-point call, eager and compiled, 1 and 2 ranks.

    python -m benchmarks.bench_syncs            # prints a markdown table (world 1, then 2 gloo ranks)

A `TorchDispatchMode` counts the aten ops that read a device value on the host
(`_local_scalar_dense`, `is_nonzero`, `item`, `nonzero`, `equal`); `Tensor.tolist` (which reads
without dispatching) is counted by a wrapper. On CPU nothing actually stalls, but every one of
these would wait for a GPU stream. Compiled calls: the host-read ops in their aten forward graph.
`tests/test_rank_agreement.py` pins the compiled count (0) and that the consistency check itself
adds exactly one read per group.
"""

from __future__ import annotations

import os
import socket
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


def entry_points(rank: int, world: int, group):
    """`{name: zero-argument call}`: this rank's side of one call of each public entry point."""
    import torch

    import lossfx

    gen = torch.Generator().manual_seed(0)
    b, s, v, h = 2, 8, 16 * world, 8
    logits = torch.randn(b, s, v, generator=gen)[..., rank * 16 : (rank + 1) * 16]
    ids = torch.randint(0, v, (b, s), generator=gen)
    hidden = torch.randn(b * s, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)[rank * 16 : (rank + 1) * 16]
    tp = {"group": group} if group is not None else {}
    vp = {"vocab_parallel_rank": rank, "vocab_parallel_group": group} if group is not None else {}
    logprob = SimpleNamespace(input_type=lossfx.LossInputType.LOGPROB)
    kl = SimpleNamespace(input_type="logprob", reference_policy_kl_penalty=0.1)
    sp = lossfx.TrainingSamplingParams(top_k=4)
    data = {"input_ids": ids}
    masked = {"input_ids": ids, "token_mask": torch.ones(b, s)}
    return {
        "token_logprobs": lambda: lossfx.token_logprobs(logits[:, :-1], ids[:, 1:], **tp),
        "next_token_logprobs": lambda: lossfx.next_token_logprobs(logits, ids, **vp),
        "prepare_loss_input LOGPROB": lambda: lossfx.prepare_loss_input(logits, data, logprob, **vp),
        "prepare_loss_input LOGPROB top-k + KL": lambda: lossfx.prepare_loss_input(
            logits, masked, kl, sampling_params=sp, **vp
        ),
        "linear_token_logprobs": lambda: lossfx.linear_token_logprobs(hidden, weight, ids.reshape(-1), **tp),
        "linear_logprob_objective": lambda: lossfx.linear_logprob_objective(
            hidden, weight, ids.reshape(-1), torch.ones(b * s), **tp
        ),
    }


def measure(rank: int, world: int, group) -> dict[str, tuple[int, int]]:
    """`{entry point: (eager host reads, compiled host reads)}` on this rank."""
    out = {}
    for name, call in entry_points(rank, world, group).items():
        call()  # warm-up (lazy imports, first-call caches)
        out[name] = (count_host_reads(call), compiled_host_reads(call))
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

    single = measure(0, 1, None)
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
        print(f"| {name} | {eager} | {compiled} | {double[name][0]} | {double[name][1]} |")


if __name__ == "__main__":
    main()
