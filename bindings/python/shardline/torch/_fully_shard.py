"""shardline.torch.fully_shard: FSDP2's interface over shardline's scheduler.

    from shardline.torch import fully_shard, clip_grad_norm_
    for block in model.blocks:
        fully_shard(block)                     # one scheduler unit per call
    fully_shard(model)                         # the root: its own parameters, one Scheduler
    opt = torch.optim.AdamW(model.parameters())
    loss = model(x).sum(); loss.backward(); clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()

How it maps onto the scheduler (scheduler/scheduler.h):
  * Each fully_shard call makes one unit of the parameters under the module that no nested
    fully_shard call took. The outermost fully_shard'ed module whose forward runs first is the
    root: at that first forward it creates one Scheduler and registers its units, in
    module.modules() order (so every rank registers the same units in the same order).
  * Sharded parameters: the module keeps its nn.Parameter objects; at that lazy initialisation
    each one's .data becomes its slice of this rank's flat master shard (1-D, possibly empty;
    zero-copy), so an optimizer built on model.parameters() steps on the master shards. After a
    backward that reduced, each parameter's .grad is its slice of the sharded gradient.
  * Forward: the module's pre-forward hook calls PreForward, takes the unit's unsharded views
    (the gathered flat buffer, zero-copy) and puts them in place of the parameters on the
    module (module._parameters[name]); the post-forward hook puts the sharded parameters back
    and calls PostForward. A parent's use is split around its children ([root, block0, root,
    block1, root]), so a unit is never in use twice at once.
  * Backward: the views are outputs of an autograd Function (_Gather) whose backward adds the
    unit's parameter gradients into the scheduler's unsharded gradient views; PreBackward runs
    when the first gradient reaches a module's outputs, PostBackward when the gradients of its
    inputs are computed, FinishBackward in a callback queued on the autograd engine.
  * Saved tensors: a forward view saved by autograd (Linear saves its weight) is packed as
    (unit, tensor, geometry) and unpacked as the same view of the backward gather, which may
    live at another address.
"""

import atexit
import dataclasses
import gc
import os
import time
import weakref
from typing import Optional

import torch
import torch.nn as nn

import shardline

__all__ = [
    "CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "clip_grad_norm_",
    "full_state_dict", "fully_shard", "original_shape",
]


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy. param_dtype: the dtype of the unsharded parameters (the
    forward and backward compute, the all-gather); reduce_dtype: of the gradient reduction;
    output_dtype: the root's floating outputs are cast to it; cast_forward_inputs: floating
    inputs of every fully_shard'ed module are cast to param_dtype. None: float32."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """FSDP2's OffloadPolicy: no offloading."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """FSDP2's CPUOffloadPolicy: the master shards and sharded gradients in host memory (the
    scheduler's cpu_offload). pin_memory is accepted for FSDP2 compatibility; on this CPU-only
    path there is no device memory to pin against, so it changes nothing."""
    pin_memory: bool = True


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_world = None  # the default world communicator, made once per process


def _default_world():
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


def _mesh_config(mesh):
    """(world communicator, strategy, shard_size) of a fully_shard mesh argument."""
    if mesh is None:
        return _default_world(), "full_shard", 0
    if isinstance(mesh, shardline.Communicator):
        return mesh, "full_shard", 0
    device_mesh = getattr(torch.distributed, "device_mesh", None)
    if device_mesh is not None and isinstance(mesh, device_mesh.DeviceMesh):
        if mesh.device_type != "cpu":
            raise ValueError(f"fully_shard: the DeviceMesh is on '{mesh.device_type}'; "
                             "shardline.torch.fully_shard computes on the CPU")
        world = _default_world()
        ranks = mesh.mesh.flatten().tolist()
        if sorted(ranks) != list(range(world.size)):
            raise NotImplementedError(
                f"fully_shard: the DeviceMesh covers ranks {ranks}; shardline's scheduler needs a "
                f"mesh over the whole world of {world.size} ranks")
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
    raise TypeError(f"fully_shard: mesh must be None, a shardline.Communicator or a torch "
                    f"DeviceMesh, not {type(mesh).__name__}")


class _UnitState:
    """What one fully_shard call manages: the module, its parameters, its unit."""

    def __init__(self, module, mesh, reshard_after_forward, mp_policy, offload_policy):
        self.module_ref = weakref.ref(module)
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.recompute_open = False
        self.descendants = set()  # the states of fully_shard'ed modules under this one
        self.full = None  # the full tensors while unshard()'ed
        self.borrowed = []  # units whose tied parameters this module's forward uses too
        self.borrowed_names = []  # (owner, its parameter index, the name here) of those
        self.shapes = []  # the parameters' original shapes
        self.params = []  # the nn.Parameter objects, in registration order
        self.names = []   # their names relative to the module (the first slot's)
        self.fqns = []    # their names relative to the root module (the registered names)
        self.slots = []   # per parameter, every (submodule, attribute name) that holds it
        self.slot_names = []  # per parameter, those slots' names relative to the module
        self.root = None  # the _Root, once initialised
        self.unit = None  # the scheduler's unit id
        self.slices = []  # per parameter (shard_offset, length), after initialisation
        self.tensor_offsets = []  # per parameter, the flat index of its first element here
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reshard_after_backward = True
        self.name = ""
        self.trace = None  # a shardline.Trace for the root's scheduler (set_shardline_trace)
        # set_modules_to_forward_prefetch / _backward_prefetch: lists of _UnitStates, or None
        self.forward_prefetch = None
        self.backward_prefetch = None

    @property
    def module(self):
        return self.module_ref()


def _owner(p):
    """The _UnitState that manages parameter p, or None."""
    return getattr(p, "_shardline_unit", None)


def _collect_parameters(state, module):
    """The parameters under `module` that no fully_shard'ed submodule manages, each with every
    (submodule, name) slot that holds it; a parameter held by another unit is refused."""
    index = {}

    def visit(mod, prefix, top):
        if not top and isinstance(mod, FSDPModule):
            return  # its own unit
        for name, p in mod._parameters.items():
            if p is None:
                continue
            owner = _owner(p)
            if owner is not None and owner is not state:
                # A tie with a parameter another fully_shard call took (an output head tied to
                # an embedding): the tensor stays in that unit, which this module's forward
                # uses too (a unit used twice per forward).
                i = next(k for k, q in enumerate(owner.params) if q is p)
                owner.slots[i].append((mod, name))
                owner.slot_names[i].append(None)  # not under the owner's module
                if owner not in state.borrowed:
                    state.borrowed.append(owner)
                state.borrowed_names.append((owner, i, f"{prefix}{name}"))
                continue
            if id(p) not in index:
                index[id(p)] = len(state.params)
                state.params.append(p)
                state.names.append(f"{prefix}{name}")
                state.slots.append([])
                state.slot_names.append([])
            state.slots[index[id(p)]].append((mod, name))
            state.slot_names[index[id(p)]].append(f"{prefix}{name}")
        for child_name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.", False)

    visit(module, "", True)
    state.shapes = [tuple(p.shape) for p in state.params]
    for name, p in zip(state.names, state.params):
        if p.dtype != torch.float32:
            raise NotImplementedError(f"fully_shard: parameter '{name}' is {p.dtype}; shardline's "
                                      "scheduler keeps float32 master parameters")
        if p.device.type not in ("cpu", "meta"):
            raise ValueError(f"fully_shard: parameter '{name}' is on {p.device}; "
                             "shardline.torch.fully_shard computes on the CPU")
    for p in state.params:
        p._shardline_unit = state


def original_shape(p):
    """The shape a parameter had when fully_shard took it (torch.Size). After the first forward
    a fully_shard'ed parameter is this rank's 1-D slice of its unit's flat shard, so p.shape and
    p.dim() describe the slice; group parameters by this instead (weight decay for
    len(original_shape(p)) >= 2). A parameter no fully_shard call manages: its own shape."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"original_shape: p must be a Tensor (a parameter), not "
                        f"{type(p).__name__}")
    st = _owner(p)
    if st is not None:
        for q, shape in zip(st.params, st.shapes):
            if q is p:
                return torch.Size(shape)
    return p.shape


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


