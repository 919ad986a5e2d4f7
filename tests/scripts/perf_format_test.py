#!/usr/bin/env python3
"""The *_perf binaries speak nccl-tests' output format (ctest labels `multiprocess;script`).

    perf_format_test.py <path of shardline-launch> <directory of the *_perf binaries>

Each binary runs once over the ucx backend (2 processes under shardline-launch) and once with
ranks as threads (--backend local -t 3), on small sizes with checking on. The output is parsed
the way people parse nccl-tests output (the "# nThread" header, the "#  Rank" lines, the
whitespace-separated rows of 13 columns, the footer) and checked: sizes and counts follow the
sweep and nccl-tests' getCollByteCount, algbw = size / time, busbw = algbw * the collective's
factor, #wrong is 0, the footer says OK, and the -J file is JSON with the same rows. Bad flags
must fail with exit code 2 and a message naming the flag.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

LAUNCH = None
BIN_DIR = None

BINARIES = ["all_gather_perf", "reduce_scatter_perf", "all_reduce_perf", "broadcast_perf",
            "alltoall_perf"]
SMALL = ["-b", "8", "-e", "64K", "-f", "4", "-c", "1", "-n", "2", "-w", "1"]

# nccl-tests' column header, byte for byte (its Reporter's printf formats).
HEADER_LINES = [
    "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
    % ("", "", "", "", ""),
    "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s"
    % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
       "algbw", "busbw", "#wrong"),
    "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s"
    % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
       "(GB/s)", ""),
]

NTHREAD_RE = re.compile(
    r"^# nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+) step: (\d+)\((factor|bytes)\) "
    r"warmup iters: (\d+) iters: (\d+) agg iters: (\d+) validation: (\d+) graph: (\d+)\s*$")
RANK_RE = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+")
OOB_RE = re.compile(r"^# Out of bounds values : (\d+) (OK|FAILED)\s*$")
AVG_RE = re.compile(r"^# Avg bus bandwidth    : (\S+)\s*$")


def counts(binary, count, n):
    """nccl-tests' getCollByteCount: (send, recv, param) element counts."""
    if binary == "all_gather_perf":
        return count // n, count // n * n, count // n
    if binary in ("reduce_scatter_perf",):
        return count // n * n, count // n, count // n
    if binary == "alltoall_perf":
        return count // n * n, count // n * n, count // n
    return count, count, count


def bus_factor(binary, n):
    if binary == "all_reduce_perf":
        return 2.0 * (n - 1) / n
    if binary == "broadcast_perf":
        return 1.0
    return (n - 1) / n


def run(cmd, timeout, env=None):
    full_env = dict(os.environ)
    full_env.setdefault("SHARDLINE_TIMEOUT_S", "60")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} hung for {timeout} s:\n{out.decode()}\n{err.decode()}")
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def parse(text):
    """Parses nccl-tests-style output into a dict (header fields, ranks, rows, footer)."""
    result = {"ranks": [], "rows": [], "header": None, "columns": [], "oob": None, "avg": None}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if m := NTHREAD_RE.match(line):
            result["header"] = dict(zip(
                ["nthread", "ngpus", "minbytes", "maxbytes", "step", "steptype", "warmup",
                 "iters", "agg", "validation", "graph"],
                [int(g) if g.isdigit() else g for g in m.groups()]))
        elif m := RANK_RE.match(line):
            result["ranks"].append(int(m.group(1)))
        elif line in HEADER_LINES:
            result["columns"].append(line)
        elif m := OOB_RE.match(line):
            result["oob"] = (int(m.group(1)), m.group(2))
        elif m := AVG_RE.match(line):
            result["avg"] = float(m.group(1))
        elif line and not line.startswith("#"):
            fields = line.split()
            if len(fields) != 13:
                raise AssertionError(f"row with {len(fields)} columns, not 13: {line!r}")

            def cell(f):
                if f[0] == "N/A":
                    assert f == ["N/A"] * 4, f"partly N/A cell in {line!r}"
                    return None
                return {"time": float(f[0]), "algbw": float(f[1]), "busbw": float(f[2]),
                        "wrong": None if f[3] == "N/A" else int(f[3]), "time_text": f[0]}

            result["rows"].append({
                "size": int(fields[0]), "count": int(fields[1]), "type": fields[2],
                "redop": fields[3], "root": int(fields[4]),
                "out": cell(fields[5:9]), "in": cell(fields[9:13])})
    return result


