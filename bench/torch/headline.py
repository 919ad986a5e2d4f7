"""The PyTorch headline benchmark (issue 13): one GPT, six ways, in one go on this machine.

    PYTHONPATH=build-py/python python bench/torch/headline.py             # the headline table
    PYTHONPATH=build-py/python python bench/torch/headline.py --quick     # smoke test (< 60 s)
    PYTHONPATH=build-py/python python bench/torch/headline.py --sweep     # width x ranks sweep

The model is examples/train_gpt.py's GPT (vocab 8192, d 512, 8 layers, 8 heads, seq 256, tied
embeddings), micro-batch 4 per rank, AdamW; 2 ranks x 1 thread, 10 timed steps after 3 warm-up
steps, 3 rounds. Each round runs every configuration once, in an order rotated from round to
round (the machine is shared: interleaving spreads a slow spell over all rows), each in fresh
processes (bench/torch/worker.py; ranks under shardline.launch):

    single-1t    one process, 1 thread, both ranks' micro-batches together (the same global batch)
    single-2t    the same with 2 threads
    alone        compute alone: one process per rank, each on its own micro-batch, no
                 communication in the step (gradients are not reduced; each steps AdamW over
                 all its parameters, as DDP does): what a step could take if the communication
                 cost nothing. Its loss curve is not the others' (no rank sees the other's
                 gradients): only the first step's loss, before any update, is checked
    ddp          DistributedDataParallel over gloo
    fsdp2        torch's fully_shard over gloo
    fsdp2-sl     torch's fully_shard over the "shardline" c10d backend
    shardline    shardline.torch.fully_shard (shardline's scheduler and collectives)
    shardline-fsdp1  shardline.torch.FullyShardedDataParallel, wrapped FSDP1's way
                 (transformer_auto_wrap_policy on the blocks): the same scheduler

A step's time is the slowest rank's; a run's figure is the median of its timed steps; a round's
ratios divide figures of the same round; the table shows the median over rounds of both. Every
run's loss curve (mean over ranks) must equal single-1t's within --loss-tol (relative): checked
and printed, and the exit status is 1 when one does not. Results: DIR/headline.json and
DIR/headline.md (the table, with the load average over the run).
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

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "worker.py"

CONFIGS = {  # name: (worker args, ranks or 0 for one process, description)
    "single-1t": (["--impl", "single", "--threads", "1"], 0, "single process, 1 thread"),
    "single-2t": (["--impl", "single", "--threads", "2"], 0, "single process, 2 threads"),
    "alone": (["--impl", "alone"], None, "compute alone (no communication)"),
    "ddp": (["--impl", "ddp", "--backend", "gloo"], None, "DDP + gloo"),
    "fsdp2": (["--impl", "fsdp2", "--backend", "gloo"], None, "FSDP2 + gloo"),
    "fsdp2-sl": (["--impl", "fsdp2", "--backend", "shardline"], None,
                 "FSDP2 + shardline backend"),
    "shardline": (["--impl", "shardline"], None, "shardline.torch.fully_shard"),
    "shardline-fsdp1": (["--impl", "shardline-fsdp1"], None,
                        "shardline.torch.FullyShardedDataParallel (FSDP1's wrapper)"),
}

FULL = {"vocab": 8192, "dim": 512, "layers": 8, "heads": 8, "seq": 256, "batch": 4}
QUICK = {"vocab": 256, "dim": 64, "layers": 2, "heads": 2, "seq": 32, "batch": 2}

MIB = 1 << 20


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_config(name, model, args, out_dir, tag, ranks, memory_step=True):
    worker_args, nranks, _ = CONFIGS[name]
    nranks = ranks if nranks is None else nranks
    prefix = out_dir / "runs" / f"{tag}-{name}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(WORKER), *worker_args, "--json", str(prefix),
           "--steps", str(args.warmup + args.steps),
           "--global-ranks", str(ranks)]
    if not memory_step:
        cmd.append("--no-memory-step")
    for key, value in model.items():
        cmd += [f"--{key}", str(value)]
    if nranks:
        cmd = [sys.executable, "-m", "shardline.launch", "-n", str(nranks), "--grace", "10",
               "--", *cmd]
    env = dict(os.environ)
    env.setdefault("SHARDLINE_TIMEOUT_S", "120")
    env.setdefault("OMP_NUM_THREADS", "1")
    load_before = loadavg()
    start = time.monotonic()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=env, timeout=args.run_timeout, start_new_session=True)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stdout}\n{proc.stderr}")
    per_rank = []
    for r in range(max(nranks, 1)):
        with open(f"{prefix}.rank{r}.json") as f:
            per_rank.append(json.load(f))
    return summarize(name, per_rank, args.warmup, load_before, loadavg(), elapsed)


def summarize(name, per_rank, warmup, load_before, load_after, elapsed):
    steps = len(per_rank[0]["step_times"])
    step_times = [max(r["step_times"][i] for r in per_rank) for i in range(steps)]
    timed = slice(warmup, steps)
    out = {
        "config": name,
        "ranks": len(per_rank),
        "step_time": statistics.median(step_times[timed]),
        "step_times": step_times,
        "cpu_time_per_rank": statistics.mean(
            statistics.median(r["cpu_times"][timed]) for r in per_rank),
        "rss_peak_bytes": max(r["rss_peak_bytes"] for r in per_rank),
        "allocator_peak_bytes": max((r.get("allocator") or {}).get("peak_above_start", 0)
                                    for r in per_rank) if all(r.get("allocator")
                                                              for r in per_rank) else None,
        "state_bytes": {k: max(r["state_bytes"][k] for r in per_rank)
                        for k in per_rank[0]["state_bytes"]},
        "losses": per_rank[0]["losses"],
        "load_before": load_before,
        "load_after": load_after,
        "wall_s": elapsed,
    }
    if all("scheduler" in r for r in per_rank):
        exposed = [max(r["scheduler"][i]["exposed_communication"] for r in per_rank)
                   for i in range(steps)]
        out["exposed_communication"] = statistics.median(exposed[timed])
        out["communication_time"] = statistics.median(
            max(r["scheduler"][i]["communication_time"] for r in per_rank)
            for i in range(warmup, steps))
        out["host_hook_time"] = statistics.median(
            max(r["scheduler"][i]["host_hook_time"] for r in per_rank)
            for i in range(warmup, steps))
    return out


def check_losses(runs, reference, tol):
    """[(config, round, step, value, reference value)] beyond tol, and the largest relative
    difference seen."""
    bad, worst = [], 0.0
    for rnd, by_name in enumerate(runs):
        ref = by_name[reference]["losses"]
        for name, run in by_name.items():
            # Compute alone trains each rank on its own gradients: only the loss before the
            # first update (the mean over the ranks' halves of the global batch) is comparable.
            checked = 1 if name == "alone" else len(ref)
            for step, (a, b) in enumerate(zip(run["losses"][:checked], ref[:checked])):
                rel = abs(a - b) / max(abs(b), 1e-12)
                worst = max(worst, rel)
                if rel > tol or len(run["losses"]) != len(ref):
                    bad.append((name, rnd, step, a, b))
    return bad, worst


RATIOS = [  # (label, numerator, denominator, target or None)
    ("fully_shard / compute alone", "shardline", "alone", 1.02),
    ("DDP+gloo / compute alone", "ddp", "alone", None),
    ("FSDP2+gloo / compute alone", "fsdp2", "alone", None),
    ("fully_shard / FSDP2+gloo", "shardline", "fsdp2", 0.95),
    ("fully_shard / DDP+gloo", "shardline", "ddp", 1.02),
    ("FSDP2+shardline / FSDP2+gloo", "fsdp2-sl", "fsdp2", 0.97),
    ("FSDP1 wrapper / fully_shard", "shardline-fsdp1", "shardline", None),
    ("FSDP1 wrapper / FSDP2+gloo", "shardline-fsdp1", "fsdp2", None),
    ("FSDP2+gloo / DDP+gloo", "fsdp2", "ddp", None),
    ("single 1 thread / DDP+gloo", "single-1t", "ddp", None),
]


def fmt_mib(b):
    return "—" if b is None else f"{b / MIB:.0f}"


def table(runs, names, steps, warmup):
    med = {}
    for name in names:
        rs = [r[name] for r in runs]
        state = rs[0]["state_bytes"]
        med[name] = {
            "step_time": statistics.median(r["step_time"] for r in rs),
            "cpu_time_per_rank": statistics.median(r["cpu_time_per_rank"] for r in rs),
            "rss_peak_bytes": statistics.median(r["rss_peak_bytes"] for r in rs),
            "allocator_peak_bytes": (None if any(r["allocator_peak_bytes"] is None for r in rs)
                                     else statistics.median(r["allocator_peak_bytes"]
                                                            for r in rs)),
            "state_bytes": sum(state.values()),
            "exposed_communication": (statistics.median(r["exposed_communication"] for r in rs)
                                      if "exposed_communication" in rs[0] else None),
            "rounds": [r["step_time"] for r in rs],
            "ranks": rs[0]["ranks"],
        }
    lines = [
        "| configuration | ranks × threads | step time (ms) | per round (ms) | CPU time per rank "
        "per step (ms) | peak RSS per rank (MiB) | allocator peak in a step (MiB) | "
        "params + grads + AdamW state per rank (MiB) | exposed communication (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        m = med[name]
        threads = "2" if name == "single-2t" else "1"
        ranks = m["ranks"]
        exposed = m["exposed_communication"]
        lines.append(
            f"| {CONFIGS[name][2]} | {ranks} × {threads} | {m['step_time'] * 1e3:.0f} | "
            f"{' / '.join(f'{t * 1e3:.0f}' for t in m['rounds'])} | "
            f"{m['cpu_time_per_rank'] * 1e3:.0f} | {fmt_mib(m['rss_peak_bytes'])} | "
            f"{fmt_mib(m['allocator_peak_bytes'])} | {m['state_bytes'] / MIB:.1f} | "
            f"{'n/a' if exposed is None else f'{exposed * 1e3:.1f}'} |")
    ratio_lines = ["| step-time ratio (median over rounds of the round's ratio) | per round | "
                   "median | target | met | CPU-time-per-rank ratio, per round | median |",
                   "|---|---|---|---|---|---|---|"]
    ratios = {}
    for label, num, den, target in RATIOS:
        if num not in med or den not in med:
            continue
        per_round = [r[num]["step_time"] / r[den]["step_time"] for r in runs]
        value = statistics.median(per_round)
        cpu = [r[num]["cpu_time_per_rank"] / r[den]["cpu_time_per_rank"] for r in runs]
        ratios[label] = {"per_round": per_round, "median": value, "target": target,
                         "cpu_per_round": cpu, "cpu_median": statistics.median(cpu)}
        met = "—" if target is None else ("yes" if value <= target else "no")
        ratio_lines.append(f"| {label} | {' / '.join(f'{x:.3f}' for x in per_round)} | "
                           f"{value:.3f} | {'—' if target is None else f'≤ {target}'} | {met} | "
                           f"{' / '.join(f'{x:.3f}' for x in cpu)} | "
                           f"{statistics.median(cpu):.3f} |")
    memory_lines = []
    if "shardline" in med and "fsdp2" in med:
        a, b = med["shardline"]["rss_peak_bytes"], med["fsdp2"]["rss_peak_bytes"]
        memory_lines.append(f"| fully_shard peak RSS per rank ≤ FSDP2+gloo's | {a / MIB:.0f} MiB "
                            f"vs {b / MIB:.0f} MiB ({a / b:.3f}×) | {'yes' if a <= b else 'no'} |")
    if "shardline" in med and "ddp" in med:
        a, b = med["shardline"]["state_bytes"], med["ddp"]["state_bytes"]
        n = med["shardline"]["ranks"]
        ok = a <= b / n * 1.01
        memory_lines.append(f"| fully_shard params + grads + AdamW state per rank = 1/{n} of "
                            f"DDP's | {a / MIB:.2f} MiB vs {b / MIB:.2f} MiB / {n} = "
                            f"{b / n / MIB:.2f} MiB | {'yes' if ok else 'no'} |")
    md = "\n".join(lines) + "\n\n" + "\n".join(ratio_lines) + "\n"
    if memory_lines:
        md += ("\n| memory target (medians over rounds) | measured | met |\n|---|---|---|\n"
               + "\n".join(memory_lines) + "\n")
    return med, ratios, md


def headline(args):
    model = QUICK if args.quick else FULL
    names = list(CONFIGS) if not args.only else args.only.split(",")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, loads = [], []
    started = datetime.datetime.now(datetime.timezone.utc)
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        by_name = {}
        for name in order:
            result = run_config(name, model, args, out_dir, f"r{rnd}", args.ranks)
            by_name[name] = result
            loads += [result["load_before"], result["load_after"]]
            extra = ""
            if "exposed_communication" in result:
                extra = f", exposed comm {result['exposed_communication'] * 1e3:.1f} ms"
            print(f"round {rnd} {name:10s} step {result['step_time'] * 1e3:8.1f} ms, CPU/rank "
                  f"{result['cpu_time_per_rank'] * 1e3:8.1f} ms, RSS "
                  f"{result['rss_peak_bytes'] / MIB:6.0f} MiB, load {result['load_before']:.1f}"
                  f"{extra}", flush=True)
        runs.append(by_name)
    return report(runs, names, model, args, out_dir, loads, started)


def summarize_dir(args):
    """The table of an earlier (or interrupted) headline run from its DIR/runs/ files: every
    round that has all its configurations."""
    out_dir = pathlib.Path(args.summarize)
    names = list(CONFIGS) if not args.only else args.only.split(",")
    runs, loads = [], []
    for rnd in range(args.rounds):
        by_name = {}
        for name in names:
            nranks = CONFIGS[name][1]
            nranks = args.ranks if nranks is None else max(nranks, 1)
            files = [out_dir / "runs" / f"r{rnd}-{name}.rank{r}.json" for r in range(nranks)]
            if not all(f.is_file() for f in files):
                break
            per_rank = [json.loads(f.read_text()) for f in files]
            before = per_rank[0].get("load_start")
            after = per_rank[0].get("load_end")
            by_name[name] = summarize(name, per_rank, args.warmup, before, after, None)
            loads += [x for x in (before, after) if x is not None]
        if len(by_name) < len(names):
            break
        runs.append(by_name)
    if not runs:
        raise SystemExit(f"{out_dir}: no complete round")
    args.rounds = len(runs)
    model = QUICK if args.quick else FULL
    started = datetime.datetime.fromtimestamp(
        min(f.stat().st_mtime for f in (out_dir / "runs").iterdir()), datetime.timezone.utc)
    return report(runs, names, model, args, out_dir, loads, started)


def report(runs, names, model, args, out_dir, loads, started):
    # Compute alone's losses are its own after the first step: never the reference.
    reference = ("single-1t" if "single-1t" in names
                 else next((n for n in names if n != "alone"), names[0]))
    bad, worst = check_losses(runs, reference, args.loss_tol)
    med, ratios, md = table(runs, names, args.steps, args.warmup)
    print()
    print(md)
    print(f"loss curves: largest relative difference from {reference}'s {worst:.2e} "
          f"(tolerance {args.loss_tol:.0e}): {'agree' if not bad else 'DISAGREE'}")
    for name, rnd, step, a, b in bad[:20]:
        print(f"  {name} round {rnd} step {step}: {a:.6f} vs {b:.6f}")
    loads = loads or [float("nan")]
    load = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    print(f"load average (1 min) over the run: min {load['min']:.1f}, median "
          f"{load['median']:.1f}, max {load['max']:.1f} on {os.cpu_count()} cores")
    result = {
        "started": started.isoformat(timespec="seconds"),
        "model": model, "ranks": args.ranks, "warmup": args.warmup, "steps": args.steps,
        "rounds": args.rounds, "cpus": os.cpu_count(), "load_average": load,
        "loss_check": {"reference": reference, "tolerance": args.loss_tol,
                       "worst_relative": worst, "agree": not bad},
        "losses": {name: runs[0][name]["losses"] for name in names},
        "summary": med, "ratios": ratios, "runs": runs,
    }
    import torch
    result["torch"] = torch.__version__
    with open(out_dir / "headline.json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out_dir / "headline.md", "w") as f:
        f.write(f"{md}\nLoad average (1 min) over the run: min {load['min']:.1f}, median "
                f"{load['median']:.1f}, max {load['max']:.1f} on {os.cpu_count()} cores. "
                f"Loss curves: largest relative difference {worst:.1e} "
                f"({'agree' if not bad else 'DISAGREE'}).\n")
    print(f"wrote {out_dir / 'headline.json'} and {out_dir / 'headline.md'}")
    return 0 if not bad else 1


SWEEP_MODEL = {"vocab": 4096, "layers": 4, "seq": 128, "batch": 2}
SWEEP_WIDTHS = [(128, 2), (256, 4), (384, 6), (512, 8)]  # (d, heads)
SWEEP_CONFIGS = ["ddp", "fsdp2", "shardline"]


def sweep(args):
    """Step time against the model's width on 2 and 4 ranks (1 thread each): DDP, FSDP2 and
    fully_shard over gloo / shardline; a smaller GPT and fewer steps than the headline."""
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    widths = SWEEP_WIDTHS[:args.sweep_widths]
    points, loads = [], []
    for ranks in (2, 4):
        for d, heads in widths:
            model = dict(SWEEP_MODEL, dim=d, heads=heads)
            for name in SWEEP_CONFIGS:
                r = run_config(name, model, args, out_dir, f"sweep-n{ranks}-d{d}", ranks,
                               memory_step=False)
                loads += [r["load_before"], r["load_after"]]
                points.append({"ranks": ranks, "dim": d, "config": name,
                               "step_time": r["step_time"],
                               "cpu_time_per_rank": r["cpu_time_per_rank"],
                               "rss_peak_bytes": r["rss_peak_bytes"],
                               "state_bytes": sum(r["state_bytes"].values()),
                               "losses": r["losses"]})
                print(f"sweep ranks {ranks} d {d:4d} {name:10s} step "
                      f"{r['step_time'] * 1e3:8.1f} ms, CPU/rank "
                      f"{r['cpu_time_per_rank'] * 1e3:8.1f} ms, load {r['load_before']:.1f}",
                      flush=True)
    load = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    lines = ["| ranks | d | " + " | ".join(f"{CONFIGS[c][2]} (ms)" for c in SWEEP_CONFIGS)
             + " | fully_shard / DDP | fully_shard / FSDP2 |",
             "|---|---|" + "---|" * (len(SWEEP_CONFIGS) + 2)]
    for ranks in (2, 4):
        for d, _ in widths:
            t = {p["config"]: p["step_time"] for p in points
                 if p["ranks"] == ranks and p["dim"] == d}
            lines.append(f"| {ranks} | {d} | "
                         + " | ".join(f"{t[c] * 1e3:.0f}" for c in SWEEP_CONFIGS)
                         + f" | {t['shardline'] / t['ddp']:.2f} | "
                         f"{t['shardline'] / t['fsdp2']:.2f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    with open(out_dir / "sweep.json", "w") as f:
        json.dump({"model": SWEEP_MODEL, "widths": widths, "warmup": args.warmup,
                   "steps": args.steps, "load_average": load, "points": points}, f, indent=1)
    with open(out_dir / "sweep.md", "w") as f:
        f.write(md + f"\nLoad average (1 min): min {load['min']:.1f}, median "
                f"{load['median']:.1f}, max {load['max']:.1f} on {os.cpu_count()} cores.\n")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, ranks in zip(axes, (2, 4)):
            for name in SWEEP_CONFIGS:
                xs = [p["dim"] for p in points if p["ranks"] == ranks and p["config"] == name]
                ys = [p["step_time"] * 1e3 for p in points
                      if p["ranks"] == ranks and p["config"] == name]
                ax.plot(xs, ys, marker="o", label=CONFIGS[name][2])
            ax.set_title(f"{ranks} ranks x 1 thread on {os.cpu_count()} cores")
            ax.set_xlabel("model width d (4 layers, seq 128, micro-batch 2)")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("median step time (ms)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 2 steps (1 warm-up), 1 round: a smoke test")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--loss-tol", type=float, default=1e-3,
                   help="largest relative difference of a loss from single-1t's")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", default="")
    p.add_argument("--sweep", action="store_true",
                   help="instead of the headline: the width x ranks sweep (3 steps after 1)")
    p.add_argument("--sweep-widths", type=int, default=len(SWEEP_WIDTHS),
                   help="how many of the widths " + str([d for d, _ in SWEEP_WIDTHS]))
    p.add_argument("--summarize", default="", metavar="DIR",
                   help="only the report of DIR/runs/ (complete rounds of an earlier run)")
    p.add_argument("--plot", default="", help="--sweep: write the plot (PNG) here")
    args = p.parse_args()
    defaults = (1, 1, 1) if args.quick else ((1, 3, 1) if args.sweep else (3, 10, 3))
    args.rounds = defaults[0] if args.rounds is None else args.rounds
    args.steps = defaults[1] if args.steps is None else args.steps
    args.warmup = defaults[2] if args.warmup is None else args.warmup
    if not args.out:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
        name = f"{stamp}-torch{'-quick' if args.quick else ''}{'-sweep' if args.sweep else ''}"
        args.out = str(ROOT / "build" / "bench-results" / name)
    if args.summarize:
        args.out = args.summarize
        sys.exit(summarize_dir(args))
    sys.exit(sweep(args) if args.sweep else headline(args))


if __name__ == "__main__":
    main()
