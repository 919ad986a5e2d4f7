"""The torch.distributed backend "shardline": shardline's collectives as a Python ProcessGroup
(the group where shardline is the only backend) or a Python c10d Backend (the CPU part of a
device map such as "cpu:shardline,cuda:nccl").

torch calls a Python ProcessGroup's methods directly from Python, and both classes' methods from
C++ (DDP's reducer, torch's dispatcher) through its pybind11 trampolines; each method issues
shardline collectives on the group's communicator and returns a `_Work` at once. The
communicator's rendezvous goes through the store torch gives the creator
(`_core.init_with_store`), so shardline opens no store or port of its own.
"""

import atexit
import datetime
import queue
import sys
import threading
import weakref

import torch
import torch.distributed as dist

from torch._C._distributed_c10d import Backend as C10DBackend

from .. import _core
from .._core import DeadlineExceededError, Error

__all__ = ["BackendShardline", "ProcessGroupShardline", "register"]

BACKEND_NAME = "shardline"

# torch dtypes shardline reduces (and moves as they are). Other dtypes (bool, int16, complex, ...)
# move as bytes in the collectives that only copy.
_NATIVE_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int32, torch.int64,
})

_RedOpType = dist.ReduceOp.RedOpType
_REDUCE_OPS = {
    _RedOpType.SUM: "sum",
    _RedOpType.AVG: "avg",
    _RedOpType.MIN: "min",
    _RedOpType.MAX: "max",
    _RedOpType.PRODUCT: "product",
}

_SUPPORTED = ("allreduce, allreduce_coalesced, allgather, all_gather_single(_coalesced), "
              "reduce_scatter, reduce_scatter_single(_coalesced), broadcast, "
              "all_to_all_single and alltoall with equal splits, barrier")

# Seconds a Work's wait allows beyond the group's timeout: the collective fails by itself at the
# timeout (its error names the missing ranks); the margin only bounds a wait that would hang.
_WAIT_MARGIN_S = 10.0


def _unsupported(what):
    return NotImplementedError(f"shardline backend: {what} is not supported (supported: "
                               f"{_SUPPORTED})")


def _reduce_op(op, collective):
    """(shardline op name, premultiply factor or None) for a torch ReduceOp."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    if kind == _RedOpType.PREMUL_SUM:
        return "sum", op.factor
    name = _REDUCE_OPS.get(kind)
    if name is None:
        raise _unsupported(f"{collective} with ReduceOp.{getattr(kind, 'name', kind)} "
                           "(SUM, AVG, MIN, MAX, PRODUCT and PREMUL_SUM are)")
    return name, None


def _check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"shardline backend: {what} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout != torch.strided:
        raise _unsupported(f"{what} with layout {t.layout}")
    if t.device.type != "cpu":
        raise ValueError(f"shardline backend: {what} is on {t.device}; this backend moves CPU "
                         "tensors only (a device map such as 'cpu:shardline,cuda:nccl' gives "
                         "other devices other backends)")


class _Call:
    """One ProcessGroup call being issued: its buffers and what to do once its collectives are
    done (copies back into non-contiguous outputs, into list outputs, ...)."""

    def __init__(self, collective):
        self.collective = collective
        self.works = []  # shardline Works
        self.finish = []

    def source(self, t, what, reduce):
        """A contiguous tensor shardline can read with `t`'s values (`t` itself when it is)."""
        _check_tensor(t, what)
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return self._as_moved(t, what, reduce)

    def target(self, t, what, reduce, initial=False):
        """A contiguous tensor shardline writes whose contents end up in `t` (`t` itself when it
        is contiguous; otherwise a copy, holding `t`'s values when `initial`, copied back when
        the collective is done)."""
        _check_tensor(t, what)
        t = t.detach()
        if t.is_contiguous():
            return self._as_moved(t, what, reduce)
        staged = t.contiguous() if initial else torch.empty(t.shape, dtype=t.dtype)
        self.finish.append(lambda: t.copy_(staged))
        return self._as_moved(staged, what, reduce)

    def _as_moved(self, t, what, reduce):
        if t.dtype in _NATIVE_DTYPES:
            return t
        if reduce:
            raise _unsupported(f"{self.collective} of {what} with dtype {t.dtype} (reductions "
                               "take float32/64, float16, bfloat16, int8, uint8, int32, int64)")
        # A collective that only copies moves any dtype as its bytes.
        return t.reshape(-1).view(torch.uint8)


