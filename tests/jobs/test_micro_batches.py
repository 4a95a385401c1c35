"""A replica runs one micro-batch unless a draft model's step costs say two pay (issue 17 item 3).

The costs are injected (what `cached_step_costs` would have measured), so the choice is
deterministic; the tokens through the replica are the single-process engine's either way."""

from __future__ import annotations

import pytest

import raysd.jobs.profiles as profiles
from raysd.core.sampling import SamplingParams
from raysd.core.speculation import StepCosts
from raysd.jobs.config import GenerateConfig
from raysd.jobs.replica import GenerationReplica
from tests.conftest import EOS
from tests.jobs.conftest import token_prompts
from tests.jobs.test_generate import reference

pytestmark = pytest.mark.slow

BATCH = 8


def memory_bound(key: dict) -> StepCosts:
    """A step costs the same at every batch size, and a draft step nearly as much as the target's."""
    sizes = tuple(key["batch_sizes"])
    return StepCosts(sizes, tuple((1.0,) * (key["k_max"] + 1) for _ in sizes), tuple(0.9 for _ in sizes))


def compute_bound(key: dict) -> StepCosts:
    """Costs proportional to the rows, and a costly draft: overlap hides it."""
    sizes = tuple(key["batch_sizes"])
    return StepCosts(sizes, tuple((0.25 * b,) * (key["k_max"] + 1) for b in sizes), tuple(0.1 * b for b in sizes))


def run_replica(cfg: GenerateConfig, prompts) -> tuple[int, list[list[int]]]:
    replica = GenerationReplica(cfg)
    try:
        # the target's EOS, as its actor read it from the loaded model (no config read again in the replica)
        assert replica.coordinator.config.speculation.eos_token_ids == replica.coordinator.target_info.eos_token_ids == (EOS,)
        outputs, _ = replica.generate([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
        return replica.coordinator.config.num_micro_batches, [o["generated_token_ids"] for [o] in outputs]  # one sample each
    finally:
        replica.shutdown()


@pytest.mark.parametrize("costs, expected", [(memory_bound, 1), (compute_bound, 2)])
def test_a_draft_model_splits_the_batch_only_where_overlap_pays(costs, expected, tmp_path, model_dirs, local_ray, monkeypatch):
    target, draft = model_dirs
    keys = []
    monkeypatch.setattr(profiles, "cached_step_costs", lambda key, measure: (keys.append(key) or costs(key), True))
    prompts = token_prompts(10, seed=4)
    cfg = GenerateConfig(input=str(tmp_path), output=str(tmp_path / "out"), target=target, draft=draft,
                         max_new_tokens=6, batch_size=BATCH, quiet=True)
    micro, tokens = run_replica(cfg, prompts)
    assert keys and keys[0]["batch_sizes"] == [1, BATCH // 2, BATCH]
    assert micro == expected
    assert tokens == reference(target, draft, prompts, [SamplingParams(max_new_tokens=6)] * len(prompts))


def test_a_model_free_drafter_runs_one_micro_batch_without_profiling(tmp_path, model_dirs, local_ray, monkeypatch):
    target, _ = model_dirs

    def no_profile(key, measure):
        raise AssertionError("a fixed K with a model-free drafter needs no step costs")

    monkeypatch.setattr(profiles, "cached_step_costs", no_profile)
    prompts = token_prompts(10, seed=5)
    cfg = GenerateConfig(input=str(tmp_path), output=str(tmp_path / "out"), target=target, draft="ngram",
                         max_new_tokens=6, batch_size=BATCH, quiet=True, num_speculative_tokens=4)  # auto profiles for K
    micro, tokens = run_replica(cfg, prompts)
    assert micro == 1
    assert tokens == reference(target, "ngram", prompts, [SamplingParams(max_new_tokens=6)] * len(prompts))
