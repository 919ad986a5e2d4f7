"""shardline.torch: shardline under PyTorch.

    import shardline.torch                    # registers the torch.distributed backend
    import torch.distributed as dist
    dist.init_process_group("shardline")      # torchrun / shardline-launch environment
    # torch's own FSDP2 (fully_shard), DDP and dist.* collectives now run on shardline

The backend moves CPU tensors. A group where shardline is the only backend is a
ProcessGroupShardline; in a device map that gives other devices other backends
("cpu:shardline,cuda:nccl") shardline is the CPU Backend of torch's group (BackendShardline; see
its note on Work). The rendezvous goes through the store torch creates for the group (shardline
opens no port of its own). `pip install` also registers it as the entry point
`torch.distributed.backends: shardline`, so init_process_group("shardline") finds it without the
import. The base `shardline` package never imports torch; only this subpackage does.

The second way in is shardline's own FSDP: `fully_shard` (FSDP2's interface: the same names,
arguments and module methods) on shardline's scheduler, with `clip_grad_norm_` for the global
norm of its sharded gradients and `get_default_world` for the communicator it shards over (see
_fully_shard.py, which says where each part is, and docs/pytorch.md), and `save_checkpoint` /
`load_checkpoint` for sharded checkpoints of a fully_shard'ed model and its optimizer, loadable at
another world size (see _checkpoint.py and docs/checkpoints.md), `export_safetensors` /
`import_safetensors` for its full weights as one safetensors file and `sync_module_states` for rank
0's initial values on every rank (see _weights.py), and `elastic()` for fully_shard over replica
groups that may drop out and rejoin (see _elastic.py).
"""

from ._backend import BACKEND_NAME, BackendShardline, ProcessGroupShardline, register
from ._checkpoint import CheckpointSave, load_checkpoint, save_checkpoint
from ._clip_grad import clip_grad_norm_
from ._elastic import Elastic, ElasticStep, elastic
from ._fsdp1 import (BackwardPrefetch, CPUOffload, CustomPolicy, FullStateDictConfig,
                     FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy,
                     ShardedStateDictConfig, ShardingStrategy, StateDictType, always_wrap_policy,
                     lambda_auto_wrap_policy, size_based_auto_wrap_policy,
                     transformer_auto_wrap_policy)
from ._fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_init import get_default_world, stream_for
from ._fully_shard import FSDPModule, fully_shard, original_shape
from ._grad_scaler import ShardedGradScaler
from ._state_dict import full_state_dict
from ._weights import export_safetensors, import_safetensors, sync_module_states

__all__ = [
    "BACKEND_NAME", "BackendShardline", "BackwardPrefetch", "CheckpointSave", "CPUOffload",
    "CPUOffloadPolicy", "CustomPolicy", "Elastic", "ElasticStep", "FSDPModule",
    "FullStateDictConfig",
    "FullyShardedDataParallel", "MixedPrecision", "MixedPrecisionPolicy", "ModuleWrapPolicy",
    "OffloadPolicy", "ProcessGroupShardline", "ShardedGradScaler", "ShardedStateDictConfig",
    "ShardingStrategy", "StateDictType", "always_wrap_policy", "clip_grad_norm_",
    "elastic", "export_safetensors", "full_state_dict", "fully_shard", "get_default_world",
    "import_safetensors", "lambda_auto_wrap_policy", "load_checkpoint", "original_shape",
    "register", "save_checkpoint", "size_based_auto_wrap_policy", "stream_for",
    "sync_module_states",
    "transformer_auto_wrap_policy",
]

register()
