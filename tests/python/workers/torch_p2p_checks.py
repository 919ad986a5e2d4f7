"""Checks of torch_backend_worker.py (one rank of tests/python/test_torch_backend.py): send and
recv (isend, irecv from any rank, batch_isend_irecv), reduce, gather, scatter and their object
variants, all-to-all with unequal splits, and monitored_barrier, each value-checked against plain
torch computed from every rank's regenerated inputs; the ops gloo has, in f64, bf16 and f32 at
odd sizes, against gloo's own results; and the bytes each rank sends in reduce, gather and
scatter, counted from the communicator's flight records."""

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_reference import close, data, reduce_ref, seed_of, torch_op


def sent_bytes(comm, after):
    """Bytes this rank sent in the operations recorded after `after` (a flight_record_json()
    snapshot), and their kinds: a collective's by its ring algorithm, a send's its message."""
    def records(snapshot):
        doc = json.loads(snapshot)
        return [(r["kind"], r["seq"], r) for r in doc["entries"] + doc["point_to_point"]]
    seen = {(k, s) for k, s, _ in records(after)}
    n = comm.size
    total, kinds = 0, []
    for kind, seq, r in records(comm.flight_record_json()):
        if (kind, seq) in seen:
            continue
        esize = torch.empty(0, dtype=getattr(torch, {"bf16": "bfloat16", "f32": "float32"}.get(
            r["dtype"], "uint8"))).element_size()
        kinds.append(kind)
        if kind in ("reduce_scatter", "all_gather"):
            total += (n - 1) * r["count"] * esize
        elif kind == "all_reduce":
            total += 2 * (n - 1) * r["count"] * esize // n
        elif kind == "send":
            total += r["count"] * esize
    return total, sorted(kinds)


