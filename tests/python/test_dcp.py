"""torch.distributed.checkpoint (DCP) and torch's state-dict functions on fully_shard'ed models
(tests/python/workers/dcp_worker.py under shardline.launch, gloo).

Each round trip trains 2 AdamW steps at one world size, saves model and optimizer with DCP
(through get_model_state_dict / get_optimizer_state_dict, which give DTensors in the original
shapes), and loads into a fresh model at another world size (set_model_state_dict /
set_optimizer_state_dict): every weight and every optimizer state equals the saver's bit for
bit, and the next step's loss and weights match the saver's within 1e-6. Each rank's file holds
about 1/N of the bytes. Written by shardline and read by FSDP2, and written by FSDP2 and read by
shardline, in CI; shardline to shardline and hybrid meshes on either side in the long tier. A
shardline loader also checks the full forms (full_state_dict=True on every rank, set_*_state_dict
of full state dicts).
"""
import json

import pytest

pytest.importorskip("torch")


def run(launch, nprocs, *args):
    result = launch(nprocs, ["dcp_worker.py", *args], timeout=150)
    assert result.returncode == 0, result.describe()


@pytest.mark.parametrize("saver,n,loader,m", [("shardline", 3, "fsdp2", 2),
                                              ("fsdp2", 2, "shardline", 3)])
def test_dcp_round_trip(launch, tmp_path, saver, n, loader, m):
    ckpt = tmp_path / "ckpt"
    run(launch, n, "save", saver, ckpt)
    files = sorted(ckpt.glob("__*_0.distcp"))
    assert len(files) == n, files
    if not saver.endswith("-hsdp"):  # (hybrid: the replicas write their shards once, together)
        sizes = [f.stat().st_size for f in files]
        for size in sizes:
            assert 0.5 * sum(sizes) / n <= size <= 1.5 * sum(sizes) / n, sizes
    run(launch, m, "load", loader, ckpt)
    check_loaded(tmp_path, loader)


@pytest.mark.long
@pytest.mark.parametrize("saver,n,loader,m", [("shardline", 3, "shardline", 4),
                                              ("shardline-hsdp", 4, "fsdp2", 2),
                                              ("fsdp2-hsdp", 4, "shardline-hsdp", 4),
                                              ("fsdp2", 3, "shardline", 2),
                                              ("shardline", 2, "shardline-hsdp", 4)])
def test_dcp_round_trip_hybrid_and_more(launch, tmp_path, saver, n, loader, m):
    ckpt = tmp_path / "ckpt"
    run(launch, n, "save", saver, ckpt)
    run(launch, m, "load", loader, ckpt)
    check_loaded(tmp_path, loader)


def check_loaded(tmp_path, loader):
    got = json.loads((tmp_path / "ckpt.load.json").read_text())
    assert got["keys"] == [True, True]
    worst = max(got["weights"].items(), key=lambda kv: kv[1])
    assert worst[1] == 0.0, worst
    worst = max(got["optim"].items(), key=lambda kv: kv[1])
    assert worst[1] == 0.0, worst
    loss, want = got["loss"]
    assert abs(loss - want) <= 1e-6 * want, got["loss"]
    worst = max(got["after"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-6, worst
    if loader.startswith("shardline"):
        forms = got["forms"]
        assert forms["keys"], forms
        assert forms["full_vs_shardline"] == forms["set_weights"] == forms["set_optim"] == 0.0, \
            forms