class PerfFormatTest(unittest.TestCase):
    def check_output(self, binary, out, nranks, nthread, json_path=None):
        p = parse(out)
        self.assertIsNotNone(p["header"], out)
        h = p["header"]
        self.assertEqual((h["nthread"], h["ngpus"], h["minbytes"], h["maxbytes"]),
                         (nthread, 1, 8, 65536), out)
        self.assertEqual((h["step"], h["steptype"], h["warmup"], h["iters"], h["validation"]),
                         (4, "factor", 1, 2, 1), out)
        self.assertEqual(p["ranks"], list(range(nranks)), out)
        self.assertEqual(p["columns"], HEADER_LINES, out)
        sizes = [8 * 4 ** k for k in range(7)]  # 8 .. 32768 (the next, 131072, is past 64K)
        self.assertEqual(len(p["rows"]), len(sizes), out)
        busbws = []
        for size, row in zip(sizes, p["rows"]):
            send, recv, param = counts(binary, size // 4, nranks)
            self.assertEqual(row["size"], max(send, recv) * 4, row)
            self.assertEqual(row["count"], param, row)
            self.assertEqual(row["type"], "float")
            reduces = binary in ("reduce_scatter_perf", "all_reduce_perf")
            self.assertEqual(row["redop"], "sum" if reduces else "none")
            self.assertEqual(row["root"], 0 if binary == "broadcast_perf" else -1)
            self.assertEqual(row["out"] is None, binary == "broadcast_perf", row)
            self.assertEqual(row["in"] is None, binary == "alltoall_perf", row)
            for c in (row["out"], row["in"]):
                if c is None:
                    continue
                self.assertEqual(c["wrong"], 0, f"{binary}: wrong elements in {row}\n{out}")
                self.assertGreater(c["time"], 0, row)
                # algbw = size / time; the printed time and bandwidths are rounded.
                decimals = len(c["time_text"].partition(".")[2])
                t_lo = max(c["time"] - 0.5 * 10 ** -decimals, 1e-9)
                t_hi = c["time"] + 0.5 * 10 ** -decimals
                self.assertLessEqual(c["algbw"], row["size"] / t_lo / 1e3 + 0.0051, row)
                self.assertGreaterEqual(c["algbw"], row["size"] / t_hi / 1e3 - 0.0051, row)
                factor = bus_factor(binary, nranks)
                self.assertLessEqual(c["busbw"], row["size"] / t_lo / 1e3 * factor + 0.0051, row)
                self.assertGreaterEqual(c["busbw"], row["size"] / t_hi / 1e3 * factor - 0.0051,
                                        row)
                busbws.append(c["busbw"])
        self.assertEqual(p["oob"], (0, "OK"), out)
        self.assertIsNotNone(p["avg"], out)
        self.assertAlmostEqual(p["avg"], sum(busbws) / len(busbws), delta=0.006, msg=out)
        if json_path is not None:
            with open(json_path) as f:
                doc = json.load(f)
            self.assertEqual(doc["test"], binary)
            self.assertEqual(doc["nranks"], nranks)
            self.assertEqual(doc["out_of_bounds"], 0)
            self.assertEqual([r["size"] for r in doc["results"]], [r["size"] for r in p["rows"]])
            for r in doc["results"]:
                for key in ("out_of_place", "in_place"):
                    if r[key] is not None:
                        self.assertEqual(r[key]["wrong"], 0, r)

    def test_ucx_two_processes(self):
        for binary in BINARIES:
            with self.subTest(binary=binary), tempfile.TemporaryDirectory() as tmp:
                json_path = os.path.join(tmp, "out.json")
                cmd = [sys.executable, LAUNCH, "-n", "2", "--grace", "5", "--",
                       os.path.join(BIN_DIR, binary)] + SMALL + ["-J", json_path]
                start = time.monotonic()
                code, out, err = run(cmd, timeout=60)
                self.assertEqual(code, 0, f"{binary} exited {code} after "
                                          f"{time.monotonic() - start:.1f} s:\n{out}\n{err}")
                self.check_output(binary, out, nranks=2, nthread=1, json_path=json_path)

    def test_local_three_threads(self):
        for binary in BINARIES:
            with self.subTest(binary=binary):
                code, out, err = run([os.path.join(BIN_DIR, binary), "--backend", "local",
                                      "-t", "3"] + SMALL, timeout=60)
                self.assertEqual(code, 0, f"{binary} exited {code}:\n{out}\n{err}")
                self.check_output(binary, out, nranks=3, nthread=3)

    def test_bad_flags_fail_with_a_message(self):
        program = os.path.join(BIN_DIR, "all_reduce_perf")
        cases = [
            (["--bogus"], "invalid option '--bogus'"),
            (["-b", "12X"], "invalid size '12X' for -b"),
            (["-b", "1M", "-e", "1K"], "invalid sizes for 'minbytes' and 'maxbytes'"),
            (["-d", "uint32"], "datatype 'uint32' is not supported"),
            (["-d", "int8"], "datatype int8 cannot be reduced"),
            (["-o", "prod"], "op 'prod' is not supported"),
            (["-n", "zero"], "invalid value 'zero' for -n"),
            (["-a", "7"], "invalid value '7' for -a"),
            (["-t", "2"], "only with --backend local"),
            (["-g", "2"], "-g must be 1"),
            (["--backend", "mpi"], "invalid backend 'mpi'"),
            (["-c"], "-c needs a value"),
        ]
        for args, message in cases:
            with self.subTest(args=args):
                code, out, err = run([program] + args, timeout=30)
                self.assertEqual(code, 2, f"{args}: exit {code}\n{out}\n{err}")
                self.assertIn(message, err)
                self.assertIn("USAGE", err)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    LAUNCH, BIN_DIR = sys.argv[1], sys.argv[2]
    unittest.main(argv=sys.argv[:1] + sys.argv[3:], verbosity=2)
