"""The root of fully_shard'ed modules (FSDP2's FSDPState) and its hooks: the outermost
fully_shard'ed module whose forward runs first creates one Scheduler for every unit under it
(_Root.initialize), and drives the step from the module and autograd hooks: the forward hooks
(_ForwardHooks: the step's start, each module's pre- and post-forward, the saved tensors) and
the backward ones (_BackwardHooks: each module's pre- and post-backward, the end of the step).
Per-unit work is _fsdp_param_group._UnitUses."""

import atexit
import gc
import weakref

import torch

import shardline

from . import _fsdp_init
from ._fsdp_api import _DTYPE_NAMES, CPUOffloadPolicy
from ._fsdp_param_group import (_from_local, _InputBoundary, _is_dtensor, _map_tensors,
                                _tensors, _UnitUses)

_roots = weakref.WeakSet()  # every initialised _Root


@atexit.register
def _release_all():
    """At exit, before the native module goes: the parameters stop pointing into the schedulers'
    memory and the schedulers and the default world are dropped (in order: a Scheduler before
    its communicator), so nothing of shardline outlives the interpreter's teardown."""
    for root in list(_roots):
        for st in root.states:
            for p in st.params:
                p.grad = None
                p.data = torch.empty(0)
            st.mesh = None
        root.views.clear()
        root.scheduler = None
        root.world = None
    _fsdp_init._drop_default_world()
    gc.collect()


class _ForwardHooks:
    """The _Root's forward: the step's start, each fully_shard'ed module's pre- and post-forward
    (a parent's use split around its children's), and autograd's saved tensors."""

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
        # A unit whose optimizer holds its flat parameter (FullyShardedDataParallel with
        # use_orig_params=False) is zeroed whole when that parameter's .grad was dropped.
        flat = [u for u in self.units if u.flat_param is not None]
        flat_none = [u for u in flat if u.flat_param.grad is None]
        params = [(st, p, sl) for st in self.states if st.flat_param is None
                  for p, sl in zip(st.params, st.slices) if p.requires_grad]
        # An optimizer's zero_grad(set_to_none=True) dropped the .grad views: the sharded
        # gradient starts from zero again.
        none = [(st, p, sl) for st, p, sl in params if p.grad is None]
        if (none or flat_none) and len(none) == len(params) and len(flat_none) == len(flat):
            self.call(s.zero_grad)
        else:
            for u in flat_none:
                s.shard_grad(u.unit).zero_()
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
        self.placed.clear()
        self.pending.clear()

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
        st.forward_grad = torch.is_grad_enabled()
        self._begin_use(st)
        return args, kwargs

    def post_forward(self, st, output):
        if not self.forward_stack or self.forward_stack[-1] is not st:
            return output  # an exception unwound the forward; the step ends below
        self.forward_stack.pop()
        self._end_use(st)
        if self.recomputing:
            self.recomputing = False
            if st.recompute_open:
                # A reentrant checkpoint ran the forward without gradients (no backward use was
                # registered) and differentiates this recomputation: its outputs open the use.
                self._on_outputs(st, output)
            return output
        if self.forward_stack:
            # The parent's use goes on in the parent's grad mode, not the child's: a child run
            # without gradients (inside a reentrant checkpoint, or under no_grad) must not leave
            # the parent's parameters untracked for the rest of its forward.
            parent = self.forward_stack[-1]
            with torch.set_grad_enabled(parent.forward_grad):
                self._begin_use(parent)
        else:
            self.in_forward = False
            self.saved_hooks.__exit__(None, None, None)
            self.saved_hooks = None
        if st.mp_policy.output_dtype is not None:
            dtype = st.mp_policy.output_dtype
            output = _map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
        if not self._on_outputs(st, output) and not self.forward_stack:
            # Nothing to differentiate: the step ends with the forward.
            self.finish_step()
        return output

    def _on_outputs(self, st, output):
        """The first gradient that reaches `output` opens st's backward use; False when no
        output requires a gradient."""
        outs = [t for t in _tensors(output) if t.requires_grad]
        if outs:
            step = self.step_id
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda grads, st=st: self._on_pre_backward(st, step), mode="any")
        return bool(outs)

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

    # -- saved tensors
    def _pack(self, t):
        local, spec = t, None
        if _is_dtensor(t):
            # A tensor-parallel parameter's DTensor: its local tensor is the forward view.
            local, spec = t._local_tensor, (t.device_mesh, t.placements, t.shape, t.stride())
        elif type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return t  # another tensor subclass: no storage of its own to look up
        if local.numel() and local.device.type in ("cpu", "cuda") and not local.is_sparse:
            key = self.pack_map.get(local.untyped_storage().data_ptr())
            if key is not None:
                return ("shardline", self.step_id, key, tuple(local.shape), local.stride(),
                        local.storage_offset(), local.data_ptr(), spec)
        return t

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] == "shardline"):
            return packed
        _, step, (unit, index), shape, stride, offset, address, spec = packed
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
        return t if spec is None else _wrap_local(t, spec)


