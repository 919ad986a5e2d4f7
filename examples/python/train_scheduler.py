"""FSDP from a Python framework: run as
`shardline-launch -n 2 -- python examples/python/train_scheduler.py`.

A two-layer numpy model, y = tanh(x W1 + b1) W2, trained with SGD on a squared loss. shardline
keeps each layer's parameters sharded over the ranks, gathers them just in time around each
layer's forward and backward (prefetching the next layer), and reduce-scatters the gradients,
averaged over the ranks. At the end every rank checks its shards against the same steps run
unsharded on the whole batch.
"""
import numpy as np
import shardline

world = shardline.init()
rank, size = world.rank, world.size
scheduler = shardline.Scheduler(world, strategy="full_shard", forward_prefetch=1)
specs = {"layer1": [("w", (13, 31)), ("b", (31,))], "layer2": [("w", (31, 5))]}
l1 = scheduler.register_unit("layer1", specs["layer1"])
l2 = scheduler.register_unit("layer2", specs["layer2"])

init = np.random.default_rng(0)
values = {"layer1": [init.standard_normal((13, 31), np.float32) * 0.3, np.zeros(31, np.float32)],
          "layer2": [init.standard_normal((31, 5), np.float32) * 0.3]}
scheduler.set_values(l1, values["layer1"])  # every rank keeps only its shard
scheduler.set_values(l2, values["layer2"])

data = np.random.default_rng(1)
batches = [(data.standard_normal((8 * size, 13), np.float32),
            data.standard_normal((8 * size, 5), np.float32)) for _ in range(3)]
lr = 0.1

for x_all, t_all in batches:
    x, target = x_all[rank::size], t_all[rank::size]  # this rank's part of the batch

    # Forward: a layer's parameters exist between its pre_forward and post_forward.
    scheduler.pre_forward(l1)
    w1, b1 = scheduler.params(l1)
    h = np.tanh(x @ w1 + b1)
    scheduler.post_forward(l1)
    scheduler.pre_forward(l2)
    (w2,) = scheduler.params(l2)
    y = h @ w2
    scheduler.post_forward(l2)
    dy = 2 * (y - target) / y.size

    # Backward, in reverse: gathered again; gradients are added into the unsharded views.
    scheduler.pre_backward(l2)
    (w2,) = scheduler.params(l2)
    (gw2,) = scheduler.grads(l2)
    gw2 += h.T @ dy
    dh = (dy @ w2.T) * (1 - h * h)
    scheduler.post_backward(l2)  # issues layer2's reduce-scatter
    scheduler.pre_backward(l1)
    gw1, gb1 = scheduler.grads(l1)
    gw1 += x.T @ dh
    gb1 += dh.sum(axis=0)
    scheduler.post_backward(l1)
    scheduler.finish_backward()  # waits for the reductions

    for unit in (l1, l2):  # SGD on this rank's shards (gradients averaged over the ranks)
        scheduler.master_shard(unit)[:] -= lr * scheduler.shard_grad(unit)
    scheduler.zero_grad()

# The same steps unsharded, on the whole batch.
(w1, b1), (w2,) = values["layer1"], values["layer2"]
for x, target in batches:
    h = np.tanh(x @ w1 + b1)
    y = h @ w2
    dy = 2 * (y - target) / y.size
    dh = (dy @ w2.T) * (1 - h * h)
    w1, b1, w2 = w1 - lr * (x.T @ dh), b1 - lr * dh.sum(axis=0), w2 - lr * (h.T @ dy)
expected = {"layer1": {"w": w1, "b": b1}, "layer2": {"w": w2}}

for name, unit in (("layer1", l1), ("layer2", l2)):
    shard = scheduler.master_shard(unit)
    for tensor, tensor_offset, shard_offset, length in scheduler.shard_slices(unit):
        want = expected[name][tensor].reshape(-1)[tensor_offset:tensor_offset + length]
        got = shard[shard_offset:shard_offset + length]
        assert np.allclose(got, want, atol=1e-5), f"{name}.{tensor} differs"
print(f"rank {rank}: {scheduler.steps} steps match the unsharded run; {scheduler.metrics()}")
