"""shardline.torch.save_checkpoint / load_checkpoint: fully_shard's model and its optimizer as a
sharded shardline checkpoint (docs/checkpoints.md), loadable at another world size or mesh.

    save_checkpoint(model, optimizer, "ckpt/step1000")     # every rank, between steps
    ... a job of any world size, same model code, fully_shard calls and optimizer class:
    load_checkpoint(model, optimizer, "ckpt/step1000")
    # or in the background: returns once the shards are copied into host memory
    handle = save_checkpoint(model, optimizer, "ckpt/step2000", background=True)
    ... train on; handle.wait() (the next save_checkpoint / load_checkpoint waits for it too)

What is written, per fully_shard unit u (a shardline.Checkpointer over the root's Scheduler):
  * "master": the unit's flat master shard (the parameters);
  * "optim.t.<key>": every optimizer state tensor shaped like its parameter (AdamW's exp_avg and
    exp_avg_sq, SGD's momentum_buffer) as a shard-shaped state: each parameter's state is its
    slice of a flat buffer laid out like the master shard, so a load reshards it exactly;
  * replicated states (written once, from rank 0; every rank loads them):
    "optim.present.<u>" (u8, one element per parameter of the unit: 1 if it had optimizer state)
    and "optim.s.<u>.<i>.<key>", every 0-d state tensor (AdamW's `step`) of parameter i, in its
    own dtype (so parameters that stepped a different number of times keep their own counts).
Not written: the optimizer's param_groups (learning rate and other hyperparameters: construct the
optimizer as the saving job did; an LR scheduler's state is the caller's), buffers (module
buffers such as BatchNorm statistics), and non-tensor optimizer state (refused, naming it).
"""

import atexit
import json
import os
import warnings

import torch

import shardline

import weakref

from ._fsdp_state import _lazy_root
from ._fully_shard import FSDPModule

__all__ = ["CheckpointSave", "load_checkpoint", "save_checkpoint"]

_TENSOR = "optim.t."
_SCALAR = "optim.s."
_PRESENT = "optim.present."


def _root_of(model, what):
    """The _Root of `model` (initialised now if no forward ran yet), checked to be between
    steps with every unit resharded."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"{what}: model must be the root module fully_shard was called on, not "
                        f"{type(model).__name__}")
    st = model._shardline_state
    if st.root is not None and st.root.root_state is not st:
        raise ValueError(f"{what}: '{st.name}' is not the root of its fully_shard tree; pass the "
                         "outermost fully_shard'ed module (the one whose forward you call)")
    root = _lazy_root(st)
    if root.step_open or root.forward_stack:
        raise RuntimeError(f"{what}: inside a step (between the root's forward and the end of "
                           "its backward); call it between steps, after optimizer.step()")
    for unit in root.units:
        if unit.full is not None:
            raise RuntimeError(f"{what}: '{unit.name}' is unshard()'ed; reshard() it first")
    return root


def _optimizer_params(root, optimizer, what):
    """{id(p): (unit state, index)} of every parameter; checks the optimizer's are among them."""
    where = {id(p): (st, i) for st in root.units for i, p in enumerate(st.params)}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in where:
                    raise ValueError(f"{what}: the optimizer holds a parameter of shape "
                                     f"{tuple(p.shape)} that no fully_shard unit under this root "
                                     "manages")
    return where


def _check_key(key, what):
    if not isinstance(key, str) or not key or len(key) > 100 or not all(
            c.isalnum() or c in "._-" for c in key):
        raise ValueError(f"{what}: optimizer state key {key!r} cannot be a checkpoint state name "
                         "(1-100 characters of [A-Za-z0-9._-])")


def _unit_keys(st, optimizer, what):
    """The unit's optimizer state: ({shard-shaped state name: dtype} sorted by name, so every
    rank registers them in the same order; [(param index, key, 0-d value)] sorted)."""
    names, scalars = {}, []
    if optimizer is None:
        return names, scalars
    for i, p in enumerate(st.params):
        state = optimizer.state.get(p)
        if not state:
            continue
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                if value is None:
                    continue
                raise NotImplementedError(
                    f"{what}: optimizer state '{key}' of '{st.name}' is a "
                    f"{type(value).__name__}; only tensors (shaped like the parameter, or 0-d) "
                    "are saved")
            _check_key(key, what)
            if value.dim() == 0:
                scalars.append((i, key, value))
            elif value.shape == p.shape:
                names[_TENSOR + key] = value.dtype
            else:
                raise NotImplementedError(
                    f"{what}: optimizer state '{key}' of '{st.name}' has shape "
                    f"{tuple(value.shape)}; only states shaped like the sharded parameter "
                    f"{tuple(p.shape)} or 0-d are saved")
    return dict(sorted(names.items())), sorted(scalars, key=lambda e: (e[0], e[1]))


