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

Where the parts are (FSDP2's layout, torch/distributed/fsdp/_fully_shard/):
  * _fully_shard.py: fully_shard, FSDPModule, the unshard handle, original_shape.
  * _fsdp_api.py: the policies (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy).
  * _fsdp_init.py: the default world (get_default_world) and the mesh argument.
  * _fsdp_param_group.py: a unit (_UnitState), its parameters, its autograd functions and the
    root's per-unit steps (_UnitUses).
  * _fsdp_state.py: the root (_Root: one Scheduler, the step's state machine) and its hooks.
  * _state_dict.py: full_state_dict, the sharded state dict's DTensors (model and optimizer)
    and load_state_dict's pre-hooks; _clip_grad.py: clip_grad_norm_.
  * _elastic.py: elastic() (mesh=elastic: the rounds of an elastic job, the root's scheduler
    rebuilt over each rebuilt round's groups, the state sent to joining replica groups).
"""

import torch
import torch.nn as nn

import shardline

from ._fsdp_api import _DTYPE_NAMES, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_init import _mesh_config, _module_device, _reshard_size
from ._fsdp_param_group import _as_dtensors, _collect_parameters, _owner, _UnitState
from ._fsdp_state import _post_forward, _pre_forward, _states
from ._state_dict import (SavePretrainedFullWeights, _before_state_dict, _load_full_tensors,
                          _to_dtensors)

__all__ = ["FSDPModule", "fully_shard", "original_shape"]


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


_CLASS_CACHE = {}


def fully_shard(module, *, mesh=None, reshard_after_forward=True,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy()):
    """Shards `module`'s parameters (those no nested fully_shard call took) as one scheduler
    unit; returns the module, whose class now also derives from FSDPModule.

    mesh: None (the world: get_default_world(), through torch's store under an initialised
    torch.distributed), a shardline.Communicator over the world, or a torch DeviceMesh over the
    world: 1-D (full shard) or 2-D (replicate x shard: hybrid; a shard dimension of 1 is no
    shard), or shardline.torch.elastic(): hybrid over replica groups that may drop out and
    rejoin (_elastic.py; the loop runs each step in `with elastic.step(model, optimizer)`). reshard_after_forward: True (full shard) or False (shard-grad-op: kept unsharded
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
    mesh_config = _mesh_config(mesh, _module_device(module))
    if type(reshard_after_forward) is not bool:
        reshard_after_forward = _reshard_size(int(reshard_after_forward), mesh_config)

    device_mesh = None if mesh is None or isinstance(mesh, shardline.Communicator) else mesh
    if getattr(mesh, "_shardline_elastic", False):
        device_mesh = None
    return _shard(module, mesh_config, reshard_after_forward, mp_policy, offload_policy,
                  device_mesh)


def _shard(module, mesh_config, reshard_after_forward, mp_policy, offload_policy, device_mesh,
           ignored_modules=(), class_name=None):
    """fully_shard once its arguments are checked (and FullyShardedDataParallel's way in):
    `module` becomes a unit over mesh_config ((world, strategy, shard_size), _mesh_config);
    device_mesh: the torch DeviceMesh it came from, if any; parameters under ignored_modules
    stay outside every unit. class_name: the module's new class's name (default
    FSDP<class>, as FSDP2 names it)."""
    state = _UnitState(module, mesh_config, reshard_after_forward, mp_policy, offload_policy)
    state.device_mesh = device_mesh
    state.ignored_modules = set(map(id, ignored_modules))
    _collect_parameters(state, module)
    cls = type(module)
    name = class_name or f"FSDP{cls.__name__}"
    new_cls = _CLASS_CACHE.get((cls, name))
    if new_cls is None:
        # A Hugging Face model's save_pretrained writes the full weights (_state_dict.py).
        hf = callable(getattr(cls, "save_pretrained", None)) and hasattr(cls, "config_class")
        bases = (FSDPModule, SavePretrainedFullWeights, cls) if hf else (FSDPModule, cls)
        new_cls = type(name, bases, {})
        _CLASS_CACHE[(cls, name)] = new_cls
    module.__class__ = new_cls
    module._shardline_state = state
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, always_call=True, with_kwargs=True)
    module._register_load_state_dict_pre_hook(_load_full_tensors, with_module=True)
    module.register_state_dict_pre_hook(_before_state_dict)
    module._register_state_dict_hook(_to_dtensors)
    _states.add(state)
    return module


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
        """FSDP2's: `event` (a torch.cuda.Event recorded after the optimizer's last write of
        the parameters) is what the next step's gathers and reductions wait for, instead of
        the compute stream (by default they wait for all work on it before the next forward).
        Once, for the next step; no host synchronization. On the CPU the optimizer has finished
        when optimizer.step() returns, so there is no event to wait for: this does nothing."""
        root = self._shardline_state.root
        if root is None or not root.cuda:
            return
        if not isinstance(event, torch.cuda.Event):
            raise TypeError(f"set_post_optim_event: event must be a torch.cuda.Event, not "
                            f"{type(event).__name__}")
        if not event.cuda_event:
            raise ValueError("set_post_optim_event: the event was never recorded (record it "
                             "on the optimizer's stream after optimizer.step())")
        root.scheduler.set_post_optimizer_event(event.cuda_event, event)

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
            for v, slots in zip(_as_dtensors(st, st.full), st.slots):
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
