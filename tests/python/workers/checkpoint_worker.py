"""One rank of test_checkpoint.py's jobs under shardline.launch: shardline.Checkpointer on numpy.

    checkpoint_worker.py OUT_DIR CKPT_DIR save|load|errors [--shard-size S]

Every job registers the same three units of odd-sized tensors and three states per unit (an f32
moment, an i64 counter, an f64 accumulator). `save` gives the master shards (set_values) and the
states (through shard_slices) values drawn from numpy generators seeded by (unit, tensor, kind)
and saves them to CKPT_DIR. `load` (any world size; hybrid with --shard-size) starts from other
values and garbage, loads CKPT_DIR, and compares every element of every shard with the same
generators' values (padding: zero). Two replicated states (an i64 step, a 3 x 5 f64 table: rank
0's values from a generator, the other ranks' garbage) come back as rank 0's on every rank.
`save` also saves CKPT_DIR-async with save_async and overwrites every shard, state and replicated
state right after the call (the next step), and exports CKPT_DIR.safetensors (as saved) and
CKPT_DIR-bf16.safetensors; `load` loads CKPT_DIR-async too, and imports CKPT_DIR-plain.safetensors
(written by the test with safetensors.numpy) into the master shards, checking every element.
`errors` checks the exceptions and sync_module_states. Each rank writes
OUT_DIR/rank<r>.json: per (unit, state, tensor) the elements it checked, so the test can see
that the ranks covered every tensor.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

import shardline

UNITS = [
    ("embed", [("w", (13, 7)), ("b", (5,))]),
    ("block", [("q", (11, 3)), ("scale", ()), ("k", (3, 17))]),
    ("head", [("x", (29,))]),
]
STATES = [("adam.m", np.float32, 1), ("count", np.int64, 2), ("acc", np.float64, 3)]


def values(u, t, kind, dtype, shape):
    """The saved values of tensor t of unit u: the master (kind 0) or a state (kind 1, 2, 3)."""
    rng = np.random.default_rng([u, t, kind, 2026])
    n = int(np.prod(shape, dtype=np.int64))
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-2**62, 2**62, n, dtype=np.int64).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def setup(world, shard_size):
    strategy = "hybrid_shard" if shard_size else "full_shard"
    sched = shardline.Scheduler(world, strategy=strategy, shard_size=shard_size)
    units = [sched.register_unit(name, tensors) for name, tensors in UNITS]
    return sched, units


def add_states(ckpt, sched, units, fill):
    """Registers the states (zeros, or `fill`ed with garbage); returns {(u, state): array}."""
    arrays = {}
    for u, unit in enumerate(units):
        n = sched.unit(unit).shard_elements
        for name, dtype, _ in STATES:
            a = np.zeros(n, dtype)
            if fill:
                a[:] = -3
            ckpt.add_state(sched.unit(unit), name, a)
            arrays[(u, name)] = a
    return arrays


def replicated(rank):
    """The replicated states' saved values (rank 0's) and this rank's values (garbage unless 0)."""
    rng = np.random.default_rng([77, 2026])
    step, table = np.array(rng.integers(1, 2**40), np.int64), rng.standard_normal((3, 5))
    if rank == 0:
        return (step, table), (step.copy(), table.copy())
    return (step, table), (np.array(-rank, np.int64), np.full((3, 5), -1.0 * rank))


def add_replicated(ckpt, mine):
    step, table = mine
    ckpt.add_replicated_state("step", step)
    ckpt.add_replicated_state("table", table)
    assert ckpt.replicated_states == [("step", [], "i64"), ("table", [3, 5], "f64")]


def check_replicated(want, got):
    for name, w, g in zip(["step", "table"], want, got):
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), (name, g, w)


def scribble(sched, units, arrays, mine):
    for unit in units:
        sched.master_shard(unit)[:] = 5
    for a in list(arrays.values()) + list(mine):
        a[...] = -9


def barrier(world):
    out = np.zeros(world.size, np.float32)
    world.all_gather(out, np.ones(1, np.float32)).wait()


