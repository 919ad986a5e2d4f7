"""scripts/shardline-tune-plot draws its four PNGs from a shardline-tune sweep table.

Input: the committed walkthrough table (bench/results/tune/llama3-8b-128.json, docs/tuning.md)
and a hand-made one with a refused row and no fitting row; a file that is not a sweep table is
an error naming the missing member.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "shardline-tune-plot")
TABLE = os.path.join(ROOT, "bench", "results", "tune", "llama3-8b-128.json")
NAMES = ("step_time.png", "memory.png", "breakdown.png", "pareto.png")

pytest.importorskip("matplotlib")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120)


def check_pngs(directory, prefix):
    for name in NAMES:
        path = os.path.join(directory, prefix + name)
        with open(path, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", path
        assert len(data) > 10000, path


def test_walkthrough_table(tmp_path):
    r = run(TABLE, "--out-dir", str(tmp_path), "--prefix", "x-")
    assert r.returncode == 0, r.stderr
    check_pngs(tmp_path, "x-")
    assert r.stdout.count("wrote ") == 4


def row(index, strategy, shard_size, fp, step, peak, fits, ok=True):
    return {
        "index": index, "strategy": strategy, "shard_size": shard_size, "forward_prefetch": fp,
        "backward_prefetch": "before_grad", "backward_prefetch_depth": 1, "budget_units": 0,
        "budget_bytes": 0, "param_dtype": "model", "reduce_dtype": "model",
        "activation_checkpointing": "off", "ok": ok, "error": "" if ok else "refused",
        "ranks_simulated": 1, "representative": True, "step_time_s": step,
        "tokens_per_s_per_device": 1000.0 / step if ok else 0, "mfu": 0.3,
        "exposed_communication_s": 0.01,
        "memory": {"master_shards": peak // 8, "sharded_grads": peak // 8,
                   "optimizer_state": peak // 4, "unsharded_params_peak": peak // 8,
                   "grad_buffers_peak": peak // 8, "activations_peak": peak // 4,
                   "total_peak": peak},
        "fits": fits,
    }


def test_no_row_fits_and_refused_rows(tmp_path):
    table = {
        "model": "m", "cluster": "topology t: 1 x 8 devices", "world_size": 8,
        "device_memory_bytes": 1 << 30, "best": -1,
        "rows": [row(0, "full", 8, 1, 0.5, 3 << 30, False),
                 row(1, "hybrid", 4, 2, 0.4, 5 << 30, False),
                 row(2, "full", 8, 2, 0, 0, False, ok=False)],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    r = run(str(path), "--out-dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    check_pngs(tmp_path / "out", "")


def test_not_a_sweep_table(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"rows": []}))
    r = run(str(path), "--out-dir", str(tmp_path))
    assert r.returncode != 0
    assert "has no 'best': not a shardline-tune sweep table" in r.stderr
    r = run(str(tmp_path / "missing.json"))
    assert r.returncode != 0
    assert "cannot read" in r.stderr
