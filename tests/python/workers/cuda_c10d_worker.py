"""One rank of torch.distributed over the "shardline" backend with CUDA tensors (test_cuda.py;
scripts/gpu-run.sh): every collective the backend takes on CUDA, odd sizes, hashed floats, every
element against a plain loop over the ranks' regenerated inputs, issued on a side stream as well
as the default one; then what it refuses on CUDA. Ranks that share the GPU go over ucx staged
through host memory, one rank per GPU over nccl. Prints "ok" and exits 0, or raises.

    cuda_c10d_worker.py
"""
import os
import sys

import torch
import torch.distributed as dist

import shardline.torch  # noqa: F401  (registers "shardline": torch 2.11 reads no entry point)

N = 1237


def data(rank, n, salt, device):
    g = torch.Generator().manual_seed(1000003 * rank + salt)
    return torch.randn(n, generator=g).to(device)


def close(got, want, what, tol=1e-5):
    got, want = got.double().cpu(), want.double().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    bad = (got - want).abs() > tol * (1 + want.abs())
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: element {i} is {got.reshape(-1)[i].item()}, want "
                             f"{want.reshape(-1)[i].item()}")


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("shardline")
    side = torch.cuda.Stream(device)
    for stream in (torch.cuda.current_stream(device), side):
        with torch.cuda.stream(stream):
            salt = 1 if stream is side else 0
            # all_reduce, in place, sum and avg
            for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / world)):
                t = data(rank, N, salt, device)
                dist.all_reduce(t, op=op)
                want = sum(data(r, N, salt, "cpu") for r in range(world)) * scale
                close(t, want, f"all_reduce {op}")
            # all_gather_into_tensor
            out = torch.empty(N * world, device=device)
            dist.all_gather_into_tensor(out, data(rank, N, salt + 2, device))
            close(out, torch.cat([data(r, N, salt + 2, "cpu") for r in range(world)]),
                  "all_gather_into_tensor")
            # reduce_scatter_tensor (sum)
            part = torch.empty(N, device=device)
            dist.reduce_scatter_tensor(part, data(rank, N * world, salt + 3, device))
            full = sum(data(r, N * world, salt + 3, "cpu") for r in range(world))
            close(part, full[rank * N:(rank + 1) * N], "reduce_scatter_tensor")
            # broadcast from the last rank, a non-contiguous tensor
            b = data(rank, 2 * N, salt + 4, device).reshape(N, 2).t()
            dist.broadcast(b, src=world - 1)
            close(b, data(world - 1, 2 * N, salt + 4, "cpu").reshape(N, 2).t(), "broadcast")
            # all_to_all_single, equal splits
            a_in = data(rank, 3 * world, salt + 5, device)
            a_out = torch.empty_like(a_in)
            dist.all_to_all_single(a_out, a_in)
            want = torch.cat([data(r, 3 * world, salt + 5, "cpu")[rank * 3:(rank + 1) * 3]
                              for r in range(world)])
            close(a_out, want, "all_to_all_single")
            # async: wait() orders the current stream, no host block
            t = data(rank, N, salt + 6, device)
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            close(t, sum(data(r, N, salt + 6, "cpu") for r in range(world)), "async all_reduce")
    torch.cuda.synchronize(device)
    # Refused on CUDA, with a message naming it.
    if world > 1:
        try:
            dist.send(torch.ones(3, device=device), dst=(rank + 1) % world)
        except NotImplementedError as e:
            assert "CUDA" in str(e), e
        else:
            raise AssertionError("send of a CUDA tensor was accepted")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
