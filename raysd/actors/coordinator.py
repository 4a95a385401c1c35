"""Draft and target in two Ray actors, drafting overlapped with batched verification.

The rows are split into micro-batches. Each micro-batch alternates draft -> verify, and the
coordinator keeps every micro-batch in flight, so with two of them the actors run as a
two-stage pipeline:

    draft   | A1 | B1 | A2 | B2 | ...
    target  |    | A1 | B1 | A2 | ...

A step of micro-batch A is one call to each actor (raysd.actors.model_actors): the draft actor
applies A's last verdict, admits its new rows, chooses the step's plan (its K controller pools
the evidence of every verdict) and proposes; the proposal goes straight to the target actor as
an ObjectRef argument (object store; never through the coordinator), which runs the engine's
own step (raysd.engine.step.speculative_step) and returns the verdict here. The coordinator
only admits rows (raysd.engine.requests.Admission), forwards each verdict to the draft with the
micro-batch's next call, hands finished rows back, and recovers from actor failures. Draws are
keyed by (seed, tokens generated), so the same seeds give the same tokens as SpecEngine.

A model-free drafter (n-gram lookup, or none) has no model to overlap, so it runs inside the
target actor (DrafterSpec.colocated): one actor, one call per several steps, no draft actor.

A tensor-parallel target (`CoordinatorConfig.target_tensor_parallel` N > 1) is N target actors, one
per rank, each holding 1/N of the weights and of the KV cache (raysd.models.tensor_parallel): the
step graph hands every rank the same call and the same proposal, every rank runs the same step,
and rank 0's verdict is the step's (docs/tensor_parallel.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import ray
from ray.exceptions import RayActorError, RayChannelError, RayChannelTimeoutError
from ray.util.placement_group import remove_placement_group

from raysd.actors.launch import (  # noqa: F401 - ActorResources: re-exported, where callers look for it
    MAX_ACTOR_RESTARTS,
    ActorResources,
    ModelActors,
    PlacementFailed,
    cluster_room,
    start_model_actors,
    start_targets,
)
from raysd.actors.liveness import GROUP_TIMEOUT_S, PLACEMENT_TIMEOUT_S, actor_state, answer, last_line, wait_until_dead
from raysd.actors.local import exit_when_orphaned
from raysd.actors.turns import Doorbell
from raysd.actors.wire import (
    ActorInfo,
    DrafterSpec,
    MicroBatchStateLost,
    ModelFactory,
    ReplicaGaveUp,
    StepCall,
    StepTimedOut,
    TensorParallelGroupBroken,
    TransferStats,
    pickled_nbytes,
)
from raysd.core.speculation import SpeculationConfig, StepCosts
from raysd.engine.requests import Admission, GenerationResult, Request, warn_if_lossy
from raysd.engine.verdict import StepTimings, Verdict
from raysd.models.names import TensorParallel, check_runner_kind

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class CoordinatorConfig:
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    micro_batch_size: int = 8  # rows per micro-batch; waiting requests take freed slots
    num_micro_batches: int = 2  # >= 2: one drafts while another verifies
    draft_resources: ActorResources = ActorResources()
    target_resources: ActorResources = ActorResources()
    placement_strategy: str = "STRICT_PACK"  # both actors on one node
    max_actor_restarts: int = MAX_ACTOR_RESTARTS  # Ray restarts a dead actor this many times
    max_recoveries: int = 3  # re-runs of in-flight rows after actor failures, per generate call
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
    # With a model-free drafter (run inside the target actor), one call to the target actor runs up
    # to this many steps, returning after the first that retires a row (TargetActor.step): a
    # row's slot is refilled as soon as it frees, and the steps between cost no round trip. A
    # request arriving while the rows run waits at most this many steps for a free slot. With a
    # draft actor, so do the plain steps its controller plans in a row (`-k auto`, Proposed.steps).
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
    # The target borrows the draft actor's CPU threads while that actor has nothing to do: one
    # micro-batch, both actors on the CPUs of one node (SpecCoordinator.lend_threads).
    lend_draft_threads: bool = True

    def __post_init__(self) -> None:
        check_runner_kind(self.runner, self.cuda_graphs, self.compile)
        if self.target_tensor_parallel < 1:
            raise ValueError(f"target_tensor_parallel must be >= 1, got {self.target_tensor_parallel}")
        if self.speculation.tree_budget and self.runner == "dynamic":
            raise ValueError("tree drafting needs the static runner (runner='auto' or 'static'), not 'dynamic'")
        if self.max_steps_per_call < 1:
            raise ValueError(f"max_steps_per_call must be >= 1, got {self.max_steps_per_call}")
        if self.micro_batch_size < 1 or self.num_micro_batches < 1:
            raise ValueError("micro_batch_size and num_micro_batches must be >= 1")
        if self.placement_strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}, got {self.placement_strategy!r}")
        if self.max_actor_restarts < -1 or self.max_recoveries < 0:
            raise ValueError("max_actor_restarts must be >= -1 and max_recoveries >= 0")
        for name in ("placement_timeout_s", "step_timeout_s", "group_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (None for no step limit), got {value}")


@dataclass
class RunReport:
    """Where the time and the bytes of one `generate` went.

    busy: seconds each actor spent inside its step method; wall: the coordinator's
    loop. overlap_efficiency = (draft_busy + target_busy - wall) / min(draft_busy,
    target_busy): 1 when the shorter side is fully hidden behind the longer one,
    0 when they ran strictly one after the other, negative when coordination
    overhead exceeds both.
    """

    wall_s: float = 0.0
    draft_busy_s: float = 0.0
    target_busy_s: float = 0.0
    steps: int = 0  # micro-batch steps (one target forward each)
    draft_steps: int = 0  # of which the draft actor proposed for (the rest drafted nothing: K = 0)
    borrowed_steps: int = 0  # of which the target ran with the draft actor's threads too (`lend_threads`)
    generated_tokens: int = 0
    recoveries: int = 0  # times in-flight rows were re-queued after an actor failure
    # Calls whose result this process slept for until the target rang (`caller_doorbell`); the
    # others it napped for, or its wait timed out and the read spun.
    rung_calls: int = 0
    transfer: TransferStats = field(default_factory=TransferStats)
    slots: int = 0  # micro_batch_size * num_micro_batches: rows the actors can hold at once
    active_rows: int = 0  # summed over completed steps: rows in the micro-batches when the step ended
    recoveries_done: int = 0  # streams: recoveries followed by a completed step (see `_serve`)
    queue_wait_s: float = 0.0  # summed over rows: from submission (or the start of `generate`) to admission
    idle_s: float = 0.0  # streams: time the loop had no row at all to run (waiting for input)
    first_step_at: float | None = None  # wall clock (time.time()) when the first step ended
    last_step_at: float | None = None  # and the latest

    @property
    def occupancy(self) -> float | None:
        """Mean rows in the micro-batches over steps / slots: 1 when every step ran full."""
        if not self.steps or not self.slots:
            return None
        return self.active_rows / (self.steps * self.slots)

    @property
    def overlap_efficiency(self) -> float:
        shorter = min(self.draft_busy_s, self.target_busy_s)
        if shorter <= 0:
            return 0.0
        return (self.draft_busy_s + self.target_busy_s - self.wall_s) / shorter


@dataclass
class RunOutput:
    results: list[GenerationResult]  # in request order
    report: RunReport


@dataclass
class _MicroBatch:
    """The coordinator's view of a micro-batch: which requests sit in its slots (for recovery),
    and its last verdict, not yet forwarded to the draft actor."""

    mb_id: int
    rows: list[tuple[int, Request]] = field(default_factory=list)  # (request index, request), slot order
    new: list[tuple[int, Request]] = field(default_factory=list)  # admitted, not yet sent to the actors
    last: Verdict | None = None  # the target's last verdict, for the draft actor's next call
    last_verify_s: float = 0.0  # and the target's seconds for it
    last_steps: int = 0  # the steps its last call ran (kept when it empties; 0 after a recovery)
    fresh: bool = True  # the actors hold no (valid) state for it: the next step starts it afresh
    busy: bool = False

    def clear(self) -> None:
        self.rows, self.new, self.last, self.fresh, self.busy = [], [], None, True, False


def _target_actor(*args, **kwargs):
    """raysd.actors.model_actors.TargetActor, made in the target actor's process: this module
    names it without importing that one (torch, transformers), which a replica's process never needs."""
    from raysd.actors.model_actors import TargetActor

    return TargetActor(*args, **kwargs)