def save(world, ckpt_dir, shard_size):
    sched, units = setup(world, shard_size)
    for u, (name, tensors) in enumerate(UNITS):
        sched.set_values(units[u], [values(u, t, 0, np.float32, shape).reshape(shape)
                                    for t, (_, shape) in enumerate(tensors)])
    ckpt = shardline.Checkpointer(sched, checksum_block_bytes=40, read_chunk_bytes=120)
    arrays = add_states(ckpt, sched, units, fill=False)
    saved, mine = replicated(world.rank)
    add_replicated(ckpt, mine)
    for u, (_, tensors) in enumerate(UNITS):
        index = {n: t for t, (n, _) in enumerate(tensors)}
        for tensor, tensor_offset, shard_offset, length in sched.shard_slices(units[u]):
            t = index[tensor]
            for name, dtype, kind in STATES:
                full = values(u, t, kind, dtype, tensors[t][1])
                arrays[(u, name)][shard_offset:shard_offset + length] = \
                    full[tensor_offset:tensor_offset + length]
    ckpt.save(ckpt_dir)
    stats = ckpt.last_save_stats
    assert stats["background"] is False and stats["finished"] and stats["snapshot_bytes"] == 0, \
        stats
    assert stats["dir"] == ckpt_dir and stats["blocked"] > 0, stats
    checked = check(sched, units, arrays)
    shardline.export_safetensors(sched, ckpt_dir + ".safetensors")
    shardline.export_safetensors(sched, ckpt_dir + "-bf16.safetensors", dtype="bf16",
                                 writer_rank=world.size - 1, metadata={"step": "3"},
                                 cast_chunk_bytes=6)
    # A background save holds the values at the call: the next step overwrites everything.
    assert not ckpt.save_pending
    ckpt.save_async(ckpt_dir + "-async")
    scribble(sched, units, arrays, mine)
    ckpt.wait(timeout=60)
    assert not ckpt.save_pending
    ckpt.wait()  # nothing pending
    stats = ckpt.last_save_stats
    # This rank's pieces: the tensor elements its shards hold, of the master and every state.
    pieces = sum(length * (4 + sum(np.dtype(d).itemsize for _, d, _ in STATES))
                 for unit in units for _, _, _, length in sched.shard_slices(unit))
    assert stats["background"] is True and stats["finished"], stats
    assert stats["snapshot_bytes"] == pieces <= stats["snapshot_capacity_bytes"], (stats, pieces)
    assert stats["write"] > 0 and 0 <= stats["snapshot"] <= stats["blocked"], stats
    return checked


def check(sched, units, arrays):
    """Every element of the master shards and states against values(); the padding zero.
    Returns {"unit/state/tensor": elements checked}."""
    checked = {}
    for u, (uname, tensors) in enumerate(UNITS):
        index = {n: t for t, (n, _) in enumerate(tensors)}
        master = sched.master_shard(units[u])
        shards = [("master", np.float32, 0, master)] + [
            (name, dtype, kind, arrays[(u, name)]) for name, dtype, kind in STATES]
        covered = np.zeros(master.size, bool)
        for tensor, tensor_offset, shard_offset, length in sched.shard_slices(units[u]):
            t = index[tensor]
            covered[shard_offset:shard_offset + length] = True
            for name, dtype, kind, shard in shards:
                want = values(u, t, kind, dtype, tensors[t][1])[tensor_offset:
                                                                tensor_offset + length]
                got = shard[shard_offset:shard_offset + length]
                assert got.dtype == want.dtype, (uname, name, got.dtype, want.dtype)
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, (
                    f"unit {uname} state {name} tensor {tensor}: {bad.size} of {length} elements "
                    f"differ, first at tensor element {tensor_offset + bad[0]}: "
                    f"{got[bad[0]]!r} != {want[bad[0]]!r}")
                key = f"{uname}/{name}/{tensor}"
                checked[key] = checked.get(key, 0) + length
        for name, _, _, shard in shards:
            padding = shard[~covered]
            assert np.all(padding == 0), f"unit {uname} state {name}: padding {padding}"
    return checked


