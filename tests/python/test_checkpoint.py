"""shardline.Checkpointer from Python (numpy): a job of 4 processes saves three units' master
shards and three states per unit (f32, i64, f64) with values from seeded numpy generators; jobs
of 1, 2 and 3 processes (full shard) and of 4 (hybrid 2 x 2) load it and compare every element of
every shard with the same generators (tests/python/workers/checkpoint_worker.py); the ranks'
checked elements must cover every tensor (once per replica). A job of 2 checks the exceptions;
in one process (init_local(1)) the argument errors and that the Checkpointer keeps its arrays.
"""
import gc
import json
import weakref

import numpy as np
import pytest

import shardline

from checkpoint_worker import STATES, UNITS

NUMEL = {f"{u}/{s}/{t}": int(np.prod(shape, dtype=np.int64))
         for u, tensors in UNITS for s in ["master"] + [n for n, _, _ in STATES]
         for t, shape in tensors}


def run(launch, out, nprocs, ckpt, mode, *args):
    out.mkdir(exist_ok=True)
    result = launch(nprocs, ["checkpoint_worker.py", out, ckpt, mode, *args], timeout=120)
    assert result.returncode == 0, result.describe()
    assert "leaked" not in result.output, result.describe()  # nanobind's exit check
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]
    assert [r["rank"] for r in ranks] == list(range(nprocs))
    return ranks


def coverage(ranks):
    total = {}
    for r in ranks:
        for key, n in r["checked"].items():
            total[key] = total.get(key, 0) + n
    return total


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(launch, base, checkpoint dir) of the world-4 save."""
    return tmp_path_factory.mktemp("ckpt")


def save_once(launch, base):
    ckpt = base / "step3"
    if not ckpt.exists():
        ranks = run(launch, base / "save", 4, ckpt, "save")
        assert coverage(ranks) == NUMEL
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "manifest.json"] + [f"shard-0000{s}-of-00004.bin" for s in range(4)]
    return ckpt


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_save_at_four_load_at(launch, saved, nprocs):
    ckpt = save_once(launch, saved)
    ranks = run(launch, saved / f"load{nprocs}", nprocs, ckpt, "load")
    assert coverage(ranks) == NUMEL


def test_save_at_four_load_hybrid_2x2(launch, saved):
    ckpt = save_once(launch, saved)
    ranks = run(launch, saved / "hybrid", 4, ckpt, "load", "--shard-size", "2")
    assert coverage(ranks) == {k: 2 * n for k, n in NUMEL.items()}


def test_errors(launch, saved):
    ckpt = save_once(launch, saved)
    ranks = run(launch, saved / "errors", 2, ckpt, "errors")
    assert coverage(ranks) == NUMEL


def test_in_process_round_trip_keeps_arrays(tmp_path):
    world = shardline.init_local(1)[0]
    sched = shardline.Scheduler(world)
    unit = sched.register_unit("u", [("w", (7, 3)), ("b", (5,))])
    rng = np.random.default_rng(5)
    w, b = rng.standard_normal((7, 3)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    sched.set_values(unit, [w, b])
    n = sched.unit(unit).shard_elements
    ckpt = shardline.Checkpointer(sched)
    state = np.arange(n, dtype=np.float64) * 0.5
    ckpt.add_state(unit, "m", state)
    ref = weakref.ref(state)
    del state
    gc.collect()
    assert ref() is not None  # the Checkpointer holds it
    ckpt.save(tmp_path / "a")  # os.PathLike
    with pytest.raises(shardline.AlreadyExistsError, match="exists"):
        ckpt.save(str(tmp_path / "a"))
    ref()[:] = -1
    sched.master_shard(unit)[:] = 0
    ckpt.load(tmp_path / "a")
    # The saved elements back; the padding (between and after the tensors) zero.
    want_state, want_master = np.zeros(n), np.zeros(n, np.float32)
    full = {"w": w.reshape(-1), "b": b}
    for tensor, tensor_offset, shard_offset, length in sched.shard_slices(unit):
        want_state[shard_offset:shard_offset + length] = \
            np.arange(shard_offset, shard_offset + length) * 0.5
        want_master[shard_offset:shard_offset + length] = \
            full[tensor][tensor_offset:tensor_offset + length]
    assert np.count_nonzero(want_state == 0) > 1  # there is padding
    assert np.array_equal(ref(), want_state)
    assert np.array_equal(sched.master_shard(unit), want_master)
    assert ckpt.states == [(0, "m", "f64")]
    with pytest.raises(TypeError, match="shardline.Unit"):
        ckpt.add_state("u", "x", np.zeros(n, np.float32))
    with pytest.raises(shardline.InvalidArgumentError, match="not C-contiguous"):
        ckpt.add_state(unit, "x", np.zeros(2 * n, np.float32)[::2])
    with pytest.raises(shardline.InvalidArgumentError, match="'bad name!'"):
        ckpt.add_state(unit, "bad name!", np.zeros(n, np.float32))
    with pytest.raises(shardline.FailedPreconditionError, match="incomplete"):
        (tmp_path / "b.tmp-0123456789abcdef").mkdir()
        ckpt.load(tmp_path / "b.tmp-0123456789abcdef")
    del ckpt
    gc.collect()
    assert ref() is None  # released with the Checkpointer
