#!/usr/bin/env python3
"""What Python adds to a collective: shardline's Python module against the C++ perf binaries.

    bench/python/overhead_bench.py [--build-dir build] [--python-path build-py/python]
                                   [--rounds 9] [--quick] [--json FILE]

Outside CI (about 4 minutes on the 2-core VM; --quick: one short round, under a minute, a smoke
test that writes no file unless --json is given). Two ranks, two processes over UCX, every
launch under the build's shardline-launch:

  * C++: build/bench/all_reduce_perf -b 8 -e 8 and all_gather_perf -b 64M -e 64M (float, -c 1);
  * Python: bench/python/overhead_worker.py, which repeats the perf runner's steps for one size
    from Python (its docstring lists them), once per kind of memory: shardline.empty as numpy
    arrays ("empty": the perf binaries' allocator, so the like-for-like row), the same memory as
    torch tensors ("empty-torch"), and private numpy.empty / torch.empty memory ("numpy",
    "torch"; torch rows only where torch imports).

Both time the same loop: -n calls issued back to back on the communicator's stream, each Work
dropped, then a wait for the last; the time of one call is the burst's time / n, averaged over
the two ranks (-a 1). Out of place and in place are timed separately, as the perf binaries'
two columns. Iterations: 8 B 2000 (warm-up 2 x 200, past the start-up transient of
docs/benchmarks.md), 64 MiB 20 (2 x 5). Results are checked (#wrong) in every launch, untimed.

Every Python launch is paired with a C++ launch of the same collective right before or after it
(alternating), and every round runs every Python cell (memory x collective) once, in an order
that rotates from round to round, so that the machine's drift hits both sides of a pair alike.
The table gives each cell's median over its launches and, for Python, the median over its pairs
of Python - C++ and of Python / C++, and in how many pairs Python was the slower. "Nothing
measurable added" means Python was not the slower in so many pairs that chance would do it with
probability under 5% (a one-sided sign test; with 9 rounds: slower in at most 7 of the 9). The
targets checked: Python adds under 5 us per call at 8 B, and nothing measurable at 64 MiB, both
on shardline.empty memory.

--python-path may be given more than once, as LABEL=PATH, to compare builds of the module in one
run (e.g. before=build-py-old/python after=build-py/python). Writes
build/bench-results/<date>-python-overhead.json (machine, load, environment, every launch's numbers,
the summary) and prints the table as Markdown.
"""

import argparse
import datetime
import json
import math
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
WORKER = os.path.join(ROOT, "bench", "python", "overhead_worker.py")

# (collective, bytes, iters, warmup), full and --quick.
CASES = [("all_reduce", 8, 2000, 200), ("all_gather", 64 << 20, 20, 5)]
QUICK_CASES = [("all_reduce", 8, 500, 100), ("all_gather", 64 << 20, 5, 2)]
MEMORIES = ["empty", "empty-torch", "numpy", "torch"]
MEMORY_TEXT = {
    "empty": "shardline.empty (numpy)",
    "empty-torch": "shardline.empty (torch)",
    "numpy": "numpy.empty (private)",
    "torch": "torch.empty (private)",
}
PLACEMENTS = ["out_of_place", "in_place"]
TARGET_ADDED_US = 5.0


def log(message):
    print(message, file=sys.stderr, flush=True)


def human(size):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def machine():
    info = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for key in ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor"):
            m = re.search(rf"^{re.escape(key)}:\s*(.+)$", lscpu, re.M)
            if m:
                info[key] = m.group(1).strip()
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        info["MemTotal"] = f.readline().split(":")[1].strip()
    return info


def git_commit():
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None


