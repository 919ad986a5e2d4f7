"""Errors are exceptions carrying the Status text: bad arguments (ValueError), a disagreement
across ranks and a killed peer (RemoteError on every rank, not a hang), deadlines
(TimeoutError)."""

import re

import numpy as np
import pytest

import shardline


@pytest.fixture(scope="module")
def pair():
    """Two ranks of the local backend in this process. Validation errors are raised when the
    collective is issued, before anything is enqueued, so one rank alone can provoke them."""
    return shardline.init_local(2, timeout=30)


def test_error_hierarchy():
    assert issubclass(shardline.InvalidArgumentError, shardline.Error)
    assert issubclass(shardline.InvalidArgumentError, ValueError)
    assert issubclass(shardline.DeadlineExceededError, TimeoutError)
    assert issubclass(shardline.FailedPreconditionError, RuntimeError)
    assert issubclass(shardline.NotFoundError, LookupError)
    assert issubclass(shardline.RemoteError, shardline.Error)
    assert not issubclass(shardline.RemoteError, ValueError)


@pytest.mark.parametrize("dtype, name", [(np.bool_, "bool"), (np.complex64, "complex64"),
                                         (np.complex128, "complex128"), (np.uint16, "uint16"),
                                         (np.float128 if hasattr(np, "float128") else np.uint64,
                                          "float128" if hasattr(np, "float128") else "uint64")])
def test_bad_dtype_numpy(pair, dtype, name):
    with pytest.raises(shardline.InvalidArgumentError) as info:
        pair[0].all_reduce(np.zeros(4, dtype=dtype))
    e = info.value
    assert isinstance(e, ValueError)
    assert f"dtype {name}" in str(e) and "all_reduce tensor" in str(e), str(e)
    assert e.code == "INVALID_ARGUMENT" and e.peer_error is False


def test_bad_dtype_torch(pair):
    torch = pytest.importorskip("torch")
    for dtype, name in [(torch.bool, "bool"), (torch.complex64, "complex64"),
                        (torch.int16, "int16")]:
        with pytest.raises(ValueError, match=f"all_gather input has dtype {name}"):
            pair[0].all_gather(torch.zeros(8, dtype=dtype), torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_byte_dtypes_do_not_reduce(pair, dtype):
    short = {"int8": "i8", "uint8": "u8"}[dtype]
    x = np.zeros(6, dtype=dtype)
    for call in (lambda: pair[0].all_reduce(x, "max"),
                 lambda: pair[0].reduce_scatter(np.zeros(3, dtype=dtype), x, "sum")):
        with pytest.raises(shardline.InvalidArgumentError,
                           match=f"dtype {short} is not supported"):
            call()


def test_sizes_within_a_rank(pair):
    c = pair[0]
    f = np.float32
    with pytest.raises(ValueError, match=re.escape(
            "all_gather: output has 9 elements; it needs input's 5 x 2 ranks = 10")):
        c.all_gather(np.zeros(9, f), np.zeros(5, f))
    with pytest.raises(ValueError, match=re.escape(
            "reduce_scatter: input has 11 elements; it needs output's 5 x 2 ranks = 10")):
        c.reduce_scatter(np.zeros(5, f), np.zeros(11, f))
    with pytest.raises(ValueError,
                       match=re.escape("all_reduce: output has 4 elements but tensor has 5")):
        c.all_reduce(np.zeros(5, f), output=np.zeros(4, f))
    with pytest.raises(ValueError, match=r"all_to_all: .* they have 7 and 7"):
        c.all_to_all(np.zeros(7, f), np.zeros(7, f))
    with pytest.raises(ValueError, match=r"all_to_all: .* they have 8 and 6"):
        c.all_to_all(np.zeros(6, f), np.zeros(8, f))
    with pytest.raises(ValueError, match="all_gather: output is f64 but input is f32"):
        c.all_gather(np.zeros(10, np.float64), np.zeros(5, f))


def test_not_contiguous(pair):
    x = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="all_reduce tensor is not C-contiguous"):
        pair[0].all_reduce(x[:, ::2])
    with pytest.raises(ValueError, match="not C-contiguous"):
        pair[0].all_reduce(np.asfortranarray(x))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="all_gather output is not C-contiguous"):
        pair[0].all_gather(torch.zeros(4, 3).t(), torch.zeros(6))


def test_read_only_output(pair):
    out = np.zeros(10, np.float32)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="all_gather output is read-only"):
        pair[0].all_gather(out, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="all_reduce tensor is read-only"):
        pair[0].all_reduce(out)  # in place: the tensor is written
    with pytest.raises(ValueError, match="broadcast tensor is read-only"):
        pair[0].broadcast(out)
    # A read-only input is fine to read from; the peer completes the collective.
    src = np.arange(4, dtype=np.float32)
    src.setflags(write=False)
    dst = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    works = [pair[0].all_reduce(src, output=dst[0]),
             pair[1].all_reduce(np.ones(4, np.float32), output=dst[1])]
    for w in works:
        w.wait(30)
    for d in dst:
        np.testing.assert_array_equal(d, np.arange(4) + 1)


