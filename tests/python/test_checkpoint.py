"""shardline.Checkpointer from Python (numpy): a job of 4 processes saves three units' master
shards and three states per unit (f32, i64, f64) with values from seeded numpy generators; jobs
of 1, 2 and 3 processes (full shard) and of 4 (hybrid 2 x 2) load it and compare every element of
every shard with the same generators (tests/python/workers/checkpoint_worker.py); the ranks'
checked elements must cover every tensor (once per replica). The same holds for a background save
(save_async, everything overwritten right after the call) and for two replicated states. The
world-4 job exports the weights as safetensors (as saved and as bf16), read here with
safetensors.numpy and compared with the generators (bf16: a numpy round-to-nearest-even); a file
written here by safetensors.numpy imports at every loading world. A job of 2 checks the
exceptions and sync_module_states; in one process (init_local(1)) the argument errors and that
the Checkpointer keeps its arrays.
"""
import gc
import json
import weakref

import numpy as np
import pytest

import shardline

from checkpoint_worker import STATES, UNITS, values

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
            "manifest.json", "replicated.bin"] + [f"shard-0000{s}-of-00004.bin" for s in range(4)]
        # The file a plain writer makes, for the loading jobs to import (other values).
        st = pytest.importorskip("safetensors.numpy")
        st.save_file({t: values(u, i, 0, np.float32, shape).reshape(shape)
                      for u, (_, tensors) in enumerate(UNITS)
                      for i, (t, shape) in enumerate(tensors)},
                     str(base / "step3-plain.safetensors"))
    return ckpt


def bf16_round(x):
    """float32 -> the float32 value of its bfloat16 rounding (nearest, ties to even)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def test_export_read_by_safetensors(launch, saved):
    save_once(launch, saved)
    st = pytest.importorskip("safetensors.numpy")
    exact = st.load_file(str(saved / "step3.safetensors"))
    bf16 = __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(saved / "step3-bf16.safetensors")) if _has_torch() else None
    names = [t for _, tensors in UNITS for t, _ in tensors]
    assert sorted(exact) == sorted(names)
    for u, (_, tensors) in enumerate(UNITS):
        for i, (t, shape) in enumerate(tensors):
            want = values(u, i, 0, np.float32, shape).reshape(shape)
            assert exact[t].dtype == np.float32 and np.array_equal(exact[t], want), t
            if bf16 is not None:
                got = bf16[t].float().numpy()
                assert str(bf16[t].dtype) == "torch.bfloat16" and got.shape == shape, t
                assert np.array_equal(got, bf16_round(want)), t
    # The header's metadata: the format, and ours.
    import json as _json
    raw = (saved / "step3-bf16.safetensors").read_bytes()
    header = _json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"format": "pt", "step": "3"}
    assert {header[t]["dtype"] for t in names} == {"BF16"}


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


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
