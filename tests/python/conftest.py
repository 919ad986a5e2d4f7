"""Shared fixtures of the Python tests: launching workers under shardline.launch.

The tests import `shardline` as installed (pip install .), or from a build tree with
PYTHONPATH=<build>/python; the launcher is always `python -m shardline.launch`, found through
the package, and the workers in tests/python/workers/ inherit the same environment.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
# harness.py, and collective_cases.py (imported by the in-process tests too), whatever pytest's
# import mode.
sys.path[:0] = [str(HERE), str(WORKERS)]

from harness import run_bounded  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "long: the long tier (scripts/run-long-tests.sh); scripts/run-tests.sh deselects it")


@pytest.fixture
def launch():
    """launch(n, args, timeout=..., grace=None, env=None): `python -m shardline.launch -n n
    --tag-output -- python args...`; a Launched. args[0] may name a file in workers/."""

    def run(nprocs, args, *, timeout=120, grace=None, env=None):
        args = [str(a) for a in args]
        if args and (WORKERS / args[0]).is_file():
            args[0] = str(WORKERS / args[0])
        command = [sys.executable, "-m", "shardline.launch", "-n", str(nprocs), "--tag-output"]
        if grace is not None:
            command += ["--grace", str(grace)]
        command += ["--", sys.executable, *args]
        full_env = dict(os.environ)
        # A collective that never completes fails within a minute, well inside `timeout`.
        full_env.setdefault("SHARDLINE_TIMEOUT_S", "60")
        full_env.update(env or {})
        return run_bounded(command, timeout=timeout, env=full_env)

    return run