def test_other_bad_arguments(pair):
    c = pair[0]
    with pytest.raises(ValueError, match="all_reduce tensor is a list, not a tensor"):
        c.all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="unknown reduce op 'band' .*max or product"):
        c.all_reduce(np.zeros(3, np.float32), "band")
    with pytest.raises(ValueError, match="root 2 is not a rank of this communicator"):
        c.broadcast(np.zeros(3, np.float32), root=2)
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="all_to_all .* input .* and output .* overlap"):
        c.all_to_all(x, x)
    with pytest.raises(ValueError, match="all_gather .*input .* and output"):
        c.all_gather(x, x[1:3])  # rank 0's slice starts at 0, not 1
    with pytest.raises(ValueError, match="size 0 < 1"):
        shardline.init_local(0)
    with pytest.raises(ValueError, match="give rank and world_size together"):
        shardline.init(rank=0)
    with pytest.raises(ValueError, match="is not host:port"):
        shardline.init(rank=0, world_size=1, address="nowhere")
    works = [c.barrier(), pair[1].barrier()]
    with pytest.raises(ValueError, match="timeout -1 s is negative"):
        works[0].wait(timeout=-1)
    for w in works:
        w.wait(30)


def test_wrong_device(pair):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: a wrong-device tensor cannot be made on a CPU-only run")
    with pytest.raises(ValueError, match="is on cuda:0 but the communicator moves"):
        pair[0].all_reduce(torch.zeros(4, device="cuda"))


def test_deadline_and_work_state():
    a, b = shardline.init_local(2, timeout=30)
    a.barrier(), b.barrier()  # collective #0: the all_reduce is #1
    x, y = np.ones(5, np.float32), np.full(5, 2.0, np.float32)
    wa = a.all_reduce(x)
    # Rank 1 has not issued its part: the wait gives up at its own timeout, and says which
    # collective is late and whom it waits for (not the stream's event).
    with pytest.raises(shardline.DeadlineExceededError) as info:
        wa.wait(timeout=0.2)
    e = info.value
    assert isinstance(e, TimeoutError) and e.code == "DEADLINE_EXCEEDED"
    assert re.fullmatch(r"DEADLINE_EXCEEDED: all_reduce #1 on world \(rank 0 of 2, local\): not finished after "
                        r"waiting 2\d\dms: running for [\d.]+m?s, waiting for rank\(s\) 1",
                        str(e)), str(e)
    assert e.peer_error is False  # the wait gave up; the collective has not failed
    # One queued behind it says so.
    wq = a.barrier()
    with pytest.raises(shardline.DeadlineExceededError,
                       match=r"^DEADLINE_EXCEEDED: barrier #2 on world \(rank 0 of 2, local\): not finished after "
                             r"waiting [\d.]+m?s: still queued on stream 'world.python', behind "
                             r"all_reduce #1 \(running\)$"):
        wq.wait(timeout=0.05)
    assert not wa.is_completed() and wa.exception() is None
    wb = b.all_reduce(y)
    b.barrier()
    wa.wait(30)
    wb.wait(30)
    wq.wait(30)
    assert wa.is_completed() and wa.exception() is None
    np.testing.assert_array_equal(x, np.full(5, 3.0))
    np.testing.assert_array_equal(y, np.full(5, 3.0))


