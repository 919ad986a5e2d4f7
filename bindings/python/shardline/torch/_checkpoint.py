"""shardline.torch.save_checkpoint / load_checkpoint: fully_shard's model and its optimizer as a
sharded shardline checkpoint (docs/checkpoints.md), loadable at another world size or mesh.

    save_checkpoint(model, optimizer, "ckpt/step1000")     # every rank, between steps
    ... a job of any world size, same model code, fully_shard calls and optimizer class:
    load_checkpoint(model, optimizer, "ckpt/step1000")

What is written, per fully_shard unit (a shardline.Checkpointer over the root's Scheduler):
  * "master": the unit's flat master shard (the parameters);
  * "optim.t.<key>": every optimizer state tensor shaped like its parameter (AdamW's exp_avg and
    exp_avg_sq, SGD's momentum_buffer) as a shard-shaped state: each parameter's state is its
    slice of a flat buffer laid out like the master shard, so a load reshards it exactly;
  * "optim.s.<key>": every 0-d state tensor (AdamW's `step`), in its own dtype, as a shard-shaped
    state whose elements of each parameter all hold that parameter's value (see _pack_scalars:
    the checkpoint format has no place for replicated values yet);
  * "optim.present" (u8): 1 on the elements of parameters that had optimizer state.
Not written: the optimizer's param_groups (learning rate and other hyperparameters: construct the
optimizer as the saving job did; an LR scheduler's state is the caller's), buffers (module
buffers such as BatchNorm statistics), and non-tensor optimizer state (refused, naming it).
"""

import json
import os

import torch

import shardline

from ._fully_shard import FSDPModule, _lazy_root

__all__ = ["load_checkpoint", "save_checkpoint"]

_TENSOR = "optim.t."
_SCALAR = "optim.s."
_PRESENT = "optim.present"


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
    """The unit's optimizer state as {name: dtype} of its checkpoint states (sorted by name, so
    every rank registers them in the same order)."""
    names = {}
    if optimizer is None:
        return names
    for p in st.params:
        state = optimizer.state.get(p)
        if not state:
            continue
        names[_PRESENT] = torch.uint8
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
                names[_SCALAR + key] = value.dtype
            elif value.shape == p.shape:
                names[_TENSOR + key] = value.dtype
            else:
                raise NotImplementedError(
                    f"{what}: optimizer state '{key}' of '{st.name}' has shape "
                    f"{tuple(value.shape)}; only states shaped like the sharded parameter "
                    f"{tuple(p.shape)} or 0-d are saved")
    return dict(sorted(names.items()))


# ---- Scalars as shard-shaped states ------------------------------------------------------------
# The checkpoint format holds shard-shaped states only, so a 0-d state (AdamW's step) is stored
# as a shard-shaped one whose elements of each parameter all hold the parameter's value. A rank
# whose shard holds no element of a parameter learns its values from the others (_share_scalars).
# Replicated states in the format will replace these two functions.

def _pack_scalars(st, optimizer, name, buffer):
    key = name[len(_SCALAR):]
    for p, (offset, length) in zip(st.params, st.slices):
        state = optimizer.state.get(p) or {}
        if key in state:
            buffer[offset:offset + length] = state[key]


def _share_scalars(world, unknowns):
    """unknowns: [(param, key, dtype, value or None)]; returns the values with every None
    replaced by the maximum over the ranks that know it (one all-reduce), or None if none does."""
    if not unknowns:
        return []
    # float64 holds every float32 / int32 value exactly; -inf marks "not known here".
    known = torch.tensor([v if v is not None else float("-inf") for _, _, _, v in unknowns],
                         dtype=torch.float64)
    world.all_reduce(known, op="max").wait()
    return [None if x == float("-inf") else x for x in known.tolist()]


# ---- Building the Checkpointer, and the optimizer from it ------------------------------------
# save_checkpoint and load_checkpoint are each one collective call between these: a background
# save (or an export) builds the same Checkpointer with _saving_checkpointer and keeps it (and so
# its buffers) alive until its write is done.

