"""A tensor-parallel target in bf16: 2 ranks' greedy tokens against the whole bf16 model's
own `generate`, judged by the near-tie rule (tests/gpu/gpu_helpers.py): the ranks' all-reduce adds
two partial sums where the whole model's matmul adds one, so bf16 may flip a near-tie, nothing else.

With two GPUs or more each rank has its own and the group is NCCL's (what a job runs); with one,
both ranks share it over gloo (CUDA tensors), which tests the sharded bf16 arithmetic but not NCCL.
`RAYSD_GPU_TESTS_ON_CPU=1` dry-runs it on the CPU in bf16."""

from __future__ import annotations

import torch

from tests.gpu.gpu_helpers import DEVICE, check_greedy_close, hf_greedy, tiny_on_device

MAX_NEW = 24


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 9, 1, 12, 3, 7, 4, 16)]


def _sharded_greedy(rank: int, world_size: int) -> list[list[int]]:
    from raysd.core.sampling import SamplingParams
    from raysd.core.speculation import SpeculationConfig
    from raysd.engine.drafters import NgramDrafter
    from raysd.engine.engine import EngineConfig, SpecEngine
    from raysd.engine.requests import Request
    from raysd.models.tensor_parallel import shard_model
    from tests.conftest import EOS, tiny_model

    device = torch.device("cuda", rank % torch.cuda.device_count()) if DEVICE.type == "cuda" else DEVICE
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = shard_model(tiny_model("llama").to(torch.bfloat16).eval(), rank, world_size).to(device)
    engine = SpecEngine(model, NgramDrafter(96, device), EngineConfig(SpeculationConfig(4, eos_token_ids=(EOS,)),
                                                                      max_batch_size=8))
    return [r.token_ids for r in engine.generate([Request(i, p, SamplingParams(max_new_tokens=MAX_NEW))
                                                  for i, p in enumerate(_prompts())])]


def _rank(rank: int, world_size: int, port: int, backend: str, path: str) -> None:
    from raysd.models.tensor_parallel import init_group

    if backend == "nccl":
        torch.cuda.set_device(rank)
    init_group(rank, world_size, "127.0.0.1", port, backend, timeout_s=120)
    try:
        out = _sharded_greedy(rank, world_size)
        if rank == 0:
            torch.save(out, path)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_bf16_tp2_greedy_within_near_ties(tmp_path):
    import torch.multiprocessing as mp

    from raysd.models.tensor_parallel import free_address

    backend = "nccl" if DEVICE.type == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    _, port = free_address()
    path = str(tmp_path / "rank0.pt")
    mp.start_processes(_rank, args=(2, port, backend, path), nprocs=2, join=True, start_method="spawn")
    got = torch.load(path)
    model = tiny_on_device("llama")
    expected = [hf_greedy(model, p, MAX_NEW) for p in _prompts()]
    print(f"backend {backend}: {sum(a == b for a, b in zip(got, expected))}/{len(got)} rows identical")
    check_greedy_close(model, _prompts(), got, expected, min_identical=0.75)