class _BackwardHooks:
    """The _Root's backward: a module's backward use opens when the first gradient reaches its
    outputs and closes when its inputs' gradients are computed; the step ends in a callback
    queued on the autograd engine (finish_step), or when a backward that raised is found
    (settle)."""

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
            self.call(self.scheduler.finish_backward)
            self.offload_wait()
        finally:
            self.step_open = False
            self.backward_started = False
            self.pack_map.clear()
            self.views.clear()
            self.placed.clear()
            self.pending.clear()
            self.step_id += 1
        if self.scheduler.steps == 1:
            self.check_prefetch_lists()
        if self.sync and backward_ran:
            s = self.scheduler
            for st in self.units:
                grad = s.shard_grad(st.unit)
                flat = st.flat_param
                if flat is not None and flat.requires_grad and (
                        flat.grad is None or flat.grad.data_ptr() != grad.data_ptr()):
                    flat.grad = grad
                for p, (offset, length) in zip(st.params, st.slices):
                    if p.requires_grad:
                        g = grad[offset:offset + length]
                        if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                            p.grad = g

    def offload_wait(self):
        """CPU offload on CUDA: the optimizer steps on the host, so the host waits for the
        sharded gradients' copies to host memory (FinishBackward ordered them before the compute
        stream's later work only), as FSDP2's CPUOffloadPolicy does."""
        if self.cuda and self.scheduler_options["cpu_offload"]:
            self.compute_stream.synchronize()

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
            self.call(self.scheduler.finish_backward)
            self.offload_wait()
        finally:
            self.clear_step()

    def clear_step(self):
        """Forgets every use, saved tensor and pending gradient of the step and closes it; a
        stale hook of its graph is then recognised as such (step_id moves on)."""
        self.step_open = False
        self.backward_started = False
        self.recomputing = False
        self.forward_stack.clear()
        self.backward_stack.clear()
        self.pack_map.clear()
        self.views.clear()
        self.placed.clear()
        self.pending.clear()
        self.span_start.clear()
        self.step_id += 1


