"""shardline.torch.FullyShardedDataParallel: FSDP1's wrapper API over fully_shard's units and
shardline's scheduler.

    from shardline.torch import FullyShardedDataParallel as FSDP, ShardingStrategy, CPUOffload
    from shardline.torch import ModuleWrapPolicy
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 cpu_offload=CPUOffload(offload_params=True))

Each module the auto-wrap policy picks is wrapped (bottom-up) in its own FullyShardedDataParallel,
which makes the module one unit (fully_shard on it); the outermost wrapper's module takes the
rest and is the root. The wrapper holds the
module as `_fsdp_wrapped_module` (printing shows the wrapped structure); parameter names and
state-dict keys leave that component out, as FSDP1's do. The enums, configs and wrap policies are
torch's own (torch.distributed.fsdp), so code that imports them from torch passes them here too.
docs/pytorch.md's FSDP1 section has the mapping.
"""

import contextlib
import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullStateDictConfig,
                                    MixedPrecision, ShardedStateDictConfig, ShardingStrategy,
                                    StateDictType)
from torch.distributed.fsdp.wrap import (CustomPolicy, ModuleWrapPolicy, _Policy,
                                         always_wrap_policy, lambda_auto_wrap_policy,
                                         size_based_auto_wrap_policy,
                                         transformer_auto_wrap_policy)

from ._clip_grad import clip_grad_norm_
from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_init import _group, get_default_world
from ._fsdp_param_group import _is_dtensor, _place
from ._fully_shard import FSDPModule, _shard
from ._state_dict import _optimizer_params
from ._weights import sync_module_states as _sync_module_states

__all__ = ["BackwardPrefetch", "CPUOffload", "CustomPolicy", "FullStateDictConfig",
           "FullyShardedDataParallel", "MixedPrecision", "ModuleWrapPolicy",
           "ShardedStateDictConfig", "ShardingStrategy", "StateDictType", "always_wrap_policy",
           "lambda_auto_wrap_policy", "size_based_auto_wrap_policy",
           "transformer_auto_wrap_policy"]

_WRAPPED = "_fsdp_wrapped_module"


def _clean(name):
    """A name without the wrappers' component, as FSDP1 reports it."""
    return name.replace(f"{_WRAPPED}.", "")


