"""The Scheduler from Python: two ranks (init_local(2), one thread each) train a small numpy
MLP for a few SGD steps through the hooks, and the result must match an unsharded float64 run
of the same steps on every element."""

import threading

import numpy as np
import pytest

import shardline

DIMS = [5, 7, 4, 3]  # input, hidden, hidden, output: units of 42, 32 and 15 elements
UNITS = ["embed", "hidden", "head"]
REDUCE_OPS = ["avg", "avg", "sum"]  # the head's gradient is summed over the ranks instead
BATCH = 6
STEPS = 4
LR = 0.1
WORLD = 2


def initial_params():
    rng = np.random.default_rng(1234)
    params = []
    for d_in, d_out in zip(DIMS[:-1], DIMS[1:]):
        params.append([(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32),
                       rng.uniform(-0.5, 0.5, d_out).astype(np.float32)])
    return params


def batch(rank, step):
    rng = np.random.default_rng([rank, step, 99])
    x = rng.standard_normal((BATCH, DIMS[0])).astype(np.float32)
    t = rng.standard_normal((BATCH, DIMS[-1])).astype(np.float32)
    return x, t


def forward(params, x, dtype):
    """Activations [x, a0, a1, y]: tanh after every layer but the last."""
    acts = [x.astype(dtype)]
    for i, (w, b) in enumerate(params):
        z = acts[-1] @ w.astype(dtype) + b.astype(dtype)
        acts.append(np.tanh(z) if i < len(params) - 1 else z)
    return acts


def layer_backward(i, w, acts, d_out):
    """Gradients (dW, db) of layer i and the gradient of its input, given d(loss)/d(output)."""
    d_z = d_out if i == len(DIMS) - 2 else d_out * (1 - acts[i + 1] ** 2)
    return acts[i].T @ d_z, d_z.sum(axis=0), d_z @ w.T


def reference(params):
    """The unsharded run in float64: each step averages (or, for "sum" units, adds) the ranks'
    gradients of 0.5 * mean_batch |y - t|^2, then p -= LR * g."""
    params = [[p.astype(np.float64) for p in layer] for layer in params]
    for step in range(STEPS):
        total = [[np.zeros_like(p) for p in layer] for layer in params]
        for rank in range(WORLD):
            x, t = batch(rank, step)
            acts = forward(params, x, np.float64)
            d = (acts[-1] - t) / BATCH
            for i in reversed(range(len(params))):
                gw, gb, d = layer_backward(i, params[i][0], acts, d)
                total[i][0] += gw
                total[i][1] += gb
        for i, layer in enumerate(params):
            scale = 1.0 / WORLD if REDUCE_OPS[i] == "avg" else 1.0
            for p, g in zip(layer, total[i]):
                p -= LR * scale * g
    return params


def run_rank(world, init, out, time_communication=True):
    s = shardline.Scheduler(world, timeout=30, time_communication=time_communication)
    for name, op, (d_in, d_out) in zip(UNITS, REDUCE_OPS, zip(DIMS[:-1], DIMS[1:])):
        s.register_unit(name, [(f"{name}.w", (d_in, d_out)), (f"{name}.b", (d_out,))],
                        reduce_op=op)
    for u, (w, b) in enumerate(init):
        s.set_values(u, [w, b])
    out["initial"] = [(s.shard_slices(u), s.master_shard(u).copy()) for u in range(len(UNITS))]

    # Calls out of order and unknown units: errors that leave the scheduler usable.
    errors = {}
    for key, call in [("post_forward", lambda: s.post_forward(0)),
                      ("pre_forward unknown", lambda: s.pre_forward(7)),
                      ("params unknown", lambda: s.params(-1)),
                      ("unit_id unknown", lambda: s.unit_id("nope")),
                      ("metrics early", lambda: s.metrics(timeout=5)),
                      ("set_values size", lambda: s.set_values(0, [np.zeros(3, np.float32),
                                                                   init[0][1]]))]:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the test checks the type
            errors[key] = e
    out["errors"] = errors

    metrics = []
    for step in range(STEPS):
        x, t = batch(world.rank, step)
        acts = [x]
        for u in range(len(UNITS)):
            s.pre_forward(u)
            w, b = s.params(u)
            z = acts[-1] @ w + b
            acts.append(np.tanh(z) if u < len(UNITS) - 1 else z)
            s.post_forward(u)
        s.end_forward()
        d = (acts[-1] - t) / BATCH
        for u in reversed(range(len(UNITS))):
            s.pre_backward(u)
            w, _ = s.params(u)
            gw_view, gb_view = s.grads(u)
            gw, gb, d = layer_backward(u, w, acts, d)
            gw_view += gw  # add into the views, never overwrite
            gb_view += gb
            s.post_backward(u)
        s.finish_backward()
        for u in range(len(UNITS)):
            master = s.master_shard(u)
            master -= LR * s.shard_grad(u)
        s.zero_grad()
        metrics.append(s.metrics(timeout=30))
    out["metrics"] = metrics
    out["steps"] = s.steps
    out["final"] = [(s.shard_slices(u), s.master_shard(u).copy()) for u in range(len(UNITS))]
    out["facts"] = dict(num_units=s.num_units, hidden=s.unit_id("hidden"),
                        shard_rank=s.shard_rank, shard_size=s.shard_size,
                        forward_order=list(s.forward_order))
    out["scheduler"] = s  # destroyed on the main thread, after both ranks are done


