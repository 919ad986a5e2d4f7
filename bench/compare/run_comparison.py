#!/usr/bin/env python3
"""shardline's host collectives side by side with Open MPI, Gloo and memcpy, in one run.

    bench/compare/run_comparison.py [--build-dir build] [--ranks 2 4] [--rounds 3] [--quick]

End to end (outside CI; about 6 minutes on the 2-core VM at load ~3.5, 138 launches):
  1. installs the peers from Debian's packages (scripts/install-deps.sh --peers: libopenmpi-dev,
     openmpi-bin, libgloo-dev) and matplotlib from PyPI if missing;
  2. builds shardline's perf binaries (bench/perf) in --build-dir and compiles the peer drivers
     (bench/compare/{mpi,gloo,memcpy}_perf.cc) into <build-dir>/compare with mpicxx and g++;
  3. runs everything interleaved over 4 KiB .. 256 MiB (float, sum), for each rank count and
     round: shardline's five binaries (one launch per collective and size group: bench/perf
     takes one -n/-w per launch), Open MPI (MPI_Allgather, MPI_Reduce_scatter_block,
     MPI_Allreduce, MPI_Bcast, MPI_Alltoall), Gloo (allgather, ReduceScatterHalvingDoubling,
     allreduce) and single-thread memcpy; a peer sweeps every group in ONE launch (-G, the same
     per-group -n/-w as shardline's launches). The order of the four systems rotates every round
     so that machine noise hits every system alike; data are checked (#wrong) in the first round;
  4. writes build/bench-results/<date>.json (machine, load, medians, ratios, targets, per-round
     measurements as compact rows, the time every launch took, the elapsed time) and
     build/bench-results/<date>.png (busbw against size, one panel per collective, one line per
     system and rank count), and prints the ratio table (Markdown), the targets and the elapsed
     time.

Each system's number at a size is the median over rounds (all sizes, every round) of the better
of its out-of-place and in-place busbw (a form a system lacks counts as missing); latency is the
smaller median time.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "alltoall"]
PEERS = ["openmpi", "gloo"]
KIB, MIB = 1024, 1024 * 1024

# (min, max, factor, iters, warmup): many iterations where a call costs microseconds, few where it
# costs 0.1-2 s. Where the time went in a loaded 15-minute run (208 launches): 256 MiB and 64 MiB
# calls (each timed point costs 1 synchronising call + iters, in and out of place), and one
# launch per system, collective and group. Now: every group runs every round (medians over all
# rounds), 256 MiB with one timed call, and a peer sweeps all groups in one launch.
# The small group warms up with 50 calls (OSU's latency tests skip 200 for small messages): on
# the 2-core VM shardline's first ~25 back-to-back small collectives after start-up run 2-3x
# slower than the rest (a one-time transient; docs/benchmarks.md), which 3 warm-up calls left in
# the first timed cell. Every system gets the same warm-up.
GROUPS = [
    (4 * KIB, 64 * KIB, 2, 20, 50),
    (256 * KIB, 16 * MIB, 4, 8, 2),
    (64 * MIB, 64 * MIB, 4, 3, 1),
    (256 * MIB, 256 * MIB, 4, 1, 0),
]
QUICK_GROUPS = [
    (4 * KIB, 64 * KIB, 4, 10, 2),
    (1 * MIB, 16 * MIB, 4, 3, 1),
]
SYSTEMS = ["shardline", "openmpi", "gloo", "memcpy"]
LAUNCH_FIELDS = ["system", "coll", "group", "nranks", "round", "seconds", "load"]
RECORD_FIELDS = ["system", "coll", "nranks", "size", "placement", "round", "time_us", "algbw",
                 "busbw", "wrong"]

ROW_RE = re.compile(r"^\s*\d+\s+\d+\s+\S+\s+\S+\s+-?\d+\s")
MARK_RE = re.compile(r"^# collective (\S+) system (\S+) nranks (\d+)")
TARGETS = {"all_gather": 1.2, "reduce_scatter": 3.0, "all_reduce": 2.0}


def log(msg):
    print(msg, flush=True)


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def ensure_dependencies(skip_install):
    if not skip_install:
        sh([os.path.join(ROOT, "scripts", "install-deps.sh"), "--peers"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("run_comparison: installing matplotlib from PyPI")
        base = [sys.executable, "-m", "pip", "install", "--quiet", "matplotlib"]
        if subprocess.run(base).returncode != 0:  # Debian's Python is "externally managed"
            sh(base + ["--break-system-packages"])


def build(build_dir):
    if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
        sh(["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja"], stdout=subprocess.DEVNULL)
    sh(["cmake", "--build", build_dir, "--target"] + [f"{c}_perf" for c in COLLECTIVES])
    out = os.path.join(build_dir, "compare")
    os.makedirs(out, exist_ok=True)
    src = os.path.join(ROOT, "bench", "compare")
    jobs = [
        (["mpicxx"], "mpi_perf", []),
        (["g++"], "gloo_perf", ["-lgloo", "-pthread"]),
        (["g++"], "memcpy_perf", ["-pthread"]),
    ]
    for compiler, name, libs in jobs:
        target = os.path.join(out, name)
        sources = [os.path.join(src, f"{name}.cc"), os.path.join(src, "report.h")]
        if os.path.exists(target) and all(os.path.getmtime(s) < os.path.getmtime(target)
                                           for s in sources):
            continue
        sh(compiler + ["-O2", "-std=c++17", "-o", target, sources[0]] + libs)
    return out


def machine():
    info = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for key in ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket",
                    "Socket(s)", "L2 cache", "L3 cache", "Hypervisor vendor"):
            m = re.search(rf"^{re.escape(key)}:\s*(.+)$", lscpu, re.M)
            if m:
                info[key] = m.group(1).strip()
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        info["MemTotal"] = f.readline().split(":")[1].strip()
    return info


def loadavg():
    return os.getloadavg()


def run_launch(cmd, timeout, env=None):
    """Runs one launch in its own process group; a bounded wait (loopback TCP may stall)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - start
    return proc.returncode, out, time.monotonic() - start


