"""A replica's settings, resolved before any of its actors starts: what each model actor asks of
the cluster (`ActorResources`), where the drafter runs (`replica_shape`), and everything the
coordinator's loop obeys (`CoordinatorConfig`). Plain records: nothing here imports Ray or torch,
so a job's config check (raysd.jobs.config) reads them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raysd.actors.liveness import GROUP_TIMEOUT_S, PLACEMENT_TIMEOUT_S
from raysd.core.speculation import SpeculationConfig
from raysd.models.names import check_runner_kind

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")  # Ray's, for a replica's placement group
MAX_ACTOR_RESTARTS = 3  # Ray restarts a dead model actor this many times

# A replica's shape: where its drafter runs.
# - "colocated": in the target's actor, one process running the engine's own step (a draft model on
#   the target's device); one call for several steps, nothing to exchange.
# - "split": a draft actor of its own (each model on a device of its own), which drafts one
#   micro-batch while the target verifies another, the proposals exchanged over the step graph.
# "auto": colocated unless each model has a GPU of its own, or the target is tensor-parallel (`replica_shape`).
REPLICA_SHAPES = ("auto", "colocated", "split")


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float = 1.0
    num_gpus: float = 1.0  # fractions share one GPU (keep each model within its share); 0 on CPU

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"resources must be >= 0, got {self}")
        if self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError("an actor needs some CPU or GPU (a placement-group bundle cannot be empty)")
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"num_gpus above 1 must be whole, got {self.num_gpus}")

    def __add__(self, other: ActorResources) -> ActorResources:
        """Both actors' resources for one actor (a colocated replica's)."""
        return ActorResources(self.num_cpus + other.num_cpus, self.num_gpus + other.num_gpus)

    def bundle(self) -> dict[str, float]:
        return {k: v for k, v in (("CPU", self.num_cpus), ("GPU", self.num_gpus)) if v > 0}


def replica_shape(shape: str, has_draft_model: bool, target_gpus: float, draft_gpus: float, tensor_parallel: int = 1) -> str:
    """"colocated" or "split" for a drafter asked to run `shape` (REPLICA_SHAPES), given each model
    actor's GPUs.

    Two models that share a device (a CPU, or one GPU between them) run best in one process: two
    processes would time-slice the device (two CUDA contexts; on a CPU, two thread pools on the
    same cores) and exchange every proposal for nothing. Each with a GPU of its own, the draft
    works while the target verifies. A draft model beside a tensor-parallel target keeps an actor
    of its own (every rank would otherwise run it); a model-free drafter runs in each rank."""
    if shape not in REPLICA_SHAPES:
        raise ValueError(f"the replica's shape must be one of {REPLICA_SHAPES}, got {shape!r}")
    if shape == "auto":
        own_devices = target_gpus >= 1 and draft_gpus >= 1
        shape = "split" if has_draft_model and (tensor_parallel > 1 or own_devices) else "colocated"
    if shape == "colocated" and has_draft_model and tensor_parallel > 1:
        raise ValueError("a draft model cannot run inside a tensor-parallel target's ranks: use the split shape")
    return shape


@dataclass(frozen=True)
class CoordinatorConfig:
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    micro_batch_size: int = 8  # rows per micro-batch; waiting requests take freed slots
    # None: 1 for a colocated replica (one process: nothing to overlap), 2 for a split one (one
    # micro-batch drafts while the other verifies).
    num_micro_batches: int | None = None
    draft_resources: ActorResources = ActorResources()
    target_resources: ActorResources = ActorResources()  # a colocated replica's one actor asks for both
    placement_strategy: str = "STRICT_PACK"  # both actors on one node
    max_actor_restarts: int = MAX_ACTOR_RESTARTS
    max_recoveries: int = 3  # actor failures in a row (no step completed between) before the replica gives up
    measure_bytes: bool = True
    # Give up placing the actors after this long (PlacementFailed, which names the resources asked
    # and the cluster's): a fixed-size cluster may have no room left for them.
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S
    # None: a step is waited for as long as its actors are alive (Ray reports a death); a number: a
    # step (one call to the actors) that takes longer fails the run with StepTimedOut.
    step_timeout_s: float | None = None
    # A tensor-parallel target's group: how long its ranks wait for each other to join, and for a
    # collective (torch.distributed needs a finite limit; a step's collective waits for the slowest rank).
    group_timeout_s: float = GROUP_TIMEOUT_S
    runner: str = "auto"  # the target's KV cache (raysd.models.runner); the draft's is DrafterSpec.runner
    # A colocated replica's call runs up to this many steps, returning after the first that retires a
    # row (TargetWorker.step): a freed slot is refilled at once, and the steps between cost no round
    # trip; a request arriving while every slot is busy waits for a row to finish either way. A split
    # replica's draft actor hands the target its plain steps likewise (`-k auto`, Proposed.steps).
    max_steps_per_call: int = 8
    # N > 1: the target is N rank actors (one placement-group bundle of `target_resources` each),
    # each holding 1/N of its weights (raysd.models.tensor_parallel); a rank's loss restarts all N.
    target_tensor_parallel: int = 1
    # The target's decode and verify forwards replayed as CUDA graphs captured per shape
    # (raysd.models.cuda_graphs; static runner, a GPU); a draft model's: DrafterSpec.cuda_graphs.
    cuda_graphs: bool = False
    # The target's decode and verify forwards through torch.compile (EngineConfig.compile); a draft
    # model's: DrafterSpec.compile.
    compile: bool = False
    # A split replica's target borrows the draft actor's CPU threads while that actor has nothing
    # to do: one micro-batch, both actors on the CPUs of one node (GraphTransport.lend_threads).
    lend_draft_threads: bool = True

    def __post_init__(self) -> None:
        check_runner_kind(self.runner, self.cuda_graphs, self.compile)
        if self.target_tensor_parallel < 1:
            raise ValueError(f"target_tensor_parallel must be >= 1, got {self.target_tensor_parallel}")
        if self.speculation.tree_budget and self.runner == "dynamic":
            raise ValueError("tree drafting needs the static runner (runner='auto' or 'static'), not 'dynamic'")
        if self.max_steps_per_call < 1:
            raise ValueError(f"max_steps_per_call must be >= 1, got {self.max_steps_per_call}")
        if self.micro_batch_size < 1 or (self.num_micro_batches is not None and self.num_micro_batches < 1):
            raise ValueError("micro_batch_size and num_micro_batches must be >= 1")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}")
        if self.max_actor_restarts < -1 or self.max_recoveries < 0:
            raise ValueError("max_actor_restarts must be >= -1 and max_recoveries >= 0")
        for name in ("placement_timeout_s", "step_timeout_s", "group_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (None for no step limit), got {value}")

    def micro_batches(self, shape: str) -> int:
        """The micro-batches a replica of `shape` keeps in flight."""
        if self.num_micro_batches is not None:
            return self.num_micro_batches
        return 1 if shape == "colocated" else 2
