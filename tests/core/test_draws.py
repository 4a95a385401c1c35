"""Counter-based draws (raysd.core.draws): pure functions of (seed, position, draw index)."""

import numpy as np
import torch
from scipy.stats import chisquare

from raysd.core.draws import counter_uniforms


def test_a_row_draws_the_same_whatever_else_is_in_the_batch():
    alone = counter_uniforms(torch.tensor([42]), torch.tensor([7]), 9)
    batch = counter_uniforms(torch.tensor([1, 42, 2**63 - 1]), torch.tensor([7, 7, 0]), 9)
    assert torch.equal(batch[1:2], alone)
    assert alone.dtype == torch.float64 and alone.shape == (1, 9)
    # Another position, seed or draw index gives other draws.
    assert not torch.equal(counter_uniforms(torch.tensor([42]), torch.tensor([8]), 9), alone)
    assert not torch.equal(counter_uniforms(torch.tensor([43]), torch.tensor([7]), 9), alone)
    assert len(set(alone[0].tolist())) == 9


def _reference(seed: int, position: int, j: int) -> float:
    """The same construction in Python integers (no int64 tricks): lowbias32 chained over the key."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    h = mix((seed >> 32) ^ mix((seed & 0xFFFFFFFF) ^ mix(position ^ mix(j))))
    return ((mix(h ^ 0x68E31DA4) >> 5) * 2**26 + (mix(h ^ 0xB5297A4D) >> 6)) / 2**53


def test_matches_a_plain_integer_reference():
    """The int64 tensor arithmetic (16-bit split multiplies) equals exact integer arithmetic."""
    keys = [(0, 0), (1, 1), (2**63 - 1, 2**32 - 1), (123456789012345, 77), (2**40 + 3, 5000)]
    u = counter_uniforms(torch.tensor([k[0] for k in keys]), torch.tensor([k[1] for k in keys]), 5)
    for (seed, pos), row in zip(keys, u.tolist()):
        assert row == [_reference(seed, pos, j) for j in range(5)]


def test_uniform_and_uncorrelated():
    """200,000 draws over 100 bins: chi-square at a false-alarm rate of 1e-6 (the keys are
    fixed, so the outcome is too); neighbouring draw indices and positions uncorrelated
    within 6 standard errors (1/sqrt(n))."""
    n_rows, n_draws = 20_000, 10
    seeds = torch.arange(n_rows, dtype=torch.int64) * 2654435761 % 2**62
    positions = torch.arange(n_rows, dtype=torch.int64) % 97
    u = counter_uniforms(seeds, positions, n_draws).numpy()
    counts, _ = np.histogram(u.ravel(), bins=100, range=(0.0, 1.0))
    assert chisquare(counts).pvalue > 1e-6
    assert u.min() >= 0.0 and u.max() < 1.0
    bound = 6 / np.sqrt(n_rows)
    for j in range(n_draws - 1):
        assert abs(np.corrcoef(u[:, j], u[:, j + 1])[0, 1]) < bound
    next_pos = counter_uniforms(seeds, positions + 1, 1).numpy()[:, 0]
    assert abs(np.corrcoef(u[:, 0], next_pos)[0, 1]) < bound