def load(world, ckpt_dir, shard_size):
    sched, units = setup(world, shard_size)
    for u, (_, tensors) in enumerate(UNITS):
        sched.set_values(units[u], [np.full(shape, 7, np.float32) for _, shape in tensors])
        sched.master_shard(units[u])[:] = 9  # the padding too
    ckpt = shardline.Checkpointer(sched, read_chunk_bytes=64)
    arrays = add_states(ckpt, sched, units, fill=True)
    saved, mine = replicated(world.rank)
    add_replicated(ckpt, mine)
    assert [s[1] for s in ckpt.states] == [n for n, _, _ in STATES] * len(UNITS)
    assert ckpt.states[1][2] == "i64"
    ckpt.load(ckpt_dir)
    check_replicated(saved, mine)
    checked = check(sched, units, arrays)
    scribble(sched, units, arrays, mine)
    ckpt.load(ckpt_dir + "-async")
    check_replicated(saved, mine)
    assert check(sched, units, arrays) == checked
    # A file written by safetensors.numpy (the test) imports into the master shards.
    scribble(sched, units, arrays, mine)
    shardline.import_safetensors(sched, ckpt_dir + "-plain.safetensors")
    for u, (uname, tensors) in enumerate(UNITS):
        index = {n: t for t, (n, _) in enumerate(tensors)}
        master = sched.master_shard(units[u])
        covered = np.zeros(master.size, bool)
        for tensor, tensor_offset, shard_offset, length in sched.shard_slices(units[u]):
            covered[shard_offset:shard_offset + length] = True
            shape = tensors[index[tensor]][1]
            want = values(u, index[tensor], 0, np.float32, shape)[tensor_offset:
                                                                  tensor_offset + length]
            assert np.array_equal(master[shard_offset:shard_offset + length], want), (uname,
                                                                                      tensor)
        assert np.all(master[~covered] == 0), uname
    return checked


