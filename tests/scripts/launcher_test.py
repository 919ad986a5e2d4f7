#!/usr/bin/env python3
"""Tests of shardline-launch: environment, tagged output, failure reporting, grace period,
signal forwarding, exit codes. Usage: launcher_test.py PATH_TO_SHARDLINE_LAUNCH"""

import os
import signal
import subprocess
import sys
import time
import unittest

LAUNCH = None


def launch(*args, timeout=30, env=None):
    return subprocess.run([sys.executable, LAUNCH, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


class LauncherTest(unittest.TestCase):
    def test_torchrun_environment(self):
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        r = launch("-n", "3", "--", "sh", "-c",
                   "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT",
                   env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = sorted(r.stdout.split("\n")[:-1])
        self.assertEqual(len(lines), 3)
        ports = set()
        for rank, line in enumerate(lines):
            f = line.split()
            self.assertEqual(f[:5], [str(rank), "3", str(rank), "3", "127.0.0.1"])
            ports.add(f[5])
        self.assertEqual(len(ports), 1)
        port = int(ports.pop())
        self.assertTrue(0 < port < 65536)
        # Below the kernel's ephemeral range (where there is room), so that no outgoing
        # connection can take it between the launcher's choice and rank 0's listen.
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_lo = int(f.read().split()[0])
        if ephemeral_lo > 12000:
            self.assertTrue(10000 <= port < ephemeral_lo, port)

    def test_bind_to_core(self):
        # Local process k runs on the k-th CPU of the launcher's set, round robin; without the
        # option each keeps the whole set.
        allowed = sorted(os.sched_getaffinity(0))
        n = len(allowed) + 1  # one more than the CPUs: the last wraps around
        show = "import os; print(os.environ['LOCAL_RANK'], sorted(os.sched_getaffinity(0)))"
        # --tag-output: the launcher passes the ranks' lines on whole, one at a time.
        r = launch("-n", str(n), "--bind-to", "core", "--tag-output", "--", sys.executable, "-c",
                   show)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = dict(line.split(": ", 1)[1].split(" ", 1) for line in r.stdout.splitlines())
        self.assertEqual(len(got), n)
        for k in range(n):
            self.assertEqual(got[str(k)], str([allowed[k % len(allowed)]]), got)
        r = launch("-n", "2", "--", sys.executable, "-c", show)
        self.assertEqual(r.returncode, 0, r.stderr)
        for line in r.stdout.splitlines():
            self.assertEqual(line.split(" ", 1)[1], str(allowed))
        r = launch("-n", "2", "--bind-to", "socket", "--", "true")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--bind-to", r.stderr)

    def test_master_port_from_environment(self):
        env = dict(os.environ, MASTER_ADDR="localhost", MASTER_PORT="29511")
        r = launch("-n", "2", "sh", "-c", "echo $MASTER_ADDR:$MASTER_PORT", env=env)
        self.assertEqual(r.stdout.split(), ["localhost:29511"] * 2)

    def test_every_job_gets_a_random_store_token(self):
        env = {k: v for k, v in os.environ.items() if k != "SHARDLINE_STORE_TOKEN"}
        tokens = []
        for _ in range(2):
            r = launch("-n", "2", "--", "sh", "-c", "echo $SHARDLINE_STORE_TOKEN", env=env)
            self.assertEqual(r.returncode, 0, r.stderr)
            lines = r.stdout.split()
            self.assertEqual(len(lines), 2)
            self.assertEqual(lines[0], lines[1])  # one token for the whole job
            self.assertRegex(lines[0], r"^[0-9a-f]{32}$")
            tokens.append(lines[0])
        self.assertNotEqual(tokens[0], tokens[1])
        # The environment's token wins, an empty one included (authentication off).
        for given in ("s3cret", ""):
            r = launch("-n", "2", "--", "sh", "-c", "echo \"[$SHARDLINE_STORE_TOKEN]\"",
                       env=dict(env, SHARDLINE_STORE_TOKEN=given))
            self.assertEqual(r.stdout.split(), [f"[{given}]"] * 2, r.stderr)

    def test_several_nodes_need_a_shared_store_token(self):
        env = {k: v for k, v in os.environ.items() if k != "SHARDLINE_STORE_TOKEN"}
        r = launch("-n", "1", "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port",
                   "29400", "--", "true", env=env)
        self.assertEqual(r.returncode, 2)
        self.assertIn("same store token", r.stderr)
        self.assertIn("SHARDLINE_STORE_TOKEN", r.stderr)

    def test_master_addr_with_a_port_is_refused(self):
        for args, env_addr in ((("--master-addr", "node0:29500"), None), ((), "node0:29500"),
                               ((), "tcp://node0")):
            env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
            if env_addr:
                env["MASTER_ADDR"] = env_addr
            r = launch("-n", "1", *args, "--", "true", env=env)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("MASTER_ADDR", r.stderr)
            self.assertIn("not a plain host", r.stderr)

    def test_one_launcher_per_node(self):
        # Node 1 of 3, 2 processes each: ranks 2 and 3 of 6, the given store for every node.
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env["SHARDLINE_STORE_TOKEN"] = "shared"
        r = launch("-n", "2", "--nnodes", "3", "--node-rank", "1", "--master-addr", "10.0.0.1",
                   "--master-port", "29400", "--", "sh", "-c",
                   "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $NODE_RANK $GROUP_RANK "
                   "$MASTER_ADDR:$MASTER_PORT", env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(r.stdout.splitlines()),
                         ["2 6 0 2 1 1 10.0.0.1:29400", "3 6 1 2 1 1 10.0.0.1:29400"])
        # Failures name the global rank.
        r = launch("-n", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0",
                   "--master-port", "29400", "--grace", "1", "--", "sh", "-c",
                   'if [ "$RANK" = 3 ]; then exit 5; fi; exec sleep 60', env=env)
        self.assertEqual(r.returncode, 5)
        self.assertIn("rank 3 (pid", r.stderr)
        self.assertIn("terminating rank(s) 2", r.stderr)

    def test_several_nodes_need_the_store_address(self):
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        r = launch("-n", "1", "--nnodes", "2", "--node-rank", "0", "--", "true", env=env)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--master-addr", r.stderr)
        r = launch("-n", "1", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h0", "--",
                   "true", env=env)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--master-port", r.stderr)
        for bad in (["--nnodes", "2", "--node-rank", "2"], ["--nnodes", "0"],
                    ["--node-rank", "-1"]):
            r = launch("-n", "1", "--master-addr", "h0", "--master-port", "1", *bad, "--", "true",
                       env=env)
            self.assertEqual(r.returncode, 2, bad)

    def test_tag_output(self):
        r = launch("-n", "2", "--tag-output", "--", "sh", "-c", "echo out$RANK; echo err$RANK >&2")
        self.assertEqual(r.returncode, 0)
        self.assertEqual(sorted(r.stdout.splitlines()), ["[0]<stdout>: out0", "[1]<stdout>: out1"])
        self.assertEqual(sorted(r.stderr.splitlines()), ["[0]<stderr>: err0", "[1]<stderr>: err1"])

    def test_failure_is_reported_and_survivors_terminated_after_grace(self):
        start = time.monotonic()
        r = launch("-n", "3", "--grace", "1", "--", "sh", "-c",
                   'if [ "$RANK" = 1 ]; then exit 7; fi; exec sleep 60')
        elapsed = time.monotonic() - start
        self.assertEqual(r.returncode, 7)
        self.assertIn("rank 1 (pid", r.stderr)
        self.assertIn("exited with status 7", r.stderr)
        self.assertIn("terminating rank(s) 0, 2", r.stderr)
        self.assertLess(elapsed, 20)

    def test_survivors_that_exit_on_their_own_within_grace(self):
        r = launch("-n", "2", "--grace", "30", "--", "sh", "-c",
                   'if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 1; exit 4')
        self.assertEqual(r.returncode, 137)  # the first failure decides: SIGKILL
        self.assertIn("rank 0", r.stderr)
        self.assertIn("SIGKILL", r.stderr)
        self.assertIn("rank 1", r.stderr)
        self.assertNotIn("grace period", r.stderr)

    def test_sigterm_is_forwarded(self):
        p = subprocess.Popen([sys.executable, LAUNCH, "-n", "2", "--", "sleep", "60"],
                             stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # let it start its children; the signal is what is under test
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("SIGTERM", err)

    def test_bad_arguments(self):
        self.assertNotEqual(launch("-n", "0", "true").returncode, 0)
        self.assertNotEqual(launch("-n", "2").returncode, 0)
        r = launch("-n", "1", "/nonexistent/program")
        self.assertEqual(r.returncode, 127)
        self.assertIn("cannot start", r.stderr)


if __name__ == "__main__":
    LAUNCH = sys.argv.pop(1)
    unittest.main(verbosity=2)
