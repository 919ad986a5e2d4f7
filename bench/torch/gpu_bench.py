"""The GPU benchmark of docs/benchmarks.md ("PyTorch on a GPU"), on one GPU, in one run:

  * train_gpt.py at world 1 (a GPT of --dim, --layers, --seq, bf16): the plain model (autocast),
    shardline.torch.fully_shard and torch's FSDP2 on NCCL, --rounds rounds interleaved, --steps
    steps each (the first --warmup left out); the median step of each and the ratios, with peak
    memory (torch's max_memory_allocated / max_memory_reserved; fully_shard's own pool from its
    metrics: it is not in torch's figures).
  * torch.distributed all_reduce over the "shardline" backend against "nccl", the same process
    (world 1), sizes 8 KiB to 64 MiB: median microseconds of --reps calls each.

    python bench/torch/gpu_bench.py --out DIR [--dim 2048 --layers 24 --seq 2048 --batch 2]

Writes DIR/gpu_bench.json and prints the tables. Run under no launcher: it starts its own
processes (shardline.launch -n 1)."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def train_gpt():
    for where in (os.path.join(HERE, "train_gpt.py"),
                  os.path.join(HERE, "..", "..", "examples", "train_gpt.py")):
        if os.path.exists(where):
            return where
    raise FileNotFoundError("train_gpt.py")


def run_step_times(impl, args):
    command = [sys.executable, "-m", "shardline.launch", "-n", "1", "--", sys.executable,
               train_gpt(), "--impl", impl, "--device", "cuda", "--dtype", "bfloat16",
               "--dim", str(args.dim), "--layers", str(args.layers), "--heads",
               str(args.heads), "--seq", str(args.seq), "--vocab", str(args.vocab), "--batch",
               str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--global-ranks", "1"]
    if impl == "fsdp2":
        command += ["--backend", "nccl"]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{impl} failed ({done.returncode}):\n{text[-3000:]}")
    steps = [float(m) for m in re.findall(r"step \d+: loss [-\d.e+]+ time ([\d.]+) ms", text)]
    summary = re.search(r"median step ([\d.]+) ms.*?max_memory_allocated (\d+) MiB, "
                        r"max_memory_reserved (\d+) MiB", text)
    pools = re.findall(r"(gather|reduce)_pool_peak_bytes[=: ]+(\d+)", text)
    return {"median_ms": float(summary.group(1)), "steps_ms": steps,
            "max_allocated_MiB": int(summary.group(2)), "max_reserved_MiB": int(summary.group(3)),
            "shardline_pools_MiB": {k: int(v) / 2**20 for k, v in pools},
            "losses": re.findall(r"loss ([-\d.e+]+)", text), "seconds": time.monotonic() - start}


C10D = r'''
import os, statistics, sys, time, torch, torch.distributed as dist
import shardline.torch  # registers "shardline"
torch.cuda.set_device(0)
dist.init_process_group("shardline")
groups = {"shardline": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
reps = int(sys.argv[1])
for size in [8 << 10, 256 << 10, 4 << 20, 64 << 20]:
    t = torch.randn(size // 4, device="cuda")
    out = {}
    for rnd in range(3):
        for name, g in groups.items():
            for _ in range(3):
                dist.all_reduce(t, group=g)
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                dist.all_reduce(t, group=g)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            out.setdefault(name, []).append(statistics.median(times) * 1e6)
    print("c10d", size, " ".join(f"{k}={statistics.median(v):.1f}" for k, v in out.items()),
          flush=True)
dist.destroy_process_group()
'''


def run_c10d(args):
    command = [sys.executable, "-m", "shardline.launch", "-n", "1", "--", sys.executable, "-c",
               C10D, str(args.reps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"c10d failed ({done.returncode}):\n{text[-3000:]}")
    rows = {}
    for size, rest in re.findall(r"c10d (\d+) (.*)", text):
        rows[int(size)] = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", rest)}
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--skip-c10d", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    impls = ["single", "shardline", "fsdp2"]
    runs = {impl: [] for impl in impls}
    for rnd in range(args.rounds):
        order = impls if rnd % 2 == 0 else impls[::-1]
        for impl in order:
            r = run_step_times(impl, args)
            runs[impl].append(r)
            print(f"round {rnd} {impl}: median step {r['median_ms']:.1f} ms, "
                  f"max allocated {r['max_allocated_MiB']} MiB, reserved "
                  f"{r['max_reserved_MiB']} MiB, pools {r['shardline_pools_MiB']}", flush=True)
    median = {impl: statistics.median(r["median_ms"] for r in rs) for impl, rs in runs.items()}
    print("\n| run | median step (ms) | / plain | / FSDP2 | max allocated (MiB) | "
          "max reserved (MiB) |\n|---|---|---|---|---|---|")
    for impl in impls:
        last = runs[impl][-1]
        print(f"| {impl} | {median[impl]:.1f} | {median[impl] / median['single']:.3f} | "
              f"{median[impl] / median['fsdp2']:.3f} | {last['max_allocated_MiB']} | "
              f"{last['max_reserved_MiB']} |")
    result = {"config": vars(args), "runs": runs, "median_ms": median}
    if not args.skip_c10d:
        c10d = run_c10d(args)
        result["c10d_all_reduce_us"] = c10d
        print("\n| bytes | shardline (us) | nccl (us) | nccl / shardline |\n|---|---|---|---|")
        for size, row in sorted(c10d.items()):
            print(f"| {size} | {row.get('shardline', 0):.1f} | {row.get('nccl', 0):.1f} | "
                  f"{row.get('nccl', 0) / max(row.get('shardline', 1e-9), 1e-9):.2f} |")
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
