"""State dicts of fully_shard'ed modules: module.state_dict() gives this rank's slices (the
sharded form), load_state_dict() takes either form (_load_full_tensors), and full_state_dict()
gives the whole tensors (FSDP2's get_model_state_dict(full_state_dict=True) counterpart), which a
fully_shard'ed Hugging Face model's save_pretrained writes (SavePretrainedFullWeights)."""

import torch

__all__ = ["full_state_dict"]


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
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
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