class FullyShardedDataParallel(nn.Module):
    """FSDP1's FullyShardedDataParallel (torch.distributed.fsdp), with its constructor's
    arguments and defaults, on shardline's scheduler.

    process_group / device_mesh: the group to shard over (default: the world); HYBRID_SHARD
    takes a 2-D DeviceMesh (replicate, shard) or a pair (intra-node group, inter-node group).
    sharding_strategy: FULL_SHARD (default; a unit reshards after forward), SHARD_GRAD_OP
    (kept from forward to backward), NO_SHARD (replicated, DDP-like), HYBRID_SHARD and
    _HYBRID_SHARD_ZERO2 (full shard / shard-grad-op within the shard dimension, replicated over
    the other). cpu_offload=CPUOffload(offload_params=True): the scheduler's cpu_offload.
    mixed_precision: param_dtype and reduce_dtype as the scheduler's; buffer_dtype casts the
    floating buffers (state dicts hold them in their original dtypes, as FSDP1's do).
    auto_wrap_policy: a torch policy object (ModuleWrapPolicy, CustomPolicy) or a
    function policy (module, recurse, nonwrapped_numel) such as transformer_auto_wrap_policy
    and size_based_auto_wrap_policy through functools.partial. ignored_modules: their
    parameters stay outside every unit (replicated, not reduced). param_init_fn: called on each
    module that has meta parameters. device_id: None, "cpu" or a CPU device (shardline.torch
    computes on the CPU). sync_module_states: rank 0's parameters and buffers everywhere
    first. limit_all_gathers (default True): the scheduler's budget at two gathered units, or
    the minimum the units need where that is more. backward_prefetch / forward_prefetch: the
    scheduler prefetches one unit ahead in both directions whatever they say.
    use_orig_params: False (the default) gives one flat parameter per unit (FSDP1's
    FlatParameter: the unit's master shard, the root sharded at construction); True the
    original parameters, this rank's slices, by name.
    """

    def __init__(self, module, process_group=None, sharding_strategy=None, cpu_offload=None,
                 auto_wrap_policy=None, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision=None, ignored_modules=None, param_init_fn=None, device_id=None,
                 sync_module_states=False, forward_prefetch=False, limit_all_gathers=True,
                 use_orig_params=False, ignored_states=None, device_mesh=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel: module must be an nn.Module, not "
                            f"{type(module).__name__}")
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(f"FullyShardedDataParallel: sharding_strategy {strategy!r} is not a "
                            "ShardingStrategy")
        if device_id is not None and (isinstance(device_id, int)
                                      or torch.device(device_id).type != "cpu"):
            raise ValueError(f"FullyShardedDataParallel: device_id {device_id!r}; "
                             "shardline.torch computes on the CPU (None or 'cpu')")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError("FullyShardedDataParallel: backward_prefetch must be a "
                            "BackwardPrefetch or None")
        ignored = list(ignored_modules or []) + [m for m in (ignored_states or [])
                                                 if isinstance(m, nn.Module)]
        if any(not isinstance(m, nn.Module) for m in ignored_states or []):
            raise NotImplementedError("FullyShardedDataParallel: ignored_states of parameters; "
                                      "pass their modules as ignored_modules")
        if param_init_fn is not None:
            for m in list(module.modules()):
                if any(p.is_meta for p in m.parameters(recurse=False)):
                    param_init_fn(m)
        elif any(p.is_meta for p in module.parameters()):
            module.to_empty(device="cpu")
            for m in module.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        mesh_config, torch_mesh = _mesh_of(strategy, process_group, device_mesh)
        if sync_module_states:
            _sync_module_states(module, mesh=torch_mesh if torch_mesh is not None
                                else mesh_config[0])
        mp = mixed_precision or MixedPrecision()
        if mp.buffer_dtype is not None:
            for m in module.modules():
                original = {}
                for name, b in m._buffers.items():
                    if b is not None and b.is_floating_point() and b.dtype != mp.buffer_dtype:
                        original[name] = b.dtype
                        m._buffers[name] = b.to(mp.buffer_dtype)
                if original:
                    m._register_state_dict_hook(
                        functools.partial(_buffers_in_original_dtypes, original))
        config = dict(
            mesh_config=mesh_config,
            reshard_after_forward=strategy in (ShardingStrategy.FULL_SHARD,
                                               ShardingStrategy.HYBRID_SHARD),
            mp_policy=MixedPrecisionPolicy(param_dtype=mp.param_dtype,
                                           reduce_dtype=mp.reduce_dtype,
                                           cast_forward_inputs=mp.cast_forward_inputs
                                           or mp.cast_root_forward_inputs),
            offload_policy=(CPUOffloadPolicy() if cpu_offload is not None
                            and cpu_offload.offload_params else OffloadPolicy()),
            device_mesh=torch_mesh)
        ignored_ids = {id(m) for i in ignored for m in i.modules()}
        for parent, name, child in _targets(module, auto_wrap_policy, ignored_ids):
            setattr(parent, name, FullyShardedDataParallel._wrap(child, config, ignored))
        self._fsdp_setup(module, config, ignored)
        self.sharding_strategy = strategy
        self.use_orig_params = use_orig_params
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        # Read by the root's scheduler when it is made (_Root.initialize: the budget).
        module._shardline_state.limit_all_gathers = limit_all_gathers
        if not use_orig_params:
            _make_flat_parameters(self)

    @classmethod
    def _wrap(cls, module, config, ignored):
        """A wrapper made by the auto-wrap policy (FSDP1's nested FullyShardedDataParallel)."""
        wrapper = cls.__new__(cls)
        nn.Module.__init__(wrapper)
        wrapper._fsdp_setup(module, config, ignored)
        return wrapper

    def _fsdp_setup(self, module, config, ignored):
        self._fsdp_wrapped_module = module
        self._fsdp_state_dict_type = StateDictType.FULL_STATE_DICT
        self._fsdp_state_dict_config = FullStateDictConfig()
        self._fsdp_full_units = None  # units this wrapper unshard()ed for a full state dict
        # The wrapped module keeps its class's name (FSDP1 prints the wrapped structure so).
        _shard(module, config["mesh_config"], config["reshard_after_forward"],
               config["mp_policy"], config["offload_policy"], config["device_mesh"], ignored,
               class_name=type(module).__name__)
        self._register_state_dict_hook(_clean_state_dict_keys)
        self.register_state_dict_pre_hook(_before_full_state_dict)
        self._register_load_state_dict_pre_hook(_add_wrapped_prefix, with_module=True)

    # ---- the module
    @property
    def module(self):
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules[_WRAPPED], name)  # as FSDP1 forwards them

    def __getitem__(self, key):
        return self._fsdp_wrapped_module.__getitem__(key)

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """As FSDP1's: without `_fsdp_wrapped_module.` in the names; with
        use_orig_params=False, one flat parameter per unit (`<wrapper>._flat_param`) in place
        of the parameters it holds."""
        flat = {}  # id of a parameter a flat parameter holds -> (name, that flat parameter)
        for name, m in self.named_modules(prefix=prefix):
            if isinstance(m, FullyShardedDataParallel):
                st = m._fsdp_wrapped_module._shardline_state
                if st.flat_param is not None:
                    for p in st.params:
                        flat[id(p)] = (_clean(f"{name}.{_WRAPPED}._flat_param" if name
                                              else f"{_WRAPPED}._flat_param"), st.flat_param)
        given = set()
        for name, p in super().named_parameters(prefix=prefix, recurse=recurse,
                                                 remove_duplicate=remove_duplicate):
            if id(p) in flat:
                name, p = flat[id(p)]
                if id(p) in given:
                    continue
                given.add(id(p))
            yield _clean(name), p

    def _original_parameters(self):
        return [p for _, p in nn.Module.named_parameters(self)]

    def named_buffers(self, *args, **kwargs):
        for name, b in super().named_buffers(*args, **kwargs):
            yield _clean(name), b

    # ---- training
    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate unsharded (no reduction) in the backwards inside; the first
        backward after it reduces them all."""
        inner = self._fsdp_wrapped_module
        inner.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """The global norm of every gradient under this wrapper, as shardline.torch.clip_grad_norm_
        (clips in place; returns the norm)."""
        return clip_grad_norm_(self._original_parameters(), max_norm, norm_type)

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module, recurse=True, writeback=True, rank0_only=False,
                           offload_to_cpu=False, with_grads=False):
        """Inside, every unit under `module` (with recurse=False: only its own) holds its full
        parameters (FSDP1's summon_full_params; collective, between steps). writeback=True
        writes changes back into the shards at the exit; False drops them. with_grads is not
        supported."""
        if with_grads:
            raise NotImplementedError("summon_full_params(with_grads=True)")
        units = _units_under(module, recurse)
        for m in units:
            m.unshard()
        try:
            yield
        finally:
            for m in units:
                if writeback:
                    m.reshard()
                else:
                    _drop_full(m._shardline_state)

    # ---- state dicts
    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
        """Inside, state_dict() of every wrapper under `module` gives `state_dict_type`:
        FULL_STATE_DICT (the default: whole tensors; FullStateDictConfig's rank0_only keeps them
        on rank 0) or SHARDED_STATE_DICT (DTensors in the original shapes, as
        docs/pytorch.md says)."""
        if state_dict_type not in (StateDictType.FULL_STATE_DICT,
                                   StateDictType.SHARDED_STATE_DICT):
            raise NotImplementedError(f"FullyShardedDataParallel: {state_dict_type} (FULL_ and "
                                      "SHARDED_STATE_DICT are supported)")
        wrappers = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        before = [(w._fsdp_state_dict_type, w._fsdp_state_dict_config) for w in wrappers]
        config = state_dict_config or (FullStateDictConfig()
                                       if state_dict_type == StateDictType.FULL_STATE_DICT
                                       else ShardedStateDictConfig())
        for w in wrappers:
            w._fsdp_state_dict_type, w._fsdp_state_dict_config = state_dict_type, config
        try:
            yield
        finally:
            for w, (kind, cfg) in zip(wrappers, before):
                w._fsdp_state_dict_type, w._fsdp_state_dict_config = kind, cfg

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        """The optimizer's state dict keyed by parameter names (as named_parameters() gives
        them), in the form of the model's state_dict_type: FULL_STATE_DICT whole tensors
        (rank0_only: on rank 0 only), SHARDED_STATE_DICT DTensors. Collective."""
        osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        osd = _unflatten(model, optim, osd)
        names = _optimizer_names(model, optim)
        full = model._fsdp_state_dict_type == StateDictType.FULL_STATE_DICT
        names = osd.pop("_names", names)
        state = {}
        for pid, values in osd["state"].items():
            state[names[pid]] = {k: v.full_tensor() if full and _is_dtensor(v) else v
                                 for k, v in values.items()}
        groups = [{**g, "params": [names[pid] for pid in g["params"]]}
                  for g in osd["param_groups"]]
        if full and getattr(model._fsdp_state_dict_config, "rank0_only", False) and \
                torch.distributed.get_rank() != 0:
            return {}
        return {"state": state, "param_groups": groups}

    @staticmethod
    def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False,
                                 load_directly=False, group=None):
        """optim_state_dict's result (whole tensors or DTensors, keyed by name) as the state
        dict optim.load_state_dict takes (keyed by the optimizer's parameter order; the
        optimizer's hook cuts each tensor to this rank's slice). load_directly=True loads it
        too."""
        if _flat_units(optim):
            osd = _flatten(model, optim, optim_state_dict)
        else:
            names = _optimizer_names(model, optim)
            ids = {name: pid for pid, name in names.items()}
            osd = {"state": {ids[name]: dict(values)
                             for name, values in optim_state_dict["state"].items()},
                   "param_groups": _groups_in_order(optim, optim_state_dict)}
        if load_directly:
            optim.load_state_dict(osd)
        return osd


def _optimizer_names(model, optim, params=None):
    """{index in the optimizer's state dict: the parameter's name in `model`} (params: the
    parameters in that numbering, by default the optimizer's)."""
    by_id = {}
    for name, p in model.named_parameters():
        by_id.setdefault(id(p), name)
    for name, p in nn.Module.named_parameters(model):  # the originals a flat one holds
        by_id.setdefault(id(p), _clean(name))
    if params is None:
        params = _optimizer_params(optim)
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"FullyShardedDataParallel: the optimizer's parameters {missing} are "
                         "not parameters of the model")
    return {i: by_id[id(p)] for i, p in enumerate(params)}


