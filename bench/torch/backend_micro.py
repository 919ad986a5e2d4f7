"""The c10d ops, timed over gloo and over the "shardline" backend in the same processes,
interleaved: where code that calls torch.distributed gains or loses by switching backends.

    .venv/bin/python -m shardline.launch -n 2 -- \\
        .venv/bin/python bench/torch/backend_micro.py [--reps 10] [--sizes 8K,1M,64M] \\
        [--ops all_gather,reduce] [--markdown FILE]

Each rank makes two groups over the world: gloo (the default group) and shardline
(dist.new_group(backend="shardline")). For each size and op it alternates the two backends,
--reps calls each after a warm-up call, every call waited on at once behind a gloo barrier, and
rank 0 prints the median wall time per call of each backend and their ratio (shardline / gloo:
below 1, shardline is faster). Sizes are the bytes of the largest float32 buffer of the call on
one rank: the all-gather's output and the reduce-scatter's input, the gathered list of a gather
and the scattered list of a scatter, each all-to-all buffer, the tensor of the others. The ops:
all_gather_into_tensor, reduce_scatter_tensor (AVG: FSDP2's two calls), all_reduce, broadcast,
reduce, gather, scatter, all_to_all_single with equal and with unequal splits, and a ring of
send/recv (each rank sends to the next while it receives from the previous). --markdown appends
the table, with the command line, to FILE (docs/benchmarks.md's tables come from it).
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardline.torch  # noqa: F401  (registers the backend)

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "gather", "scatter",
       "all_to_all", "all_to_all_uneven", "send_recv")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def make_call(op, group, nbytes, rank, world):
    """A no-argument function doing one `op` of `nbytes` on `group` (waited on)."""
    n = max(nbytes // 4 // world * world, world)  # elements, a multiple of the ranks
    g = torch.Generator().manual_seed(rank)
    big = torch.randn(n, generator=g)
    part = torch.randn(n // world, generator=g)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(big, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, big, op=dist.ReduceOp.AVG, group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(big, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(big, src=0, group=group)
    if op == "reduce":
        return lambda: dist.reduce(big, dst=0, group=group)
    if op == "gather":
        parts = [torch.empty_like(part) for _ in range(world)] if rank == 0 else None
        return lambda: dist.gather(part, parts, dst=0, group=group)
    if op == "scatter":
        parts = list(big.chunk(world)) if rank == 0 else None
        return lambda: dist.scatter(part, parts, src=0, group=group)
    if op == "all_to_all":
        out = torch.empty_like(big)
        return lambda: dist.all_to_all_single(out, big, group=group)
    if op == "all_to_all_uneven":
        # Rank r sends rank j (r + j) % world + 1 shares of n / (world * (world + 1)).
        unit = n // (world * (world + 1))
        sends = [((rank + j) % world + 1) * unit for j in range(world)]
        recvs = [((i + rank) % world + 1) * unit for i in range(world)]
        src, dst = torch.randn(sum(sends), generator=g), torch.empty(sum(recvs))
        return lambda: dist.all_to_all_single(dst, src, recvs, sends, group=group)
    if op == "send_recv":
        got = torch.empty_like(big)
        to, frm = (rank + 1) % world, (rank - 1) % world

        def ring():
            sent = dist.isend(big, to, group=group)
            dist.recv(got, frm, group=group)
            sent.wait()
        return ring
    raise ValueError(f"unknown op {op}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sizes", default="8K,256K,8M,64M")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--markdown", help="append the table to this file (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "shardline": dist.new_group(backend="shardline")}
    rows = []
    for size in args.sizes.split(","):
        nbytes = parse_size(size)
        for op in args.ops.split(","):
            calls = {b: make_call(op, g, nbytes, rank, world) for b, g in groups.items()}
            for call in calls.values():
                call()  # warm-up (connections, buffers)
            wall = {b: [] for b in calls}
            for _ in range(args.reps):
                for b, call in calls.items():
                    dist.barrier(group=groups["gloo"])
                    t0 = time.perf_counter()
                    call()
                    wall[b].append(time.perf_counter() - t0)
            ms = {b: statistics.median(w) * 1e3 for b, w in wall.items()}
            ratio = ms["shardline"] / ms["gloo"]
            rows.append((op, size, ms["gloo"], ms["shardline"], ratio))
            if rank == 0:
                print(f"{op:18s} {size:>5s}  gloo {ms['gloo']:9.3f} ms  shardline "
                      f"{ms['shardline']:9.3f} ms  shardline/gloo {ratio:.3f}", flush=True)
    if rank == 0 and args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n{world} ranks: `{' '.join(sys.argv)}`\n\n")
            f.write("| op | size | gloo ms | shardline ms | shardline/gloo |\n")
            f.write("|---|---:|---:|---:|---:|\n")
            for op, size, g, s, r in rows:
                f.write(f"| {op} | {size} | {g:.3f} | {s:.3f} | {r:.2f} |\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