def p2p_checks(checks, rank, world, mode, comm):
    s = "p2p"

    def send_recv():
        to, frm = (rank + 1) % world, (rank - 1) % world
        mine = data(seed_of(20, rank), 1031, torch.float32)
        got = torch.zeros(1031)
        if rank % 2 == 0:
            dist.send(mine, to, tag=7)
            dist.recv(got, frm, tag=7)
        else:
            dist.recv(got, frm, tag=7)
            dist.send(mine, to, tag=7)
        close(got, data(seed_of(20, frm), 1031, torch.float32), "send/recv ring")
        # Into a strided view, and two tags in flight received in the other order.
        full = torch.zeros(9, 4)
        a, b = data(seed_of(21, rank), 9, torch.float32), data(seed_of(22, rank), 5, torch.float32)
        sends = [dist.isend(a, to, tag=1), dist.isend(b, to, tag=2)]
        got_b = torch.zeros(5)
        dist.irecv(got_b, frm, tag=2).wait()
        dist.irecv(full[:, 1], frm, tag=1).wait()
        for w in sends:
            w.wait()
        close(full[:, 1], data(seed_of(21, frm), 9, torch.float32), "recv into a column")
        close(got_b, data(seed_of(22, frm), 5, torch.float32), "tag 2 before tag 1")
        if full[:, 0].abs().sum() != 0:
            raise AssertionError("recv wrote outside its view")
    checks.run(s, "send and recv", send_recv)

    def any_source():
        if rank == 0:
            sources = set()
            for _ in range(world - 1):
                got = torch.zeros(33)
                if mode == "run":
                    src = dist.recv(got)  # from any rank
                else:
                    # torch's wrapper of a Python Backend's Work has no source rank (only wait
                    # and get_future reach the backend): which sender it was, the values say.
                    dist.irecv(got).wait()
                    src = next((r for r in range(1, world) if torch.equal(
                        got, data(seed_of(23, r), 33, torch.float32))), None)
                close(got, data(seed_of(23, src or 0), 33, torch.float32), f"from rank {src}")
                sources.add(src)
            if sources != set(range(1, world)):
                raise AssertionError(f"sources {sources}")
        else:
            dist.send(data(seed_of(23, rank), 33, torch.float32), 0)
    checks.run(s, "recv from any source", any_source)

    def batch():
        to, frm = (rank + 1) % world, (rank - 1) % world
        out_next = data(seed_of(24, rank, 0), 65, torch.bfloat16)
        out_prev = data(seed_of(24, rank, 1), 65, torch.bfloat16)
        in_prev, in_next = torch.zeros(65, dtype=torch.bfloat16), torch.zeros(65,
                                                                               dtype=torch.bfloat16)
        ops = [dist.P2POp(dist.irecv, in_prev, frm), dist.P2POp(dist.isend, out_next, to),
               dist.P2POp(dist.irecv, in_next, to), dist.P2POp(dist.isend, out_prev, frm)]
        if world == 2:  # the two neighbours are one rank: one message each way per tag
            ops = ops[:2]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        close(in_prev, data(seed_of(24, frm, 0), 65, torch.bfloat16), "batch from previous")
        if world > 2:
            close(in_next, data(seed_of(24, to, 1), 65, torch.bfloat16), "batch from next")
    checks.run(s, "batch_isend_irecv", batch)

    for dtype in (torch.float32, torch.bfloat16):
        for n in (7, 1031):
            for k, op in enumerate(("sum", "avg", "min", "max", "product", "premul")):
                def reduce(dtype=dtype, n=n, op=op, k=k):
                    for root in range(world):
                        inputs = [data(seed_of(25, k, n, root, r), n, dtype).view(n, 1)
                                  for r in range(world)]
                        t = inputs[rank].clone()
                        dist.reduce(t, dst=root, op=torch_op(op))
                        if rank == root:
                            close(t, reduce_ref(inputs, op), f"reduce {op} to {root}")
                        else:
                            close(t, inputs[rank], "a non-root's tensor")
                checks.run(s, f"reduce {op} {dtype} n={n}", reduce)

    def gather_scatter():
        for root in range(world):
            inputs = [data(seed_of(26, root, r), 13, torch.float32) for r in range(world)]
            outs = [torch.zeros(13) for _ in range(world)] if rank == root else None
            dist.gather(inputs[rank], outs, dst=root)
            if rank == root:
                for r in range(world):
                    close(outs[r], inputs[r], f"gather to {root} [{r}]")
            pieces = [data(seed_of(27, root, r), 11, torch.bfloat16) for r in range(world)]
            got = torch.zeros(11, dtype=torch.bfloat16)
            dist.scatter(got, pieces if rank == root else None, src=root)
            close(got, pieces[rank], f"scatter from {root}")
        objs = [{"rank": r, "values": list(range(r + 2)), "name": "x" * (3 * r + 1)}
                for r in range(world)]
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(objs[rank], gathered, dst=0)
        if rank == 0 and gathered != objs:
            raise AssertionError(f"gather_object: {gathered}")
        out = [None]
        dist.scatter_object_list(out, objs if rank == world - 1 else None, src=world - 1)
        if out[0] != objs[rank]:
            raise AssertionError(f"scatter_object_list: {out[0]}")
    checks.run(s, "gather, scatter and their object variants", gather_scatter)

    def uneven_all_to_all():
        def rows(src, dst):  # rows rank src sends rank dst
            return (src + 2 * dst) % 3 + (1 if src == dst else 0)
        inputs = [data(seed_of(28, r), sum(rows(r, j) for j in range(world)) * 3,
                       torch.float32).view(-1, 3) for r in range(world)]
        in_splits = [rows(rank, j) for j in range(world)]
        out_splits = [rows(i, rank) for i in range(world)]
        out = torch.full((sum(out_splits), 3), -1.0)
        dist.all_to_all_single(out, inputs[rank], out_splits, in_splits)
        want = []
        for i in range(world):
            start = sum(rows(i, j) for j in range(rank))
            want.append(inputs[i][start:start + rows(i, rank)])
        close(out, torch.cat(want), "all_to_all_single with unequal splits")
        lists_in = [data(seed_of(29, rank, j), rank + j + 1, torch.float32) for j in range(world)]
        lists_out = [torch.zeros(i + rank + 1) for i in range(world)]
        dist.all_to_all(lists_out, lists_in)
        for i in range(world):
            close(lists_out[i], data(seed_of(29, i, rank), i + rank + 1, torch.float32),
                  f"all_to_all lists of unequal sizes [{i}]")
    checks.run(s, "all-to-all with unequal splits", uneven_all_to_all)

    def monitored():
        dist.monitored_barrier(timeout=timedelta(seconds=30))
        dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
        if rank == 0:
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=0))
                raise AssertionError("a zero timeout passed")
            except RuntimeError as e:
                if "Rank 0 timed out in monitoredBarrier" not in str(e):
                    raise
        # Rank 1 stays away from a group of its own: rank 0 names it; the others say they got
        # there (the failure aborts that group's communicator only).
        group = dist.new_group(backend="shardline")
        if rank == 1:
            return
        try:
            dist.monitored_barrier(group, timeout=timedelta(seconds=1), wait_all_ranks=True)
            raise AssertionError("the barrier passed without rank 1")
        except RuntimeError as e:
            want = ("Ranks 1 failed to pass monitoredBarrier in 1000 ms" if rank == 0 else
                    f"Rank {rank} successfully reached monitoredBarrier")
            if want not in str(e):
                raise AssertionError(f"{e!r} does not say {want!r}") from None
    if mode == "run":  # monitored_barrier needs the group's CPU backend in torch's registry
        checks.run(s, "monitored_barrier", monitored)

    def bytes_moved():
        # reduce: a reduce-scatter, then the shard to the root; gather and scatter: only the
        # root's share. n elements of f32, n a multiple of the ranks.
        n, esize = 1024 * world, 4
        for what, fn, want in (
                ("reduce", lambda: dist.reduce(torch.ones(n), dst=0),
                 (world - 1) * n * esize // world + (0 if rank == 0 else n * esize // world)),
                ("gather", lambda: dist.gather(torch.ones(n), [torch.zeros(n) for _ in range(
                    world)] if rank == 0 else None, dst=0), 0 if rank == 0 else n * esize),
                ("scatter", lambda: dist.scatter(torch.zeros(n), [torch.ones(n)] * world
                                                 if rank == 0 else None, src=0),
                 (world - 1) * n * esize if rank == 0 else 0)):
            before = comm().flight_record_json()
            fn()
            got, kinds = sent_bytes(comm(), before)
            if got != want or {"all_reduce", "all_gather"} & set(kinds):
                raise AssertionError(f"{what}: rank {rank} sent {got} bytes in {kinds}, want "
                                     f"{want}")
    checks.run(s, "bytes each rank sends", bytes_moved)

    def versus_gloo():
        # The same calls on the world (shardline) and on a gloo group; gloo has no AVG (checked
        # against plain torch above).
        gloo = dist.new_group(backend="gloo")
        n = 1031
        for d, dtype in enumerate((torch.float64, torch.bfloat16, torch.float32)):
            x = data(seed_of(30, d, rank), n * world, dtype)
            shard = x[:n].clone()

            def both(fn, what):
                got = fn(None)
                want = fn(gloo)
                for i, (a, b) in enumerate(zip(got, want)):
                    close(a, b, f"{what} {dtype} [{i}] against gloo")
            both(lambda g: _gathered(shard, world, g), "all_gather_into_tensor")
            both(lambda g: [_reduced_scatter(x, world, g)], "reduce_scatter_tensor")
            for op in ("sum", "min", "max", "product"):
                both(lambda g, op=op: [_all_reduced(x[:n], op, g)], f"all_reduce {op}")
            both(lambda g: _reduced_to(x[:n], 1 % world, rank, g), "reduce")
            both(lambda g: _gathered_to(shard, world, rank, g), "gather")
            both(lambda g: [_scattered(x, world, rank, g)], "scatter")
            both(lambda g: [_uneven_all_to_all(x, world, rank, g)], "all_to_all_single uneven")
    checks.run(s, "the ops gloo has, against gloo", versus_gloo)


def _gathered(shard, world, group):
    out = torch.empty(shard.numel() * world, dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard, group=group)
    return [out]


def _reduced_scatter(x, world, group):
    out = torch.empty(x.numel() // world, dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _all_reduced(x, op, group):
    t = x.clone()
    dist.all_reduce(t, op=torch_op(op), group=group)
    return t


def _reduced_to(x, root, rank, group):
    t = x.clone()
    dist.reduce(t, dst=root, group=group)
    return [t] if rank == root else []


def _gathered_to(shard, world, rank, group):
    outs = [torch.empty_like(shard) for _ in range(world)] if rank == 0 else None
    dist.gather(shard, outs, dst=0, group=group)
    return outs or []


def _scattered(x, world, rank, group):
    out = torch.empty(x.numel() // world, dtype=x.dtype)
    dist.scatter(out, list(x.chunk(world)) if rank == world - 1 else None, src=world - 1,
                 group=group)
    return out


def _uneven_all_to_all(x, world, rank, group):
    def rows(src, dst):
        return (3 * src + dst) % 4 + 1
    send = [rows(rank, j) for j in range(world)]
    recv = [rows(i, rank) for i in range(world)]
    out = torch.empty(sum(recv), dtype=x.dtype)
    dist.all_to_all_single(out, x[:sum(send)].contiguous(), recv, send, group=group)
    return out

