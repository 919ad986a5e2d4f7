"""The package: version, type stubs, registered memory, shardline.launch and shardline.flight."""

import importlib.resources
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import shardline
from harness import run_bounded


def test_version():
    assert shardline.__version__ == "0.1.0"
    assert shardline._core.__version__ == "0.1.0"


def test_ships_stubs_and_py_typed():
    package = importlib.resources.files("shardline")
    init_dir = os.path.dirname(os.path.abspath(shardline.__file__))
    for name in ("_core.pyi", "py.typed", "launch.py", "_launch_tool.py", "flight.py",
                 "_flight_tool.py"):
        assert package.joinpath(name).is_file(), name
        assert os.path.isfile(os.path.join(init_dir, name)), name
    stub = package.joinpath("_core.pyi").read_text()
    for name in ("class Communicator", "def all_reduce", "def all_gather", "def reduce_scatter",
                 "def broadcast", "def all_to_all", "class Scheduler", "class Work",
                 "def init_local", "def host_stream"):
        assert name in stub, name


def test_public_names():
    for name in shardline.__all__:
        assert hasattr(shardline, name), name


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_empty_and_zeros(framework):
    if framework == "torch":
        torch = pytest.importorskip("torch")
    x = shardline.zeros((3, 5), "int32", framework=framework)
    assert tuple(x.shape) == (3, 5)
    assert np.all(np.asarray(x) == 0) if framework == "numpy" else bool((x == 0).all())
    y = shardline.empty(7, np.float16 if framework == "numpy" else "float16", framework=framework)
    assert tuple(y.shape) == (7,)
    if framework == "torch":
        b = shardline.empty((2, 3), torch.bfloat16, framework="torch")
        assert b.dtype == torch.bfloat16 and tuple(b.shape) == (2, 3)
        assert shardline.zeros(0, "float32", framework="torch").numel() == 0
    else:
        assert y.dtype == np.float16
        with pytest.raises(ValueError, match="numpy has no bfloat16"):
            shardline.empty(4, "bfloat16")
    with pytest.raises(ValueError, match="unknown dtype 'complex64'"):
        shardline.empty(4, "complex64", framework=framework)
    with pytest.raises(ValueError, match="negative dimension -2"):
        shardline.zeros((3, -2), framework=framework)
    with pytest.raises(ValueError, match="framework 'jax' is not 'numpy' or 'torch'"):
        shardline.empty(4, framework="jax")


def test_launch_sets_the_environment():
    code = ("import os; print('ENV', os.environ['RANK'], os.environ['WORLD_SIZE'], "
            "os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])")
    # --tag-output: the launcher forwards whole lines, each prefixed with its rank.
    result = run_bounded([sys.executable, "-m", "shardline.launch", "-n", "2", "--tag-output",
                          "--", sys.executable, "-c", code], timeout=60)
    assert result.returncode == 0, result.describe()
    for rank in range(2):
        assert f"[{rank}]<stdout>: ENV {rank} 2 {rank} " in result.output, result.describe()
    lines = sorted(result.lines("ENV "))
    assert [l.split()[1:4] for l in lines] == [["0", "2", "0"], ["1", "2", "1"]], result.describe()
    assert len({l.split()[5] for l in lines}) == 1, "the ranks got different ports"


def test_launch_failing_rank():
    code = "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    result = run_bounded([sys.executable, "-m", "shardline.launch", "-n", "2", "--grace", "10",
                          "--", sys.executable, "-c", code], timeout=60)
    assert result.returncode == 3, result.describe()
    assert "rank 1" in result.output and "exited with status 3" in result.output, \
        result.describe()


def test_launch_terminates_the_rest_after_the_grace_period():
    # Rank 0 fails; rank 1 would wait forever: the launcher ends it after 1 s.
    code = ("import os, sys, threading\n"
            "if os.environ['RANK'] == '0': sys.exit(5)\n"
            "threading.Event().wait()")
    result = run_bounded([sys.executable, "-m", "shardline.launch", "-n", "2", "--grace", "1",
                          "--", sys.executable, "-c", code], timeout=60)
    assert result.returncode == 5, result.describe()
    assert "grace period of 1 s over; terminating rank(s) 1" in result.output, result.describe()


def test_launch_run_api():
    code = "import os, sys; sys.exit(int(os.environ['WORLD_SIZE']) + 4)"
    from shardline import launch
    assert launch.run(3, [sys.executable, "-c", code], timeout=60) == 7


def test_launch_run_one_node_of_several():
    # Node 1 of 2, 2 processes: ranks 2 and 3 of 4; each rank checks its environment.
    code = ("import os, sys; e = os.environ; "
            "ok = (e['WORLD_SIZE'], e['NODE_RANK'], e['MASTER_ADDR'], e['MASTER_PORT']) == "
            "('4', '1', '10.9.8.7', '29411') and e['RANK'] == str(2 + int(e['LOCAL_RANK'])); "
            "sys.exit(0 if ok else 9)")
    from shardline import launch
    env = dict(os.environ, SHARDLINE_STORE_TOKEN="shared")  # every node's launcher needs one
    assert launch.run(2, [sys.executable, "-c", code], timeout=60, nnodes=2, node_rank=1,
                      master_addr="10.9.8.7", master_port=29411, env=env) == 0


def test_launch_usage_error():
    result = subprocess.run([sys.executable, "-m", "shardline.launch", "-n", "0", "--", "true"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "-n must be at least 1" in result.stderr


def _flight_dump(directory, rank, entries):
    dump = {"format": "shardline-flight-recorder", "version": 1, "communicator": "world",
            "backend": "local", "rank": rank, "size": 2, "pid": 1, "host": "h", "reason": "t",
            "dumped_at_ns": 1, "capacity": 8, "recorded": len(entries), "next_seq": 0,
            "entries": [{"seq": seq, "call": call, "kind": call.split("(")[0], "count": 3,
                         "dtype": "f32", "op": "sum", "root": 0, "stream": "s", "tag": "",
                         "state": "failed", "enqueued_ns": 1, "started_ns": 1, "ended_ns": 2,
                         "error": "x"} for seq, call in entries]}
    with open(os.path.join(directory, f"flight.world.rank{rank}.json"), "w") as fh:
        json.dump(dump, fh)


def test_flight_names_the_divergence(tmp_path):
    _flight_dump(tmp_path, 0, [(4, "all_gather(count=3, f32)")])
    _flight_dump(tmp_path, 1, [(4, "broadcast(count=3, f32, root=0)")])
    result = run_bounded([sys.executable, "-m", "shardline.flight", str(tmp_path)], timeout=60)
    assert result.returncode == 1, result.output
    assert result.output.splitlines()[0] == (
        "[world] ranks diverged at #4: rank 1 called broadcast(count=3, f32, root=0) where rank 0 "
        "called all_gather(count=3, f32)")
    from shardline import flight
    assert flight.main([str(tmp_path), "--json"]) == 1
    assert flight.main([str(tmp_path / "missing")]) == 2