def unshard(per_rank, u):
    """The unit's full tensors from every rank's (shard_slices, master shard); checks that the
    slices cover every element exactly once and stay inside the shard."""
    names = [f"{UNITS[u]}.w", f"{UNITS[u]}.b"]
    sizes = [DIMS[u] * DIMS[u + 1], DIMS[u + 1]]
    flat = {n: np.full(k, np.nan, np.float64) for n, k in zip(names, sizes)}
    covered = {n: np.zeros(k, np.int64) for n, k in zip(names, sizes)}
    for slices, shard in per_rank:
        used = np.zeros(shard.size, np.int64)
        for name, t_off, s_off, length in slices:
            assert name in flat and length > 0, slices
            assert t_off + length <= flat[name].size and s_off + length <= shard.size, slices
            flat[name][t_off:t_off + length] = shard[s_off:s_off + length]
            covered[name][t_off:t_off + length] += 1
            used[s_off:s_off + length] += 1
        assert used.max(initial=0) <= 1, f"{UNITS[u]}: shard elements used twice: {slices}"
    for n in names:
        assert np.all(covered[n] == 1), f"{n}: elements covered {covered[n].tolist()}"
    return [flat[names[0]].reshape(DIMS[u], DIMS[u + 1]), flat[names[1]]]


def run_world(init, time_communication=True):
    """Every rank's run_rank on a thread; their outputs."""
    worlds = shardline.init_local(WORLD, timeout=30)
    outs = [{} for _ in worlds]
    failures = []

    def target(world, out):
        try:
            run_rank(world, init, out, time_communication)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(f"rank {world.rank}: {type(e).__name__}: {e}")
            world.abort()  # the other rank fails at once instead of at its deadline

    threads = [threading.Thread(target=target, args=(w, o)) for w, o in zip(worlds, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within 120 s"
    assert not failures, "\n".join(failures)
    return outs


def test_scheduler_untimed_trains_the_same_and_leaves_the_times_out():
    init = initial_params()
    timed, untimed = run_world(init), run_world(init, time_communication=False)
    for u in range(len(UNITS)):
        for a, b in zip(unshard([o["final"][u] for o in timed], u),
                        unshard([o["final"][u] for o in untimed], u)):
            np.testing.assert_array_equal(a, b)
    for out in untimed:
        for m in out["metrics"]:
            assert m.exposed_communication is None and m.communication_time is None
            assert m.overlap_fraction is None and m.step_time is not None
            assert all(u.exposed_wait is None for u in m.units)
    assert all(m.exposed_communication is not None for m in timed[0]["metrics"])


def test_scheduler_sgd_matches_unsharded():
    init = initial_params()
    outs = run_world(init)

    for u in range(len(UNITS)):
        # set_values kept each rank's shard of the initial values.
        start = unshard([o["initial"][u] for o in outs], u)
        for got, want in zip(start, init[u]):
            np.testing.assert_array_equal(got, want)
    want = reference(init)
    for u in range(len(UNITS)):
        got = unshard([o["final"][u] for o in outs], u)
        for g, w, name in zip(got, want[u], ("w", "b")):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{UNITS[u]}.{name} after {STEPS} steps")
        # The training moved every parameter tensor.
        assert not np.allclose(got[0], init[u][0])

    for rank, out in enumerate(outs):
        e = out["errors"]
        assert isinstance(e["post_forward"], shardline.FailedPreconditionError), e
        assert "PostForward" in str(e["post_forward"]), e
        assert isinstance(e["pre_forward unknown"], ValueError), e
        assert "no such unit" in str(e["pre_forward unknown"]), e
        assert isinstance(e["params unknown"], ValueError), e
        assert "no unit -1 (3 registered)" in str(e["params unknown"]), e
        assert isinstance(e["unit_id unknown"], shardline.NotFoundError), e
        assert isinstance(e["metrics early"], shardline.FailedPreconditionError), e
        assert isinstance(e["set_values size"], ValueError), e
        assert "embed.w" in str(e["set_values size"]), e

        assert out["steps"] == STEPS
        facts = out["facts"]
        assert facts == dict(num_units=3, hidden=1, shard_rank=rank, shard_size=WORLD,
                             forward_order=[0, 1, 2]), facts
        for i, m in enumerate(out["metrics"]):
            assert m.step in (i, i + 1), m.step
            assert [um.name for um in m.units] == UNITS
            assert all(um.reductions == 1 and um.gathers >= 1 for um in m.units), str(m)
            assert m.bytes_gathered == sum(um.bytes_gathered for um in m.units) > 0
            assert m.bytes_reduced == sum(um.bytes_reduced for um in m.units) > 0
            # Every unit's float32 gradient enters its reduction once (shards may be padded).
            for u, um in enumerate(m.units):
                assert um.bytes_reduced >= 4 * (DIMS[u] + 1) * DIMS[u + 1], str(m)
            assert m.hook_calls >= 4 * len(UNITS) + 1 and m.host_hook_time >= 0
            assert m.peak_inflight_bytes > 0 and m.budget_overshoots == 0
            assert m.step_time is None or m.step_time > 0
            assert m.overlap_fraction is None or 0 <= m.overlap_fraction <= 1
            assert m.order_deviations == 0
            assert "step" in str(m)
    del outs