_CLASS_CACHE = {}


def fully_shard(module, *, mesh=None, reshard_after_forward=True,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy()):
    """Shards `module`'s parameters (those no nested fully_shard call took) as one scheduler
    unit; returns the module, whose class now also derives from FSDPModule.

    mesh: None (the world: shardline.init(), through torch's store under an initialised
    torch.distributed), a shardline.Communicator over the world, or a torch DeviceMesh over the
    world: 1-D (full shard) or 2-D (replicate x shard: hybrid; a shard dimension of 1 is no
    shard). reshard_after_forward: True (full shard) or False (shard-grad-op: kept unsharded
    from forward to backward); the root is never resharded after forward (as in FSDP2).
    """
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("fully_shard: a list of modules as one unit is not supported; "
                                  "call it on a module that contains them")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: module must be an nn.Module, not {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: {type(module).__name__} was already fully_shard'ed")
    if type(reshard_after_forward) is not bool and not isinstance(reshard_after_forward, int):
        raise TypeError("fully_shard: reshard_after_forward must be a bool or an int")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("fully_shard: mp_policy must be a shardline.torch.MixedPrecisionPolicy")
    for field in ("param_dtype", "reduce_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and dtype not in _DTYPE_NAMES:
            raise ValueError(f"fully_shard: mp_policy.{field} = {dtype}; shardline supports "
                             "float32, bfloat16 and float16")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError("fully_shard: offload_policy must be a shardline.torch.OffloadPolicy or "
                        "CPUOffloadPolicy")
    mesh_config = _mesh_config(mesh)
    if type(reshard_after_forward) is not bool:
        reshard_after_forward = _reshard_size(int(reshard_after_forward), mesh_config)

    state = _UnitState(module, mesh_config, reshard_after_forward, mp_policy, offload_policy)
    _collect_parameters(state, module)
    cls = type(module)
    new_cls = _CLASS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLASS_CACHE[cls] = new_cls
    module.__class__ = new_cls
    module._shardline_state = state
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, always_call=True, with_kwargs=True)
    module._register_load_state_dict_pre_hook(_load_full_tensors, with_module=True)
    return module


def _load_full_tensors(module, state_dict, prefix, *args):
    """load_state_dict's pre-hook on a fully_shard'ed module: a full tensor (the parameter's
    original shape) for a sharded parameter becomes this rank's slice of it, so torch's copy
    into the sharded parameter works. Other entries (slices: the sharded form) are kept."""
    st = module._shardline_state
    entries = [(st, i, name) for i, names in enumerate(st.slot_names) for name in names
               if name is not None]  # None: a tie under another module (its hook's entry)
    for owner, i, name in entries + st.borrowed_names:
        if owner.root is None or owner.full is not None:
            continue  # the parameters are whole (before the first forward, or unshard()'ed)
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and tuple(value.shape) == owner.shapes[i]:
            t, n = owner.tensor_offsets[i], owner.slices[i][1]
            state_dict[prefix + name] = value.reshape(-1)[t:t + n]


def full_state_dict(module, *, rank0_only=False, cpu_offload=False):
    """module.state_dict() with every fully_shard'ed parameter whole (copies): each unit under
    `module` is unshard()'ed for the call, then resharded. Collective over the world, between
    steps. The keys and shapes are those of the unsharded module, so a plain (never sharded)
    copy of the model takes the result with nn.Module.load_state_dict. (module.state_dict()
    itself gives this rank's 1-D slices: the sharded form; load_state_dict() takes either form.)

    rank0_only: every rank still takes part, but only rank 0 of the world keeps the copies; the
    others get {}. cpu_offload: as in FSDP2's StateDictOptions(full_state_dict=True,
    cpu_offload=True), which gives the state dict to rank 0 only (the tensors are on the CPU
    either way: fully_shard computes on the CPU)."""
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        keep = True
        if (rank0_only or cpu_offload) and units:
            keep = units[0]._shardline_state.mesh[0].rank == 0
        if not keep:
            return {}
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in module.state_dict().items()}
    finally:
        for m in units:
            m.reshard()


