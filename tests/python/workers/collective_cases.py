"""Every collective, op, dtype and aliasing form, checked element by element against numpy.

Used by collectives_worker.py (one process per rank, under shardline.launch) and directly by
test_collectives.py at world size 1. Every rank's input is a function of (case, rank) only, so
each rank computes every other rank's input and an independent reference (float64/longdouble
for floating sums, exact modular integer arithmetic for integer sums) for the whole result.

How the C++ side rounds (runtime/host_kernels.h): sums accumulate in rank order in the compute
type (f32 for f16/bf16) and round once when stored; avg is that sum scaled by 1/n (floating:
in the compute type, rounded again; integers: truncating division of the wrapped sum); integer
sums wrap modulo 2^bits; min/max are exact. Reductions take f32, f64, f16, bf16, i32 and i64;
int8 and uint8 only move bytes (all_gather, broadcast, all_to_all), and a reduction on them is
InvalidArgumentError naming the dtype.
"""

import zlib

import numpy as np

import shardline

try:
    import torch
except ImportError:  # the numpy cases still run
    torch = None

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
REDUCIBLE = {"float32", "float64", "float16", "bfloat16", "int32", "int64"}
OPS = ["sum", "avg", "min", "max", "product"]
INT_BITS = {"int8": 8, "uint8": 8, "int32": 32, "int64": 64}
# Relative rounding of one stored result, and of the f32/f64 accumulation.
OUT_EPS = {"float32": 2.0**-23, "float64": 2.0**-52, "float16": 2.0**-10, "bfloat16": 2.0**-7}
ACC_EPS = {"float32": 2.0**-23, "float64": 2.0**-52, "float16": 2.0**-23, "bfloat16": 2.0**-23}
# The smallest subnormal step of each floating dtype (absolute error floor of a rounding).
TINY = {"float32": 2.0**-149, "float64": 2.0**-1074, "float16": 2.0**-24, "bfloat16": 2.0**-133}
SENTINEL = 77


class Mismatch(AssertionError):
    pass


def seed(*parts):
    return zlib.crc32(repr(parts).encode())


