"""A replica's placement group and model actors, started by a process that need not import torch.

The model actors' Ray classes here are hosts: each builds its worker (raysd.actors.model_actors:
TargetWorker, DraftWorker) in its own process from a picklable `build` callable and forwards
every call to it, as vLLM's RayWorkerWrapper hosts its worker. Nothing here imports torch, so a
job's replica (raysd.jobs.replica) starts its model actors first, and they import theirs and load
their models while the replica sets up its coordinator and tokenizer. `SpecCoordinator` starts
its actors through here too (one way to start them), and takes actors started ahead of it
(`ModelActors`). Ray shows the hosts' class names (`ray::TargetActor`), by which the chaos tests
and the soak find their processes.
"""

from __future__ import annotations

import functools
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysd.actors.liveness import PLACEMENT_TIMEOUT_S
from raysd.actors.local import exit_when_orphaned
from raysd.actors.settings import MAX_ACTOR_RESTARTS, ActorResources, CoordinatorConfig
from raysd.actors.wire import DrafterSpec, ModelFactory
from raysd.models.names import TensorParallel



class PlacementFailed(RuntimeError):
    """A replica's placement group could not be placed within its timeout: the cluster has no room
    for its model actors now."""


def in_passing_thread(fn: Callable, *args):
    """`fn(*args)` in a thread that ends with it: a model actor's torch work outside its steps
    (building its model, timing its steps), which Ray runs in the process's main thread.

    libgomp (PyTorch's OpenMP on Linux) keeps a worker pool for each thread that runs a parallel
    region, and once it manages more threads than there are cores it stops spinning at its
    barriers: every parallel op then sleeps and wakes its workers. A step runs in the compiled
    graph's execution thread, not the main one; had the main thread run parallel work (a step-cost
    profile's forwards), its pool would live on beside the steps' and slow them: with as many
    threads as cores and small ops, a second thread runs markedly slower than the first while the
    first's pool lives, as fast once the first thread has ended. A pool goes with the thread that
    made it.
    """
    out: list = []

    def run() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            out.append((False, exc))

    thread = threading.Thread(target=run, name="raysd-model-work")
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


class TargetActor:
    """Ray's class for a target actor: `build()` makes raysd.actors.model_actors.TargetWorker in this
    process (and again on Ray's restart of it); each method is that worker's. Its torch work outside
    the steps runs `in_passing_thread`."""

    def __init__(self, build: Callable[[], object]):
        self.actor = in_passing_thread(build)

    def group_address(self):
        return self.actor.group_address()

    def join_group(self, address, port, timeout_s):
        return self.actor.join_group(address, port, timeout_s)

    def time_steps(self, batch_sizes, k_max, context, reps):
        return in_passing_thread(self.actor.time_steps, batch_sizes, k_max, context, reps)

    def time_drafter(self, batch_sizes, context, reps):
        return in_passing_thread(self.actor.time_drafter, batch_sizes, context, reps)

    def beam_search(self, requests, spec, eos_token_ids):
        return self.actor.beam_search(requests, spec, eos_token_ids)

    def info(self):
        return self.actor.info()

    def get_vocab_size(self):
        return self.actor.get_vocab_size()

    def controller_state(self):
        return self.actor.controller_state()

    def draft_sources(self):
        return self.actor.draft_sources()

    def await_proposal(self, call):
        return self.actor.await_proposal(call)

    def step(self, call, proposed=None):
        return self.actor.step(call, proposed)


class DraftActor:
    """Ray's class for a split replica's draft actor: `build(target_name)` makes raysd.actors.
    model_actors.DraftWorker, which asks the named target actor for its vocabulary size; each method
    is that worker's (its torch work outside the steps `in_passing_thread`, as the target's)."""

    def __init__(self, build: Callable[[str], object], target_name: str):
        self.actor = in_passing_thread(build, target_name)

    def time_steps(self, batch_sizes, context, reps):
        return in_passing_thread(self.actor.time_steps, batch_sizes, context, reps)

    def info(self):
        return self.actor.info()

    def controller_state(self):
        return self.actor.controller_state()

    def draft_sources(self):
        return self.actor.draft_sources()

    def transfer_stats(self):
        return self.actor.transfer_stats()

    def propose(self, call):
        return self.actor.propose(call)

    def rest(self, proposed):
        return self.actor.rest(proposed)


@dataclass
class ModelActors:
    """A replica's placement group (bundles 0..N-1: the target's ranks; bundle N: the draft actor,
    if any) and its model actors, as `start_model_actors` started them."""

    placement_group: PlacementGroup
    node: str  # the node of the process that started them (the step graph's driver)
    targets: list  # one handle per tensor-parallel rank; rank 0 named `target_name`
    draft: object | None
    target_name: str


def cluster_room() -> str:
    """What the cluster has and has free, in the units a bundle asks for (CPUs, GPUs, custom
    resources; not Ray's internal per-group and per-node ones)."""

    def plain(resources: dict) -> str:
        kept = {k: v for k, v in sorted(resources.items())
                if "_group_" not in k and not k.startswith("node:") and k not in ("memory", "object_store_memory")}
        return ", ".join(f"{k} {v:g}" for k, v in kept.items()) or "nothing"

    return f"the cluster has {plain(ray.cluster_resources())}, of which {plain(ray.available_resources())} free"


