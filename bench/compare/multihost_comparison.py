#!/usr/bin/env python3
"""Cross-host busbw: shardline against Open MPI on test hosts made of namespaces, in one run.

    bench/compare/multihost_comparison.py [--build-dir build] [--hosts 2] [--per-host 2]
                                          [--rounds 3] [--quick]

Creates the test hosts of tests/scripts/testhosts.py (network, UTS, IPC, PID and mount namespaces
joined by veth pairs through a bridge; needs root), then, for every round, runs on them
  - shardline: all_gather_perf, reduce_scatter_perf and all_reduce_perf (bench/perf), one
    `shardline-launch --nnodes H --node-rank K` per host, as across machines (UCX: TCP between
    hosts, shared memory / single copy within);
  - Open MPI: bench/compare/mpi_perf under one mpirun across the hosts, with its best settings
    across hosts (`--mca btl tcp,vader,self`, TCP restricted to the test subnet), started on the
    other hosts through testhosts.py's rsh agent;
in alternating order, over the same size groups. Data are checked in the first round. Prints a
Markdown table (median busbw over rounds, better of out-of-place and in-place, recomputed from
the times in MB/s) and writes build/bench-results/multihost-<date>.json (--table JSON reprints it).
Reuses run_comparison.py's parsing and summaries.
"""

import argparse
import datetime
import json
import os
import secrets
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
import run_comparison as rc  # noqa: E402
from testhosts import SUBNET, TestHosts  # noqa: E402

COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce"]
KIB, MIB = 1024, 1024 * 1024
GROUPS = [  # (min, max, factor, iters, warmup)
    (64 * KIB, 1 * MIB, 4, 10, 5),
    (4 * MIB, 64 * MIB, 4, 3, 1),
]
QUICK_GROUPS = [(1 * MIB, 4 * MIB, 4, 3, 1)]
STORE_PORT = 29500


def build(build_dir):
    rc.sh(["cmake", "--build", build_dir, "--target"] + [f"{c}_perf" for c in COLLECTIVES])
    out = os.path.join(build_dir, "compare")
    os.makedirs(out, exist_ok=True)
    target = os.path.join(out, "mpi_perf")
    sources = [os.path.join(HERE, "mpi_perf.cc"), os.path.join(HERE, "report.h")]
    if not os.path.exists(target) or any(os.path.getmtime(s) > os.path.getmtime(target)
                                         for s in sources):
        rc.sh(["mpicxx", "-O2", "-std=c++17", "-o", target, sources[0]])
    return target


def run_on_hosts(hosts, commands, env, timeout):
    """Starts commands[k] on host k together; (exit codes or None, joined output, seconds)."""
    start = time.monotonic()
    procs = [hosts.popen(k, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True) for k, cmd in enumerate(commands) if cmd is not None]
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, start + timeout - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            out, _ = p.communicate()
            codes.append(None)
        outs.append(out)
    return codes, "\n".join(outs), time.monotonic() - start


def shardline_launches(args, hosts, groups, check):
    launch = os.path.join(ROOT, "collectives", "tools", "shardline-launch")
    for gi, (lo, hi, factor, iters, warmup) in enumerate(groups):
        sweep = ["-b", str(lo), "-e", str(hi), "-f", str(factor), "-n", str(iters), "-w",
                 str(warmup), "-c", check]
        for coll in COLLECTIVES:
            binary = os.path.join(args.build_dir, "bench", f"{coll}_perf")
            yield coll, [[sys.executable, launch, "-n", str(args.per_host), "--nnodes",
                          str(args.hosts), "--node-rank", str(k), "--master-addr",
                          hosts[0].addr, "--master-port", str(STORE_PORT), "--grace", "5", "--",
                          binary] + sweep for k in range(args.hosts)]


