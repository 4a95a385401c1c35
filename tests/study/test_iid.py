"""On toy models whose acceptance is i.i.d. by construction (raysd.study.toy), the engine's
measured acceptance matches Leviathan et al.'s closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.core.theory import expected_tokens_per_step, truncated_geometric_pmf
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.study.toy import fixed_distribution_llama, next_token_probs
from tests.core.test_distribution import tv_tolerance

V = 12


def toy_pair(noise: float):
    """Target logits l, draft logits l + noise * n: more noise, lower acceptance."""
    g = torch.Generator().manual_seed(0)
    logits, n = torch.randn(V, generator=g), torch.randn(V, generator=g)
    target, draft = fixed_distribution_llama(logits), fixed_distribution_llama(logits + noise * n)
    p, q = next_token_probs(target), next_token_probs(draft)
    return target, draft, float(torch.minimum(p, q).sum())


@pytest.mark.parametrize("noise,k", [(0.3, 6), (1.0, 2), (1.0, 4), (2.0, 3)])  # a = 0.87, 0.60, 0.60, 0.37
def test_iid_acceptance_matches_theory(noise, k):
    target, draft, a = toy_pair(noise)
    assert 0.3 < a < 0.95
    speculation = SpeculationConfig(num_speculative_tokens=k)
    engine = SpecEngine(target, DraftModelDrafter(draft, V), EngineConfig(speculation, max_batch_size=64))
    params = [SamplingParams(temperature=1.0, max_new_tokens=240, ignore_eos=True, seed=i) for i in range(64)]
    results = engine.generate([Request(i, [1 + i % 5, 3], p) for i, p in enumerate(params)])

    alpha = np.mean([r.stats.alpha_estimate for r in results])
    assert alpha == pytest.approx(a, abs=1e-4)  # the same overlap at every position, by construction
    counts = np.sum([r.stats.acceptance_histogram for r in results], axis=0)  # steps accepting j drafts
    steps = int(counts.sum())
    assert steps > 3000
    # Steps at the end of a row offer fewer than K drafts (its budget): each draft not offered
    # moves the mean by at most a and the law by at most 1 / steps.
    not_offered = k * steps - sum(r.stats.speculation_length_sum for r in results)
    j = np.arange(k + 1)
    mean = (j * counts).sum() / steps
    se = np.sqrt((counts * (j - mean) ** 2).sum() / (steps - 1) / steps)
    expected = expected_tokens_per_step(a, k) - 1
    assert expected - a * not_offered / steps - 5 * se <= mean <= expected + 5 * se, (mean, expected, se)
    # The whole law of accepted drafts per step is the truncated geometric: TV within the
    # sampling tolerance at a false-alarm rate of 1e-6, plus the cut-short steps.
    tv = 0.5 * np.abs(counts / steps - truncated_geometric_pmf(a, k)).sum()
    assert tv <= tv_tolerance(k + 1, steps) + not_offered / steps, tv
