#!/usr/bin/env python3
"""Two builds of shardline's perf binaries, side by side in one run (A/B).

The machine is noisy and runs differ by more than 10% among themselves, so two versions are
compared only within one run: every round runs each (collective, ranks, size) cell on A and then
on B (the order alternates between rounds), and the report gives the median busbw of each and
the ratio B/A per cell. Out-of-place and in-place columns are reported separately.

  bench/compare/ab_versions.py --a OLD/build/bench --b build/bench \
      --launch build/bin/shardline-launch [--rounds 5] [--ranks 2 4] [--sizes 8K 32M] \
      [--json out.json]

A Google Benchmark microbenchmark of bench/micro (scheduler_hooks_bench, ...) the same way: each
round runs A's binary and B's (alternating which goes first), and the report gives the median of
the rounds for every benchmark's wall time and per-unit counters, and B/A:

  bench/compare/ab_versions.py --a OLD/build/bench --b build/bench \
      --micro scheduler_hooks_bench [--filter REGEX] [--min-time 0.2] [--rounds 5]

Prints a Markdown table (for docs/benchmarks.md).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "alltoall"]


def number(text):
    return float("nan") if text == "N/A" else float(text)


def parse_row(out):
    """busbw (out-of-place, in-place) of the single data row of nccl-tests-style output."""
    for line in out.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cols = line.split()
        # size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong
        if len(cols) >= 13:
            wrong = (cols[8], cols[12])
            if any(w not in ("0", "N/A") for w in wrong):
                raise RuntimeError(f"#wrong is not 0: {line}")
            return tuple(number(cols[i]) for i in (7, 11, 5, 9))
    raise RuntimeError("no data row in:\n" + out)


def run_cell(launch, bindir, coll, ranks, size, iters, warmup, timeout):
    cmd = [sys.executable, launch, "-n", str(ranks), "--",
           os.path.join(bindir, f"{coll}_perf"), "-b", size, "-e", size,
           "-n", str(iters), "-w", str(warmup), "-c", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    return parse_row(out.stdout)


def iterations(size):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    n = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return (2000, 200) if n <= (1 << 20) else (20, 5)


def run_micro(bindir, name, bench_filter, min_time, timeout):
    """{benchmark name: {"wall_ns": ..., counter: ...}} of one run of a Google Benchmark binary."""
    cmd = [os.path.join(bindir, name), "--benchmark_format=json",
           f"--benchmark_min_time={min_time}"]
    if bench_filter:
        cmd.append(f"--benchmark_filter={bench_filter}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    rows = {}
    for bench in json.loads(out.stdout)["benchmarks"]:
        if bench.get("run_type", "iteration") != "iteration":
            continue
        scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[bench.get("time_unit", "ns")]
        row = {"wall_ns": bench["real_time"] * scale}
        for key, value in bench.items():
            if key.endswith("_per_unit") and isinstance(value, (int, float)):
                row[key] = value
        rows[bench["name"]] = row
    return rows


def micro_main(args):
    runs = {"A": [], "B": []}
    for rnd in range(args.rounds):
        order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
        for version in order:
            bindir = args.a if version == "A" else args.b
            runs[version].append(run_micro(bindir, args.micro, args.filter, args.min_time,
                                           args.timeout))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    names = list(runs["A"][0])
    metrics = list(runs["A"][0][names[0]])
    print("| benchmark | metric | A (median) | B (median) | B/A |")
    print("|---|---|---:|---:|---:|")
    report = []
    for name in names:
        for metric in metrics:
            med = {v: statistics.median(r[name][metric] for r in runs[v]) for v in ("A", "B")}
            ratio = med["B"] / med["A"] if med["A"] else float("nan")
            print(f"| {name} | {metric} | {med['A']:.1f} | {med['B']:.1f} | {ratio:.2f} |")
        report.append({"benchmark": name, "A": [r[name] for r in runs["A"]],
                       "B": [r[name] for r in runs["B"]]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--a", required=True, help="bin dir of version A (the baseline)")
    p.add_argument("--b", required=True, help="bin dir of version B")
    p.add_argument("--launch", help="shardline-launch (collectives)")
    p.add_argument("--micro", help="a Google Benchmark binary's name in both bin dirs")
    p.add_argument("--filter", help="--benchmark_filter for --micro")
    p.add_argument("--min-time", type=float, default=0.2, help="--benchmark_min_time (s)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", nargs="+", default=["8K", "32M"])
    p.add_argument("--collectives", nargs="+", default=COLLECTIVES)
    p.add_argument("--timeout", type=int, default=120)
    p.add_argument("--json")
    args = p.parse_args()
    if args.micro:
        micro_main(args)
        return
    if not args.launch:
        p.error("--launch is needed for the collectives (or give --micro)")

    cells = [(c, n, s) for c in args.collectives for n in args.ranks for s in args.sizes]
    results = {cell: {"A": [], "B": []} for cell in cells}
    for rnd in range(args.rounds):
        order = ("A", "B") if rnd % 2 == 0 else ("B", "A")
        for cell in cells:
            for version in order:
                bindir = args.a if version == "A" else args.b
                iters, warmup = iterations(cell[2])
                results[cell][version].append(
                    run_cell(args.launch, bindir, *cell, iters, warmup, args.timeout))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    print("| collective | ranks | size | A busbw oop / ip (GB/s) | B busbw oop / ip (GB/s) "
          "| B/A oop | B/A ip | A time oop (µs) | B time oop (µs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    report = []
    for cell in cells:
        med = {v: [statistics.median([x[i] for x in results[cell][v]]) for i in range(4)]
               for v in ("A", "B")}
        a, b = med["A"], med["B"]
        ratio = [b[i] / a[i] if a[i] > 0 else float("nan") for i in range(2)]
        print(f"| {cell[0]} | {cell[1]} | {cell[2]} | {a[0]:.2f} / {a[1]:.2f} | "
              f"{b[0]:.2f} / {b[1]:.2f} | {ratio[0]:.2f} | {ratio[1]:.2f} | {a[2]:.1f} | "
              f"{b[2]:.1f} |")
        report.append({"collective": cell[0], "ranks": cell[1], "size": cell[2],
                       "A": results[cell]["A"], "B": results[cell]["B"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