def _make_flat_parameters(wrapper):
    """use_orig_params=False: the root is initialised now (FSDP1 shards at construction) and
    each unit's master shard becomes one parameter, FSDP1's FlatParameter, sharing its memory
    with the unit's parameters (their slices are views of it)."""
    from ._fsdp_state import _lazy_root
    try:
        root = _lazy_root(wrapper._fsdp_wrapped_module._shardline_state)
    except RuntimeError as e:
        raise NotImplementedError(
            "FullyShardedDataParallel(use_orig_params=False) shards at construction, so a "
            "wrapper made before it (nested by hand) cannot join its units: wrap submodules "
            "through auto_wrap_policy, or pass use_orig_params=True") from e
    for st in root.units:
        st.flat_param = nn.Parameter(root.scheduler.master_shard(st.unit),
                                     requires_grad=any(p.requires_grad for p in st.params))
        # Its .grad is the unit's sharded gradient: clip_grad_norm_ and ShardedGradScaler
        # reduce over the ranks what they find on it.
        st.flat_param._shardline_flat_unit = st


def _flat_units(optim):
    """{id(flat parameter): its unit's state} for the optimizer's flat parameters."""
    from ._fsdp_state import _roots
    flat = {id(st.flat_param): st for root in list(_roots) for st in root.units
            if st.flat_param is not None}
    return {id(p): flat[id(p)] for p in _optimizer_params(optim) if id(p) in flat}


