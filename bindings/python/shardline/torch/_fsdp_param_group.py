"""A fully_shard unit (FSDP2's FSDPParamGroup): what one fully_shard call manages (_UnitState),
the parameters it collects, the autograd functions of its forward and backward uses, and the
root's calls into the scheduler for one unit (_UnitUses: gather, reshard, gradients; FSDP2's
FSDPParamGroup.pre_forward / post_forward / pre_backward / post_backward / unshard)."""

import copy
import dataclasses
import time
import weakref

import torch

from . import _fsdp_init


class _UnitState:
    """What one fully_shard call manages: the module, its parameters, its unit."""

    def __init__(self, module, mesh, reshard_after_forward, mp_policy, offload_policy):
        self.module_ref = weakref.ref(module)
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.recompute_open = False
        self.forward_grad = True  # grad mode of the module's current forward
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
        self.prefix = ""  # the module's name in the root module, with a trailing dot
        self.device_mesh = None  # the torch DeviceMesh fully_shard was given, if any
        self.ignored_modules = set()  # ids of modules whose parameters stay outside the unit
        self.limit_all_gathers = False  # FullyShardedDataParallel's rate limiter (its root's)
        # FullyShardedDataParallel(use_orig_params=False): the unit's master shard as one
        # parameter (FSDP1's FlatParameter), which the optimizer steps on; its .grad is the
        # sharded gradient.
        self.flat_param = None
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


def _sharded_owner(p):
    """The _UnitState whose sharded gradient p's .grad is: p's owner, or the unit whose flat
    parameter p is (FullyShardedDataParallel with use_orig_params=False). None for a parameter
    no unit manages (its gradient is the same on every rank)."""
    return getattr(p, "_shardline_unit", None) or getattr(p, "_shardline_flat_unit", None)


def _collect_parameters(state, module):
    """The parameters under `module` that no fully_shard'ed submodule manages, each with every
    (submodule, name) slot that holds it; a parameter held by another unit is refused."""
    from ._fully_shard import FSDPModule  # (_fully_shard imports this module)

    index = {}

    def visit(mod, prefix, top):
        if not top and isinstance(mod, FSDPModule):
            return  # its own unit
        if id(mod) in state.ignored_modules:
            return  # FullyShardedDataParallel's ignored_modules: left as they are
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
    _take_local_tensors(state)
    state.shapes = [tuple(p.shape) for p in state.params]
    for name, p in zip(state.names, state.params):
        if p.dtype != torch.float32:
            raise NotImplementedError(f"fully_shard: parameter '{name}' is {p.dtype}; shardline's "
                                      "scheduler keeps float32 master parameters")
        if p.device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(f"fully_shard: parameter '{name}' is on {p.device}; "
                             "shardline.torch.fully_shard computes on the CPU and on CUDA")
    for p in state.params:
        p._shardline_unit = state


def _take_local_tensors(state):
    """Tensor parallel underneath: a DTensor parameter (torch's parallelize_module, on the tp
    mesh) becomes a plain parameter of its local tensor, which the unit's flat layout holds; its
    spec is kept (state.dtensors) so that compute sees the DTensor again (_as_dtensors)."""
    state.dtensors = [None] * len(state.params)
    for i, p in enumerate(state.params):
        if not _is_dtensor(p):
            continue
        if p.device_mesh.ndim != 1:
            raise NotImplementedError(
                f"fully_shard: parameter '{state.names[i]}' is a DTensor on a "
                f"{p.device_mesh.ndim}-D mesh; shardline takes DTensors of tensor parallel on a "
                "1-D (tp) mesh")
        local = torch.nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
        state.dtensors[i] = (p.device_mesh, tuple(p.placements), tuple(p.shape), p.stride())
        state.params[i] = local
        for mod, name in state.slots[i]:
            mod._parameters[name] = local


def _as_dtensors(st, views):
    """The unit's views with each tensor-parallel parameter's wrapped as its DTensor again
    (differentiable: the gradient of the DTensor reaches the view)."""
    if not any(st.dtensors):
        return views
    return [v if spec is None else _from_local(v, spec) for v, spec in zip(views, st.dtensors)]


def _from_local(local, spec):
    """The DTensor of spec (mesh, placements, global shape, stride) over its local tensor."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, spec[0], spec[1], run_check=False, shape=spec[2],
                              stride=spec[3])


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
    """`obj` with fn applied to every tensor in it, each container rebuilt as its own type (as
    FSDP2 does): named tuples, lists, tuples, dicts and their subclasses (HF's ModelOutput is an
    OrderedDict and a dataclass), and dataclass instances (frozen ones too)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name, None)
            mapped = _map_tensors(fn, value)
            if mapped is not value:
                object.__setattr__(new, field.name, mapped)
                if isinstance(new, dict) and field.name in new:
                    dict.__setitem__(new, field.name, mapped)  # ModelOutput keeps both views
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    if type(obj) is dict:
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, dict):
        new = copy.copy(obj)
        for k, v in obj.items():
            dict.__setitem__(new, k, _map_tensors(fn, v))
        return new
    return obj


def _is_dtensor(value):
    tensor = getattr(torch.distributed, "tensor", None)
    return tensor is not None and isinstance(value, tensor.DTensor)


def _place(st, tensors):
    """Puts `tensors` (one per parameter of `st`) into every module slot of its parameters."""
    for t, slots in zip(tensors, st.slots):
        for mod, name in slots:
            mod._parameters[name] = t


def _tensors(obj):
    out = []
    _map_tensors(lambda t: out.append(t) or t, obj)
    return out


# ---- A unit's uses ---------------------------------------------------------------------------

