"""Collectives from Python: run as `shardline-launch -n 2 -- python examples/python/collectives.py`.

Every rank all-gathers its slice, reduce-scatters and all-reduces, on numpy arrays and a torch
tensor, and checks the results against numpy.
"""
import numpy as np
import shardline

world = shardline.init()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
rank, size = world.rank, world.size
inputs = [np.random.default_rng(r).standard_normal(1001, dtype=np.float32) for r in range(size)]

# Registered memory (the fast path) for the output; any DLPack tensor works as well.
gathered = shardline.empty(1001 * size, "float32")
work = world.all_gather(gathered, inputs[rank])  # returns at once: the collective runs
work.wait(timeout=60)                            # on the communicator's stream
assert np.array_equal(gathered, np.concatenate(inputs))

# Reduce-scatter: this rank receives its slice of the element-wise sum.
full = np.tile(inputs[rank], size)
mine = np.empty(1001, np.float32)
world.reduce_scatter(mine, full, op="sum").wait()
assert np.allclose(mine, sum(inputs), rtol=1e-5)

# All-reduce in place, on a torch tensor (zero-copy through DLPack).
try:
    import torch
    t = torch.from_numpy(inputs[rank].copy())
    world.all_reduce(t, op="max").wait()
    assert np.array_equal(t.numpy(), np.maximum.reduce(inputs))
except ImportError:
    pass

# Errors are exceptions carrying the Status text.
try:
    world.all_gather(np.empty(3, np.float32), inputs[rank])
except ValueError as error:  # shardline.InvalidArgumentError
    assert "all_gather" in str(error)

print(f"rank {rank}: collectives match numpy")
