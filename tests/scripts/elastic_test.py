#!/usr/bin/env python3
"""Elastic hybrid sharding with real processes and real SIGKILLs (ctest `elastic_kill`, label
`multiprocess`).

    elastic_test.py <shardline-store> <elastic_mp> [--trials N] [--first-seed S]
                    [--launch <shardline-launch>]

Each trial starts a store in a process of its own (shardline-store) and 4 ranks of
tests/scheduler/multiprocess/elastic_mp.cc: 2 replica groups x 2 shard ranks, 12 steps. A seeded
rank SIGKILLs itself at a seeded step, in the forward, the backward, with the reductions in flight,
or after the commit before its optimizer step. Then:
  * its partner in the replica group is left out of the next quorum (exit 3);
  * the other replica's ranks redo the step alone and finish training; their parameters equal a
    plain-loop reference that averages, at every step, the gradients of the replicas that took part
    (the dead replica's contribution dropped from the step it died in);
  * in odd trials the dead replica group is restarted (incarnation 1): it joins at a step boundary,
    receives the master shards and momenta, and ends with state bit-identical (CRC-32C) to the
    survivor of the same shard index, the reference then dropping the dead replica only until it
    rejoined;
  * the survivors detect and recover within SHARDLINE_TIMEOUT_S + 5 s (the recovery they print;
    a rank that dies after the commit usually costs no redo at all).
Then a whole-job failure (a rank of each replica dies: the survivors end with an error, exit 3 or
4, within the timeout + 5 s), and with --launch one trial through
shardline-launch --max-restarts 1, which hosts the store and restarts the dead group (and whose
survivors' Chrome trace and flight records show the recovery).
Every process runs in its own session and is killed if the trial overruns.
"""

