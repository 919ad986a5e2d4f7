"""shardline on CUDA from Python: the Scheduler on torch's CUDA stream and fully_shard of a CUDA
module. On a machine without a GPU the tests that need one skip and say so (scripts/gpu-run.sh
runs them on a GPU machine); the checks of what a CUDA call refuses run everywhere."""

import json
import socket

import pytest

import shardline

torch = pytest.importorskip("torch")

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(
    not GPU, reason="no CUDA device here (scripts/gpu-run.sh runs this on a GPU machine)")


@pytest.fixture
def world():
    (comm,) = shardline.init_local(1)
    return comm


def test_a_cuda_scheduler_needs_a_communicator_of_its_device(world):
    with pytest.raises(shardline.InvalidArgumentError,
                       match=r"communicator 'world' moves host memory, not cuda:0 memory"):
        shardline.Scheduler(world, device="cuda:0", framework="torch")


def test_cuda_views_are_torch_tensors(world):
    with pytest.raises(shardline.InvalidArgumentError, match="framework='torch'"):
        shardline.Scheduler(world, device="cuda:0", framework="numpy")


def test_device_and_stream_arguments(world):
    with pytest.raises(shardline.InvalidArgumentError, match="unknown device 'gpu'"):
        shardline.Scheduler(world, device="gpu")
    with pytest.raises(shardline.InvalidArgumentError, match="compute_stream is for device='cuda:N'"):
        shardline.Scheduler(world, compute_stream=0x1234)
    s = shardline.Scheduler(world, framework="torch")
    assert s.device == "host"
    with pytest.raises(shardline.InvalidArgumentError, match="optimizer has finished"):
        s.set_post_optimizer_event(0x1234)


@pytest.mark.skipif(GPU, reason="checks the refusal on a machine without a GPU")
def test_cuda_calls_without_a_gpu_are_errors():
    # A CUDA build reports the missing device; a build without CUDA says so.
    with pytest.raises((shardline.Error, RuntimeError), match="CUDA|cuda"):
        shardline.wrap_cuda_stream(0, 0)
    # ucx over CUDA memory (staged through pinned host memory) needs the device too.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(shardline.Error, match="staged on cuda:0"):
        shardline.init(backend="ucx", rank=0, world_size=1, address=f"127.0.0.1:{port}",
                       device="cuda:0", timeout=20)


def test_fully_shard_refuses_parameters_on_two_devices():
    from shardline.torch import _fsdp_init

    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3, device="meta"))
    assert _fsdp_init._module_device(module) == torch.device("cpu")  # meta decides nothing
    if not GPU:
        pytest.skip("a module on CPU and CUDA needs a GPU to build")
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3, device="cuda"))
    with pytest.raises(ValueError, match="move the module to one device"):
        _fsdp_init._module_device(module)


def check_parity(launch, tmp_path, world, args, timeout):
    """Runs cuda_fully_shard_worker.py on `world` ranks; every variant it ran must be within
    its tolerance (the report names the failures)."""
    out = tmp_path / "cuda.json"
    result = launch(world, ["cuda_fully_shard_worker.py", out, *args], timeout=timeout)
    assert out.exists(), result.describe()
    report = json.loads(out.read_text())
    failed = {k: v for k, v in report["results"].items() if not v["ok"]}
    assert not failed, json.dumps(failed, indent=1)
    assert result.returncode == 0, result.describe()


@needs_gpu
def test_fully_shard_on_cuda_matches_one_process(launch, tmp_path):
    """Every variant of cuda_fully_shard_worker.py (full shard, shard-grad-op, bf16,
    accumulation, activation checkpointing, offload, clip, grad scaler, post-optimizer event,
    a side stream) at world 1 over NCCL: parameters and losses within 1e-4 (fp32, TF32 off) or
    2e-2 (bf16, f16) of a plain run of the same global batch, with no host synchronization in
    the steps after the first."""
    check_parity(launch, tmp_path, 1, [], timeout=240)


@needs_gpu
@pytest.mark.parametrize("world,mesh,variants", [
    (2, "world", "full_shard,shard_grad_op,bf16,offload,clip"),
    (4, "world", "full_shard,accumulation,checkpoint"),
    (4, "hybrid", "full_shard,bf16"),
])
def test_ranks_sharing_the_gpu_match_one_process(launch, tmp_path, world, mesh, variants):
    """Ranks that share the one GPU shard over ucx staged through pinned host memory (NCCL
    refuses two ranks on one device): the same parity as at world 1."""
    check_parity(launch, tmp_path, world, ["--variants", variants, "--mesh", mesh], timeout=300)


@needs_gpu
@pytest.mark.parametrize("world", [1, 2])
def test_c10d_backend_on_cuda_tensors(launch, world):
    """init_process_group("shardline") with CUDA tensors: the collectives against plain loops,
    on the default and a side stream (world 1 over nccl, world 2 sharing the GPU over ucx
    staged), and point-to-point refused on CUDA naming it."""
    result = launch(world, ["cuda_c10d_worker.py"], timeout=180)
    assert result.returncode == 0, result.describe()
    assert result.output.count(": ok") == world, result.describe()


def test_the_cuda_world_backend_choice(monkeypatch):
    """get_default_world's backend for a CUDA model: nccl when each rank on the host has a GPU,
    ucx staged when ranks outnumber the GPUs, SHARDLINE_CUDA_BACKEND overriding either."""
    from shardline.torch import _fsdp_init

    gpus = torch.cuda.device_count()
    monkeypatch.delenv("SHARDLINE_CUDA_BACKEND", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(gpus + 1))
    assert _fsdp_init._cuda_backend() == "ucx"
    if gpus:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(gpus))
        assert _fsdp_init._cuda_backend() == "nccl"
    for chosen in ("nccl", "ucx"):
        monkeypatch.setenv("SHARDLINE_CUDA_BACKEND", chosen)
        assert _fsdp_init._cuda_backend() == chosen
    monkeypatch.setenv("SHARDLINE_CUDA_BACKEND", "gloo")
    with pytest.raises(ValueError, match="SHARDLINE_CUDA_BACKEND='gloo'"):
        _fsdp_init._cuda_backend()


def test_stream_for_a_host_communicator_is_its_own(world):
    from shardline.torch import stream_for

    assert stream_for(world) is None  # host memory: the communicator's own stream


def test_backend_premul_sum_without_a_readable_factor_is_named():
    """torch 2.11's ReduceOp hides PREMUL_SUM's factor: the backend names the op instead of
    failing on the missing attribute."""
    import torch.distributed as dist
    from shardline.torch import _backend_calls

    class Hidden:  # a PREMUL_SUM ReduceOp as torch 2.11 shows it to Python
        op = dist.ReduceOp.RedOpType.PREMUL_SUM

    with pytest.raises(NotImplementedError, match="PREMUL_SUM on torch"):
        _backend_calls._reduce_op(Hidden(), "allreduce")
    made = dist._make_nccl_premul_sum(0.25)
    if getattr(made, "factor", None) is None:  # this torch hides it too (2.11)
        with pytest.raises(NotImplementedError, match="PREMUL_SUM on torch"):
            _backend_calls._reduce_op(made, "allreduce")
    else:
        assert _backend_calls._reduce_op(made, "allreduce") == ("sum", 0.25)