def test_timeout_arguments(pair):
    works = [pair[0].barrier(), pair[1].barrier()]
    with pytest.raises(shardline.InvalidArgumentError, match="timeout is NaN"):
        works[0].wait(timeout=float("nan"))
    with pytest.raises(shardline.InvalidArgumentError, match="timeout -1 s is negative"):
        works[0].wait(timeout=-1)
    for w in works:
        w.wait(timeout=float("inf"))  # no bound: returns when done
    with pytest.raises(shardline.InvalidArgumentError, match="init_local: timeout is NaN"):
        shardline.init_local(2, timeout=float("nan"))
    with pytest.raises(shardline.InvalidArgumentError, match="init_local: timeout -1 s is not > 0"):
        shardline.init_local(2, timeout=-1)
    with pytest.raises(shardline.InvalidArgumentError, match="init: timeout is NaN"):
        shardline.init(rank=0, world_size=1, address="127.0.0.1:1", timeout=float("nan"))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_zero_elements(pair, framework):
    """Count 0 is a legal collective (it only advances the sequence); numpy exports an empty
    array with stride 0, which is no layout to refuse."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        make = lambda shape: torch.zeros(shape)  # noqa: E731
    else:
        make = lambda shape: np.zeros(shape, np.float32)  # noqa: E731
    for shape in [(0,), (0, 3), (3, 0, 2)]:
        works = []
        for c in pair:
            works += [c.all_reduce(make(shape)), c.all_gather(make(shape), make(shape)),
                      c.reduce_scatter(make(shape), make(shape)), c.broadcast(make(shape)),
                      c.all_to_all(make(shape), make(shape))]
        for w in works:
            w.wait(30)
    # The communicators still agree on the sequence afterwards.
    x = [np.full(3, r + 1.0, np.float32) for r in range(2)]
    works = [c.all_reduce(v) for c, v in zip(pair, x)]
    for w in works:
        w.wait(30)
    np.testing.assert_array_equal(x[0], np.full(3, 3.0))


def test_non_utf8_message_keeps_its_text(tmp_path):
    """A message quoting bytes that are not UTF-8 (a Latin-1 value in a manifest) is raised as its
    shardline.Error, the bad bytes replaced, not as a UnicodeDecodeError that loses it."""
    world = shardline.init_local(1)[0]
    sched = shardline.Scheduler(world)
    sched.register_unit("u", [("w", (4,))])
    ckpt = shardline.Checkpointer(sched)
    ckpt.save(tmp_path / "c")
    manifest = tmp_path / "c" / "manifest.json"
    text = manifest.read_bytes()
    assert b'"crc32c"' in text
    manifest.write_bytes(text.replace(b'"crc32c"', b'"caf\xe9"'))
    with pytest.raises(shardline.InvalidArgumentError) as info:
        ckpt.load(tmp_path / "c")
    assert '"caf\ufffd" is not "crc32c"' in str(info.value), str(info.value)
    assert info.value.code == "INVALID_ARGUMENT"


def test_mismatch_across_ranks_local():
    """The local backend compares the ranks' calls as the ucx one does. Rank 1's call may
    already find the communicator aborted by rank 0's side and raise when issued."""
    a, b = shardline.init_local(2, timeout=30)
    works = [a.all_reduce(np.ones(5, np.float32))]
    errors = []
    try:
        works.append(b.all_reduce(np.ones(6, np.float32)))
    except shardline.Error as e:
        errors.append(e)
    for w in works:
        with pytest.raises(shardline.Error) as info:
            w.wait(30)
        errors.append(info.value)
        assert isinstance(w.exception(), shardline.RemoteError)
    assert len(errors) == 2
    for e in errors:
        assert isinstance(e, shardline.RemoteError) and e.peer_error is True, repr(e)
        assert re.search(r"rank 0 called all_reduce\(count=5, f32, sum\) but rank 1 called "
                         r"all_reduce\(count=6, f32, sum\)", str(e)), str(e)


def test_mismatch_across_processes(launch):
    result = launch(2, ["errors_worker.py", "mismatch"], timeout=90)
    assert result.returncode == 0, result.describe()
    lines = result.lines("MISMATCH rank")
    assert len(lines) == 2, result.describe()
    for line in lines:
        # Both sizes named; a disagreement caused by a peer is a RemoteError (InvalidArgument
        # with the peer payload), on every rank.
        assert "RemoteError [INVALID_ARGUMENT]" in line, result.describe()
        assert "ranks disagree on the collective" in line, result.describe()
        assert "rank 0 called all_reduce(count=5, f32, sum)" in line, result.describe()
        assert "rank 1 called all_reduce(count=6, f32, sum)" in line, result.describe()
    # Afterwards the communicator is aborted with that error.
    after = result.lines("AFTER rank")
    assert len(after) == 2 and all("count=5" in l and "count=6" in l for l in after), \
        result.describe()


def test_killed_peer(launch):
    """Rank 2 of 3 SIGKILLs itself; both survivors raise within the communicator's timeout
    (15 s, far below the 600 s default) and say which peer is gone. --grace keeps the
    launcher from terminating the survivors before they report."""
    timeout = 15
    result = launch(3, ["errors_worker.py", "kill", timeout], grace=60, timeout=90)
    assert result.returncode == 128 + 9, result.describe()  # the killed rank's signal
    assert "rank 2" in result.output and "SIGKILL" in result.output, result.describe()
    lines = result.lines("SURVIVOR rank")
    assert sorted(l.split()[2] for l in lines) == ["0", "1"], result.describe()
    for line in lines:
        elapsed = float(line.split()[4])
        assert elapsed < timeout + 5, result.describe()
        assert "RemoteError" in line or "DeadlineExceededError" in line, result.describe()
        assert re.search(r"rank(\(s\))? 2\b", line), result.describe()  # names the dead rank
        # A peer's fault on every survivor, the one that noticed the death first included.
        assert "peer_error=True" in line, result.describe()


def test_shrink_after_an_abort():
    """Rank 1 of 3 is lost: the survivors shrink the aborted world without it and reduce."""
    comms = shardline.init_local(3, timeout=30)
    comms[0].abort()
    with pytest.raises(shardline.Error):
        comms[2].all_reduce(np.ones(3, np.float32)).wait(30)
    small = [comms[r].shrink([1], timeout=30) for r in (0, 2)]
    assert [(s.rank, s.size) for s in small] == [(0, 2), (1, 2)]
    values = [np.arange(7, dtype=np.float32) * (r + 1) for r in (0, 2)]
    works = [s.all_reduce(v) for s, v in zip(small, values)]
    for w in works:
        w.wait(30)
    for v in values:
        np.testing.assert_array_equal(v, np.arange(7, dtype=np.float32) * 4)
    with pytest.raises(ValueError, match="rank 0 cannot exclude itself"):
        comms[0].shrink([0])
