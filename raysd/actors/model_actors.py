"""The two halves of a speculative step, each in its own (Ray actor) process.

DraftActor holds the draft model (or none, for n-gram lookup) and one DraftSide
per micro-batch; TargetActor holds the target model and one TargetSide (verifier
and the rows' state) per micro-batch: the halves of the engine's own step
(raysd.engine.step). The per-micro-batch objects share the model weights and
differ only in their KV caches and rows. Both classes are plain Python: the
coordinator makes them Ray actors with `ray.remote(...)`, and tests may call them
in process.

Every step call carries a MicroBatchUpdate (what happened to the micro-batch's
rows since its last step), so one call per actor per step is enough.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from raysd.core.acceptance import parse_acceptance
from raysd.core.tree_shape import RANK_PRIOR
from raysd.engine.drafters import DraftModelDrafter, Drafter, FeatureDrafter, NgramDrafter, Proposal
from raysd.engine.adaptive import AdaptiveConfig, KController, StepCosts, by_rank
from raysd.engine.hierarchy import AssistedDraftModelDrafter, check_inner, profile_inner_costs
from raysd.engine.rows import Request
from raysd.engine.step import DraftSide, RowLimits, StepOutcome, TargetSide
from raysd.engine.verifier import TargetVerifier
from raysd.models.eagle_draft import EagleDraft
from raysd.models.features import EagleCausalLM
from raysd.models.loading import max_model_len
from raysd.models.runners import check_runner_kind
from raysd.models.static_runner import supports_static
from raysd.models.profile import time_forward, time_forward_upto
from raysd.actors.transport import ENCODINGS, ProbsEncoding, WireProposal, decode_proposal, encode_proposal, pickled_nbytes

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel

ModelFactory = Callable[[], "PreTrainedModel"]  # picklable, e.g. functools.partial(load_model, spec)


class MicroBatchStateLost(RuntimeError):
    """The actor has no state for a micro-batch it was asked to step: it was restarted."""


@dataclass(frozen=True)
class DrafterSpec:
    """How the draft actor builds its drafter; picklable."""

    model_factory: ModelFactory | None = None  # None: n-gram prompt lookup, no model; an EagleDraft: a feature draft
    draft_top_m: int = 0  # > 0: the draft samples from its top-m tokens only (exact; see DraftModelDrafter)
    min_ngram: int = 1
    max_ngram: int = 3
    probs_encoding: ProbsEncoding = "auto"  # "auto": lossless sparse whenever smaller than dense
    runner: str = "auto"  # the draft model's KV cache (raysd.models.runners)
    # Hierarchical speculation (raysd.engine.hierarchy): "ngram" lets n-gram lookup draft for the
    # draft model, at most `inner_k` per middle step, chosen by goodput on the draft model's step
    # costs profiled in the actor at `inner_batch_sizes` (`inner_adaptive`), else always inner_k.
    inner: str = "none"
    inner_k: int = 4
    inner_adaptive: bool = True
    inner_batch_sizes: tuple[int, ...] = (1, 16)
    # A model-free drafter (n-gram lookup, or no drafting) runs inside the target actor, beside
    # the rows' tokens: a step is then one call to one actor, with no draft actor to keep in
    # step. In its own actor it would cost a round trip per step and overlap nothing, as it has
    # no model to run (docs/actors.md). False keeps it in a draft actor of its own.
    colocate: bool = True

    @property
    def colocated(self) -> bool:
        """Whether the coordinator runs this drafter inside the target actor (no draft actor)."""
        return self.colocate and self.model_factory is None

    def __post_init__(self) -> None:
        check_runner_kind(self.runner)
        check_inner(self.inner)
        if self.inner != "none" and self.model_factory is None:
            raise ValueError(f"draft assist {self.inner!r} needs a draft model")
        if not 0 <= self.inner_k <= 64:
            raise ValueError(f"inner_k must be in 0..64, got {self.inner_k}")
        if self.draft_top_m < 0:
            raise ValueError(f"draft_top_m must be >= 0 (0 disables), got {self.draft_top_m}")
        if self.draft_top_m and self.model_factory is None:
            raise ValueError("draft_top_m needs a draft model")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.probs_encoding not in ENCODINGS:
            raise ValueError(f"probs_encoding must be one of {ENCODINGS}, got {self.probs_encoding!r}")

    def build(self, model: PreTrainedModel | EagleDraft | None, target_vocab_size: int, device: torch.device,
              inner_costs: StepCosts | None = None) -> Drafter:
        """`inner_costs`: the draft model's step costs for the inner k (profile_inner_costs), under inner_adaptive."""
        if model is None:
            return NgramDrafter(target_vocab_size, device, self.min_ngram, self.max_ngram)
        if isinstance(model, EagleDraft):
            if self.inner != "none":
                raise ValueError("draft assist takes a draft model, not an EAGLE feature draft")
            return FeatureDrafter(model, target_vocab_size, runner=self.runner)
        if self.inner == "ngram":
            adaptive = AdaptiveConfig(inner_costs) if self.inner_adaptive and inner_costs is not None else None
            return AssistedDraftModelDrafter(model, target_vocab_size, draft_top_m=self.draft_top_m, runner=self.runner,
                                             inner_k=self.inner_k, inner_adaptive=adaptive,
                                             min_ngram=self.min_ngram, max_ngram=self.max_ngram)
        return DraftModelDrafter(model, target_vocab_size, draft_top_m=self.draft_top_m, runner=self.runner)


