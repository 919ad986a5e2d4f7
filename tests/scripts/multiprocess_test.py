#!/usr/bin/env python3
"""Multi-process scenarios of the ucx backend (ctest label `multiprocess`).

    multiprocess_test.py <path of shardline-launch> <path of collectives_mp>

Each scenario starts `shardline-launch -n N -- collectives_mp <scenario>` with a hard timeout,
kills the whole process group if it overruns, and checks exit codes and output.
"""

import os
import re
import signal
import subprocess
import sys
import time
import unittest

LAUNCH = None
PROGRAM = None
SURVIVOR_EXIT = 3


def run(n, scenario, timeout, env=None, grace=10):
    full_env = dict(os.environ)
    full_env.setdefault("SHARDLINE_TIMEOUT_S", "60")
    full_env.update(env or {})
    cmd = [sys.executable, LAUNCH, "-n", str(n), "--grace", str(grace), "--", PROGRAM, scenario]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        out, _ = proc.communicate()
        raise AssertionError(f"{scenario} (n={n}) hung for {timeout} s:\n{out.decode(errors='replace')}")
    return proc.returncode, out.decode(errors="replace"), time.monotonic() - start


class MultiprocessUcxTest(unittest.TestCase):
    def expect_ok(self, n, scenario, timeout, env=None):
        code, out, took = run(n, scenario, timeout, env)
        self.assertEqual(code, 0, f"{scenario} n={n} exited {code} after {took:.1f} s:\n{out}")
        for r in range(n):
            self.assertRegex(out, rf"OK {scenario} rank {r}\b", out)

    def test_correctness(self):
        for n in (2, 3, 4):
            with self.subTest(n=n):
                self.expect_ok(n, "correctness", timeout=60)

    def test_tcp_between_processes(self):
        # Every peer treated as remote: UCX's network path (TCP here), error handling on.
        self.expect_ok(2, "quick", timeout=60, env={"SHARDLINE_UCX_SHM": "0"})

    def test_mismatched_counts_and_dtypes_fail_everywhere(self):
        for n in (2, 4):
            with self.subTest(n=n):
                self.expect_ok(n, "mismatch", timeout=60)

    def test_store_flooded_with_garbage(self):
        self.expect_ok(3, "flood", timeout=60)

    def test_killed_rank_is_an_error_on_every_survivor(self):
        # Shared memory with UCX error handling (SHARDLINE_UCX_CMA=0): UCX 1.13 aborts a process
        # whose CMA read hits a dead peer, so the default (CMA) mode cannot survive a SIGKILL.
        code, out, took = run(3, "kill", timeout=60, env={"SHARDLINE_UCX_CMA": "0"}, grace=20)
        self.assertNotEqual(code, 0, out)
        for r in (0, 2):
            m = re.search(rf"SURVIVOR rank {r} failed after ([0-9.]+) s: (\w+)", out)
            self.assertIsNotNone(m, f"rank {r} did not report the failure:\n{out}")
            self.assertLess(float(m.group(1)), 20 + 5, out)
            self.assertIn(m.group(2), ("UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED"), out)
        self.assertLess(took, 50, out)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: multiprocess_test.py <shardline-launch> <collectives_mp>")
    LAUNCH, PROGRAM = sys.argv[1], sys.argv[2]
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:], verbosity=2)
