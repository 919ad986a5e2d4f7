"""The FSDP summary (../shared/seeds/003_*, "FSDP Implementation (PyTorch)"), completed:

    # Initialize distributed process group
    torch.distributed.init_process_group("nccl")

    # Wrap model with FSDP
    model = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=mp_policy,
        device_id=torch.cuda.current_device()
    )

    # Train normally
    for batch in dataloader:
        loss = model(batch).loss
        loss.backward()
        optimizer.step()

Changed: the import (shardline.torch; --torch: torch's own), the device (CPU), the backend
(gloo), the sizes (seeds/seed_harness.py). Completed: mp_policy (bfloat16 compute, float32
reductions), a model whose output has a .loss (the MLP and its MSE loss, returned in a
dataclass as Hugging Face models return ModelOutput), the dataloader (the global batches), and
optimizer.zero_grad(), which the snippet leaves out."""
import dataclasses

import torch
import torch.nn as nn
import torch.optim as optim

from seed_harness import MLP, arguments, batches, fsdp_module, report


@dataclasses.dataclass
class Output:
    loss: torch.Tensor


class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, batch):
        data, target = batch
        return Output(loss=nn.functional.mse_loss(self.mlp(data), target))


args, rank, world_size = arguments()
fsdp = fsdp_module(args)
FSDP, ShardingStrategy, MixedPrecision = (fsdp.FullyShardedDataParallel, fsdp.ShardingStrategy,
                                          fsdp.MixedPrecision)
torch.manual_seed(0)
model = WithLoss()
mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
if not args.single:
    # Initialize distributed process group
    torch.distributed.init_process_group("gloo")

    # Wrap model with FSDP
    model = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=mp_policy,
        device_id=torch.device("cpu")
    )
else:
    # One process: the same bfloat16 compute, by autocast.
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
optimizer = optim.AdamW(model.parameters(), lr=1e-2)
dataloader = batches(rank, world_size)

# Train normally
losses = []
for batch in dataloader:
    optimizer.zero_grad()
    loss = model(batch).loss
    loss.backward()
    optimizer.step()
    losses.append(loss)
report(args, rank, world_size, losses, model)
