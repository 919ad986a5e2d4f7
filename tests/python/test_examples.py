"""Runs the Python examples that docs/embedding.md quotes (tests/scripts/doc_snippets_test.py
keeps the quotes equal to the files), on two ranks under shardline.launch."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("example", ["collectives.py", "train_scheduler.py"])
def test_example_runs_on_two_ranks(example):
    script = ROOT / "examples" / "python" / example
    result = subprocess.run(
        [sys.executable, "-m", "shardline.launch", "-n", "2", "--grace", "10", "--",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        assert f"rank {rank}: " in result.stdout, result.stdout + result.stderr