def _draft_actor(*args, **kwargs):
    """raysd.actors.model_actors.DraftActor, made in the draft actor's process (as `_target_actor`)."""
    from raysd.actors.model_actors import DraftActor

    return DraftActor(*args, **kwargs)


def target_build(target_factory: ModelFactory, drafter: DrafterSpec, config: CoordinatorConfig, tokenizer_factory=None,
                 tensor_parallel: TensorParallel = TensorParallel()):
    """How one rank's target actor (raysd.actors.launch.TargetActor) builds its TargetActor: picklable."""
    return functools.partial(_target_actor, target_factory, config.runner, drafter if drafter.colocated else None, tokenizer_factory,
                             tensor_parallel=tensor_parallel, cuda_graphs=config.cuda_graphs, compile=config.compile)


def draft_build(drafter: DrafterSpec, config: CoordinatorConfig):
    """How the draft actor (raysd.actors.launch.DraftActor) builds its DraftActor, given the target's name: picklable."""
    return functools.partial(_draft_actor, drafter, measure_bytes=config.measure_bytes)


class SpecCoordinator:
    """Owns a placement group with one target and one draft actor, and runs requests through them.

    Needs `ray.init()` first. Reusable across `generate` calls; `shutdown()` (or a
    `with` block) releases the actors and the placement group. `config` may be replaced between
    calls (e.g. the EOS ids, or measured step costs for adaptive K): micro-batches started
    afterwards follow it.
    """

    def __init__(self, target_factory: ModelFactory, drafter: DrafterSpec, config: CoordinatorConfig,
                 tokenizer_factory=None, actors: ModelActors | None = None):
        """`tokenizer_factory`: builds the target's tokenizer in the target actor, for stop strings.
        `actors`: the model actors, started ahead of this (raysd.actors.launch: a job's replica starts
        them before it imports torch) with the builds `target_build` and `draft_build` would give;
        None: started here. Either way this coordinator owns them (`shutdown`)."""
        exit_when_orphaned()  # this process drives the step graph (raysd.actors.local)
        if config.speculation.tree_budget and drafter.runner == "dynamic":
            raise ValueError("tree drafting needs the static runner and a draft-model, EAGLE or n-gram drafter")
        self.config = config
        self.steps_completed = 0  # micro-batch steps over the coordinator's life (for progress watchers)
        # Called on the loop's thread after each completed call, as on_step(timings, verdict, rows in
        # the micro-batches): a job's live metrics (raysd.jobs.metrics.ReplicaMetrics.on_step).
        self.on_step = None
        self._serving = threading.Lock()  # one loop at a time: a stream or a generate call
        self._graph = None  # the step as a compiled graph (`_step_graph`), set up at the start (`_open_graph`)
        self._graph_capacity: float = 0  # its executions in flight at most
        # A model-free drafter runs inside the target actor (DrafterSpec.colocated): no draft actor.
        self.colocated = drafter.colocated
        tp = config.target_tensor_parallel
        self._target_builds = [target_build(target_factory, drafter, config, tokenizer_factory, TensorParallel(rank, tp))
                               for rank in range(tp)]
        if actors is None:
            actors = start_model_actors(self._target_builds, None if self.colocated else draft_build(drafter, config),
                                        config.target_resources, config.draft_resources, config.placement_strategy,
                                        config.placement_timeout_s, config.max_actor_restarts)
        elif len(actors.targets) != tp or (actors.draft is None) != self.colocated:
            raise ValueError(f"the actors started ahead ({len(actors.targets)} target rank(s), draft actor: {actors.draft is not None}) "
                             f"do not match the config ({tp}, {not self.colocated})")
        self.placement_group, self._node = actors.placement_group, actors.node  # `_node`: see `one_node`
        self._target_name = actors.target_name
        self.targets, self.draft = actors.targets, actors.draft  # rank 0 first: the one named, the one that reports
        self.can_decode = tokenizer_factory is not None
        self.target_info, self.draft_info = self._infos()  # all load their models first
        self._doorbell = Doorbell() if Doorbell.available() else None  # see `caller_doorbell`
        self._tickets = 0  # calls made, each one's ticket (StepCall.ticket)
        self._join_group()
        self.vocab_size = self.target_info.vocab_size
        if config.speculation.tree_budget and not (self.target_info.supports_trees and self.draft_info.supports_trees):
            self.shutdown()
            raise ValueError("tree drafting needs the static runner and a draft-model, EAGLE or n-gram drafter "
                             "(Llama-family target and draft models, no draft assist)")
        warn_if_lossy(config.speculation.acceptance)
        try:
            self._open_graph()
        except (RayActorError, RayChannelError):  # an actor died as it started: Ray restarts it, and
            self._close_graph()  # the first step compiles again, through the loop's recovery

    @property
    def target(self):
        """The target actor (rank 0 of a tensor-parallel target: the one that reports)."""
        return self.targets[0]

    @property
    def tensor_parallel(self) -> int:
        return self.config.target_tensor_parallel

    def _join_group(self) -> None:
        """Set up the ranks' torch.distributed group: rank 0 picks a free port on its node, and
        every rank joins at once (each join returns when all have, or raises after the config's
        group_timeout_s; a rank that dies meanwhile fails the wait)."""
        if self.tensor_parallel == 1:
            return
        address, port = ray.get(self.target.group_address.remote())
        ray.get([t.join_group.remote(address, port, self.config.group_timeout_s) for t in self.targets])

    def _restart_targets(self) -> None:
        """Start every rank of a tensor-parallel target afresh (killed by `_recover`), to join a new
        group on a new port: the old group lost a member, and a rank cannot rejoin it alone."""
        for t in self.targets:  # rank 0's name is free again once the GCS records its death
            wait_until_dead(t)
        self.targets = start_targets(self.placement_group, self._target_builds, self._target_name,
                                     self.config.target_resources)

    @property
    def device_channel(self) -> bool:
        """Whether proposals travel as device tensors, GPU to GPU: draft and target on two
        different GPUs (NCCL cannot join two processes on one GPU; those, and CPUs, go through
        the host over shared memory, the proposal lossless sparse where smaller), on the node
        of this process (`_step_graph`: across nodes the step runs as tasks, through the host).
        A tensor-parallel target's ranks read the proposal from the host: one small message, N readers."""
        d, t = self.draft_info.gpu, self.target_info.gpu
        return (self.draft is not None and d is not None and t is not None and d != t and self.one_node
                and self.tensor_parallel == 1)

    @property
    def can_lend(self) -> bool:
        """Whether the draft actor may lend its CPU threads to the target's calls (raysd.actors.
        turns): a draft actor that can (Linux, its CPU) and a target on the same node's CPUs, not
        tensor-parallel. A GPU's step needs no host threads, and another node's cores are not this
        target's to use."""
        return (self.config.lend_draft_threads and self.draft is not None and self.draft_info.lends_threads
                and self.tensor_parallel == 1 and self.draft_info.node == self.target_info.node
                and self.target_info.gpu is None)

    @property
    def caller_doorbell(self) -> Doorbell | None:
        """Where this process sleeps through each call (`_ReadPacer.wait`) until the target rings
        it: a target on this node's CPUs, whose threads a read spinning in the compiled graph's
        channel (Ray 2.60: sched_yield) would slow, most of all through a call that admits rows and
        prefills them, which the pacer's recent calls cannot time. From a driver process (nice 0)
        beside the target actor (nice 15), 2 cores, fast-step target, B = 32, 64 rows: 10-16 s
        with the nap, 5-11 s of it this process's CPU; 3.0-3.5 s with the doorbell. A GPU's
        target needs no host core, and the read's spin wakes sooner."""
        same_node = self.target_info.node == self._node and self.target_info.gpu is None
        return self._doorbell if same_node else None

    @property
    def lend_threads(self) -> bool:
        """Whether the draft actor lends its threads now: with one micro-batch it idles through every
        target call (with two, it proposes for the other meanwhile)."""
        return self.can_lend and self.config.num_micro_batches == 1

    @property
    def admission(self) -> Admission:
        """Which requests may run, under the current config (read at each micro-batch's start)."""
        limits = [self.target_info.max_model_len, self.draft_info.max_model_len]
        return Admission.of(self.config.speculation, self.vocab_size, limits, self.can_decode)

    @property
    def max_model_len(self) -> int:
        return self.admission.max_model_len

    def controller_state(self) -> dict:
        """The K controller's pooled evidence and the plans it chose, from the actor that plans
        the steps: the draft actor, or the target actor with a colocated drafter."""
        return ray.get((self.target if self.draft is None else self.draft).controller_state.remote())

    def __enter__(self) -> "SpecCoordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self._close_graph()
        for actor in [getattr(self, "draft", None), *getattr(self, "targets", [])]:
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(self.placement_group)
        if getattr(self, "_doorbell", None) is not None:
            self._doorbell.close()

    def profile_step_costs(self, k_max: int, batch_sizes: Sequence[int], context: int = 128, reps: int = 3) -> StepCosts:
        """Step costs measured inside the actors, on the devices they run on. Every rank of a
        tensor-parallel target profiles at once (each forward's collectives need all of them);
        rank 0's times are the target's."""
        target_ref, *others = [t.time_steps.remote(list(batch_sizes), k_max, context, reps) for t in self.targets]
        if self.draft is None:  # a colocated drafter is model-free: its drafting counts as free
            target_s, draft_s = ray.get([target_ref, *others])[0], [0.0] * len(batch_sizes)
        else:
            target_s, draft_s, *_ = ray.get([target_ref, self.draft.time_steps.remote(list(batch_sizes), context, reps),
                                             *others])
        return StepCosts(tuple(batch_sizes), tuple(tuple(t) for t in target_s), tuple(draft_s))

    def generate(self, requests: Sequence[Request]) -> RunOutput:
        """Generate for every request; results come back in request order, one per request.

        The same loop as `stream()` (`_serve`), fed once with the whole list."""
        report = RunReport()
        admitted, results = self.admission.split(requests)
        waiting: deque[tuple[int, Request]] = deque(admitted)
        start = time.perf_counter()
        with self._loop_lock("generate"):
            self._serve(waiting, results, report, {i: start for i, _ in waiting})
        report.wall_s = time.perf_counter() - start
        if self.draft is not None and self.config.measure_bytes:
            self._add_proposal_bytes(report.transfer)
        assert len(results) == len(requests), "every request yields exactly one result"
        return RunOutput([results[i] for i in range(len(requests))], report)

    def _add_proposal_bytes(self, transfer: TransferStats) -> None:
        try:
            sent = ray.get(self.draft.transfer_stats.remote(), timeout=30)
        except (RayActorError, ray.exceptions.GetTimeoutError):  # a report only
            return
        transfer.proposal, transfer.dense_equivalent = sent.proposal, sent.dense_equivalent
        transfer.sparse_steps = sent.sparse_steps

    def stream(self, max_pending: int) -> "RequestStream":
        """A long-lived loop on these actors, fed request by request (see `RequestStream`).
        At most `max_pending` requests are queued or running at once; `submit` blocks beyond."""
        return RequestStream(self, max_pending)

    @contextmanager
    def _loop_lock(self, who: str):
        if not self._serving.acquire(blocking=False):
            raise RuntimeError(f"{who}: this coordinator is already running a loop (a stream or a generate call)")
        try:
            yield
        finally:
            self._serving.release()

    def _serve(self, waiting: deque, results, report: RunReport, enqueued: dict[int, float], refill=None) -> None:
        """The pipeline loop: admit waiting rows into free slots, step every micro-batch, hand each
        finished row to `results[i] = result` as soon as its step ends.

        `refill(waiting, idle)`, when given, moves newly submitted requests into `waiting` before
        each round (blocking while `idle`: nothing waiting or running); the loop ends once a round
        leaves it with nothing to do. Without it the loop ends when `waiting` is drained.
        `enqueued[i]`: when request i was submitted (for the queue-wait time)."""
        cfg = self.config
        if self._graph is not None and self._graph_capacity < cfg.num_micro_batches + 1:
            self._close_graph()  # compiled for fewer executions in flight than this config keeps
        report.slots = cfg.micro_batch_size * cfg.num_micro_batches
        mbs = [_MicroBatch(m) for m in range(cfg.num_micro_batches)]
        in_flight: deque[tuple[object, _MicroBatch, int, float, bool, int]] = deque()  # executions of the step graph, oldest first
        pacer = _ReadPacer()
        while True:
            if refill is not None:
                idle = not (waiting or in_flight or any(mb.rows for mb in mbs))
                t0 = time.perf_counter()
                refill(waiting, idle)
                if idle:
                    report.idle_s += time.perf_counter() - t0
            if not (waiting or in_flight or any(mb.rows for mb in mbs)):
                return
            try:
                # 1. Every idle micro-batch takes waiting rows into free slots and starts its next step.
                for mb in mbs:
                    if not mb.busy:
                        before = len(mb.rows)
                        self._admit(mb, waiting, mbs)
                        now = time.perf_counter()
                        for i, _ in mb.rows[before:]:
                            report.queue_wait_s += now - enqueued.pop(i, now)  # a re-queued row counts once
                        if mb.rows:
                            in_flight.append(self._submit(mb))
                # 2. The oldest step ends first (both actors run the graph's executions in order):
                #    hand back its finished rows, keep its verdict for the draft.
                ref, mb, nbytes, submitted_at, admitted, ticket = in_flight.popleft()
                limit = self.config.step_timeout_s
                report.rung_calls += pacer.wait(submitted_at, admitted, self.caller_doorbell, ticket,
                                                None if limit is None else submitted_at + limit)
                verdict, timings = self._read(ref, submitted_at)
            except (RayActorError, RayChannelError, MicroBatchStateLost, TensorParallelGroupBroken) as exc:
                # 3. An actor died (and is restarting): every micro-batch's state on it is
                # gone. Re-run their rows from the start; finished results stay.
                self._recover(mbs, waiting, in_flight, report, exc)
                pacer = _ReadPacer()
                continue
            pacer.ready(timings, colocated=self.draft is None, admitted=admitted)
            report.active_rows += timings.steps * sum(len(m.rows) for m in mbs)  # no row leaves before a call's last step
            self._take(mb, verdict, timings, results, report)
            if self.on_step is not None:
                self.on_step(timings, verdict, sum(len(m.rows) for m in mbs))
            t = report.transfer
            t.steps += 1
            t.target_args += nbytes
            t.results += pickled_nbytes((verdict, timings)) if cfg.measure_bytes else 0
            if verdict.features is not None and cfg.measure_bytes:
                t.features += sum(f.numel() * f.element_size() for f in verdict.features)
            if refill is not None and report.recoveries:
                # A stream lives for a whole job: max_recoveries bounds failures in a row, not in its life.
                report.recoveries_done += report.recoveries
                report.recoveries = 0

    def _admit(self, mb: _MicroBatch, waiting: deque, mbs: list[_MicroBatch]) -> None:
        """Fill free slots, sharing what is left evenly between micro-batches so both stay busy."""
        if not mb.rows:  # empty: drop its old caches rather than select([]) them
            mb.clear()
        unfinished = len(waiting) + sum(len(m.rows) for m in mbs)
        share = min(self.config.micro_batch_size, math.ceil(unfinished / len(mbs)))
        while waiting and len(mb.rows) < share:
            item = waiting.popleft()
            mb.rows.append(item)
            mb.new.append(item)

    def _submit(self, mb: _MicroBatch) -> tuple[object, _MicroBatch, int, float, bool, int]:
        """One step of `mb`, one execution of the step graph (`_step_graph`): the draft actor gets
        the last verdict and the new rows, the target actor the new rows and the draft's proposal.
        Returns (the execution's ref, mb, the call's bytes, when it was submitted, whether it
        admitted rows, its ticket)."""
        spec = self.admission.spec if mb.fresh else None
        self._tickets += 1
        bell = self.caller_doorbell
        graph = self._step_graph()
        # The target sleeps through the drafting of a call the draft lends its threads to, where the
        # step graph has it wait (`_step_graph`; actor tasks never spin).
        awaits = self.lend_threads and not isinstance(graph, _TaskStep)
        # max_steps: a colocated drafter's steps per call, or a draft actor's plain run (Proposed.steps).
        target_call = StepCall(mb.mb_id, spec, None, tuple(mb.new), self.draft_info.feature_draft,
                               self.config.max_steps_per_call, 0.0, self.device_channel,
                               caller_doorbell=None if bell is None else bell.address, ticket=self._tickets,
                               proposal_doorbell=self.target_info.doorbell if awaits else None)
        if self.draft is None:
            ref = graph.execute(target_call)
        else:
            draft_call = dataclasses.replace(target_call, verdict=None if mb.fresh else mb.last, verify_s=mb.last_verify_s,
                                             last_steps=mb.last_steps, lend_threads=self.lend_threads)
            ref = graph.execute(draft_call, target_call)
        admitted = bool(mb.new)
        mb.busy, mb.fresh, mb.last, mb.new = True, False, None, []
        return ref, mb, (pickled_nbytes(target_call) if self.config.measure_bytes else 0), time.perf_counter(), admitted, self._tickets

    def _read(self, ref, submitted_at: float) -> tuple[Verdict, StepTimings]:
        """One execution's result: the target's, or rank 0's of a tensor-parallel target. Every
        output is read (a channel left unread fills up): every rank's, all of which ran the same step
        (the others' verdicts are rank 0's), and the draft actor's `rest`. The first failure among
        them is raised."""
        if not isinstance(ref, list):
            return self._get(ref, submitted_at)
        outputs, error = [], None
        for r in ref:
            try:
                outputs.append(self._get(r, submitted_at))
            except (RayActorError, RayChannelError, MicroBatchStateLost, TensorParallelGroupBroken) as exc:
                error = error or exc
        if error is not None:
            raise error
        return outputs[0]

    def _get(self, ref, submitted_at: float):
        """One output of a step, waited for as long as its actors live (Ray ends the wait when one
        dies: the graph's monitor tears the graph down and the read raises), or until the config's
        step_timeout_s has passed since the step was submitted."""
        limit = self.config.step_timeout_s
        if limit is None:
            return ref.get(timeout=-1)
        try:
            out = ref.get(timeout=max(0.0, submitted_at + limit - time.perf_counter()))
            if time.perf_counter() - submitted_at <= limit:
                return out
        except (RayChannelTimeoutError, ray.exceptions.GetTimeoutError):
            pass
        self._close_graph()  # its executions in flight will never be read: the next run compiles afresh
        raise StepTimedOut(f"a step took longer than {limit:g} s (the step timeout, --step-timeout); "
                           "its actors are alive but did not answer in time")

    @property
    def one_node(self) -> bool:
        """Whether this process and its actors (every rank of a tensor-parallel target) share one
        node (the step's channels are then shared memory)."""
        nodes = {self._node, self.draft_info.node, *(i.node for i in self.rank_infos)}
        return len(nodes) == 1

    def _step_graph(self):
        """The replica's step as a Ray compiled graph, set up once (and again after an actor's
        restart): driver -> draft.propose -> target.step -> driver, over channels that live as long
        as the graph (shared memory on one node), so a step costs no task submission, no object
        store and no scheduling. Up to `num_micro_batches` executions are in flight: the draft
        proposes for one micro-batch while the target verifies another. With a colocated drafter
        the graph is the target actor alone. A tensor-parallel target's ranks all take the same
        call (and the same proposal) and return one output each (MultiOutputNode; `_read`).

        When the actors and this process are not all on one node, the step runs as actor tasks
        instead (`_TaskStep`): in Ray 2.60 a compiled graph's channel across nodes, torn down while
        a remote writer is pushing into it (after an actor or a node is lost), fails a CHECK in the
        reader's raylet (experimental_mutable_object_provider.cc: WriteAcquire, "Channel closed"),
        which takes that whole node down (tests/reliability/test_node_loss.py). Tasks cost a
        submission and an object-store round trip per step, which a step across nodes pays in its
        transfers anyway."""
        if self._graph is None and not self.one_node:
            self._graph, self._graph_capacity = _TaskStep(self.draft, self.targets), math.inf
        if self._graph is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as calls:
                if self.draft is None:
                    outs = [t.step.bind(calls) for t in self.targets]
                else:
                    proposed = self.draft.propose.bind(calls[0])
                    if self.device_channel:  # the proposal's device tensors travel GPU to GPU (NCCL)
                        proposed = proposed.with_tensor_transport(transport="nccl")
                    target_call = calls[1]
                    if self.can_lend:  # through a lent call the target sleeps until the proposal is ready
                        target_call = self.target.await_proposal.bind(target_call)
                    outs = [t.step.bind(target_call, proposed) for t in self.targets]
                    if self.can_lend:  # after proposing, the draft actor sleeps through a call it lent threads to
                        outs.append(self.draft.rest.bind(proposed))
                out = outs[0] if len(outs) == 1 else MultiOutputNode(outs)
            # Sized for two micro-batches at least: a replica compiles at its start with one, then may
            # switch to two once it knows its step costs (_serve compiles again for more).
            self._graph_capacity = max(self.config.num_micro_batches, 2) + 1
            # No fixed deadline on sending a call or reading a result: Ray's default (10 s) would take
            # a slow step (a first step that compiles, a long prefill, a busy machine) for a failure.
            self._graph = out.experimental_compile(_submit_timeout=-1, _max_inflight_executions=self._graph_capacity)
        return self._graph

    def _open_graph(self) -> None:
        """Compile the step graph now, before the first step, and wait until its driver-side proxy
        actor runs. Compiling starts that actor (a new Ray worker process, importing Ray: about a
        second of CPU); done at the first step, that start shares the cores with the target's first
        forwards, whose first call then took 0.39 s instead of 0.12 (2 cores, fast-step target, batch 8)."""
        graph = self._step_graph()
        proxy = getattr(graph, "_proxy_actor", None)  # Ray 2.60's CompiledDAG; none for _TaskStep
        if proxy is not None:
            try:  # it needs no resources, only a worker process: a wait past the placement's means none starts
                ray.get(proxy.__ray_ready__.remote(), timeout=self.config.placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                self.shutdown()
                raise RuntimeError(f"the step graph's driver-side proxy actor did not start within "
                                   f"{self.config.placement_timeout_s:.0f}s: Ray started no worker process for it "
                                   "on this node (see the raylet's log)") from None

    def _close_graph(self) -> None:
        if self._graph is not None:
            graph, self._graph = self._graph, None
            try:
                graph.teardown()
            except Exception:  # noqa: BLE001 - an actor of it died: its channels are gone anyway
                pass

    def _take(self, mb: _MicroBatch, verdict: Verdict, timings: StepTimings, results, report: RunReport) -> None:
        """A step's verdict: its finished rows to `results`, the rest kept in slot order; the
        verdict itself (less the results) waits for the draft actor's next call. The rows go last: a
        stream's caller takes the report's totals as its rows arrive, which then count this call."""
        mb.busy = False
        if verdict.keep is not None:
            mb.rows = [mb.rows[k] for k in verdict.keep]
        if self.draft is not None:
            mb.last, mb.last_verify_s = dataclasses.replace(verdict, finished=()), timings.verify_s
            mb.last_steps = timings.steps
        report.steps += timings.steps
        report.draft_steps += timings.drafted_steps
        report.borrowed_steps += timings.borrowed_steps
        report.last_step_at = time.time()
        if report.first_step_at is None:
            report.first_step_at = report.last_step_at
        report.target_busy_s += timings.wall_s - (timings.draft_s if self.draft is None else 0.0)
        report.draft_busy_s += timings.draft_s
        self.steps_completed += timings.steps
        for i, finished in verdict.finished:
            report.generated_tokens += len(finished.token_ids)
            results[i] = finished

    def _recover(self, mbs: list[_MicroBatch], waiting: deque, in_flight: deque, report: RunReport,
                 error: BaseException | None = None) -> None:
        report.recoveries += 1
        # A tensor-parallel target whose group broke (a rank died, or a collective failed) starts
        # all its ranks afresh; a lost draft actor leaves the ranks and their group as they are.
        restart_ranks = self.tensor_parallel > 1 and (isinstance(error, TensorParallelGroupBroken) or not self._ranks_alive())
        if restart_ranks:  # before the graph's teardown: a survivor may be blocked in a collective
            for t in self.targets:
                ray.kill(t, no_restart=True)
        self._close_graph()  # its channels went with the actor; a new graph is compiled on the restarted one
        if report.recoveries > self.config.max_recoveries:
            n = report.recoveries
            raise ReplicaGaveUp(f"{self._failure_line(error)}; {n} failure{'s' if n > 1 else ''} in a row with no step "
                                "completed in between: the replica gives up") from error
        if restart_ranks:
            self._restart_targets()
        requeue = sorted((item for mb in mbs for item in mb.rows), key=lambda item: item[0])
        waiting.extendleft(reversed(requeue))  # re-run from the prompt: same seed, same output
        for mb in mbs:
            mb.clear()
            mb.last_steps = 0  # its last call's steps are unknown: a plain run it asked for is not ended
        in_flight.clear()  # stale steps: the micro-batches start afresh
        self._wait_for_actors()
        if restart_ranks:
            self._join_group()

    def _ranks_alive(self) -> bool:
        """Whether every rank of a tensor-parallel target is alive, as Ray records it (a rank is
        never restarted by Ray: start_targets)."""
        return not any(actor_state(t).dead for t in self.targets)

    def _role(self, actor_id) -> str:
        if self.draft is not None and self.draft._actor_id == actor_id:
            return "draft"
        for rank, t in enumerate(self.targets):
            if t._actor_id == actor_id:
                return "target" if self.tensor_parallel == 1 else f"target (rank {rank})"
        return "model"

    def _failure_line(self, error: BaseException | None) -> str:
        """What failed, in one line: which actor died, and Ray's word for why."""
        if isinstance(error, RayActorError):
            actor_id = getattr(error, "actor_id", None)
            role = self._role(ray.ActorID.from_hex(actor_id)) if isinstance(actor_id, str) else "a model"
            return f"the {role} actor died: {last_line(error)}"
        if error is None:
            return "a model actor failed"
        return f"{type(error).__name__}: {last_line(error)}"

    def _infos(self) -> tuple[ActorInfo, ActorInfo]:
        """Both actors' info, once each has loaded its model: waited for as long as Ray says the
        actor is alive or restarting (liveness.answer), however slowly it loads, and while their
        placement group has its bundles (`_check_placement`). A colocated drafter has no actor:
        its info is the target's, with no context limit of its own."""
        unplaced_since: list[float] = []
        check = functools.partial(self._check_placement, unplaced_since)
        self.rank_infos = [answer(t.info.remote, t, "target", check) for t in self.targets]
        target = self.rank_infos[0]
        if self.draft is None:
            return target, dataclasses.replace(target, max_model_len=2**31 - 1, supports_trees=True)
        return target, answer(self.draft.info.remote, self.draft, "draft", check)

    def _check_placement(self, unplaced_since: list[float]) -> None:
        """PlacementFailed once the actors' placement group has been without its bundles for the
        placement timeout: its node was lost, and the cluster has no room to place it again (Ray
        keeps the group RESCHEDULING, and the actors restarting into it, for ever)."""
        state = ray.util.placement_group_table(self.placement_group).get("state")
        if state == "CREATED":
            unplaced_since.clear()
            return
        if not unplaced_since:
            unplaced_since.append(time.monotonic())
        if time.monotonic() - unplaced_since[0] > self.config.placement_timeout_s:
            raise PlacementFailed(f"the model actors' placement group lost its node and could not be placed again within "
                                  f"{self.config.placement_timeout_s:.0f} s (the placement timeout): {cluster_room()}")

    def _wait_for_actors(self) -> None:
        """Block until the actors answer again, for as long as Ray restarts them (calls made to a
        dying process would fail and burn a recovery each); ActorDead once Ray gives one up."""
        self.target_info, self.draft_info = self._infos()


class _ReadPacer:
    """When to start waiting for a step's result. Ray 2.60's compiled-graph channel read spins
    (sched_yield in PlasmaObjectHeader::ReadAcquire) for as long as it waits, so a coordinator
    that called `get()` at once would burn a core for the whole of every step: a core the
    target's torch threads need where cores are few. Measured on 2 cores, a 4 ms step of the
    fast-step target, B = 32: the replica's process at 93% CPU, the target actor (Ray workers
    run at nice 15) slowed 16x when it had both cores. So the read starts just before the
    step is expected to end: from when the target could start it (its submission plus the
    draft's proposing, or the previous result, whichever is later) plus the target's time,
    less a slack (SLACK_FRACTION of that time + SLACK_S) spent spinning.

    The times are the shortest of the last RECENT calls that admitted no rows, once there are
    TRUSTED of them: a call with new rows also prefills them, and the first calls of a replica
    run while its processes still start, so either can take several times a steady call, and a
    nap planned from one oversleeps the next call by the difference (seen on 2 cores, fast-step
    target, batch 8: the second and third reads 0.17 s and 0.28 s late). Until then, and for a
    step cheaper than the last ones (`-k auto` choosing K = 0 after K = 4, the batch's last
    rows), the read errs early: spinning costs some CPU, oversleeping the whole step's idle target.

    Where the target rings a doorbell at each call's end (SpecCoordinator.caller_doorbell: its
    CPUs on this node), `wait` sleeps on that instead and needs no estimate, the calls that
    admit rows included; the estimates then only bound the sleep (`bell_timeout_s`)."""

    SLACK_FRACTION = 0.05
    SLACK_S = 3e-4
    MIN_NAP_S = 5e-4  # below it, sleeping's own wake-up jitter costs more than the spin
    RECENT = 8
    TRUSTED = 2
    # A ring that does not come within Doorbell.timeout_s of the call's expected seconds
    # (FIRST_BELL_TIMEOUT_S before any such call was read) leaves the read to wait, spinning: a
    # target lost mid-call never rings, and the read is what reports its loss.
    FIRST_BELL_TIMEOUT_S = 10.0

    def __init__(self):
        self.ready_at = 0.0  # perf_counter when the last result was read
        self.recent: deque[tuple[float, float]] = deque(maxlen=self.RECENT)  # (target's, draft actor's) seconds per call
        self.admitting_s: float | None = None  # the last call's that admitted rows (target's + draft actor's)

    def wait(self, submitted_at: float, admitted: bool, bell: Doorbell | None, ticket: int,
             deadline: float | None = None) -> bool:
        """Until the call submitted at `submitted_at` (with `ticket`) ends, or is about to, or the
        step's `deadline` (perf_counter) comes: asleep on `bell` until the target rings it (True),
        else a `nap` (False)."""
        if bell is None:
            self.nap(submitted_at)
            return False
        timeout = self.bell_timeout_s(admitted)
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.perf_counter()))
        return bell.wait_for(ticket, timeout)

    def bell_timeout_s(self, admitted: bool) -> float:
        if admitted:
            expected = self.admitting_s
        else:
            expected = min(t + d for t, d in self.recent) if self.recent else None
        if expected is None:
            return self.FIRST_BELL_TIMEOUT_S
        return Doorbell.timeout_s(expected)

    def nap(self, submitted_at: float) -> None:
        if len(self.recent) < self.TRUSTED:
            return
        target_s = min(t for t, _ in self.recent)
        draft_s = min(d for _, d in self.recent)
        ends = max(submitted_at + draft_s, self.ready_at) + target_s
        delay = ends - self.SLACK_FRACTION * target_s - self.SLACK_S - time.perf_counter()
        if delay > self.MIN_NAP_S:
            time.sleep(delay)

    def ready(self, timings: StepTimings, colocated: bool, admitted: bool = False) -> None:
        """A result was read: `timings` its call's, `admitted` whether the call took new rows."""
        self.ready_at = time.perf_counter()
        draft_s = 0.0 if colocated else timings.draft_s
        if admitted:
            self.admitting_s = timings.wall_s + draft_s
        else:
            self.recent.append((timings.wall_s, draft_s))


