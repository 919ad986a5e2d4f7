"""One run of bench/torch/headline.py: trains examples/train_gpt.py's GPT with one
implementation and writes what it measured as JSON (one file per rank, PATH.rank<r>.json).

    python bench/torch/worker.py --impl single --threads 2 --json out/single2
    python -m shardline.launch -n 2 -- python bench/torch/worker.py --impl fsdp2 --json out/f

Per step: the step time (forward, backward, optimizer step, zero_grad) and the CPU time of all
the process's threads in it; the loss, mean over the ranks. After the timed steps: peak RSS
(ru_maxrss), the bytes of parameters, gradients and optimizer state this rank holds (unique
storages, the local shards of sharded tensors), then one more step under torch.profiler with
profile_memory=True, whose peak of torch's CPU allocator above the step's start is the
allocator figure (tensors shardline allocates itself, such as its gather buffers, are not in
it: RSS is the figure that compares all). For shardline's fully_shard, the scheduler's
metrics of each step (exposed communication, communication time, host hook time).
"""
import argparse
import json
import math
import os
import pathlib
import resource
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from train_gpt import GPT, tokens_for  # noqa: E402


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model, opt):
    """Bytes of the unique storages behind this rank's parameters, gradients and optimizer
    state (a tensor that is a view of another one counts once)."""
    seen = set()

    def size(tensors):
        total = 0
        for t in tensors:
            if t is None:
                continue
            s = _local(t).untyped_storage()
            key = (s.data_ptr(), s.nbytes())
            if key in seen or s.nbytes() == 0:
                continue
            seen.add(key)
            total += s.nbytes()
        return total

    params = list(model.parameters())
    out = {"params": size(params), "grads": size(p.grad for p in params)}
    out["optimizer"] = size(v for st in opt.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor))
    return out


def allocator_peak(trace_path):
    """(peak above the step's start, bytes allocated at the end) from the [memory] events of
    a torch.profiler Chrome trace; None when the trace has none."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    mem = [e["args"] for e in mem if e.get("args", {}).get("Device Type", 0) == 0]
    if not mem:
        return None
    start = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    peak = max(a["Total Allocated"] for a in mem)
    return {"peak_above_start": peak - start, "end_above_start": mem[-1]["Total Allocated"] - start}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl",
                   choices=["shardline", "shardline-fsdp1", "fsdp2", "ddp", "single", "alone"],
                   required=True)
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (fsdp2, ddp)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=13, help="all steps, warm-up included")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    p.add_argument("--global-ranks", type=int, default=2,
                   help="single: the number of ranks whose micro-batches it runs together")
    p.add_argument("--no-memory-step", action="store_true",
                   help="skip the profiled step that measures torch's allocator")
    p.add_argument("--json", required=True, help="writes PATH.rank<r>.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.impl == "single":
        rank, world = 0, 1
    dist = None
    if args.impl in ("fsdp2", "ddp"):
        import torch.distributed as dist
        if args.backend == "shardline":
            import shardline.torch  # noqa: F401  (registers the backend)
        dist.init_process_group(args.backend)

    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    world_comm = None
    if args.impl == "shardline":
        import shardline.torch as slt
        for block in model.blocks:
            slt.fully_shard(block)
        slt.fully_shard(model)
        world_comm = slt.get_default_world()
    elif args.impl == "shardline-fsdp1":
        # FSDP1's way: the wrapper, one unit per block by transformer_auto_wrap_policy.
        import functools

        import shardline.torch as slt
        policy = functools.partial(slt.transformer_auto_wrap_policy,
                                   transformer_layer_cls={type(model.blocks[0])})
        model = slt.FullyShardedDataParallel(model, auto_wrap_policy=policy)
        world_comm = slt.get_default_world()
    elif args.impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif args.impl == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif args.impl == "alone":
        # Compute alone: the model stays whole and local, the gradients are not reduced. The
        # world only lines the ranks' steps up (the barrier before each, outside the timing) and
        # averages the losses afterwards.
        import shardline.torch as slt
        world_comm = slt.get_default_world()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    def mean_over_ranks(x):
        t = torch.tensor([x], dtype=torch.float64)
        if world_comm is not None:
            world_comm.all_reduce(t).wait()
        elif dist is not None:
            dist.all_reduce(t)
        return t.item() / world

    def batch_for(step):
        if args.impl == "single":
            return torch.cat([tokens_for(step, r, args) for r in range(args.global_ranks)])
        return tokens_for(step, rank, args)

    def train_step(batch, keep_state=None):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if keep_state is not None:
            keep_state.update(state_bytes(model, opt))
        opt.zero_grad()
        return loss

    def loadavg():
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])

    load_start = loadavg()
    times, cpu_times, losses, sched = [], [], [], []
    for step in range(args.steps):
        batch = batch_for(step)
        if dist is not None:
            dist.barrier()
        elif world_comm is not None:
            world_comm.barrier().wait()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = train_step(batch)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(mean_over_ranks(loss.item()))
        if args.impl.startswith("shardline"):
            m = model.shardline_scheduler.metrics()
            sched.append({"exposed_communication": m.exposed_communication,
                          "communication_time": m.communication_time,
                          "host_hook_time": m.host_hook_time,
                          "overlap_fraction": m.overlap_fraction,
                          "bytes_gathered": m.bytes_gathered, "bytes_reduced": m.bytes_reduced})
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"rank {rank}: loss {losses[-1]} at step {step}")

    result = {"impl": args.impl, "backend": args.backend if dist is not None else None,
              "threads": args.threads, "rank": rank, "world": world, "step_times": times,
              "cpu_times": cpu_times, "losses": losses,
              "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "load_start": load_start, "load_end": loadavg()}
    if sched:
        result["scheduler"] = sched

    state = {}
    if args.no_memory_step:
        train_step(batch_for(args.steps), keep_state=state)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        profile_memory=True) as prof:
                train_step(batch_for(args.steps), keep_state=state)
            prof.export_chrome_trace(trace)
            result["allocator"] = allocator_peak(trace)
    result["state_bytes"] = state
    with open(f"{args.json}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