class _Completer:
    """Completes the futures of a group's Works (get_future) on one thread, started when the
    first future is asked for, waiting for the Works in the order their futures were asked for.
    The group's collectives finish in the order they were issued, so a future asked for in issue
    order (DDP's buckets) never waits behind a later collective."""

    def __init__(self, name):
        self._name = name
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def add(self, work):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(work)

    def _run(self):
        while True:
            work = self._queue.get()
            if work is None:
                return
            work._settle_future()
            del work

    def close(self, timeout):
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


_live_completers = weakref.WeakSet()
_live_groups = weakref.WeakSet()


@atexit.register
def _shut_down_groups():
    # torch's C++ may hold a group past the interpreter's end: release the communicators while
    # Python still runs (the base package's exit handler then waits for what is in flight).
    for group in list(_live_groups):
        group.shutdown()
    for completer in list(_live_completers):
        completer.close(timeout=30.0)


class _Work(dist.Work):
    """A torch Work over the shardline collectives of one ProcessGroup call."""

    def __init__(self, pg, call, result):
        super().__init__()
        self._pg = pg
        self._collective = call.collective
        self._works = call.works
        self._finish = call.finish
        self._result = result
        self._lock = threading.Lock()
        self._done = False
        self._error = None
        self._future = None

    # Errors are kept and handed out as fresh copies without tracebacks: a traceback's frames
    # would hold this Work (and its shardline Works), and torch's C++ (a future, DDP) may hold
    # the exception where the garbage collector cannot see the cycle.

    def _complete(self, timeout_s):
        """Waits for every collective, then runs the finishing copies once. Returns None or the
        error (naming the collective), without raising it."""
        if not self._done:
            error, finished = self._wait_works(timeout_s)
            if error is not None and not finished:
                return error  # the wait timed out; the collective still runs
            with self._lock:
                if not self._done:
                    if error is None:
                        for f in self._finish:
                            f()
                    self._error = error
                    self._done, self._works, self._finish = True, (), ()
        return self._error

    def _wait_works(self, timeout_s):
        """(None, True) once every collective succeeded; else (error, whether they finished)."""
        for w in self._works:
            try:
                w.wait(timeout_s)
            except Error as e:
                timed_out = isinstance(e, DeadlineExceededError) and not w.is_completed()
                return self._pg._named_error(self._collective, e), not timed_out
        return None, True

    def _wait_all(self, timeout_s):
        error = self._complete(timeout_s)
        if error is not None:
            raise _copy_error(error)

    def wait(self, timeout=None):
        """Blocks (the GIL released) until the collective is done; raises its error.
        timeout: a timedelta (torch's zero or None: the group's timeout)."""
        if isinstance(timeout, datetime.timedelta) and timeout > datetime.timedelta(0):
            timeout_s = timeout.total_seconds()
        elif isinstance(timeout, (int, float)) and timeout > 0:
            timeout_s = float(timeout)
        else:
            timeout_s = self._pg._timeout_s + _WAIT_MARGIN_S
        self._wait_all(timeout_s)
        return True

    def is_completed(self):
        if self._done:
            return True
        if not all(w.is_completed() for w in self._works):
            return False
        self._complete(0.0)
        return True

    def is_success(self):
        return self.is_completed() and self._error is None

    def exception(self):
        return _copy_error(self._error) if self.is_completed() and self._error else None

    def result(self):
        return self._result

    def get_future(self):
        """A torch.futures.Future that completes (with result(): the output tensors) or fails
        with the collective; DDP's communication hooks chain on it."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = torch.futures.Future()
            ready = self._done
        if ready:
            self._settle_future()
        else:
            self._pg._completer().add(self)
        return self._future

    def _settle_future(self):
        error = self._complete(self._pg._timeout_s + _WAIT_MARGIN_S)
        if error is not None:
            self._future.set_exception(_copy_error(error))
        else:
            self._future.set_result(self._result)


def _copy_error(error):
    """A new exception like `error`: same class, message and attributes, no traceback."""
    copy = type(error)(*error.args)
    copy.__dict__.update(getattr(error, "__dict__", {}))
    return copy


class _Collectives:
    """The collectives of both classes below: each issues shardline collectives on the group's
    communicator and returns a _Work at once; they run on the communicator's shardline stream,
    in call order. The concrete class supplies rank() and size()."""

    def _join(self, store, rank, size, timeout, group_name, global_ranks):
        if isinstance(timeout, datetime.timedelta):
            self._timeout_s = timeout.total_seconds()
        else:
            self._timeout_s = float(timeout)
        self._label = f"group {group_name}" if group_name else "group"
        if global_ranks:
            self._label += f" (global ranks {list(global_ranks)})"
        name = f"torch.pg{group_name}" if group_name else "torch.pg"
        self._comm = _core.init_with_store(store, rank, size, backend="ucx",
                                           timeout=self._timeout_s, name=name)
        self._completer_obj = None
        _live_groups.add(self)

    def getBackendName(self):
        return BACKEND_NAME

    @property
    def communicator(self):
        """The shardline Communicator under this group."""
        return self._comm

    def __repr__(self):
        return f"<{type(self).__name__} {self._label} rank {self.rank()} of {self.size()}>"

    # ---- helpers -------------------------------------------------------------------------------

    def _completer(self):
        if self._completer_obj is None:
            self._completer_obj = _Completer(f"shardline-futures-{self._label}")
            _live_completers.add(self._completer_obj)
        return self._completer_obj

    def _named_error(self, collective, e):
        message = (f"shardline backend: {collective} on {self._label}, rank {self.rank()} of "
                   f"{self.size()}, failed: {e}")
        error = type(e)(message)
        error.code = getattr(e, "code", None)
        error.peer_error = getattr(e, "peer_error", False)
        return error

    def _issue(self, call, fn, *args):
        """Issues one shardline collective of `call`; a refusal raises at once, named."""
        try:
            call.works.append(fn(*args))
        except Error as e:
            raise self._named_error(call.collective, e) from e

    # ---- all-reduce ----------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = dist.AllreduceOptions() if opts is None else opts
        return self._allreduce("allreduce", tensors, opts.reduceOp)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._allreduce("allreduce_coalesced", tensors, opts.reduceOp)

    def _allreduce(self, collective, tensors, reduce_op):
        call = _Call(collective)
        op, factor = _reduce_op(reduce_op, collective)
        for i, t in enumerate(tensors):
            buf = call.target(t, f"tensor {i}", reduce=True, initial=True)
            if factor is not None:
                buf.mul_(factor)
            self._issue(call, self._comm.all_reduce, buf, op)
        return _Work(self, call, list(tensors))

    # ---- all-gather ----------------------------------------------------------------------------

    def all_gather_single(self, output, input, opts=None):
        call = _Call("all_gather_into_tensor")
        self._all_gather_into(call, output, input, "")
        return _Work(self, call, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        call = _Call("all_gather_into_tensor_coalesced")
        if len(outputs) != len(inputs):
            raise ValueError(f"shardline backend: {call.collective}: {len(outputs)} outputs "
                             f"for {len(inputs)} inputs")
        for i, (output, input) in enumerate(zip(outputs, inputs)):
            self._all_gather_into(call, output, input, f" {i}")
        return _Work(self, call, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_into(self, call, output, input, index):
        src = call.source(input, f"input{index}", reduce=False)
        if output.dtype != input.dtype:
            raise ValueError(f"shardline backend: {call.collective}: output{index} is "
                             f"{output.dtype} but input{index} is {input.dtype}")
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"shardline backend: {call.collective}: output{index} has "
                             f"{output.numel()} elements; it needs input{index}'s "
                             f"{input.numel()} x {self.size()} ranks")
        dst = call.target(output, f"output{index}", reduce=False)
        self._issue(call, self._comm.all_gather, dst, src)

    def allgather(self, output_lists, inputs, opts=None):
        # output_lists[i][r] receives input i of rank r.
        return self._allgather_lists("allgather", output_lists, inputs, output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's layout is the other way round: output_lists[r][i] receives input i of rank r.
        collective = "allgather_coalesced"
        if len(output_lists) != self.size():
            raise ValueError(f"shardline backend: {collective}: {len(output_lists)} output lists "
                             f"for {self.size()} ranks (output_lists[rank][i] receives input i "
                             f"of that rank)")
        for r, outputs in enumerate(output_lists):
            if len(outputs) != len(inputs):
                raise ValueError(f"shardline backend: {collective}: output list {r} has "
                                 f"{len(outputs)} tensors for {len(inputs)} inputs")
        per_input = [[output_lists[r][i] for r in range(self.size())] for i in range(len(inputs))]
        return self._allgather_lists(collective, per_input, inputs, output_lists)

    def _check_rank_list(self, collective, tensors, kind, like, like_kind, i):
        """One tensor per rank in list i, each with the dtype and size of `like`."""
        if len(tensors) != self.size():
            raise ValueError(f"shardline backend: {collective}: {kind} list {i} has "
                             f"{len(tensors)} tensors for {self.size()} ranks")
        for j, t in enumerate(tensors):
            _check_tensor(t, f"{kind} {i}[{j}]")
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(
                    f"shardline backend: {collective}: {kind} {i}[{j}] is {t.dtype} with "
                    f"{t.numel()} elements but {like_kind} {i} is {like.dtype} with "
                    f"{like.numel()} (every rank's tensors must match)")

    def _allgather_lists(self, collective, output_lists, inputs, result):
        """All-gathers each of `inputs` into output_lists[i] (one tensor per rank); the Work's
        result is `result`, the caller's lists as given."""
        call = _Call(collective)
        if len(output_lists) != len(inputs):
            raise ValueError(f"shardline backend: {collective}: {len(output_lists)} output "
                             f"lists for {len(inputs)} inputs")
        for i, (outputs, input) in enumerate(zip(output_lists, inputs)):
            self._check_rank_list(collective, outputs, "output", input, "input", i)
            src = call.source(input, f"input {i}", reduce=False)
            flat = torch.empty(input.numel() * self.size(), dtype=input.dtype)
            dst = call.target(flat, f"output list {i}", reduce=False)
            self._issue(call, self._comm.all_gather, dst, src)
            call.finish.append(_copy_chunks(flat, outputs))
        return _Work(self, call, [list(o) for o in result])

    # ---- reduce-scatter ------------------------------------------------------------------------

    def reduce_scatter_single(self, output, input, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        call = _Call("reduce_scatter_tensor")
        self._reduce_scatter_into(call, output, input, opts.reduceOp, "")
        return _Work(self, call, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        call = _Call("reduce_scatter_tensor_coalesced")
        if len(outputs) != len(inputs):
            raise ValueError(f"shardline backend: {call.collective}: {len(outputs)} outputs "
                             f"for {len(inputs)} inputs")
        for i, (output, input) in enumerate(zip(outputs, inputs)):
            self._reduce_scatter_into(call, output, input, opts.reduceOp, f" {i}")
        return _Work(self, call, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_into(self, call, output, input, reduce_op, index):
        op, factor = _reduce_op(reduce_op, call.collective)
        src = call.source(input, f"input{index}", reduce=True)
        if factor is not None:
            src = src * factor
        if output.dtype != input.dtype:
            raise ValueError(f"shardline backend: {call.collective}: output{index} is "
                             f"{output.dtype} but input{index} is {input.dtype}")
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"shardline backend: {call.collective}: input{index} has "
                             f"{input.numel()} elements; it needs output{index}'s "
                             f"{output.numel()} x {self.size()} ranks")
        dst = call.target(output, f"output{index}", reduce=True)
        self._issue(call, self._comm.reduce_scatter, dst, src, op)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = dist.ReduceScatterOptions() if opts is None else opts
        call = _Call("reduce_scatter")
        op, factor = _reduce_op(opts.reduceOp, call.collective)
        if len(outputs) != len(input_lists):
            raise ValueError(f"shardline backend: reduce_scatter: {len(outputs)} outputs for "
                             f"{len(input_lists)} input lists")
        for i, (output, inputs) in enumerate(zip(outputs, input_lists)):
            self._check_rank_list("reduce_scatter", inputs, "input", output, "output", i)
            flat = torch.cat([t.detach().reshape(-1) for t in inputs])
            if factor is not None:
                flat.mul_(factor)
            src = call.source(flat, f"input list {i}", reduce=True)
            dst = call.target(output, f"output {i}", reduce=True)
            self._issue(call, self._comm.reduce_scatter, dst, src, op)
        return _Work(self, call, list(outputs))

    # ---- broadcast, all-to-all, barrier --------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        opts = dist.BroadcastOptions() if opts is None else opts
        call = _Call("broadcast")
        root = opts.rootRank
        if not 0 <= root < self.size():
            raise ValueError(f"shardline backend: broadcast: root {root} is not a rank of "
                             f"{self.size()}")
        if opts.rootTensor != 0:
            raise _unsupported(f"broadcast with rootTensor {opts.rootTensor} (each tensor of "
                               "the list is broadcast from the root rank's same tensor)")
        for i, t in enumerate(tensors):
            buf = call.target(t, f"tensor {i}", reduce=False, initial=True)
            self._issue(call, self._comm.broadcast, buf, root)
        return _Work(self, call, list(tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        call = _Call("all_to_all_single")
        size = self.size()
        for name, t, splits in (("input", input, input_split_sizes),
                                ("output", output, output_split_sizes)):
            _check_tensor(t, name)
            rows = t.shape[0] if t.dim() > 0 else 1
            if rows % size != 0:
                raise ValueError(f"shardline backend: all_to_all_single: {name} has {rows} rows, "
                                 f"not a multiple of the {size} ranks (give split sizes? unequal "
                                 "splits are not supported)")
            if splits and (len(splits) != size or any(s != rows // size for s in splits)):
                raise _unsupported(f"all_to_all_single with unequal splits ({name}_split_sizes="
                                   f"{list(splits)}; only {size} x {rows // size} rows is)")
        if output.dtype != input.dtype or output.numel() != input.numel():
            raise ValueError(f"shardline backend: all_to_all_single: output is {output.dtype} "
                             f"with {output.numel()} elements but input is {input.dtype} with "
                             f"{input.numel()}")
        src = call.source(input, "input", reduce=False)
        dst = call.target(output, "output", reduce=False)
        self._issue(call, self._comm.all_to_all, dst, src)
        return _Work(self, call, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        call = _Call("alltoall")
        size = self.size()
        if len(outputs) != size or len(inputs) != size:
            raise ValueError(f"shardline backend: alltoall: {len(outputs)} outputs and "
                             f"{len(inputs)} inputs for {size} ranks")
        first = inputs[0]
        for name, ts in (("input", inputs), ("output", outputs)):
            for j, t in enumerate(ts):
                _check_tensor(t, f"{name} {j}")
                if t.dtype != first.dtype:
                    raise ValueError(f"shardline backend: alltoall: {name} {j} is {t.dtype} "
                                     f"but input 0 is {first.dtype}")
                if t.numel() != first.numel():
                    raise _unsupported(f"alltoall with unequal sizes ({name} {j} has "
                                       f"{t.numel()} elements, input 0 {first.numel()})")
        flat_in = torch.cat([t.detach().reshape(-1) for t in inputs])
        flat_out = torch.empty_like(flat_in)
        src = call.source(flat_in, "inputs", reduce=False)
        dst = call.target(flat_out, "outputs", reduce=False)
        self._issue(call, self._comm.all_to_all, dst, src)
        call.finish.append(_copy_chunks(flat_out, outputs))
        return _Work(self, call, list(outputs))

    def barrier(self, opts=None):
        call = _Call("barrier")
        self._issue(call, self._comm.barrier)
        return _Work(self, call, [])

    # ---- what shardline does not do ------------------------------------------------------------

    def _refuse(name):  # noqa: N805 - builds methods
        def method(self, *args, **kwargs):
            raise _unsupported(name)
        method.__name__ = name
        method.__doc__ = "Not supported by the shardline backend: raises NotImplementedError."
        return method

    gather = _refuse("gather")
    gather_single = _refuse("gather_single")
    gather_into_tensor = _refuse("gather_into_tensor")
    scatter = _refuse("scatter")
    reduce = _refuse("reduce")
    send = _refuse("send")
    recv = _refuse("recv")
    recv_anysource = _refuse("recv_anysource")
    monitored_barrier = _refuse("monitored_barrier")
    del _refuse

    # ---- lifetime ------------------------------------------------------------------------------

    def abort(self):
        """Fails every collective in flight or issued later, here and on the peers."""
        self._comm.abort()

    def shutdown(self):
        """Waits (bounded) for the futures being completed and releases the communicator (after
        the collectives in flight); destroy_process_group calls it, and so does the
        interpreter's exit for groups still alive then."""
        if self._completer_obj is not None:
            self._completer_obj.close(timeout=self._timeout_s + _WAIT_MARGIN_S)
            self._completer_obj = None
        if not isinstance(self._comm, _ShutDown):
            self._comm = _ShutDown(self._label)
        _live_groups.discard(self)


class ProcessGroupShardline(_Collectives, dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives are shardline's (CPU tensors): what
    init_process_group("shardline") and new_group(backend="shardline") create. torch calls its
    methods directly (Python) or through its trampoline (C++: DDP), so the Work they return is
    this module's, with every Work method."""

    def __init__(self, store, rank, size, timeout, group_name=None, global_ranks=None):
        dist.ProcessGroup.__init__(self, store, rank, size)
        self._group_name = ""
        self._group_desc = ""
        self._join(store, rank, size, timeout, group_name, global_ranks)

    # A ProcessGroup without C++ backends keeps its name and description only if the subclass
    # does (torch's DeviceMesh looks groups up by name).

    def getGroupName(self):
        return self._group_name

    def setGroupName(self, name):
        self._group_name = name

    def getGroupDesc(self):
        return self._group_desc

    def setGroupDesc(self, desc):
        self._group_desc = desc


class BackendShardline(_Collectives, C10DBackend):
    """The same collectives as a c10d Backend: the CPU part of a group whose other devices have
    other backends ("cpu:shardline,cuda:nccl"), which a Python ProcessGroup cannot be (torch
    makes a ProcessGroup returned by a creator the whole group).

    torch hands Python callers its own wrapper of a Python backend's Work, which forwards only
    wait() and get_future(): through it is_completed() stays False and exception() None (torch
    2.15). wait() and futures are exact."""

    def __init__(self, store, rank, size, timeout, group_name=None, global_ranks=None):
        C10DBackend.__init__(self, rank, size)
        self._join(store, rank, size, timeout, group_name, global_ranks)


class _ShutDown:
    """Stands for the communicator of a group that was shut down."""

    def __init__(self, label):
        self._label = label

    def __getattr__(self, name):
        raise RuntimeError(f"shardline backend: {self._label} was shut down "
                           "(destroy_process_group); create a new group")


def _copy_chunks(flat, outputs):
    def copy():
        for j, out in enumerate(outputs):
            out.detach().copy_(flat[j * out.numel():(j + 1) * out.numel()].view(out.shape))
    return copy


def _create(options, backend_options=None):
    """torch's creator (extended API): the group's store, rank, size, timeout and name."""
    cls = BackendShardline if _shares_group_with_other_backends() else ProcessGroupShardline
    return cls(options.store, options.group_rank, options.group_size, options.timeout,
               options.group_id, options.global_ranks_in_group)


def _shares_group_with_other_backends():
    """Whether the group being created maps other devices to other backends. torch tells a
    creator nothing about the group's other devices; its caller (_new_process_group_helper)
    holds them in the local `backend_config` (a BackendConfig). If that is not found, the answer
    is no: the ProcessGroup, which serves every use where shardline is the only backend."""
    try:
        config = sys._getframe(2).f_locals.get("backend_config")
    except ValueError:  # no such frame
        return False
    if not isinstance(config, getattr(dist.distributed_c10d, "BackendConfig", ())):
        return False
    return any(b != BACKEND_NAME for b in config.get_device_backend_map().values())


def register():
    """Registers the backend "shardline" for CPU tensors (idempotent); the torch entry point
    `torch.distributed.backends: shardline` calls it."""
    if "SHARDLINE" in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
