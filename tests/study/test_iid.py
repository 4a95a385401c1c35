"""On toy models whose acceptance is i.i.d. by construction (raysd.study.toy), the engine's
measured acceptance matches Leviathan et al.'s closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.theory import expected_tokens_per_step, truncated_geometric_pmf
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.rows import Request
from raysd.study.toy import fixed_distribution_llama, next_token_probs

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
    engine = SpecEngine(target, DraftModelDrafter(draft, V), EngineConfig(num_speculative_tokens=k, max_batch_size=64))
    params = [SamplingParams(temperature=1.0, max_new_tokens=240, ignore_eos=True, seed=i) for i in range(64)]
    results = engine.generate([Request(i, [1 + i % 5, 3], p) for i, p in enumerate(params)])

    alpha = np.mean([r.stats.alpha_estimate for r in results])
    assert alpha == pytest.approx(a, abs=1e-4)  # the same overlap at every position, by construction
    steps = sum(r.stats.num_spec_steps for r in results)
    mean_len = 1 + sum(r.stats.num_accepted_draft_tokens for r in results) / steps
    assert steps > 3000
    assert mean_len == pytest.approx(expected_tokens_per_step(a, k), rel=0.05)
    # The whole law of accepted drafts per step is the truncated geometric (TV distance small).
    hist = np.sum([r.stats.acceptance_histogram for r in results], axis=0) / steps
    assert 0.5 * np.abs(hist - truncated_geometric_pmf(a, k)).sum() < 0.03
