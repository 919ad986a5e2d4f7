#!/usr/bin/env python3
"""The flight recorder across processes (ctest label `multiprocess`).

    flight_test.py <shardline-launch> <flight_mp> <shardline-flight>

Each scenario runs `shardline-launch -n 3 -- flight_mp <scenario> <iteration>` with
SHARDLINE_FLIGHT_RECORDER_DIR set, bounded in time (the launcher's process group is killed if it
overruns; the ranks die with the launcher), then runs shardline-flight on the dumps and checks its
diagnosis against what the scenario did:

  straggler  rank 2 stops itself (SIGSTOP) before iteration K; ranks 0 and 1 wait in K's
             all-gather. SIGUSR1 makes them dump while they wait, and the tool must name rank 2
             from those dumps alone. At their deadline (8 s) they fail and dump again; the test
             then resumes rank 2 (SIGCONT), which learns of the abort and dumps too. The tool
             must name rank 2 as behind, with its last completed collective, and ranks 0-1
             waiting in the next one.
  diverge    at iteration K rank 1 calls all_gather where ranks 0 and 2 call reduce_scatter:
             the tool must say where the ranks diverged and what each called.
"""

import glob
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

LAUNCH = PROGRAM = FLIGHT = None
EXPECTED_FAILURE = 3
N = 3
DEADLINE_S = 3
STRAGGLER_DEADLINE_S = 8  # time for the SIGUSR1 dumps while the job hangs


class Job:
    """shardline-launch in its own session, its output read line by line with a deadline."""

    def __init__(self, args, env, timeout):
        self.deadline = time.monotonic() + timeout
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, LAUNCH, "-n", str(N), "--grace", "20", "--", PROGRAM, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.buffer = b""

    def output(self):
        return "\n".join(self.lines)

    def wait_for(self, pattern):
        """Reads lines until one matches `pattern` (returns the match) or the deadline passes."""
        regex = re.compile(pattern)
        for line in self.lines:
            m = regex.search(line)
            if m:
                return m
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r} in time:\n{self.output()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"the job ended without {pattern!r}:\n{self.output()}")
            self.buffer += chunk
            *complete, self.buffer = self.buffer.split(b"\n")
            fresh = [raw.decode(errors="replace") for raw in complete]
            self.lines.extend(fresh)  # all of them: lines after a match are read later
            for line in fresh:
                m = regex.search(line)
                if m:
                    return m

    def finish(self):
        """Waits for the launcher to exit (within the deadline); returns its exit code."""
        try:
            out, _ = self.proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job hung:\n{self.output()}")
        text = (self.buffer + out).decode(errors="replace")
        self.lines.extend(l for l in text.split("\n") if l)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


class FlightRecorderTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="shardline_flight_")
        self.env = dict(os.environ, SHARDLINE_FLIGHT_RECORDER_DIR=self.dir,
                        SHARDLINE_TIMEOUT_S=str(DEADLINE_S))
        self.pids = []

    def tearDown(self):
        # A rank still stopped when a test fails dies with the launcher (job.kill, a cleanup):
        # PR_SET_PDEATHSIG sends it SIGKILL, which a stopped process does not ignore.
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, scenario, iteration):
        job = Job([scenario, str(iteration)], self.env, timeout=90)
        self.addCleanup(job.kill)
        for r in range(N):
            self.pids.append(int(job.wait_for(rf"READY rank {r} pid (\d+)").group(1)))
        return job

    def wait_stopped(self, pid, timeout=30):
        """Polls /proc until `pid` is stopped (a state no event announces)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.01)
        self.fail(f"pid {pid} did not stop within {timeout} s")

    def dump_on_signal(self, rank, ready, timeout=20):
        """Sends SIGUSR1 to `rank` until its dump says SIGUSR1 and satisfies `ready`."""
        path = os.path.join(self.dir, f"flight.world.rank{rank}.json")
        end = time.monotonic() + timeout
        dump = None
        while time.monotonic() < end:
            os.kill(self.pids[rank], signal.SIGUSR1)
            time.sleep(0.05)
            try:
                with open(path) as fh:
                    dump = json.load(fh)
            except (OSError, ValueError):
                continue  # not written yet (the dump is renamed into place: never partial)
            if dump["reason"] == "SIGUSR1" and ready(dump):
                return dump
        self.fail(f"rank {rank} wrote no suitable dump on SIGUSR1 within {timeout} s: {dump}")

    def flight(self, *extra):
        proc = subprocess.run([sys.executable, FLIGHT, *extra, self.dir], capture_output=True,
                              text=True, timeout=60)
        return proc.returncode, proc.stdout, proc.stderr

    def check_dumps(self):
        files = sorted(glob.glob(os.path.join(self.dir, "flight.world.rank*.json")))
        self.assertEqual([os.path.basename(f) for f in files],
                         [f"flight.world.rank{r}.json" for r in range(N)])
        dumps = []
        for f in files:
            with open(f) as fh:
                dumps.append(json.load(fh))  # valid JSON
        return dumps

    def test_straggler_is_named(self):
        k = 25
        self.env["SHARDLINE_TIMEOUT_S"] = str(STRAGGLER_DEADLINE_S)
        job = self.start("straggler", k)
        wait_seq = 1 + 2 * k  # iteration i: all_gather #(1 + 2i), reduce_scatter #(2 + 2i)
        # While the job hangs, SIGUSR1 makes ranks 0 and 1 dump what they wait in (rank 2 is
        # stopped and cannot): the live diagnosis, before any deadline.
        self.wait_stopped(self.pids[2])
        for r in (0, 1):
            dump = self.dump_on_signal(r, lambda d: any(
                e["seq"] == wait_seq and e["state"] == "running" and "waiting_on" in e
                for e in d["entries"]))
            entry = [e for e in dump["entries"] if e["seq"] == wait_seq][0]
            self.assertEqual(entry["waiting_on"], [2], dump)
            self.assertEqual(entry["tag"], f"block.{k}")
        code, stdout, stderr = self.flight()
        self.assertEqual(code, 1, stdout + stderr)
        self.assertEqual(stdout.splitlines()[0],
                         f"[world] rank 2 is behind: it left no dump, ranks 0-1 wait in "
                         f"all_gather #{wait_seq} (unit block.{k}) (no dump from rank 2)")

        # Ranks 0 and 1 time out waiting for rank 2 (stopped); then rank 2 is resumed.
        for r in (0, 1):
            m = job.wait_for(rf"FAILED rank {r} at iteration (\d+): (.*)")
            self.assertEqual(int(m.group(1)), k, job.output())
        os.kill(self.pids[2], signal.SIGCONT)
        m = job.wait_for(r"FAILED rank 2 at iteration (\d+)")
        self.assertEqual(int(m.group(1)), k, job.output())
        self.assertEqual(job.finish(), EXPECTED_FAILURE, job.output())
        out = job.output()
        self.assertRegex(out, rf"FAILED rank [01] at iteration \d+: DEADLINE_EXCEEDED: .*"
                              rf"all_gather #\d+ on world .*timed out after "
                              rf"{STRAGGLER_DEADLINE_S}s waiting for rank\(s\) 2", out)

        dumps = self.check_dumps()
        for r in (0, 1):
            entry = {e["seq"]: e for e in dumps[r]["entries"]}[wait_seq]
            self.assertIn(entry["state"], ("running", "failed"))
            self.assertEqual(entry["waiting_on"], [2], dumps[r])
            self.assertEqual(entry["tag"], f"block.{k}")
        self.assertEqual(max(e["seq"] for e in dumps[2]["entries"] if e["state"] == "done"),
                         wait_seq - 1)

        code, stdout, stderr = self.flight()
        self.assertEqual(code, 1, stdout + stderr)
        self.assertEqual(
            stdout.splitlines()[0],
            f"[world] rank 2 is behind: it last completed reduce_scatter #{wait_seq - 1} "
            f"(unit block.{k - 1}), ranks 0-1 wait in all_gather #{wait_seq} (unit block.{k})")

        # Without rank 2's dump the others still point at it.
        os.remove(os.path.join(self.dir, "flight.world.rank2.json"))
        code, stdout, stderr = self.flight()
        self.assertEqual(code, 1, stdout + stderr)
        self.assertEqual(stdout.splitlines()[0],
                         f"[world] rank 2 is behind: it left no dump, ranks 0-1 wait in "
                         f"all_gather #{wait_seq} (unit block.{k}) (no dump from rank 2)")

    def test_divergence_is_named(self):
        k = 30
        job = self.start("diverge", k)
        for r in range(N):
            m = job.wait_for(rf"FAILED rank {r} at iteration (\d+): (.*)")
            self.assertEqual(int(m.group(1)), k, job.output())
            self.assertIn("disagree", m.group(2), job.output())
        self.assertEqual(job.finish(), EXPECTED_FAILURE, job.output())
        self.check_dumps()
        seq = 2 + 2 * k
        code, stdout, stderr = self.flight("-v")
        self.assertEqual(code, 1, stdout + stderr)
        self.assertEqual(
            stdout.splitlines()[0],
            f"[world] ranks diverged at #{seq}: rank 1 called all_gather(count=16, f32) where "
            f"rank 0 called reduce_scatter(count=16, f32, sum)")
        # -v lists each rank's last records.
        self.assertRegex(stdout, rf"rank 1 \(pid \d+, .*\n(.*\n)*    #{seq} all_gather")
        code, stdout, _ = self.flight("--json")
        findings = json.loads(stdout)
        self.assertEqual(findings[0]["communicator"], "world")
        self.assertTrue(findings[0]["problem"])
        self.assertEqual(findings[0]["ranks"], [0, 1, 2])

    # --- The tool on hand-written dumps: the cases the processes above do not produce -------

    def write_dump(self, comm, rank, size, entries):
        dump = {"format": "shardline-flight-recorder", "version": 1, "communicator": comm,
                "backend": "ucx", "rank": rank, "size": size, "pid": 100 + rank, "host": "h",
                "reason": "test", "dumped_at_ns": 1, "capacity": 2048, "recorded": len(entries),
                "next_seq": 0, "entries": []}
        for seq, kind, state, tag, waiting in entries:
            e = {"seq": seq, "call": f"{kind}(count=4, f32)", "kind": kind, "count": 4,
                 "dtype": "f32", "op": "sum", "root": 0, "stream": "s", "tag": tag,
                 "state": state, "enqueued_ns": 1, "started_ns": 2, "ended_ns": 0, "error": ""}
            if waiting is not None:
                e["waiting_on"] = waiting
            if state == "failed":
                e["error"] = "INTERNAL: boom"
            dump["entries"].append(e)
        name = comm.replace("/", "_")
        with open(os.path.join(self.dir, f"flight.{name}.rank{rank}.json"), "w") as fh:
            json.dump(dump, fh)

    def test_diagnoses_hand_written_dumps(self):
        ag, rs = "all_gather", "reduce_scatter"
        # "a": everyone entered #5; ranks 0, 1, 3 wait on rank 2, which waits on nobody.
        for r in range(4):
            self.write_dump("a", r, 4, [(4, ag, "done", "u4", None),
                                        (5, rs, "running", "u5", [] if r == 2 else [2])])
        # "b": all done, nothing pending.
        for r in range(2):
            self.write_dump("b", r, 2, [(0, ag, "done", "", None), (1, ag, "done", "", None)])
        # "c": every rank failed in #1 without waiting on anyone.
        for r in range(2):
            self.write_dump("c", r, 2, [(0, ag, "done", "", None), (1, ag, "failed", "", [])])
        # "d/x": rank 1's #6 is still queued on its stream (it completed #5); ranks 0 and 2
        # finished #6 and wait in #7 for rank 1.
        self.write_dump("d/x", 0, 3, [(6, rs, "done", "u6", None), (7, ag, "failed", "u7", [1])])
        self.write_dump("d/x", 1, 3, [(5, ag, "done", "u5", None), (6, rs, "queued", "u6", None)])
        self.write_dump("d/x", 2, 3, [(6, rs, "done", "u6", None), (7, ag, "running", "u7", [1])])
        code, stdout, stderr = self.flight()
        self.assertEqual(code, 1, stdout + stderr)
        self.assertEqual(stdout.splitlines(), [
            "[a] rank 2 is behind: it last completed all_gather #4 (unit u4), ranks 0-1, 3 wait in "
            "reduce_scatter #5 (unit u5)",
            "[c] ranks 0-1 failed in all_gather #1: rank 0: INTERNAL: boom",
            "[d/x] rank 1 is behind: it last completed all_gather #5 (unit u5), ranks 0, 2 wait "
            "in all_gather #7 (unit u7)",
            "[b] nothing pending: all 2 ranks completed up to #1",
        ])

    def test_bad_input(self):
        code, _, stderr = self.flight()
        self.assertEqual(code, 2)
        self.assertIn("no flight.*.json dumps", stderr)
        with open(os.path.join(self.dir, "flight.x.rank0.json"), "w") as fh:
            fh.write("{not json")
        code, _, stderr = self.flight()
        self.assertEqual(code, 2)
        self.assertIn("flight.x.rank0.json: not a readable JSON dump", stderr)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: flight_test.py <shardline-launch> <flight_mp> <shardline-flight>")
    LAUNCH, PROGRAM, FLIGHT = sys.argv[1:4]
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