# ---- Autograd functions -----------------------------------------------------------------------

class _Gather(torch.autograd.Function):
    """anchor -> the unit's unsharded views for one forward use; its backward hands their
    gradients to the root (added into the scheduler's unsharded gradient)."""

    @staticmethod
    def forward(ctx, root, state, frozen, anchor, *views):
        ctx.root, ctx.state, ctx.step = root, state, root.step_id
        ctx.set_materialize_grads(False)
        outs = tuple(v.view_as(v) for v in views)
        ctx.mark_non_differentiable(*[o for o, f in zip(outs, frozen) if f])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.root._on_param_grads(ctx.state, ctx.step, grads)
        return (None, None, None, None) + (None,) * len(grads)


class _InputBoundary(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the inputs' gradients are computed:
    the end of the module's backward use."""

    @staticmethod
    def forward(ctx, root, state, *tensors):
        ctx.root, ctx.state, ctx.step = root, state, root.step_id
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.root._on_inputs_done(ctx.state, ctx.step)
        return (None, None) + grads


def _map_tensors(fn, obj):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _tensors(obj):
    out = []
    _map_tensors(lambda t: out.append(t) or t, obj)
    return out


# ---- The root: one Scheduler and the step's state machine ------------------------------------

_roots = weakref.WeakSet()  # every initialised _Root


@atexit.register
def _release_all():
    """At exit, before the native module goes: the parameters stop pointing into the schedulers'
    memory and the schedulers and the default world are dropped (in order: a Scheduler before
    its communicator), so nothing of shardline outlives the interpreter's teardown."""
    global _world
    for root in list(_roots):
        for st in root.states:
            for p in st.params:
                p.grad = None
                p.data = torch.empty(0)
            st.mesh = None
        root.views.clear()
        root.scheduler = None
        root.world = None
    _world = None
    gc.collect()


class _Root:
    def __init__(self, root_state):
        self.root_state = root_state
        self.states = []
        self.scheduler = None
        self.step_id = 0
        self.in_forward = False
        self.forward_stack = []   # units in forward; only the top one's use is open
        self.backward_stack = []  # [state, open] of units in backward
        self.backward_started = False
        self.pending = {}         # unit -> [grads] that arrived while the unit was not open
        self.views = {}           # unit -> its unsharded views of the current backward use
        self.pack_map = {}        # storage address -> (unit, tensor) of the open forward views
        self.saved_hooks = None
        self.anchor = torch.empty(0, requires_grad=True)
        self.recomputing = False  # inside a recomputed forward (activation checkpointing)
        self.sync = True
        # Saved forward views unpacked in backward, and of them those whose backward gather
        # lies at another address (for tests).
        self.saved_unpacked = 0
        self.saved_moved = 0
        # set_shardline_trace: the scheduler's streams write their spans into it, and each
        # unit's forward and backward use becomes a "forward <unit>" / "backward <unit>" span on
        # its "compute" track (from the hook's return to the end of the use).
        self.trace = root_state.trace
        self.span_start = {}  # unit -> time.time_ns() at the start of its open use

    # -- lazy initialisation
    def initialize(self):
        root_module = self.root_state.module
        for m in root_module.modules():
            st = getattr(m, "_shardline_state", None)
            if st is None or st in self.states:
                continue
            if st.root is not None:
                raise RuntimeError("fully_shard: a module under this root already belongs to "
                                   "another root's scheduler")
            self.states.append(st)
        names = {id(m): n for n, m in root_module.named_modules(remove_duplicate=False)}
        first = self.root_state
        for st in self.states:
            if st.mesh[0] is not first.mesh[0] or st.mesh[1:] != first.mesh[1:]:
                raise NotImplementedError(
                    "fully_shard: every module under one root must use the same mesh (one "
                    "shardline Scheduler per root)")
            if st.mp_policy != first.mp_policy or st.offload_policy != first.offload_policy:
                raise NotImplementedError(
                    "fully_shard: every module under one root must use the same mp_policy and "
                    "offload_policy (one shardline Scheduler per root)")
        for st in self.states:
            for owner in st.borrowed:
                if owner not in self.states:
                    raise NotImplementedError(
                        f"fully_shard: '{names.get(id(st.module), '')}' uses a parameter tied to "
                        "a module outside its root; both must be under one root")
            # module.to_empty() (meta -> cpu) makes new Parameter objects and unties shared
            # ones: take the module's current objects, and restore the ties fully_shard saw.
            for i, slots in enumerate(st.slots):
                mod, name = slots[0]
                current = mod._parameters[name]
                if current is not st.params[i]:
                    st.params[i] = current
                    current._shardline_unit = st
                    st.shapes[i] = tuple(current.shape)
                for mod, name in slots[1:]:
                    mod._parameters[name] = current
            for name, p in zip(st.names, st.params):
                if p.device.type != "cpu":
                    raise RuntimeError(
                        f"fully_shard: parameter '{name}' is on {p.device} at the first forward; "
                        "a model built on the meta device needs module.to_empty(device='cpu') "
                        "and its initialisation before it")
        world, strategy, shard_size = first.mesh
        mp = first.mp_policy
        self.param_dtype = mp.param_dtype or torch.float32
        reduce_dtype = mp.reduce_dtype or self.param_dtype
        # A parent's use is split around its children ([root, block0, root, block1, ...]), so
        # prefetching the next block needs depth 2 (the parent's next use is already gathered:
        # the root is kept, and a kept parent costs nothing to prefetch again).
        interleaved = any(
            st.params and any(getattr(m, "_shardline_state", None) not in (None, st)
                              for m in st.module.modules())
            for st in self.states if st is not self.root_state) or (
            self.root_state.params and len(self.states) > 1)
        self.per_block = 2 if interleaved else 1
        # Explicit prefetch lists (set_modules_to_*_prefetch) of k modules: the scheduler
        # prefetches k blocks along its order; the first step checks that each list names the
        # units that follow its module there (check_prefetch_lists).
        depths = []
        for field in ("forward_prefetch", "backward_prefetch"):
            lists = [getattr(st, field) for st in self.states if getattr(st, field) is not None]
            depths.append(self.per_block * max(map(len, lists)) if lists else self.per_block)
        self.forward_depth, self.backward_depth = depths
        self.scheduler = shardline.Scheduler(
            world, strategy=strategy, shard_size=shard_size, forward_prefetch=self.forward_depth,
            backward_prefetch_depth=self.backward_depth,
            param_dtype=_DTYPE_NAMES[self.param_dtype], reduce_dtype=_DTYPE_NAMES[reduce_dtype],
            cpu_offload=isinstance(first.offload_policy, CPUOffloadPolicy), name="fully_shard",
            framework="torch", root_unit=0 if self.root_state.params else -1, trace=self.trace)
        self.world = world
        self.strategy = strategy
        s = self.scheduler
        for i, st in enumerate(self.states):
            st.root = self
            st.name = names.get(id(st.module), "") or "<root>"
            if not st.params:
                continue  # a module with no parameters of its own: no unit, no hooks' work
            reshard = False if st is self.root_state else st.reshard_after_forward
            # The tensors are registered under their names in the root module (the unsharded
            # model's state-dict keys), unique across units: checkpoints and safetensors
            # exports carry them.
            prefix = names.get(id(st.module), "")
            st.fqns = [f"{prefix}.{n}" if prefix else n for n in st.names]
            st.unit = s.register_unit(
                f"{i}:{st.name}", [(n, tuple(p.shape)) for n, p in zip(st.fqns, st.params)],
                reshard_after_forward=reshard, reduce_op="avg")
        self.units = [st for st in self.states if st.params]
        for st in self.states:
            st.descendants = {m._shardline_state for m in st.module.modules()
                              if isinstance(m, FSDPModule) and m is not st.module}
        for st in self.units:
            with torch.no_grad():
                s.set_values(st.unit, [p.detach().contiguous() for p in st.params])
            master = s.master_shard(st.unit)
            index = {n: i for i, n in enumerate(st.fqns)}
            st.slices = [(0, 0)] * len(st.params)
            st.tensor_offsets = [0] * len(st.params)
            for name, tensor_offset, shard_offset, length in s.shard_slices(st.unit):
                st.slices[index[name]] = (shard_offset, length)
                st.tensor_offsets[index[name]] = tensor_offset
            for p, (offset, length) in zip(st.params, st.slices):
                p.data = master[offset:offset + length]
                p.grad = None
        self.replicas = world.size // s.shard_size
        _roots.add(self)

    # -- forward
    def _begin_use(self, st):
        self._begin_unit(st)
        for owner in st.borrowed:
            if self.recomputing:
                raise NotImplementedError(
                    "fully_shard: recomputing (torch.utils.checkpoint) a module that uses a "
                    "parameter tied to another unit")
            self._begin_unit(owner)

    def _end_use(self, st):
        for owner in reversed(st.borrowed):
            self._end_unit(owner)
        self._end_unit(st)

    def _begin_unit(self, st):
        if not st.params:
            return
        s = self.scheduler
        if self.recomputing:
            # Activation recomputation inside the backward: the unit's open backward use has
            # its parameters; otherwise the scheduler serves the recomputation from the gather
            # of the unit's coming backward use (PreForward in its backward phase).
            top = self.backward_stack[-1] if self.backward_stack else None
            if top is not None and top[0] is st and top[1]:
                views = self.views[st.unit]
                st.recompute_open = False
            else:
                s.pre_forward(st.unit)
                views = s.params(st.unit)
                st.recompute_open = True
            # As in the forward, the views require gradients (so autograd saves the same
            # tensors, which checkpoint checks); this graph is only used to unpack.
            views = [v.detach().requires_grad_(p.requires_grad and torch.is_grad_enabled())
                     for v, p in zip(views, st.params)]
            for v, slots in zip(views, st.slots):
                for mod, name in slots:
                    mod._parameters[name] = v
            return
        s.pre_forward(st.unit)
        if self.trace is not None:
            self.span_start[st.unit] = time.time_ns()
        views = s.params(st.unit)
        for i, v in enumerate(views):
            if v.numel():
                self.pack_map[v.untyped_storage().data_ptr()] = (st.unit, i)
        frozen = [not p.requires_grad for p in st.params]
        if torch.is_grad_enabled() and not all(frozen):
            views = _Gather.apply(self, st, frozen, self.anchor, *views)
        for v, slots in zip(views, st.slots):
            for mod, name in slots:
                mod._parameters[name] = v

    def _end_unit(self, st):
        if not st.params:
            return
        for p, slots in zip(st.params, st.slots):
            for mod, name in slots:
                mod._parameters[name] = p
        if self.recomputing and not st.recompute_open:
            return
        if not self.recomputing:
            self._end_span("forward", st)
        self.scheduler.post_forward(st.unit)

    def begin_step(self, st):
        if st is not self.root_state:
            raise RuntimeError(
                f"fully_shard: the forward of '{st.name}' ran outside its root's forward; "
                "shardline runs each step from the root module")
        if self.in_forward or self.backward_stack:
            raise RuntimeError("fully_shard: a forward started while the last step's backward "
                               "is still running")
        if self.scheduler is not None and self.step_open:
            # The last forward's backward never ran: end that step (zero gradients).
            self.finish_step()
        for unit in self.units:
            self.write_back(unit)  # the forward reshards what unshard() left unsharded
        s = self.scheduler
        params = [(st, p, sl) for st in self.states for p, sl in zip(st.params, st.slices)
                  if p.requires_grad]
        # An optimizer's zero_grad(set_to_none=True) dropped the .grad views: the sharded
        # gradient starts from zero again.
        none = [(st, p, sl) for st, p, sl in params if p.grad is None]
        if none and len(none) == len(params):
            s.zero_grad()
        else:
            for st, p, (offset, length) in none:
                s.shard_grad(st.unit)[offset:offset + length].zero_()
        syncs = {st.requires_gradient_sync for st in self.states}
        reduces = {st.requires_all_reduce for st in self.states}
        if len(syncs) > 1 or len(reduces) > 1:
            raise NotImplementedError(
                "fully_shard: set_requires_gradient_sync / set_requires_all_reduce differ "
                "between the modules of one root; shardline's scheduler sets them per step "
                "(call them on the root with recurse=True)")
        self.sync = syncs.pop()
        for unit in self.units:
            s.set_reshard_after_backward(unit.unit, unit.reshard_after_backward)
        s.set_requires_gradient_sync(self.sync)
        s.set_requires_all_reduce(reduces.pop())
        self.step_open = True
        self.backward_started = False
        self.span_start.clear()
        self.pack_map.clear()
        self.views.clear()
        self.pending.clear()

    def check_prefetch_lists(self):
        """After the first step (the order recorded): every explicit prefetch list must name the
        units that follow its module in the forward order (the backward: its reverse), skipping
        units kept gathered, within the depth the scheduler was given."""
        order = list(self.scheduler.forward_order)
        kept = {st.unit for st in self.units
                if st is self.root_state or not st.reshard_after_forward}
        for field, sequence, depth, method in (
                ("forward_prefetch", order, self.forward_depth,
                 "set_modules_to_forward_prefetch"),
                ("backward_prefetch", order[::-1], self.backward_depth,
                 "set_modules_to_backward_prefetch")):
            for st in self.units:
                wanted = getattr(st, field)
                if wanted is None or st.unit not in sequence:
                    continue
                start = sequence.index(st.unit)
                following = []
                for pos in range(start + 1, len(sequence)):
                    u = sequence[pos]
                    if u != st.unit and u not in kept and u not in [f for f, _ in following]:
                        following.append((u, pos - start))
                expected = following[:len(wanted)]
                if ([w.unit for w in wanted] != [u for u, _ in expected]
                        or any(distance > depth for _, distance in expected)):
                    names = {x.unit: x.name for x in self.units}
                    raise NotImplementedError(
                        f"fully_shard: {method} on '{st.name}' names "
                        f"{[w.name for w in wanted]}, but the units that follow it in the "
                        f"{field.split('_')[0]} order are "
                        f"{[names[u] for u, _ in following]}; shardline's scheduler prefetches "
                        "a fixed depth along its recorded order, so each list must name the "
                        "next units there (fewer at the end)")

    def settle(self):
        """Ends the step of a backward that raised: autograd no longer runs it (no graph task
        on this thread), but its uses are still open and FinishBackward never ran."""
        if self.backward_started and torch._C._current_graph_task_id() == -1:
            self.abort_backward()

    def abort_backward(self):
        """Closes the open backward uses and ends the scheduler's step. The gradients that
        reached the scheduler before the error are reduced into the sharded gradient, as torch
        leaves the partial sums in .grad; .grad is not re-pointed, so after zero_grad() (.grad
        None) the next step starts from zero."""
        try:
            while self.backward_stack:
                st, is_open = self.backward_stack.pop()
                if is_open:
                    self._close(st)
            self.pending.clear()
            self.scheduler.finish_backward()
        finally:
            self.step_open = False
            self.backward_started = False
            self.recomputing = False
            self.forward_stack.clear()
            self.backward_stack.clear()
            self.pack_map.clear()
            self.views.clear()
            self.pending.clear()
            self.span_start.clear()
            self.step_id += 1

    def pre_forward(self, st, args, kwargs):
        self.settle()
        if self.backward_started and (self.recomputing or not self.forward_stack):
            # A forward inside the backward: torch.utils.checkpoint recomputing activations.
            if self.forward_stack:
                raise NotImplementedError(
                    "fully_shard: a recomputed region (torch.utils.checkpoint) that contains "
                    "nested fully_shard'ed modules; checkpoint each of them separately")
            self.recomputing = True
            self.forward_stack.append(st)
            self._begin_use(st)
            return args, kwargs
        if not self.forward_stack:
            self.begin_step(st)
            self.in_forward = True
            self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.saved_hooks.__enter__()
        else:
            self._end_use(self.forward_stack[-1])
        mp = st.mp_policy
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            def cast(t):
                return t.to(mp.param_dtype) if t.is_floating_point() else t
            args, kwargs = _map_tensors(cast, args), _map_tensors(cast, kwargs)
        st.input_boundary = False
        if torch.is_grad_enabled() and st is not self.root_state:
            flat = _tensors((args, kwargs))
            need = [t for t in flat if t.requires_grad]
            if need:
                st.input_boundary = True
                replaced = _InputBoundary.apply(self, st, *need)
                replaced = (replaced,) if isinstance(replaced, torch.Tensor) else replaced
                swap = {id(t): r for t, r in zip(need, replaced)}
                args, kwargs = _map_tensors(lambda t: swap.get(id(t), t), (args, kwargs))
        self.forward_stack.append(st)
        self._begin_use(st)
        return args, kwargs

    def post_forward(self, st, output):
        if not self.forward_stack or self.forward_stack[-1] is not st:
            return output  # an exception unwound the forward; the step ends below
        self.forward_stack.pop()
        self._end_use(st)
        if self.recomputing:
            self.recomputing = False
            return output
        if self.forward_stack:
            self._begin_use(self.forward_stack[-1])
        else:
            self.in_forward = False
            self.saved_hooks.__exit__(None, None, None)
            self.saved_hooks = None
            if st.mp_policy.output_dtype is not None:
                dtype = st.mp_policy.output_dtype
                output = _map_tensors(
                    lambda t: t.to(dtype) if t.is_floating_point() else t, output)
        outs = [t for t in _tensors(output) if t.requires_grad]
        if outs:
            step = self.step_id
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda grads, st=st: self._on_pre_backward(st, step), mode="any")
        elif not self.forward_stack:
            # Nothing to differentiate: the step ends with the forward.
            self.finish_step()
        return output

    def gather_full(self, st):
        """The unit's full tensors, from every rank's master shard and slice table."""
        s = self.scheduler
        master = s.master_shard(st.unit)
        size = self.world.size
        shards = torch.empty(size * master.numel(), dtype=master.dtype)
        self.world.all_gather(shards, master.contiguous()).wait()
        table = torch.tensor([[t, o, n] for t, (o, n) in zip(st.tensor_offsets, st.slices)],
                             dtype=torch.int64).reshape(-1)
        tables = torch.empty(size * table.numel(), dtype=torch.int64)
        self.world.all_gather(tables, table).wait()
        tables = tables.reshape(size, len(st.params), 3)
        shards = shards.reshape(size, master.numel())
        full = [torch.empty(tuple(shape), dtype=torch.float32) for shape in st.shapes]
        for r in range(size):
            for i, (t, o, n) in enumerate(tables[r].tolist()):
                if n:
                    full[i].view(-1)[t:t + n] = shards[r, o:o + n]
        return full

    def write_back(self, st):
        """Ends an unshard() of `st`: this rank's slices of its full tensors into the shard."""
        if st.full is None:
            return
        with torch.no_grad():
            for p, full, t, (_, n) in zip(st.params, st.full, st.tensor_offsets, st.slices):
                if n:
                    p.copy_(full.reshape(-1)[t:t + n])
        for p, slots in zip(st.params, st.slots):
            for mod, name in slots:
                mod._parameters[name] = p
        st.full = None

    def forward_failed(self):
        """An exception left the forward: close the open uses and end the step."""
        while self.forward_stack:
            st = self.forward_stack.pop()
            for p, slots in zip(st.params, st.slots):
                for mod, name in slots:
                    mod._parameters[name] = p
        if self.saved_hooks is not None:
            self.saved_hooks.__exit__(None, None, None)
            self.saved_hooks = None
        self.in_forward = False

    def _end_span(self, phase, st):
        start = self.span_start.pop(st.unit, None)
        if self.trace is not None and start is not None:
            self.trace.add_span("compute", f"{phase} {st.name}", "compute", start,
                                time.time_ns() - start)

    # -- saved tensors
    def _pack(self, t):
        if t.numel() and t.device.type == "cpu" and not t.is_sparse:
            key = self.pack_map.get(t.untyped_storage().data_ptr())
            if key is not None:
                return ("shardline", self.step_id, key, tuple(t.shape), t.stride(),
                        t.storage_offset(), t.data_ptr())
        return t

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] == "shardline"):
            return packed
        _, step, (unit, index), shape, stride, offset, address = packed
        if step != self.step_id:
            raise RuntimeError("fully_shard: a backward through a graph of an earlier step")
        views = self.views.get(unit)
        if views is None:
            raise RuntimeError(
                f"fully_shard: autograd needs a saved parameter of unit {unit} outside its "
                "backward use")
        t = views[index].as_strided(shape, stride, offset)
        self.saved_unpacked += 1
        self.saved_moved += t.data_ptr() != address
        return t

    # -- backward
    def _open(self, st):
        # The forward opened st, then its borrowed units: the backward mirrors that.
        for owner in reversed(st.borrowed):
            self._open_unit(owner)
        self._open_unit(st)

    def _close(self, st):
        self._close_unit(st)
        for owner in st.borrowed:
            self._close_unit(owner)

    def _open_unit(self, st):
        if not st.params:
            return
        self.scheduler.pre_backward(st.unit)
        if self.trace is not None:
            self.span_start[st.unit] = time.time_ns()
        self.views[st.unit] = self.scheduler.params(st.unit)
        for grads in self.pending.pop(st.unit, []):
            self._add_grads(st, grads)

    def _close_unit(self, st):
        if not st.params:
            return
        self.views.pop(st.unit, None)
        self._end_span("backward", st)
        self.scheduler.post_backward(st.unit)

    def _on_pre_backward(self, st, step):
        if step != self.step_id:
            raise RuntimeError("fully_shard: a backward through the graph of an earlier step")
        if not self.backward_started:
            self.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_step)
        # A module that returns its child's output directly: the child's hook may fire first.
        # The parent's backward use then comes after the child's (below it on the stack).
        below = len(self.backward_stack)
        while below > 0 and self.backward_stack[below - 1][0] in st.descendants:
            below -= 1
        if below < len(self.backward_stack):
            self.backward_stack.insert(below, [st, False])
            return
        if self.backward_stack and self.backward_stack[-1][1]:
            self._close(self.backward_stack[-1][0])
            self.backward_stack[-1][1] = False
        self.backward_stack.append([st, True])
        self._open(st)

    def _end_top(self):
        st, is_open = self.backward_stack.pop()
        if is_open:
            self._close(st)
        if self.backward_stack:
            self.backward_stack[-1][1] = True
            self._open(self.backward_stack[-1][0])

    def _on_inputs_done(self, st, step):
        if step != self.step_id or not self.backward_stack:
            return
        if self.backward_stack[-1][0] is st:
            self._end_top()

    def _on_param_grads(self, st, step, grads):
        if step != self.step_id:
            raise RuntimeError("fully_shard: a backward through the graph of an earlier step")
        top = self.backward_stack[-1] if self.backward_stack else None
        if top is not None and top[0] is st and top[1]:
            self._add_grads(st, grads)
            if not st.input_boundary and st is not self.root_state:
                self._end_top()  # no input gradient will mark the end of this use
        elif top is not None and top[1] and st in top[0].borrowed:
            self._add_grads(st, grads)  # a tied parameter's use inside another module
        else:
            self.pending.setdefault(st.unit, []).append(grads)

    def _add_grads(self, st, grads):
        views = self.scheduler.grads(st.unit)
        for view, g in zip(views, grads):
            if g is not None and view.numel():
                view.add_(g.reshape(view.shape))

    def finish_step(self):
        if not self.step_open:
            return
        backward_ran = self.backward_started
        try:
            while self.backward_stack:
                self._end_top()
            if self.pending:
                units = sorted(self.pending)
                raise RuntimeError(f"fully_shard: gradients of units {units} arrived after "
                                   "their backward use ended")
            self.scheduler.finish_backward()
        finally:
            self.step_open = False
            self.backward_started = False
            self.pack_map.clear()
            self.views.clear()
            self.pending.clear()
            self.step_id += 1
        if self.scheduler.steps == 1:
            self.check_prefetch_lists()
        if self.sync and backward_ran:
            s = self.scheduler
            for st in self.units:
                grad = s.shard_grad(st.unit)
                for p, (offset, length) in zip(st.params, st.slices):
                    if p.requires_grad:
                        g = grad[offset:offset + length]
                        if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                            p.grad = g

    step_open = False