class _TaskStep:
    """The step graph's interface (`execute(*calls).get()`, `teardown()`) over ordinary actor tasks:
    the proposal goes from the draft actor to the target actor as an ObjectRef argument (object store,
    never through this process). A caller's tasks to one actor run in the order submitted."""

    def __init__(self, draft, targets: list):
        self.draft, self.targets = draft, targets

    def execute(self, *calls) -> "_TaskRef | list[_TaskRef]":
        """One `_TaskRef`; a list of one per rank for a tensor-parallel target (as MultiOutputNode's)."""
        if self.draft is None:
            refs = [_TaskRef(t.step.remote(calls[0])) for t in self.targets]
        else:
            draft_call, target_call = calls
            proposed = self.draft.propose.remote(draft_call)  # one proposal, read by every rank
            refs = [_TaskRef(t.step.remote(target_call, proposed)) for t in self.targets]
        return refs[0] if len(refs) == 1 else refs

    def teardown(self) -> None:
        pass  # nothing persists between steps


@dataclass(frozen=True)
class _TaskRef:
    ref: ray.ObjectRef

    def get(self, timeout: float | None = None):
        return ray.get(self.ref, timeout=None if timeout == -1 else timeout)


@dataclass(frozen=True)
class StreamedResult:
    result: GenerationResult
    latency_s: float  # from `submit` to the result (0 for a request refused at submission)


