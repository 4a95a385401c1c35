"""Host values to the device without a host synchronisation.

PyTorch's blocking copy of pageable host memory to a GPU (`torch.tensor(values, device="cuda")`,
`cpu_tensor.to("cuda")`) returns only once the stream has run everything queued before it: the host
then launches the rest of the step's kernels while the GPU idles. A step copies several small
tensors (lengths, pending tokens, draft counts), each of which would be such a synchronisation.
They go through pinned memory instead, asynchronously: the caching host allocator keeps a pinned
block until its copy has run.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch


def host_to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (host numbers, or a CPU tensor) as a `dtype` tensor on `device`: on CUDA through pinned
    memory with no host synchronisation, elsewhere a plain copy."""
    device = torch.device(device)
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def padded_rows(rows: Sequence[Sequence[int]], width: int, right_aligned: bool) -> tuple[np.ndarray, np.ndarray]:
    """[B, width] int64 token ids of `rows`, each on the left (0-padded on the right) or on the right
    (left-padded), and their validity, built on the host with no work per row."""
    counts = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))  # [B]
    columns = np.arange(width)[None, :]  # [1, width]
    valid = columns >= width - counts[:, None] if right_aligned else columns < counts[:, None]  # [B, width]
    ids = np.zeros((len(rows), width), dtype=np.int64)
    ids[valid] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(counts.sum()))  # row-major: each row in order
    return ids, valid
