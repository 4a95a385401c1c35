"""Hierarchical speculation through the Ray actors (DrafterSpec(inner="ngram")): the draft actor's
middle level drafts for itself with n-gram lookup. Greedy output is the target's own; seeded
samples are the single-process engine's with the same three levels."""

from __future__ import annotations

import pytest

from raysd.actors.coordinator import ActorResources, CoordinatorConfig, SpecCoordinator
from raysd.actors.model_actors import DrafterSpec
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.hierarchy import AssistedDraftModelDrafter
from tests.actors.actor_helpers import factory, greedy_and_sampled, hf_greedy, random_prompts
from tests.conftest import EOS, VOCAB, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # tests/actors/conftest.py
CPU = ActorResources(num_cpus=1, num_gpus=0)
K = 4


def test_three_levels_through_the_actors_match_the_target_and_the_engine():
    prompts = [p + p for p in random_prompts(8, seed=6)]  # repeated halves: the lookup finds matches
    greedy, sampled = greedy_and_sampled(prompts)
    cfg = CoordinatorConfig(num_speculative_tokens=K, micro_batch_size=2, eos_token_ids=(EOS,), draft_resources=CPU,
                            target_resources=CPU)
    spec = DrafterSpec(factory("llama", 1), inner="ngram", inner_k=3, inner_adaptive=False)
    with SpecCoordinator(factory("llama", 0), spec, cfg) as c:
        out = c.generate(greedy + sampled)
    target = tiny_model("llama", 0)
    assert [r.token_ids for r in out.results[:4]] == [hf_greedy(target, list(r.prompt_token_ids), 12) for r in greedy]
    engine = SpecEngine(target, AssistedDraftModelDrafter(tiny_model("llama", 1), VOCAB, inner_k=3),
                        EngineConfig(K, 3, (EOS,)))
    assert [r.token_ids for r in out.results[4:]] == [r.token_ids for r in engine.generate(sampled)]


def test_draft_assist_refusals():
    with pytest.raises(ValueError, match="needs a draft model"):
        DrafterSpec(None, inner="ngram")
    with pytest.raises(ValueError, match="draft assist must be one of"):
        DrafterSpec(factory("llama", 1), inner="eagle")
    with pytest.raises(ValueError, match="tree drafting"):
        SpecCoordinator(factory("llama", 0), DrafterSpec(factory("llama", 1), inner="ngram", inner_adaptive=False),
                        CoordinatorConfig(tree_budget=4, draft_resources=CPU, target_resources=CPU))
