#!/usr/bin/env python3
"""All-gather and reduce-scatter against their memory-traffic ceilings on one host, in one run.

    bench/compare/ceiling_comparison.py [--build-dir build] [--base-bench OLD/build/bench] \\
        [--ranks 2 4] [--sizes 16M 64M] [--rounds 5] [--json FILE]

A collective on one host moves its bytes through the machine's memory, which all ranks share. So
each collective's busbw is set against what the memory allows it, measured in the same run:

  C  = the aggregate copy bandwidth of N concurrent copiers with non-temporal stores, N = the
       rank count, each copying `size` bytes (memcpy_perf -t N -s 1): bytes copied per second,
       one read and one write of memory per byte copied, so the machine moves 2C bytes/s.
  all-gather (in place, size S = the gathered buffer): every rank reads the (n-1)/n * S it
       receives and writes it once: 2(n-1)S bytes of traffic for busbw * t = (n-1)S/n, i.e. 2n
       bytes per busbw byte, ceiling = 2C / 2n = C / n.
  reduce-scatter (size S = the input): every rank reads its block of every input (n * S/n) and
       writes its S/n once: (n+1)S bytes for busbw * t = (n-1)S/n, i.e. n(n+1)/(n-1) bytes per
       busbw byte, ceiling = 2C(n-1) / (n(n+1)) (C/3 at 2 ranks, 0.3C at 4).
  fraction = busbw / ceiling.

Per rank count and round the systems run one after another in an order that rotates every
round: shardline (all_gather_perf, reduce_scatter_perf under shardline-launch, every knob at its
default), optionally a base build of the same binaries (--base-bench: an A/B in the same run),
Open MPI (mpi_perf), Gloo (gloo_perf) and memcpy_perf -t N -s 1. Data are checked in the first
round. A number is the median over rounds of the better of out-of-place and in-place busbw.
Prints a Markdown table (for docs/benchmarks.md) and writes the JSON (machine, load, ceilings,
cells, every measurement). The peer drivers are built by run_comparison.py's build step.
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_comparison as rc  # noqa: E402

COLLS = ["all_gather", "reduce_scatter"]
PEERS = ["openmpi", "gloo"]


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def ceiling(coll, n, copy_bw):
    """busbw ceiling (GB/s) of `coll` at n ranks from the aggregate copy bandwidth C (GB/s)."""
    if coll == "all_gather":
        return copy_bw / n
    return 2 * copy_bw * (n - 1) / (n * (n + 1))


def measure(args, peers_dir):
    launch = os.path.join(args.build_dir, "bin", "shardline-launch")
    mpi_env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_btl_base_warn_component_unused": "0"}
    lo, hi = min(args.sizes), max(args.sizes)
    factor = max(2, hi // lo) if hi > lo else 2
    systems = ["shardline"] + (["base"] if args.base_bench else []) + \
        ([] if args.no_peers else PEERS) + ["memcpy"]
    records, failures, timings = [], [], []
    for n in args.ranks:
        for rnd in range(args.rounds):
            sweep = ["-b", str(lo), "-e", str(hi), "-f", str(factor), "-n", str(args.iters),
                     "-w", str(args.warmup)]
            check = ["-c", "1" if rnd == 0 else "0"]
            blocks = {s: [] for s in systems}
            for coll in COLLS:
                for system, bench in (("shardline", os.path.join(args.build_dir, "bench")),
                                      ("base", args.base_bench)):
                    if system in blocks:
                        blocks[system].append(
                            (coll, [sys.executable, launch, "-n", str(n), "--grace", "5", "--",
                                    os.path.join(bench, f"{coll}_perf")] + sweep + check,
                             {"SHARDLINE_TIMEOUT_S": "120"}))
                if "openmpi" in blocks:
                    blocks["openmpi"].append(
                        (coll, ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to",
                                "none", "-n", str(n), os.path.join(peers_dir, "mpi_perf"),
                                coll] + sweep + check, mpi_env))
                if "gloo" in blocks:
                    blocks["gloo"].append(
                        (coll, [sys.executable, launch, "-n", str(n), "--grace", "5", "--",
                                os.path.join(peers_dir, "gloo_perf"), coll] + sweep + check,
                         None))
            blocks["memcpy"].append(
                ("memcpy", [os.path.join(peers_dir, "memcpy_perf"), "-t", str(n), "-s", "1"] +
                 sweep, None))
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            for system in order:
                for coll, cmd, env in blocks[system]:
                    env = dict(env or {})
                    tmp = None
                    if system == "gloo":
                        tmp = tempfile.mkdtemp(prefix="shardline-gloo-")
                        env["GLOO_STORE_DIR"] = tmp
                    code, out, took = rc.run_launch(cmd, timeout=args.launch_timeout, env=env)
                    if tmp:
                        shutil.rmtree(tmp, ignore_errors=True)
                    timings.append({"system": system, "coll": coll, "nranks": n, "round": rnd,
                                    "seconds": round(took, 2), "load": round(rc.loadavg()[0], 2)})
                    got = rc.parse_rows(out, coll, system, n)
                    for r in got:
                        r["round"] = rnd
                        r["system"] = system  # the base build prints "shardline"
                        r["coll"] = coll
                    records.extend(got)
                    if code != 0 or not got:
                        what = "timed out" if code is None else f"exit {code}"
                        failures.append({"system": system, "coll": coll, "nranks": n,
                                         "round": rnd, "what": what, "tail": out[-2000:]})
                        rc.log(f"  !! {system} {coll} n={n} round {rnd}: {what}")
            rc.log(f"  n={n} round {rnd + 1}/{args.rounds} done (load {rc.loadavg()[0]:.2f})")
    return records, failures, timings


def table(best, args):
    systems = ["shardline"] + (["base"] if args.base_bench else []) + \
        ([] if args.no_peers else PEERS)
    names = {"shardline": "shardline", "base": "shardline (base)", "openmpi": "Open MPI",
             "gloo": "Gloo"}
    head = "| collective | ranks | size | copy C GB/s | ceiling GB/s |"
    rule = "|---|---|---|---:|---:|"
    for s in systems:
        head += f" {names[s]} busbw | fraction |"
        rule += "---:|---:|"
    if args.base_bench:
        head += " shardline / base |"
        rule += "---:|"
    lines, cells = [head, rule], []
    for coll in COLLS:
        for n in args.ranks:
            for size in args.sizes:
                mc = best.get(("memcpy", "memcpy", n, size))
                if mc is None:
                    continue
                cap = ceiling(coll, n, mc["busbw"])
                cell = {"coll": coll, "nranks": n, "size": size, "copy_bw": mc["busbw"],
                        "ceiling": cap}
                line = f"| {coll} | {n} | {rc.human(size)} | {mc['busbw']:.2f} | {cap:.2f} |"
                for s in systems:
                    v = best.get((s, coll, n, size))
                    bw = v["busbw"] if v else None
                    cell[s] = bw
                    cell[f"{s}_fraction"] = bw / cap if bw is not None else None
                    line += (" - | - |" if bw is None else f" {bw:.2f} | {bw / cap:.2f} |")
                if args.base_bench:
                    a, b = cell.get("base"), cell.get("shardline")
                    cell["vs_base"] = b / a if a and b else None
                    line += f" {cell['vs_base']:.2f}x |" if cell["vs_base"] else " - |"
                lines.append(line)
                cells.append(cell)
    return lines, cells


def targets(cells, args):
    """The reduce-scatter reaches the all-gather's fraction of its own ceiling."""
    out = []
    by = {(c["coll"], c["nranks"], c["size"]): c for c in cells}
    for n in args.ranks:
        for size in args.sizes:
            ag, rs = by.get(("all_gather", n, size)), by.get(("reduce_scatter", n, size))
            if not ag or not rs or ag["shardline_fraction"] is None or \
                    rs["shardline_fraction"] is None:
                continue
            out.append({"nranks": n, "size": rc.human(size),
                        "all_gather": round(ag["shardline_fraction"], 3),
                        "reduce_scatter": round(rs["shardline_fraction"], 3),
                        "met": rs["shardline_fraction"] >= ag["shardline_fraction"]})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(rc.ROOT, "build"))
    parser.add_argument("--base-bench", help="bench/ directory of a base build (A/B)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["16M", "64M"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-peers", action="store_true", help="leave Open MPI and Gloo out")
    parser.add_argument("--no-build", action="store_true",
                        help="use the binaries as they are (peer drivers in <build-dir>/compare)")
    parser.add_argument("--launch-timeout", type=float, default=240)
    parser.add_argument("--json", help="output file (default build/bench-results/ceiling-*.json)")
    args = parser.parse_args()
    args.build_dir = os.path.abspath(args.build_dir)
    args.sizes = sorted(parse_size(s) for s in args.sizes)
    if len(args.sizes) > 2 or (len(args.sizes) == 2 and args.sizes[1] % args.sizes[0]):
        parser.error("--sizes: one size, or two where the larger is a multiple of the smaller")
    started = time.monotonic()
    if args.no_build:
        peers_dir = os.path.join(args.build_dir, "compare")
    else:
        rc.ensure_dependencies(skip_install=True)
        peers_dir = rc.build(args.build_dir)
    info = rc.machine()
    load_before = [round(x, 2) for x in rc.loadavg()]
    rc.log(f"ceiling_comparison: {info.get('Model name', '?')}, {info.get('CPU(s)', '?')} CPUs; "
           f"load {load_before}")
    records, failures, timings = measure(args, peers_dir)
    load_after = [round(x, 2) for x in rc.loadavg()]
    _, best = rc.summarise(records)
    lines, cells = table(best, args)
    goals = targets(cells, args)
    wrong = sum(r["wrong"] or 0 for r in records)
    checked = sum(1 for r in records if r["wrong"] is not None)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    path = args.json or os.path.join(rc.ROOT, "build", "bench-results", f"ceiling-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"date": stamp, "machine": info, "load_before": load_before, "load_after": load_after,
           "load_during": rc.load_during(timings), "ranks": args.ranks, "sizes": args.sizes,
           "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup,
           "base_bench": args.base_bench, "checked_cells": checked, "wrong_elements": wrong,
           "failures": failures, "targets": goals, "cells": cells,
           "elapsed_seconds": round(time.monotonic() - started, 1),
           "record_fields": rc.RECORD_FIELDS}
    # Bulky parts one row per line (as run_comparison.py writes them).
    text = json.dumps(doc, indent=1)[:-2]
    text += ',\n "records": [\n  ' + ",\n  ".join(
        json.dumps([r[f] for f in rc.RECORD_FIELDS]) for r in records) + "\n ]"
    text += ',\n "launches": [\n  ' + ",\n  ".join(json.dumps(t) for t in timings) + "\n ]\n}\n"
    with open(path, "w") as f:
        f.write(text)
    print()
    print("\n".join(lines))
    print()
    print("| ranks | size | all_gather fraction | reduce_scatter fraction | met |")
    print("|---|---|---:|---:|---|")
    for g in goals:
        print(f"| {g['nranks']} | {g['size']} | {g['all_gather']:.2f} | "
              f"{g['reduce_scatter']:.2f} | {'yes' if g['met'] else 'NO'} |")
    print()
    rc.log(f"ceiling_comparison: {len(timings)} launches, {checked} checked cells, {wrong} wrong "
           f"elements, {len(failures)} failed launches; load {load_before[0]:.2f} -> "
           f"{load_after[0]:.2f} (during: {doc['load_during']}); "
           f"{time.monotonic() - started:.0f} s; wrote {path}")
    return 1 if wrong or failures else 0


if __name__ == "__main__":
    sys.exit(main())
