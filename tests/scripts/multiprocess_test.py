#!/usr/bin/env python3
"""Multi-process scenarios of the ucx backend (ctest label `multiprocess`).

    multiprocess_test.py <path of shardline-launch> <path of collectives_mp>

Each scenario starts `shardline-launch -n N -- collectives_mp <scenario>` with a hard timeout,
kills the launcher's process group if it overruns (the ranks die with the launcher: it sets
PR_SET_PDEATHSIG), and checks exit codes and output.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import unittest

LAUNCH = None
PROGRAM = None
SURVIVOR_EXIT = 3
INIT_ERROR_EXIT = 4


def run(n, scenario, timeout, env=None, grace=10, args=()):
    full_env = dict(os.environ)
    full_env.setdefault("SHARDLINE_TIMEOUT_S", "60")
    full_env.update(env or {})
    cmd = [sys.executable, LAUNCH, "-n", str(n), "--grace", str(grace), "--", PROGRAM, scenario,
           *args]
    return run_command(cmd, timeout, full_env, f"{scenario} (n={n})")


def run_command(cmd, timeout, env, what):
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} hung for {timeout} s:\n{out.decode(errors='replace')}")
    return proc.returncode, out.decode(errors="replace"), time.monotonic() - start


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a crash looks like in the output: UCX's fatal errors and assertions print a backtrace.
CRASH = re.compile(r"backtrace|Assertion|ucs_fatal|Fatal error|Segmentation fault|"
                   r"AddressSanitizer|ThreadSanitizer")


class MultiprocessUcxTest(unittest.TestCase):
    def expect_ok(self, n, scenario, timeout, env=None):
        code, out, took = run(n, scenario, timeout, env)
        self.assertEqual(code, 0, f"{scenario} n={n} exited {code} after {took:.1f} s:\n{out}")
        for r in range(n):
            self.assertRegex(out, rf"OK {scenario} rank {r}\b", out)
        self.assertIsNone(CRASH.search(out), out)

    def test_correctness(self):
        for n in (2, 3, 4):
            with self.subTest(n=n):
                self.expect_ok(n, "correctness", timeout=60)

    def test_correctness_on_shareable_memory(self):
        # Buffers in shareable memory: peers on the host map them and copy with memcpy.
        env = {"SHARDLINE_MP_MEMORY": "shareable", "SHARDLINE_DEBUG": "INFO",
               "SHARDLINE_DEBUG_SUBSYS": "COLL"}
        for n in (2, 4):
            with self.subTest(n=n):
                code, out, took = run(n, "correctness", 60, env)
                self.assertEqual(code, 0, f"exited {code} after {took:.1f} s:\n{out}")
                for r in range(n):
                    self.assertRegex(out, rf"OK correctness rank {r}\b", out)
                    self.assertRegex(out, rf"rank {r}: maps the shareable memory of peer rank",
                                     out)
                self.assertNotIn("reading its memory with process_vm_readv", out)
                self.assertIsNone(CRASH.search(out), out)

    def test_shareable_memory_without_mapping(self):
        # SHARDLINE_UCX_MAP=0: the same buffers are read with process_vm_readv.
        self.expect_ok(3, "quick", timeout=60,
                       env={"SHARDLINE_MP_MEMORY": "shareable", "SHARDLINE_UCX_MAP": "0"})

    def test_registered_memory(self):
        # RegisterMemory across processes: the communicator's host memory registers as mapped
        # (and is mapped), private memory as process_read; with mapping or CMA off the paths
        # change accordingly. Freeing a block the peers map must return its pages.
        cases = [({"SHARDLINE_DEBUG": "INFO", "SHARDLINE_DEBUG_SUBSYS": "COLL"}, "mapped"),
                 ({"SHARDLINE_UCX_MAP": "0"}, "process_read"),
                 ({"SHARDLINE_UCX_CMA": "0"}, "transport")]
        for env, path in cases:
            with self.subTest(path=path):
                code, out, took = run(2, "register", 60, env)
                self.assertEqual(code, 0, f"exited {code} after {took:.1f} s:\n{out}")
                for r in range(2):
                    self.assertRegex(out, rf"OK register rank {r} path {path}\b", out)
                    if path == "mapped":
                        self.assertRegex(out, rf"rank {r}: maps the shareable memory of peer", out)
                self.assertIsNone(CRASH.search(out), out)

    def test_tcp_between_processes(self):
        # Every peer treated as remote: UCX's network path (TCP here), error handling on.
        self.expect_ok(2, "quick", timeout=60, env={"SHARDLINE_UCX_SHM": "0"})

    def test_mismatched_counts_and_dtypes_fail_everywhere(self):
        for n in (2, 4):
            with self.subTest(n=n):
                self.expect_ok(n, "mismatch", timeout=60)

    def test_skipped_collective_fails_every_rank_at_once(self):
        # Rank 1's stream drops its all-reduce (poisoned after the collective was enqueued). The
        # timeout is 600 s; every rank must fail within seconds (the time is printed).
        for n in (2, 3):
            with self.subTest(n=n):
                code, out, took = run(n, "skipped", timeout=60)
                self.assertEqual(code, 0, out)
                for r in range(n):
                    m = re.search(rf"SKIPPED rank {r} failed after ([0-9.]+) s", out)
                    self.assertIsNotNone(m, f"rank {r} did not report:\n{out}")
                    self.assertLess(float(m.group(1)), 10, out)
                print(out, file=sys.stderr)

    def test_store_flooded_with_garbage(self):
        self.expect_ok(3, "flood", timeout=60)

    def test_process_group_split_and_mesh(self):
        # InitProcessGroup from shardline-launch's environment; with 4 ranks a 2 x 2 mesh.
        for n in (2, 4):
            with self.subTest(n=n):
                self.expect_ok(n, "init", timeout=90)

    def check_kill(self, env):
        # Rank 1 SIGKILLs itself during a large all-reduce (timeout 20 s). Every survivor must
        # report the error within the deadline + 5 s, then shut down and exit with the code the
        # program chose (no abort, no hang).
        # The grace period outlasts the deadline, so a survivor that only notices at its deadline
        # still reports (and passes: deadline + 5 s is the bound).
        code, out, took = run(3, "kill", timeout=90, env=env, grace=30)
        self.assertNotEqual(code, 0, out)
        self.assertRegex(out, r"rank 1 \(pid \d+\) was killed by signal 9", out)
        for r in (0, 2):
            m = re.search(rf"SURVIVOR rank {r} failed after ([0-9.]+) s: (\w+)", out)
            self.assertIsNotNone(m, f"rank {r} did not report the failure:\n{out}")
            self.assertLess(float(m.group(1)), 20 + 5, out)
            self.assertIn(m.group(2), ("UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED"), out)
            self.assertRegex(out, rf"SHUTDOWN rank {r} in", f"rank {r} did not shut down:\n{out}")
            self.assertRegex(out, rf"rank {r} \(pid \d+\) exited with status {SURVIVOR_EXIT}\b",
                             f"rank {r} did not exit cleanly:\n{out}")
        self.assertIsNone(CRASH.search(out), out)
        self.assertLess(took, 60, out)

    def test_point_to_point(self):
        self.expect_ok(3, "p2p", timeout=120)

    def test_point_to_point_over_tcp(self):
        self.expect_ok(2, "p2p", timeout=120, env={"SHARDLINE_UCX_SHM": "0"})

    def test_killed_rank_fails_the_receives_waiting_for_it(self):
        code, out, took = run(3, "p2p_kill", timeout=90, grace=30)
        self.assertRegex(out, r"rank 1 \(pid \d+\) was killed by signal 9", out)
        for r in (0, 2):
            m = re.search(rf"SURVIVOR rank {r} failed after ([0-9.]+) s: (\w+)", out)
            self.assertIsNotNone(m, f"rank {r} did not report the failure:\n{out}")
            self.assertLess(float(m.group(1)), 20 + 5, out)
            self.assertIn(m.group(2), ("UNAVAILABLE", "ABORTED"), out)
            self.assertRegex(out, rf"rank {r} \(pid \d+\) exited with status {SURVIVOR_EXIT}\b",
                             f"rank {r} did not exit cleanly:\n{out}")
        self.assertIsNone(CRASH.search(out), out)

    def test_killed_rank_is_an_error_on_every_survivor(self):
        # The default: large messages between the processes are single-copy (CMA) reads.
        self.check_kill({})

    def test_killed_rank_with_mapped_memory(self):
        # The survivor copies out of its mapping of the dead rank's memory: still an error.
        self.check_kill({"SHARDLINE_MP_MEMORY": "shareable"})

    def test_killed_rank_over_ucx_shared_memory(self):
        self.check_kill({"SHARDLINE_UCX_CMA": "0"})

    def test_killed_rank_over_tcp(self):
        self.check_kill({"SHARDLINE_UCX_SHM": "0"})

    def test_survivors_shrink_and_carry_on(self):
        # The last rank SIGKILLs itself mid all-reduce; the others Shrink the world without it
        # and run every collective on the shrunk communicator, checked.
        for n in (3, 4):
            with self.subTest(n=n):
                code, out, took = run(n, "shrink", timeout=90, env={"SHARDLINE_TIMEOUT_S": "20"},
                                      grace=60)
                self.assertRegex(out, rf"rank {n - 1} \(pid \d+\) was killed by signal 9", out)
                for r in range(n - 1):
                    self.assertRegex(out, rf"SHRUNK rank {r} in [0-9.]+ s: world/shrink0"
                                     rf"\.without_{n - 1}, rank {r} of {n - 1}", out)
                    self.assertRegex(out, rf"OK shrink rank {r}\b", out)
                    self.assertNotRegex(out, rf"rank {r} \(pid \d+\) exited", out)
                self.assertIsNone(CRASH.search(out), out)

    # --- InitProcessGroup failures: clear errors on every rank, no hang -----------------------

    def expect_init_errors(self, out, ranks, pattern):
        for r in ranks:
            m = re.search(rf"INIT_ERROR rank {r}: (.*)", out)
            self.assertIsNotNone(m, f"rank {r} reported no init error:\n{out}")
            self.assertRegex(m.group(1), pattern, out)

    def test_join_with_a_different_timeout_fails_on_every_rank_naming_it(self):
        code, out, _ = run(3, "init_error", timeout=60, env={"SHARDLINE_TIMEOUT_S": "5"},
                           args=["SHARDLINE_TIMEOUT_S=7"])
        self.assertEqual(code, INIT_ERROR_EXIT, out)
        self.expect_init_errors(
            out, (0, 1, 2),
            r"FAILED_PRECONDITION: join of world: rank 1 has timeout_s=7 but rank 0 has "
            r"timeout_s=5")

    def test_different_ucx_wire_tuning_fails_on_every_rank_naming_it(self):
        # Rank 1's chunk size differs: the ucx handshake names it on every rank, over UCX's
        # shared memory and over its network path alike.
        for shm in ("1", "0"):
            with self.subTest(shm=shm):
                code, out, _ = run(3, "init_error", timeout=60,
                                   env={"SHARDLINE_UCX_CHUNK_BYTES": "1048576",
                                        "SHARDLINE_UCX_SHM": shm},
                                   args=["SHARDLINE_UCX_CHUNK_BYTES=65536"])
                self.assertEqual(code, INIT_ERROR_EXIT, out)
                self.expect_init_errors(
                    out, (0, 1, 2),
                    r"INVALID_ARGUMENT: creating ucx communicator world \(rank \d of 3\): rank 1 "
                    r"has SHARDLINE_UCX_CHUNK_BYTES=65536 but rank 0 has "
                    r"SHARDLINE_UCX_CHUNK_BYTES=1048576")
                self.assertIsNone(CRASH.search(out), out)

    def test_wrong_token_is_refused(self):
        code, out, _ = run(2, "init_error", timeout=60,
                           env={"SHARDLINE_TIMEOUT_S": "3", "SHARDLINE_STORE_TOKEN": "right"},
                           args=["SHARDLINE_STORE_TOKEN=wrong"])
        self.assertEqual(code, INIT_ERROR_EXIT, out)
        self.expect_init_errors(out, (1,), r"PERMISSION_DENIED: store at 127\.0\.0\.1:\d+ "
                                r"refused the token \(SHARDLINE_STORE_TOKEN\)")
        self.expect_init_errors(out, (0,), r"DEADLINE_EXCEEDED: .*waiting for rank\(s\) 1\b")

    def test_store_port_in_use(self):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen(8)
            port = busy.getsockname()[1]
            code, out, took = run(2, "init_error", timeout=60, grace=5,
                                  env={"SHARDLINE_TIMEOUT_S": "3", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port)})
        self.assertEqual(code, INIT_ERROR_EXIT, out)
        self.expect_init_errors(out, (0,), rf"port {port} .*already in use")
        self.assertLess(took, 30, out)

    def test_unreachable_store(self):
        # Rank 1 alone: nobody hosts the store.
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), SHARDLINE_TIMEOUT_S="2")
        code, out, took = run_command([PROGRAM, "init_error"], 30, env, "unreachable store")
        self.assertEqual(code, INIT_ERROR_EXIT, out)
        self.expect_init_errors(out, (1,), r"UNAVAILABLE: store at 127\.0\.0\.1:\d+ unreachable")
        self.assertLess(took, 15, out)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: multiprocess_test.py <shardline-launch> <collectives_mp>")
    LAUNCH, PROGRAM = sys.argv[1], sys.argv[2]
    unittest.main(argv=[sys.argv[0]] + sys.argv[3:], verbosity=2)