def parse_rows(text, default_coll, default_system, nranks):
    """nccl-tests rows -> records; '# collective X system Y' lines switch the current table."""
    coll, system = default_coll, default_system
    records = []
    for line in text.splitlines():
        if m := MARK_RE.match(line):
            coll, system = m.group(1), m.group(2)
            continue
        if not ROW_RE.match(line):
            continue
        f = line.split()
        if len(f) != 13:
            continue
        for placement, cell in (("out", f[5:9]), ("in", f[9:13])):
            if cell[0] == "N/A":
                continue
            records.append({"system": system, "coll": coll, "nranks": nranks,
                            "size": int(f[0]), "placement": placement,
                            "time_us": float(cell[0]), "algbw": float(cell[1]),
                            "busbw": float(cell[2]),
                            "wrong": None if cell[3] == "N/A" else int(cell[3])})
    return records


def group_flags(groups):
    """The peers' -G schedule: one launch runs what shardline runs in len(groups) launches."""
    flags = []
    for lo, hi, factor, iters, warmup in groups:
        flags += ["-G", f"{lo}:{hi}:{factor}:{iters}:{warmup}"]
    return flags


def measure(args, bins, peers_dir):
    groups = QUICK_GROUPS if args.quick else GROUPS
    launch = os.path.join(args.build_dir, "bin", "shardline-launch")
    mpi_env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_btl_base_warn_component_unused": "0"}
    records, failures, timings = [], [], []
    t_start = time.monotonic()
    for nranks in args.ranks:
        for rnd in range(args.rounds):
            check = ["-c", "1" if rnd == 0 else "0"]
            sched = group_flags(groups)
            blocks = {"shardline": [], "openmpi": [], "gloo": [], "memcpy": []}
            for gi, (lo, hi, factor, iters, warmup) in enumerate(groups):
                sweep = ["-b", str(lo), "-e", str(hi), "-f", str(factor), "-n", str(iters),
                         "-w", str(warmup)] + check
                for coll in COLLECTIVES:
                    blocks["shardline"].append(
                        (coll, gi, [sys.executable, launch, "-n", str(nranks), "--grace", "5",
                                    "--", os.path.join(bins, f"{coll}_perf")] + sweep,
                         {"SHARDLINE_TIMEOUT_S": "120"}))
            blocks["openmpi"].append(
                (None, None, ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to",
                              "none", "-n", str(nranks), os.path.join(peers_dir, "mpi_perf"),
                              "all"] + sched + check, mpi_env))
            blocks["gloo"].append(
                (None, None, [sys.executable, launch, "-n", str(nranks), "--grace", "5", "--",
                              os.path.join(peers_dir, "gloo_perf"), "all"] + sched + check,
                 None))
            blocks["memcpy"].append(
                ("memcpy", None, [os.path.join(peers_dir, "memcpy_perf")] + sched, None))
            # Rotate the order every round so that no system always runs first or last.
            order = SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)]
            for system in order:
                t_block = time.monotonic()
                for coll, gi, cmd, env in blocks[system]:
                    env = dict(env or {})
                    tmp = None
                    if system == "gloo":
                        tmp = tempfile.mkdtemp(prefix="shardline-gloo-")
                        env["GLOO_STORE_DIR"] = tmp
                    code, out, took = run_launch(cmd, timeout=args.launch_timeout, env=env)
                    if tmp:
                        shutil.rmtree(tmp, ignore_errors=True)
                    timings.append({"system": system, "coll": coll, "group": gi,
                                    "nranks": nranks, "round": rnd, "seconds": round(took, 2),
                                    "load": round(loadavg()[0], 2)})
                    got = parse_rows(out, coll, system, nranks if system != "memcpy" else 1)
                    for r in got:
                        r["round"] = rnd
                    records.extend(got)
                    if code != 0:
                        what = "timed out" if code is None else f"exit {code}"
                        failures.append({"system": system, "coll": coll, "nranks": nranks,
                                         "group": gi, "round": rnd, "what": what,
                                         "tail": out[-2000:]})
                        log(f"  !! {system} {coll or ''} n={nranks} group {gi}: {what}")
                now = time.monotonic()
                log(f"  n={nranks} round {rnd + 1}/{args.rounds} {system:9s} "
                    f"{now - t_block:5.1f} s (elapsed {now - t_start:.0f} s, "
                    f"load {loadavg()[0]:.1f})")
    return records, failures, timings


