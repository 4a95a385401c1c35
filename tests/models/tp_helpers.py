"""Run a function on N gloo ranks (torch.multiprocessing, spawn) and collect what rank 0 returns.

The ranks are fresh processes: each imports this module, joins the group
(raysd.models.tensor_parallel.init_group) and calls `fn(rank, world_size, *args)`; rank 0's
return value comes back through a file (torch.save) so that tensors travel as they are.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world_size: int, port: int, path: str, fn, args) -> None:
    torch.set_num_threads(1)  # N ranks on two cores: one thread each
    from raysd.models.tensor_parallel import init_group

    init_group(rank, world_size, "127.0.0.1", port, "gloo", timeout_s=120)
    try:
        out = fn(rank, world_size, *args)
        if rank == 0:
            torch.save(out, path)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args):
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; rank 0's result. `fn` must be a
    module-level function (spawn pickles it by name)."""
    from raysd.models.tensor_parallel import free_address

    _, port = free_address()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.pt")
        mp.start_processes(_rank, args=(world_size, port, path, fn, args), nprocs=world_size, join=True,
                           start_method="spawn")
        return torch.load(path, weights_only=False)