class _Root(_ForwardHooks, _BackwardHooks, _UnitUses):
    """One Scheduler for the units under the root module, and the step's state machine."""

    step_open = False  # from begin_step to the end of the step (finish_step, abort_backward)

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
        self.placed = {}          # unit -> what its modules hold during that use (_open_unit)
        self.device_mesh = None   # the 1-D DeviceMesh of the world's DTensors (_state_dict.py)
        self.pack_map = {}        # storage address -> (unit, tensor) of the open forward views
        self.saved_hooks = None
        self.anchor = torch.empty(0, requires_grad=True)
        self.world_device = torch.device("cpu")  # set by initialize: the device it computes on
        self.cuda = False
        self.compute_stream = None  # on CUDA: torch's stream the scheduler wraps
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
            # output_dtype and cast_forward_inputs act per module, as in FSDP2; the dtypes of
            # the gathers and reductions are the scheduler's.
            if (st.mp_policy.param_dtype != first.mp_policy.param_dtype
                    or st.mp_policy.reduce_dtype != first.mp_policy.reduce_dtype
                    or st.offload_policy != first.offload_policy):
                raise NotImplementedError(
                    "fully_shard: every module under one root must use the same mp_policy "
                    "param_dtype and reduce_dtype, and the same offload_policy (one shardline "
                    "Scheduler per root)")
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
        world, strategy, shard_size = first.mesh
        # The device the root computes on: the one whose memory its world moves (CUDA for an
        # nccl world, the CPU for ucx), where every parameter must be at the first forward.
        self.world_device = _fsdp_init._torch_device(world) if not getattr(
            world, "_shardline_elastic", False) else torch.device("cpu")
        for st in self.states:
            for name, p in zip(st.names, st.params):
                if p.device != self.world_device:
                    raise RuntimeError(
                        f"fully_shard: parameter '{name}' is on {p.device} at the first forward, "
                        f"but the mesh moves {self.world_device} memory (a model on cuda:N "
                        "shards over a 'cuda' DeviceMesh or the nccl world); a model built on "
                        "the meta device needs module.to_empty(device=...) and its "
                        "initialisation before it")
        self.cuda = self.world_device.type == "cuda"
        self.anchor = torch.empty(0, requires_grad=True, device=self.world_device)
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
        self.scheduler_options = dict(
            strategy=strategy, shard_size=shard_size, forward_prefetch=self.forward_depth,
            backward_prefetch_depth=self.backward_depth,
            param_dtype=_DTYPE_NAMES[self.param_dtype], reduce_dtype=_DTYPE_NAMES[reduce_dtype],
            cpu_offload=isinstance(first.offload_policy, CPUOffloadPolicy), name="fully_shard",
            framework="torch", root_unit=0 if self.root_state.params else -1, trace=self.trace)
        self.elastic = world if getattr(world, "_shardline_elastic", False) else None
        self.make_scheduler(world)
        self.strategy = strategy
        s = self.scheduler
        for i, st in enumerate(self.states):
            st.root = self
            st.name = names.get(id(st.module), "") or "<root>"
            st.prefix = f"{names[id(st.module)]}." if names.get(id(st.module)) else ""
            if not st.params:
                continue  # a module with no parameters of its own: no unit, no hooks' work
            reshard = False if st is self.root_state else st.reshard_after_forward
            # The tensors are registered under their names in the root module (the unsharded
            # model's state-dict keys), unique across units: checkpoints and safetensors
            # exports carry them.
            st.fqns = [st.prefix + n for n in st.names]
            st.unit_spec = (f"{i}:{st.name}",
                            [(n, tuple(p.shape)) for n, p in zip(st.fqns, st.params)], reshard)
        self.units = [st for st in self.states if st.params]
        self.register_units()
        from ._fully_shard import FSDPModule  # (_fully_shard imports this module)

        for st in self.states:
            st.descendants = {m._shardline_state for m in st.module.modules()
                              if isinstance(m, FSDPModule) and m is not st.module}
        for st in self.units:
            with torch.no_grad():
                # The scheduler takes initial values from host memory (one copy to the device).
                s.set_values(st.unit, [p.detach().contiguous().cpu() for p in st.params])
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
        if self.root_state.limit_all_gathers:
            # FSDP1's rate limiter: two gathered units, or the minimum the units need.
            s.set_budget(0, max(2, s.minimum_budget_units))
        _roots.add(self)

    def make_scheduler(self, world):
        """Creates the Scheduler over `world` with the root's options (no units yet): over the
        communicator the mesh argument gave, or, for a shardline.torch.elastic() mesh, over the
        current round's shard and replicate groups (again at each rebuilt round, _elastic.py).
        self.world is the communicator that spans one copy of the shards (clip_grad_norm_ and
        the full state dict reduce over it) and self.replicas how often it holds them."""
        if self.elastic is not None:
            shard, replicate = self.elastic._round_groups(self)
            options = dict(self.scheduler_options, strategy="hybrid_shard", shard_size=0)
            self.scheduler = shardline.Scheduler(shard, replicate=replicate, **options)
            # Every member replica holds the same shards: the shard group spans one copy.
            self.world, self.replicas = shard, 1
        else:
            options = self.scheduler_options
            if self.cuda:
                # The compute stream is torch's current stream of the device, wrapped; a hook
                # that runs under another current stream is bridged to it (_UnitUses.call).
                self.compute_stream = torch.cuda.current_stream(self.world_device)
                options = dict(options, device=str(self.world_device),
                               compute_stream=self.compute_stream.cuda_stream)
            self.scheduler = shardline.Scheduler(world, **options)
            self.world = world
            self.replicas = world.size // self.scheduler.shard_size

    def register_units(self):
        """Registers the units with the scheduler, in the same order on every rank."""
        for st in self.units:
            name, tensors, reshard = st.unit_spec
            st.unit = self.scheduler.register_unit(name, tensors, reshard_after_forward=reshard,
                                                   reduce_op="avg")

    # -- the explicit prefetch lists, once the first step recorded the order
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


def _lazy_root(st):
    if st.root is None:
        root = _Root(st)
        root.initialize()
    return st.root


_states = weakref.WeakSet()  # every fully_shard call's _UnitState


def _wrap_local(local, spec):
    """The DTensor of `spec` over `local`, for autograd's saved tensors (no gradient)."""
    with torch.no_grad():
        return _from_local(local, spec)


def _init_outermost(st):
    """Initialises the root of st's tree before any forward (a state dict, an optimizer's
    state): the outermost fully_shard'ed module that contains st's module, which the root's
    first forward would have made the root."""
    if st.root is not None:
        return st.root
    outer = max((o for o in _states if o.module is not None and o.root is None
                 and any(m is st.module for m in o.module.modules())),
                key=lambda o: sum(1 for _ in o.module.modules()))
    return _lazy_root(outer)


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