def _saving_checkpointer(root, optimizer, what, timeout):
    """A Checkpointer over the root's scheduler with the optimizer's state copied into
    shard-shaped buffers and registered (the master shards are always saved)."""
    ckpt = shardline.Checkpointer(root.scheduler, timeout=timeout)
    for st in root.units:
        n = root.scheduler.unit(st.unit).shard_elements
        for name, dtype in _unit_keys(st, optimizer, what).items():
            buffer = torch.zeros(n, dtype=dtype)
            if name == _PRESENT:
                for p, (offset, length) in zip(st.params, st.slices):
                    if optimizer.state.get(p):
                        buffer[offset:offset + length] = 1
            elif name.startswith(_SCALAR):
                _pack_scalars(st, optimizer, name, buffer)
            else:
                key = name[len(_TENSOR):]
                for p, (offset, length) in zip(st.params, st.slices):
                    value = (optimizer.state.get(p) or {}).get(key)
                    if value is not None:
                        buffer[offset:offset + length] = value.detach().reshape(-1)
            ckpt.add_state(st.unit, name, buffer)
    return ckpt


def _manifest_states(dir):
    """{unit name: {state name: dtype name}} of the checkpoint's manifest, or None without one
    (the Checkpointer's load then names what is missing)."""
    path = os.path.join(os.fspath(dir), "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    return {u["name"]: {s["name"]: s["dtype"] for s in u["states"]}
            for u in manifest.get("units", [])}


_DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16,
           "bf16": torch.bfloat16, "i8": torch.int8, "u8": torch.uint8, "i32": torch.int32,
           "i64": torch.int64}


def _loading_checkpointer(root, optimizer, dir, timeout):
    """A Checkpointer with a buffer registered for every optimizer state the checkpoint in `dir`
    has (none when `optimizer` is None); returns it and [(unit state, name, buffer)]."""
    saved = _manifest_states(dir) if optimizer is not None else {}
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
    return ckpt, buffers


def _restore_optimizer(root, optimizer, buffers):
    """Replaces the optimizer's state with the loaded buffers' (collective: _share_scalars)."""
    by_unit = {}
    for st, name, buffer in buffers:
        by_unit.setdefault(id(st), (st, {}))[1][name] = buffer
    # This rank's values; scalars and presence of parameters it holds no element of are shared.
    unknowns = []
    for st, named in by_unit.values():
        present = named.get(_PRESENT)
        for p, (offset, length) in zip(st.params, st.slices):
            here = length > 0
            flag = float(present[offset]) if (present is not None and here) else None
            unknowns.append((p, _PRESENT, None, flag))
            for name, buffer in named.items():
                if name.startswith(_SCALAR):
                    value = buffer[offset].item() if here else None
                    unknowns.append((p, name[len(_SCALAR):], buffer.dtype, value))
    shared = _share_scalars(root.world, unknowns)
    present = {}
    scalars = {}
    for (p, key, dtype, _), value in zip(unknowns, shared):
        if key == _PRESENT:
            present[id(p)] = value == 1.0
        elif value is not None:
            scalars.setdefault(id(p), {})[key] = torch.tensor(value, dtype=dtype)
    optimizer.state.clear()
    for st, named in by_unit.values():
        for p, (offset, length) in zip(st.params, st.slices):
            if not present.get(id(p)):
                continue
            state = {name[len(_TENSOR):]: buffer[offset:offset + length].clone().reshape(p.shape)
                     for name, buffer in named.items() if name.startswith(_TENSOR)}
            state.update(scalars.get(id(p), {}))
            # torch's optimizers look their state up by key: the order is not recorded.
            optimizer.state[p] = state


# ---- The calls ---------------------------------------------------------------------------------

def save_checkpoint(model, optimizer, dir, *, timeout=None):
    """Saves `model` (the root fully_shard'ed module) and `optimizer`'s state (None: the
    parameters only) as a new sharded checkpoint directory `dir` (shardline.AlreadyExistsError if
    it exists). Collective: every rank calls it with the same `dir`, between steps. Atomic: a
    save that fails or is killed leaves no `dir` (see docs/checkpoints.md)."""
    what = "save_checkpoint"
    root = _root_of(model, what)
    _optimizer_params(root, optimizer, what)
    ckpt = _saving_checkpointer(root, optimizer, what, timeout)
    ckpt.save(os.fspath(dir), timeout=timeout)


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
    ckpt, buffers = _loading_checkpointer(root, optimizer, dir, timeout)
    ckpt.load(os.fspath(dir), timeout=timeout)
    if optimizer is not None:
        _restore_optimizer(root, optimizer, buffers)
