"""Work: waits release the GIL, and a Work keeps its tensors alive after Python drops them."""

import gc
import os
import re
import threading
import time
import weakref

import numpy as np
import pytest

import shardline


def test_wait_releases_the_gil():
    """Rank 0 waits for its all_reduce; only a Python thread can issue rank 1's part, after
    counting in a loop that needs the GIL. If wait() held the GIL, the thread could not run,
    and the wait would end with DeadlineExceededError instead."""
    a, b = shardline.init_local(2, timeout=30)
    x = np.arange(1001, dtype=np.float32)
    y = np.full(1001, 0.5, dtype=np.float32)
    waiting = threading.Event()
    state = {"count": 0, "issued_at": None, "work": None}

    def helper():
        if not waiting.wait(timeout=20):
            return
        start = time.monotonic()
        # Pure-Python work for 0.2 s: runs only while the main thread has released the GIL.
        while time.monotonic() - start < 0.2:
            state["count"] += 1
        state["issued_at"] = time.monotonic()
        state["work"] = b.all_reduce(y)

    thread = threading.Thread(target=helper)
    thread.start()
    work = a.all_reduce(x)
    entered = time.monotonic()
    waiting.set()
    try:
        work.wait(timeout=10)
    finally:
        thread.join(timeout=20)
    assert not thread.is_alive()
    assert state["issued_at"] is not None and state["issued_at"] > entered
    assert state["count"] > 1000, state
    state["work"].wait(10)
    np.testing.assert_array_equal(x, np.arange(1001, dtype=np.float32) + 0.5)
    np.testing.assert_array_equal(y, x)


def test_stream_synchronize_releases_the_gil():
    a, b = shardline.init_local(2, timeout=30)
    x, y = np.ones(7, np.float64), np.ones(7, np.float64)
    a.all_reduce(x)  # the Work is dropped; the stream still runs the collective
    done = threading.Event()

    def helper():
        count = 0
        while count < 100000:  # needs the GIL while the main thread synchronizes
            count += 1
        b.all_reduce(y).wait(10)
        done.set()

    thread = threading.Thread(target=helper)
    thread.start()
    a.stream.synchronize(timeout=10)
    thread.join(timeout=20)
    assert done.is_set()
    np.testing.assert_array_equal(x, np.full(7, 2.0))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_work_keeps_tensors_alive(framework):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        new = lambda n, v: torch.full((n,), v, dtype=torch.float32)  # noqa: E731
        as_numpy = lambda t: t.numpy()  # noqa: E731
    else:
        new = lambda n, v: np.full(n, v, dtype=np.float32)  # noqa: E731
        as_numpy = np.asarray
    gc.collect()
    assert shardline._core._pending_works() == 0
    a, b = shardline.init_local(2, timeout=30)
    n = 100003
    # Rank 0: an all_gather into an output this test keeps a view of, and an all_reduce whose
    # tensors nobody keeps. Both are issued, then the Works and tensors are dropped.
    out = new(2 * n, -1.0)
    kept = out[n:]  # a view: it alone keeps the output alive once the test drops `out`
    inp = new(n, 3.0)
    probes = [weakref.ref(inp)]
    w1 = a.all_gather(out, inp)
    lost_in, lost_out = new(n, 1.0), new(n, 0.0)
    probes += [weakref.ref(lost_in), weakref.ref(lost_out)]
    w2 = a.all_reduce(lost_in, output=lost_out)
    del w1, w2, out, inp, lost_in, lost_out
    gc.collect()
    assert all(p() is not None for p in probes), "a tensor went away with its Work"
    assert shardline._core._pending_works() == 2
    # Rank 1 completes both collectives; rank 0's stream then has finished them too.
    peer_out = new(2 * n, -1.0)
    b.all_gather(peer_out, new(n, 5.0)).wait(30)
    peer_sum = new(n, 0.0)
    b.all_reduce(new(n, 2.0), output=peer_sum).wait(30)
    a.stream.synchronize(timeout=30)
    assert shardline._core._pending_works() == 0
    gc.collect()
    assert all(p() is None for p in probes), "the tensors outlived their finished collective"
    np.testing.assert_array_equal(as_numpy(kept), np.full(n, 5.0))
    np.testing.assert_array_equal(as_numpy(peer_out), np.repeat([3.0, 5.0], n))
    np.testing.assert_array_equal(as_numpy(peer_sum), np.full(n, 3.0))


def test_drain_waits_for_dropped_works():
    a, b = shardline.init_local(2, timeout=30)
    x = np.ones(5, np.float32)
    a.all_reduce(x)
    b.all_reduce(np.ones(5, np.float32))
    assert shardline._core._drain(30) == 0
    assert shardline._core._pending_works() == 0
    np.testing.assert_array_equal(x, np.full(5, 2.0))


@pytest.mark.parametrize("mode", ["kept", "dropped"])
def test_exit_after_a_timed_out_wait(launch, tmp_path, mode):
    """Rank 0's wait(timeout=1) on a collective rank 1 never joins raises; then its script ends.
    With SHARDLINE_TIMEOUT_S at 60 it exits within 2 s of its last statement: the exit aborts the
    timed-out collective's communicator (telling rank 1) instead of waiting for its deadline."""
    fifo = tmp_path / "rank0-alive"
    os.mkfifo(fifo)
    result = launch(2, ["exit_worker.py", fifo, mode], timeout=30,
                    env={"SHARDLINE_TIMEOUT_S": "60"})
    assert result.returncode == 0, result.describe()
    seq = 1  # after the barrier
    timeout = result.lines("TIMEOUT ")
    assert len(timeout) == 1, result.describe()
    assert re.match(rf"TIMEOUT DEADLINE_EXCEEDED: all_reduce #{seq} on world \(rank 0 of 2, ucx\): not finished "
                    r"after waiting 1(\.\d+)?s: running for [\d.]+m?s, waiting for rank\(s\) 1$",
                    timeout[0]), result.describe()
    assert len(result.lines(f"shardline: aborted at interpreter exit after a wait() gave up on "
                            f"it: all_reduce #{seq} on world")) == 1, result.describe()
    last = float(result.lines("LAST ")[0].split()[1])
    gone = float(result.lines("GONE ")[0].split()[1])
    assert 0 <= gone - last < 2, result.describe()
