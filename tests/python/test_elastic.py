"""shardline.torch.elastic: fully_shard over replica groups that survive a SIGKILLed rank, with
real processes (workers/elastic_worker.py under `python -m shardline.launch --max-restarts M
--shard-size 2`: 2 replica groups x 2 shard ranks, on the CPU).

  * test_killed_rank_survivors_finish: rank 1 (replica 0) SIGKILLs itself in the backward of
    step 3, with reductions in flight, or after every collective of step 3 succeeded, just
    before its optimizer.step() votes (the others vote ok; their optimizers must not step).
    Replica 1 redoes step 3 alone and trains to the end; its parameters (and the full state
    dict, and each step's gradient norm) equal a plain unsharded loop that drops replica 0's
    gradients from step 3 on (the worker checks every element it owns; the test checks which
    replicas each step had).
  * test_restarted_group_rejoins: the same kill with --max-restarts 1; the launcher restarts
    replica group 0, which joins at a round boundary, receives the master shards and the SGD
    momenta, and trains the last steps with replica 1: it ends bit-identical (digest) to the
    survivor of its shard index, whose reference has replica 0 back from the step it joined.

Both need shardline-store (the store the launcher hosts outside the ranks) on PATH or in
$SHARDLINE_BIN_DIR (default build/bin).
"""
import os
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import shardline  # noqa: E402
import shardline.torch as slt  # noqa: E402
from harness import run_bounded  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = os.environ.get("SHARDLINE_BIN_DIR", str(ROOT / "build" / "bin"))
STORE = os.path.join(BIN, "shardline-store")
STEPS, KILL_RANK, KILL_STEP = 9, 1, 3
TIMEOUT_S = 10  # SHARDLINE_TIMEOUT_S of the ranks: the bound on every wait of theirs


def store_path():
    if os.path.exists(STORE):
        return BIN
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and os.path.exists(os.path.join(d, "shardline-store")):
            return None
    pytest.skip(f"{STORE} is not built (scripts/build.sh build, or set SHARDLINE_BIN_DIR)")


def launch(tmp_path, max_restarts, extra):
    bin_dir = store_path()
    env = dict(os.environ, SHARDLINE_TIMEOUT_S=str(TIMEOUT_S))
    if bin_dir is not None:
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    command = [sys.executable, "-m", "shardline.launch", "-n", "4", "--max-restarts",
               str(max_restarts), "--shard-size", "2", "--tag-output", "--grace", "20", "--",
               sys.executable, str(HERE / "workers" / "elastic_worker.py"), str(tmp_path),
               "--steps", str(STEPS), "--kill-rank", str(KILL_RANK), "--kill-step",
               str(KILL_STEP), *extra]
    # About 15 s on an idle machine (torch's import at each start); a rank's waits end within
    # TIMEOUT_S, so a hang shows as the overrun.
    return run_bounded(command, timeout=240, env=env)


def rank_lines(result):
    """rank -> its stdout lines, the launcher's tag removed."""
    out = {}
    for line in result.output.splitlines():
        m = re.match(r"^\[(\d+)\]<stdout>: (.*)$", line)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


def steps_of(lines):
    """step -> (replicas, redo) of every committed step a rank printed, each printed once."""
    steps = {}
    for line in lines:
        m = re.match(r"^STEP (\d+) replicas (\S+)( redo)?$", line)
        if m:
            step = int(m.group(1))
            assert step not in steps, f"step {step} committed twice:\n{lines}"
            steps[step] = (m.group(2), bool(m.group(3)))
    return steps


