#!/usr/bin/env python3
"""Multi-host scenarios on test hosts made of namespaces (ctest label `multihost`).

    multihost_test.py <path of shardline-launch> <path of collectives_mp>

Each test creates its hosts (tests/scripts/testhosts.py: network, UTS, IPC, PID and mount
namespaces joined through a bridge) and starts one `shardline-launch --nnodes H --node-rank K` per
host, as users do across machines, all pointing at rank 0's store on host 0. Every launch is
bounded in time; the hosts and every process on them are removed when the test ends, whether it
passed or not. Skipped, with the reason, where namespaces cannot be created (not root, no `ip`).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testhosts import TestHosts  # noqa: E402

LAUNCH = None
PROGRAM = None
SURVIVOR_EXIT = 3
STORE_PORT = 29500
CROSSING_COUNT = (1 << 20) + 3  # collectives_mp.cc's Crossing(): f32 elements per rank
CRASH = re.compile(r"backtrace|Assertion|ucs_fatal|Fatal error|Segmentation fault")
UNAVAILABLE = None


class Job:
    """One launcher per host; their output lines, each with the time it arrived."""

    def __init__(self, hosts, per_host, scenario, env=None, grace=10):
        self.hosts = hosts
        self.lines = []  # (monotonic time, host, line)
        self.cond = threading.Condition()
        full_env = dict(os.environ)
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            full_env.pop(name, None)
        full_env.setdefault("SHARDLINE_TIMEOUT_S", "30")
        # One store token for every host's launcher (each would otherwise refuse to start).
        full_env.setdefault("SHARDLINE_STORE_TOKEN", "multihost-test-token")
        full_env.update(env or {})
        self.procs, self.readers = [], []
        for k in range(len(hosts)):
            cmd = [sys.executable, LAUNCH, "-n", str(per_host), "--nnodes", str(len(hosts)),
                   "--node-rank", str(k), "--master-addr", hosts[0].addr, "--master-port",
                   str(STORE_PORT), "--grace", str(grace), "--", PROGRAM, scenario]
            p = hosts.popen(k, cmd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
            self.procs.append(p)
            t = threading.Thread(target=self._read, args=(k, p.stdout), daemon=True)
            t.start()
            self.readers.append(t)

    def _read(self, host, stream):
        for raw in iter(stream.readline, b""):
            with self.cond:
                self.lines.append((time.monotonic(), host, raw.decode(errors="replace").rstrip()))
                self.cond.notify_all()
        stream.close()

    def text(self):
        with self.cond:
            return "\n".join(f"[host {h}] {line}" for _, h, line in self.lines)

    def wait_lines(self, pattern, count, timeout):
        """Waits until `count` lines match `pattern`; returns their (time, match) pairs."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [(t, m) for t, _, line in self.lines if (m := regex.search(line))]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{count} lines matching {pattern!r} did not come "
                                         f"within {timeout} s:\n{self.text_locked()}")
                self.cond.wait(left)

    def text_locked(self):
        return "\n".join(f"[host {h}] {line}" for _, h, line in self.lines)

    def wait(self, timeout):
        """Exit codes of the launchers; AssertionError (after killing them) past `timeout`."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                raise AssertionError(f"launchers still ran after {timeout} s:\n{self.text()}")
        for t in self.readers:
            t.join(timeout=10)
        return codes


def netns_pids(host):
    out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True,
                         timeout=10).stdout
    return [int(p) for p in out.split()]


def rank_pid(host, rank):
    """The pid (in our PID namespace) of the collectives_mp process of `rank` on `host`."""
    for pid in netns_pids(host):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and os.path.basename(PROGRAM).encode() in cmd:
            return pid
    raise AssertionError(f"no process of rank {rank} on {host}")


class MultihostTest(unittest.TestCase):
    def setUp(self):
        if UNAVAILABLE:
            self.skipTest(f"test hosts unavailable: {UNAVAILABLE}")

    def run_ok(self, nhosts, per_host, scenario, timeout, env=None):
        """Runs a scenario that must pass; returns its output and, per host, the bytes received
        on eth0 (from other hosts) and on lo (within the host) meanwhile."""
        with TestHosts(nhosts) as hosts:
            before = [(hosts.rx_bytes(i), hosts.stats(i, "lo")[0]) for i in range(nhosts)]
            job = Job(hosts, per_host, scenario, env)
            codes = job.wait(timeout)
            received = [hosts.rx_bytes(i) - before[i][0] for i in range(nhosts)]
            loopback = [hosts.stats(i, "lo")[0] - before[i][1] for i in range(nhosts)]
            out = job.text()
            self.assertEqual(codes, [0] * nhosts, out)
            for r in range(nhosts * per_host):
                self.assertRegex(out, rf"OK {scenario} rank {r}\b", out)
            self.assertIsNone(CRASH.search(out), out)
            return out, received, loopback

    # --- correctness across hosts -------------------------------------------------------------

    def check_hosts(self, nhosts, per_host):
        out, _, _ = self.run_ok(nhosts, per_host, "hosts", timeout=120)
        # The mesh's shard group is the host: R x S = hosts x ranks per host.
        for r in range(nhosts * per_host):
            self.assertRegex(
                out, rf"MESH rank {r} on node{r // per_host}: {nhosts} x {per_host} \(replicate x "
                rf"shard\), shard rank {r % per_host}, replicate rank {r // per_host}\n", out)

    def test_every_collective_2_hosts_x_2_ranks(self):
        self.check_hosts(2, 2)

    def test_every_collective_3_hosts_x_1_rank(self):
        self.check_hosts(3, 1)

    def crossing_lower_bounds(self, nhosts, per_host):
        """Bytes each host must receive in collectives_mp's Crossing(), whatever the algorithm:
        what its ranks' results depend on and only other hosts hold."""
        n, nh, e, c = nhosts * per_host, per_host, 4, CROSSING_COUNT
        per = c // n
        bounds = []
        for h in range(nhosts):
            b = (n - nh) * c * e          # all_gather: the other hosts' inputs
            b += nh * c * e               # reduce_scatter: one partial sum per output element
            b += c * e                    # all_reduce: the same
            b += 0 if h == nhosts - 1 else c * e  # broadcast from rank n-1 (on the last host)
            b += nh * (n - nh) * per * e  # all_to_all: what other hosts' ranks send here
            bounds.append(b)
        return bounds

    def test_cross_host_bytes_go_over_the_link(self):
        # A path that silently stayed inside one host (or never moved the data) fails here. And
        # within a host the data must not take the network stack: ranks of one host exchange
        # their all-gather blocks alone (per_host * (per_host - 1) * count floats) through
        # shared memory, so the host's loopback (which carries only the store's messages) must
        # see less than that.
        for nhosts, per_host in ((2, 2), (3, 1)):
            with self.subTest(hosts=nhosts, per_host=per_host):
                _, received, loopback = self.run_ok(nhosts, per_host, "crossing", timeout=90)
                bounds = self.crossing_lower_bounds(nhosts, per_host)
                for h in range(nhosts):
                    self.assertGreaterEqual(
                        received[h], bounds[h],
                        f"host {h} received {received[h]} B over its link, less than the "
                        f"{bounds[h]} B its ranks' results need from other hosts")
                    if per_host > 1:
                        local = per_host * (per_host - 1) * CROSSING_COUNT * 4
                        self.assertLess(loopback[h], local,
                                        f"host {h}'s loopback carried {loopback[h]} B: data "
                                        f"between its own ranks went through TCP")
                print(f"crossing {nhosts}x{per_host}: received {received} B over the links "
                      f"(lower bounds {bounds} B), {loopback} B on the hosts' loopbacks",
                      file=sys.stderr)

    # --- failures across hosts ------------------------------------------------------------------

    def test_cut_link_fails_every_rank_on_both_sides(self):
        timeout = 8
        with TestHosts(2) as hosts:
            job = Job(hosts, 2, "cut", {"SHARDLINE_TIMEOUT_S": str(timeout)}, grace=30)
            job.wait_lines(r"LOOPING rank \d", 4, timeout=60)
            cut = time.monotonic()
            hosts.set_link(1, up=False)
            failed = job.wait_lines(r"FAILED rank (\d): (\w+)", 4, timeout=timeout + 20)
            codes = job.wait(timeout=60)
            out = job.text()
            ranks = sorted(int(m.group(1)) for _, m in failed)
            self.assertEqual(ranks, [0, 1, 2, 3], out)
            for t, m in failed:
                self.assertLess(t - cut, timeout + 5,
                                f"rank {m.group(1)} failed {t - cut:.1f} s after the cut:\n{out}")
                self.assertIn(m.group(2), ("UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED"), out)
            for r in range(4):
                self.assertRegex(out, rf"SHUTDOWN rank {r} in", out)
                self.assertRegex(out, rf"rank {r} \(pid \d+\) exited with status {SURVIVOR_EXIT}\b",
                                 out)
            self.assertEqual(codes, [SURVIVOR_EXIT] * 2, out)
            self.assertIsNone(CRASH.search(out), out)
            for h in hosts:
                self.assertEqual(netns_pids(h), [], f"processes left on {h}:\n{out}")
            print("\n".join(f"rank {m.group(1)} failed {t - cut:.2f} s after the cut: "
                            f"{m.group(2)}" for t, m in failed), file=sys.stderr)

    def test_paused_rank_only_delays_the_collectives(self):
        with TestHosts(2) as hosts:
            job = Job(hosts, 2, "pause", {"SHARDLINE_TIMEOUT_S": "30", "SL_MP_RUN_S": "7"})
            job.wait_lines(r"LOOPING rank \d", 4, timeout=60)
            pid = rank_pid(hosts[1], 3)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(3)  # the pause itself (the stimulus), not a wait for an event
            finally:
                os.kill(pid, signal.SIGCONT)
            codes = job.wait(timeout=90)
            out = job.text()
            self.assertEqual(codes, [0, 0], out)
            longest = [float(x) for x in re.findall(r"OK pause rank \d: \d+ iterations, "
                                                    r"longest ([0-9.]+) s", out)]
            self.assertEqual(len(longest), 4, out)
            # The pause fell inside the collectives: some iteration waited for the paused rank.
            self.assertGreater(max(longest), 2.5, out)
            print(out, file=sys.stderr)
            self.assertIsNone(CRASH.search(out), out)

    def test_dead_store_is_named_on_every_rank(self):
        timeout = 8
        with TestHosts(2) as hosts:
            job = Job(hosts, 2, "store_dies", {"SHARDLINE_TIMEOUT_S": str(timeout)}, grace=30)
            errors = job.wait_lines(r"STORE_ERROR rank (\d) after ([0-9.]+) s: (.*)", 3,
                                    timeout=timeout + 30)
            job.wait(timeout=60)
            out = job.text()
            self.assertRegex(out, r"rank 0 \(pid \d+\) was killed by signal 9", out)
            self.assertEqual(sorted(int(m.group(1)) for _, m in errors), [1, 2, 3], out)
            for _, m in errors:
                self.assertLess(float(m.group(2)), timeout, out)
                self.assertRegex(m.group(3), rf"store at {re.escape(hosts[0].addr)}:{STORE_PORT}",
                                 out)
            print("\n".join(m.group(0) for _, m in errors), file=sys.stderr)
            for h in hosts:
                self.assertEqual(netns_pids(h), [], f"processes left on {h}:\n{out}")

    def test_survivors_across_hosts_shrink_and_carry_on(self):
        # Rank 3 (host 1) SIGKILLs itself; ranks 0-2 on both hosts shrink the world and run
        # every collective on it, checked.
        with TestHosts(2) as hosts:
            job = Job(hosts, 2, "shrink", {"SHARDLINE_TIMEOUT_S": "20"}, grace=60)
            job.wait(timeout=120)
            out = job.text()
            self.assertRegex(out, r"rank 3 \(pid \d+\) was killed by signal 9", out)
            for r in range(3):
                self.assertRegex(out, rf"SHRUNK rank {r} in [0-9.]+ s: world/shrink0\.without_3, "
                                 rf"rank {r} of 3", out)
                self.assertRegex(out, rf"OK shrink rank {r}\b", out)
            self.assertIsNone(CRASH.search(out), out)
            for h in hosts:
                self.assertEqual(netns_pids(h), [], f"processes left on {h}:\n{out}")

    # --- mpirun -----------------------------------------------------------------------------

    def mpirun(self, hosts, host_list, nranks, program, timeout=90):
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   SHARDLINE_TIMEOUT_S="30", **hosts.rsh_agent_env())
        testhosts = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testhosts.py")
        agent = f"{sys.executable} {testhosts} rsh"
        cmd = ["mpirun", "--host", host_list, "-n", str(nranks), "--bind-to", "none",
               "--mca", "plm_rsh_agent", agent, "--mca", "oob_tcp_if_include", "10.47.0.0/24",
               "--mca", "btl_tcp_if_include", "10.47.0.0/24", *program]
        p = hosts.popen(0, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            raise AssertionError(f"mpirun hung for {timeout} s:\n{out.decode(errors='replace')}")
        return p.returncode, out.decode(errors="replace")

    @unittest.skipIf(shutil.which("mpirun") is None, "Open MPI's mpirun is not installed")
    def test_mpirun_on_one_host_needs_no_store_address(self):
        with TestHosts(2) as hosts:
            code, out = self.mpirun(hosts, f"{hosts[0].addr}:2", 2, [PROGRAM, "init"])
            self.assertEqual(code, 0, out)
            for r in range(2):
                self.assertRegex(out, rf"OK init rank {r}\b", out)

    @unittest.skipIf(shutil.which("mpirun") is None, "Open MPI's mpirun is not installed")
    def test_mpirun_across_hosts_asks_for_the_store_address(self):
        with TestHosts(2) as hosts:
            code, out = self.mpirun(hosts, f"{hosts[0].addr}:1,{hosts[1].addr}:1", 2,
                                    [PROGRAM, "init"])
            self.assertNotEqual(code, 0, out)
            self.assertRegex(out, r"ranks on several hosts \(OMPI_COMM_WORLD_LOCAL_SIZE=1 of 2\): "
                             r"pass them with mpirun -x; set MASTER_ADDR and MASTER_PORT", out)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: multihost_test.py <shardline-launch> <collectives_mp>")
    LAUNCH, PROGRAM = sys.argv[1], os.path.abspath(sys.argv[2])
    UNAVAILABLE = TestHosts.unavailable()
    if UNAVAILABLE:
        # ctest reports exit code 77 as skipped (SKIP_RETURN_CODE), with this line in the log.
        print(f"SKIP multihost: test hosts unavailable: {UNAVAILABLE}", flush=True)
        sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:], verbosity=2)
