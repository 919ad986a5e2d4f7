"""State dicts of fully_shard'ed modules.

module.state_dict() gives the sharded form. Under an initialised torch.distributed it is FSDP2's:
each parameter in its original shape as a DTensor sharded on dim 0 over the shard group
(Shard(0) on a 1-D mesh, (Replicate(), Shard(0)) on a 2-D one). Those row chunks are derived from
the flat layout, whose shards cut tensors anywhere, one unit at a time (_to_dtensors: the unit's
shards are all-gathered, each rank copies its chunks out, and the gathered unit is freed before
the next), so torch.distributed.checkpoint (DCP) and the torch.distributed.checkpoint.state_dict
functions work on it as on an FSDP2 model, and each rank's part is about 1/N of the bytes.
Without torch.distributed there is no DeviceMesh for a DTensor: the sharded form is this rank's
1-D slices of the flat shard. load_state_dict() takes DTensors, full tensors and slices
(_load_full_tensors), and full_state_dict() gives the whole tensors (FSDP2's
get_model_state_dict(full_state_dict=True) counterpart), which a fully_shard'ed Hugging Face
model's save_pretrained writes (SavePretrainedFullWeights)."""

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._fsdp_param_group import _from_local, _is_dtensor, _owner

__all__ = ["full_state_dict"]


def _entries(st):
    """(owner state, parameter index, name relative to st's module) of every name under st's
    module that a fully_shard'ed parameter is registered as: st's own slots, then the ties it
    borrows from other units."""
    own = [(st, i, name) for i, names in enumerate(st.slot_names) for name in names
           if name is not None]  # None: a tie under another module (that module's entry)
    return own + list(st.borrowed_names)


def _load_full_tensors(module, state_dict, prefix, *args):
    """load_state_dict's pre-hook on a fully_shard'ed module: a DTensor (the sharded form) or a
    full tensor (the parameter's original shape) for a sharded parameter becomes this rank's
    slice of it, so torch's copy into the sharded parameter works. A DTensor is made whole one
    tensor at a time (full_tensor(): collective over its mesh). Other entries (1-D slices: the
    sharded form without torch.distributed) are kept."""
    st = module._shardline_state
    _before_state_dict(module, prefix, False)  # under torch.distributed: sharded from now on
    for owner, i, name in _entries(st):
        if prefix + name not in state_dict:
            continue
        if owner.root is None or owner.full is not None:
            # The parameters are whole (before the first forward, or unshard()'ed).
            if _is_dtensor(state_dict[prefix + name]):
                state_dict[prefix + name] = state_dict[prefix + name].full_tensor()
            continue
        state_dict[prefix + name] = _slice_of(owner, i, state_dict[prefix + name])


def _slice_of(st, i, value, scalars=True):
    """`value` for parameter i of st as this rank's slice of the flat shard, where it is a form
    of the whole parameter: a DTensor (made whole one tensor at a time), a tensor of the
    parameter's original shape, or, for a tensor-parallel parameter, a tensor of its global
    shape or its tp DTensor. Anything else is returned as it is (1-D slices: the sharded form
    without torch.distributed). scalars=False keeps 0-dim tensors (an optimizer's step)."""
    spec = st.dtensors[i]
    if _is_dtensor(value):
        if spec is not None and value.device_mesh == spec[0] and \
                tuple(value.placements) == spec[1]:
            value = value.to_local()
        else:
            value = value.full_tensor()
    if not isinstance(value, torch.Tensor) or (value.dim() == 0 and not scalars):
        return value
    if spec is not None and tuple(value.shape) == spec[2]:
        value = _tp_chunk(value, spec)
    if tuple(value.shape) == st.shapes[i]:
        t, n = st.tensor_offsets[i], st.slices[i][1]
        return value.reshape(-1)[t:t + n]
    return value


def _tp_chunk(full, spec):
    """This rank's tensor-parallel part of the global tensor `full` (Shard(d): torch.chunk on d,
    as DTensor splits; Replicate: all of it)."""
    mesh, placements = spec[0], spec[1]
    placement = placements[0]
    if placement.is_shard():
        chunks = torch.chunk(full, mesh.size(0), dim=placement.dim)
        return chunks[mesh.get_local_rank(0)]
    return full


def _dtensor_of(st, i, full, mesh):
    """The sharded state-dict DTensor of parameter i from its whole (local) tensor `full`: on
    the shard mesh (_sharded), or for a tensor-parallel parameter its tp DTensor, replicated
    over the shard group."""
    spec = st.dtensors[i]
    return _sharded(full, mesh) if spec is None else _from_local(full.clone(), spec)


