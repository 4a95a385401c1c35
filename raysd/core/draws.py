"""Counter-based random draws: a uniform in [0, 1) as a pure function of
(seed, position, draw index), computed on whatever device the keys live on.

A row's draws depend only on its own seed and how far it has generated, never on its
batch, the other rows or the order of calls, so a seed reproduces a row anywhere (engine,
actors, another batch size) with no per-row `torch.Generator` and no host round trip.
This is the counter-based construction of Salmon et al. 2011 ("Parallel random numbers:
as easy as 1, 2, 3"); the bijective mixer is Wellons' `lowbias32` integer hash, applied
in a chain over the key's 32-bit words. Every intermediate stays below 2^49, so int64
arithmetic never overflows and CPU and GPU give bit-identical draws.

Keys: `seeds` [B] int64 in [0, 2^63), `positions` [B] int64 in [0, 2^32) (tokens the row
has generated when the step starts: every step emits at least one token, so no two steps
of a row share a position), draw index j in [0, num_draws).
"""

from __future__ import annotations

import numpy as np
import torch

from raysd.core.device import host_to_device

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x, c < 2^32, in int64 without overflow: c split in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of [0, 2^32) with strong avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor, num_draws: int) -> torch.Tensor:
    """[B, num_draws] float64 uniforms in [0, 1) with 53 random bits each.

    Args:
        seeds: [B] int64 in [0, 2^63).
        positions: [B] int64 in [0, 2^32).
        num_draws: draws per row (e.g. 2K + 1 for one speculative step).
    """
    assert seeds.shape == positions.shape and seeds.dim() == 1, (seeds.shape, positions.shape)
    device = seeds.device
    j = torch.arange(num_draws, dtype=torch.int64, device=device)[None, :]  # [1, N]
    seed_lo, seed_hi = (seeds & _MASK32)[:, None], ((seeds >> 32) & _MASK32)[:, None]  # [B, 1]
    pos = (positions & _MASK32)[:, None]  # [B, 1]
    h = _mix32(seed_hi ^ _mix32(seed_lo ^ _mix32(pos ^ _mix32(j))))  # [B, N]
    hi = _mix32(h ^ 0x68E31DA4) >> 5  # 27 bits
    lo = _mix32(h ^ 0xB5297A4D) >> 6  # 26 bits
    return ((hi << 26) + lo).double() * 2.0**-53  # [B, N]


def step_uniforms(seeds, positions, k: int, device) -> torch.Tensor:
    """[B, 2k + 1] float64 draws for one speculative step, computed on `device`: k for drafting
    (a tree: one per node), k for acceptance, 1 for the final token, keyed by each row's seed
    and the tokens it has generated so far (host sequences or arrays)."""
    keys = torch.as_tensor(np.stack([np.asarray(seeds, dtype=np.int64), np.asarray(positions, dtype=np.int64)]))  # [2, B]
    keys = host_to_device(keys, torch.int64, device)
    return counter_uniforms(keys[0], keys[1], 2 * k + 1)
