#!/usr/bin/env python3
"""Checkpoints killed at every step of a save, by a real SIGKILL (ctest label `multiprocess`).

    checkpoint_kill_test.py <shardline-launch> <checkpoint_kill_mp>

1. A 2-rank job saves version 1 into `previous`.
2. For Save and for SaveAsync (whose files are written by a background thread), a 2-rank job saves
   with a RecordingFileSystem and reports how many file operations each rank performs; then, for
   every rank r and every operation index k of that rank, a 2-rank job saves version 2 with
   SHARDLINE_CHECKPOINT_KILL_AT=r:k: rank r raises SIGKILL right before its k-th operation, the
   launcher reports it and ends the job. On disk: the target exists only when rank 0 was killed
   before its last operation (the parent's fsync, after the rename); a temporary directory exists
   unless rank 0 was killed before creating it.
3. One fresh 2-rank job loads `previous` (every element of every state bit-identical to version
   1) and every directory the killed saves left: each is reported incomplete (FailedPrecondition,
   by the manifest reader and by a load on every rank) or is complete and loads version 2 bit for
   bit; the complete ones are exactly the targets expected above.

Every job runs in its own session and is killed (its process group) if it overruns; the ranks die
with their launcher. Two jobs run at a time; the whole test takes well under a minute.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

LAUNCH = PROGRAM = None
JOB_TIMEOUT_S = 40
TOTAL_BUDGET_S = 150
PARALLEL = 2


class Job:
    def __init__(self, args, kill_at=None):
        env = dict(os.environ, SHARDLINE_UCX_SPIN_US="0", SHARDLINE_TIMEOUT_S="20")
        env.pop("SHARDLINE_CHECKPOINT_KILL_AT", None)
        if kill_at is not None:
            env["SHARDLINE_CHECKPOINT_KILL_AT"] = kill_at
        self.args = args
        self.kill_at = kill_at
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self.proc = subprocess.Popen(
            [sys.executable, LAUNCH, "-n", "2", "--grace", "0.5", "--", PROGRAM, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.output = None

    def finish(self):
        """Waits (bounded) and returns (exit code, output); kills the job's group on overrun."""
        try:
            out, _ = self.proc.communicate(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            out, _ = self.proc.communicate()
            raise AssertionError(f"job {self.args} (kill at {self.kill_at}) overran "
                                 f"{JOB_TIMEOUT_S} s:\n{out.decode(errors='replace')}")
        self.output = out.decode(errors="replace")
        return self.proc.returncode, self.output


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(args, kill_at=None):
    return Job(args, kill_at).finish()


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


def main():
    global LAUNCH, PROGRAM
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    LAUNCH, PROGRAM = sys.argv[1], sys.argv[2]
    started = time.monotonic()
    root = tempfile.mkdtemp(prefix="shardline_ckpt_kill_")
    live = []
    try:
        previous = os.path.join(root, "previous")
        rc, out = run(["save", previous, "1", "sync"])
        expect(rc == 0, f"saving the previous checkpoint failed ({rc}):\n{out}")

        cases = []  # (mode, rank, op, target, is the last operation of rank 0)
        counted = []
        for mode in ("sync", "async"):
            target = os.path.join(root, f"count_{mode}")
            rc, out = run(["save", target, "2", mode, "count"])
            expect(rc == 0, f"the counting save ({mode}) failed ({rc}):\n{out}")
            ops = {int(r): int(n) for r, n in re.findall(r"SAVED rank (\d) operations (\d+)", out)}
            expect(sorted(ops) == [0, 1] and min(ops.values()) > 3, f"operation counts: {out}")
            counted.append(target)
            print(f"{mode}: {ops[0]} file operations on rank 0, {ops[1]} on rank 1", flush=True)
            for rank in (0, 1):
                for op in range(ops[rank]):
                    cases.append((mode, rank, op, os.path.join(root, f"{mode}_r{rank}_op{op}"),
                                  rank == 0 and op == ops[0] - 1))

        # The kills, PARALLEL jobs at a time.
        pending = list(cases)
        while pending or live:
            while pending and len(live) < PARALLEL:
                case = pending.pop(0)
                mode, rank, op, target, _ = case
                live.append((case, Job(["save", target, "2", mode], kill_at=f"{rank}:{op}")))
            case, job = live.pop(0)
            mode, rank, op, target, last = case
            rc, out = job.finish()
            what = f"{mode} save, rank {rank} killed before operation {op}"
            expect(rc != 0, f"{what}: the job succeeded:\n{out}")
            expect(f"SIGKILL before file operation {op} " in out, f"{what}: no kill:\n{out}")
            expect(f"rank {rank} (pid" in out and "signal 9" in out,
                   f"{what}: the launcher did not report rank {rank} killed:\n{out}")
            expect(os.path.exists(target) == last,
                   f"{what}: target {'missing' if last else 'exists'}")
            temporaries = [e for e in os.listdir(root)
                           if e.startswith(os.path.basename(target) + ".tmp-")]
            expect(len(temporaries) == (0 if last or (rank == 0 and op == 0) else 1),
                   f"{what}: temporary directories {temporaries}")
            expect(time.monotonic() - started < TOTAL_BUDGET_S, "over the time budget")

        # A fresh job checks everything that was left.
        left = sorted(os.path.join(root, e) for e in os.listdir(root)
                      if e != "previous")
        rc, out = run(["check", previous, "1", "2", *left])
        expect(rc == 0, f"the check job failed ({rc}):\n{out}")
        complete = set(re.findall(r"^COMPLETE (\S+)$", out, re.M))
        incomplete = set(re.findall(r"^INCOMPLETE (\S+)$", out, re.M))
        expect(complete | incomplete == set(left) and not (complete & incomplete),
               f"not every directory was classified:\n{out}")
        want_complete = {c[3] for c in cases if c[4]} | set(counted)
        expect(complete == want_complete, f"complete: {sorted(complete)}, "
                                          f"expected {sorted(want_complete)}")
        expect(all(".tmp-" in d for d in incomplete), f"incomplete: {sorted(incomplete)}")
        print(f"{len(cases)} kills; {len(incomplete)} incomplete and {len(complete)} complete "
              f"checkpoints checked; previous loads bit-identically; "
              f"{time.monotonic() - started:.1f} s", flush=True)
        return 0
    finally:
        for _, job in live:
            kill_group(job.proc)
            job.proc.communicate()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)