class _Deliveries(dict):
    """`_finish_step` writes `results[i] = result`; for a stream that hands the result over at once."""

    def __init__(self, stream: "RequestStream"):
        super().__init__()
        self.stream = stream

    def __setitem__(self, i, result) -> None:
        self.stream._deliver(i, result)


class RequestStream:
    """A SpecCoordinator's loop kept running across calls: requests are admitted into free
    micro-batch slots as soon as they are submitted (rows of several callers share the
    micro-batches), and each result is handed back the moment its row finishes.

    - `submit(request)` returns a `concurrent.futures.Future` of a `StreamedResult`. It is
      thread-safe, and blocks while `max_pending` requests are already queued or running
      (backpressure: memory holds at most `max_pending` requests).
    - The loop is `SpecCoordinator._serve` (the same as `generate`) on a daemon thread; it
      waits, without a step in flight, while there is nothing to run.
    - Rows carry their own random streams, so a request gives the same tokens whatever it
      shares its micro-batch with: the stream gives `generate`'s outputs.
    - An actor failure re-runs the rows in flight exactly once (`_recover`); the
      `max_recoveries` budget counts failures without a completed step in between. A failure
      beyond it fails every pending future and every later `submit`.
    - `totals()`: the loop's cumulative `RunReport` numbers (busy times, steps, occupancy...).
    """

    def __init__(self, coordinator: SpecCoordinator, max_pending: int):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.coordinator = coordinator
        self.max_pending = max_pending
        self.report = RunReport()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Semaphore(max_pending)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, float]] = {}
        self._enqueued: dict[int, float] = {}  # loop thread only
        self._next = 0
        self._closed = False
        self._error: BaseException | None = None
        self._started = time.perf_counter()
        if not coordinator._serving.acquire(blocking=False):
            raise RuntimeError("stream: this coordinator is already running a loop (a stream or a generate call)")
        self._thread = threading.Thread(target=self._run, name="raysd-request-stream", daemon=True)
        self._thread.start()

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (queued or in a micro-batch)."""
        return len(self._pending)

    def submit(self, request: Request) -> Future:
        future: Future = Future()
        refused = self.coordinator.admission.refusal(request)
        if refused is not None:  # refused before it takes a slot, as in `generate`
            future.set_result(StreamedResult(refused, 0.0))
            return future
        while not self._room.acquire(timeout=0.2):  # backpressure: wait for a request to finish
            self._check()
        try:
            with self._lock:
                self._check()
                i, self._next = self._next, self._next + 1
                now = time.perf_counter()
                self._pending[i] = (future, now)
                self._inbox.put((i, request, now))
        except BaseException:
            self._room.release()
            raise
        return future

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the generation loop failed: {type(self._error).__name__}: {self._error}") from self._error
        if self._closed:
            raise RuntimeError("the request stream is closed")

    def close(self, timeout: float | None = None) -> None:
        """Finish what was submitted, then end the loop."""
        with self._lock:
            self._closed = True
        self._inbox.put(None)  # wakes an idle loop
        self._thread.join(timeout)

    def totals(self) -> dict:
        r = self.report
        return {"wall_s": time.perf_counter() - self._started, "draft_busy_s": r.draft_busy_s,
                "target_busy_s": r.target_busy_s, "steps": r.steps, "draft_steps": r.draft_steps,
                "borrowed_steps": r.borrowed_steps, "active_rows": r.active_rows,
                "slots": r.slots, "queue_wait_s": r.queue_wait_s, "idle_s": r.idle_s,
                "recoveries": r.recoveries + r.recoveries_done, "generated_tokens": r.generated_tokens,
                "first_step_at": r.first_step_at, "last_step_at": r.last_step_at}

    # The loop thread.

    def _run(self) -> None:
        try:
            self.coordinator._serve(deque(), _Deliveries(self), self.report, self._enqueued, refill=self._refill)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            self._error = exc
        finally:
            with self._lock:
                self._closed = True
                left = list(self._pending.values())
                self._pending.clear()
            self.coordinator._serving.release()
            error = self._error or RuntimeError("the request stream was closed before the request finished")
            for future, _ in left:
                if not future.done():
                    future.set_exception(error)

    def _refill(self, waiting: deque, idle: bool) -> None:
        block = idle
        while True:
            try:
                item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block and not self._closed:
                    continue
                return
            if item is None:  # close(): end once idle
                block = False
                continue
            i, request, submitted = item
            self._enqueued[i] = submitted
            waiting.append((i, request))
            block = False

    def _deliver(self, i: int, result: GenerationResult) -> None:
        with self._lock:
            future, submitted = self._pending.pop(i)
        self._room.release()
        future.set_result(StreamedResult(result, time.perf_counter() - submitted))
