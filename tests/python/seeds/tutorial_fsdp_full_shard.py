"""The FSDP tutorial (../shared/seeds/000_*, "FSDP in action | What to shard"), completed:

    model = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
    )

Changed: the import (shardline.torch; --torch: torch's own), the device (CPU), the backend
(gloo), the sizes (seeds/seed_harness.py)."""
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributed import init_process_group

from seed_harness import MLP, arguments, batches, fsdp_module, report, train_step

args, rank, world_size = arguments()
fsdp = fsdp_module(args)  # the snippet: from torch.distributed.fsdp import ...
FSDP, ShardingStrategy = fsdp.FullyShardedDataParallel, fsdp.ShardingStrategy
if not args.single:
    init_process_group(backend="gloo", rank=rank, world_size=world_size)

torch.manual_seed(0)
model = MLP()
if not args.single:
    model = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
    )
optimizer = optim.AdamW(model.parameters(), lr=1e-2)
criterion = nn.MSELoss()
losses = [train_step(data, target, model, optimizer, criterion)
          for data, target in batches(rank, world_size)]
report(args, rank, world_size, losses, model)
