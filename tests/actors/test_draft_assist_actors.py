"""Hierarchical speculation through the Ray actors (DrafterSpec(draft_assist="ngram")): the draft actor's
middle level drafts for itself with n-gram lookup. Greedy output is the target's own; seeded
samples are the single-process engine's with the same three levels."""

from __future__ import annotations

import pytest

from raysd.actors import ActorResources, CoordinatorConfig, SpecCoordinator
from raysd.actors.model_actors import DrafterSpec
from raysd.core.speculation import SpeculationConfig
from raysd.engine.draft_assist import DraftAssistDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from tests.actors.actor_helpers import factory, greedy_and_sampled, hf_greedy, random_prompts
from tests.conftest import EOS, VOCAB, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # tests/actors/conftest.py
CPU = ActorResources(num_cpus=1, num_gpus=0)
K = 4


def test_three_levels_through_the_actors_match_the_target_and_the_engine():
    prompts = [p + p for p in random_prompts(8, seed=6)]  # repeated halves: the lookup finds matches
    greedy, sampled = greedy_and_sampled(prompts)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    cfg = CoordinatorConfig(speculation, micro_batch_size=2, draft_resources=CPU, target_resources=CPU)
    spec = DrafterSpec(factory("llama", 1), draft_assist="ngram", assist_k=3, assist_adaptive=False)
    with SpecCoordinator(factory("llama", 0), spec, cfg) as c:
        out = c.generate(greedy + sampled)
    target = tiny_model("llama", 0)
    assert [r.token_ids for r in out.results[:4]] == [hf_greedy(target, list(r.prompt_token_ids), 12) for r in greedy]
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    engine = SpecEngine(target, DraftAssistDrafter(tiny_model("llama", 1), VOCAB, assist_k=3),
                        EngineConfig(speculation, max_batch_size=3))
    assert [r.token_ids for r in out.results[4:]] == [r.token_ids for r in engine.generate(sampled)]


def test_draft_assist_refusals():
    with pytest.raises(ValueError, match="needs a draft model"):
        DrafterSpec(None, draft_assist="ngram")
    with pytest.raises(ValueError, match="draft assist must be one of"):
        DrafterSpec(factory("llama", 1), draft_assist="eagle")
    with pytest.raises(ValueError, match="tree drafting"):
        SpecCoordinator(factory("llama", 0), DrafterSpec(factory("llama", 1), draft_assist="ngram", assist_adaptive=False),
                        CoordinatorConfig(SpeculationConfig(tree_budget=4), draft_resources=CPU, target_resources=CPU))