import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STORE = PROGRAM = None
STEPS = 20
TIMEOUT_S = 10
TRIAL_BUDGET_S = 90
PHASES = ("forward", "backward", "reduce", "optimizer")


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Trial:
    def __init__(self, seed):
        rng = random.Random(seed)
        self.seed = seed
        self.victim = (rng.randrange(2), rng.randrange(2))
        self.kill_step = rng.randrange(1, STEPS - 4)  # the survivors await joiners 2 steps on
        self.phase = rng.choice(PHASES)
        self.rejoin = seed % 2 == 1
        self.survivor_replica = 1 - self.victim[0]
        self.procs = {}
        self.outputs = {}
        self.store = None

    def describe(self):
        return (f"seed {self.seed}: rank {self.victim} dies at step {self.kill_step} "
                f"({self.phase}){', then its replica rejoins' if self.rejoin else ''}")

    def start_rank(self, replica, shard, incarnation, extra):
        args = [PROGRAM, "--replicas", "2", "--shard-size", "2", "--replica", str(replica),
                "--shard", str(shard), "--incarnation", str(incarnation), "--steps", str(STEPS),
                *extra]
        self.procs[(replica, shard, incarnation)] = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True)

    def wait(self, key, deadline):
        proc = self.procs[key]
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, _ = proc.communicate()
            self.outputs[key] = out.decode(errors="replace")
            raise AssertionError(f"{self.describe()}: rank {key} overran the trial:\n"
                                 f"{self.outputs[key]}")
        self.outputs[key] = out.decode(errors="replace")
        return proc.returncode

    def run(self):
        deadline = time.monotonic() + TRIAL_BUDGET_S
        self.store = subprocess.Popen([STORE, "--host", "127.0.0.1", "--port", "0"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      start_new_session=True)
        line = self.store.stdout.readline().decode()
        match = re.search(r"listening on [^:]+:(\d+)", line)
        assert match, f"shardline-store said {line!r}"
        self.env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=match.group(1),
                        SHARDLINE_STORE_TOKEN=secrets.token_hex(8),
                        SHARDLINE_TIMEOUT_S=str(TIMEOUT_S), SHARDLINE_UCX_SPIN_US="0")
        for replica in range(2):
            for shard in range(2):
                extra = []
                if (replica, shard) == self.victim:
                    extra = ["--kill", f"{self.kill_step}:{self.phase}"]
                elif replica == self.survivor_replica and self.rejoin:
                    extra = ["--await-joiners-at", str(self.kill_step + 2)]
                self.start_rank(replica, shard, 0, extra)
        dead = self.victim[0]
        partner = (dead, 1 - self.victim[1])
        codes = {}
        codes[self.victim] = self.wait((*self.victim, 0), deadline)
        codes[partner] = self.wait((*partner, 0), deadline)
        if self.rejoin:
            for shard in range(2):
                self.start_rank(dead, shard, 1, [])
        for shard in range(2):
            codes[(self.survivor_replica, shard)] = self.wait((self.survivor_replica, shard, 0),
                                                              deadline)
        if self.rejoin:
            for shard in range(2):
                codes[(dead, shard, 1)] = self.wait((dead, shard, 1), deadline)
        return self.check(codes, partner)

    def check(self, codes, partner):
        what = self.describe()
        everything = "\n".join(f"--- rank {k}:\n{v}" for k, v in sorted(self.outputs.items()))
        assert codes[self.victim] == -signal.SIGKILL, f"{what}: the victim exited {codes}\n{everything}"
        assert codes[partner] == 3, f"{what}: its partner exited {codes[partner]}\n{everything}"
        recoveries = []
        digests = {}
        for shard in range(2):
            key = (self.survivor_replica, shard, 0)
            out = self.outputs[key]
            assert codes[key[:2]] == 0 and "CHECK ok" in out, f"{what}: survivor {key}:\n{everything}"
            steps = {int(k): v for k, v in re.findall(r"^STEP (\d+) replicas (\S+) ", out, re.M)}
            assert sorted(steps) == list(range(STEPS)), f"{what}: {key} trained {sorted(steps)}"
            both = "0,1"
            alone = str(self.survivor_replica)
            lost_from = self.kill_step + (1 if self.phase == "optimizer" else 0)
            for step, replicas in steps.items():
                if step < lost_from:
                    assert replicas == both, f"{what}: step {step} had replicas {replicas}"
                elif step == lost_from:
                    # The redo runs without the dead replica, unless its restart was quick enough
                    # to join the redo itself.
                    assert replicas == alone or (self.rejoin and replicas == both), \
                        f"{what}: step {step} had replicas {replicas}"
                elif not self.rejoin:
                    assert replicas == alone, f"{what}: step {step} had replicas {replicas}"
            if self.rejoin:
                rejoined = [s for s, r in steps.items() if r == both and s >= lost_from]
                assert rejoined, f"{what}: replica {self.victim[0]} never trained again: {steps}\n{everything}"
            found = re.findall(r"^RECOVERY round \d+ step (\d+) detect_ms ([\d.]+) resume_ms "
                               r"([\d.]+)", out, re.M)
            # A rank that dies after the commit costs no redo when its loss is known before the
            # next quorum (the usual case): then there is no recovery to report.
            assert found or self.phase == "optimizer", f"{what}: {key} printed no recovery:\n{out}"
            for step, detect, resume in found:
                assert float(detect) + float(resume) < (TIMEOUT_S + 5) * 1000, \
                    f"{what}: recovery took {detect} + {resume} ms"
                recoveries.append((float(detect), float(resume)))
            digests[shard] = re.search(r"^DIGEST replica \d shard \d (\w+)$", out, re.M).group(1)
        # From the kill to the survivors' next committed step.
        killed = int(re.search(r"^KILLING .* at_ms (\d+)$", self.outputs[(*self.victim, 0)],
                               re.M).group(1))
        commits = [int(t) for key in ((self.survivor_replica, 0, 0), (self.survivor_replica, 1, 0))
                   for t in re.findall(r"^STEP \d+ replicas \S+ at_ms (\d+)$", self.outputs[key],
                                       re.M)]
        self.kill_to_commit_ms = min(t for t in commits if t > killed) - killed
        self.rejoin_ms = None
        if self.rejoin:
            joined = []
            for shard in range(2):
                out = self.outputs[(self.victim[0], shard, 1)]
                start = int(re.search(r"^START at_ms (\d+)$", out, re.M).group(1))
                first = re.search(r"^STEP \d+ replicas \S+ at_ms (\d+)$", out, re.M)
                assert first, f"{what}: the rejoined rank never committed a step:\n{out}"
                joined.append(int(first.group(1)) - start)
            self.rejoin_ms = max(joined)
        if self.rejoin:
            for shard in range(2):
                key = (self.victim[0], shard, 1)
                out = self.outputs[key]
                assert codes[key] == 0 and "CHECK joined" in out, f"{what}: rejoined {key}:\n{out}"
                digest = re.search(r"^DIGEST replica \d shard \d (\w+)$", out, re.M).group(1)
                assert digest == digests[shard], \
                    f"{what}: rejoined shard {shard} ends with {digest}, survivor {digests[shard]}"
        return recoveries

    def cleanup(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()
        if self.store is not None:
            self.store.stdin.close()
            try:
                self.store.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_group(self.store)
                self.store.wait()


def whole_job_failure():
    """One rank of each replica dies in the same step: no replica holds the state any more, and
    the two survivors end with an error (exit 3: their group is out, or 4: no replica holds the
    state) within the timeout + 5 s instead of hanging."""
    trial = Trial(0)
    try:
        t0 = time.monotonic()
        trial.store = subprocess.Popen([STORE, "--host", "127.0.0.1", "--port", "0"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       start_new_session=True)
        port = re.search(r":(\d+)$", trial.store.stdout.readline().decode().strip()).group(1)
        trial.env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                         SHARDLINE_STORE_TOKEN=secrets.token_hex(8),
                         SHARDLINE_TIMEOUT_S=str(TIMEOUT_S), SHARDLINE_UCX_SPIN_US="0")
        victims = {(0, 0), (1, 1)}
        for replica in range(2):
            for shard in range(2):
                extra = ["--kill", "3:backward"] if (replica, shard) in victims else []
                trial.start_rank(replica, shard, 0, extra)
        deadline = time.monotonic() + TRIAL_BUDGET_S
        codes = {key[:2]: trial.wait(key, deadline) for key in list(trial.procs)}
        took = time.monotonic() - t0
        everything = "\n".join(f"--- rank {k}:\n{v}" for k, v in sorted(trial.outputs.items()))
        for key, code in codes.items():
            # A survivor learns first either that its own group is out (3) or that no replica
            # holds the state any more (4): both end it cleanly.
            want = {-signal.SIGKILL} if key in victims else {3, 4}
            assert code in want, f"whole-job failure: rank {key} exited {code}\n{everything}"
            assert "CHECK" not in trial.outputs[(*key, 0)], everything
        assert took < TIMEOUT_S + 5, f"whole-job failure took {took:.1f} s"
        print(f"ok whole-job failure: both survivors report it ({took:.1f} s)", flush=True)
    finally:
        trial.cleanup()


def through_launcher(launch):
    """shardline-launch --max-restarts 1 hosts the store, restarts the replica group of a rank
    that dies, and the job succeeds with the restarted group's state bit-identical."""
    work = tempfile.mkdtemp(prefix="elastic_test.")
    traces, flights = os.path.join(work, "traces"), os.path.join(work, "flight")
    os.makedirs(traces)
    os.makedirs(flights)
    env = dict(os.environ, SHARDLINE_TIMEOUT_S=str(TIMEOUT_S), SHARDLINE_UCX_SPIN_US="0",
               SHARDLINE_FLIGHT_RECORDER_DIR=flights)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, launch, "-n", "4", "--max-restarts", "1", "--shard-size", "2",
         "--grace", "5", "--", PROGRAM, "--steps", str(STEPS), "--kill", "3:backward",
         "--kill-rank", "1", "--await-joiners-at", "5", "--trace", traces],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TRIAL_BUDGET_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"the launcher trial overran:\n{out.decode(errors='replace')}")
    out = out.decode(errors="replace")
    assert proc.returncode == 0, f"launcher exited {proc.returncode}:\n{out}"
    # What a restart costs before it loads anything: the job's start to its first committed step
    # (the launcher's output interleaves the ranks; each rank's first STEP follows its START).
    starts = [int(t) for t in re.findall(r"^START at_ms (\d+)$", out, re.M)]
    firsts = sorted(int(t) for t in re.findall(r"^STEP 0 replicas \S+ at_ms (\d+)$", out, re.M))
    fresh = [f - min(starts) for f in firsts[:4]]
    assert "restarting replica group 0" in out, out
    assert out.count("CHECK ok") == 2 and out.count("CHECK joined") == 2, out
    digests = re.findall(r"^DIGEST replica (\d) shard (\d) (\w+)$", out, re.M)
    by_shard = {}
    for _, shard, digest in digests:
        by_shard.setdefault(shard, set()).add(digest)
    assert len(digests) == 4 and all(len(d) == 1 for d in by_shard.values()), out
    # The recovery on a survivor's trace, and in the flight records of the aborted round.
    with open(os.path.join(traces, "elastic.2.0.json")) as f:
        trace = f.read()
    assert '"name":"recovery"' in trace and "was lost" in trace, trace[:2000]
    dumps = ""
    for name in os.listdir(flights):
        with open(os.path.join(flights, name)) as f:
            dumps += f.read()
    # The aborted round's communicators (elastic/q0/...) were dumped with why they ended: the dead
    # rank's exit, or the round's abort (communicators that nothing had failed yet).
    assert "elastic/q0/" in dumps and re.search(r"exited|elastic round \d+ aborted", dumps), \
        f"flight dumps: {os.listdir(flights)}"
    shutil.rmtree(work)
    print(f"ok launcher: a replica group restarted and rejoined "
          f"({time.monotonic() - t0:.1f} s)", flush=True)
    return fresh


