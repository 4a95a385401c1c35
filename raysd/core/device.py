"""Host values to the device without a host synchronisation.

PyTorch's blocking copy of pageable host memory to a GPU (`torch.tensor(values, device="cuda")`,
`cpu_tensor.to("cuda")`) returns only once the stream has run everything queued before it: the host
then launches the rest of the step's kernels while the GPU idles. On an H100 the engine made 5.5 such
synchronisations per plain decode step and 12.8 at K = 4 (docs/performance.md, GPU), most of them
small per-step tensors (lengths, pending tokens, draft counts). These go through pinned memory
instead, asynchronously: the caching host allocator keeps a pinned block until its copy has run.
"""

from __future__ import annotations

from typing import Sequence

import torch


def host_to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (host numbers, or a CPU tensor) as a `dtype` tensor on `device`: on CUDA through pinned
    memory with no host synchronisation, elsewhere a plain copy."""
    device = torch.device(device)
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
