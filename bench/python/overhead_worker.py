"""One rank of the Python overhead benchmark: the perf binaries' timing, from Python.

    shardline-launch -n 2 -- python bench/python/overhead_worker.py \
        --collective all_reduce --bytes 8 --memory empty --iters 2000 --warmup 200 --out r.json

Run by bench/python/overhead_bench.py (which compares it with bench/perf's binaries in the same
run); usable alone. It repeats what bench/perf/runner.cc does for one size (-b == -e), step for
step, with the collectives issued from Python:

  * buffers: a send and a receive buffer of --bytes each; all-reduce uses `count` = bytes / 4
    float32 elements of each, all-gather the first bytes / (4 n) of send and all of receive
    (size = the gathered size, as nccl-tests); in place the input is receive itself
    (all-reduce) or this rank's block of it (all-gather, a view made once before timing);
  * a sync is a waited-for one-element float64 all-reduce (runner.cc's Sync);
  * warm-up: two bursts of --warmup out-of-place calls (runner.cc warms up at the largest, then
    the smallest size; here both are --bytes);
  * per placement (out of place, then in place): inputs written, one call, a sync, then the timed
    burst — --iters calls issued back to back, dropping each Work, then a wait for the last one
    (they run in order on the communicator's stream) — time / iters, averaged over the ranks;
    then --check checked calls (#wrong summed over the ranks), untimed.

The timed calls are written as a user writes them: `comm.all_reduce(x)`,
`comm.all_reduce(x, output=y)`, `comm.all_gather(out, inp)`.

--memory picks where the tensors live:
  empty        shardline.empty(..., framework="numpy"): shardline's shareable host memory, as
               the perf binaries' (arena blocks from SHARDLINE_HOST_SHAREABLE_BYTES)
  empty-torch  shardline.empty(..., framework="torch"): the same memory as torch tensors
  numpy        numpy.empty: numpy's private memory
  torch        torch.empty: torch's private memory

Rank 0 writes {"out_of_place": {"time_us", "wrong"}, "in_place": {...}, ...} to --out.
"""

import argparse
import json
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--collective", choices=["all_reduce", "all_gather"], required=True)
    p.add_argument("--bytes", type=int, required=True,
                   help="size in bytes (as the perf binaries' -b/-e)")
    p.add_argument("--memory", choices=["empty", "empty-torch", "numpy", "torch"], required=True)
    p.add_argument("--iters", type=int, default=20, help="timed calls per placement (-n)")
    p.add_argument("--warmup", type=int, default=5, help="calls per warm-up burst (-w)")
    p.add_argument("--check", type=int, default=1, help="checked calls per placement (-c)")
    p.add_argument("--timeout", type=float, default=None, help="bound on every wait, seconds")
    p.add_argument("--out", help="rank 0 writes its results here (JSON)")
    args = p.parse_args(argv)
    if args.bytes < 4 or args.iters < 1 or args.warmup < 0 or args.check < 0:
        p.error("--bytes must be >= 4, --iters >= 1, --warmup and --check >= 0")
    return args


class Buffers:
    """The send and receive buffers, as tensors of --memory and as numpy views of them."""

    def __init__(self, shardline, memory, count):
        import numpy

        if memory in ("empty", "empty-torch"):
            framework = "torch" if memory == "empty-torch" else "numpy"
            self.send = shardline.empty(count, "float32", framework=framework)
            self.recv = shardline.empty(count, "float32", framework=framework)
        elif memory == "numpy":
            self.send = numpy.empty(count, numpy.float32)
            self.recv = numpy.empty(count, numpy.float32)
        else:
            import torch

            self.send = torch.empty(count, dtype=torch.float32)
            self.recv = torch.empty(count, dtype=torch.float32)
        torchlike = memory in ("empty-torch", "torch")
        self.send_np = self.send.numpy() if torchlike else self.send
        self.recv_np = self.recv.numpy() if torchlike else self.recv


