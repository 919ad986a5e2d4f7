"""The shardline c10d backend's Work (private): a torch Work over the shardline collectives of
one ProcessGroup call, and the thread that completes the futures DDP chains on."""

import datetime
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from .._core import DeadlineExceededError, Error

# Seconds a Work's wait allows beyond the group's timeout: the collective fails by itself at the
# timeout (its error names the missing ranks); the margin only bounds a wait that would hang.
_WAIT_MARGIN_S = 10.0


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


class _Work(dist.Work):
    """A torch Work over the shardline collectives of one ProcessGroup call."""

    def __init__(self, pg, call, result, source=None):
        super().__init__()
        self._source = source  # a receive's: its shardline Work (Work.source names the sender)
        self._pg = pg
        self._collective = call.collective
        self._works = call.works
        self._finish = call.finish
        self._result = result
        self._lock = threading.Lock()
        self._done = False
        self._error = None
        self._future = None
        # CUDA tensors: the collectives are on torch's current stream, so the finishing copies
        # go there now, and an event after them is what wait() makes the waiter's stream wait
        # for (torch's NCCL semantics: no host block).
        self._event = None
        if getattr(call, "cuda", False):
            for f in self._finish:
                f()
            self._finish = ()
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(call.device))

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
        timeout: a timedelta (torch's zero or None: the group's timeout). CUDA tensors: the
        current stream waits for the collective instead (no host block); an error the
        collective already reported is raised, a later one fails the group's next calls."""
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
            if all(w.is_completed() for w in self._works):
                error = self._complete(0.0)
                if error is not None:
                    raise _copy_error(error)
            return True
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

    def _source_rank(self):
        """The rank (in the group) that sent a receive's data, once it is done."""
        if self._source is None:
            raise ValueError(f"shardline backend: {self._collective} has no source rank (only "
                             "a receive has)")
        self._wait_all(self._pg._timeout_s + _WAIT_MARGIN_S)
        return self._source.source

    source_rank = _source_rank

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
