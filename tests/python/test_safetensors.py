"""Full-weight safetensors files against the reference implementation (PyPI `safetensors`).

The C++ side is build/bin/checkpoint_fixture (tests/scheduler/checkpoint/checkpoint_fixture.cc: a
model of three units, ranks as threads) and build/bin/shardline-checkpoint; $SHARDLINE_BIN_DIR
overrides build/bin. Every element is compared with the fixture's hashed values, computed here with
numpy (the same SplitMix64 formula as checkpoint_fixture.h):
  * a checkpoint saved at world 4 and at hybrid 2 x 2, exported by ExportSafetensors and by
    `shardline-checkpoint export` (as saved, as bf16, and the adam.m state), read with
    safetensors.numpy.load_file / safetensors.torch.load_file; bf16 checked against a numpy
    round-to-nearest-even of the f32 bits; `verify` and `inspect` on it;
  * files written by safetensors.numpy.save_file (f32) and safetensors.torch.save_file (bf16)
    imported by ImportSafetensors at world 3, 1 and hybrid 2 x 2, every element checked in C++.
"""

import json
import os
import subprocess

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("SHARDLINE_BIN_DIR", os.path.join(ROOT, "build", "bin"))
FIXTURE = os.path.join(BIN, "checkpoint_fixture")
CLI = os.path.join(BIN, "shardline-checkpoint")

safetensors_numpy = pytest.importorskip("safetensors.numpy")
if not (os.access(FIXTURE, os.X_OK) and os.access(CLI, os.X_OK)):
    pytest.skip(f"{FIXTURE} and {CLI} are not built (scripts/build.sh build, or set "
                "SHARDLINE_BIN_DIR)", allow_module_level=True)

# The fixture model (checkpoint_fixture.h): (unit, tensor index, name, shape, master dtype);
# "head" (unit 0, tensor 2) is tied to "emb" and not in the files.
TENSORS = [
    (0, 0, "emb", (13, 7), np.float32),
    (0, 1, "bias", (5,), np.float32),
    (1, 0, "w", (3, 5, 7), np.float32),
    (1, 1, "scale", (), np.float32),
    (1, 2, "empty", (0, 4), np.float32),
    (1, 3, "b", (11,), np.float32),
    (2, 0, "big", (1031,), np.float64),
]


def mix(x):
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def values(seed, unit, tensor, shape):
    """FixtureValue(seed, unit, tensor, i) for every element, as float32, shaped."""
    n = int(np.prod(shape, dtype=np.int64))
    key = (np.uint64(seed) << np.uint64(56)) ^ (np.uint64(unit) << np.uint64(48)) ^ \
        (np.uint64(tensor) << np.uint64(32)) ^ np.arange(n, dtype=np.uint64)
    k = mix(key) >> np.uint64(40)
    return (k.astype(np.float64) / 8388608.0 - 1.0).astype(np.float32).reshape(shape)


def bf16_bits(f32):
    """bf16 bits of float32 values by round to nearest even (no NaN here)."""
    bits = f32.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> \
        np.uint64(16)
    return rounded.astype(np.uint16)


def run(*args, ok=True):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120)
    if ok:
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}{r.stderr}"
    return r


def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