def input_values(numpy, rank, n, seed):
    """Rank `rank`'s input: small integers (exact in float32, and their sums over a few ranks)."""
    i = numpy.arange(n, dtype=numpy.int64)
    return ((i * 7 + rank * 13 + seed * 5) % 31 - 15).astype(numpy.float32)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import numpy
    import shardline

    comm = shardline.init(timeout=args.timeout) if args.timeout else shardline.init()
    rank, n = comm.rank, comm.size
    count = args.bytes // 4
    per_rank = count // n
    buffers = Buffers(shardline, args.memory, count)
    send, recv = buffers.send, buffers.recv
    scratch = shardline.empty(1, "float64")
    timeout = args.timeout

    # The arguments of one call, per placement; the in-place views are made once, here.
    if args.collective == "all_reduce":
        oop_in, oop_out = send[:count], recv[:count]
        ip_in, ip_out = recv[:count], recv[:count]
    else:
        oop_in, oop_out = send[:per_rank], recv[: per_rank * n]
        ip_in, ip_out = recv[rank * per_rank:(rank + 1) * per_rank], recv[: per_rank * n]

    def scalar(value, op):
        scratch[0] = value
        comm.all_reduce(scratch, op).wait(timeout)
        return float(scratch[0])

    def sync():
        scalar(0.0, "sum")

    # The timed loops, one per form, written out (no per-call indirection).
    if args.collective == "all_reduce":

        def burst_oop(iters):
            for _ in range(iters):
                work = comm.all_reduce(oop_in, output=oop_out)
            work.wait(timeout)

        def burst_ip(iters):
            for _ in range(iters):
                work = comm.all_reduce(ip_out)
            work.wait(timeout)

    else:

        def burst_oop(iters):
            for _ in range(iters):
                work = comm.all_gather(oop_out, oop_in)
            work.wait(timeout)

        def burst_ip(iters):
            for _ in range(iters):
                work = comm.all_gather(ip_out, ip_in)
            work.wait(timeout)

    def init_data(in_place, seed):
        # Sentinel over the output, then this rank's input (also outside timing, as runner.cc).
        out_np = buffers.recv_np
        out_np[: per_rank * n if args.collective == "all_gather" else count] = numpy.nan
        values_n = per_rank if args.collective == "all_gather" else count
        values = input_values(numpy, rank, values_n, seed)
        if not in_place:
            buffers.send_np[:values_n] = values
        elif args.collective == "all_reduce":
            out_np[:count] = values
        else:
            out_np[rank * per_rank:(rank + 1) * per_rank] = values

    def expected(seed):
        if args.collective == "all_reduce":
            return sum(input_values(numpy, r, count, seed).astype(numpy.float64) for r in range(n))
        return numpy.concatenate([input_values(numpy, r, per_rank, seed) for r in range(n)])

    def wrong_count(seed):
        got = buffers.recv_np[: per_rank * n if args.collective == "all_gather" else count]
        return int(numpy.count_nonzero(~(got.astype(numpy.float64) == expected(seed))))

    results = {}
    sync()
    for _ in range(2):  # runner.cc: warm-up at the largest, then at the smallest size
        if args.warmup > 0:
            burst_oop(args.warmup)
    check_seed = 0
    for placement, burst, in_place in (("out_of_place", burst_oop, False),
                                       ("in_place", burst_ip, True)):
        init_data(in_place, 99)
        burst(1)
        sync()
        start = time.perf_counter()
        burst(args.iters)
        seconds = (time.perf_counter() - start) / args.iters
        seconds = scalar(seconds, "avg")  # -a 1: the average over ranks
        wrong = None
        for _ in range(args.check):
            check_seed += 1
            init_data(in_place, check_seed)
            burst(1)
            wrong = int(scalar(float(wrong_count(check_seed)), "sum"))
            if wrong:
                break
        results[placement] = {"time_us": seconds * 1e6, "wrong": wrong}
    sync()

    if rank == 0:
        doc = {"collective": args.collective, "bytes": args.bytes, "memory": args.memory,
               "nranks": n, "iters": args.iters, "warmup": args.warmup, "check": args.check,
               "python": sys.version.split()[0], "numpy": numpy.__version__,
               "shardline": shardline.__version__, "shardline_file": shardline.__file__,
               **results}
        if args.memory in ("torch", "empty-torch"):
            import torch

            doc["torch"] = torch.__version__
        text = json.dumps(doc)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        print(text, flush=True)
    bad = any(r["wrong"] for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
