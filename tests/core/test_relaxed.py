"""The relaxed acceptance dial (rejection_sample's `relax`): exact at lambda = 0, and on
Yin et al.'s Pareto front otherwise (TV to the target lambda TV, rejections (1 - lambda) TV)."""

import math

import numpy as np
import pytest
import torch

from raysd.core.rejection import rejection_sample
from raysd.core.theory import pareto_front_tv_loss
from tests.core.test_distribution import chi_square_pvalue, tv_tolerance


def random_case(seed, B=256, K=3, V=7):
    g = torch.Generator().manual_seed(seed)
    draft = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    target = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    tokens = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, K)
    return tokens, torch.full((B,), K), draft, target, torch.rand(B, K, generator=g), torch.rand(B, generator=g)


def test_lambda_zero_is_the_exact_test_bit_for_bit():
    args = random_case(0)
    exact = rejection_sample(*args)
    zero = rejection_sample(*args, relax=torch.zeros(256))
    assert torch.equal(exact.output_token_ids, zero.output_token_ids) and torch.equal(exact.num_accepted, zero.num_accepted)


def test_lambda_one_accepts_every_draft():
    out = rejection_sample(*random_case(1), relax=torch.ones(256))
    assert (out.num_accepted == 3).all()


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.7])
def test_one_position_emits_the_mixture_and_sits_on_the_front(lam):
    """N = 100,000 rows with one draft each: the emitted token follows (1 - lam) p + lam q
    (chi-square at 1e-4, TV within the McDiarmid tolerance at 1e-6), and the rejection rate is
    (1 - lam) TV(p, q) within 5 standard errors."""
    N, V = 100_000, 6
    g = torch.Generator().manual_seed(42)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    tokens = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)  # [N, 1]
    out = rejection_sample(tokens, torch.ones(N, dtype=torch.int64), q.expand(N, 1, V), p.expand(N, 2, V),
                           torch.rand(N, 1, generator=g), torch.rand(N, generator=g), relax=torch.full((N,), lam))
    mixture = ((1 - lam) * p + lam * q).double().numpy()
    counts = np.bincount(out.output_token_ids[:, 0].numpy(), minlength=V)
    assert chi_square_pvalue(counts, mixture) > 1e-4
    assert 0.5 * np.abs(counts / N - mixture).sum() <= tv_tolerance(V, N)
    tv = 0.5 * float((p - q).abs().sum())
    rejected = float((out.num_accepted == 0).double().mean())
    se = math.sqrt(max(rejected * (1 - rejected), 1e-12) / N)
    assert abs(rejected - (1 - lam) * tv) < 5 * se + 1e-6
    # The output's distance to the target is lam TV: the front's loss at that rejection rate.
    assert 0.5 * np.abs(mixture - p.double().numpy()).sum() == pytest.approx(pareto_front_tv_loss((1 - lam) * tv, tv), abs=1e-6)