@pytest.mark.parametrize("world,shard_size", [(4, 0), (4, 2)])
def test_export_reads_back_with_safetensors(tmp_path, world, shard_size):
    ckpt, online = tmp_path / "ckpt", tmp_path / "online.safetensors"
    run(FIXTURE, "save", ckpt, online, "--world", world, "--shard-size", shard_size)
    assert "every CRC-32C matches" in run(CLI, "verify", ckpt).stdout
    inspect = run(CLI, "inspect", ckpt).stdout
    assert "tensor 'head' [13, 7] f32 offset 0 tied to 'emb'" in inspect
    offline = tmp_path / "offline.safetensors"
    run(CLI, "export", ckpt, offline)
    assert online.read_bytes() == offline.read_bytes()

    for path in (online, offline):
        loaded = safetensors_numpy.load_file(str(path))
        assert sorted(loaded) == sorted(t[2] for t in TENSORS)  # the tie is written once
        for unit, index, name, shape, dtype in TENSORS:
            got = loaded[name]
            assert got.dtype == dtype and got.shape == shape, name
            want = values(1, unit, index, shape).astype(dtype)
            np.testing.assert_array_equal(got, want, err_msg=name)
        meta = header(path)["__metadata__"]
        assert meta == {"format": "pt", "shardline.tied_to.head": "emb"}

    adam = tmp_path / "adam.safetensors"
    run(CLI, "export", ckpt, adam, "--state", "adam.m")
    loaded = safetensors_numpy.load_file(str(adam))
    for unit, index, name, shape, _ in TENSORS:
        assert loaded[name].dtype == np.float32, name
        np.testing.assert_array_equal(loaded[name], values(2, unit, index, shape), err_msg=name)


def test_bf16_export_matches_round_to_nearest_even(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    ckpt, online = tmp_path / "ckpt", tmp_path / "online.safetensors"
    run(FIXTURE, "save", ckpt, online, "--world", 3, "--dtype", "bf16")
    offline = tmp_path / "offline.safetensors"
    run(CLI, "export", ckpt, offline, "--dtype", "bf16")
    assert online.read_bytes() == offline.read_bytes()
    loaded = safetensors_torch.load_file(str(online))
    for unit, index, name, shape, _ in TENSORS:
        got = loaded[name]
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == shape, name
        got_bits = got.contiguous().view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(got_bits, bf16_bits(values(1, unit, index, shape)),
                                      err_msg=name)


@pytest.mark.parametrize("world,shard_size", [(3, 0), (1, 0), (4, 2)])
def test_numpy_file_imports(tmp_path, world, shard_size):
    path = tmp_path / "np.safetensors"
    # f32 everywhere: the f64 unit's tensor is widened on import.
    tensors = {name: values(1, unit, index, shape) for unit, index, name, shape, _ in TENSORS}
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "np"})
    r = run(FIXTURE, "import", path, "--world", world, "--shard-size", shard_size)
    assert "ok at world" in r.stdout
    # A wrong value is caught: the check can fail.
    tensors["w"] = tensors["w"].copy()
    tensors["w"].flat[17] += 0.25
    bad = tmp_path / "bad.safetensors"
    safetensors_numpy.save_file(tensors, str(bad))
    r = run(FIXTURE, "import", bad, "--world", world, "--shard-size", shard_size, ok=False)
    # One element, counted once per replica of its shard.
    replicas = world // shard_size if shard_size else 1
    assert r.returncode == 1 and f"{replicas} elements differ" in r.stderr, r.stderr


def test_torch_bf16_file_imports(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "torch.safetensors"
    tensors = {name: torch.from_numpy(values(1, unit, index, shape).copy()).to(torch.bfloat16)
               for unit, index, name, shape, _ in TENSORS}
    safetensors_torch.save_file(tensors, str(path))
    run(FIXTURE, "import", path, "--world", 3, "--file-dtype", "bf16")
    # Read as f32 instead: the widened bf16 values are not the f32 values.
    r = run(FIXTURE, "import", path, "--world", 3, ok=False)
    assert r.returncode == 1 and "elements differ" in r.stderr, r.stderr


def test_import_names_missing_and_unknown_tensors(tmp_path):
    tensors = {name: values(1, unit, index, shape) for unit, index, name, shape, _ in TENSORS}
    del tensors["bias"]
    tensors["lm_head.weight"] = np.zeros((2, 2), np.float32)
    path = tmp_path / "x.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    r = run(FIXTURE, "import", path, "--world", 2, ok=False)
    assert r.returncode == 1
    assert f"safetensors import '{path}'" in r.stderr and "no tensor 'bias'" in r.stderr, r.stderr
