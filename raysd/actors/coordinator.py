"""Draft and target in two Ray actors, drafting overlapped with batched verification.

The rows are split into micro-batches. Each micro-batch alternates draft -> verify,
and the coordinator keeps every micro-batch in flight, so with two of them the
actors run as a two-stage pipeline:

    draft   | A1 | B1 | A2 | B2 | ...
    target  |    | A1 | B1 | A2 | ...

The actors run the engine's own step, halved (raysd.engine.step): the draft actor's
DraftSide proposes, the target actor's TargetSide verifies, emits, rolls back and
retires finished rows, and keeps the rows' state (budgets, stop sets, statistics)
beside the target model. The proposal goes from the draft actor to the target actor
as an ObjectRef argument (object store; never through the coordinator); the target's
StepOutcome comes back here and rides on the micro-batch's next draft call. The
coordinator only admits rows, collects finished ones, chooses K and recovers from
actor failures. Draws are keyed by (seed, tokens generated), so the same seeds give
the same tokens as SpecEngine.

A model-free drafter (n-gram lookup, or none) has no model to overlap, so it runs inside
the target actor (DrafterSpec.colocated): one actor, one call per step, no draft actor.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysd.actors.model_actors import (
    ActorInfo,
    DraftActor,
    DrafterSpec,
    MicroBatchStateLost,
    MicroBatchUpdate,
    ModelFactory,
    TargetActor,
    VerifyResult,
)
from raysd.actors.transport import TransferStats, pickled_nbytes
from raysd.core.acceptance import parse_acceptance
from raysd.core.stats import SpecDecodeStats
from raysd.engine.adaptive import AdaptiveConfig, KController, StepCosts
from raysd.engine.engine import LossyAcceptanceWarning, check_adaptive_costs, check_tree_config
from raysd.engine.rows import GenerationResult, Request, request_error
from raysd.engine.step import RowLimits, StepOutcome
from raysd.models.runners import check_runner_kind

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DRAFT_BACKLOG = 32  # K = 0 steps whose draft updates wait for the next call before travelling on their own


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

    def bundle(self) -> dict[str, float]:
        return {k: v for k, v in (("CPU", self.num_cpus), ("GPU", self.num_gpus)) if v > 0}


@dataclass(frozen=True)
class CoordinatorConfig:
    num_speculative_tokens: int = 4  # K: drafts per row per step
    micro_batch_size: int = 8  # rows per micro-batch; waiting requests take freed slots
    num_micro_batches: int = 2  # >= 2: one drafts while another verifies
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None  # None: the models' own context
    draft_resources: ActorResources = ActorResources()
    target_resources: ActorResources = ActorResources()
    placement_strategy: str = "STRICT_PACK"  # both actors on one node
    max_actor_restarts: int = 3  # Ray restarts a dead actor this many times
    max_recoveries: int = 3  # re-runs of in-flight rows after actor failures, per generate call
    measure_bytes: bool = True
    placement_timeout_s: float = 180.0  # give up (with a clear error) if the actors cannot be placed
    # Choose K in 0..num_speculative_tokens each step (raysd.engine.adaptive), e.g. with
    # costs from `profile_step_costs`; None: always num_speculative_tokens.
    adaptive: AdaptiveConfig | None = None
    runner: str = "auto"  # the target's KV cache (raysd.models.runners); the draft's is DrafterSpec.runner
    acceptance: str = "exact"  # or "relaxed:LAMBDA" (lossy; raysd.engine.engine.EngineConfig.acceptance)
    tree_budget: int = 0  # P > 0: draft trees of at most P nodes (raysd.engine.engine.EngineConfig.tree_budget)
    # With a model-free drafter (run inside the target actor), one call to the target actor runs up
    # to this many steps, returning after the first that retires a row (TargetActor.verify): a
    # row's slot is refilled as soon as it frees, and the steps between cost no round trip. A
    # request arriving while the rows run waits at most this many steps for a free slot.
    max_steps_per_call: int = 8

    def __post_init__(self) -> None:
        check_runner_kind(self.runner)
        check_tree_config(self.tree_budget, self.runner, self.num_speculative_tokens,
                          parse_acceptance(self.acceptance) is not None)
        check_adaptive_costs(self.adaptive, self.num_speculative_tokens, self.tree_budget)
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in 0..64, got {self.num_speculative_tokens}")
        if self.max_steps_per_call < 1:
            raise ValueError(f"max_steps_per_call must be >= 1, got {self.max_steps_per_call}")
        if self.micro_batch_size < 1 or self.num_micro_batches < 1:
            raise ValueError("micro_batch_size and num_micro_batches must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.placement_strategy not in STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {STRATEGIES}, got {self.placement_strategy!r}")
        if self.max_actor_restarts < -1 or self.max_recoveries < 0:
            raise ValueError("max_actor_restarts must be >= -1 and max_recoveries >= 0")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


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
    generated_tokens: int = 0
    recoveries: int = 0  # times in-flight rows were re-queued after an actor failure
    transfer: TransferStats = field(default_factory=TransferStats)
    slots: int = 0  # micro_batch_size * num_micro_batches: rows the actors can hold at once
    active_rows: int = 0  # summed over completed steps: rows in the micro-batches when the step ended
    recoveries_done: int = 0  # streams: recoveries followed by a completed step (see `_serve`)
    queue_wait_s: float = 0.0  # summed over rows: from submission (or the start of `generate`) to admission
    idle_s: float = 0.0  # streams: time the loop had no row at all to run (waiting for input)

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
    what the target decided last (for the draft's next update), and what K depends on."""

    mb_id: int
    rows: list[tuple[int, Request]] = field(default_factory=list)  # (request index, request), slot order
    new: list[tuple[int, Request]] = field(default_factory=list)  # admitted, not yet sent to the actors
    last: StepOutcome | None = None  # the target's last decision, not yet forwarded to the draft
    features: ray.ObjectRef | None = None  # its features for a feature draft (target actor -> draft actor)
    # Draft-side updates of steps that drafted nothing (K = 0): the draft actor was not asked for
    # them, and gets them in order with its next call (_submit).
    backlog: list[MicroBatchUpdate] = field(default_factory=list)
    fresh: bool = True  # the actors hold no (valid) state for it: the next step starts it afresh
    busy: bool = False
    # The rows' acceptance evidence and room after the last step (KController.choose_k_from).
    overlap_sum: list[float] = field(default_factory=list)
    tested: list[int] = field(default_factory=list)
    room: list[int] = field(default_factory=list)

    def clear(self) -> None:
        self.rows, self.new, self.last, self.features, self.fresh, self.busy = [], [], None, None, True, False
        self.backlog = []
        self.overlap_sum, self.tested, self.room = [], [], []