def load_during(timings):
    """1-minute load average sampled after every launch: min / median / max."""
    loads = [t["load"] for t in timings]
    if not loads:
        return None
    return {"min": min(loads), "median": round(statistics.median(loads), 2), "max": max(loads)}


def human(size):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= div and size % div == 0:
            return f"{size // div}{unit}"
    return str(size)


def summarise(records):
    """Medians per (system, coll, nranks, size, placement), then the better placement."""
    cells = {}
    for r in records:
        cells.setdefault((r["system"], r["coll"], r["nranks"], r["size"], r["placement"]),
                         []).append(r)
    med = {}
    for key, rs in cells.items():
        med[key] = {"busbw": statistics.median(r["busbw"] for r in rs),
                    "time_us": statistics.median(r["time_us"] for r in rs), "n": len(rs)}
    best = {}
    for (system, coll, nranks, size, placement), m in med.items():
        b = best.setdefault((system, coll, nranks, size), {"busbw": 0.0, "time_us": float("inf")})
        b["busbw"] = max(b["busbw"], m["busbw"])
        b["time_us"] = min(b["time_us"], m["time_us"])
    return med, best


def ratio_table(best, ranks):
    memcpy = {size: v["busbw"] for (s, c, n, size), v in best.items() if s == "memcpy"}
    lines, rows = [], []
    lines.append("| collective | ranks | size | shardline | Open MPI | Gloo | memcpy | "
                 "shardline / best peer | shardline / memcpy |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for coll in COLLECTIVES:
        for n in ranks:
            sizes = sorted({size for (s, c, nn, size) in best if c == coll and nn == n})
            for size in sizes:
                sl = best.get(("shardline", coll, n, size))
                peers = {p: best.get((p, coll, n, size)) for p in PEERS}
                if sl is None:
                    continue
                peer_bw = [v["busbw"] for v in peers.values() if v is not None]
                best_peer = max(peer_bw) if peer_bw else None
                mc = memcpy.get(size)
                r_peer = sl["busbw"] / best_peer if best_peer else None
                r_mem = sl["busbw"] / mc if mc else None
                rows.append({"coll": coll, "nranks": n, "size": size,
                             "shardline": sl["busbw"],
                             **{p: (v["busbw"] if v else None) for p, v in peers.items()},
                             "memcpy": mc, "vs_best_peer": r_peer, "vs_memcpy": r_mem})

                def f(x, d=2):
                    return "-" if x is None else f"{x:.{d}f}"

                lines.append(f"| {coll} | {n} | {human(size)} | {f(sl['busbw'])} | "
                             f"{f(peers['openmpi'] and peers['openmpi']['busbw'])} | "
                             f"{f(peers['gloo'] and peers['gloo']['busbw'])} | {f(mc)} | "
                             f"{f(r_peer)}x | {f(r_mem)}x |")
    return lines, rows


def targets(med, best, ranks):
    """The issue's targets, evaluated on this run's medians."""
    out = []
    memcpy = {size: v["busbw"] for (s, c, n, size), v in best.items() if s == "memcpy"}
    for coll, want in TARGETS.items():
        for n in ranks:
            for size in (16 * MIB, 64 * MIB):
                sl = best.get(("shardline", coll, n, size))
                peer = [best[(p, coll, n, size)]["busbw"] for p in PEERS
                        if (p, coll, n, size) in best]
                if sl is None or not peer:
                    continue
                r = sl["busbw"] / max(peer)
                out.append({"target": f"{coll} busbw vs best peer", "nranks": n,
                            "size": human(size), "want": f">= {want}x", "got": round(r, 2),
                            "met": r >= want})
    for n in ranks:
        ip = med.get(("shardline", "all_gather", n, 64 * MIB, "in"))
        mc = memcpy.get(64 * MIB)
        if ip and mc:
            r = ip["busbw"] / mc
            out.append({"target": "in-place all_gather busbw vs memcpy", "nranks": n,
                        "size": "64M", "want": ">= 0.6x", "got": round(r, 2), "met": r >= 0.6})
    for coll in ("all_gather", "reduce_scatter", "all_reduce"):
        for n in ranks:
            sl = best.get(("shardline", coll, n, 8 * KIB))
            mpi = best.get(("openmpi", coll, n, 8 * KIB))
            if sl and mpi:
                r = sl["time_us"] / mpi["time_us"]
                out.append({"target": f"{coll} latency vs Open MPI", "nranks": n, "size": "8K",
                            "want": "<= 1.5x", "got": round(r, 2), "met": r <= 1.5})
    return out


def plot(best, ranks, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    colors = {"shardline": "tab:blue", "openmpi": "tab:orange", "gloo": "tab:green"}
    styles = {n: ("-", "--", ":", "-.")[i % 4] for i, n in enumerate(ranks)}
    memcpy = sorted((size, v["busbw"]) for (s, c, n, size), v in best.items() if s == "memcpy")
    for ax, coll in zip(axes.flat, COLLECTIVES):
        for system, color in colors.items():
            for n in ranks:
                pts = sorted((size, v["busbw"]) for (s, c, nn, size), v in best.items()
                             if s == system and c == coll and nn == n)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(n, ":"),
                            color=color, marker="o", markersize=3, label=f"{system} n={n}")
        if memcpy:
            ax.plot([p[0] for p in memcpy], [p[1] for p in memcpy], ":", color="gray",
                    label="memcpy (1 thread)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(coll)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].axis("off")
    axes.flat[-1].legend(handles, labels, loc="center")
    fig.suptitle("busbw (median over rounds, better of out-of-place / in-place), host memory")
    fig.tight_layout()
    fig.savefig(path, dpi=60)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sweep (a smoke test)")
    parser.add_argument("--no-install", action="store_true", help="skip apt/pip")
    parser.add_argument("--launch-timeout", type=float, default=240,
                        help="seconds one launch may take before it is killed (default 240)")
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "bench-results"))
    args = parser.parse_args()
    args.build_dir = os.path.abspath(args.build_dir)
    started = time.monotonic()

    ensure_dependencies(args.no_install)
    bins = os.path.join(args.build_dir, "bench")
    peers_dir = build(args.build_dir)
    info = machine()
    load_before = [round(x, 2) for x in loadavg()]
    log(f"run_comparison: {info.get('Model name', '?')}, {info.get('CPU(s)', '?')} CPUs, "
        f"{info['MemTotal']}; load {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    t0 = time.monotonic()
    records, failures, timings = measure(args, bins, peers_dir)
    launches = len(timings)
    measure_s = time.monotonic() - t0
    load_after = [round(x, 2) for x in loadavg()]
    spent = {}
    for t in timings:
        key = f"{t['system']} n={t['nranks']}"
        spent[key] = round(spent.get(key, 0.0) + t["seconds"], 1)
    med, best = summarise(records)
    table, rows = ratio_table(best, args.ranks)
    goals = targets(med, best, args.ranks)
    wrong = sum(r["wrong"] or 0 for r in records)
    checked = sum(1 for r in records if r["wrong"] is not None)

    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    json_path = os.path.join(args.out, f"{stamp}.json")
    png_path = os.path.join(args.out, f"{stamp}.png")
    elapsed = time.monotonic() - started
    doc = {"date": stamp, "machine": info, "load_before": load_before, "load_after": load_after,
           "load_during": load_during(timings), "ranks": args.ranks, "rounds": args.rounds,
           "quick": args.quick, "groups": QUICK_GROUPS if args.quick else GROUPS,
           "launches": launches, "measure_seconds": round(measure_s, 1),
           "elapsed_seconds": round(elapsed, 1), "seconds_by_system": spent,
           "checked_cells": checked, "wrong_elements": wrong, "failures": failures,
           "targets": goals}
    # Bulky parts one row per line: medians as objects, records and launches as rows.
    medians = [{"system": k[0], "coll": k[1], "nranks": k[2], "size": k[3], "placement": k[4],
                **{kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()}}
               for k, v in sorted(med.items())]
    rows_out = [[r[f] for f in RECORD_FIELDS] for r in records]
    text = json.dumps(doc, indent=1)[:-2]
    text += ',\n "ratios": [\n  ' + ",\n  ".join(
        json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
        for r in rows) + "\n ]"
    text += ',\n "medians": [\n  ' + ",\n  ".join(json.dumps(m) for m in medians) + "\n ]"
    text += ',\n "launch_fields": ' + json.dumps(LAUNCH_FIELDS)
    text += ',\n "launch_rows": [\n  ' + ",\n  ".join(
        json.dumps([t[f] for f in LAUNCH_FIELDS])
        for t in timings) + "\n ]"
    text += ',\n "record_fields": ' + json.dumps(RECORD_FIELDS)
    text += ',\n "records": [\n  ' + ",\n  ".join(json.dumps(r) for r in rows_out) + "\n ]\n}\n"
    with open(json_path, "w") as f:
        f.write(text)
    plot(best, args.ranks, png_path)

    print()
    print("\n".join(table))
    print()
    print("| target | ranks | size | want | got | met |")
    print("|---|---|---|---|---|---|")
    for g in goals:
        print(f"| {g['target']} | {g['nranks']} | {g['size']} | {g['want']} | {g['got']}x | "
              f"{'yes' if g['met'] else 'NO'} |")
    print()
    log(f"run_comparison: {launches} launches, {checked} checked cells, {wrong} wrong elements, "
        f"{len(failures)} failed launches; load {load_before[0]:.2f} -> {load_after[0]:.2f} "
        f"(during: {doc['load_during']}); time per system: {spent}")
    log(f"run_comparison: measured {measure_s:.0f} s; elapsed {time.monotonic() - started:.0f} s "
        f"({(time.monotonic() - started) / 60:.1f} min) end to end")
    log(f"run_comparison: wrote {json_path} and {png_path}")
    return 1 if wrong or failures else 0


if __name__ == "__main__":
    sys.exit(main())
