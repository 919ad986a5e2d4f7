"""fully_shard's communicators (FSDP2 keeps its mesh handling in _fsdp_init.py): the default
world that fully_shard(mesh=None) shards over (get_default_world), and what a mesh argument and
an int reshard_after_forward mean for shardline's scheduler."""

import os

import torch

import shardline

__all__ = ["get_default_world", "stream_for"]

_world = None  # the default world communicator over host memory, made once per process
_cuda_world = None  # the default world over CUDA memory (backend nccl), made once per process


def get_default_world(device=None):
    """The communicator over every rank that fully_shard shards over when its mesh is None or a
    torch DeviceMesh: a shardline.Communicator, made at the first call in this process (later
    calls return the same object). Use it for collectives of your own beside a fully_shard'ed
    model, such as a loss averaged over the ranks: get_default_world().all_reduce(t).wait().

    device: None or "cpu" for the world over host memory (backend ucx), which a model on the
    CPU shards over; a CUDA device ("cuda:N", a torch.device; "cuda" is the current device) for
    the world over that device's memory, which a model on it shards over: backend nccl when
    every rank on this host has a GPU of its own, else (ranks that share a GPU: NCCL refuses
    them) ucx staged through pinned host memory. SHARDLINE_CUDA_BACKEND=nccl or ucx chooses.

    The first call (or the first such fully_shard call) joins the world, so every rank makes
    it: under an initialised torch.distributed through torch's store; under torchrun otherwise
    as a client of the store its agent serves (torch's env:// rendezvous); otherwise through
    the launcher's environment (shardline.init())."""
    global _world, _cuda_world
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        if _world is None:
            _world = _join("ucx", "fully_shard", None)
        return _world
    where = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    if _cuda_world is None:
        _cuda_world = _join(_cuda_backend(), "fully_shard.cuda", where)
    elif _cuda_world.device != where:
        raise ValueError(f"get_default_world: this process's CUDA world moves {_cuda_world.device} "
                         f"memory, not {where}'s (one CUDA device per process)")
    return _cuda_world


def _cuda_backend():
    """nccl when each rank on this host has a GPU of its own, else ucx staged through host
    memory; SHARDLINE_CUDA_BACKEND overrides."""
    chosen = os.environ.get("SHARDLINE_CUDA_BACKEND", "")
    if chosen:
        if chosen not in ("nccl", "ucx"):
            raise ValueError(f"SHARDLINE_CUDA_BACKEND={chosen!r}: expected 'nccl' or 'ucx'")
        return chosen
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if local <= torch.cuda.device_count() else "ucx"


def _join(backend, name, device):
    """The world communicator of `backend` moving `device`'s memory (None: the backend's
    default), joined as get_default_world says."""
    dist = torch.distributed
    if (dist.is_available() and not dist.is_initialized()
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        # torchrun: its agent already serves the store at MASTER_PORT; join it as a client
        # (torch's env:// rendezvous), never binding that port a second time.
        store, rank, size = next(dist.rendezvous("env://"))
        return shardline.init_with_store(dist.PrefixStore(f"shardline/{name}", store), rank, size,
                                         backend=backend, name=name, device=device)
    # Under an initialised torch.distributed, shardline.init() rendezvouses through torch's
    # store; otherwise through the launcher's environment.
    return shardline.init(backend=backend, name=name, device=device)


_wrapped = {}  # (device index, cudaStream_t) -> the shardline.Stream over torch's stream


def stream_for(comm):
    """The stream= argument for a collective of `comm` on tensors torch made: None (the
    communicator's own stream) for host memory; for CUDA memory, torch's current stream of the
    device, wrapped (once per stream), so the collective comes after the work that made its
    input and before torch's later work on it, with no host synchronization."""
    if comm.device == "host":
        return None
    device = torch.device(comm.device)
    handle = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, handle)
    if key not in _wrapped:
        _wrapped[key] = shardline.wrap_cuda_stream(handle, device.index,
                                                   f"torch stream {handle:#x}")
    return _wrapped[key]


def _torch_device(comm):
    """The torch device whose memory communicator `comm` moves."""
    return torch.device("cpu") if comm.device == "host" else torch.device(comm.device)


def _module_device(module):
    """The device a fully_shard'ed module computes on, from its parameters: CUDA if they are on
    one CUDA device, else the CPU (the meta device too: materialise it with to_empty on the
    mesh's device). A mix of devices is refused."""
    kinds = {p.device for p in module.parameters() if p.device.type != "meta"}
    if len(kinds) > 1:
        raise ValueError(f"fully_shard: the module's parameters are on {sorted(map(str, kinds))}; "
                         "move the module to one device first")
    device = kinds.pop() if kinds else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"fully_shard: the module's parameters are on {device}; shardline "
                         "computes on the CPU and on CUDA devices")
    return device


