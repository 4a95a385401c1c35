"""A tensor-parallel target through the actors: TP = 2 rank actors (gloo on the CPU) give the
single-process engine's tokens and TP = 1's, with a colocated suffix drafter and with a draft
model in its own actor, greedy and seeded; the step costs are profiled on all ranks at once; a
killed rank's recovery is the job-level chaos test's (tests/reliability/test_tensor_parallel_chaos.py)."""

from __future__ import annotations

import pytest
import ray

from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.suffix import SuffixDrafter
from raysd.models.tensor_parallel import TensorParallel
from tests.actors.actor_helpers import factory, greedy_and_sampled, random_prompts
from tests.conftest import EOS, VOCAB, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]
CPU = ActorResources(num_cpus=1, num_gpus=0)
K = 4


def _coordinator(draft: DrafterSpec, tp: int, micro_batch_size: int = 3) -> SpecCoordinator:
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    cfg = CoordinatorConfig(speculation, micro_batch_size=micro_batch_size, draft_resources=CPU, target_resources=CPU,
                            target_tensor_parallel=tp)
    return SpecCoordinator(factory("llama", 0), draft, cfg)


def _engine(drafter, batch: int = 3):
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    return SpecEngine(tiny_model("llama", 0), drafter, EngineConfig(speculation, max_batch_size=batch))


def _tokens(results):
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def draft_model_tp2():
    with _coordinator(DrafterSpec(factory("llama", 1)), tp=2) as c:
        yield c


def test_ranks_hold_their_shards(draft_model_tp2):
    c = draft_model_tp2
    infos = ray.get([t.info.remote() for t in c.targets])
    assert [i.tensor_parallel for i in infos] == [TensorParallel(0, 2), TensorParallel(1, 2)]
    assert len({i.pid for i in infos}) == 2 and c.target_info == infos[0]
    assert not c.transport.device_channel


def test_draft_actor_tp2_matches_engine(draft_model_tp2):
    """The whole target's tokens in the single-process engine (which TP = 1 through the actors
    gives: tests/actors/test_pipeline.py), greedy and seeded."""
    greedy, sampled = greedy_and_sampled(random_prompts(10, seed=3))
    reqs = greedy + sampled
    out = draft_model_tp2.generate(reqs)
    engine = _engine(DraftModelDrafter(tiny_model("llama", 1), VOCAB)).generate(reqs)
    assert _tokens(out.results) == _tokens(engine)
    assert [r.stats.num_accepted_draft_tokens for r in out.results] == [r.stats.num_accepted_draft_tokens for r in engine]
    assert draft_model_tp2.shape == "split"  # a draft model beside a tensor-parallel target keeps its own actor
    assert out.stats.steps > 0 and out.stats.recoveries == 0


def test_ranks_off_the_drivers_node_step_as_tasks_with_the_same_tokens(draft_model_tp2):
    """Across nodes the step runs as actor tasks (raysd.actors.transport.TaskTransport): every rank
    gets the same proposal's ObjectRef, and the tokens are the compiled graph's."""
    from raysd.actors.transport import GraphTransport, TaskTransport

    c = draft_model_tp2
    greedy, sampled = greedy_and_sampled(random_prompts(6, seed=9), max_new_tokens=10)
    graph = c.generate(greedy + sampled)
    assert c._members().one_node and isinstance(c.transport, GraphTransport)
    c.transport.close()
    c.transport = TaskTransport(c._members(), c._transport_config())
    try:
        tasks = c.generate(greedy + sampled)
    finally:
        c.transport.close()
        c.transport = GraphTransport(c._members(), c._transport_config())
    assert _tokens(tasks.results) == _tokens(graph.results)


def test_colocated_suffix_tp2_matches_engine_and_tp1():
    greedy, sampled = greedy_and_sampled(random_prompts(8, seed=4))
    reqs = greedy + sampled
    spec = DrafterSpec(model_free="suffix")
    with _coordinator(spec, tp=2, micro_batch_size=4) as c:
        assert c.draft is None and len(c.targets) == 2
        out = c.generate(reqs)
    with _coordinator(spec, tp=1, micro_batch_size=4) as c:
        whole = c.generate(reqs)
    # micro-batches of 4, one at a time per micro-batch: the engine's batch of the same rows
    engine = _engine(SuffixDrafter(VOCAB), batch=4).generate(reqs)
    assert _tokens(out.results) == _tokens(whole.results)
    assert _tokens(out.results[: len(greedy)]) == _tokens(engine[: len(greedy)])  # greedy: the target's own tokens


def test_step_costs_are_profiled_on_every_rank_at_once(draft_model_tp2):
    costs = draft_model_tp2.profile_step_costs(2, [1, 2], context=16, reps=1)
    assert costs.batch_sizes == (1, 2) and len(costs.target_s[0]) == 3 and all(t > 0 for row in costs.target_s for t in row)