class _UnitUses:
    """The _Root's (_fsdp_state.py) per-unit steps: a unit's forward use (its unsharded views in
    place of the parameters, _Gather), its backward use (its gradients into the scheduler's
    unsharded gradient views), and unshard()'s full tensors. The state they use is the root's
    (_Root.__init__)."""

    def call(self, hook, *args):
        """Runs a scheduler hook. On CUDA the scheduler's compute stream is torch's stream of
        the device at initialisation; under another current stream (a `with
        torch.cuda.stream(...)` block, autograd's stream for a backward node) the compute stream
        first waits for the current one (the scheduler orders its work after what the hook
        covers: gradients added, views read) and the current one then waits for the compute
        stream (the waits the hook enqueued), without a host synchronization."""
        if not self.cuda:
            return hook(*args)
        current = torch.cuda.current_stream(self.world_device)
        if current == self.compute_stream:
            return hook(*args)
        self.compute_stream.wait_stream(current)
        try:
            return hook(*args)
        finally:
            current.wait_stream(self.compute_stream)

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
                self.call(s.pre_forward, st.unit)
                views = s.params(st.unit)
                st.recompute_open = True
            # As in the forward, the views pass through _Gather: autograd saves the same tensors
            # (which a non-reentrant checkpoint checks, and only unpacks from this graph), and a
            # reentrant checkpoint, which differentiates this graph, hands the parameters'
            # gradients to the root.
            frozen = [not p.requires_grad for p in st.params]
            if torch.is_grad_enabled() and not all(frozen):
                views = _Gather.apply(self, st, frozen, self.anchor, *views)
            _place(st, _as_dtensors(st, views))
            return
        self.call(s.pre_forward, st.unit)
        if self.trace is not None:
            self.span_start[st.unit] = time.time_ns()
        views = s.params(st.unit)
        for i, v in enumerate(views):
            if v.numel():
                self.pack_map[v.untyped_storage().data_ptr()] = (st.unit, i)
        frozen = [not p.requires_grad for p in st.params]
        if torch.is_grad_enabled() and not all(frozen):
            views = _Gather.apply(self, st, frozen, self.anchor, *views)
        _place(st, _as_dtensors(st, views))

    def _end_unit(self, st):
        if not st.params:
            return
        # The module holds its shard again, or, after a recomputation inside its backward use,
        # that use's views.
        _place(st, self.placed.get(st.unit, st.params))
        if self.recomputing and not st.recompute_open:
            return
        if not self.recomputing:
            self._end_span("forward", st)
        self.call(self.scheduler.post_forward, st.unit)

    def _end_span(self, phase, st):
        start = self.span_start.pop(st.unit, None)
        if self.trace is not None and start is not None:
            self.trace.add_span("compute", f"{phase} {st.name}", "compute", start,
                                time.time_ns() - start)

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
        self.call(self.scheduler.pre_backward, st.unit)
        if self.trace is not None:
            self.span_start[st.unit] = time.time_ns()
        views = self.views[st.unit] = self.scheduler.params(st.unit)
        # The module holds the unsharded views for the whole backward use, as FSDP2 puts the
        # full parameters back before a module's backward: a forward that is recomputed below
        # the unit's hooks (Hugging Face's gradient checkpointing wraps a layer's `forward`
        # itself) reads them. Through _Gather, so that a reentrant checkpoint, which
        # differentiates its recomputed graph, hands the parameters' gradients to the root;
        # a non-reentrant one only takes its saved tensors from that graph.
        frozen = [not p.requires_grad for p in st.params]
        with torch.enable_grad():
            if not all(frozen):
                views = _Gather.apply(self, st, frozen, self.anchor, *views)
            views = _as_dtensors(st, views)
        self.placed[st.unit] = views
        _place(st, views)
        for grads in self.pending.pop(st.unit, []):
            self._add_grads(st, grads)

    def _close_unit(self, st):
        if not st.params:
            return
        self.views.pop(st.unit, None)
        self.placed.pop(st.unit, None)
        _place(st, st.params)
        self._end_span("backward", st)
        self.call(self.scheduler.post_backward, st.unit)

    def _add_grads(self, st, grads):
        views = self.scheduler.grads(st.unit)
        for view, g in zip(views, grads):
            if g is not None and view.numel():
                view.add_(g.reshape(view.shape))

    # -- unshard() / reshard()
    def gather_full(self, st, shard=None):
        """The unit's full tensors, from every rank's master shard (or `shard`: a tensor of the
        master shard's size and layout, such as an optimizer state) and slice table."""
        s = self.scheduler
        master = s.master_shard(st.unit) if shard is None else shard
        size = self.world.size
        # Over the world's memory (CUDA for an nccl world; an offloaded shard goes there first),
        # the full tensors on the master shard's device.
        moved = self.world_device
        shards = torch.empty(size * master.numel(), dtype=master.dtype, device=moved)
        stream = _fsdp_init.stream_for(self.world)
        self.world.all_gather(shards, master.contiguous().to(moved), stream=stream).wait()
        table = torch.tensor([[t, o, n] for t, (o, n) in zip(st.tensor_offsets, st.slices)],
                             dtype=torch.int64).reshape(-1)
        tables = torch.empty(size * table.numel(), dtype=torch.int64, device=moved)
        self.world.all_gather(tables, table.to(moved), stream=stream).wait()
        tables = tables.cpu().reshape(size, len(st.params), 3)
        shards = shards.to(master.device).reshape(size, master.numel())
        full = [torch.empty(tuple(shape), dtype=master.dtype, device=master.device)
                for shape in st.shapes]
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
