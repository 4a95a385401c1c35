"""Draft trees through the Ray actors (CoordinatorConfig.tree_budget): the draft actor grows the
tree, the target actor verifies it, and the accepted branch travels back in the step's outcome.
Greedy output is the target's own; seeded samples are the single-process engine's."""

from __future__ import annotations

import functools

import pytest

from raysd.actors import ActorResources, CoordinatorConfig, SpecCoordinator
from raysd.actors.model_actors import DrafterSpec
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig, StepCosts
from raysd.engine.drafters import DraftModelDrafter, FeatureDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from tests.actors.actor_helpers import factory, greedy_and_sampled, hf_greedy, random_prompts, requests
from tests.conftest import EOS, VOCAB, tiny_eagle, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # tests/actors/conftest.py
CPU = ActorResources(num_cpus=1, num_gpus=0)
K, P = 4, 8


def test_tree_through_the_actors_matches_the_target_and_the_engine():
    prompts = random_prompts(8, seed=6)
    greedy, sampled = greedy_and_sampled(prompts)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P)
    cfg = CoordinatorConfig(speculation, micro_batch_size=2, draft_resources=CPU, target_resources=CPU)
    with SpecCoordinator(factory("llama", 0), DrafterSpec(factory("llama", 1)), cfg) as c:
        out = c.generate(greedy + sampled)
    target = tiny_model("llama", 0)
    assert [r.token_ids for r in out.results[:4]] == [hf_greedy(target, list(r.prompt_token_ids), 12) for r in greedy]
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P)
    engine = SpecEngine(target, DraftModelDrafter(tiny_model("llama", 1), VOCAB), EngineConfig(speculation, max_batch_size=3))
    assert [r.token_ids for r in out.results[4:]] == [r.token_ids for r in engine.generate(sampled)]
    assert all(r.stats.mean_nodes_verified > 1 for r in out.results)


def test_trees_refuse_what_they_cannot_draft():
    with pytest.raises(ValueError, match="static runner"):
        CoordinatorConfig(SpeculationConfig(tree_budget=4), runner="dynamic")
    with pytest.raises(ValueError, match="tree drafting needs the static runner and a draft-model, EAGLE or n-gram drafter"):
        SpecCoordinator(factory("llama", 0), DrafterSpec(factory("llama", 1), runner="dynamic"),
                        CoordinatorConfig(SpeculationConfig(tree_budget=4), draft_resources=CPU, target_resources=CPU))


@pytest.mark.parametrize("shape", ["colocated", "split"])
def test_eagle_tree_through_the_actors_matches_the_target_and_the_engine(shape):
    """The feature draft's tree beside the target, and across two actors (the target actor returns
    the features of each row's head and accepted path with its verdict; the draft actor grows its
    next tree from them)."""
    prompts = random_prompts(8, seed=9)
    greedy, sampled = greedy_and_sampled(prompts)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P)
    cfg = CoordinatorConfig(speculation, micro_batch_size=2, draft_resources=CPU, target_resources=CPU)
    with SpecCoordinator(factory("llama", 0), DrafterSpec(functools.partial(tiny_eagle, 0, 3), shape=shape), cfg) as c:
        out = c.generate(greedy + sampled)
    target = tiny_model("llama", 0)
    assert [r.token_ids for r in out.results[:4]] == [hf_greedy(target, list(r.prompt_token_ids), 12) for r in greedy]
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P)
    engine = SpecEngine(target, FeatureDrafter(tiny_eagle(0, 3), VOCAB), EngineConfig(speculation, max_batch_size=3))
    assert [r.token_ids for r in out.results[4:]] == [r.token_ids for r in engine.generate(sampled)]
    assert any(r.stats.mean_nodes_verified > 1 for r in out.results) and (out.transfer.features > 0) == (c.shape == "split")


def test_ngram_tree_through_the_actors_matches_the_target():
    reqs = requests(random_prompts(6, seed=7), max_new_tokens=12)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P)
    cfg = CoordinatorConfig(speculation, micro_batch_size=3, draft_resources=CPU, target_resources=CPU)
    with SpecCoordinator(factory("llama", 0), DrafterSpec(None), cfg) as c:
        out = c.generate(reqs)
    target = tiny_model("llama", 0)
    assert [r.token_ids for r in out.results] == [hf_greedy(target, list(r.prompt_token_ids), 12) for r in reqs]


def test_the_tree_chosen_each_step_through_the_actors_matches_the_target():
    """-k auto with a tree budget: the draft actor (or, for n-gram, the target actor) chooses each
    step's chain or tree, and both actors draft and verify the one chosen."""
    reqs = requests(random_prompts(6, seed=8), max_new_tokens=12)
    target = tiny_model("llama", 0)
    expected = [hf_greedy(target, list(r.prompt_token_ids), 12) for r in reqs]
    costs = StepCosts((1, 4), (tuple(1.0 + 0.01 * k for k in range(P + 1)),) * 2, (0.05, 0.05))  # a verifier with spare width
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), tree_budget=P,
                                    adaptive=AdaptiveConfig(costs))
    cfg = CoordinatorConfig(speculation, micro_batch_size=3, draft_resources=CPU, target_resources=CPU)
    for drafter in (DrafterSpec(factory("llama", 1)), DrafterSpec(None)):
        with SpecCoordinator(factory("llama", 0), drafter, cfg) as c:
            out = c.generate(reqs)
            chosen = c.controller_state()["chosen"]
        assert [r.token_ids for r in out.results] == expected
        assert any(tree for _, tree in chosen), chosen