def _unflatten(model, optim, osd):
    """An optimizer state dict over flat parameters as one over the parameters they hold:
    each element-wise state cut into the parameters' slices (then made DTensors), the scalars
    (AdamW's step) repeated; param_groups list those parameters. Unchanged without flat
    parameters."""
    units = _flat_units(optim)
    if not units:
        return osd
    from ._state_dict import _states_to_dtensors
    flat_params = _optimizer_params(optim)
    originals, states, expand = [], {}, {}
    for pid, flat in enumerate(flat_params):
        st = units.get(id(flat))
        if st is None:
            expand[pid] = [len(originals)]
            originals.append(flat)
            if pid in osd["state"]:
                states[expand[pid][0]] = dict(osd["state"][pid])
            continue
        expand[pid] = []
        for p, (offset, length) in zip(st.params, st.slices):
            k = len(originals)
            expand[pid].append(k)
            originals.append(p)
            if pid in osd["state"]:
                states[k] = {name: v[offset:offset + length].clone()
                             if isinstance(v, torch.Tensor) and v.dim() == 1
                             and v.numel() == flat.numel() else v
                             for name, v in osd["state"][pid].items()}
    _states_to_dtensors(originals, states)
    groups = [{**g, "params": [k for pid in g["params"] for k in expand[pid]]}
              for g in osd["param_groups"]]
    names = _optimizer_names(model, optim, originals)
    out = {"state": {k: v for k, v in states.items()}, "param_groups": groups}
    # Keyed by index over `originals`; optim_state_dict names them with this mapping.
    out["_names"] = names
    return out