def check_survivors(result, lines):
    what = result.describe()
    assert any(line.startswith("KILLING (0, 1) at step 3") for line in lines.get(1, [])), what
    for rank in (2, 3):
        out = lines.get(rank, [])
        assert any(line.startswith("CHECK ok") for line in out), f"rank {rank}:\n{what}"
        steps = steps_of(out)
        assert sorted(steps) == list(range(STEPS)), f"rank {rank} committed {sorted(steps)}"
        for step in range(KILL_STEP):
            assert steps[step] == ("0,1", False), f"rank {rank} step {step}: {steps[step]}"
        # The step the rank died in was redone by replica 1 alone.
        assert steps[KILL_STEP] == ("1", True), f"rank {rank}: {steps[KILL_STEP]}\n{what}"
        recoveries = [line for line in out if line.startswith("RECOVERY")]
        assert recoveries and recoveries[0].startswith(f"RECOVERY step {KILL_STEP} "), what
        # Detected and resumed within the bound of every wait, not at the end of some timeout.
        m = re.match(r"RECOVERY step \d+ detect_ms ([\d.]+) resume_ms ([\d.]+)", recoveries[0])
        assert m and float(m.group(1)) + float(m.group(2)) < (TIMEOUT_S + 5) * 1e3, recoveries
    return {rank: steps_of(lines[rank]) for rank in (2, 3)}


@pytest.mark.parametrize("phase", ["backward", "before-vote"])
def test_killed_rank_survivors_finish(tmp_path, phase):
    result = launch(tmp_path, 0, ["--kill-phase", phase])
    lines = rank_lines(result)
    steps = check_survivors(result, lines)
    for rank in (2, 3):
        assert all(steps[rank][s][0] == "1" for s in range(KILL_STEP, STEPS)), steps[rank]
    # Rank 0 lost its partner: left out of the next round (exit 3), unless the launcher ended
    # it first; either way it never committed a step past the failure.
    assert not any(s >= KILL_STEP for s in steps_of(lines.get(0, []))), result.describe()
    # The launcher reports the replica group it did not restart.
    assert result.returncode != 0, result.describe()


def test_restarted_group_rejoins(tmp_path):
    join_at = KILL_STEP + 2
    result = launch(tmp_path, 1, ["--await-joiners-at", str(join_at)])
    what = result.describe()
    assert result.returncode == 0, what
    lines = rank_lines(result)
    steps = check_survivors(result, lines)
    for rank in (2, 3):
        # Alone from the failure until the restarted group joined, then both again.
        assert steps[rank][join_at - 1][0] == "1", steps[rank]
        assert steps[rank][STEPS - 1][0] == "0,1", f"replica 0 never rejoined: {steps[rank]}"
    digests = {}
    for line in result.output.splitlines():
        m = re.search(r"DIGEST replica (\d) shard (\d) (\w+)", line)
        if m:
            digests[(int(m.group(1)), int(m.group(2)))] = m.group(3)
    for shard in (0, 1):
        # The joiner received the master shards and momenta and trained in step since.
        assert digests.get((0, shard)) == digests.get((1, shard)) is not None, (digests, what)
    assert sum(line == "CHECK joined" for rank in (0, 1) for line in lines.get(rank, [])) == 2


def test_step_rejects_bad_arguments():
    e = slt.Elastic(group=None)  # validation happens before any round
    with pytest.raises(TypeError, match="fully_shard'ed module"):
        e.step(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="callable"):
        e.step_committed(3)


def test_watched_optimizer_steps_outside_elastic_steps():
    """The vote gate on optimizer.step() only acts inside an elastic step, and stays a bound
    method that torch's LR schedulers can wrap in turn."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    e = slt.Elastic(group=None)
    e._watch(opt)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    before = model.weight.detach().clone()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    schedule.step()
    assert torch.allclose(model.weight, before - 0.5 * model.weight.grad)
    assert opt.param_groups[0]["lr"] == 0.25
    with pytest.raises(ValueError, match="another Elastic"):
        slt.Elastic(group=None)._watch(opt)


def test_group_needs_a_launcher_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("SHARDLINE_SHARD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(shardline.InvalidArgumentError, match="SHARDLINE_SHARD_SIZE"):
        shardline.ElasticGroup(timeout=5)


def test_scheduler_over_groups_rejects_bad_input():
    (comm,) = shardline.init_local(1)
    with pytest.raises(ValueError, match="hybrid_shard"):
        shardline.Scheduler(comm, replicate=comm)  # strategy full_shard
    with pytest.raises(TypeError, match="replicate"):
        shardline.Scheduler(comm, strategy="hybrid_shard", replicate=3)
