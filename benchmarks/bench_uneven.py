"""The issue's uneven-shard case of `linear_logprob_objective`, on 2 gloo processes.

    python -m benchmarks.bench_uneven                    # V = 152059 as 76030 + 76029 rows, N = 5627
    python -m benchmarks.bench_uneven --n 5627 --hidden 16 --dtype float32

With the default chunk sized from each rank's own width, these two ranks walked 18 and 17 row
chunks (330 and 331 rows), ran different numbers of per-chunk all-gathers and aborted. Now the
chunk comes from `ceil(V / R)`. Each rank runs the objective with the default chunk (forward,
which forms the gradients, and backward), and compares the log-probs, the objective and both
gradients with a float64 computation made here in row chunks (the dense reference would hold
`[N, V]` in float64, 6.8 GB). Prints rank 0's errors and seconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _float64_truth(hidden, weight, target, a, rows=256):
    """`(log p(target) [N], objective, dhidden [N, H], dweight [V, H])` in float64, in row chunks."""
    import torch

    h, w = hidden.double(), weight.double()
    lp = torch.empty(h.shape[0], dtype=torch.float64)
    dh, dw = torch.zeros_like(h), torch.zeros_like(w)
    for s in range(0, h.shape[0], rows):
        z = h[s : s + rows] @ w.T  # [C, V]
        logp = z.log_softmax(-1)
        t = target[s : s + rows]
        lp[s : s + rows] = logp.gather(-1, t[:, None])[:, 0]
        dz = -logp.exp_() * a[s : s + rows, None].double()  # d(Σ a·log p)/dz = a·(onehot − p)
        dz[torch.arange(len(t)), t] += a[s : s + rows].double()
        dh[s : s + rows] = dz @ w
        dw += dz.T @ h[s : s + rows]
    return lp, (a.double() * lp).sum(), dh, dw


def _worker(rank, world, port, args, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import lossfx
    from lossfx import linear_objective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.hidden, generator=gen) / 2
    weight = torch.randn(args.vocab, args.hidden, generator=gen) / 2
    target = torch.randint(0, args.vocab, (args.n,), generator=gen)
    a = torch.randn(args.n, generator=gen) / args.n
    widths = [-(-args.vocab // world)] * (world - 1)
    widths.append(args.vocab - sum(widths))
    start = sum(widths[:rank])
    rows = slice(start, start + widths[rank])
    own = [
        -(-args.n // linear_objective.default_objective_chunk_rows(args.n, w, dtype)) for w in widths
    ]  # chunk counts the old width-based default gave each rank
    h = hidden.to(dtype).requires_grad_()
    w = weight[rows].to(dtype).clone().requires_grad_()
    t0 = time.perf_counter()
    objective, lp, _ = lossfx.linear_logprob_objective(
        h, w, target, a.to(dtype), group=dist.group.WORLD, vocab_start=start, vocab_size=args.vocab
    )
    objective.backward()
    seconds = time.perf_counter() - t0
    if rank == 0:
        lp64, obj64, dh64, dw64 = _float64_truth(hidden.to(dtype), weight.to(dtype), target, a.to(dtype))
        errors = {
            "logprobs": (lp.double() - lp64).abs().max().item(),
            "objective": (objective.double() - obj64).abs().item(),
            "dhidden": (h.grad.double() - dh64).abs().max().item(),
            "dweight (rank 0 rows)": (w.grad.double() - dw64[rows]).abs().max().item(),
        }
        queue.put({"widths": widths, "old_chunk_counts": own, "seconds": seconds, "errors": errors})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=152059)
    parser.add_argument("--n", type=int, default=5627)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from benchmarks.measure import environment

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    env = environment()
    print(f"{env['date']}, {env['machine']}, {env['cpu_model']}, torch {env['torch']}, load {os.getloadavg()[0]:.1f}")
    print(f"V={args.vocab} as {result['widths']} rows, N={args.n}, H={args.hidden}, {args.dtype}")
    print(f"row chunks the old width-based default gave each rank: {result['old_chunk_counts']}")
    print(f"forward + backward on rank 0: {result['seconds']:.2f} s")
    for name, value in result["errors"].items():
        print(f"max |error| vs float64, {name}: {value:.2e}")


if __name__ == "__main__":
    main()