def _flatten(model, optim, named_osd):
    """The inverse of _unflatten for loading: states keyed by the held parameters' names
    (DTensors or whole tensors) into one state per flat parameter, in the optimizer's
    numbering."""
    from ._state_dict import _slice_of
    units = _flat_units(optim)
    flat_params = _optimizer_params(optim)
    name_of = {}
    for name, p in nn.Module.named_parameters(model):
        name_of.setdefault(id(p), _clean(name))
    state = {}
    for pid, flat in enumerate(flat_params):
        st = units.get(id(flat))
        if st is None:
            if name_of[id(flat)] in named_osd["state"]:
                state[pid] = dict(named_osd["state"][name_of[id(flat)]])
            continue
        held = [named_osd["state"].get(name_of[id(p)]) for p in st.params]
        present = [h for h in held if h is not None]
        if not present:
            continue
        out = {}
        for key, value in present[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                buf = torch.zeros(flat.numel(), dtype=value.dtype)
                for i, h in enumerate(held):
                    if h is not None:
                        offset, length = st.slices[i]
                        buf[offset:offset + length] = _slice_of(st, i, h[key], scalars=False)
                out[key] = buf
            else:
                out[key] = value  # a scalar (AdamW's step): the same for every held one
        state[pid] = out
    return {"state": state, "param_groups": _groups_in_order(optim, named_osd)}


def _groups_in_order(optim, named_osd):
    """The named state dict's param_groups (their hyperparameters) with the optimizer's own
    parameter order: load_state_dict pairs the saved ids with the optimizer's parameters by
    position."""
    if len(named_osd["param_groups"]) != len(optim.param_groups):
        raise ValueError(f"FullyShardedDataParallel: the state dict has "
                         f"{len(named_osd['param_groups'])} param groups, the optimizer "
                         f"{len(optim.param_groups)}")
    groups, pid = [], 0
    for saved, group in zip(named_osd["param_groups"], optim.param_groups):
        n = len(group["params"])
        groups.append({**saved, "params": list(range(pid, pid + n))})
        pid += n
    return groups


def _mesh_of(strategy, process_group, device_mesh):
    """((world, strategy, shard_size), torch DeviceMesh or None) for FSDP1's arguments."""
    from ._fsdp_init import _mesh_config
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if device_mesh is not None:
        if hybrid != (device_mesh.ndim == 2):
            raise ValueError(f"FullyShardedDataParallel: {strategy.name} with a "
                             f"{device_mesh.ndim}-D device_mesh")
        world, kind, shard = _mesh_config(device_mesh)
        if strategy == ShardingStrategy.NO_SHARD:
            kind = "no_shard"
        return (world, kind, shard), device_mesh
    dist = torch.distributed
    world = get_default_world()
    if hybrid:
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError(f"FullyShardedDataParallel: {strategy.name} needs a 2-D "
                             "device_mesh or process_group=(intra-node group, inter-node group)")
        shard = dist.get_world_size(process_group[0])
        if dist.get_process_group_ranks(process_group[0]) != list(
                range(world.rank // shard * shard, world.rank // shard * shard + shard)):
            raise NotImplementedError("FullyShardedDataParallel: the intra-node group must be "
                                      "consecutive ranks (row-major), as shardline's hybrid "
                                      "mesh shards over them")
        return (world, "hybrid_shard", shard), None
    if process_group is not None and dist.get_world_size(process_group) != world.size:
        ranks = dist.get_process_group_ranks(process_group)
        comm = _group(ranks, world)
        return (comm, "no_shard" if strategy == ShardingStrategy.NO_SHARD else "full_shard",
                0), None
    if strategy == ShardingStrategy.NO_SHARD:
        return (world, "no_shard", 0), None
    return (world, "full_shard", 0), None


def _targets(root, policy, ignored_ids):
    """(parent, attribute name, module) of each module the auto-wrap policy wraps, children
    before their parents (FSDP1 wraps bottom-up); never the root."""
    if policy is None:
        return []
    if isinstance(policy, _Policy):
        chosen = policy._run_policy(root, set(), {})
        wanted = {id(m) for m in chosen if m is not root and id(m) not in ignored_ids}
    else:
        wanted = set()

        def visit(module):  # FSDP1's recursive wrap: returns the parameters it wrapped
            if id(module) in ignored_ids:
                return 0
            numel = sum(p.numel() for p in module.parameters())
            if not policy(module=module, recurse=True, nonwrapped_numel=numel):
                return 0
            wrapped = sum(visit(child) for child in module.children())
            rest = numel - wrapped
            if module is not root and policy(module=module, recurse=False,
                                             nonwrapped_numel=rest):
                wanted.add(id(module))
                return numel
            return wrapped

        visit(root)
    out = []

    def post_order(parent):
        for name, child in parent.named_children():
            post_order(child)
            if id(child) in wanted:
                out.append((parent, name, child))

    post_order(root)
    return out


def _units_under(module, recurse):
    if not recurse:
        inner = module._fsdp_wrapped_module if isinstance(module, FullyShardedDataParallel) \
            else module
        return [inner] if isinstance(inner, FSDPModule) else []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _drop_full(st):
    """Ends an unshard() without writing back: the module holds its shards again."""
    st.full = None
    _place(st, st.params)


def _before_full_state_dict(module, prefix, keep_vars):
    """state_dict()'s pre-hook on a wrapper: FULL_STATE_DICT unshards every unit under it (the
    outermost wrapper of the call does), so the module's state dict holds whole tensors."""
    if module._fsdp_state_dict_type != StateDictType.FULL_STATE_DICT:
        return
    if any(getattr(u._shardline_state, "in_full_state_dict", False)
           for u in _units_under(module, True)):
        return  # an outer wrapper's call
    units = _units_under(module, True)
    for u in units:
        u.unshard()
        u._shardline_state.in_full_state_dict = True
    module._fsdp_full_units = units


def _clean_state_dict_keys(module, state_dict, prefix, local_metadata):
    """state_dict()'s post-hook on a wrapper: keys without `_fsdp_wrapped_module.`; for a full
    state dict, copies of the whole tensors (on rank 0 only with rank0_only), and the units
    resharded."""
    inner = prefix + f"{_WRAPPED}."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    units = module._fsdp_full_units
    if units is None:
        return
    module._fsdp_full_units = None
    try:
        rank0_only = getattr(module._fsdp_state_dict_config, "rank0_only", False)
        keep = not (rank0_only and units and units[0]._shardline_state.mesh[0].rank != 0)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            value = state_dict[key]
            if not keep:
                del state_dict[key]
            elif isinstance(value, torch.Tensor):
                state_dict[key] = value.full_tensor() if _is_dtensor(value) else \
                    value.detach().clone()
    finally:
        for u in units:
            u._shardline_state.in_full_state_dict = False
            u.reshard()


def _buffers_in_original_dtypes(original, module, state_dict, prefix, local_metadata):
    """state_dict()'s post-hook on a module whose buffers MixedPrecision.buffer_dtype cast:
    FSDP1 saves them in their original dtypes (`original`: name -> dtype), in full and sharded
    state dicts alike; loading casts back into the buffers' dtype."""
    for name, dtype in original.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = state_dict[prefix + name].to(dtype)


def _add_wrapped_prefix(module, state_dict, prefix, *args):
    """load_state_dict's pre-hook on a wrapper: the keys FSDP1 names (without
    `_fsdp_wrapped_module.`) get it back, so the wrapped module's loading finds them."""
    inner = prefix + f"{_WRAPPED}."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
