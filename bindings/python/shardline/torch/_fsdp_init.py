"""fully_shard's communicators (FSDP2 keeps its mesh handling in _fsdp_init.py): the default
world that fully_shard(mesh=None) shards over (get_default_world), and what a mesh argument and
an int reshard_after_forward mean for shardline's scheduler."""

import os

import torch

import shardline

__all__ = ["get_default_world"]

_world = None  # the default world communicator, made once per process


def get_default_world():
    """The communicator over every rank that fully_shard shards over when its mesh is None or a
    torch DeviceMesh: a shardline.Communicator, made at the first call in this process (later
    calls return the same object). Use it for collectives of your own beside a fully_shard'ed
    model, such as a loss averaged over the ranks: get_default_world().all_reduce(t).wait().

    The first call (or the first such fully_shard call) joins the world, so every rank makes
    it: under an initialised torch.distributed through torch's store; under torchrun otherwise
    as a client of the store its agent serves (torch's env:// rendezvous); otherwise through
    the launcher's environment (shardline.init())."""
    global _world
    if _world is None:
        dist = torch.distributed
        if (dist.is_available() and not dist.is_initialized()
                and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
            # torchrun: its agent already serves the store at MASTER_PORT; join it as a client
            # (torch's env:// rendezvous), never binding that port a second time.
            store, rank, size = next(dist.rendezvous("env://"))
            _world = shardline.init_with_store(dist.PrefixStore("shardline/fully_shard", store),
                                               rank, size, name="fully_shard")
        else:
            # Under an initialised torch.distributed, shardline.init() rendezvouses through
            # torch's store; otherwise through the launcher's environment.
            _world = shardline.init(name="fully_shard")
    return _world


_groups = {}  # ranks of a 1-D DeviceMesh over part of the world -> its communicator


def _group(ranks, world):
    """The communicator over `ranks` (a 1-D sub-mesh, as the dp dimension of a (dp, tp) mesh),
    split from the world once per group. Collective over the world: every rank asks for its own
    group at the same point (its fully_shard calls), each group a color."""
    key = tuple(ranks)
    if key not in _groups:
        _groups[key] = world.split(min(ranks), ranks.index(world.rank))
    return _groups[key]


def _drop_default_world():
    """At exit (_fsdp_state._release_all): the default world goes, after the schedulers."""
    global _world
    _groups.clear()
    _world = None


def _mesh_config(mesh):
    """(world communicator, strategy, shard_size) of a fully_shard mesh argument."""
    if mesh is None:
        return get_default_world(), "full_shard", 0
    if isinstance(mesh, shardline.Communicator):
        return mesh, "full_shard", 0
    if getattr(mesh, "_shardline_elastic", False):
        # shardline.torch.elastic(): hybrid over each round's groups (_elastic.py).
        return mesh, "hybrid_shard", mesh.shard_size
    device_mesh = getattr(torch.distributed, "device_mesh", None)
    if device_mesh is not None and isinstance(mesh, device_mesh.DeviceMesh):
        if mesh.device_type != "cpu":
            raise ValueError(f"fully_shard: the DeviceMesh is on '{mesh.device_type}'; "
                             "shardline.torch.fully_shard computes on the CPU")
        world = get_default_world()
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
