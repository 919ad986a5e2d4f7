"""The host cost of the hooks per unit (issue 31, item 2): a model of many tiny units, whose
compute is negligible, trained by shardline.torch.fully_shard and by torch's FSDP2 over gloo,
2 ranks, interleaved in one run.

    PYTHONPATH=build-py/python .venv/bin/python bench/torch/tiny_units.py            # the table
    PYTHONPATH=build-py/python .venv/bin/python bench/torch/tiny_units.py --quick    # smoke test

The model: --units Linear(16, 16) layers in a row (a ReLU between them), each its own unit
(fully_shard on each, then on the root), a batch of 2 rows, SGD. A step is forward, backward,
opt.step() and zero_grad(), ranks lined up by a barrier before it; its time is the slowest
rank's. Per run: the median step over --steps timed steps after --warmup. Per unit per step:
that time over the number of units (wall), and the CPU time of every thread of the process
over the same span (CPU), mean over the ranks. Rounds run both implementations, in an order
that alternates; the table gives the medians over rounds and the median of each round's ratio.
Every step's loss must agree between the two (relative 1e-5): the script fails otherwise.
Results: DIR/tiny_units.json and DIR/tiny_units.md (DIR: --out, default
build/bench-results/<time>-tiny-units).
"""
import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parents[2]
IMPLS = {"fsdp2": "FSDP2 + gloo", "shardline": "shardline.torch.fully_shard"}


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def worker(args):
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    layers = []
    for _ in range(args.units):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers)
    units = [m for m in model if isinstance(m, nn.Linear)]
    if args.impl == "shardline":
        import shardline.torch as slt
        for unit in units:
            slt.fully_shard(unit)
        slt.fully_shard(model)
        world = slt.get_default_world()

        def barrier():
            world.barrier().wait()
    else:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo")
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
        barrier = dist.barrier
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1000 + rank)
    times, cpu_times, losses = [], [], []
    for _ in range(args.warmup + args.steps):
        x = torch.randn(2, 16, generator=generator)
        barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(loss.item())
    with open(f"{args.json}.rank{rank}.json", "w") as f:
        json.dump({"step_times": times, "cpu_times": cpu_times, "losses": losses}, f)
    if args.impl == "fsdp2":
        import torch.distributed as dist
        dist.destroy_process_group()


def run(impl, args, out_dir, tag):
    prefix = out_dir / "runs" / f"{tag}-{impl}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "shardline.launch", "-n", "2", "--grace", "10", "--",
           sys.executable, str(HERE), "--worker", "--impl", impl, "--json", str(prefix),
           "--units", str(args.units), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("SHARDLINE_TIMEOUT_S", "120")
    load = loadavg()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                          timeout=600, start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stdout}\n{proc.stderr}")
    ranks = [json.loads(pathlib.Path(f"{prefix}.rank{r}.json").read_text()) for r in range(2)]
    timed = slice(args.warmup, args.warmup + args.steps)
    steps = [max(r["step_times"][i] for r in ranks) for i in range(args.warmup + args.steps)]
    return {
        "step_time": statistics.median(steps[timed]),
        "cpu_time": statistics.mean(statistics.median(r["cpu_times"][timed]) for r in ranks),
        "losses": [statistics.mean(r["losses"][i] for r in ranks)
                   for i in range(args.warmup + args.steps)],
        "load_before": load, "load_after": loadavg(),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--units", type=int, default=64)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=None, help="default 5")
    p.add_argument("--rounds", type=int, default=None, help="default 5")
    p.add_argument("--quick", action="store_true", help="8 units, 3 steps after 1, 1 round")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.quick:
        args.units = 8
    defaults = (3, 1, 1) if args.quick else (40, 5, 5)
    args.steps = defaults[0] if args.steps is None else args.steps
    args.warmup = defaults[1] if args.warmup is None else args.warmup
    args.rounds = defaults[2] if args.rounds is None else args.rounds
    if args.worker:
        return worker(args)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    out_dir = pathlib.Path(args.out or ROOT / "build" / "bench-results" / f"{stamp}-tiny-units")
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds, loads = [], []
    names = list(IMPLS)
    for rnd in range(args.rounds):
        results = {}
        for impl in (names if rnd % 2 == 0 else names[::-1]):
            results[impl] = r = run(impl, args, out_dir, f"r{rnd}")
            loads += [r["load_before"], r["load_after"]]
            print(f"round {rnd} {impl:9s} step {r['step_time'] * 1e3:7.2f} ms = "
                  f"{r['step_time'] / args.units * 1e6:6.1f} us/unit, CPU "
                  f"{r['cpu_time'] / args.units * 1e6:6.1f} us/unit, load {r['load_before']:.1f}",
                  flush=True)
        rounds.append(results)
    bad = [(rnd, i, a, b) for rnd, results in enumerate(rounds)
           for i, (a, b) in enumerate(zip(results["shardline"]["losses"],
                                          results["fsdp2"]["losses"]))
           if abs(a - b) > 1e-5 * max(abs(b), 1e-12)]
    per_unit = {impl: {"wall_us": statistics.median(r[impl]["step_time"] for r in rounds)
                       / args.units * 1e6,
                       "cpu_us": statistics.median(r[impl]["cpu_time"] for r in rounds)
                       / args.units * 1e6} for impl in names}
    wall_ratio = [r["shardline"]["step_time"] / r["fsdp2"]["step_time"] for r in rounds]
    cpu_ratio = [r["shardline"]["cpu_time"] / r["fsdp2"]["cpu_time"] for r in rounds]
    load = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    lines = [f"| implementation | wall per unit per step (µs) | CPU per unit per step (µs) |",
             "|---|---:|---:|"]
    for impl in names:
        lines.append(f"| {IMPLS[impl]} | {per_unit[impl]['wall_us']:.1f} | "
                     f"{per_unit[impl]['cpu_us']:.1f} |")
    lines.append(f"| fully_shard / FSDP2 (median of rounds; rounds "
                 f"{' / '.join(f'{x:.2f}' for x in wall_ratio)}) | "
                 f"{statistics.median(wall_ratio):.3f} | {statistics.median(cpu_ratio):.3f} |")
    md = "\n".join(lines) + (
        f"\n\n{args.units} units, 2 ranks, {args.rounds} rounds of {args.steps} steps after "
        f"{args.warmup}; load average (1 min) min {load['min']:.1f}, median {load['median']:.1f}, "
        f"max {load['max']:.1f} on {os.cpu_count()} cores. Losses "
        f"{'agree' if not bad else 'DISAGREE'} (relative 1e-5).\n")
    print()
    print(md)
    import torch
    with open(out_dir / "tiny_units.json", "w") as f:
        json.dump({"units": args.units, "steps": args.steps, "warmup": args.warmup,
                   "rounds": rounds, "per_unit": per_unit, "wall_ratio": wall_ratio,
                   "cpu_ratio": cpu_ratio, "load_average": load, "losses_agree": not bad,
                   "torch": torch.__version__, "cpus": os.cpu_count()}, f, indent=1)
    (out_dir / "tiny_units.md").write_text(md)
    print(f"wrote {out_dir / 'tiny_units.json'} and {out_dir / 'tiny_units.md'}")
    for rnd, i, a, b in bad[:10]:
        print(f"  round {rnd} step {i}: fully_shard loss {a:.8f}, FSDP2 {b:.8f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