_groups = {}  # ranks of a 1-D DeviceMesh over part of the world -> its communicator


def _group(ranks, world):
    """The communicator over `ranks` (a 1-D sub-mesh, as the dp dimension of a (dp, tp) mesh),
    split from the world once per group. Collective over the world: every rank asks for its own
    group at the same point (its fully_shard calls), each group a color."""
    key = (world.device, tuple(ranks))
    if key not in _groups:
        _groups[key] = world.split(min(ranks), ranks.index(world.rank))
    return _groups[key]


def _drop_default_world():
    """At exit (_fsdp_state._release_all): the default worlds go, after the schedulers."""
    global _world, _cuda_world
    _groups.clear()
    _wrapped.clear()
    _world = None
    _cuda_world = None


def _mesh_config(mesh, device=None):
    """(world communicator, strategy, shard_size) of a fully_shard mesh argument, for a module
    on `device` (None: the CPU; a DeviceMesh's device type decides for itself)."""
    if mesh is None:
        return get_default_world(device), "full_shard", 0
    if isinstance(mesh, shardline.Communicator):
        return mesh, "full_shard", 0
    if getattr(mesh, "_shardline_elastic", False):
        # shardline.torch.elastic(): hybrid over each round's groups (_elastic.py).
        return mesh, "hybrid_shard", mesh.shard_size
    device_mesh = getattr(torch.distributed, "device_mesh", None)
    if device_mesh is not None and isinstance(mesh, device_mesh.DeviceMesh):
        if mesh.device_type not in ("cpu", "cuda"):
            raise ValueError(f"fully_shard: the DeviceMesh is on '{mesh.device_type}'; "
                             "shardline.torch.fully_shard computes on 'cpu' and 'cuda'")
        same = device is not None and torch.device(device).type == mesh.device_type
        world = get_default_world(device if same else mesh.device_type)
        ranks = mesh.mesh.flatten().tolist()
        if mesh.ndim == 1 and sorted(ranks) != list(range(world.size)):
            # The dp dimension of a larger mesh (tensor parallel beside it): its own group.
            return _group(ranks, world), "full_shard", 0
        if sorted(ranks) != list(range(world.size)):
            raise NotImplementedError(
                f"fully_shard: the 2-D DeviceMesh covers ranks {ranks}; shardline's scheduler "
                f"shards a 2-D mesh over the whole world of {world.size} ranks")
        if mesh.ndim == 1:
            return world, "full_shard", 0
        if mesh.ndim == 2:
            if ranks != list(range(world.size)):
                raise NotImplementedError(
                    f"fully_shard: the 2-D DeviceMesh's ranks {mesh.mesh.tolist()} are not in "
                    "row-major order; shardline's hybrid mesh shards over consecutive ranks")
            shard_size = mesh.size(1)
            if shard_size == 1:
                return world, "no_shard", 0
            return world, "hybrid_shard", shard_size
        raise ValueError(f"fully_shard: a {mesh.ndim}-D DeviceMesh; FSDP takes 1-D (shard) or "
                         "2-D (replicate, shard)")
    raise TypeError(f"fully_shard: mesh must be None, a shardline.Communicator, a torch "
                    f"DeviceMesh or shardline.torch.elastic(), not {type(mesh).__name__}")


def _reshard_size(k, mesh_config):
    """FSDP2's int reshard_after_forward: reshard to a group of k ranks after forward. As in
    FSDP2, 1 is False and the shard group's size is True; other factors would need a second,
    smaller shard group per unit, which shardline's scheduler does not have."""
    world, strategy, shard_size = mesh_config
    shard = {"full_shard": world.size, "no_shard": 1}.get(strategy, shard_size)
    if k < 1 or k > shard or shard % k:
        raise ValueError(f"fully_shard: reshard_after_forward={k}: as an int it must be a "
                         f"factor of the shard group's size {shard}")
    if k == 1:
        return False
    if k == shard:
        return True
    raise NotImplementedError(
        f"fully_shard: reshard_after_forward={k} (reshard to groups of {k} of the {shard} "
        "shard ranks after forward) is not supported: shardline's scheduler has one shard group "
        f"per unit; pass True (or {shard}) or False (or 1)")