def _device_mesh(st):
    """The DeviceMesh of st's DTensors: the one fully_shard was given, or, for the world, a 1-D
    mesh over torch.distributed's world (made once per root). None without torch.distributed, or
    for a shardline.Communicator mesh that is not torch's world."""
    if st.device_mesh is not None:
        return st.device_mesh
    dist = torch.distributed
    world, strategy, _ = st.mesh
    if (not dist.is_available() or not dist.is_initialized() or strategy != "full_shard"
            or dist.get_world_size() != world.size or dist.get_rank() != world.rank):
        return None
    root = st.root
    if root.device_mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        root.device_mesh = init_device_mesh(root.world_device.type, (world.size,))
    return root.device_mesh


def _sharded(full, mesh):
    """This rank's DTensor of the whole tensor `full` on `mesh`: dim 0 chunked over the mesh's
    last dimension (torch.chunk's split, as DTensor's Shard(0)), replicated over a first one; a
    0-dim tensor replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if full.dim() == 0:
        local = full.clone()
        placements = [Replicate()] * mesh.ndim
    else:
        shards = mesh.size(mesh.ndim - 1)
        chunks = torch.chunk(full, shards, dim=0)
        k = mesh.get_local_rank(mesh.ndim - 1)
        # clone: a view would keep the whole gathered tensor alive
        local = chunks[k].clone() if k < len(chunks) else full.new_empty((0,) + full.shape[1:])
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def _before_state_dict(module, prefix, keep_vars):
    """state_dict()'s pre-hook on a fully_shard'ed module: under torch.distributed, a model
    whose first forward has not run yet is initialised now (its parameters become slices of the
    master shards), so its state dict is the sharded DTensors from the start, as FSDP2's is."""
    st = module._shardline_state
    if st.root is None and _world_mesh_possible(st) and not any(
            p.device.type == "meta" for p in module.parameters()):
        from ._fsdp_state import _init_outermost  # (_fsdp_state imports this module's users)
        _init_outermost(st)


def _world_mesh_possible(st):
    dist = torch.distributed
    return st.device_mesh is not None or (
        dist.is_available() and dist.is_initialized() and st.mesh[1] == "full_shard"
        and dist.get_world_size() == st.mesh[0].size)


def _to_dtensors(module, state_dict, prefix, local_metadata):
    """state_dict()'s post-hook on a fully_shard'ed module: its parameters as DTensors in their
    original shapes (see the module docstring). Collective over the world: every rank calls
    state_dict(). Each unit is gathered whole once, and freed before the next."""
    st = module._shardline_state
    if st.root is None:
        return  # before the first forward the parameters are whole
    mesh = _device_mesh(st)
    if mesh is None:
        return  # no torch.distributed: the 1-D slices
    by_owner = {}
    for owner, i, name in _entries(st):
        if owner.full is None and prefix + name in state_dict:
            by_owner.setdefault(id(owner), (owner, []))[1].append((i, name))
    for owner, names in by_owner.values():
        full = owner.root.gather_full(owner)
        made = {}
        for i, name in names:
            if i not in made:  # a tie inside the unit: one DTensor under both names
                made[i] = _dtensor_of(owner, i, full[i], _device_mesh(owner))
            state_dict[prefix + name] = made[i]
        del full


def full_state_dict(module, *, rank0_only=False, cpu_offload=False):
    """module.state_dict() with every fully_shard'ed parameter whole (copies): each unit under
    `module` is unshard()'ed for the call, then resharded. Collective over the world, between
    steps. The keys and shapes are those of the unsharded module, so a plain (never sharded)
    copy of the model takes the result with nn.Module.load_state_dict. (module.state_dict()
    itself gives the sharded form: DTensors, or without torch.distributed this rank's 1-D
    slices; load_state_dict() takes every form.)

    rank0_only: every rank still takes part, but only rank 0 of the world keeps the copies; the
    others get {}. cpu_offload: as in FSDP2's StateDictOptions(full_state_dict=True,
    cpu_offload=True), which gives the state dict to rank 0 only (the tensors are on the CPU
    either way: fully_shard computes on the CPU)."""
    from ._fully_shard import FSDPModule  # (_fully_shard imports this module)

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        keep = True
        if (rank0_only or cpu_offload) and units:
            keep = units[0]._shardline_state.mesh[0].rank == 0
        if not keep:
            return {}
        return {k: (v.full_tensor() if _is_dtensor(v) else v.detach().clone())
                if isinstance(v, torch.Tensor) else v
                for k, v in module.state_dict().items()}
    finally:
        for m in units:
            m.reshard()


class SavePretrainedFullWeights:
    """Mixed into a fully_shard'ed Hugging Face model's class: save_pretrained writes the full
    weights, never this rank's slices."""

    def save_pretrained(self, save_directory, *args, is_main_process=True, state_dict=None,
                        **kwargs):
        """transformers' save_pretrained, called on every rank between steps (collective): the
        weights are full_state_dict(self, rank0_only=True) (rank 0 of the world keeps the
        copies), and only world rank 0 writes (is_main_process=False on a rank
        keeps it from writing). A state_dict passed in is written as it is."""
        st = self._shardline_state
        if state_dict is None and st.root is not None:  # before the first forward: whole
            state_dict = full_state_dict(self, rank0_only=True)
            is_main_process = is_main_process and st.mesh[0].rank == 0
        return super().save_pretrained(save_directory, *args, is_main_process=is_main_process,
                                       state_dict=state_dict, **kwargs)