def run_launch(cmd, timeout, env):
    """One launch in its own process group, bounded: (exit code or None on timeout, output, s)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - start
    return proc.returncode, out, time.monotonic() - start


class Runner:
    def __init__(self, args):
        self.args = args
        self.launcher = os.path.join(args.build_dir, "bin", "shardline-launch")
        self.bench_dir = os.path.join(args.build_dir, "bench")
        self.tmp = tempfile.mkdtemp(prefix="shardline-pyoverhead-")

    def env(self, python_path=None):
        env = dict(os.environ)
        if python_path:
            env["PYTHONPATH"] = python_path + (os.pathsep + env["PYTHONPATH"]
                                               if env.get("PYTHONPATH") else "")
        return env

    def command(self, cell, case, out):
        coll, size, iters, warmup = case
        if cell["system"] == "C++":
            return [sys.executable, self.launcher, "-n", "2", "--",
                    os.path.join(self.bench_dir, f"{coll}_perf"), "-b", str(size), "-e", str(size),
                    "-n", str(iters), "-w", str(warmup), "-c", "1", "-J", out]
        return [sys.executable, self.launcher, "-n", "2", "--", self.args.python, WORKER,
                "--collective", coll, "--bytes", str(size), "--memory", cell["memory"],
                "--iters", str(iters), "--warmup", str(warmup), "--check", "1", "--out", out]

    def run(self, cell, case, rnd):
        out = os.path.join(self.tmp, "result.json")
        if os.path.exists(out):
            os.unlink(out)
        cmd = self.command(cell, case, out)
        code, text, seconds = run_launch(cmd, self.args.launch_timeout,
                                         self.env(cell.get("python_path")))
        record = {"round": rnd, "system": cell["system"], "memory": cell["memory"],
                  "collective": case[0], "bytes": case[1], "iters": case[2],
                  "seconds": round(seconds, 2), "load": round(os.getloadavg()[0], 2)}
        try:
            if code != 0:
                raise RuntimeError(f"exit {code}")
            with open(out) as f:
                result = json.load(f)
            if cell["system"] == "C++":
                row = result["results"][0]
                result = {p: row[p] for p in PLACEMENTS}
            for p in PLACEMENTS:
                record[p] = round(result[p]["time_us"], 3)
                record[p + "_wrong"] = result[p]["wrong"]
        except (RuntimeError, OSError, ValueError, KeyError, IndexError) as e:
            tail = "\n".join(text.splitlines()[-15:])
            record["failure"] = f"{' '.join(cmd)}: {e}\n{tail}"
            log(f"FAILED: {record['failure']}")
        return record


def parse_python_paths(items):
    paths = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = "", item
        paths.append((label, os.path.abspath(path)))
    return paths


def module_file(python, path, module):
    """Where `python` imports `module` from with `path` first on PYTHONPATH, or None."""
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([python, "-c", f"import {module}; print({module}.__file__)"], env=env,
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def cell_name(cell):
    if cell["system"] == "C++":
        return "C++ perf binary (HostAllocator)"
    label = cell["system"].partition(":")[2]
    return f"Python{' ' + label if label else ''}, {MEMORY_TEXT[cell['memory']]}"


def binomial_tail(n, k):
    """P(X >= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def quartiles(values):
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarise(records, cells, cases):
    """Per (collective, placement, cell): median, min, max; for Python, against its C++ pair."""
    rows = []
    for coll, size, _, _ in cases:
        for placement in PLACEMENTS:
            mine = [r for r in records if r["collective"] == coll and placement in r]
            by_pair = {}
            for r in mine:
                by_pair.setdefault(r["pair"], {})[r["system"] == "C++"] = r[placement]
            cpp = [r[placement] for r in mine if r["system"] == "C++"]
            if not cpp:
                continue
            cpp_med = statistics.median(cpp)
            rows.append({"collective": coll, "bytes": size, "placement": placement,
                         "system": "C++", "memory": "HostAllocator", "name": cell_name(cells[0]),
                         "launches": len(cpp), "median_us": cpp_med, "min_us": min(cpp),
                         "max_us": max(cpp)})
            for cell in cells[1:]:
                t = [r[placement] for r in mine
                     if r["system"] == cell["system"] and r["memory"] == cell["memory"]]
                pairs = [(v[False], v[True]) for v in
                         (by_pair[r["pair"]] for r in mine
                          if r["system"] == cell["system"] and r["memory"] == cell["memory"])
                         if True in v and False in v]
                if not t or not pairs:
                    continue
                diffs = [py - c for py, c in pairs]
                ratios = [py / c for py, c in pairs]
                q1, q3 = quartiles(ratios)
                rows.append({"collective": coll, "bytes": size, "placement": placement,
                             "system": cell["system"], "memory": cell["memory"],
                             "name": cell_name(cell), "launches": len(t),
                             "median_us": statistics.median(t), "min_us": min(t), "max_us": max(t),
                             "pairs": len(pairs), "minus_cpp_us": statistics.median(diffs),
                             "ratio_to_cpp": statistics.median(ratios),
                             "ratio_q1": q1, "ratio_q3": q3,
                             "slower_in": sum(1 for d in diffs if d > 0),
                             "faster_in": sum(1 for d in diffs if d < 0),
                             # One-sided sign test: is Python the slower more often than chance?
                             "p_slower": binomial_tail(sum(1 for d in diffs if d != 0),
                                                       sum(1 for d in diffs if d > 0))})
    return rows


def targets(rows):
    out = []
    for row in rows:
        if row["system"] == "C++" or row["memory"] != "empty":
            continue
        where = f"{row['system']} {row['collective']} {human(row['bytes'])} {row['placement']}"
        if row["collective"] == "all_reduce":
            out.append({"target": f"added per call, {where}", "want": f"< {TARGET_ADDED_US} us",
                        "got": f"{row['minus_cpp_us']:+.2f} us",
                        "met": row["minus_cpp_us"] < TARGET_ADDED_US})
        else:
            out.append({"target": f"nothing measurable added, {where}",
                        "want": "P(slower in this many pairs by chance) >= 0.05",
                        "got": f"{row['minus_cpp_us']:+.0f} us, x{row['ratio_to_cpp']:.3f}, "
                               f"slower in {row['slower_in']}/{row['pairs']}, "
                               f"p {row['p_slower']:.3f}",
                        "met": row["p_slower"] >= 0.05})
    return out


def markdown(rows):
    lines = ["| collective | size | placement | memory | median µs/call | min–max µs | "
             "Python − C++ µs | × C++ (IQR) | slower in |",
             "|---|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        digits = 2 if r["median_us"] < 100 else 0
        if r["system"] == "C++":
            diff = ratio = slower = "—"
        else:
            diff = f"{r['minus_cpp_us']:+.{digits}f}"
            ratio = f"{r['ratio_to_cpp']:.2f} ({r['ratio_q1']:.2f}–{r['ratio_q3']:.2f})"
            slower = f"{r['slower_in']}/{r['pairs']}"
        lines.append(f"| {r['collective']} | {human(r['bytes'])} | "
                     f"{r['placement'].replace('_', ' ')} | {r['name']} | "
                     f"{r['median_us']:.{digits}f} | {r['min_us']:.{digits}f}–"
                     f"{r['max_us']:.{digits}f} | {diff} | {ratio} | {slower} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build"),
                   help="build with the perf binaries and bin/shardline-launch (default build)")
    p.add_argument("--python-path", action="append",
                   help="[LABEL=]directory holding the shardline package (default build-py/python)"
                        "; repeat to compare builds")
    p.add_argument("--python", default=sys.executable, help="interpreter of the Python ranks")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 9; --quick 1)")
    p.add_argument("--memories", nargs="+", choices=MEMORIES, default=MEMORIES)
    p.add_argument("--quick", action="store_true",
                   help="one short round: a smoke test (under a minute), no file written")
    p.add_argument("--launch-timeout", type=float, default=120,
                   help="seconds one launch may take before it is killed (default 120)")
    p.add_argument("--json", help="where to write the results (default "
                                  "build/bench-results/<date>-python-overhead.json; "
                                  "none with --quick)")
    args = p.parse_args()
    args.build_dir = os.path.abspath(args.build_dir)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 9)
    if rounds < 1:
        p.error("--rounds must be at least 1")
    cases = QUICK_CASES if args.quick else CASES
    started = time.monotonic()

    runner = Runner(args)
    tools = [runner.launcher] + [os.path.join(runner.bench_dir, f"{c}_perf") for c, *_ in cases]
    for tool in tools:
        if not os.path.exists(tool):
            p.error(f"{tool} is missing: build the perf binaries (scripts/build.sh build)")
    paths = parse_python_paths(args.python_path or [os.path.join(ROOT, "build-py", "python")])
    cells = [{"system": "C++", "memory": "HostAllocator"}]
    skipped = []
    for label, path in paths:
        found = module_file(args.python, path, "shardline")
        if found is None or not os.path.abspath(found).startswith(path + os.sep):
            p.error(f"{args.python} imports shardline from {found or 'nowhere'}, not from {path}: "
                    "build it there with -DSHARDLINE_BUILD_PYTHON=ON (docs/benchmarks.md, "
                    "Python overhead)")
        has_torch = module_file(args.python, path, "torch") is not None
        for memory in args.memories:
            if memory in ("torch", "empty-torch") and not has_torch:
                skipped.append(memory)
                continue
            cells.append({"system": f"Python:{label}" if label else "Python", "memory": memory,
                          "python_path": path})
    if skipped:
        log(f"torch does not import: skipping {', '.join(sorted(set(skipped)))}")
    if len(cells) == 1:
        p.error("no Python cell left to measure (--memories)")
    spin = os.environ.get("SHARDLINE_UCX_SPIN_US")
    load_before = [round(x, 2) for x in os.getloadavg()]
    log(f"overhead_bench: {len(cells)} cells x {len(cases)} collectives x {rounds} rounds; "
        f"SHARDLINE_UCX_SPIN_US={spin if spin is not None else '(default)'}; "
        f"load {load_before[0]:.2f}")

    records = []
    pair = 0
    python_cells = cells[1:]
    for rnd in range(rounds):
        for k, case in enumerate(cases):
            shift = (rnd + k) % len(python_cells)
            for cell in python_cells[shift:] + python_cells[:shift]:
                # Each Python launch next to a C++ launch, alternately before and after it.
                order = [cells[0], cell] if pair % 2 == 0 else [cell, cells[0]]
                for c in order:
                    record = runner.run(c, case, rnd)
                    record["pair"] = pair
                    records.append(record)
                    if "failure" not in record:
                        log(f"round {rnd + 1}/{rounds} {case[0]} {human(case[1])} "
                            f"{cell_name(c)}: {record['out_of_place']:.2f} / "
                            f"{record['in_place']:.2f} us ({record['seconds']:.1f} s, "
                            f"load {record['load']:.1f})")
                pair += 1

    rows = summarise(records, cells, cases)
    goals = targets(rows)
    failures = [r["failure"] for r in records if "failure" in r]
    wrong = sum((r.get(p + "_wrong") or 0) for r in records for p in PLACEMENTS)
    elapsed = time.monotonic() - started
    shutil.rmtree(runner.tmp, ignore_errors=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    json_path = args.json
    if json_path is None and not args.quick:
        json_path = os.path.join(ROOT, "build", "bench-results", f"{stamp}-python-overhead.json")
    if json_path:
        doc = {"date": stamp, "benchmark": "python-overhead", "commit": git_commit(),
               "machine": machine(), "load_before": load_before,
               "load_after": [round(x, 2) for x in os.getloadavg()],
               "SHARDLINE_UCX_SPIN_US": spin, "nranks": 2, "rounds": rounds, "pairs": pair,
               "quick": args.quick, "python": args.python,
               "python_paths": [{"label": label, "path": path} for label, path in paths],
               "cases": [dict(zip(("collective", "bytes", "iters", "warmup"), c)) for c in cases],
               "elapsed_seconds": round(elapsed, 1), "launches": len(records),
               "wrong_elements": wrong, "failures": failures, "targets": goals}
        text = json.dumps(doc, indent=1)[:-2]
        text += ',\n "summary": [\n  ' + ",\n  ".join(
            json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
            for r in rows) + "\n ]"
        text += ',\n "records": [\n  ' + ",\n  ".join(json.dumps(r) for r in records) + "\n ]\n}\n"
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            f.write(text)

    print("\n".join(markdown(rows)))
    print()
    print("| target | want | got | met |")
    print("|---|---|---|---|")
    for g in goals:
        print(f"| {g['target']} | {g['want']} | {g['got']} | {'yes' if g['met'] else 'NO'} |")
    print()
    print(f"{len(records)} launches, {len(failures)} failed, {wrong} wrong elements; "
          f"elapsed {elapsed:.0f} s" + (f"; results in {os.path.relpath(json_path, ROOT)}"
                                         if json_path else ""))
    return 1 if failures or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
