"""The collectives FSDP2 calls, timed over gloo and over the "shardline" c10d backend in the same
processes, interleaved: where FSDP2-over-shardline gains or loses against FSDP2-over-gloo.

    PYTHONPATH=build-py/python .venv/bin/python -m shardline.launch -n 2 -- \\
        .venv/bin/python bench/torch/backend_micro.py [--reps 20] [--sizes 1024,1572864]

Each rank makes two groups over the world: gloo (the default group) and shardline
(dist.new_group(backend="shardline")). For each size (elements per rank's shard, float32) and
collective (all_gather_into_tensor, reduce_scatter_tensor with AVG: FSDP2's calls; all_reduce),
it alternates the two backends, --reps calls each, every call waited on at once, and prints per
call the median wall time and the median CPU time of the process (every thread: the caller,
gloo's or shardline's communication threads). The default sizes are one block of the headline
GPT (d 512: 3.15 M parameters, 1.58 M per rank's shard) and a small call (per-call overhead).
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import shardline.torch  # noqa: F401  (registers the backend)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", default="1024,1576960")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "shardline": dist.new_group(backend="shardline")}

    def run(name, group, n):
        g = torch.Generator().manual_seed(rank)
        shard = torch.randn(n, generator=g)
        full = torch.empty(n * world)
        if name == "all_gather":
            return lambda: dist.all_gather_into_tensor(full, shard, group=group)
        if name == "reduce_scatter":
            grads = torch.randn(n * world, generator=g)
            return lambda: dist.reduce_scatter_tensor(shard, grads, op=dist.ReduceOp.AVG,
                                                      group=group)
        return lambda: dist.all_reduce(shard, group=group)

    for n in [int(s) for s in args.sizes.split(",")]:
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            calls = {b: run(name, g, n) for b, g in groups.items()}
            for call in calls.values():
                call()  # warm-up (connections, buffers)
            wall = {b: [] for b in calls}
            cpu = {b: [] for b in calls}
            for _ in range(args.reps):
                for b, call in calls.items():
                    dist.barrier(group=groups["gloo"])
                    t0, c0 = time.perf_counter(), time.process_time()
                    call()
                    wall[b].append(time.perf_counter() - t0)
                    cpu[b].append(time.process_time() - c0)
            if rank == 0:
                line = [f"{name:15s} n={n:8d}"]
                for b in calls:
                    line.append(f"{b}: wall {statistics.median(wall[b]) * 1e3:7.3f} ms, "
                                f"cpu {statistics.median(cpu[b]) * 1e3:7.3f} ms")
                ratio = statistics.median(wall["shardline"]) / statistics.median(wall["gloo"])
                line.append(f"shardline/gloo wall {ratio:.3f}")
                print(" | ".join(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