# ---- Optimizer state ---------------------------------------------------------------------------
# An optimizer's state of a fully_shard'ed parameter is shaped like the parameter: this rank's
# 1-D slice. Under torch.distributed its state_dict() gives each element-wise state (AdamW's
# exp_avg, ...) as the parameter's DTensor would be, and load_state_dict() takes DTensors or full
# tensors back, so get_optimizer_state_dict / set_optimizer_state_dict and DCP work as with
# FSDP2. The hooks are added to an optimizer at its first step (a global step pre-hook; torch's
# get/set_optimizer_state_dict step a fresh optimizer once with zero gradients).

_hooked = weakref.WeakSet()  # the optimizers seen by _on_optimizer_step


def _on_optimizer_step(optimizer, args, kwargs):
    """torch.optim's global step pre-hook: gives an optimizer of fully_shard'ed parameters the
    state-dict hooks, once, and initialises their root if no forward ran yet."""
    if optimizer in _hooked:
        return
    _hooked.add(optimizer)
    owners = {_owner(p) for g in optimizer.param_groups for p in g["params"]} - {None}
    if not owners:
        return
    from ._fsdp_state import _init_outermost
    for st in owners:
        if st.root is None and not any(p.device.type == "meta" for p in st.params):
            _init_outermost(st)
    optimizer.register_state_dict_post_hook(_optimizer_to_dtensors)
    optimizer.register_load_state_dict_pre_hook(_optimizer_from_dtensors)


def _index(st, p):
    return next(i for i, q in enumerate(st.params) if q is p)


def _optimizer_params(optimizer):
    """The optimizer's parameters in its state dict's numbering."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _optimizer_to_dtensors(optimizer, state_dict):
    """The optimizer's state_dict() post-hook: each 1-D state of a fully_shard'ed parameter
    (this rank's slice) becomes the parameter's DTensor in its original shape. Per unit and
    state name, the states are placed in a buffer shaped like the master shard and gathered
    whole once (collective over the world: every rank calls state_dict())."""
    _states_to_dtensors(_optimizer_params(optimizer), state_dict["state"])
    return state_dict


def _states_to_dtensors(params, states):
    """In place: states[k] (a dict of optimizer states) of parameter params[k], for each
    fully_shard'ed one, with its 1-D states as DTensors in the original shape (the
    optimizer's state_dict() post-hook, and FullyShardedDataParallel's optim_state_dict)."""
    per_unit = {}
    for pid, p in enumerate(params):
        st = _owner(p)
        if st is None or st.root is None or st.full is not None or pid not in states:
            continue
        mesh = _device_mesh(st)
        if mesh is None:
            continue
        per_unit.setdefault(id(st), (st, mesh, []))[2].append((pid, _index(st, p)))
    for st, mesh, entries in sorted(per_unit.values(), key=lambda e: e[0].unit):
        names = [k for k, v in states[entries[0][0]].items()
                 if isinstance(v, torch.Tensor) and v.dim() == 1]
        for pid, _ in entries:
            states[pid] = dict(states[pid])  # the live state's dict: never change it
        master = st.root.scheduler.master_shard(st.unit)
        for name in names:
            dtype = states[entries[0][0]][name].dtype
            shard = torch.zeros(master.numel(), dtype=dtype)
            for pid, i in entries:
                offset, length = st.slices[i]
                shard[offset:offset + length] = states[pid][name]
            full = st.root.gather_full(st, shard)
            for pid, i in entries:
                states[pid][name] = _dtensor_of(st, i, full[i], mesh)
            del full


def _optimizer_from_dtensors(optimizer, state_dict):
    """The optimizer's load_state_dict() pre-hook: a DTensor (made whole one tensor at a time)
    or a full tensor in a fully_shard'ed parameter's original shape becomes this rank's
    slice."""
    states = state_dict["state"]
    # As load_state_dict pairs them: the state dict's parameter keys (ids, or FQNs from torch's
    # set_optimizer_state_dict) in its param_groups' order with the optimizer's parameters.
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    for pid, p in zip(keys, _optimizer_params(optimizer)):
        st = _owner(p)
        if st is None or st.root is None or st.full is not None or pid not in states:
            continue
        i = _index(st, p)
        state = dict(states[pid])
        for name, value in state.items():
            local = _slice_of(st, i, value, scalars=False)
            if local is not value:
                state[name] = local.clone()
        states[pid] = state
    return state_dict


register_optimizer_step_pre_hook(_on_optimizer_step)
