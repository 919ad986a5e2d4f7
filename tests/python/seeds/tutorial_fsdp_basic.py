"""The FSDP tutorial (../shared/seeds/000_*, "FSDP in action"), first snippet, completed:

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init_process_group(backend="nccl", rank=rank, world_size=world_size)

    torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}")
    model = MLP()
    model = model.to(device)
    model = FSDP(model)

with its train_step. Changed: the import (shardline.torch; --torch: torch's own), the device (CPU:
also device_id, which torch's FSDP1 needs on the CPU), the backend
(gloo), the sizes (seeds/seed_harness.py)."""
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributed import init_process_group

from seed_harness import MLP, arguments, batches, fsdp_module, report, train_step

args, rank, world_size = arguments()
FSDP = fsdp_module(args).FullyShardedDataParallel  # the snippet: from torch.distributed.fsdp
if not args.single:
    init_process_group(backend="gloo", rank=rank, world_size=world_size)

device = torch.device("cpu")
torch.manual_seed(0)
model = MLP()
model = model.to(device)
if not args.single:
    model = FSDP(model, device_id=device)

optimizer = optim.AdamW(model.parameters(), lr=1e-2)
criterion = nn.MSELoss()
losses = [train_step(data, target, model, optimizer, criterion)
          for data, target in batches(rank, world_size)]
report(args, rank, world_size, losses, model)
