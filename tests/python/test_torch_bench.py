"""The PyTorch headline benchmark's smoke test: bench/torch/headline.py --quick (a tiny GPT, two
steps, one round of all eight configurations) runs, every configuration's loss curve equals the
single process's (compute alone's first loss only: its ranks train apart), the sharded
configurations hold half of DDP's parameters, gradients and optimizer state per rank, compute
alone all of them, and the table has its eight rows. In the long tier (about 30 s: eight
configurations, each starting processes that import torch)."""
import json
import pathlib
import sys

import pytest

from harness import run_bounded

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "torch" / "headline.py"
CONFIG_ROWS = {"single-1t": "single process, 1 thread", "single-2t": "single process, 2 threads",
               "alone": "compute alone (no communication)", "ddp": "DDP + gloo", "fsdp2": "FSDP2 + gloo",
               "fsdp2-sl": "FSDP2 + shardline backend", "shardline": "shardline.torch.fully_shard",
               "shardline-fsdp1": "shardline.torch.FullyShardedDataParallel (FSDP1's wrapper)"}


@pytest.mark.long
def test_headline_quick(tmp_path):
    result = run_bounded([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                         timeout=240)
    assert result.returncode == 0, result.describe()
    with open(tmp_path / "headline.json") as f:
        data = json.load(f)
    names = ["single-1t", "single-2t", "alone", "ddp", "fsdp2", "fsdp2-sl", "shardline",
             "shardline-fsdp1"]
    assert list(data["summary"]) == names
    ref = data["losses"]["single-1t"]
    assert len(ref) == 2 and all(2.0 < x < 10.0 for x in ref), ref
    for name in names:
        losses = data["losses"][name]
        assert len(losses) == 2, (name, losses)
        checked = 1 if name == "alone" else 2
        for a, b in zip(losses[:checked], ref[:checked]):
            assert abs(a - b) <= 1e-3 * abs(b), (name, losses, ref)
        run = data["runs"][0][name]
        assert run["ranks"] == (1 if name.startswith("single") else 2)
        assert all(t > 0 for t in run["step_times"]), (name, run["step_times"])
        assert run["rss_peak_bytes"] > 0
    # Parameters + gradients + AdamW's two moments: 4 copies of the model; a sharded rank
    # holds half of each (up to the padding of odd-sized tensors to the world size).
    ddp = sum(data["runs"][0]["ddp"]["state_bytes"].values())
    assert sum(data["runs"][0]["alone"]["state_bytes"].values()) == ddp
    for name in ["fsdp2", "fsdp2-sl", "shardline", "shardline-fsdp1"]:
        sharded = sum(data["runs"][0][name]["state_bytes"].values())
        assert abs(sharded - ddp / 2) <= 0.02 * ddp, (name, sharded, ddp)
    assert "exposed_communication" in data["runs"][0]["shardline"]
    table = (tmp_path / "headline.md").read_text()
    rows = [line.split(" | ")[0][2:] for line in table.splitlines()
            if line.startswith("| ") and " × " in line and "ranks × threads" not in line]
    assert rows == [CONFIG_ROWS[name] for name in names], table
