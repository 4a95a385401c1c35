"""A replica's coordinator: rows into micro-batches, each micro-batch's steps through the model
actors, finished rows out, model actors that die recovered from.

A replica takes one of two shapes (raysd.actors.settings.replica_shape), decided before its
actors start from where its models live:

- colocated: one model actor holds the target and the drafter (a draft model on the same device
  too) and runs the engine's own step in process (raysd.engine.step.speculative_step), several
  steps per call, returning after the first that retires a row. One micro-batch: on one device
  there is nothing to overlap.
- split: each model has a device of its own. A draft actor proposes for one micro-batch while the
  target actor(s) verify another, the proposal going from actor to actor, never through here:

      draft   | A1 | B1 | A2 | B2 | ...
      target  |    | A1 | B1 | A2 | ...

Either way the loop is three steps, as an engine's: admit waiting rows into free slots and submit
each idle micro-batch's next step (`_admit`, `_submit`); read the oldest step's result
(`Transport.read`: how calls travel is raysd.actors.transport's business); hand its finished rows
back and keep its verdict for the draft side (`_take`). A tensor-parallel target is N rank actors
(raysd.models.tensor_parallel) that all take the same call; rank 0 reports. Draws are keyed by
(seed, tokens generated), so the same seeds give the same tokens as the single-process SpecEngine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import ray
from ray.exceptions import RayActorError, RayChannelError
from ray.util.placement_group import remove_placement_group

from raysd.actors.launch import (
    ModelActors,
    PlacementFailed,
    cluster_room,
    draft_build,
    start_model_actors,
    start_targets,
    target_build,
    target_resources,
)
from raysd.actors.liveness import actor_state, answer, last_line, wait_until_dead
from raysd.actors.local import exit_when_orphaned
from raysd.actors.settings import CoordinatorConfig
from raysd.actors.stream import RequestStream
from raysd.actors.transport import Members, Pending, TransportConfig, open_transport
from raysd.actors.wire import (
    ActorInfo,
    DrafterSpec,
    MicroBatchStateLost,
    ModelFactory,
    ReplicaGaveUp,
    StepCall,
    TensorParallelGroupBroken,
    TransferStats,
)
from raysd.core.speculation import StepCosts
from raysd.engine.requests import Admission, GenerationResult, Request, warn_if_lossy
from raysd.engine.verdict import LoopStats, StepTimings, Verdict
from raysd.models.names import TensorParallel

# An actor died (Ray restarts it), or lost the state of a micro-batch (it was restarted), or a
# tensor-parallel group broke: the rows in flight run again from their start.
RECOVERABLE = (RayActorError, RayChannelError, MicroBatchStateLost, TensorParallelGroupBroken)


@dataclass
class RunOutput:
    results: list[GenerationResult]  # in request order
    stats: LoopStats
    wall_s: float
    transfer: TransferStats  # the bytes between this process and the actors, and between the actors


@dataclass
class _MicroBatch:
    """The coordinator's view of a micro-batch: which requests sit in its slots (for recovery), and
    (split) its last verdict, not yet forwarded to the draft actor."""

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


class SpecCoordinator:
    """Owns a replica's placement group and model actors, and runs requests through them.

    Needs `ray.init()` first. Reusable across `generate` calls (its `config` is read at each run's
    start: a run may change the micro-batches or the speculation, not the shape or the models);
    `shutdown()` (or a `with` block) releases the actors and the placement group."""

    def __init__(self, target_factory: ModelFactory, drafter: DrafterSpec, config: CoordinatorConfig,
                 tokenizer_factory=None, actors: ModelActors | None = None):
        """`tokenizer_factory`: builds the target's tokenizer in the target actor, for stop strings.
        `actors`: the model actors, started ahead of this (a job's replica starts them before it
        imports anything heavy) with the builds `target_build` and `draft_build` would give; None:
        started here. Either way this coordinator owns them (`shutdown`)."""
        exit_when_orphaned()  # this process drives the steps (raysd.actors.local)
        tp = config.target_tensor_parallel
        self.config = config
        self.shape = drafter.shape_for(config.target_resources.num_gpus, config.draft_resources.num_gpus, tp)
        self._draft_graphs = drafter.cuda_graphs  # a draft model's forwards replayed as CUDA graphs
        self.steps_completed = 0  # engine steps over the coordinator's life (for progress watchers)
        # Called on the loop's thread after each completed call, as on_step(timings, verdict, rows in
        # the micro-batches): a job's live metrics (raysd.jobs.metrics.ReplicaMetrics.on_step).
        self.on_step = None
        self._serving = threading.Lock()  # one loop at a time: a stream or a generate call
        self._target_builds = [target_build(target_factory, drafter, config, tokenizer_factory, TensorParallel(rank, tp))
                               for rank in range(tp)]
        self._target_resources = target_resources(drafter, config)
        split = self.shape == "split"
        if actors is None:
            actors = start_model_actors(self._target_builds, draft_build(drafter, config) if split else None,
                                        self._target_resources, config.draft_resources, config.placement_strategy,
                                        config.placement_timeout_s, config.max_actor_restarts)
        elif len(actors.targets) != tp or (actors.draft is not None) != split:
            raise ValueError(f"the actors started ahead ({len(actors.targets)} target rank(s), draft actor: "
                             f"{actors.draft is not None}) do not match the config ({tp}, {split})")
        self.placement_group, self._node = actors.placement_group, actors.node
        self._target_name = actors.target_name
        self.targets, self.draft = actors.targets, actors.draft  # rank 0 first: the one named, the one that reports
        self.can_decode = tokenizer_factory is not None
        self._infos()  # every actor has loaded its model
        self._join_group()
        if config.speculation.tree_budget and not (self.target_info.supports_trees and self.draft_info.supports_trees):
            self.shutdown()
            raise ValueError("tree drafting needs the static runner and a draft-model, EAGLE or n-gram drafter "
                             "(Llama-family target and draft models, no draft assist)")
        warn_if_lossy(config.speculation.acceptance)
        self.transport = open_transport(self._members(), self._transport_config())
        try:
            self.transport.open()
        except RECOVERABLE:  # an actor died as it started: the loop's recovery sets the transport up again
            self.transport.reset()
        except BaseException:  # the step graph cannot start: release the actors and their placement group
            self.shutdown()
            raise

    @property
    def target(self):
        """The target actor (rank 0 of a tensor-parallel target: the one that reports)."""
        return self.targets[0]

    @property
    def tensor_parallel(self) -> int:
        return len(self.targets)

    @property
    def admission(self) -> Admission:
        """Which requests may run, under the current config (read at each micro-batch's start), with
        the target's device crossover for -k auto's learned costs (SpeculationConfig.with_crossover)."""
        limits = [self.target_info.max_model_len, self.draft_info.max_model_len]
        spec = self.config.speculation.with_crossover(self.target_info.crossover_tokens)
        return Admission.of(spec, self.target_info.vocab_size, limits, self.can_decode)

    @property
    def max_model_len(self) -> int:
        return self.admission.max_model_len

    def controller_state(self) -> dict:
        """The K controller's pooled evidence and the plans it chose, from the actor that plans the
        steps: the draft actor, or the target actor of a colocated replica."""
        return ray.get((self.target if self.draft is None else self.draft).controller_state.remote())

    def profile_step_costs(self, k_max: int, batch_sizes: Sequence[int], context: int = 128, reps: int = 3) -> StepCosts:
        """Step costs measured inside the actors, on the devices they run on. Every rank of a
        tensor-parallel target profiles at once (each forward's collectives need all of them)."""
        sizes = list(batch_sizes)
        refs = [t.time_steps.remote(sizes, k_max, context, reps) for t in self.targets]
        drafter = self.target.time_drafter if self.draft is None else self.draft.time_steps
        target_s, *_ = ray.get(refs)
        draft_s = ray.get(drafter.remote(sizes, context, reps))
        return StepCosts(tuple(sizes), tuple(tuple(t) for t in target_s), tuple(draft_s))

    def __enter__(self) -> SpecCoordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if getattr(self, "transport", None) is not None:
            self.transport.close()
        for actor in [getattr(self, "draft", None), *getattr(self, "targets", [])]:
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(self.placement_group)

    def generate(self, requests: Sequence[Request]) -> RunOutput:
        """Every request's result, in request order: the same loop as `stream()`, fed the whole list."""
        stats = LoopStats()
        admitted, results = self.admission.split(requests)
        waiting: deque[tuple[int, Request]] = deque(admitted)
        start = time.perf_counter()
        with self._loop_lock("generate"):
            self.transport.take_transfer()  # this run's bytes only
            self._serve(waiting, results, stats, {i: start for i, _ in waiting})
            transfer = self.transport.take_transfer()
        wall = time.perf_counter() - start
        assert len(results) == len(requests), "every request yields exactly one result"
        return RunOutput([results[i] for i in range(len(requests))], stats, wall, transfer)

    def stream(self, max_pending: int) -> RequestStream:
        """A long-lived loop on these actors, fed request by request (raysd.actors.stream). At most
        `max_pending` requests are queued or running at once; `submit` blocks beyond."""
        return RequestStream(self, max_pending)

    @contextmanager
    def _loop_lock(self, who: str):
        if not self._serving.acquire(blocking=False):
            raise RuntimeError(f"{who}: this coordinator is already running a loop (a stream or a generate call)")
        try:
            yield
        finally:
            self._serving.release()

    # The loop.

    def _serve(self, waiting: deque, results, stats: LoopStats, enqueued: dict[int, float], refill=None) -> None:
        """Admit waiting rows into free slots, step every micro-batch, hand each finished row to
        `results[i] = result` as soon as its step ends, into `stats` what was measured.

        `refill(waiting, idle)`, when given, moves newly submitted requests into `waiting` before
        each round (blocking while `idle`: nothing waiting or running); the loop ends once a round
        leaves it with nothing to do. Without it the loop ends when `waiting` is drained.
        `enqueued[i]`: when request i was submitted (for its queue wait)."""
        cfg = self.config
        num_micro_batches = cfg.micro_batches(self.shape)
        if self.transport.config != self._transport_config():  # this run keeps other micro-batches in flight
            self.transport.reset(config=self._transport_config())
        mbs = [_MicroBatch(m) for m in range(num_micro_batches)]
        slots = cfg.micro_batch_size * num_micro_batches
        in_flight: deque[tuple[Pending, _MicroBatch]] = deque()  # steps submitted, oldest first
        failures = 0  # in a row, with no step completed in between
        rung_before = self.transport.rung_calls
        mark = time.perf_counter()  # the loop's time until then is counted
        while True:
            now = time.perf_counter()
            stats.engine_loop_s += now - mark  # at work since the last mark: a stream's reports see it as it runs
            mark = now
            if refill is not None:
                idle = not (waiting or in_flight or any(mb.rows for mb in mbs))
                refill(waiting, idle)
                if idle:
                    now = time.perf_counter()
                    stats.engine_idle_s += now - mark
                    mark = now
            if not (waiting or in_flight or any(mb.rows for mb in mbs)):
                break
            try:
                for mb in mbs:  # 1. every idle micro-batch takes waiting rows and starts its next step
                    if not mb.busy:
                        self._admit(mb, waiting, mbs, stats, enqueued)
                        if mb.rows:
                            in_flight.append((self._submit(mb), mb))
                pending, mb = in_flight.popleft()  # 2. the oldest step ends first
                verdict, timings = self.transport.read(pending)
            except RECOVERABLE as exc:  # an actor died: every micro-batch's state on it is gone
                failures += 1
                self._recover(mbs, waiting, in_flight, stats, exc, failures)
                continue
            failures = 0
            stats.active_rows += timings.steps * sum(len(m.rows) for m in mbs)  # no row leaves before a call's last step
            stats.slot_steps += timings.steps * slots
            self._take(mb, verdict, timings, results, stats)  # 3.
            if self.on_step is not None:
                self.on_step(timings, verdict, sum(len(m.rows) for m in mbs))
        stats.engine_loop_s += time.perf_counter() - mark
        stats.rung_calls += self.transport.rung_calls - rung_before

    def _admit(self, mb: _MicroBatch, waiting: deque, mbs: list[_MicroBatch], stats: LoopStats,
               enqueued: dict[int, float]) -> None:
        """Fill free slots, sharing what is left evenly between micro-batches so all stay busy."""
        if not mb.rows:  # empty: drop its old caches rather than select([]) them
            mb.clear()
        unfinished = len(waiting) + sum(len(m.rows) for m in mbs)
        share = min(self.config.micro_batch_size, math.ceil(unfinished / len(mbs)))
        now = time.perf_counter()
        while waiting and len(mb.rows) < share:
            item = waiting.popleft()
            mb.rows.append(item)
            mb.new.append(item)
            stats.queue_wait_s += now - enqueued.pop(item[0], now)  # a re-queued row counts once

    def _submit(self, mb: _MicroBatch) -> Pending:
        """One step of `mb`: the target gets the new rows (and, split, the draft's proposal); a split
        replica's draft actor gets the last verdict and the new rows. A colocated call, or a draft
        actor's plain run, runs up to max_steps_per_call steps."""
        call = StepCall(mb.mb_id, self.admission.spec if mb.fresh else None, None, tuple(mb.new),
                        self.draft_info.feature_draft, self.config.max_steps_per_call,
                        capture=self._capture_ahead() if mb.fresh else None)
        draft_call = None
        if self.draft is not None:
            draft_call = dataclasses.replace(call, verdict=None if mb.fresh else mb.last, verify_s=mb.last_verify_s,
                                             last_steps=mb.last_steps)
        pending = self.transport.submit(call, draft_call)
        mb.busy, mb.fresh, mb.last, mb.new = True, False, None, []
        return pending

    def _capture_ahead(self) -> tuple[int, int] | None:
        """A fresh micro-batch's StepCall.capture: where the models' steps replay CUDA graphs (one
        target rank) and the job bounds a row's tokens (max_model_len), the rows and tokens that
        bound its programs; else None (each is captured when a step first needs it)."""
        cfg = self.config
        graphs = cfg.cuda_graphs or self._draft_graphs
        if not graphs or self.tensor_parallel > 1 or cfg.speculation.max_model_len is None:
            return None
        return cfg.micro_batch_size, self.max_model_len

    def _take(self, mb: _MicroBatch, verdict: Verdict, timings: StepTimings, results, stats: LoopStats) -> None:
        """A step's verdict: the rows it kept in slot order, the verdict itself (less the results)
        kept for the draft actor's next call, and its finished rows to `results`, last: a stream's
        caller takes the stats as its rows arrive, which then count this call."""
        mb.busy = False
        if verdict.keep is not None:
            mb.rows = [mb.rows[k] for k in verdict.keep]
        if self.draft is not None:
            mb.last, mb.last_verify_s = dataclasses.replace(verdict, finished=()), timings.verify_s
            mb.last_steps = timings.steps
        stats.add_call(timings, colocated=self.draft is None)
        stats.last_step_at = time.time()
        if stats.first_step_at is None:
            stats.first_step_at = stats.last_step_at
        self.steps_completed += timings.steps
        for i, finished in verdict.finished:  # the output's tokens: a re-run row counts once
            stats.generated_tokens += len(finished.token_ids)
            results[i] = finished

    # Failures.

    def _recover(self, mbs: list[_MicroBatch], waiting: deque, in_flight: deque, stats: LoopStats,
                 error: BaseException, failures: int) -> None:
        """Re-run every micro-batch's rows from their start (same seeds, same tokens; finished rows
        stay finished) once Ray has the actors back, or give up after max_recoveries failures in a row."""
        stats.recoveries += 1
        # A tensor-parallel target whose group broke (a rank died, or a collective failed) starts all
        # its ranks afresh; a lost draft actor leaves the ranks and their group as they are.
        restart_ranks = self.tensor_parallel > 1 and (isinstance(error, TensorParallelGroupBroken) or not self._ranks_alive())
        if restart_ranks:  # before the transport's teardown: a survivor may be blocked in a collective
            for t in self.targets:
                ray.kill(t, no_restart=True)
        self.transport.reset()  # its channels went with the actor
        if failures > self.config.max_recoveries:
            raise ReplicaGaveUp(f"{self._failure_line(error)}; {failures} failure{'s' if failures > 1 else ''} in a row "
                                "with no step completed in between: the replica gives up") from error
        if restart_ranks:
            self._restart_targets()
        requeue = sorted((item for mb in mbs for item in mb.rows), key=lambda item: item[0])
        waiting.extendleft(reversed(requeue))
        for mb in mbs:
            mb.clear()
            mb.last_steps = 0  # its last call's steps are unknown: a plain run it asked for is not ended
        in_flight.clear()
        self._infos()  # as long as Ray brings them back
        if restart_ranks:
            self._join_group()
        self.transport.reset(self._members())

    def _failure_line(self, error: BaseException) -> str:
        """What failed, in one line: which actor died, and Ray's word for why."""
        if isinstance(error, RayActorError):
            roles = {a._actor_id.hex(): role for a, role in [(self.draft, "draft"), *((t, "target") for t in self.targets)]
                     if a is not None}
            return f"the {roles.get(getattr(error, 'actor_id', None), 'model')} actor died: {last_line(error)}"
        return f"{type(error).__name__}: {last_line(error)}"

    def _ranks_alive(self) -> bool:
        """Whether every rank of a tensor-parallel target is alive, as Ray records it."""
        return not any(actor_state(t).dead for t in self.targets)

    def _infos(self) -> None:
        """Every actor's info, once each has loaded its model: waited for as long as Ray says the
        actor is alive or restarting (liveness.answer), however slowly it loads, and while their
        placement group has its bundles (`_check_placement`). A colocated replica's drafter reports
        through its target (ActorInfo.drafter)."""
        unplaced_since: list[float] = []
        check = functools.partial(self._check_placement, unplaced_since)
        self.rank_infos: list[ActorInfo] = [answer(t.info.remote, t, "target", check) for t in self.targets]
        self.target_info = self.rank_infos[0]
        self.draft_info: ActorInfo = (self.target_info.drafter if self.draft is None
                                      else answer(self.draft.info.remote, self.draft, "draft", check))

    def _check_placement(self, unplaced_since: list[float]) -> None:
        """PlacementFailed once the actors' placement group has been without its bundles for the
        placement timeout: its node was lost, and the cluster has no room to place it again (Ray
        keeps the group RESCHEDULING, and the actors restarting into it, for ever)."""
        if ray.util.placement_group_table(self.placement_group).get("state") == "CREATED":
            unplaced_since.clear()
            return
        if not unplaced_since:
            unplaced_since.append(time.monotonic())
        if time.monotonic() - unplaced_since[0] > self.config.placement_timeout_s:
            raise PlacementFailed(f"the model actors' placement group lost its node and could not be placed again within "
                                  f"{self.config.placement_timeout_s:.0f} s (the placement timeout): {cluster_room()}")

    def _join_group(self) -> None:
        """Set up a tensor-parallel target's torch.distributed group: rank 0 picks a free port on its
        node, and every rank joins at once (each join returns when all have, or raises after the
        config's group_timeout_s; a rank that dies meanwhile fails the wait)."""
        if self.tensor_parallel == 1:
            return
        address, port = ray.get(self.target.group_address.remote())
        ray.get([t.join_group.remote(address, port, self.config.group_timeout_s) for t in self.targets])

    def _restart_targets(self) -> None:
        """Start every rank afresh (killed by `_recover`), to join a new group on a new port: the old
        group lost a member, and a rank cannot rejoin it alone."""
        for t in self.targets:  # rank 0's name is free again once the GCS records its death
            wait_until_dead(t)
        self.targets = start_targets(self.placement_group, self._target_builds, self._target_name, self._target_resources)

    def _members(self) -> Members:
        return Members(self.targets, self.draft, self.rank_infos, self.draft_info, self._node)

    def _transport_config(self) -> TransportConfig:
        c = self.config
        return TransportConfig(c.micro_batches(self.shape), c.lend_draft_threads, c.measure_bytes, c.step_timeout_s,
                               c.placement_timeout_s)
