"""Through the whole engine (draft model, KV caches, rejection test), sampled output
follows the target's law: the joint law of the first two generated tokens is
compared with the exact law computed from the target alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysd.core.sampling import SamplingParams, SamplingTensors, logits_to_probs
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import tiny_model
from tests.core.test_distribution import chi_square_pvalue, tv_tolerance

V = 8
N = 6000  # samples; 64 cells of ~94 expected counts each


def exact_joint(target, prompt, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) = P(t1 | prompt) P(t2 | prompt, t1) under the same temperature/top-k/top-p."""
    sampling = SamplingTensors.from_params([params])
    with torch.no_grad():
        first = logits_to_probs(target(torch.tensor([prompt])).logits[:, -1], sampling)[0]
        seconds = torch.stack([
            logits_to_probs(target(torch.tensor([prompt + [t]])).logits[:, -1], sampling)[0] for t in range(V)
        ])
    return (first[:, None] * seconds).double().numpy()  # [V, V]


def assert_first_two_tokens_follow_target(results, target, prompt, params: SamplingParams, length: int) -> None:
    """Every result has `length` tokens, and the law of its first two is the target's exact joint
    law: nothing outside its support, chi-square at 1e-3 (cells expecting < 5 pooled), and total
    variation within E[TV] <= sqrt(m / N) / 2 over m cells plus McDiarmid's deviation at a
    false-alarm rate of 1e-6 (tests/core/test_distribution.py)."""
    expected = exact_joint(target, prompt, params)  # [V, V]
    n, V = len(results), expected.shape[0]
    counts = np.zeros((V, V))
    for r in results:
        assert len(r.token_ids) == length
        counts[r.token_ids[0], r.token_ids[1]] += 1
    support = expected.ravel() > 0
    assert counts.ravel()[~support].sum() == 0, "a token outside the target's support was emitted"
    assert chi_square_pvalue(counts.ravel(), expected.ravel()) > 1e-3
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert tv <= tv_tolerance(int(support.sum()), n), tv


def copyable_prompt(target) -> list[int]:
    """[3, 5, t, 3, 5] with t the token the target most likes there: the n-gram drafter
    then proposes t, which the target often accepts."""
    with torch.no_grad():
        scores = [torch.softmax(target(torch.tensor([[3, 5, t, 3, 5]])).logits[0, -1], -1)[t] for t in range(V)]
    t = int(torch.stack(scores).argmax())
    return [3, 5, t, 3, 5]


@pytest.mark.parametrize("runner", ["static", "dynamic"])
@pytest.mark.parametrize("drafter_kind,k", [("model", 2), ("model", 4), ("ngram", 3)])
def test_joint_law_of_two_tokens_matches_target(drafter_kind, k, runner):
    target = tiny_model("llama", seed=11, vocab=V)
    draft = tiny_model("llama", seed=12, layers=1, vocab=V)
    prompt = copyable_prompt(target)
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=2, ignore_eos=True)
    drafter = DraftModelDrafter(draft, V, runner=runner) if drafter_kind == "model" else NgramDrafter(V)
    speculation = SpeculationConfig(num_speculative_tokens=k)
    engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=1000, runner=runner))
    reqs = [Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 10_000 + i})) for i in range(N)]
    results = engine.generate(reqs)
    assert_first_two_tokens_follow_target(results, target, prompt, base, length=2)
    accepted = sum(r.stats.num_accepted_draft_tokens for r in results)
    assert accepted > 0  # the drafts were really used, not all rejected