@dataclass(frozen=True)
class MicroBatchUpdate:
    """What happened to a micro-batch's rows since its last step, applied before the next.

    For the draft side: commit `kept` (one tuple per row of the last step, with the drafts each
    row `accepted`, so its cache rolls back without reading the drafts back) and keep rows
    `keep` (None: all): the target's StepOutcome, forwarded. Then both sides append `new_rows`
    ((caller's index, request) pairs). `limits` starts the micro-batch afresh (no rows yet)."""

    limits: RowLimits | None = None
    kept: tuple[tuple[int, ...], ...] = ()
    accepted: tuple[int, ...] = ()
    keep: tuple[int, ...] | None = None
    new_rows: tuple[tuple[int, Request], ...] = ()
    path: tuple[tuple[int, ...], ...] | None = None  # a tree's accepted nodes per row (StepOutcome.path)

    def __post_init__(self) -> None:
        if self.limits is not None and (self.kept or self.keep is not None):
            raise ValueError("a fresh micro-batch carries no commit or selection")
        if len(self.accepted) != len(self.kept):
            raise ValueError(f"accepted needs one count per kept row, got {len(self.accepted)} for {len(self.kept)}")


class _MicroBatchStore:
    """One step half (DraftSide or TargetSide) per micro-batch, sharing the actor's model."""

    def __init__(self, make: Callable[[RowLimits], DraftSide | TargetSide]):
        self.make = make
        self.states: dict[int, DraftSide | TargetSide] = {}

    def apply(self, mb: int, update: MicroBatchUpdate, features=None) -> DraftSide | TargetSide:
        """`features`: a feature draft's part of the forwarded outcome (StepOutcome.features)."""
        if update.limits is not None:
            self.states[mb] = self.make(update.limits)
        elif mb not in self.states:
            raise MicroBatchStateLost(f"no state for micro-batch {mb} in process {os.getpid()}")
        side = self.states[mb]
        if update.kept or update.keep is not None:
            side.commit(update.kept, update.accepted, update.keep, features, update.path)
        if update.new_rows:
            side.add(update.new_rows)
        return side


def assigned_device() -> torch.device:
    """The GPU Ray assigned to this process (Ray sets CUDA_VISIBLE_DEVICES, so it is
    cuda:0 here), or the CPU when none was."""
    try:
        import ray

        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", []) if ray.is_initialized() else []
    except Exception:  # not inside Ray
        gpus = []
    if gpus and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


@dataclass(frozen=True)
class ActorInfo:
    pid: int
    device: str
    vocab_size: int
    max_model_len: int  # the actor's model's context (no limit for a model-free drafter)
    feature_draft: bool = False  # the draft reads the target's features (EAGLE)
    supports_trees: bool = False  # can draft or verify trees: n-gram lookup, or a model on the static runner


@dataclass(frozen=True)
class DraftMeta:
    busy_s: float  # time spent inside propose
    proposal_nbytes: int  # pickled size of the WireProposal sent to the target (0 if not measured)
    dense_nbytes: int  # what a dense draft_probs would have cost
    encoding: str


@dataclass(frozen=True)
class VerifyResult:
    outcome: StepOutcome  # what the target decided: the draft side's next update, the finished rows
    busy_s: float  # time spent inside verify (a colocated drafter's drafting included)
    features_nbytes: int = 0  # tensor bytes of the features sent apart to the draft actor (feature draft)
    draft_s: float = 0.0  # of busy_s, a colocated drafter's proposing
    drafted: int = 0  # steps a colocated drafter proposed for (K > 0)
    steps: int = 1  # steps this call ran (several with a colocated drafter: TargetActor.verify)


