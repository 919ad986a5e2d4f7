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
  trials     4 processes, 20 trials (SHARDLINE_FLIGHT_TRIALS; the seed is printed, and
             SHARDLINE_FLIGHT_SEED replays it): each runs a loop of mixed collectives (all_reduce,
             all_gather, broadcast, barrier; 1 to 2^20 elements; one or two in flight) on a fresh
             communicator, and the test stops a random rank (SIGSTOP) at a random moment, so the
             others hang at different sequence numbers. Every other trial the live ranks dump on
             SIGUSR1 (once their records have settled); the rest dump at their deadline (2 s).
             From those dumps alone the tool must name the stopped rank, and only it.
"""

import glob
import json
import os
import random
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
TRIALS_N = 4  # processes of the random-stop trials
TRIAL_DEADLINE_MS = 2000  # the trials that dump at their deadline
TRIAL_SIGNAL_MS = 60000  # the trials that dump on SIGUSR1 (then SIGUSR2 ends them)


class Job:
    """shardline-launch in its own session, its output read line by line with a deadline."""

    def __init__(self, args, env, timeout, n=N):
        self.deadline = time.monotonic() + timeout
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, LAUNCH, "-n", str(n), "--grace", "20", "--", PROGRAM, *args],
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
                              rf"all_gather #\d+ on world .*timeout after "
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

    def settled_signal_dumps(self, pids, trial, live, timeout=20):
        """SIGUSR1 to the `live` ranks, round after round, until two rounds in a row find each
        of them waiting in the same running collective on the same peers (the hang has settled:
        a state no event announces); returns that round's dumps of communicator trial<t>."""
        end = time.monotonic() + timeout
        previous = None
        while True:
            sent = time.time_ns()
            for r in live:
                os.kill(pids[r], signal.SIGUSR1)
            dumps = {}
            while len(dumps) < len(live):
                if time.monotonic() > end:
                    self.fail(f"trial {trial}: ranks {live} did not settle on SIGUSR1 within "
                              f"{timeout} s: {previous}")
                for r in live:
                    try:
                        with open(os.path.join(self.dir, f"flight.trial{trial}.rank{r}.json")) as f:
                            dump = json.load(f)
                    except (OSError, ValueError):
                        continue  # not written yet (renamed into place: never partial)
                    if dump["reason"] == "SIGUSR1" and dump["dumped_at_ns"] >= sent:
                        dumps[r] = dump
                time.sleep(0.005)
            state = {}
            for r, dump in dumps.items():
                pending = [e for e in dump["entries"] if e["state"] != "done"]
                first = min(pending, key=lambda e: e["seq"]) if pending else None
                state[r] = None if first is None else (first["seq"], first["state"],
                                                       first.get("waiting_on"))
            settled = all(v is not None and v[1] == "running" and v[2] is not None
                          for v in state.values())
            if settled and state == previous:
                return dumps
            previous = state

    def test_stopped_rank_is_named_in_random_trials(self):
        trials = int(os.environ.get("SHARDLINE_FLIGHT_TRIALS", "20"))
        seed = int(os.environ.get("SHARDLINE_FLIGHT_SEED", str(random.randrange(1 << 32))))
        print(f"trials: {trials}, SHARDLINE_FLIGHT_SEED={seed}", file=sys.stderr)
        rng = random.Random(seed)
        modes = ["signal" if t % 2 == 0 else "deadline" for t in range(trials)]
        timeouts = [TRIAL_SIGNAL_MS if m == "signal" else TRIAL_DEADLINE_MS for m in modes]
        self.env["SHARDLINE_TIMEOUT_S"] = "60"  # the world's barriers between trials
        job = Job(["trials", ",".join(map(str, timeouts))], self.env, timeout=60 + 8 * trials,
                  n=TRIALS_N)
        self.addCleanup(job.kill)
        pids = [int(job.wait_for(rf"READY rank {r} pid (\d+)").group(1)) for r in range(TRIALS_N)]

        def resume_all():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.addCleanup(resume_all)  # runs before job.kill
        for t, mode in enumerate(modes):
            for r in range(TRIALS_N):
                job.wait_for(rf"START trial {t} rank {r}$")
            x = rng.randrange(TRIALS_N)
            delay = rng.uniform(0, 0.2)
            where = (f"trial {t} ({mode}): rank {x} stopped {delay * 1000:.0f} ms into the loop "
                     f"(SHARDLINE_FLIGHT_SEED={seed})")
            time.sleep(delay)  # the random moment of the stop (not a wait for anything)
            os.kill(pids[x], signal.SIGSTOP)
            self.wait_stopped(pids[x])
            live = [r for r in range(TRIALS_N) if r != x]
            if mode == "signal":
                self.settled_signal_dumps(pids, t, live)
            else:
                for r in live:
                    job.wait_for(rf"FAILED trial {t} rank {r}: ")
            files = [os.path.join(self.dir, f"flight.trial{t}.rank{r}.json")
                     for r in range(TRIALS_N)]
            self.assertFalse(os.path.exists(files[x]), where)
            dumps = {}
            for r in live:
                with open(files[r]) as fh:
                    dumps[r] = fh.read()
            proc = subprocess.run([sys.executable, FLIGHT, "--json", *(files[r] for r in live)],
                                  capture_output=True, text=True, timeout=60)
            self.assertEqual(proc.returncode, 1, f"{where}\n{proc.stdout}{proc.stderr}")
            [finding] = json.loads(proc.stdout)
            context = f"{where}\n{finding['diagnosis']}\n" + "\n".join(dumps.values())
            self.assertEqual(finding["communicator"], f"trial{t}", context)
            self.assertTrue(finding["diagnosis"].startswith(f"rank {x} is behind: it left no dump"),
                            context)
            self.assertEqual(finding["culprits"], [x], context)
            if mode == "signal":
                os.kill(pids[live[0]], signal.SIGUSR2)  # ends the trial: it aborts the communicator
            os.kill(pids[x], signal.SIGCONT)
            for r in range(TRIALS_N):
                job.wait_for(rf"FAILED trial {t} rank {r}: ")
        for r in range(TRIALS_N):
            job.wait_for(rf"DONE rank {r}$")
        self.assertEqual(job.finish(), 0, job.output())
        # A resumed rank whose peers gave up on its collective must fail it: flight_mp exits 1
        # on a collective that returned OK with wrong data ("FAIL rank r: WRONG trial ..."),
        # which ends the job early; checked here too, in case the lines came after the others.
        wrong = [line for line in job.lines if "WRONG trial" in line]
        self.assertEqual(wrong, [], "collective(s) returned OK with wrong data after an abort")

    # --- The tool on hand-written dumps: the cases the processes above do not produce -------

    def write_dump(self, comm, rank, size, entries, point_to_point=None):
        dump = {"format": "shardline-flight-recorder", "version": 1, "communicator": comm,
                "backend": "ucx", "rank": rank, "size": size, "pid": 100 + rank, "host": "h",
                "reason": "test", "dumped_at_ns": 1, "capacity": 2048, "recorded": len(entries),
                "next_seq": 0, "entries": []}
        for item in entries:
            seq, kind, state, tag, waiting = item[:5]
            e = {"seq": seq, "call": f"{kind}(count=4, f32)", "kind": kind, "count": 4,
                 "dtype": "f32", "op": "sum", "root": 0, "stream": "s", "tag": tag,
                 "state": state, "enqueued_ns": 1, "started_ns": 2, "ended_ns": 0, "error": ""}
            if waiting is not None:
                e["waiting_on"] = waiting
            if state == "failed":
                e["error"] = item[5] if len(item) > 5 else "INTERNAL: boom"
            dump["entries"].append(e)
        if point_to_point is not None:
            dump["point_to_point"] = point_to_point
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
        # Ranks at different sequence numbers (issue 27: the healthy ranks that merely had not
        # finished #s were named). "e": rank 3 is stopped (no dump) inside broadcast #8, whose
        # root, rank 0, and rank 1 got through it and wait in all_reduce #9; rank 2 still waits
        # in #8 for rank 3.
        bc, ar = "broadcast", "all_reduce"
        self.write_dump("e", 0, 4, [(8, bc, "done", "", None), (9, ar, "running", "", [1, 3])])
        self.write_dump("e", 1, 4, [(8, bc, "done", "", None), (9, ar, "running", "", [2])])
        self.write_dump("e", 2, 4, [(7, ag, "done", "", None), (8, bc, "running", "", [3]),
                                    (9, ar, "queued", "", None)])
        # "f": rank 1 is idle after #3 (stuck outside any collective); rank 2 got broadcast #4
        # from rank 0 without it and waits in #5; rank 0 still waits in #4 for rank 1.
        self.write_dump("f", 0, 3, [(3, ag, "done", "", None), (4, bc, "running", "", [1])])
        self.write_dump("f", 1, 3, [(3, ag, "done", "", None)])
        self.write_dump("f", 2, 3, [(4, bc, "done", "", None), (5, ag, "running", "", None)])
        # "g": deadline dumps along a ring: rank 0 timed out waiting on rank 1, which (told of
        # the abort) waited on rank 2, which waited on the stopped rank 3; nobody names 3 but 2.
        self.write_dump("g", 0, 4, [(5, ar, "failed", "", [1])])
        self.write_dump("g", 1, 4, [(5, ar, "failed", "", [2])])
        self.write_dump("g", 2, 4, [(5, ar, "failed", "", [3])])
        # "i": deadline dumps where the straggler failed too: rank 2 was stopped in all_gather
        # #51, its peers timed out waiting for it and aborted, and once resumed it failed #51 on
        # their abort marks; the waits go round (1 <-> 2), but the deadline names rank 2.
        late = "DEADLINE_EXCEEDED: all_gather #51 on i: timeout after 8s waiting for rank(s) 2"
        self.write_dump("i", 0, 3, [(50, rs, "done", "u50", None),
                                    (51, ag, "failed", "u51", [], late)])
        self.write_dump("i", 1, 3, [(50, rs, "done", "u50", None),
                                    (51, ag, "failed", "u51", [2], late)])
        self.write_dump("i", 2, 3, [(50, rs, "done", "u50", None),
                                    (51, ag, "failed", "u51", [1],
                                     "ABORTED: all_gather #51 on i: peer rank 1 aborted: " + late)])
        # "h": both ranks in #3, neither record says whom it waits on (nccl): no rank waits on
        # nobody, so nobody is named.
        for r in range(2):
            self.write_dump("h", r, 2, [(3, ar, "running", "", None)])
        # "j": rank 0 is stopped (no dump) after its part of all_reduce #3; ranks 1 and 3 got
        # through #3 and wait in #4 on rank 2, whose record (from before the others delivered;
        # not yet rescheduled) still names them: the waits go round, and only rank 0 is
        # unaccounted for.
        self.write_dump("j", 1, 4, [(3, ar, "done", "", None), (4, ag, "running", "", [2])])
        self.write_dump("j", 2, 4, [(3, ar, "running", "", [1, 3]), (4, ag, "queued", "", None)])
        self.write_dump("j", 3, 4, [(3, ar, "done", "", None), (4, ag, "running", "", [2])])
        # "p": the collectives are fine; rank 1's receive from rank 0 failed at its deadline
        # after its send went out.
        def p2p(seq, kind, call, state, waiting=None):
            e = {"seq": seq, "call": call, "kind": kind, "count": 4, "dtype": "f32", "op": "sum",
                 "root": 0, "key": 9, "stream": "s", "tag": "", "state": state,
                 "enqueued_ns": 1, "started_ns": 2, "ended_ns": 3, "error": ""}
            if waiting is not None:
                e["waiting_on"] = waiting
            return e
        self.write_dump("p", 0, 2, [(0, ag, "done", "", None)], [])
        self.write_dump("p", 1, 2, [(0, ag, "done", "", None)], [
            p2p(0, "send", "send(count=4, f32, to=0, tag=9)", "done"),
            p2p(1, "recv", "recv(count=4, f32, from=0, tag=9)", "failed", [0])])
        code, stdout, stderr = self.flight()
        self.assertEqual(code, 1, stdout + stderr)
        self.assertEqual(stdout.splitlines(), [
            "[a] rank 2 is behind: it last completed all_gather #4 (unit u4), ranks 0-1, 3 wait in "
            "reduce_scatter #5 (unit u5)",
            "[c] ranks 0-1 failed in all_gather #1: rank 0: INTERNAL: boom",
            "[d/x] rank 1 is behind: it last completed all_gather #5 (unit u5), ranks 0, 2 wait "
            "in all_gather #7 (unit u7)",
            "[e] rank 3 is behind: it left no dump, rank 2 waits in broadcast #8, ranks 0-1 in "
            "all_reduce #9 (no dump from rank 3)",
            "[f] rank 1 is behind: it last completed all_gather #3, rank 0 waits in broadcast #4, "
            "rank 2 in all_gather #5",
            "[g] rank 3 is behind: it left no dump, ranks 0-2 wait in all_reduce #5 (no dump from "
            "rank 3)",
            "[h] ranks 0-1 wait on one another in all_reduce #3 (the records name no rank that "
            "waits on nobody)",
            "[i] rank 2 is behind: it last completed reduce_scatter #50 (unit u50), ranks 0-1 wait "
            "in all_gather #51 (unit u51)",
            "[j] rank 0 is behind: it left no dump, rank 2 waits in all_reduce #3, ranks 1, 3 in "
            "all_gather #4 (no dump from rank 0)",
            "[p] nothing pending: all 2 ranks completed up to #0",
            "[p]   point-to-point: rank 1 failed in recv #1: recv(count=4, f32, from=0, tag=9), "
            "waiting on rank 0",
            "[b] nothing pending: all 2 ranks completed up to #1",
        ])
        code, stdout, stderr = self.flight("--json")
        culprits = {f["communicator"]: f["culprits"] for f in json.loads(stdout)}
        self.assertEqual(culprits, {"a": [2], "b": [], "c": [], "d/x": [1], "e": [3], "f": [1],
                                    "g": [3], "h": [], "i": [2], "j": [0], "p": []})

    def test_bad_input(self):
        code, _, stderr = self.flight()
        self.assertEqual(code, 2)
        self.assertIn("no flight.*.json dumps", stderr)
        with open(os.path.join(self.dir, "flight.x.rank0.json"), "w") as fh:
            fh.write("{not json")
        code, _, stderr = self.flight()
        self.assertEqual(code, 2)
        self.assertIn("flight.x.rank0.json: not a readable JSON dump", stderr)
        self.write_dump("x", 0, 2, [(3, "all_gather", "stuck", "", None)])
        code, _, stderr = self.flight()
        self.assertEqual(code, 2)
        self.assertIn("flight.x.rank0.json: entry 0 (#3): state 'stuck' is not one of", stderr)
        self.write_dump("x", 0, 2, [(3, "all_gather", "running", "", "1")])
        code, _, stderr = self.flight()
        self.assertEqual(code, 2)
        self.assertIn("entry 0 (#3): waiting_on '1' is not a list of ranks", stderr)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: flight_test.py <shardline-launch> <flight_mp> <shardline-flight>")
    LAUNCH, PROGRAM, FLIGHT = sys.argv[1:4]
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
