"""shardline: sharded parameters, gathered just in time, for FSDP / ZeRO-3 training.

    import numpy as np, shardline
    world = shardline.init()                  # torchrun / shardline-launch / mpirun / srun
    x = shardline.empty(1024, "float32")      # registered memory: the fast path
    out = shardline.empty(1024 * world.size, "float32")
    world.all_gather(out, x).wait()

Collectives take any DLPack tensor (numpy, torch, jax) without copying it, return a Work at once
and run on the communicator's shardline stream; the Work keeps the tensors alive until the
collective is done. Errors are exceptions whose class follows the Status code
(InvalidArgumentError is a ValueError, DeadlineExceededError a TimeoutError, RemoteError a dead or
disagreeing peer) and whose message is the Status text.
"""

import atexit as _atexit
import ctypes as _ctypes
import importlib.util as _importlib_util
import os as _os


def _preload_framework_libraries():
    """Loads the CUDA runtime and NCCL that PyTorch's wheels ship, when they are installed.

    The native module links libcudart.so.13 and libnccl.so.2 by soname. Loaded first, the
    toolkit's copies would also serve torch (same sonames) and break its newer NCCL symbols;
    loading torch's copies first makes both use them (NCCL and the CUDA runtime stay
    backward-compatible within a major version).
    """
    spec = _importlib_util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return
    for root in spec.submodule_search_locations:
        for relative in (("cu13", "lib", "libcudart.so.13"), ("nccl", "lib", "libnccl.so.2")):
            path = _os.path.join(root, *relative)
            if _os.path.exists(path):
                try:
                    _ctypes.CDLL(path, mode=_ctypes.RTLD_GLOBAL)
                except OSError:
                    pass


_preload_framework_libraries()

from . import _core  # noqa: E402
from ._core import (  # noqa: E402
    ANY_SOURCE,
    AlreadyExistsError,
    Checkpointer,
    Communicator,
    DataLossError,
    DeadlineExceededError,
    ElasticGroup,
    ElasticRecovery,
    ElasticRound,
    Error,
    FailedPreconditionError,
    InvalidArgumentError,
    Mesh,
    NotFoundError,
    RemoteError,
    ResourceExhaustedError,
    Scheduler,
    StepMetrics,
    Stream,
    Trace,
    UnimplementedError,
    Unit,
    UnitStepMetrics,
    Work,
    __version__,
    export_safetensors,
    host_stream,
    import_safetensors,
    init_local,
    init_with_store,
    sync_module_states,
    wrap_cuda_stream,
)

__all__ = [
    "ANY_SOURCE", "AlreadyExistsError", "Checkpointer", "Communicator", "DataLossError",
    "DeadlineExceededError", "ElasticGroup", "ElasticRecovery", "ElasticRound", "Error",
    "FailedPreconditionError",
    "InvalidArgumentError", "Mesh", "NotFoundError", "RemoteError", "ResourceExhaustedError",
    "Scheduler", "StepMetrics", "Stream", "Trace", "UnimplementedError", "Unit", "UnitStepMetrics",
    "Work", "__version__", "empty", "export_safetensors", "host_stream", "import_safetensors", "init",
    "init_local", "init_with_store", "sync_module_states", "wrap_cuda_stream", "zeros",
]


def init(backend="ucx", rank=None, world_size=None, address=None, timeout=None, name="world",
         device=None):
    """Joins the job and returns the world Communicator (collective over every rank).

    rank, world_size, address ("host:port" of the rendezvous store): explicit values, or (all
    None) the launcher's environment (torchrun / shardline-launch, mpirun, srun). Under an
    initialised torch.distributed (and no explicit values) the rendezvous goes through torch's
    store instead, under the prefix "shardline/<name>": torch already holds MASTER_PORT.
    timeout: seconds bounding the join and every collective (default SHARDLINE_TIMEOUT_S).
    device: the memory the world moves: None (host for ucx, cuda:LOCAL_RANK for nccl), "host"
    or "cuda:N". backend "ucx" with "cuda:N" stages CUDA memory through pinned host memory, for
    ranks that share a GPU (NCCL refuses two ranks on one device).
    """
    dist = _initialized_torch_distributed()
    if dist is not None and rank is None and world_size is None and address is None:
        store = dist.PrefixStore(f"shardline/{name}", dist.distributed_c10d._get_default_store())
        return _core.init_with_store(store, dist.get_rank(), dist.get_world_size(),
                                     backend=backend, timeout=timeout, name=name, device=device)
    return _core.init(backend=backend, rank=rank, world_size=world_size, address=address,
                      timeout=timeout, name=name, device=device)


def _initialized_torch_distributed():
    """torch.distributed if the program imported it and initialised it, else None (the package
    never imports torch itself)."""
    import sys
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _dtype_name(dtype):
    """'float32' for "float32", numpy.float32, numpy.dtype('float32') or torch.float32."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    try:
        import numpy
        return numpy.dtype(dtype).name
    except TypeError:
        raise InvalidArgumentError(f"dtype {dtype!r} is not a dtype shardline knows") from None


def _shape(shape):
    if isinstance(shape, int):
        return [shape]
    return [int(d) for d in shape]


def empty(shape, dtype="float32", framework="numpy"):
    """An uninitialised tensor in shardline's registered host memory.

    Collectives on it take the fast path: from SHARDLINE_HOST_SHAREABLE_BYTES (1 MiB) up it is
    a block of shareable memory that the peers on this host map once and copy from directly
    (shared with forked children, unlike numpy's or torch's own memory), where a
    tensor of numpy's or torch's own memory costs a system call per transfer. framework:
    "numpy" (an ndarray; no bfloat16) or "torch" (a CPU tensor).
    """
    return _core._empty(_shape(shape), _dtype_name(dtype), framework, False)


def zeros(shape, dtype="float32", framework="numpy"):
    """empty(), filled with zeros."""
    return _core._empty(_shape(shape), _dtype_name(dtype), framework, True)


def _report(lines):
    import sys
    for line in lines:
        print(line, file=sys.stderr, flush=True)


def _exit_cleanup():
    """At interpreter exit (docs/embedding.md, "Exit"): aborts the communicators of collectives
    whose wait() timed out and that still run (their peers are late or gone: nothing would end
    them before their own deadline), finishes background checkpoint saves, then waits (at most
    60 s) for collectives whose Work was dropped, which a peer may still wait on. What it
    aborted or could not finish goes to stderr."""
    _report(_core._exit_cleanup(60.0))


def _abort_timed_out():
    """The first step of _exit_cleanup alone: the native module registers it with atexit at the
    first wait() that times out, so that it runs before the exit handlers of adapters imported
    after this package (atexit runs the latest first), which may wait on those collectives."""
    _report(_core._abort_timed_out())


_atexit.register(_exit_cleanup)