def _lazy_root(st):
    if st.root is None:
        root = _Root(st)
        root.initialize()
    return st.root


# torch.compile: dynamo does not trace the hooks (they drive the scheduler and autograd's
# bookkeeping); it breaks the graph at them and runs them eagerly.
@torch._dynamo.disable
def _pre_forward(module, args, kwargs):
    st = module._shardline_state
    root = _lazy_root(st)
    return root.pre_forward(st, args, kwargs)


@torch._dynamo.disable
def _post_forward(module, args, kwargs, output):
    st = module._shardline_state
    root = st.root
    if root is None:
        return output
    if root.forward_stack and root.forward_stack[-1] is st:
        return root.post_forward(st, output)
    root.forward_failed()
    return output


class _UnshardHandle:
    """FSDP2's UnshardHandle: the unshard is already done."""

    def wait(self):
        return None


class FSDPModule:
    """The methods FSDP2 adds to a fully_shard'ed module."""

    def _shardline_states(self, recurse):
        mods = self.modules() if recurse else [self]
        return [m._shardline_state for m in mods if isinstance(m, FSDPModule)]

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: the next backwards accumulate unsharded gradients without reducing them (no
        .grad update); the next step with True reduces them once. shardline's scheduler applies
        it per step: every module of one root must agree when the forward starts."""
        for st in self._shardline_states(recurse):
            st.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """Hybrid: False reduce-scatters but defers the replicate all-reduce (see
        set_requires_gradient_sync for the per-step rule)."""
        for st in self._shardline_states(recurse):
            st.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """False: after a backward that does not reduce (set_requires_gradient_sync(False)),
        the units stay gathered into the next forward, which then runs without all-gathers
        (gradient accumulation: more memory, less communication). Taken at the next forward. A
        backward that reduces reshards as usual. As in FSDP2, do not step the optimizer while
        units are kept gathered: the next forward would use the parameters from before it."""
        for st in self._shardline_states(recurse):
            st.reshard_after_backward = bool(reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        for st in self._shardline_states(recurse):
            if st.root is not None:
                raise NotImplementedError("set_reshard_after_forward after the first forward: "
                                          "the scheduler fixes each unit's policy at "
                                          "registration")
            st.reshard_after_forward = bool(reshard_after_forward)

    def set_modules_to_forward_prefetch(self, modules):
        """FSDP2's explicit forward prefetch: when this module's forward starts, the gathers
        of `modules` are issued too. shardline's scheduler prefetches a fixed depth along its
        recorded order: the longest list sets that depth (k modules: k blocks ahead, for every
        unit), and the first step checks that each list names the units that follow this one
        in the forward order, skipping those kept gathered (NotImplementedError otherwise).
        Before the first forward only."""
        self._set_prefetch("forward_prefetch", "set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules):
        """FSDP2's explicit backward prefetch: as set_modules_to_forward_prefetch, along the
        backward order (the reverse of the forward order)."""
        self._set_prefetch("backward_prefetch", "set_modules_to_backward_prefetch", modules)

    def _set_prefetch(self, field, method, modules):
        st = self._shardline_state
        if st.root is not None:
            raise RuntimeError(f"{method}: after the first forward; the scheduler's prefetch "
                               "depth is fixed when the root creates it")
        states = []
        for m in modules:
            if not isinstance(m, FSDPModule):
                raise TypeError(f"{method}: {type(m).__name__} is not a fully_shard'ed module")
            if not m._shardline_state.params:
                raise ValueError(f"{method}: {type(m).__name__} has no parameters of its own "
                                 "(no unit to gather)")
            states.append(m._shardline_state)
        setattr(st, field, states)

    def set_shardline_trace(self, trace):
        """shardline's own (not an FSDP2 method): a shardline.Trace(rank) that the root's
        scheduler writes its spans into (tracks "gather", "reduce", "all_reduce", and "compute"
        for the compute stream's waits for gathers), and that gets a "forward <module>" /
        "backward <module>" span on "compute" for each forward and backward use of a unit
        (activation recomputations are not drawn apart). Call it on the root module before
        its first forward; write the trace with trace.write(path) (merge ranks' files with
        scripts/merge_traces.py). None: no trace."""
        st = self._shardline_state
        if st.root is not None:
            raise RuntimeError("set_shardline_trace: after the first forward; the scheduler "
                               "takes its trace when the root creates it")
        if trace is not None and not isinstance(trace, shardline.Trace):
            raise TypeError(f"set_shardline_trace: trace must be a shardline.Trace, not "
                            f"{type(trace).__name__}")
        st.trace = trace

    @property
    def shardline_trace(self):
        """The shardline.Trace given by set_shardline_trace (None: no trace)."""
        root = self._shardline_state.root
        return self._shardline_state.trace if root is None else root.trace

    def set_post_optim_event(self, event):
        """Accepted for FSDP2 compatibility. On the CPU the optimizer has finished when
        optimizer.step() returns and the next step's gathers start after it, so there is no
        event to wait for: this does nothing."""

    def unshard(self, async_op=False):
        """Puts this module's unit's full parameters (float32, no gradient) on the module until
        reshard() or the next forward, which writes them back into the shards first. Collective
        over the world (two all-gathers, outside the scheduler's step). Before the first forward
        the parameters are still whole and this does nothing. async_op: the gather is done
        when this returns; the handle's wait() returns at once."""
        st = self._shardline_state
        root = st.root
        if root is not None and st.params and st.full is None:
            root.settle()
            if root.step_open or root.forward_stack:
                raise RuntimeError("unshard(): inside a step (between the root's forward and "
                                   "the end of its backward)")
            st.full = root.gather_full(st)
            for v, slots in zip(st.full, st.slots):
                for mod, name in slots:
                    mod._parameters[name] = v
        return _UnshardHandle() if async_op else None

    def reshard(self):
        """Ends unshard(): this rank's slice of each full parameter (as it is now, changes
        included) goes back into its shard, and the module holds the sharded parameters again."""
        st = self._shardline_state
        if st.root is not None:
            st.root.write_back(st)

    @property
    def shardline_scheduler(self):
        """The root's shardline.Scheduler (None before the first forward)."""
        root = self._shardline_state.root
        return None if root is None else root.scheduler


# ---- clip_grad_norm_ ---------------------------------------------------------------------------

def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """torch.nn.utils.clip_grad_norm_ for fully_shard'ed parameters: the norm is global.

    A fully_shard'ed parameter's .grad is this rank's slice of the sharded gradient, so torch's
    own clip_grad_norm_ would return (and clip by) a local norm. Here the parts of the sharded
    gradients are reduced over the ranks (each replica counted once); gradients of parameters
    that no fully_shard call manages are taken as replicated (the same on every rank). Returns
    the total norm as a tensor and scales every gradient in place by
    min(1, max_norm / (total + 1e-6)), as torch does.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    sharded, replicated, roots = [], [], []
    for p in params:
        st = _owner(p)
        if st is not None and st.root is not None:
            sharded.append(p)
            if st.root not in roots:
                roots.append(st.root)
        else:
            replicated.append(p)
    if len(roots) > 1:
        worlds = {id(r.world) for r in roots}
        if len(worlds) > 1:
            raise NotImplementedError("clip_grad_norm_: parameters of roots on different "
                                      "communicators")
    inf = norm_type == float("inf")

    def local(ps):
        if not ps:
            return torch.zeros((), dtype=torch.float64)
        grads = [p.grad.detach().to(torch.float64) for p in ps]
        if inf:
            return torch.stack([g.abs().max() if g.numel() else torch.zeros((), dtype=g.dtype)
                                for g in grads]).max()
        return torch.stack([g.abs().pow(norm_type).sum() for g in grads]).sum()

    total = local(sharded)
    if roots:
        root = roots[0]
        buf = total.reshape(1).clone()
        root.world.all_reduce(buf, op="max" if inf else "sum").wait()
        total = buf[0] if inf else buf[0] / root.replicas
    rest = local(replicated)
    if inf:
        total = torch.maximum(total, rest)
    else:
        total = (total + rest).pow(1.0 / norm_type)
    total = total.to(torch.float32)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable this "
                           "error and scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