# ---- Building the Checkpointer, and the optimizer from it ------------------------------------
# save_checkpoint and load_checkpoint are each one collective call between these: a background
# save builds the same Checkpointer with _saving_checkpointer and keeps it (and so its buffers)
# alive in a CheckpointSave until its write is done.

def _saving_checkpointer(root, optimizer, what, timeout):
    """A Checkpointer over the root's scheduler with the optimizer's state copied into
    shard-shaped buffers and 0-d tensors and registered (the master shards are always saved)."""
    ckpt = shardline.Checkpointer(root.scheduler, timeout=timeout)
    replicated = []
    for st in root.units:
        n = root.scheduler.unit(st.unit).shard_elements
        names, scalars = _unit_keys(st, optimizer, what)
        for name, dtype in names.items():
            buffer = torch.zeros(n, dtype=dtype)
            key = name[len(_TENSOR):]
            for p, (offset, length) in zip(st.params, st.slices):
                value = (optimizer.state.get(p) or {}).get(key)
                if value is not None:
                    buffer[offset:offset + length] = value.detach().reshape(-1)
            # The buffer is this save's own copy: a background save writes it from here.
            ckpt.add_state(st.unit, name, buffer, stable=True)
        if optimizer is not None:
            present = torch.tensor([1 if optimizer.state.get(p) else 0 for p in st.params],
                                   dtype=torch.uint8)
            if present.any():
                replicated.append((f"{_PRESENT}{st.unit}", present))
        for i, key, value in scalars:
            replicated.append((f"{_SCALAR}{st.unit}.{i}.{key}", value.detach().clone()))
    for name, value in replicated:
        ckpt.add_replicated_state(name, value)
    return ckpt


def _manifest(dir):
    """({unit name: {state name: dtype name}}, {replicated name: (shape, dtype name)}) of the
    checkpoint's manifest, or (None, {}) without one (the Checkpointer's load then names what
    is missing)."""
    path = os.path.join(os.fspath(dir), "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None, {}
    units = {u["name"]: {s["name"]: s["dtype"] for s in u["states"]}
             for u in manifest.get("units", [])}
    replicated = {s["name"]: (s["shape"], s["dtype"])
                  for s in manifest.get("replicated", {}).get("states", [])}
    return units, replicated


_DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16,
           "bf16": torch.bfloat16, "i8": torch.int8, "u8": torch.uint8, "i32": torch.int32,
           "i64": torch.int64}


def _loading_checkpointer(root, optimizer, dir, timeout):
    """A Checkpointer with a buffer registered for every optimizer state the checkpoint in `dir`
    has (none when `optimizer` is None); returns it, [(unit state, name, buffer)] of the
    shard-shaped ones and {name: buffer} of the replicated ones."""
    saved, replicated = _manifest(dir) if optimizer is not None else ({}, {})
    ckpt = shardline.Checkpointer(root.scheduler, timeout=timeout)
    buffers = []
    for st in root.units:
        if saved is None:
            break
        n = root.scheduler.unit(st.unit).shard_elements
        unit_name = root.scheduler.unit(st.unit).name
        for name, dtype in sorted(saved.get(unit_name, {}).items()):
            if name.startswith("optim."):
                buffer = torch.zeros(n, dtype=_DTYPES[dtype])
                ckpt.add_state(st.unit, name, buffer)
                buffers.append((st, name, buffer))
    scalars = {}
    for name, (shape, dtype) in replicated.items():
        if name.startswith("optim."):
            scalars[name] = torch.zeros(shape, dtype=_DTYPES[dtype])
            ckpt.add_replicated_state(name, scalars[name])
    return ckpt, buffers, scalars


def _restore_optimizer(root, optimizer, buffers, scalars):
    """Replaces the optimizer's state with the loaded buffers'."""
    by_unit = {}
    for st, name, buffer in buffers:
        by_unit.setdefault(id(st), {})[name] = buffer
    optimizer.state.clear()
    for st in root.units:
        present = scalars.get(f"{_PRESENT}{st.unit}")
        if present is None:
            continue
        if present.shape != (len(st.params),):
            raise shardline.InvalidArgumentError(
                f"load_checkpoint: replicated state '{_PRESENT}{st.unit}' has shape "
                f"{list(present.shape)}; unit '{st.name}' has {len(st.params)} parameters")
        named = by_unit.get(id(st), {})
        prefix = f"{_SCALAR}{st.unit}."
        for i, (p, (offset, length)) in enumerate(zip(st.params, st.slices)):
            if not present[i]:
                continue
            # Beside the parameter (its device: a GPU's, or the host with CPU offload), as
            # torch's Optimizer.load_state_dict puts them; 0-d states (a step) stay as saved.
            state = {name[len(_TENSOR):]:
                     buffer[offset:offset + length].reshape(p.shape).to(p.device, copy=True)
                     for name, buffer in named.items() if name.startswith(_TENSOR)}
            mine = f"{prefix}{i}."
            state.update({name[len(mine):]: value.clone() for name, value in scalars.items()
                          if name.startswith(mine)})
            # torch's optimizers look their state up by key: the order is not recorded.
            optimizer.state[p] = state