@dataclass
class _Flight:
    mb: _MicroBatch
    meta_ref: ray.ObjectRef | None  # None: a step with K = 0, the draft actor was not asked
    draft_args_nbytes: int
    target_args_nbytes: int


class SpecCoordinator:
    """Owns a placement group with one target and one draft actor, and runs requests through them.

    Needs `ray.init()` first. Reusable across `generate` calls; `shutdown()` (or a
    `with` block) releases the actors and the placement group.
    """

    def __init__(self, target_factory: ModelFactory, drafter: DrafterSpec, config: CoordinatorConfig):
        if config.tree_budget and drafter.runner == "dynamic":
            raise ValueError("tree drafting needs the static runner and a draft-model, EAGLE or n-gram drafter")
        self.config = config
        self.steps_completed = 0  # micro-batch steps over the coordinator's life (for progress watchers)
        self._k_controller: KController | None = None
        self._serving = threading.Lock()  # one loop at a time: a stream or a generate call
        # A model-free drafter runs inside the target actor (DrafterSpec.colocated): no draft actor.
        self.colocated = drafter.colocated
        bundles = [config.target_resources.bundle()] + ([] if self.colocated else [config.draft_resources.bundle()])
        self.placement_group = placement_group(bundles, strategy=config.placement_strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=config.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"could not place the draft and target actors ({bundles}, {config.placement_strategy}) within "
                f"{config.placement_timeout_s:.0f}s; the cluster has {ray.cluster_resources()}. "
                "On a machine without GPUs use ActorResources(num_gpus=0)."
            ) from None
        # The target is named (uniquely) so that the draft can find it: the draft starts (and loads
        # its model) while the target loads, then asks the target for its vocabulary size, and asks
        # again on every restart. It gets the name, not an ObjectRef or a handle: Ray keeps those in
        # the object store, and cannot promise them to a restarted actor (ray-project/ray#53727).
        # Every constructor argument here is small and travels inline.
        target_name = f"raysd-target-{uuid.uuid4().hex}"
        self.target = self._actor(TargetActor, 0, config.target_resources, name=target_name).remote(
            target_factory, config.runner, config.acceptance, drafter if self.colocated else None)
        self.draft = None
        if not self.colocated:
            self.draft = self._actor(DraftActor, 1, config.draft_resources).remote(drafter, target_name, config.measure_bytes)
        self.target_info, self.draft_info = self._infos(timeout=None)  # both load their models first
        self.vocab_size = self.target_info.vocab_size
        limits = [self.target_info.max_model_len, self.draft_info.max_model_len]
        self.max_model_len = min(limits + ([config.max_model_len] if config.max_model_len else []))
        if config.tree_budget and not (self.target_info.supports_trees and self.draft_info.supports_trees):
            self.shutdown()
            raise ValueError("tree drafting needs the static runner and a draft-model, EAGLE or n-gram drafter "
                             "(Llama-family target and draft models, no draft assist)")
        if parse_acceptance(config.acceptance) is not None:
            warnings.warn(f"RELAXED ACCEPTANCE ({config.acceptance}): outputs do NOT follow the target distribution "
                          "exactly", LossyAcceptanceWarning, stacklevel=2)

    @property
    def limits(self) -> RowLimits:
        """What both actors cap and stop rows by; read at each micro-batch's start, so a replaced
        config (e.g. the EOS ids, known once the tokenizer has loaded) applies to later rows."""
        cfg = self.config
        return RowLimits(cfg.num_speculative_tokens, self.max_model_len, cfg.eos_token_ids, self.draft_info.feature_draft,
                         cfg.tree_budget)

    @property
    def k_controller(self) -> KController | None:
        """The adaptive-K controller of `config.adaptive`; its pooled acceptance lives as long as
        the coordinator (every request it serves), and restarts if the config is replaced."""
        adaptive = self.config.adaptive
        if adaptive is None:
            return None
        if self._k_controller is None or self._k_controller.config is not adaptive:
            self._k_controller = KController(adaptive, self.config.tree_budget, self.config.num_speculative_tokens)
        return self._k_controller

    def _actor(self, cls, bundle_index: int, resources: ActorResources, **options):
        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=bundle_index)
        return ray.remote(cls).options(
            **options,
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            scheduling_strategy=strategy,
            max_restarts=self.config.max_actor_restarts,
            max_task_retries=0,  # a lost step is re-run from the rows' start, not retried
        )

    def __enter__(self) -> "SpecCoordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        for actor in (getattr(self, "draft", None), getattr(self, "target", None)):
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(self.placement_group)

    def profile_step_costs(self, k_max: int, batch_sizes: Sequence[int], context: int = 128, reps: int = 3) -> StepCosts:
        """Step costs measured inside the actors, on the devices they run on."""
        target_ref = self.target.time_steps.remote(list(batch_sizes), k_max, context, reps)
        if self.draft is None:  # a colocated drafter is model-free: its drafting counts as free
            target_s, draft_s = ray.get(target_ref), [0.0] * len(batch_sizes)
        else:
            target_s, draft_s = ray.get([target_ref, self.draft.time_steps.remote(list(batch_sizes), context, reps)])
        return StepCosts(tuple(batch_sizes), tuple(tuple(t) for t in target_s), tuple(draft_s))

    def generate(self, requests: Sequence[Request]) -> RunOutput:
        """Generate for every request; results come back in request order, one per request.

        The same loop as `stream()` (`_serve`), fed once with the whole list."""
        cfg = self.config
        report = RunReport()
        results: dict[int, GenerationResult] = {}
        waiting: deque[tuple[int, Request]] = deque()
        for i, req in enumerate(requests):
            error = request_error(req, self.vocab_size, self.max_model_len)
            if error:
                stats = SpecDecodeStats(cfg.num_speculative_tokens)
                results[i] = GenerationResult(req.request_id, list(req.prompt_token_ids), [], "error", stats, error,
                                              acceptance=cfg.acceptance)
            else:
                waiting.append((i, req))
        start = time.perf_counter()
        with self._loop_lock("generate"):
            self._serve(waiting, results, report, {i: start for i, _ in waiting})
        report.wall_s = time.perf_counter() - start
        assert len(results) == len(requests), "every request yields exactly one result"
        return RunOutput([results[i] for i in range(len(requests))], report)

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
        report.slots = cfg.micro_batch_size * cfg.num_micro_batches
        mbs = [_MicroBatch(m) for m in range(cfg.num_micro_batches)]
        in_flight: dict[ray.ObjectRef, _Flight] = {}
        while True:
            if refill is not None:
                idle = not (waiting or in_flight or any(mb.rows for mb in mbs))
                t0 = time.perf_counter()
                refill(waiting, idle)
                if idle:
                    report.idle_s += time.perf_counter() - t0
            if not (waiting or in_flight or any(mb.rows for mb in mbs)):
                return
            # 1. Every idle micro-batch takes waiting rows into free slots and starts its next step.
            for mb in mbs:
                if not mb.busy:
                    before = len(mb.rows)
                    self._admit(mb, waiting, mbs)
                    if len(mb.rows) > before:
                        now = time.perf_counter()
                        for i, _ in mb.rows[before:]:
                            report.queue_wait_s += now - enqueued.pop(i, now)  # a re-queued row counts once
                    if mb.rows:
                        ref, flight = self._submit(mb)
                        in_flight[ref] = flight
            # 2. Whichever verification ends first: emit its tokens, free its finished rows.
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            flight = in_flight.pop(ref)
            try:
                result: VerifyResult = ray.get(ref)
                meta = ray.get(flight.meta_ref) if flight.meta_ref is not None else None
            except (RayActorError, MicroBatchStateLost):
                # 3. An actor died (and is restarting): every micro-batch's state on it is
                # gone. Re-run their rows from the start; finished results stay.
                self._recover(mbs, waiting, in_flight, report)
                continue
            report.active_rows += result.steps * sum(len(m.rows) for m in mbs)  # no row leaves before a call's last step
            self._finish_step(flight.mb, result, results, report)
            report.target_busy_s += result.busy_s - result.draft_s
            report.draft_busy_s += result.draft_s  # a colocated drafter's (else 0; the draft actor's: below)
            report.draft_steps += result.drafted
            t = report.transfer
            t.steps += 1
            if meta is not None:
                report.draft_steps += 1
                report.draft_busy_s += meta.busy_s
                t.proposal += meta.proposal_nbytes
                t.dense_equivalent += meta.dense_nbytes
                t.sparse_steps += meta.encoding == "sparse"
            t.draft_args += flight.draft_args_nbytes
            t.target_args += flight.target_args_nbytes
            t.results += pickled_nbytes(result) if cfg.measure_bytes else 0
            t.features += result.features_nbytes
            if refill is not None and report.recoveries:
                # A stream lives for a whole job: max_recoveries bounds failures in a row, not in its life.
                report.recoveries_done += report.recoveries
                report.recoveries = 0

    def _admit(self, mb: _MicroBatch, waiting: deque, mbs: list[_MicroBatch]) -> None:
        """Fill free slots, sharing what is left evenly between micro-batches so both stay busy."""
        cfg = self.config
        if not mb.rows:  # empty: drop its old caches rather than select([]) them
            mb.clear()
        unfinished = len(waiting) + sum(len(m.rows) for m in mbs)
        share = min(cfg.micro_batch_size, math.ceil(unfinished / len(mbs)))
        while waiting and len(mb.rows) < share:
            item = waiting.popleft()
            mb.rows.append(item)
            mb.new.append(item)

    def _choose_plan(self, mb: _MicroBatch) -> tuple[int, int]:
        """The step's K and tree budget: the controller's choice from the rows' evidence (as
        SpecEngine.step), or the configured ones."""
        if self.k_controller is None:
            return self.config.num_speculative_tokens, self.config.tree_budget
        n = len(mb.new)
        room = mb.room + [self.limits.first_room(req) for _, req in mb.new]
        return self.k_controller.choose_plan_from(mb.overlap_sum + [0.0] * n, mb.tested + [0] * n, room)

    def _skips_draft(self, k: int) -> bool:
        """A step that drafts nothing (plain decoding, or adaptive K chose 0, never with a tree)
        goes straight to the target rather than after a round trip through the draft actor, which
        gets the update with its next call. Not for a feature draft (it follows the target's
        features every step)."""
        return k == 0 and not self.draft_info.feature_draft

    def _submit(self, mb: _MicroBatch) -> tuple[ray.ObjectRef, _Flight]:
        k, tree = self._choose_plan(mb)
        limits = self.limits if mb.fresh else None
        new = tuple(mb.new)
        last = mb.last
        if last is not None:
            draft_update = MicroBatchUpdate(limits, last.kept, last.accepted, last.keep, new, last.path)
        else:
            draft_update = MicroBatchUpdate(limits, new_rows=new)
        target_update = MicroBatchUpdate(limits, new_rows=new)  # the target applied its own decision
        if not self.colocated:  # else the drafter beside the target has followed the decision already
            mb.backlog.append(draft_update)
        # Actor tasks with task events on make the GCS keep a few KB of events each (up to
        # RAY_task_events_max_num_task_in_gcs of them), which grew it per row in the soak.
        if self.colocated:
            proposal_ref = meta_ref = None  # the target actor drafts for itself
        elif self._skips_draft(k):
            proposal_ref = meta_ref = None
            if len(mb.backlog) >= DRAFT_BACKLOG:  # bounded memory: hand it over, off the critical path
                self.draft.apply.options(enable_task_events=False).remote(mb.mb_id, tuple(mb.backlog))
                mb.backlog = []
        else:
            propose = self.draft.propose.options(num_returns=2, enable_task_events=False)
            features = mb.features if last is not None else None
            proposal_ref, meta_ref = propose.remote(mb.mb_id, tuple(mb.backlog), k, features, tree)
            mb.backlog = []
        verify = self.target.verify.options(num_returns=2, enable_task_events=False)
        if self.colocated:  # several steps per call, each choosing its K in the actor
            verify_ref, mb.features = verify.remote(mb.mb_id, target_update, None, k, self.config.max_steps_per_call,
                                                    self.k_controller, tree)
        else:
            verify_ref, mb.features = verify.remote(mb.mb_id, target_update, proposal_ref, k, tree_budget=tree)
        mb.busy, mb.fresh, mb.last, mb.new = True, False, None, []
        measure = self.config.measure_bytes
        draft_nbytes = pickled_nbytes((mb.mb_id, draft_update, k)) if measure and meta_ref is not None else 0
        target_nbytes = pickled_nbytes((mb.mb_id, target_update, k)) if measure else 0
        return verify_ref, _Flight(mb, meta_ref, draft_nbytes, target_nbytes)

    def _finish_step(self, mb: _MicroBatch, result: VerifyResult, results: dict, report: RunReport) -> None:
        out = result.outcome
        mb.busy = False
        for i, finished in out.finished:
            results[i] = finished
            report.generated_tokens += len(finished.token_ids)
        if self.k_controller is not None:
            self.k_controller.observe_all(out.step_overlap, out.step_tested)
            self.k_controller.observe_ranks(out.rank_offered, out.rank_moved)
        if out.keep is not None:
            mb.rows = [mb.rows[k] for k in out.keep]
        mb.last = out
        mb.overlap_sum, mb.tested, mb.room = list(out.overlap_sum), list(out.tested), list(out.room)
        report.steps += result.steps
        self.steps_completed += result.steps

    def _recover(self, mbs: list[_MicroBatch], waiting: deque, in_flight: dict, report: RunReport) -> None:
        report.recoveries += 1
        if report.recoveries > self.config.max_recoveries:
            raise RuntimeError(f"actors failed {report.recoveries} times in one run; giving up")
        requeue = sorted((item for mb in mbs for item in mb.rows), key=lambda item: item[0])
        waiting.extendleft(reversed(requeue))  # re-run from the prompt: same seed, same output
        for mb in mbs:
            mb.clear()
        in_flight.clear()  # stale steps: later calls start the micro-batches afresh, in order after them
        self._wait_for_actors()

    def _infos(self, timeout: float | None) -> tuple[ActorInfo, ActorInfo]:
        """Both actors' info. A colocated drafter has no actor: its info is the target's, with
        no context limit of its own."""
        if self.draft is None:
            target = ray.get(self.target.info.remote(), timeout=timeout)
            return target, dataclasses.replace(target, max_model_len=2**31 - 1, supports_trees=True)
        target, draft = ray.get([self.target.info.remote(), self.draft.info.remote()], timeout=timeout)
        return target, draft

    def _wait_for_actors(self, timeout_s: float = 120.0) -> None:
        """Block until the actors answer again (Ray restarts them; calls made to a dying
        process would fail and burn a recovery each)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.target_info, self.draft_info = self._infos(timeout=30)
                return
            except (RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


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
        c = self.coordinator
        error = request_error(request, c.vocab_size, c.max_model_len)
        if error:  # refused before it takes a slot, as in `generate`
            stats = SpecDecodeStats(c.config.num_speculative_tokens)
            future.set_result(StreamedResult(GenerationResult(request.request_id, list(request.prompt_token_ids), [],
                                                              "error", stats, error), 0.0))
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
                "target_busy_s": r.target_busy_s, "steps": r.steps, "draft_steps": r.draft_steps, "active_rows": r.active_rows,
                "slots": r.slots, "queue_wait_s": r.queue_wait_s, "idle_s": r.idle_s,
                "recoveries": r.recoveries + r.recoveries_done, "generated_tokens": r.generated_tokens}

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
