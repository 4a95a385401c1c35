"""What the coordinator sends a micro-batch as it starts (its first StepCall), without Ray.

-k auto through the actors knows where the target's device turns compute-bound, as the engine
does: the target actor measures its crossover (raysd.models.profile.crossover_tokens; None on a
CPU), the coordinator puts it in the spec every micro-batch starts with, and every planner (the
draft actor's, a colocated target's, each tensor-parallel rank's) learns its costs with it.
A replica replaying CUDA graphs under a job's max_model_len captures its programs as a micro-batch
starts (StepCall.capture; tests/engine/test_graphed_steps.py runs it)."""

from __future__ import annotations

from raysd.actors.coordinator import SpecCoordinator
from raysd.actors.model_actors import _Planner
from raysd.actors.settings import CoordinatorConfig
from raysd.actors.wire import ActorInfo
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig


def _coordinator(speculation: SpeculationConfig, crossover: float | None = None, shape: str = "colocated",
                 **config) -> SpecCoordinator:
    coordinator = object.__new__(SpecCoordinator)  # these read the config, the shape and the actors' infos only
    coordinator.config = CoordinatorConfig(speculation, **config)
    coordinator.shape, coordinator._draft_graphs, coordinator.targets = shape, False, [None]
    coordinator.target_info = ActorInfo(1, "cuda:0", 64, 512, crossover_tokens=crossover)
    coordinator.draft_info = ActorInfo(2, "cuda:0", 64, 512)
    coordinator.can_decode = False
    return coordinator


def _admission(speculation: SpeculationConfig, crossover: float | None):
    return _coordinator(speculation, crossover).admission


def test_the_steps_spec_carries_the_targets_crossover():
    learned = SpeculationConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig())
    assert _admission(learned, 250.0).spec.adaptive.crossover_tokens == 250.0
    assert _admission(learned, None).spec.adaptive.crossover_tokens is None  # a CPU
    fixed = SpeculationConfig(num_speculative_tokens=4)
    assert _admission(fixed, 250.0).spec.adaptive is None


def test_a_planner_learns_its_costs_with_the_crossover_it_is_sent():
    spec = _admission(SpeculationConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig()), 250.0).spec
    planner = _Planner()
    hook = planner.for_spec(spec)
    assert hook.controller.costs.crossover_tokens == 250.0
    assert planner.for_spec(spec) is hook  # the same settings at the next micro-batch: the same controller


def test_a_graphed_replica_under_a_job_bound_captures_ahead():
    bounded = SpeculationConfig(num_speculative_tokens=4, max_model_len=96)
    graphed = {"runner": "static", "cuda_graphs": True, "micro_batch_size": 6}
    assert _coordinator(bounded, **graphed)._capture_ahead() == (6, 96)
    assert _coordinator(bounded, shape="split", **graphed)._capture_ahead() == (6, 96)
    # No job bound (a row may grow to the models' context), no graphs, or a tensor-parallel target: on first need.
    assert _coordinator(SpeculationConfig(num_speculative_tokens=4), **graphed)._capture_ahead() is None
    assert _coordinator(bounded, micro_batch_size=6)._capture_ahead() is None
    tensor_parallel = _coordinator(bounded, shape="split", **graphed)
    tensor_parallel.targets = [None, None]
    assert tensor_parallel._capture_ahead() is None


def test_the_target_measures_its_crossover_only_for_learned_costs():
    """As the engine: the matmul and copy that measure it run only where -k auto learns its costs."""
    from raysd.actors.launch import target_build
    from raysd.actors.wire import DrafterSpec

    def asks(speculation: SpeculationConfig) -> bool:
        return target_build(lambda: None, DrafterSpec(), CoordinatorConfig(speculation)).keywords["crossover"]

    assert asks(SpeculationConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig()))
    assert not asks(SpeculationConfig(num_speculative_tokens=4))
    assert not asks(SpeculationConfig(num_speculative_tokens=4, adaptive=AdaptiveConfig(crossover_tokens=50.0)))