def start_model_actors(target_builds: Sequence[Callable[[], object]], draft_build: Callable[[str], object] | None,
                       target_resources: ActorResources, draft_resources: ActorResources, strategy: str,
                       timeout_s: float = PLACEMENT_TIMEOUT_S, max_restarts: int = MAX_ACTOR_RESTARTS) -> ModelActors:
    """Place the bundles, then start the target's ranks (one build each) and the draft actor
    (`draft_build`, None for none); returns at once, while they import and load their models."""
    exit_when_orphaned()  # this process owns the actors (raysd.actors.local)
    tp = len(target_builds)
    bundles = [target_resources.bundle()] * tp + ([] if draft_build is None else [draft_resources.bundle()])
    # STRICT_PACK asks for this process's node first (a soft hint: elsewhere if it does not fit),
    # so the step's channels stay in shared memory (SpecCoordinator._step_graph).
    node = ray.get_runtime_context().get_node_id()
    group = placement_group(bundles, strategy=strategy, _soft_target_node_id=node if strategy == "STRICT_PACK" else None)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementFailed(f"could not place the model actors ({bundles}, {strategy}) within {timeout_s:.0f} s "
                              f"(the placement timeout): {cluster_room()}") from None
    # The target is named (uniquely) so that the draft can find it: the draft starts (and loads
    # its model) while the target loads, then asks the target for its vocabulary size, and asks
    # again on every restart. It gets the name, not an ObjectRef or a handle: Ray keeps those in
    # the object store, and cannot promise them to a restarted actor (ray-project/ray#53727).
    # Every constructor argument here is small and travels inline. Both model actors are named
    # (the draft's name for the job's end: pipeline.remove_placement_groups kills them by name,
    # for good, before it removes their group).
    uid = uuid.uuid4().hex
    target_name, draft_name = f"raysd-target-{uid}", f"raysd-draft-{uid}"
    targets = start_targets(group, target_builds, target_name, target_resources, max_restarts)
    draft = None
    if draft_build is not None:
        draft = _options(DraftActor, group, tp, draft_resources, max_restarts, name=draft_name).remote(draft_build, target_name)
    return ModelActors(group, node, targets, draft, target_name)


def start_targets(group: PlacementGroup, builds: Sequence[Callable[[], object]], name: str, resources: ActorResources,
                  max_restarts: int = MAX_ACTOR_RESTARTS) -> list:
    """The target's actors in bundles 0..N-1, rank 0 named. Ray restarts a lone target; the ranks of a
    tensor-parallel one are not restarted by Ray (SpecCoordinator restarts all of them together, in
    a new group: a rank that comes back alone cannot rejoin its peers' group)."""
    if len(builds) > 1:
        max_restarts = 0
    return [_options(TargetActor, group, rank, resources, max_restarts, **({"name": name} if rank == 0 else {})).remote(build)
            for rank, build in enumerate(builds)]


def _options(cls, group: PlacementGroup, bundle_index: int, resources: ActorResources, max_restarts: int, **options):
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index)
    return ray.remote(cls).options(
        **options,
        max_restarts=max_restarts,
        num_cpus=resources.num_cpus,
        num_gpus=resources.num_gpus,
        scheduling_strategy=strategy,
        max_task_retries=0,  # a lost step is re-run from the rows' start, not retried
    )


# How each of a replica's actors builds its worker, from the replica's settings: picklable callables,
# made in a process that imports no torch.


def _target_worker(*args, **kwargs):
    """raysd.actors.model_actors.TargetWorker, made in the target actor's process: this module
    names it without importing that one (torch, transformers), which a replica's process never needs."""
    from raysd.actors.model_actors import TargetWorker

    return TargetWorker(*args, **kwargs)


def _draft_worker(*args, **kwargs):
    from raysd.actors.model_actors import DraftWorker

    return DraftWorker(*args, **kwargs)


def target_build(target_factory: ModelFactory, drafter: DrafterSpec, config: CoordinatorConfig, tokenizer_factory=None,
                 tensor_parallel: TensorParallel = TensorParallel()):
    """How one rank's target actor builds its worker (with the drafter, in a colocated replica): picklable."""
    shape = drafter.shape_for(config.target_resources.num_gpus, config.draft_resources.num_gpus, config.target_tensor_parallel)
    adaptive = config.speculation.adaptive
    return functools.partial(_target_worker, target_factory, config.runner, drafter if shape == "colocated" else None,
                             tokenizer_factory, tensor_parallel=tensor_parallel, cuda_graphs=config.cuda_graphs,
                             compile=config.compile, crossover=adaptive is not None and adaptive.wants_crossover)


def draft_build(drafter: DrafterSpec, config: CoordinatorConfig):
    """How a split replica's draft actor builds its worker, given the target's name: picklable."""
    return functools.partial(_draft_worker, drafter, measure_bytes=config.measure_bytes)


def target_resources(drafter: DrafterSpec, config: CoordinatorConfig):
    """What each target actor asks for: a colocated replica's one actor holds both models' share."""
    shape = drafter.shape_for(config.target_resources.num_gpus, config.draft_resources.num_gpus, config.target_tensor_parallel)
    if shape == "colocated" and drafter.model_factory is not None:
        return config.target_resources + config.draft_resources
    return config.target_resources
