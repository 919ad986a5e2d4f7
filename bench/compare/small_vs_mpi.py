#!/usr/bin/env python3
"""Small-message latency: one or more builds of shardline's perf binaries and Open MPI, one run.

    bench/compare/small_vs_mpi.py --bins before=OLD/build/bench after=build/bench \
        --launch build/bin/shardline-launch --mpi build/compare/mpi_perf \
        [--ranks 2 4] [--rounds 8] [--size 8192] [--iters 500] [--warmup 100] [--json out.json]

For each round and rank count, every system runs every collective at one size (the order of the
systems rotates between rounds); shardline under shardline-launch (SHARDLINE_TIMEOUT_S=120,
every other knob at its default; `name=dir@caller` runs that build with `--stream caller`, the
collectives on the issuing thread as a CPU framework drives them, `@caller,core` also pins the
ranks with `shardline-launch --bind-to core`, `@caller,UCX_YIELD=never` sets a knob), Open MPI as bench/compare/run_comparison.py runs it (mpirun
--oversubscribe --bind-to none, or --mpi-bind's value; no MCA parameter but the warnings one; build mpi_perf with
`mpicxx -O2 -std=c++17 -o build/compare/mpi_perf bench/compare/mpi_perf.cc`). A system's time
in a round is the better of out-of-place and in-place; the report gives the median over rounds,
Open MPI's time / each build's time (>= 1: at least as fast as Open MPI) and the 1-minute load
average sampled before every launch. Data are checked (-c 1) in the first round.
"""
import argparse, json, os, statistics, subprocess, sys, time
COLLS = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "alltoall"]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_base_warn_component_unused": "0"}

def rows(out):
    res = {}
    coll = None
    for line in out.splitlines():
        if line.startswith("# collective "):
            coll = line.split()[2]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        c = line.split()
        if len(c) >= 13:
            for w in (c[8], c[12]):
                if w not in ("0", "N/A"):
                    raise RuntimeError("wrong: " + line)
            t = [float(x) for x in (c[5], c[9]) if x != "N/A"]
            res.setdefault(coll, []).append((int(c[0]), min(t)))
    return res

def run(cmd, env=None, timeout=120):
    e = dict(os.environ); e.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(" ".join(cmd) + "\n" + p.stdout + p.stderr)
    return p.stdout

ap = argparse.ArgumentParser()
ap.add_argument("--bins", nargs="+", required=True,
                help="name=dir, or name=dir@OPTS, OPTS comma-separated: host or caller (--stream), "
                     "core (shardline-launch --bind-to core), KNOB=value (SHARDLINE_KNOB=value)")
ap.add_argument("--mpi-bind", default="none",
                help="mpirun --bind-to value (none; core:overload-allowed to pin 4 ranks on 2 CPUs)")
ap.add_argument("--launch", required=True)
ap.add_argument("--mpi", required=True)
ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--colls", nargs="+", default=COLLS)
ap.add_argument("--size", default="8192")
ap.add_argument("--iters", type=int, default=500)
ap.add_argument("--warmup", type=int, default=100)
ap.add_argument("--json")
a = ap.parse_args()
bins = [b.split("=", 1) for b in a.bins]
data = {}
loads = []
systems = [n for n, _ in bins] + ["openmpi"]
for r in range(a.rounds):
    for n in a.ranks:
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            loads.append(os.getloadavg()[0])
            if s == "openmpi":
                for coll in a.colls:
                    out = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", a.mpi_bind,
                               "-n", str(n), a.mpi, coll, "-b", a.size, "-e", a.size, "-n", str(a.iters),
                               "-w", str(a.warmup), "-c", "1" if r == 0 else "0"], MPI_ENV)
                    for (size, t) in list(rows(out).values())[0]:
                        data.setdefault((s, coll, n, size), []).append(t)
            else:
                d, _, opts = dict(bins)[s].partition("@")
                opts = [o for o in opts.split(",") if o]
                extra = [x for o in opts if o in ("host", "caller") for x in ("--stream", o)]
                bind = ["--bind-to", "core"] if "core" in opts else []
                knobs = dict(("SHARDLINE_" + o.split("=", 1)[0], o.split("=", 1)[1])
                             for o in opts if "=" in o)
                for coll in a.colls:
                    out = run([sys.executable, a.launch, "-n", str(n)] + bind +
                              ["--", os.path.join(d, coll + "_perf"),
                               "-b", a.size, "-e", a.size, "-n", str(a.iters), "-w", str(a.warmup),
                               "-c", "1" if r == 0 else "0"] + extra,
                              dict(knobs, SHARDLINE_TIMEOUT_S="120"))
                    for (size, t) in list(rows(out).values())[0]:
                        data.setdefault((s, coll, n, size), []).append(t)
    print(f"round {r} done load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
hdr = "| collective | ranks | size | " + " | ".join(f"{s} µs" for s in systems) + " | " + \
      " | ".join(f"{s} vs Open MPI" for s, _ in bins) + " |"
print(hdr); print("|" + "---|" * (3 + len(systems) + len(bins)))
out = []
for coll in a.colls:
    for n in a.ranks:
        keys = sorted({k[3] for k in data if k[1] == coll and k[2] == n})
        for size in keys:
            med = {s: statistics.median(data[(s, coll, n, size)]) for s in systems}
            ratios = {s: med["openmpi"] / med[s] for s, _ in bins}
            print(f"| {coll} | {n} | {size} | " + " | ".join(f"{med[s]:.1f}" for s in systems) + " | " +
                  " | ".join(f"{ratios[s]:.2f}x" for s, _ in bins) + " |")
            out.append({"coll": coll, "ranks": n, "size": size,
                        "runs": {s: data[(s, coll, n, size)] for s in systems}})
print(f"\nload (1-min avg) sampled before each launch: min {min(loads):.2f} median {statistics.median(loads):.2f} max {max(loads):.2f}")
if a.json:
    json.dump({"cells": out, "loads": loads}, open(a.json, "w"), indent=1)
