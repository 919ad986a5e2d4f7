"""shardline.torch.export_safetensors / import_safetensors / sync_module_states: full weights of
a fully_shard'ed model as one safetensors file, and rank 0's initial values on every rank.

    slt.export_safetensors(model, "model.safetensors")                 # every rank, between steps
    plain.load_state_dict(safetensors.torch.load_file("model.safetensors"))   # any plain copy
    slt.import_safetensors(model, "model.safetensors")                 # any world size or mesh
    slt.sync_module_states(module)                                     # before fully_shard

The file's tensor names are the unsharded module's state-dict keys: fully_shard registers every
parameter under its name in the root module (blocks.0.fc1.weight), which the export writes
(shardline.export_safetensors: one unit at a time gathered to one rank; docs/checkpoints.md).
"""

import os

import torch

import shardline

from ._checkpoint import _root_of
from ._fsdp_init import _mesh_config

__all__ = ["export_safetensors", "import_safetensors", "sync_module_states"]

_EXPORT_DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16",
                  torch.float16: "f16"}


def export_safetensors(model, path, dtype=None, *, writer_rank=0, metadata=None, timeout=None):
    """Writes the weights of `model` (the root fully_shard'ed module) as the new safetensors file
    `path` (shardline.AlreadyExistsError if it exists: never replaced), written by world rank
    `writer_rank` one unit at a time. Tensor names are the unsharded module's parameter names,
    so safetensors.torch.load_file(path) is a state dict that a plain copy of the model takes
    (module buffers are not in it: load_state_dict(..., strict=False) for a model with buffers).
    A parameter tied to another (one nn.Parameter under two names) is written once, under its
    first name, and the tie is recorded in the header's __metadata__ as
    "shardline.tied_to.<name>": "<first name>"; safetensors.torch.load_model(plain, path)
    (strict) re-ties it, and import_safetensors needs only the first name. dtype: None (float32, the master weights' bits) or torch.bfloat16 /
    torch.float16 / torch.float64 (rounded to nearest even). metadata: {str: str} added to the
    header's __metadata__. Collective, between steps."""
    what = "export_safetensors"
    root = _root_of(model, what)
    if dtype is not None and dtype not in _EXPORT_DTYPES:
        raise ValueError(f"{what}: dtype {dtype}; the export writes "
                         f"{', '.join(str(d) for d in _EXPORT_DTYPES)} or None")
    ties = _tie_metadata(root)
    clash = sorted(set(ties) & set(metadata or {}))
    if clash:
        raise ValueError(f"{what}: metadata keys {clash} are the ties shardline records itself")
    shardline.export_safetensors(
        root.scheduler, os.fspath(path), dtype=None if dtype is None else _EXPORT_DTYPES[dtype],
        writer_rank=writer_rank, metadata={**ties, **(metadata or {})}, timeout=timeout)


def _tie_metadata(root):
    """{"shardline.tied_to.<name>": "<name written>"} for every further name of a tied
    parameter (the scheduler's units hold each tensor once, under its first name)."""
    ties = {}
    for st in root.states:
        for i, names in enumerate(st.slot_names):
            for name in names[1:]:
                if name is not None:  # None: a slot under another module (its borrowed_names)
                    ties[f"shardline.tied_to.{st.prefix}{name}"] = st.fqns[i]
        for owner, i, name in st.borrowed_names:
            ties[f"shardline.tied_to.{st.prefix}{name}"] = owner.fqns[i]
    return ties


def import_safetensors(model, path, *, strict=True, timeout=None):
    """Loads the parameters of `model` (the root fully_shard'ed module) from the safetensors file
    `path` (from export_safetensors or safetensors.torch.save_file of the unsharded model's
    state dict): every rank maps the file and copies only its shards' elements; floating dtypes
    are cast (rounding to nearest even). strict=False skips tensors of the file that are no
    parameter of the model (buffers, say); every parameter must be in the file. Collective,
    between steps; a fresh model needs no forward first."""
    root = _root_of(model, "import_safetensors")
    shardline.import_safetensors(root.scheduler, os.fspath(path),
                                 ignore_unknown_tensors=not strict, timeout=timeout)


def sync_module_states(module, src=0, *, bucket_bytes=25 << 20, mesh=None, timeout=None):
    """Overwrites every parameter and buffer of `module` (before fully_shard) with rank `src`'s
    values, in broadcasts of at most `bucket_bytes` (FSDP1's sync_module_states): for a model
    initialised on one rank or with a different seed per rank. Every rank calls it with a model
    of the same structure (else shardline.InvalidArgumentError naming the rank that differs).
    mesh: as fully_shard's (None: the world); the broadcast runs over its whole world. CPU
    tensors; any dtype (the bytes are moved)."""
    from ._fully_shard import FSDPModule
    what = "sync_module_states"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{what}: module must be an nn.Module, not {type(module).__name__}")
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError(f"{what}: call it before fully_shard (a module under "
                         f"{type(module).__name__} is already fully_shard'ed)")
    world = _mesh_config(mesh)[0]
    tensors, seen = [], set()
    named = list(module.named_parameters(remove_duplicate=False)) + \
        list(module.named_buffers(remove_duplicate=False))
    for name, t in named:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if t.device.type != "cpu":
            raise ValueError(f"{what}: '{name}' is on {t.device}; CPU tensors only")
        tensors.append(t)
    with torch.no_grad():
        views, copies = [], []
        for t in tensors:
            flat = t.detach()
            if not flat.is_contiguous():
                flat = flat.contiguous()
                copies.append((t, flat))
            views.append(flat.reshape(-1).view(torch.uint8))
        shardline.sync_module_states(world, views, root=src, bucket_bytes=bucket_bytes,
                                     timeout=timeout)
        for t, flat in copies:
            t.copy_(flat)