def mpirun_command(args, hosts, mpi_perf, groups, check):
    agent = f"{sys.executable} {os.path.join(ROOT, 'tests', 'scripts', 'testhosts.py')} rsh"
    host_list = ",".join(f"{h.addr}:{args.per_host}" for h in hosts)
    return ["mpirun", "--host", host_list, "-n", str(args.hosts * args.per_host),
            "--bind-to", "none", "--mca", "plm_rsh_agent", agent,
            "--mca", "btl", "tcp,vader,self", "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24",
            "--mca", "oob_tcp_if_include", f"{SUBNET}.0/24", mpi_perf, "all"] + \
        rc.group_flags(groups) + ["-c", check]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one small group (a smoke test)")
    parser.add_argument("--launch-timeout", type=float, default=300)
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "bench-results"))
    parser.add_argument("--table", metavar="JSON",
                        help="print the table of an earlier run's results file and exit")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            doc = json.load(f)
        print("\n".join(table(doc["records"], doc["hosts"] * doc["per_host"])[0]))
        return 0
    args.build_dir = os.path.abspath(args.build_dir)
    reason = TestHosts.unavailable()
    if reason:
        sys.exit(f"multihost_comparison: test hosts unavailable: {reason}")
    mpi_perf = build(args.build_dir)
    groups = QUICK_GROUPS if args.quick else GROUPS
    nranks = args.hosts * args.per_host
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    # Every host's launcher must present the same store token (each refuses to start without).
    env.setdefault("SHARDLINE_STORE_TOKEN", secrets.token_hex(16))
    env.update(SHARDLINE_TIMEOUT_S="120", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_base_warn_component_unused="0")
    records, failures, link_bytes = [], [], {"shardline": 0, "openmpi": 0}
    started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    with TestHosts(args.hosts) as hosts:
        env.update(hosts.rsh_agent_env())
        for rnd in range(args.rounds):
            check = "1" if rnd == 0 else "0"
            order = ["shardline", "openmpi"] if rnd % 2 == 0 else ["openmpi", "shardline"]
            for system in order:
                t0 = time.monotonic()
                rx0 = sum(hosts.rx_bytes(k) for k in range(args.hosts))
                if system == "shardline":
                    runs = list(shardline_launches(args, hosts, groups, check))
                else:
                    runs = [(None, [mpirun_command(args, hosts, mpi_perf, groups, check)])]
                for coll, commands in runs:
                    codes, out, took = run_on_hosts(hosts, commands, env, args.launch_timeout)
                    got = rc.parse_rows(out, coll, system, nranks)
                    for r in got:
                        r["round"] = rnd
                    records.extend(got)
                    if any(c != 0 for c in codes) or not got:
                        failures.append({"system": system, "coll": coll, "round": rnd,
                                         "codes": codes, "tail": out[-2000:]})
                        rc.log(f"  !! {system} {coll or ''} round {rnd}: exit {codes}\n"
                               f"{out[-2000:]}")
                link_bytes[system] += sum(hosts.rx_bytes(k) for k in range(args.hosts)) - rx0
                rc.log(f"  round {rnd + 1}/{args.rounds} {system:9s} "
                       f"{time.monotonic() - t0:5.1f} s (load {os.getloadavg()[0]:.1f})")
    lines, rows = table(records, nranks)
    wrong = sum(r["wrong"] or 0 for r in records)
    checked = sum(1 for r in records if r["wrong"] is not None)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"multihost-{stamp}.json")
    doc = {"date": stamp, "machine": rc.machine(), "hosts": args.hosts, "per_host": args.per_host,
           "rounds": args.rounds, "groups": groups, "load_before": load_before,
           "load_after": [round(x, 2) for x in os.getloadavg()],
           "elapsed_seconds": round(time.monotonic() - started, 1),
           "link_rx_bytes": link_bytes, "checked_cells": checked, "wrong_elements": wrong,
           "failures": failures, "ratios": rows, "records": records}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print()
    print(f"{args.hosts} hosts x {args.per_host} ranks, median of {args.rounds} rounds; "
          f"load {load_before[0]} -> {doc['load_after'][0]}")
    print("\n".join(lines))
    print()
    rc.log(f"multihost_comparison: {checked} checked cells, {wrong} wrong elements, "
           f"{len(failures)} failed launches, bytes over the links {link_bytes}; "
           f"{doc['elapsed_seconds']:.0f} s; wrote {path}")
    return 1 if wrong or failures else 0


def table(records, nranks):
    """Markdown rows and their values. busbw is recomputed from the time (nccl-tests' factors:
    (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce) in MB/s: the perf
    binaries print GB/s with two decimals, too coarse for links this slow."""
    factor = {"all_gather": (nranks - 1) / nranks, "reduce_scatter": (nranks - 1) / nranks,
              "all_reduce": 2 * (nranks - 1) / nranks}
    precise = [dict(r, busbw=factor[r["coll"]] * r["size"] / r["time_us"]) for r in records
               if r["coll"] in factor and r["time_us"] > 0]
    _, best = rc.summarise(precise)
    lines = ["| collective | size | shardline busbw (MB/s) | Open MPI busbw (MB/s) | "
             "shardline / Open MPI |", "|---|---|---|---|---|"]
    rows = []
    for coll in COLLECTIVES:
        for size in sorted({s for (_, c, _, s) in best if c == coll}):
            sl = best.get(("shardline", coll, nranks, size))
            mpi = best.get(("openmpi", coll, nranks, size))
            ratio = sl["busbw"] / mpi["busbw"] if sl and mpi and mpi["busbw"] > 0 else None
            rows.append({"coll": coll, "size": size, "shardline": sl and sl["busbw"],
                         "openmpi": mpi and mpi["busbw"], "ratio": ratio})

            def f(x, d=1):
                return "-" if x is None else f"{x:.{d}f}"

            lines.append(f"| {coll} | {rc.human(size)} | {f(sl and sl['busbw'])} | "
                         f"{f(mpi and mpi['busbw'])} | {f(ratio, 2)}x |")
    return lines, rows


if __name__ == "__main__":
    sys.exit(main())
