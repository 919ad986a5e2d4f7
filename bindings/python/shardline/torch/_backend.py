"""The torch.distributed backend "shardline": shardline's collectives as a Python ProcessGroup
(the group where shardline is the only backend) or a Python c10d Backend (the CPU part of a
device map such as "cpu:shardline,cuda:nccl").

torch calls a Python ProcessGroup's methods directly from Python, and both classes' methods from
C++ (DDP's reducer, torch's dispatcher) through its pybind11 trampolines; each method issues
shardline collectives on the group's communicator and returns a `_Work` at once. The
communicator's rendezvous goes through the store torch gives the creator
(`_core.init_with_store`), so shardline opens no store or port of its own.

Why Python classes and not a C++ Backend (libtorch in the build): a C++ backend would tie the
module to one torch ABI, while the Python classes serve every torch the package installs beside.
The ProcessGroup keeps its own Work (is_completed, exception, source ranks), which torch's
wrapper of a Python Backend's Work would hide. Where torch's Python asks a group for its device
backend (batch_isend_irecv, monitored_barrier), the ProcessGroup answers for the CPU itself.

The methods live by job: _backend_collectives.py (the collectives), _backend_p2p.py (send,
receive, and the ops built on them), _backend_work.py (the Work and its futures),
_backend_calls.py (argument checks and staging).
"""

import atexit
import datetime
import sys
import weakref

import torch
import torch.distributed as dist

from torch._C._distributed_c10d import Backend as C10DBackend

from .. import _core
from ._backend_collectives import _Collectives
from ._backend_p2p import _init_p2p, _PointToPoint
from ._backend_work import _WAIT_MARGIN_S, _live_completers

__all__ = ["BackendShardline", "ProcessGroupShardline", "register"]

BACKEND_NAME = "shardline"

_live_groups = weakref.WeakSet()


@atexit.register
def _shut_down_groups():
    # torch's C++ may hold a group past the interpreter's end: release the communicators while
    # Python still runs (the base package's exit handler then waits for what is in flight).
    for group in list(_live_groups):
        group.shutdown()
    for completer in list(_live_completers):
        completer.close(timeout=30.0)


class _Group(_PointToPoint, _Collectives):
    """What both classes below share: joining the group's communicator, the operations, and
    the lifetime. The concrete class supplies rank() and size()."""

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
        # CUDA tensors' communicators, one per device, joined at their first collective
        # (_Collectives._device_comm) through the same store.
        self._store, self._comm_name, self._device_comms = store, name, {}
        self._completer_obj = None
        _init_p2p(self)
        _live_groups.add(self)

    def _adopt(self, group):
        """Joins `group`'s communicator instead of a new one."""
        self._timeout_s, self._label, self._comm = group._timeout_s, group._label, group._comm
        self._store, self._comm_name = group._store, group._comm_name
        self._device_comms = group._device_comms  # shared: one communicator per device
        self._completer_obj = None
        _init_p2p(self)
        _live_groups.add(self)

    def getBackendName(self):
        return BACKEND_NAME

    @property
    def communicator(self):
        """The shardline Communicator under this group."""
        return self._comm

    def __repr__(self):
        return f"<{type(self).__name__} {self._label} rank {self.rank()} of {self.size()}>"

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
        self._device_comms.clear()
        self._close_p2p_streams()
        _live_groups.discard(self)


