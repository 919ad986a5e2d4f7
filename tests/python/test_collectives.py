"""Collectives at world sizes 1, 2 and 4: every collective, op, dtype and aliasing form on numpy
arrays and torch CPU tensors, checked element by element (workers/collective_cases.py).

World 1 runs in this process (init_local(1), and init(rank=0, world_size=1) on the ucx
backend); world 2 also in-process on the local backend (one thread per rank); worlds 2 and 4 as
processes under shardline.launch, one launch each running every case.
"""

import importlib.util
import re
import threading

import pytest

import shardline
from collective_cases import run_all

FRAMEWORKS = ["numpy", "torch"] if importlib.util.find_spec("torch") else ["numpy"]


def test_world1_local():
    (world,) = shardline.init_local(1)
    assert (world.rank, world.size, world.backend) == (0, 1, "local")
    assert run_all(world, FRAMEWORKS) > 300


def test_world1_init():
    world = shardline.init(rank=0, world_size=1, timeout=60)
    assert (world.rank, world.size, world.backend) == (0, 1, "ucx")
    assert world.timeout == 60
    assert run_all(world, FRAMEWORKS) > 300


def run_rank_threads(comms, fn, timeout):
    """fn(comm) on a thread per rank; a rank that raises aborts its communicator (so that its
    peers fail instead of waiting), and every error is reported once all threads ended."""
    errors = []

    def rank(comm):
        try:
            fn(comm)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {comm.rank}: {e!r}")
            comm.abort()

    threads = [threading.Thread(target=rank, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"a rank's thread did not finish in {timeout} s"
    assert not errors, "\n".join(errors)


def test_world2_local_threads():
    comms = shardline.init_local(2, timeout=60)
    run_rank_threads(comms, lambda comm: run_all(comm, FRAMEWORKS, log=lambda m: None), 120)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_processes(launch, nprocs):
    # INFO logs of the collectives say when a rank maps a peer's shareable memory (the >= 1 MiB
    # registered tensors): the shared-memory path must have run, or said why it could not.
    env = {"SHARDLINE_DEBUG": "INFO", "SHARDLINE_DEBUG_SUBSYS": "COLL"}
    result = launch(nprocs, ["collectives_worker.py", ",".join(FRAMEWORKS)], timeout=150,
                    env=env)
    assert result.returncode == 0, result.describe()
    ok = result.lines("COLLECTIVES OK rank")
    assert sorted(ok) == [f"COLLECTIVES OK rank {r}" for r in range(nprocs)], result.describe()
    for rank in range(nprocs):
        mapped = re.compile(rf"ucx communicator world rank {rank}: (maps the shareable memory "
                            rf"of peer rank \d|.* for peer rank \d+ failed)")
        assert mapped.search(result.output), f"rank {rank}: no mapping\n{result.describe()}"


def test_send_recv_local_threads():
    """Communicator.send / recv on two local ranks: a ring of hashed floats both ways (each rank
    receives from any rank on one stream while it sends on another), every element and the
    sender checked; a send to itself is refused naming it."""
    import numpy as np

    comms = shardline.init_local(2, timeout=60)
    results = {}

    def rank(comm):
        r = comm.rank
        mine = np.random.default_rng([7, r]).standard_normal(1001).astype(np.float32)
        got = np.zeros(1001, np.float32)
        recv_stream = shardline.host_stream(f"recv{r}")  # alive until the receive is done
        received = comm.recv(got, tag=3, stream=recv_stream)
        comm.send(mine, 1 - r, tag=3).wait(timeout=30)
        received.wait(timeout=30)
        results[r] = (got, received.source)
        with pytest.raises(shardline.InvalidArgumentError, match="itself"):
            comm.send(mine, r)

    run_rank_threads(comms, rank, 60)
    assert shardline.ANY_SOURCE == -1
    for r in range(2):
        got, source = results[r]
        assert source == 1 - r
        want = np.random.default_rng([7, 1 - r]).standard_normal(1001).astype(np.float32)
        np.testing.assert_array_equal(got, want)