def values(case, rank, n, dtype):
    """Rank `rank`'s input of `case`: n values as float64 (floating dtypes, already rounded to
    dtype) or int64 (integer dtypes, over the dtype's whole range so that sums wrap)."""
    rng = np.random.default_rng([seed(case, dtype, n), rank])
    if dtype in INT_BITS:
        info = np.iinfo(np.dtype(dtype))
        return rng.integers(int(info.min), int(info.max), size=n, endpoint=True, dtype=np.int64)
    x = rng.uniform(-4.0, 4.0, size=n)
    # A few exact zeros and tiny magnitudes (subnormal in f16) among the values.
    x[:: max(1, n // 7)] = 0.0
    x[1 :: max(1, n // 5)] *= 1e-6
    return rounded(x, dtype)


def rounded(x, dtype):
    """float64 values rounded to `dtype` (round to nearest even), back as float64."""
    if dtype == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).double().numpy()
    return x.astype(np.dtype(dtype)).astype(np.float64)


def make(x, dtype, framework):
    """A new tensor of `framework` holding the values x (float64/int64) as dtype."""
    if framework == "torch":
        if dtype == "bfloat16":
            return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(x.astype(np.dtype(dtype)))
    return x.astype(np.dtype(dtype))


def filled(n, dtype, framework):
    return make(np.full(n, SENTINEL, dtype=np.int64 if dtype in INT_BITS else np.float64),
                dtype, framework)


def read(t, dtype):
    """A tensor's values as float64/int64 numpy (a copy)."""
    if torch is not None and isinstance(t, torch.Tensor):
        t = t.double() if dtype == "bfloat16" else t
        t = t.numpy()
    t = np.asarray(t)
    return t.astype(np.int64 if dtype in INT_BITS else np.float64)


def wrap(s_u64, dtype):
    """Integers (uint64 modulo 2^64) reduced modulo 2^bits into dtype's range, as int64."""
    bits = INT_BITS[dtype]
    if bits == 64:
        return s_u64.view(np.int64)
    s = (s_u64 & np.uint64((1 << bits) - 1)).astype(np.int64)
    if np.iinfo(np.dtype(dtype)).min < 0:
        s = np.where(s >= (1 << (bits - 1)), s - (1 << bits), s)
    return s


def reference(xs, op, dtype):
    """(expected, tolerance) of reducing the ranks' inputs xs with op; tolerance None: exact."""
    n = len(xs)
    stack = np.stack(xs)
    if op in ("min", "max"):
        return (stack.min(axis=0) if op == "min" else stack.max(axis=0)), None
    if op == "product":
        if dtype in INT_BITS:
            p = np.ones(stack.shape[1], dtype=np.uint64)
            for x in xs:
                p *= x.view(np.uint64)  # wraps modulo 2^64
            return wrap(p, dtype), None
        exact = stack.astype(np.longdouble).prod(axis=0).astype(np.float64)
        # Every step of the reduction may round to dtype: relatively, or by the smallest
        # subnormal step times the factors still to come (|x| <= 4).
        tol = n * (OUT_EPS[dtype] + ACC_EPS[dtype]) * np.abs(exact) + n * TINY[dtype] * 4.0**n
        return exact, tol
    if dtype in INT_BITS:
        s = np.zeros(stack.shape[1], dtype=np.uint64)
        for x in xs:
            s += x.view(np.uint64)  # wraps modulo 2^64
        s = wrap(s, dtype)
        if op == "sum":
            return s, None
        q = s // n  # floor; C++ truncates toward zero
        return q + ((s % n != 0) & (s < 0)), None
    exact = stack.astype(np.longdouble).sum(axis=0)
    absum = np.abs(stack).sum(axis=0)
    if op == "avg":
        exact, absum = exact / n, absum / n
    exact = exact.astype(np.float64)
    roundings = 2 if op == "avg" else 1
    tol = roundings * (OUT_EPS[dtype] * np.abs(exact) + TINY[dtype]) + n * ACC_EPS[dtype] * absum
    return exact, tol


def check(name, got, want, tol, dtype):
    got = read(got, dtype)
    want = np.asarray(want)
    if got.shape != want.shape:
        raise Mismatch(f"{name}: shape {got.shape}, expected {want.shape}")
    if tol is None:
        bad = np.nonzero(got != want)[0]
    else:
        bad = np.nonzero(~(np.abs(got - want) <= tol))[0]
    if bad.size:
        i = int(bad[0])
        extra = "" if tol is None else f" (tolerance {float(np.broadcast_to(tol, want.shape)[i])!r})"
        raise Mismatch(f"{name}: {bad.size} of {want.size} elements differ; first at [{i}]: "
                       f"got {got[i]!r}, expected {want[i]!r}{extra}")


def expect_dtype_error(name, call, dtype):
    short = {"int8": "i8", "uint8": "u8"}[dtype]
    try:
        call()
    except shardline.InvalidArgumentError as e:
        if f"dtype {short} is not supported" not in str(e):
            raise Mismatch(f"{name}: error does not name the dtype: {e}") from None
        return
    raise Mismatch(f"{name}: a reduction of {dtype} was accepted")


class Runner:
    def __init__(self, comm, timeout=60.0):
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.timeout = timeout
        self.count = 0

    def wait(self, work):
        work.wait(self.timeout)
        self.count += 1

    def inputs(self, case, n, dtype):
        return [values(case, r, n, dtype) for r in range(self.size)]

    # ---- the collectives -----------------------------------------------------------------

    def all_gather(self, framework, dtype, n):
        r, size = self.rank, self.size
        case = ("all_gather", n)
        xs = self.inputs(case, n, dtype)
        want = np.concatenate(xs)
        tag = f"all_gather {framework} {dtype} n={n}"
        inp = make(xs[r], dtype, framework)
        out = filled(n * size, dtype, framework)
        self.wait(self.comm.all_gather(out, inp))
        check(tag, out, want, None, dtype)
        check(tag + " (input unchanged)", inp, xs[r], None, dtype)
        # In place: the input is this rank's slice of the output.
        buf = filled(n * size, dtype, framework)
        buf[r * n:(r + 1) * n] = make(xs[r], dtype, framework)
        self.wait(self.comm.all_gather(buf, buf[r * n:(r + 1) * n]))
        check(tag + " in place", buf, want, None, dtype)

    def reduce_scatter(self, framework, dtype, n):
        r, size = self.rank, self.size
        for op in OPS:
            tag = f"reduce_scatter {op} {framework} {dtype} n={n}"
            xs = self.inputs(("reduce_scatter", op), n * size, dtype)
            if dtype not in REDUCIBLE:
                expect_dtype_error(tag, lambda: self.comm.reduce_scatter(
                    filled(n, dtype, framework), make(xs[r], dtype, framework), op), dtype)
                continue
            want, tol = reference(xs, op, dtype)
            mine = slice(r * n, (r + 1) * n)
            inp = make(xs[r], dtype, framework)
            out = filled(n, dtype, framework)
            self.wait(self.comm.reduce_scatter(out, inp, op=op))
            check(tag, out, want[mine], None if tol is None else tol[mine], dtype)
            check(tag + " (input unchanged)", inp, xs[r], None, dtype)
            # In place: the output is this rank's slice of the input.
            buf = make(xs[r], dtype, framework)
            self.wait(self.comm.reduce_scatter(buf[mine], buf, op=op))
            check(tag + " in place", buf[mine], want[mine], None if tol is None else tol[mine],
                  dtype)

    def all_reduce(self, framework, dtype, n):
        r = self.rank
        for op in OPS:
            tag = f"all_reduce {op} {framework} {dtype} n={n}"
            xs = self.inputs(("all_reduce", op), n, dtype)
            if dtype not in REDUCIBLE:
                expect_dtype_error(
                    tag, lambda: self.comm.all_reduce(make(xs[r], dtype, framework), op), dtype)
                continue
            want, tol = reference(xs, op, dtype)
            t = make(xs[r], dtype, framework)
            self.wait(self.comm.all_reduce(t, op))
            check(tag + " in place", t, want, tol, dtype)
            inp = make(xs[r], dtype, framework)
            out = filled(n, dtype, framework)
            self.wait(self.comm.all_reduce(inp, op, output=out))
            check(tag, out, want, tol, dtype)
            check(tag + " (input unchanged)", inp, xs[r], None, dtype)

    def broadcast(self, framework, dtype, n):
        for root in sorted({0, self.size - 1, self.size // 2}):
            tag = f"broadcast root={root} {framework} {dtype} n={n}"
            xs = self.inputs(("broadcast", root), n, dtype)
            t = make(xs[self.rank], dtype, framework)
            self.wait(self.comm.broadcast(t, root=root))
            check(tag, t, xs[root], None, dtype)

    def all_to_all(self, framework, dtype, n):
        r, size = self.rank, self.size
        tag = f"all_to_all {framework} {dtype} n={n} per peer"
        xs = self.inputs(("all_to_all",), n * size, dtype)
        want = np.concatenate([xs[i][r * n:(r + 1) * n] for i in range(size)])
        inp = make(xs[r], dtype, framework)
        out = filled(n * size, dtype, framework)
        self.wait(self.comm.all_to_all(out, inp))
        check(tag, out, want, None, dtype)
        check(tag + " (input unchanged)", inp, xs[r], None, dtype)

    def every_collective(self, framework, dtype, n):
        self.all_gather(framework, dtype, n)
        self.reduce_scatter(framework, dtype, n)
        self.all_reduce(framework, dtype, n)
        self.broadcast(framework, dtype, n)
        self.all_to_all(framework, dtype, n)

    # ---- registered memory (shardline.empty / zeros) ---------------------------------------

    def registered(self, framework, dtype, n):
        """Tensors from shardline.empty()/zeros() as inputs and outputs; from 1 MiB on they are
        shareable memory and the peers on this host copy out of a mapping of them."""
        r, size = self.rank, self.size
        tag = f"registered {framework} {dtype} n={n}"
        xs = self.inputs(("registered", framework), n, dtype)
        inp = shardline.empty(n, dtype, framework=framework)
        inp[:] = make(xs[r], dtype, framework)
        out = shardline.zeros(n, dtype, framework=framework)
        check(tag + " zeros()", out, np.zeros(n), None, dtype)
        want, tol = reference(xs, "sum", dtype)
        self.wait(self.comm.all_reduce(inp, "sum", output=out))
        check(tag + " all_reduce sum", out, want, tol, dtype)
        gathered = shardline.empty((size, n), dtype, framework=framework)
        self.wait(self.comm.all_gather(gathered, inp))
        check(tag + " all_gather", gathered.reshape(-1), np.concatenate(xs), None, dtype)
        self.wait(self.comm.all_reduce(inp, "max"))
        want, _ = reference(xs, "max", dtype)
        check(tag + " all_reduce max in place", inp, want, None, dtype)
        # A plain (unregistered) output receiving from registered inputs.
        plain = filled(n, dtype, framework)
        self.wait(self.comm.all_reduce(gathered[size - 1], "min", output=plain))
        check(tag + " all_reduce min into plain memory", plain, xs[size - 1], None, dtype)


def run_all(comm, frameworks, *, small=1001, large=20011, big=300007, log=print):
    """Every case on `comm` (all ranks call it alike). Raises Mismatch on the first wrong value;
    returns the number of collectives checked."""
    run = Runner(comm)
    for framework in frameworks:
        for dtype in DTYPES:
            if framework == "numpy" and dtype == "bfloat16":
                continue  # numpy has no bfloat16
            run.every_collective(framework, dtype, small)
    # Above SHARDLINE_UCX_SMALL_BYTES (32 KiB per peer): zero-copy and pipelined paths.
    for dtype in ("float32", "int64", "float16"):
        run.every_collective("numpy", dtype, large)
    if "torch" in frameworks:
        run.all_reduce("torch", "bfloat16", large)
        run.reduce_scatter("torch", "bfloat16", large)
    # Registered memory, at least 1 MiB per tensor (shareable).
    run.registered("numpy", "float32", big)
    if "torch" in frameworks:
        run.registered("torch", "bfloat16", 2 * big)
        run.registered("torch", "int64", big // 2)
    log(f"rank {comm.rank} of {comm.size}: {run.count} collectives checked "
        f"({', '.join(frameworks)})")
    return run.count