class ProcessGroupShardline(_Group, dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives are shardline's (CPU tensors, and CUDA
    tensors on a GPU machine): what
    init_process_group("shardline") and new_group(backend="shardline") create. torch calls its
    methods directly (Python) or through its trampoline (C++: DDP), so the Work they return is
    this module's, with every Work method."""

    def __init__(self, store, rank, size, timeout, group_name=None, global_ranks=None):
        # (rank, size): the constructor whose instance the subclass is in every torch from 2.11
        # on (2.11 refuses the (store, rank, size) one for a Python subclass).
        dist.ProcessGroup.__init__(self, rank, size)
        self._group_name = ""
        self._group_desc = ""
        self._join(store, rank, size, timeout, group_name, global_ranks)
        # The group's CPU backend, over the same communicator: what torch's C++ dispatches to
        # (functional collectives) and what its Python asks for (batch_isend_irecv,
        # monitored_barrier). Calls on the group itself stay this class's.
        # A torch whose c10d Backend a Python class cannot construct (2.11) gets the group
        # alone: its methods serve every call made on the group, not torch's C++ dispatch.
        self._cpu_backend = None
        if _python_backends():
            self._cpu_backend = BackendShardline(store, rank, size, timeout, group_name,
                                                 global_ranks, _share=self)
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                                   self._cpu_backend)
            if torch.cuda.is_available():
                # The same object serves CUDA tensors too (its device communicators).
                self._register_backend(torch.device("cuda"),
                                       dist.ProcessGroup.BackendType.CUSTOM, self._cpu_backend)
            self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

    def shutdown(self):
        if self._cpu_backend is not None:
            self._cpu_backend.shutdown()
        super().shutdown()

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



class BackendShardline(_Group, C10DBackend):
    """The same collectives as a c10d Backend: the CPU part of a group whose other devices have
    other backends ("cpu:shardline,cuda:nccl"), which a Python ProcessGroup cannot be (torch
    makes a ProcessGroup returned by a creator the whole group).

    torch hands Python callers its own wrapper of a Python backend's Work, which forwards only
    wait() and get_future(): through it is_completed() stays False, exception() None, and a
    receive from any rank cannot name its sender (torch 2.15). wait() and futures are exact.
    A ProcessGroupShardline also registers one as its CPU backend, for torch's dispatcher."""

    # torch's trampoline reads its Backend's bool properties through Python attribute lookup,
    # which, where the subclass does not define them, finds the base property and calls back
    # into the trampoline without end (torch 2.15: batch_isend_irecv's supports_coalescing).
    supports_splitting = property(lambda self: False)
    supports_coalescing = property(lambda self: False)
    _supports_time_estimate = property(lambda self: False)
    supports_shrinking = property(lambda self: False)
    supports_reconfigure = property(lambda self: False)
    supports_window = property(lambda self: False)

    def __init__(self, store, rank, size, timeout, group_name=None, global_ranks=None,
                 _share=None):
        C10DBackend.__init__(self, rank, size)
        if _share is None:
            self._join(store, rank, size, timeout, group_name, global_ranks)
        else:  # the CPU backend of a ProcessGroupShardline: its communicator
            self._adopt(_share)


class _ShutDown:
    """Stands for the communicator of a group that was shut down."""

    def __init__(self, label):
        self._label = label

    def __getattr__(self, name):
        raise RuntimeError(f"shardline backend: {self._label} was shut down "
                           "(destroy_process_group); create a new group")


_python_backends_ok = None


def _python_backends():
    """Whether this torch lets a Python class construct a c10d Backend (2.15 does; 2.11's
    Backend has no constructor for Python subclasses)."""
    global _python_backends_ok
    if _python_backends_ok is None:
        class Probe(C10DBackend):
            pass
        try:
            C10DBackend.__init__(Probe.__new__(Probe), 0, 1)
            _python_backends_ok = True
        except TypeError:
            _python_backends_ok = False
    return _python_backends_ok


def _create(options, backend_options=None):
    """torch's creator (extended API): the group's store, rank, size, timeout and name."""
    shares = _shares_group_with_other_backends()
    if shares and not _python_backends():
        raise NotImplementedError(
            f"shardline backend: torch {torch.__version__} cannot take a Python c10d Backend, "
            "which a device map such as 'cpu:shardline,cuda:nccl' needs; use "
            "init_process_group('shardline') alone (it serves CPU and CUDA tensors) or a newer "
            "torch")
    cls = BackendShardline if shares else ProcessGroupShardline
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
    """Registers the backend "shardline" (idempotent): for CPU tensors, and on a machine with a
    GPU for CUDA tensors too (their collectives on nccl, or ucx staged through host memory where
    ranks share a GPU); the torch entry point `torch.distributed.backends: shardline` calls it."""
    if "SHARDLINE" in dist.Backend._plugins:
        return
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)