def _ask_target_vocab_size(name: str, timeout_s: float = 300.0) -> int:
    """The named target actor's vocabulary size, waiting while it (re)starts: a draft restarted at
    the moment its target is restarting too must not fail its constructor (Ray never restarts an
    actor whose constructor raised)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(ray.get_actor(name).get_vocab_size.remote(), timeout=30)
        except (RayActorError, GetTimeoutError, ValueError):  # ValueError: no actor by that name (yet)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class DraftActor:
    """`target_vocab_size`: an int, or the name of the (named) target actor, which the draft asks
    once its own model has loaded (so both load in parallel), and asks again after a restart.
    A name travels inline with the constructor call; an ObjectRef or an actor handle would make
    Ray keep the argument in the object store, where it cannot guarantee it for a restart
    (ray-project/ray#53727)."""

    def __init__(self, spec: DrafterSpec, target_vocab_size, measure_bytes: bool = True):
        self.spec, self.measure_bytes = spec, measure_bytes
        self.device = assigned_device()
        self.model = spec.model_factory().to(self.device).eval() if spec.model_factory else None
        if isinstance(target_vocab_size, str):  # the target actor's name
            target_vocab_size = _ask_target_vocab_size(target_vocab_size)
        self.target_vocab_size = target_vocab_size
        self.inner_costs = None  # the draft model's own step costs, for the inner k of draft assist
        if spec.inner != "none" and spec.inner_adaptive and self.model is not None and not isinstance(self.model, EagleDraft):
            with torch.inference_mode():
                self.inner_costs = profile_inner_costs(self.model, spec.inner_k, spec.inner_batch_sizes)
        self.store = _MicroBatchStore(lambda limits: DraftSide(
            spec.build(self.model, target_vocab_size, self.device, self.inner_costs), limits, self.device))

    def time_steps(self, batch_sizes: Sequence[int], context: int, reps: int) -> list[float]:
        """Seconds of one draft forward per batch size (0 for a model-free drafter)."""
        if self.model is None:
            return [0.0 for _ in batch_sizes]
        if isinstance(self.model, EagleDraft):  # a feature draft runs on the dynamic runner (FeatureDrafter)
            model, runner = EagleCausalLM(self.model, zero_features=True), "dynamic"
        else:
            model, runner = self.model, self.spec.runner
        return [time_forward(model, B, [0], context, reps, runner)[0] for B in batch_sizes]

    def info(self) -> ActorInfo:
        feature = isinstance(self.model, EagleDraft)
        if self.model is None:
            limit = 2**31 - 1
        else:
            limit = self.model.config.max_position_embeddings if feature else max_model_len(self.model)
        # a draft model or an EAGLE draft (its config is its target's family) on the static runner, or n-gram
        trees = self.model is None or (self.spec.runner != "dynamic" and supports_static(self.model)
                                       and self.spec.inner == "none")
        return ActorInfo(os.getpid(), str(self.device), self.target_vocab_size, limit, feature, trees)

    def apply(self, mb: int, updates: Sequence[MicroBatchUpdate]) -> None:
        """Apply updates, in order, without proposing: the target's decisions of steps that
        drafted nothing (K = 0), which the coordinator did not send through `propose`."""
        for update in updates:
            self.store.apply(mb, update)

    def propose(self, mb: int, updates: Sequence[MicroBatchUpdate], k: int,
                features: tuple[torch.Tensor, ...] | None = None,
                tree_budget: int | None = None) -> tuple[WireProposal, DraftMeta]:
        """Apply the updates in order (the last with, for a feature draft, the target's features of
        its last step, straight from the target actor), then propose up to min(k, room) drafts per
        row, or the tree of `tree_budget` (DraftSide.propose)."""
        start = time.perf_counter()
        self.apply(mb, updates[:-1])
        proposal = self.store.apply(mb, updates[-1], features).propose(k, tree_budget)
        wire = encode_proposal(proposal, self.spec.probs_encoding)
        busy = time.perf_counter() - start
        B, K, V = proposal.draft_probs.shape
        nbytes = pickled_nbytes(wire) if self.measure_bytes else 0
        return wire, DraftMeta(busy, nbytes, B * K * V * 4, wire.encoding)


class TargetActor:
    """The target model, and per micro-batch its verifier with the rows' state (TargetSide).
    `acceptance`: "exact" or "relaxed:LAMBDA" (raysd.core.acceptance.parse_acceptance)."""

    def __init__(self, model_factory: ModelFactory, runner: str = "auto", acceptance: str = "exact",
                 drafter: DrafterSpec | None = None):
        """`drafter`: a model-free drafter (DrafterSpec.colocated) to run here, one DraftSide per
        micro-batch beside its TargetSide, as SpecEngine.step runs the two in one process."""
        if drafter is not None and not drafter.colocated:
            raise ValueError("only a model-free drafter (DrafterSpec.colocated) runs inside the target actor")
        self.device = assigned_device()
        self.model = model_factory().to(self.device).eval()
        self.runner = runner
        relax = parse_acceptance(acceptance)
        self.store = _MicroBatchStore(lambda limits: TargetSide(
            TargetVerifier(self.model, runner, features=limits.feature_draft), limits, relax=relax, acceptance=acceptance))
        self.vocab_size = TargetVerifier(self.model).vocab_size
        self.drafts = None if drafter is None else _MicroBatchStore(lambda limits: DraftSide(
            drafter.build(None, self.vocab_size, self.device), limits, self.device))

    def time_steps(self, batch_sizes: Sequence[int], k_max: int, context: int, reps: int) -> list[list[float]]:
        """[len(batch_sizes)][k_max + 1] seconds of one target forward of K + 1 tokens per row."""
        out = []
        for B in batch_sizes:
            out.append(time_forward_upto(self.model, B, k_max, context, reps, self.runner))
        return out

    def _steps(self, local: DraftSide, side: TargetSide, k: int, tree: int | None, max_steps: int,
               controller: KController | None, start: float) -> VerifyResult:
        """SpecEngine.step's three calls (propose, verify, the drafter follows), up to max_steps times."""
        draft_s, drafted, steps, overlap, tested = 0.0, 0, 0, 0.0, 0
        ranks = np.zeros((2, len(RANK_PRIOR)), dtype=np.int64)  # the trees' walks by rank, summed
        while True:
            if controller is not None:
                batch = side.batch
                k, tree = controller.choose_plan_from(batch.overlap_sum, batch.tested, batch.room())
            t0 = time.perf_counter()
            proposal = local.propose(k, tree)
            if k > 0:  # K = 0: an empty proposal, no drafting
                draft_s, drafted = draft_s + time.perf_counter() - t0, drafted + 1
            outcome = side.verify(proposal, k, tree)
            local.commit(outcome.kept, outcome.accepted, outcome.keep, None, outcome.path)
            if controller is not None:
                controller.observe_all(outcome.step_overlap, outcome.step_tested)
                controller.observe_ranks(outcome.rank_offered, outcome.rank_moved)
            ranks += [by_rank(outcome.rank_offered, len(RANK_PRIOR)), by_rank(outcome.rank_moved, len(RANK_PRIOR))]
            steps, overlap, tested = steps + 1, overlap + outcome.step_overlap, tested + outcome.step_tested
            if outcome.finished or steps == max_steps:
                break
        outcome = dataclasses.replace(outcome, step_overlap=overlap, step_tested=tested,
                                      rank_offered=tuple(ranks[0].tolist()), rank_moved=tuple(ranks[1].tolist()))
        return VerifyResult(outcome, time.perf_counter() - start, 0, draft_s, drafted, steps)

    def info(self) -> ActorInfo:
        trees = self.runner != "dynamic" and supports_static(self.model)
        return ActorInfo(os.getpid(), str(self.device), self.vocab_size, max_model_len(self.model), supports_trees=trees)

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def verify(self, mb: int, update: MicroBatchUpdate, wire: WireProposal | None, k: int, max_steps: int = 1,
               controller: KController | None = None,
               tree_budget: int | None = None) -> tuple[VerifyResult, tuple[torch.Tensor, ...] | None]:
        """Apply the update, verify the proposal, emit, roll back, retire finished rows. Two
        returns: the outcome for the coordinator, and apart (for a feature draft, else None) the
        features, which go to the draft actor's next call without passing through the coordinator.
        `wire` None: the colocated drafter proposes here, or (none) a step with K = 0, for which
        the draft actor was not asked (no drafts).

        With a colocated drafter, one call runs up to `max_steps` steps and returns after the
        first that retires a row: until a row finishes no slot frees, so the coordinator has
        nothing to admit and one call saves the others' round trips. `controller` (adaptive K)
        then chooses each step's K here, from the rows' evidence as SpecEngine.step does, and
        learns from each step as the coordinator's own would; the outcome sums the evidence.
        `tree_budget`: the step's tree (DraftSide.propose), or the controller's choice each step."""
        start = time.perf_counter()
        side = self.store.apply(mb, update)
        if self.drafts is not None:
            return self._steps(self.drafts.apply(mb, update), side, k, tree_budget, max_steps, controller, start), None
        assert max_steps == 1 and controller is None, "several steps per call need the drafter in this actor"
        if wire is None:
            proposal = Proposal.empty(len(side), self.vocab_size, self.device)
        else:
            proposal = decode_proposal(wire, self.device)
        outcome = side.verify(proposal, k, tree_budget)
        features = None
        if outcome.features is not None:  # to the host in one copy: they travel through the object store
            sizes = [len(f) for f in outcome.features]
            features = tuple(torch.cat(outcome.features).cpu().split(sizes)) if sizes else ()
            outcome = dataclasses.replace(outcome, features=None)
        nbytes = sum(f.numel() * f.element_size() for f in features) if features else 0
        return VerifyResult(outcome, time.perf_counter() - start, nbytes), features