def expect(exc, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert text in str(e), f"{type(e).__name__}: '{e}' does not name '{text}'"
        return e
    raise AssertionError(f"{fn.__name__}{args} raised no {exc.__name__}")


def errors(world, ckpt_dir, out_dir):
    sched, units = setup(world, 0)
    ckpt = shardline.Checkpointer(sched)
    arrays = add_states(ckpt, sched, units, fill=False)
    n0 = sched.unit(units[0]).shard_elements
    # Argument errors, before anything is registered.
    expect(shardline.InvalidArgumentError, f"has {n0 + 1} elements", ckpt.add_state, units[0],
           "v", np.zeros(n0 + 1, np.float32))
    expect(shardline.InvalidArgumentError, "read-only", ckpt.add_state, units[0], "v",
           np.broadcast_to(np.zeros(1, np.float32), (n0,)))
    expect(shardline.InvalidArgumentError, "no unit 9", ckpt.add_state, 9, "v",
           np.zeros(n0, np.float32))
    expect(shardline.InvalidArgumentError, "adam.m", ckpt.add_state, units[0], "adam.m",
           np.zeros(n0, np.float32))
    expect(TypeError, "shardline.Scheduler", shardline.Checkpointer, world)
    # Collective errors: the rank that found it raises its class, the others RemoteError with
    # its message.
    e = expect(shardline.Error, "exists", ckpt.save, ckpt_dir)
    want = shardline.AlreadyExistsError if world.rank == 0 else shardline.RemoteError
    assert type(e) is want and e.code == "ALREADY_EXISTS", (type(e), e.code)
    if world.rank == 0:
        assert isinstance(e, FileExistsError)
    e = expect(shardline.Error, "-missing", ckpt.load, ckpt_dir + "-missing")
    assert e.code == "NOT_FOUND" and isinstance(e, (shardline.NotFoundError,
                                                    shardline.RemoteError)), (type(e), e.code)
    # A registered state the checkpoint lacks.
    more = shardline.Checkpointer(sched)
    more.add_state(units[1], "adam.v", np.zeros(sched.unit(units[1]).shard_elements, np.float32))
    expect(shardline.NotFoundError, "no state 'adam.v'", more.load, ckpt_dir)
    # A flipped byte in a copy of the checkpoint.
    damaged = os.path.join(out_dir, "damaged")
    if world.rank == 0:
        shutil.copytree(ckpt_dir, damaged)
        path = os.path.join(damaged, "shard-00001-of-00004.bin")
        with open(path, "r+b") as f:
            f.seek(3)
            b = f.read(1)
            f.seek(3)
            f.write(bytes([b[0] ^ 0x40]))
    barrier(world)
    e = expect(shardline.Error, "shard-00001-of-00004.bin", ckpt.load, damaged)
    assert e.code == "DATA_LOSS", e.code
    assert isinstance(e, (shardline.DataLossError, shardline.RemoteError)), type(e)
    assert isinstance(e, shardline.DataLossError) != e.peer_error, (type(e), e.peer_error)
    # The arrays registered stay usable: a good load still works afterwards.
    ckpt.load(ckpt_dir)
    checked = check(sched, units, arrays)
    # A background save over max_snapshot_bytes fails on every rank before anything is written.
    capped = shardline.Checkpointer(sched, max_snapshot_bytes=8)
    e = expect(shardline.Error, "max_snapshot_bytes (8)", capped.save_async, ckpt_dir + "-capped")
    assert e.code == "RESOURCE_EXHAUSTED", e.code
    assert not os.path.exists(ckpt_dir + "-capped") and not capped.save_pending
    expect(shardline.InvalidArgumentError, "'bad name'", ckpt.add_replicated_state, "bad name",
           np.zeros(2))
    # Full weights: never replaces a file; a missing file; a dtype that is not one.
    e = expect(shardline.Error, "safetensors export", shardline.export_safetensors, sched,
               ckpt_dir + ".safetensors")
    assert e.code == "ALREADY_EXISTS", e.code
    expect(shardline.NotFoundError, "nothing.safetensors", shardline.import_safetensors, sched,
           os.path.join(out_dir, "nothing.safetensors"))
    expect(shardline.InvalidArgumentError, "float7", shardline.export_safetensors, sched,
           os.path.join(out_dir, "x.safetensors"), dtype="float7")
    expect(TypeError, "shardline.Scheduler", shardline.export_safetensors, world, "x")
    sync(world)
    return checked


def sync(world):
    """sync_module_states: each rank's own values before, root 1's after (buckets of 24 bytes:
    inside one array and across several); a rank with other sizes fails every rank."""
    root = 1

    def arrays(rank):
        rng = np.random.default_rng([rank, 99])
        return [rng.standard_normal(1001).astype(np.float32),
                rng.integers(-2**60, 2**60, 37, dtype=np.int64), rng.standard_normal((3, 7)),
                rng.integers(0, 255, 13, dtype=np.uint8)]

    mine = arrays(world.rank)
    shardline.sync_module_states(world, mine, root=root, bucket_bytes=24, timeout=60)
    for got, want in zip(mine, arrays(root)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    if world.rank == 0:
        mine[1] = mine[1][:36].copy()
    e = expect(shardline.Error, "rank 0", shardline.sync_module_states, world, mine, root=root)
    assert e.code == "INVALID_ARGUMENT", e.code


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("ckpt_dir")
    p.add_argument("mode", choices=["save", "load", "errors"])
    p.add_argument("--shard-size", type=int, default=0)
    a = p.parse_args()
    world = shardline.init(name="checkpoint")
    if a.mode == "save":
        checked = save(world, a.ckpt_dir, a.shard_size)
    elif a.mode == "load":
        checked = load(world, a.ckpt_dir, a.shard_size)
    else:
        checked = errors(world, a.ckpt_dir, a.out_dir)
    with open(os.path.join(a.out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump({"rank": world.rank, "size": world.size, "checked": checked}, f)
    barrier(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
