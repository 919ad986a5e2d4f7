"""One rank of test_errors.py's multi-process cases; prints one result line per rank that
pytest checks ("MISMATCH ..." / "SURVIVOR ..."), and exits 1 with a message when a rank saw
something other than the expected exception.

    mismatch (2+ ranks): a good all_reduce, then rank 0 all-reduces 5 elements and every other
        rank 6: every rank must raise, naming both counts; the communicator is then aborted.
    kill (3 ranks): after a barrier the last rank SIGKILLs itself; every survivor's all_reduce
        must raise (not hang) well before the communicator's timeout (argv[2] seconds).
"""

import os
import signal
import sys
import time

import numpy as np

import shardline


def describe(e):
    return f"{type(e).__name__} [{getattr(e, 'code', '?')}] {e}"


def mismatch(world):
    rank = world.rank
    x = np.full(7, rank + 1.0, dtype=np.float32)
    world.all_reduce(x).wait(30)
    total = world.size * (world.size + 1) / 2
    if not np.all(x == total):
        print(f"rank {rank}: warm-up all_reduce gave {x}, expected {total}", flush=True)
        return 1
    n = 5 if rank == 0 else 6
    try:
        world.all_reduce(np.ones(n, dtype=np.float32)).wait(30)
    except shardline.Error as e:
        print(f"MISMATCH rank {rank}: {describe(e)}", flush=True)
        try:
            world.all_reduce(np.ones(3, dtype=np.float32)).wait(30)
        except shardline.Error as after:
            print(f"AFTER rank {rank}: {describe(after)}", flush=True)
            return 0
        print(f"rank {rank}: the communicator still works after the mismatch", flush=True)
        return 1
    print(f"rank {rank}: all_reduce of {n} elements succeeded despite the mismatch", flush=True)
    return 1


def kill(world, timeout):
    rank = world.rank
    world.barrier().wait(30)
    if rank == world.size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        world.all_reduce(np.ones(1001, dtype=np.float32)).wait(3 * timeout)
    except shardline.Error as e:
        elapsed = time.monotonic() - start
        print(f"SURVIVOR rank {rank} after {elapsed:.2f} s: peer_error={e.peer_error} "
              f"{describe(e)}", flush=True)
        return 0
    print(f"rank {rank}: all_reduce succeeded without the killed rank", flush=True)
    return 1


def main():
    mode = sys.argv[1]
    if mode == "mismatch":
        return mismatch(shardline.init(timeout=60.0))
    if mode == "kill":
        timeout = float(sys.argv[2])
        return kill(shardline.init(timeout=timeout), timeout)
    print(f"unknown mode {mode!r}", flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