def main(argv):
    global STORE, PROGRAM
    STORE, PROGRAM = argv[1], argv[2]
    trials = int(argv[argv.index("--trials") + 1]) if "--trials" in argv else 20
    first = int(argv[argv.index("--first-seed") + 1]) if "--first-seed" in argv else 1
    start = time.monotonic()
    detect, resume, kill_to_commit, rejoin = [], [], [], []
    for seed in range(first, first + trials):
        trial = Trial(seed)
        t0 = time.monotonic()
        try:
            for d, r in trial.run():
                detect.append(d)
                resume.append(r)
            kill_to_commit.append(trial.kill_to_commit_ms)
            if trial.rejoin_ms is not None:
                rejoin.append(trial.rejoin_ms)
        finally:
            trial.cleanup()
        print(f"ok {trial.describe()} ({time.monotonic() - t0:.1f} s)", flush=True)
    whole_job_failure()
    fresh = None
    if "--launch" in argv:
        fresh = through_launcher(argv[argv.index("--launch") + 1])
    def median(values):
        values = sorted(values)
        return f"median {values[len(values) // 2]:.0f} ms (max {values[-1]:.0f})" if values else "-"
    print(f"{trials} trials in {time.monotonic() - start:.1f} s; survivors' recovery: detect "
          f"{median(detect)}, resume {median(resume)}; kill to the next committed step "
          f"{median(kill_to_commit)}; a restarted group's start to its first committed step "
          f"{median(rejoin)}" + (f"; a fresh job's start to its first committed step "
                                 f"{median(fresh)}" if fresh else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
