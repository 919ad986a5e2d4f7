"""A small GPT (tied embeddings) trained on synthetic tokens, four ways:

    torchrun --nproc-per-node 2 examples/train_gpt.py --impl shardline  # fully_shard (shardline)
    torchrun --nproc-per-node 2 examples/train_gpt.py --impl fsdp2       # torch's fully_shard
    torchrun --nproc-per-node 2 examples/train_gpt.py --impl ddp
    python examples/train_gpt.py --impl single --global-ranks 2          # one process, same batch
    shardline-launch -n 2 -- python examples/train_gpt.py --impl shardline

Every rank draws its micro-batch of the same global batch, so the four print the same losses
(up to float rounding). --backend picks torch.distributed's backend for fsdp2 and ddp (gloo, or
shardline: torch's FSDP2/DDP over shardline's collectives). Printed per step: the loss (mean over
the ranks) and the step time; at the end: the median step time, peak RSS, and for shardline the
scheduler's last-step metrics (exposed communication, overlap), and the CPU time per step of
all the rank's threads (on a machine with fewer cores than threads, communication threads take
cycles from the compute). --trace PATH writes a Chrome
trace of the last step (torch.profiler; per rank PATH.rank<r>.json); with --impl shardline also
shardline's own trace of every step (per rank PATH.shardline.rank<r>.json: the scheduler's
gather and reduce streams, the compute stream's waits, each unit's forward and backward use;
bench/torch/timeline.py draws it).
"""
import argparse
import math
import os
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one tensor, used twice per forward
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tokens_for(step, rank, args):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", choices=["shardline", "fsdp2", "ddp", "single"], default="shardline")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (fsdp2, ddp)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    p.add_argument("--global-ranks", type=int, default=2,
                   help="single: the number of ranks whose micro-batches it runs together")
    p.add_argument("--trace", default="", help="Chrome trace of the last step (torch.profiler)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: the model on cuda:LOCAL_RANK (ranks that share a GPU: modulo "
                        "the GPUs); fsdp2 and ddp then default to --backend nccl")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the compute dtype: bfloat16 is fully_shard's and FSDP2's "
                        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32), autocast "
                        "for single and ddp")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.impl == "single":
        rank, world = 0, 1
    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        if args.backend == "gloo":
            args.backend = "nccl"
    bf16 = args.dtype == "bfloat16"
    if args.impl in ("fsdp2", "ddp"):
        import torch.distributed as dist
        if args.backend == "shardline":
            import shardline.torch  # noqa: F401  (registers the backend)
        dist.init_process_group(args.backend)

    torch.manual_seed(0)
    with device:  # built where it trains (a large model initialises much faster on a GPU)
        model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    all_reduce_mean = None
    if args.impl == "shardline":
        import shardline.torch as slt
        mp = (slt.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else slt.MixedPrecisionPolicy())
        for block in model.blocks:
            slt.fully_shard(block, mp_policy=mp)
        slt.fully_shard(model, mp_policy=mp)
        if args.trace:
            import shardline
            shardline_trace = shardline.Trace(rank)
            model.set_shardline_trace(shardline_trace)
        world_comm = slt.get_default_world(device)

        def all_reduce_mean(x):
            t = torch.tensor([x], dtype=torch.float64, device=device)
            world_comm.all_reduce(t, stream=slt.stream_for(world_comm)).wait()
            return t.item() / world
    elif args.impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    elif args.impl == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    if args.impl in ("fsdp2", "ddp"):
        def all_reduce_mean(x):
            t = torch.tensor([x], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            return t.item() / world
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if bf16 and args.impl in ("single", "ddp") else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    times, cpu_times = [], []
    for step in range(args.steps):
        if args.impl == "single":
            batch = torch.cat([tokens_for(step, r, args) for r in range(args.global_ranks)])
        else:
            batch = tokens_for(step, rank, args)
        batch = batch.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profiling = args.trace and step == args.steps - 1
        prof = torch.profiler.profile() if profiling else None
        if prof:
            prof.__enter__()
        start, cpu_start = time.perf_counter(), time.process_time()
        if autocast is not None:
            with autocast:
                logits = model(batch[:, :-1])
        else:
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        cpu_times.append(time.process_time() - cpu_start)
        if prof:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(f"{args.trace}.rank{rank}.json")
        value = loss.item() if all_reduce_mean is None else all_reduce_mean(loss.item())
        times.append(elapsed)
        if rank == 0:
            print(f"step {step}: loss {value:.6f} time {elapsed * 1e3:.1f} ms", flush=True)
        assert math.isfinite(value), value

    measured = times[args.warmup:] or times
    cpu = cpu_times[args.warmup:] or cpu_times
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    line = (f"rank {rank}: {args.impl} median step {statistics.median(measured) * 1e3:.1f} ms, "
            f"CPU time {statistics.median(cpu) * 1e3:.1f} ms per step (all threads), "
            f"peak RSS {rss_mib:.0f} MiB")
    if device.type == "cuda":
        # torch's caching allocator only: shardline's own pool (the gathers and reductions of
        # fully_shard) is reported by its metrics below.
        line += (f", torch max_memory_allocated "
                 f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB, max_memory_reserved "
                 f"{torch.cuda.max_memory_reserved(device) / 2**20:.0f} MiB")
    if args.impl == "shardline":
        if args.trace:
            shardline_trace.write(f"{args.trace}.shardline.rank{rank}.json")
        metrics = model.shardline_scheduler.metrics()
        exposed = metrics.exposed_communication
        line += (f", exposed communication "
                 f"{'n/a' if exposed is None else f'{exposed * 1e3:.2f} ms'}; {metrics}; "
                 f"shardline pools gather_pool_peak_bytes={metrics.gather_pool_peak_bytes} "
                 f"reduce_pool_peak_bytes={metrics.reduce_pool_peak_bytes}")
    print(line, flush=True)
    if args.impl in ("fsdp2", "ddp"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