# ---- Background saves ----------------------------------------------------------------------------

_pending = weakref.WeakKeyDictionary()  # _Root -> its CheckpointSave still running


class CheckpointSave:
    """A background save_checkpoint: its Checkpointer (and so the copied optimizer state) lives
    until the write is done. wait() returns its outcome."""

    def __init__(self, root, ckpt, dir):
        self._root = weakref.ref(root)
        self._ckpt = ckpt
        self.dir = dir
        self._stats = None

    @property
    def done(self):
        """Whether the background write has finished (wait() still raises its error, if any)."""
        return self._ckpt is None or self._ckpt.last_save_stats["finished"]

    @property
    def stats(self):
        """The save's figures (Checkpointer.last_save_stats): snapshot_bytes, and in seconds
        blocked (how long save_checkpoint kept the caller), snapshot, write."""
        return self._stats if self._ckpt is None else self._ckpt.last_save_stats

    def wait(self, timeout=None):
        """Waits for the write and raises its error (the same on every rank; once). Not
        collective. shardline.DeadlineExceededError if it still runs after `timeout` seconds
        (it stays pending: wait again). Returns the stats."""
        ckpt = self._ckpt
        if ckpt is None:
            return self._stats
        try:
            ckpt.wait(timeout=timeout)
        except shardline.DeadlineExceededError:
            if ckpt.save_pending:
                raise  # still running
            self._finish()
            raise
        except BaseException:
            self._finish()
            raise
        self._finish()
        return self._stats

    def _finish(self):
        self._stats = self._ckpt.last_save_stats
        self._ckpt = None
        root = self._root()
        if root is not None and _pending.get(root) is self:
            del _pending[root]


@atexit.register
def _finish_pending():
    """At exit (before fully_shard's own release, registered earlier): background saves nobody
    waited for are finished; a failure is reported as a warning."""
    for handle in list(_pending.values()):
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - at exit there is no caller to raise to
            warnings.warn(f"shardline.torch: the background save '{handle.dir}' failed: {e}")
    _pending.clear()


def _settle(root, timeout):
    """A save or load first waits for the root's pending background save (raising its error
    if it failed and nobody waited for it)."""
    pending = _pending.get(root)
    if pending is not None:
        pending.wait(timeout=timeout)


# ---- The calls ---------------------------------------------------------------------------------

def save_checkpoint(model, optimizer, dir, *, background=False, timeout=None):
    """Saves `model` (the root fully_shard'ed module) and `optimizer`'s state (None: the
    parameters only) as a new sharded checkpoint directory `dir` (shardline.AlreadyExistsError if
    it exists). Collective: every rank calls it with the same `dir`, between steps. Atomic: a
    save that fails or is killed leaves no `dir` (see docs/checkpoints.md).

    background=True: returns a CheckpointSave once the shards and the optimizer's state are
    copied into host memory; training may go on (and change them) while a thread writes the
    files. handle.wait() gives the outcome; the next save_checkpoint or load_checkpoint of this
    model waits for it first (and raises its error if it failed and nobody waited). `timeout`
    bounds every wait, the background part's included."""
    what = "save_checkpoint"
    root = _root_of(model, what)
    _optimizer_params(root, optimizer, what)
    _settle(root, timeout)
    ckpt = _saving_checkpointer(root, optimizer, what, timeout)
    if not background:
        ckpt.save(os.fspath(dir), timeout=timeout)
        return None
    ckpt.save_async(os.fspath(dir), timeout=timeout)
    handle = CheckpointSave(root, ckpt, os.fspath(dir))
    _pending[root] = handle
    return handle


def load_checkpoint(model, optimizer, dir, *, timeout=None):
    """Loads a checkpoint written by save_checkpoint (at any world size or mesh) into `model`'s
    sharded parameters and, unless `optimizer` is None, replaces `optimizer`'s state with the
    saved one (its param_groups are kept). Collective, between steps; the model and optimizer
    are built as the saving job built them (the same fully_shard calls, parameters and
    optimizer class). A fresh model needs no forward first. Errors name the file, unit, state
    and tensor (shardline.NotFoundError, InvalidArgumentError, DataLossError, ...)."""
    what = "load_checkpoint"
    root = _root_of(model, what)
    _optimizer_params(root, optimizer, what)
    _settle(root, timeout)
    ckpt, buffers, scalars = _loading_checkpointer(root, optimizer, dir, timeout)
    ckpt.load(os.fspath(dir), timeout=timeout)
    if optimizer is not None:
        _restore_optimizer(root, optimizer, buffers, scalars)
