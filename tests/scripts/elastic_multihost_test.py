#!/usr/bin/env python3
"""Elastic hybrid sharding across test hosts, a host's link cut instead of a process killed
(ctest `elastic_multihost`, label `multihost`).

    elastic_multihost_test.py <shardline-store> <elastic_mp> [unittest arguments]

Two test hosts (tests/scripts/testhosts.py), one replica group of
tests/scheduler/multiprocess/elastic_mp.cc per host: 2 replica groups x 2 shard ranks. Host 0
runs shardline-store, listening on its bridge address, and replica group 0; host 1 runs replica
group 1. Each host's ranks are started by one agent process (this script, `agent` mode), so that
they share the host's namespaces (hostname, PID namespace, /dev/shm) as ranks of one machine do.
Every rank stops before step HOLD_STEP (elastic_mp --hold-at); the driver cuts host 1's link
(`ip link set eth0 down` in its namespace) and then lets every rank go. No process dies, so the
store sees no connection close and writes no `lost` entry: the protocol has to decide by its
timeouts. Then:
  * test_cut_link: the survivors on host 0 abort the round, redo the step alone and finish with
    "CHECK ok" (their reference drops replica 1 from the cut step on: the STEP lines' replica
    lists say so); the surviving leader decides (a round aborted, or a quorum timed out) within
    DETECTION_BOUND_S of the cut, and the survivors' redone step commits within RECOVERY_BOUND_S
    (measured from the cut to each survivor's next STEP line); host 1's ranks exit with an error (no signal, no crash) within
    HOST1_EXIT_BOUND_S of the cut;
  * test_cut_link_then_rejoin: once the survivors have redone the step, host 1's old processes
    are killed, the link is restored and replica group 1 is started again with incarnation 1; it
    joins (the survivors wait for it with --await-joiners-at) and ends with state bit-identical
    (CRC-32C) to the survivor of the same shard index;
  * test_cut_link_anywhere: no hold, the cut follows host 1's first "STEP 2" line wherever the
    ranks are then (a collective, a quorum, a vote), with the checks of test_cut_link.
Every wait is bounded; the hosts, the store and every rank are removed when a test ends, passed
or not. Skipped (exit 77) with the reason where namespaces cannot be created (not root, no `ip`).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testhosts import TestHosts  # noqa: E402

STORE = PROGRAM = None
UNAVAILABLE = None
TIMEOUT_S = 6       # SHARDLINE_TIMEOUT_S: the collectives' deadline and the protocol's quiet time
STEPS = 10
HOLD_STEP = 3       # the step whose replicate all-reduce meets the cut
REJOIN_AT = HOLD_STEP + 2  # the survivors wait for the restarted group before this step
CUT_AFTER = 2       # without a hold: the cut follows host 1's first "STEP 2" line
FREE_STEPS = 60     # enough that training is still on when the cut takes effect
STARTUP_S = 60      # store, connections and the first HOLD_STEP steps
# A silent loss: the step's replicate all-reduce (or the vote's wait) runs into its deadline and
# the round aborts: detection, which issue 33 bounds by SHARDLINE_TIMEOUT_S + 5 s. Then the
# round's communicators are torn down (UCX gives a silent peer's endpoint 2 s to close) and the
# next quorum waits for replica 1 until the log has been quiet for
# ElasticOptions::quorum_timeout_after_abort (3 s): the redone step commits within T + 7 s.
DETECTION_BOUND_S = TIMEOUT_S + 5
RECOVERY_BOUND_S = TIMEOUT_S + 7
# Host 1's ranks: the all-reduce's deadline, then their fail vote's store call (its timeout).
HOST1_EXIT_BOUND_S = 2 * TIMEOUT_S + 5
FINISH_S = 60       # from the recovery to the end of training (and the rejoin)
CRASH = re.compile(r"backtrace|Assertion|ucs_fatal|Fatal error|Segmentation fault")


def agent(spec):
    """Runs on a test host: starts the ranks of `spec` (JSON [[name, argv], ...]), prints their
    output lines as "<name> <line>" and, when one exits, "<name> EXIT <code>"; copies each line of
    its standard input to every rank's (the --hold-at release). Exits once every rank has; if its
    own input closes (the driver is gone), kills the ranks."""
    ranks = json.loads(spec)
    lock = threading.Lock()

    def say(text):
        with lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    procs = {name: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT) for name, argv in ranks}

    def pump(name, proc):
        for raw in iter(proc.stdout.readline, b""):
            say(f"{name} {raw.decode(errors='replace').rstrip()}")
        say(f"{name} EXIT {proc.wait()}")

    def forward():
        for line in iter(sys.stdin.buffer.readline, b""):
            for proc in procs.values():
                try:
                    proc.stdin.write(line)
                    proc.stdin.flush()
                except (BrokenPipeError, ValueError):
                    pass  # that rank is gone already
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()

    threading.Thread(target=forward, daemon=True).start()
    pumps = [threading.Thread(target=pump, args=item) for item in procs.items()]
    for t in pumps:
        t.start()
    for t in pumps:
        t.join()
    sys.stdout.flush()
    os._exit(0)  # the forwarding thread may still be reading stdin: no interpreter shutdown


class Output:
    """The lines of the store and the agents, each with the time it arrived and its source: the
    rank's name ("1.0.0": replica, shard, incarnation) or "store"."""

    def __init__(self):
        self.lines = []  # (monotonic time, source, text)
        self.cond = threading.Condition()
        self.readers = []

    def attach(self, stream, source=None):
        def read():
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                name, text = (source, line) if source else (line.split(" ", 1) + [""])[:2]
                with self.cond:
                    self.lines.append((time.monotonic(), name, text))
                    self.cond.notify_all()
            stream.close()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        self.readers.append(t)

    def text(self):
        with self.cond:
            return "\n".join(f"[{t:.3f} {name}] {text}" for t, name, text in self.lines)

    def wait_for(self, pattern, sources, timeout):
        """Waits until each of `sources` has printed a line matching `pattern`; returns
        {source: (time, match)} of the first such line of each."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = {}
                for t, name, text in self.lines:
                    if name in sources and name not in found and (m := regex.search(text)):
                        found[name] = (t, m)
                if len(found) == len(sources):
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(sources) - set(found))
                    raise AssertionError(
                        f"no line matching {pattern!r} from {missing} within {timeout} s:\n"
                        + "\n".join(f"[{t:.3f} {n}] {x}" for t, n, x in self.lines))
                self.cond.wait(left)

    def of(self, source):
        with self.cond:
            return "\n".join(text for _, name, text in self.lines if name == source)


def name(replica, shard, incarnation):
    return f"{replica}.{shard}.{incarnation}"


class ElasticMultihostTest(unittest.TestCase):
    def setUp(self):
        if UNAVAILABLE:
            self.skipTest(f"test hosts unavailable: {UNAVAILABLE}")

    def start_store(self, hosts, out):
        store = hosts.popen(0, [STORE, "--host", hosts[0].addr, "--port", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
        out.attach(store.stdout, "store")
        (_, m), = out.wait_for(r"listening on [^ ]+:(\d+)", ["store"], timeout=30).values()
        return store, m.group(1)

    def start_group(self, hosts, out, env, replica, incarnation, steps, extra):
        """One agent on host `replica` running that replica group's two ranks."""
        ranks = [[name(replica, shard, incarnation),
                  [PROGRAM, "--replicas", "2", "--shard-size", "2", "--replica", str(replica),
                   "--shard", str(shard), "--incarnation", str(incarnation), "--steps",
                   str(steps), *extra]] for shard in range(2)]
        proc = hosts.popen(replica, [sys.executable, os.path.abspath(__file__), "agent",
                                     json.dumps(ranks)],
                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
        out.attach(proc.stdout)
        return proc

    def run_cut(self, rejoin, held=True):
        """Runs one scenario; returns its figures (and asserts on the way). `held`: the ranks
        hold before HOLD_STEP and the cut comes before they train it; otherwise the cut comes
        when host 1's first rank has printed STEP CUT_AFTER, wherever the ranks are then."""
        out = Output()
        t0 = time.monotonic()
        figures = {}
        steps = STEPS if held else FREE_STEPS
        with TestHosts(2) as hosts:
            try:
                store, port = self.start_store(hosts, out)
                env = {k: v for k, v in os.environ.items()
                       if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
                env.update(MASTER_ADDR=hosts[0].addr, MASTER_PORT=port,
                           SHARDLINE_STORE_TOKEN="elastic-multihost-test-token",
                           SHARDLINE_TIMEOUT_S=str(TIMEOUT_S), SHARDLINE_UCX_SPIN_US="0")
                hold = ["--hold-at", str(HOLD_STEP)] if held else []
                survivors = [name(0, s, 0) for s in range(2)]
                cut_off = [name(1, s, 0) for s in range(2)]
                joiners = [name(1, s, 1) for s in range(2)]
                groups = [
                    self.start_group(hosts, out, env, 0, 0, steps,
                                     hold + (["--await-joiners-at", str(REJOIN_AT)]
                                             if rejoin else [])),
                    self.start_group(hosts, out, env, 1, 0, steps, hold)]
                if held:
                    out.wait_for(rf"^HOLD step {HOLD_STEP}$", survivors + cut_off, STARTUP_S)
                else:
                    out.wait_for(rf"^STEP {CUT_AFTER} ", cut_off[:1], STARTUP_S)
                hosts.set_link(1, up=False)
                cut = time.monotonic()
                if held:
                    for g in groups:  # every rank trains the step now, the link already cut
                        g.stdin.write(b"\n")
                        g.stdin.flush()
                # The first step trained without replica 1 (the cut step, redone).
                alone = out.wait_for(r"^STEP (\d+) replicas 0(?: at_ms \d+)?$", survivors, RECOVERY_BOUND_S + 20)
                figures["cut_step"] = [int(alone[s][1].group(1)) for s in survivors]
                figures["recovered_s"] = [round(alone[s][0] - cut, 2) for s in survivors]
                # Detection: the surviving leader's first decision after the cut (a round it saw
                # abort, or the timeout entry it wrote to decide a quorum).
                leader = name(0, 0, 0)
                decided = out.wait_for(r"\) aborted: |appending 'timeout", [leader], 5)
                figures["detected_s"] = round(decided[leader][0] - cut, 2)
                if rejoin:
                    # The agent is its PID namespace's init: the ranks go with it.
                    os.killpg(groups[1].pid, signal.SIGKILL)
                    groups[1].wait(timeout=10)
                    self.assertEqual(hosts.leftover_processes(), [store.pid, groups[0].pid])
                    hosts.set_link(1, up=True)
                    groups.append(self.start_group(hosts, out, env, 1, 1, steps, []))
                    finished = survivors + joiners
                else:
                    exits = out.wait_for(r"^EXIT (-?\d+)$", cut_off, HOST1_EXIT_BOUND_S + 20)
                    figures["host1_exit"] = {s: (int(m.group(1)), round(t - cut, 2))
                                             for s, (t, m) in exits.items()}
                    finished = survivors
                ends = out.wait_for(r"^EXIT (-?\d+)$", finished, FINISH_S)
                for g in groups:
                    g.stdin.close()
                    g.wait(timeout=10)
                store.stdin.close()
                store.wait(timeout=10)
                figures["seconds"] = round(time.monotonic() - t0, 1)
                self.check(out, rejoin, held, steps, figures,
                           {s: int(m.group(1)) for s, (_, m) in ends.items()})
            finally:
                netns = [h.netns for h in hosts] + [hosts.switch]
                hosts.close()
                self.assertEqual(hosts.leftover_processes(), [])
                listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                         timeout=10).stdout
                self.assertEqual([n for n in netns if n in listing], [])
        return figures

    def check(self, out, rejoin, held, nsteps, figures, codes):
        everything = out.text()
        self.assertIsNone(CRASH.search(everything), everything)
        cut_step = figures["cut_step"][0]
        self.assertEqual(figures["cut_step"], [cut_step] * 2, everything)
        if held:
            self.assertEqual(cut_step, HOLD_STEP, everything)
        else:
            self.assertGreater(cut_step, CUT_AFTER, everything)
        digests = {}
        for shard in range(2):
            key = name(0, shard, 0)
            text = out.of(key)
            self.assertEqual(codes[key], 0, f"survivor {key}:\n{everything}")
            self.assertRegex(text, r"(?m)^CHECK ok", everything)
            steps = {int(k): v for k, v in re.findall(r"(?m)^STEP (\d+) replicas (\S+)(?: at_ms \d+)?$", text)}
            self.assertEqual(sorted(steps), list(range(nsteps)), everything)
            # Replica 1 is dropped from the cut step on (until it rejoins): the survivors'
            # reference (CHECK ok) averages the gradients of exactly these replicas.
            for step, replicas in steps.items():
                if step < cut_step:
                    self.assertEqual(replicas, "0,1", f"step {step} of {key}:\n{everything}")
                elif step == cut_step or not rejoin:
                    self.assertEqual(replicas, "0", f"step {step} of {key}:\n{everything}")
            if rejoin:
                back = [s for s, r in sorted(steps.items()) if r == "0,1" and s > cut_step]
                self.assertTrue(back, f"replica 1 never trained again:\n{everything}")
                self.assertEqual(back, list(range(back[0], nsteps)), everything)
                self.assertLessEqual(back[0], REJOIN_AT, everything)
            # Decided by timeouts or failed votes, never by a `lost` entry: no process died, no
            # connection closed. A held cut meets the step's all-reduce: that round is aborted and
            # redone. A free cut may instead fall between rounds (only the quorum times out).
            recoveries = re.findall(r"(?m)^RECOVERY round \d+ step (\d+) detect_ms ([\d.]+) "
                                    r"resume_ms ([\d.]+): (.*)$", text)
            if held:
                self.assertIn(str(HOLD_STEP), [r[0] for r in recoveries], everything)
            for step, detect, resume, why in recoveries:
                self.assertNotIn("was lost", why, everything)
            figures.setdefault("recoveries", []).append(recoveries)
            digests[shard] = re.search(r"(?m)^DIGEST replica 0 shard \d (\w+)$", text).group(1)
        self.assertLess(figures["detected_s"], DETECTION_BOUND_S,
                        f"the survivors' leader decided {figures['detected_s']} s after the cut "
                        f"(bound {DETECTION_BOUND_S} s):\n{everything}")
        for s, took in zip(range(2), figures["recovered_s"]):
            self.assertLess(took, RECOVERY_BOUND_S,
                            f"survivor (0, {s}) committed step {cut_step} alone {took} s after "
                            f"the cut (bound {RECOVERY_BOUND_S} s):\n{everything}")
        if rejoin:
            for shard in range(2):
                key = name(1, shard, 1)
                text = out.of(key)
                self.assertEqual(codes[key], 0, f"joiner {key}:\n{everything}")
                self.assertRegex(text, r"(?m)^CHECK joined", everything)
                digest = re.search(r"(?m)^DIGEST replica 1 shard \d (\w+)$", text).group(1)
                self.assertEqual(digest, digests[shard],
                                 f"shard {shard}: joiner {digest}, survivor {digests[shard]}:\n"
                                 f"{everything}")
        else:
            for key, (code, took) in figures["host1_exit"].items():
                self.assertGreater(code, 0, f"host 1's rank {key} exited {code}:\n{everything}")
                self.assertLess(took, HOST1_EXIT_BOUND_S,
                                f"host 1's rank {key} exited {took} s after the cut:\n{everything}")
                self.assertRegex(out.of(key), r"(?m)^elastic_mp: ", everything)
        figures["errors"] = {key: re.findall(r"(?m)^elastic_mp: (.*)$", out.of(key))
                             for key in (name(1, s, 0) for s in range(2))}

    def test_cut_link(self):
        figures = self.run_cut(rejoin=False)
        print(f"cut link: {json.dumps(figures)}", file=sys.stderr)

    def test_cut_link_anywhere(self):
        figures = self.run_cut(rejoin=False, held=False)
        print(f"cut link, unsynchronised: {json.dumps(figures)}", file=sys.stderr)

    def test_cut_link_then_rejoin(self):
        figures = self.run_cut(rejoin=True)
        print(f"cut link, then rejoin: {json.dumps(figures)}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        sys.exit(agent(sys.argv[2]))
    if len(sys.argv) < 3:
        sys.exit("usage: elastic_multihost_test.py <shardline-store> <elastic_mp>")
    STORE, PROGRAM = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    rest = sys.argv[3:]
    UNAVAILABLE = TestHosts.unavailable()
    if UNAVAILABLE:
        print(f"SKIP elastic multihost: test hosts unavailable: {UNAVAILABLE}", flush=True)
        sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
