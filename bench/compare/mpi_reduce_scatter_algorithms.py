#!/usr/bin/env python3
"""Open MPI's reduce-scatter under each of its `coll_tuned` algorithms, beside shardline's, in one run.

    bench/compare/mpi_reduce_scatter_algorithms.py [--build-dir build] [--ranks 2 4] [--rounds 3]
        [--json build/bench-results/<date>-mpi-reduce-scatter-algorithms.json]

Open MPI picks a reduce-scatter algorithm by a fixed decision table unless
`coll_tuned_use_dynamic_rules` is set; then `coll_tuned_reduce_scatter_block_algorithm` forces
one (MPI_Reduce_scatter_block, what bench/compare/mpi_perf.cc calls): 1 basic linear,
2 recursive doubling, 3 recursive halving, 4 butterfly; 0 (or no setting) is the decision
table. For a fair "N x best peer" the peer is the best of these at each size. For every round
and rank count, the systems (shardline's reduce_scatter_perf over UCX under shardline-launch,
Open MPI with its default decision and with each forced algorithm, under mpirun
--oversubscribe --bind-to none as bench/compare/run_comparison.py runs it) take turns in an
order that rotates between rounds. A system's busbw at a size is the better of out-of-place and
in-place; the report is the median over rounds. Data are checked (-c 1) in the first round.
mpi_perf is compiled with mpicxx into <build-dir>/compare if missing. Outside CI.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_base_warn_component_unused": "0"}
ALGORITHMS = {0: "default (decision table)", 1: "basic linear", 2: "recursive doubling",
              3: "recursive halving", 4: "butterfly"}
# (lo, hi, factor, iters, warmup): one launch per group, as run_comparison.py's groups.
GROUPS = [(8192, 8192, 2, 500, 100), (256 * 1024, 4 * 1024 * 1024, 16, 20, 3),
          (32 * 1024 * 1024, 32 * 1024 * 1024, 2, 5, 1)]


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def busbw(out):
    """{bytes: best of oop/ip busbw} from nccl-tests-style rows; raises on #wrong != 0."""
    res = {}
    for line in out.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        c = line.split()
        if len(c) < 13:
            continue
        for wrong in (c[8], c[12]):
            if wrong not in ("0", "N/A"):
                raise RuntimeError("wrong values: " + line)
        bw = [float(x) for x in (c[7], c[11]) if x not in ("N/A", "nan")]
        if bw:
            res[int(c[0])] = max(bw)
    return res


def run(cmd, env, timeout):
    e = dict(os.environ)
    e.update(env)
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.rounds < 1:
        sys.exit("--rounds must be >= 1")
    bins = os.path.join(args.build_dir, "bench")
    launch = os.path.join(args.build_dir, "bin", "shardline-launch")
    mpi_perf = os.path.join(args.build_dir, "compare", "mpi_perf")
    if not os.path.exists(mpi_perf):
        os.makedirs(os.path.dirname(mpi_perf), exist_ok=True)
        subprocess.run(["mpicxx", "-O2", "-std=c++17", "-o", mpi_perf,
                        os.path.join(ROOT, "bench", "compare", "mpi_perf.cc")], check=True)
    systems = ["shardline"] + [f"openmpi-{a}" for a in ALGORITHMS]
    samples = {}  # (system, ranks, bytes) -> [busbw per round]
    loads = []
    start = time.monotonic()
    for rnd in range(args.rounds):
        check = ["-c", "1" if rnd == 0 else "0"]
        for n in args.ranks:
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            for system in order:
                for lo, hi, factor, iters, warmup in GROUPS:
                    sweep = ["-b", str(lo), "-e", str(hi), "-f", str(factor), "-n", str(iters),
                             "-w", str(warmup)] + check
                    loads.append(loadavg())
                    if system == "shardline":
                        out = run([sys.executable, launch, "-n", str(n), "--grace", "5", "--",
                                   os.path.join(bins, "reduce_scatter_perf")] + sweep,
                                  {"SHARDLINE_TIMEOUT_S": "120"}, args.timeout)
                    else:
                        algorithm = int(system.split("-")[1])
                        env = dict(MPI_ENV)
                        if algorithm:
                            env["OMPI_MCA_coll_tuned_use_dynamic_rules"] = "1"
                            env["OMPI_MCA_coll_tuned_reduce_scatter_block_algorithm"] = \
                                str(algorithm)
                        out = run(["mpirun", "--allow-run-as-root", "--oversubscribe",
                                   "--bind-to", "none", "-n", str(n), mpi_perf,
                                   "reduce_scatter"] + sweep, env, args.timeout)
                    for size, bw in busbw(out).items():
                        samples.setdefault((system, n, size), []).append(bw)
    elapsed = time.monotonic() - start
    sizes = sorted({k[2] for k in samples})
    table = []
    print(f"# {args.rounds} rounds, {elapsed:.0f} s, 1-minute load {min(loads):.1f}-{max(loads):.1f}")
    header = ["ranks", "size", "shardline"] + [f"OMPI {ALGORITHMS[a]}" for a in ALGORITHMS] + \
             ["best peer", "shardline / best"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for n in args.ranks:
        for size in sizes:
            med = {s: statistics.median(samples[(s, n, size)]) for s in systems
                   if (s, n, size) in samples}
            peers = {s: v for s, v in med.items() if s != "shardline"}
            best = max(peers, key=peers.get) if peers else None
            ratio = med["shardline"] / peers[best] if best and peers[best] > 0 else float("nan")
            table.append({"ranks": n, "bytes": size, "busbw_GBps": med, "best_peer": best,
                          "shardline_over_best": ratio})
            label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
            cells = [f"{med.get(s, float('nan')):.2f}" for s in systems]
            print(f"| {n} | {label} | " + " | ".join(cells) +
                  f" | {ALGORITHMS[int(best.split('-')[1])] if best else '-'} | {ratio:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "rounds": args.rounds, "elapsed_s": round(elapsed, 1),
                       "load_min_max": [min(loads), max(loads)], "groups": GROUPS,
                       "algorithms": ALGORITHMS, "results": table,
                       "samples": [{"system": k[0], "ranks": k[1], "bytes": k[2], "busbw": v}
                                   for k, v in sorted(samples.items())]}, f, indent=1)


if __name__ == "__main__":
    main()
