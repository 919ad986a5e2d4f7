"""Two ranks of test_work.py's exit test: rank 0's last collective times out (rank 1 never joins
it), then rank 0's script ends; its exit must not wait for the collective's own deadline.

    exit_worker.py FIFO kept|dropped

kept: rank 0 still holds the Work whose wait() timed out at exit; dropped: it dropped it. Either
way one more collective, queued behind it and dropped, is pending at exit. Rank 0 prints "LAST
<time>" as its last statement. It holds the FIFO's write end and rank 1 its read end, so rank 1's
read ends when rank 0's process is gone (its files close last): rank 1 prints "GONE <time>".
"""
import os
import sys
import time

import numpy as np

import shardline

fifo, mode = sys.argv[1], sys.argv[2]
world = shardline.init()
world.barrier().wait(30)
if world.rank == 1:
    fd = os.open(fifo, os.O_RDONLY | os.O_CLOEXEC)
    while os.read(fd, 1):  # nothing is written: the read returns b"" once rank 0 is gone
        pass
    print(f"GONE {time.time():.3f}", flush=True)
    sys.exit(0)

fd = os.open(fifo, os.O_WRONLY | os.O_CLOEXEC)  # returns once rank 1 opened the read end
x = np.ones(1000, np.float32)
try:
    if mode == "kept":
        work = world.all_reduce(x)
        work.wait(timeout=1)
    else:
        world.all_reduce(x).wait(timeout=1)
except shardline.DeadlineExceededError as e:
    print(f"TIMEOUT {e}", flush=True)
world.all_reduce(np.ones(5, np.float32))
print(f"LAST {time.time():.3f}", flush=True)
