"""What runs inside a replica's model actors: the workers (as vLLM's Worker inside its Ray wrapper).

- `TargetWorker` holds the target model and one TargetSide per micro-batch. In a colocated replica
  (raysd.actors.settings.replica_shape) it holds the drafter too, a draft model included, with one
  DraftSide beside each TargetSide, and runs the engine's own step with both
  (raysd.engine.step.speculative_step), as the single-process engine does.
- In a split replica, `DraftWorker` holds the draft model and one DraftSide per micro-batch and runs
  the step's draft half (`settle` the last verdict, `draft_half`); the TargetWorker runs the same
  step on the proposal it receives.

The per-micro-batch sides share the worker's model weights and differ only in their KV caches and
rows. Both classes are plain Python: raysd.actors.launch hosts each in a Ray actor, and tests may
call them in process. Every call carries a `StepCall`: what happened to the micro-batch's rows
since its last step (the last verdict, for the draft side; rows admitted), so one call per actor
per step is enough.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from raysd.actors.local import exit_when_orphaned
from raysd.actors.proposals import WireProposal, decode_proposal, encode_proposal
from raysd.actors.turns import Doorbell, Ringer
from raysd.actors.wire import (
    ActorInfo,
    BeamSpec,
    DrafterSpec,
    MicroBatchStateLost,
    ModelFactory,
    StepCall,
    TensorParallelGroupBroken,
    TransferStats,
    pickled_nbytes,
)
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig, StepCosts
from raysd.engine.adaptive import KController, PlainRun
from raysd.engine.draft_assist import DraftAssistDrafter, profile_assist_costs
from raysd.engine.drafters import Drafter, DraftModelDrafter, FeatureDrafter, NgramDrafter, Proposal
from raysd.engine.engine import decoder
from raysd.engine.graphs import CapturePlan, capture_ahead, capture_draft_ahead, capture_target_ahead
from raysd.engine.step import DraftSide, ReceivedPlan, ReceivedProposal, StepHook, draft_half, settle, speculative_step
from raysd.engine.suffix import SuffixDrafter, SuffixIndex
from raysd.engine.target import TargetSide
from raysd.engine.verdict import Plan, StepTimings, Verdict, merge_plain
from raysd.models.eagle_draft import EagleDraft
from raysd.models.features import EagleCausalLM
from raysd.models.loading import eos_token_ids, max_model_len, model_dtype, output_vocab_size
from raysd.models.names import TensorParallel
from raysd.models.profile import crossover_tokens, time_forward, time_forward_upto
from raysd.models.static_runner import supports_static
from raysd.models.tensor_parallel import default_backend, free_address, init_group, shard_model

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


def build_drafter(spec: DrafterSpec, model: PreTrainedModel | EagleDraft | None, target_vocab_size: int,
                  device: torch.device, assist_costs: StepCosts | None = None, suffix_index: SuffixIndex | None = None) -> Drafter:
    """The drafter `spec` describes, on this actor's `model` (None: model-free). `assist_costs`: the
    draft model's step costs for the assist k (profile_assist_costs), under assist_adaptive;
    `suffix_index`: the finished rows a suffix drafter shares with the actor's others."""
    if model is None:
        if spec.model_free == "suffix":
            return SuffixDrafter(target_vocab_size, suffix_index, spec.suffix, device)
        return NgramDrafter(target_vocab_size, device, spec.min_ngram, spec.max_ngram)
    if isinstance(model, EagleDraft):
        if spec.draft_assist != "none":
            raise ValueError("draft assist takes a draft model, not an EAGLE feature draft")
        if spec.cuda_graphs or spec.compile:
            raise ValueError("cuda_graphs and compile take a draft model's forwards, not an EAGLE feature draft's")
        return FeatureDrafter(model, target_vocab_size, runner=spec.runner)
    if spec.draft_assist == "ngram":
        adaptive = AdaptiveConfig(assist_costs) if spec.assist_adaptive and assist_costs is not None else None
        return DraftAssistDrafter(model, target_vocab_size, draft_top_m=spec.draft_top_m, runner=spec.runner,
                                  assist_k=spec.assist_k, assist_adaptive=adaptive,
                                  min_ngram=spec.min_ngram, max_ngram=spec.max_ngram)
    return DraftModelDrafter(model, target_vocab_size, draft_top_m=spec.draft_top_m, runner=spec.runner,
                             cuda_graphs=spec.cuda_graphs, compile=spec.compile)


@contextmanager
def borrowed_threads(lent: int):
    """This process's torch runs `lent` more threads inside the block. Exact either way: a thread
    count changes at most float32's last bits of a product (as a batch shape does), never the rule
    that turns the target's probabilities into tokens."""
    if lent <= 0:
        yield
        return
    own = torch.get_num_threads()
    torch.set_num_threads(own + lent)
    try:
        yield
    finally:
        torch.set_num_threads(own)


class _Sides:
    """One side (DraftSide or TargetSide, or a colocated pair) per micro-batch, sharing the actor's model."""

    def __init__(self, make: Callable[[StepCall], object]):
        self.make = make
        self.states: dict[int, object] = {}

    def get(self, call: StepCall):
        if call.spec is not None:
            self.states[call.mb] = self.make(call)
        elif call.mb not in self.states:
            raise MicroBatchStateLost(f"no state for micro-batch {call.mb} in process {os.getpid()}")
        return self.states[call.mb]


class _Planner:
    """The actor's K controller: one per actor, pooling the evidence of every micro-batch it
    serves, rebuilt when a micro-batch starts with other adaptive settings."""

    def __init__(self):
        self.hook: StepHook | None = None

    def for_spec(self, spec: SpeculationConfig) -> StepHook:
        if self.hook is None or self.hook.spec.adaptive != spec.adaptive:
            controller = None if spec.adaptive is None else KController(spec.adaptive, spec.tree_budget,
                                                                         spec.num_speculative_tokens)
            self.hook = StepHook(spec, controller)
        else:
            self.hook.spec = spec
        return self.hook

    def state(self) -> dict:
        """The K controller's pooled evidence and the plans it chose ((k, tree budget) -> steps)."""
        c = self.hook.controller if self.hook is not None else None
        if c is None:
            return {"overlap_sum": 0.0, "num_tested_positions": 0, "chosen": {}}
        return {"overlap_sum": c.overlap_sum, "num_tested_positions": c.num_tested_positions, "chosen": dict(c.chosen)}


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


def assigned_gpu() -> tuple[str, str] | None:
    """(node id, GPU id) of the GPU Ray assigned this actor, or None: two actors on different GPUs
    can send tensors over NCCL; two sharing one (fractional num_gpus) cannot."""
    if assigned_device().type != "cuda":
        return None
    import ray

    context = ray.get_runtime_context()
    return context.get_node_id(), str(context.get_accelerator_ids()["GPU"][0])


def current_node() -> str | None:
    """The Ray node id of this process, or None outside Ray."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def on_device(proposal: Proposal, device: torch.device) -> Proposal:
    """A proposal received as device tensors, on this actor's device (a no-op once NCCL put it there)."""
    return Proposal(proposal.draft_token_ids.to(device), proposal.num_draft_tokens.to(device),
                    proposal.draft_probs.to(device), proposal.num_draft_host, proposal.one_hot)


@dataclass(frozen=True)
class Proposed:
    """What the draft actor sends the target actor for one micro-batch step: the proposal as a
    host `WireProposal` (lossless sparse or dense numpy), or, over a GPU-to-GPU channel, the
    drafter's own `Proposal` of device tensors."""

    plan: Plan
    wire: WireProposal | Proposal
    busy_s: float  # inside the draft actor's call (applying the last verdict, admitting, proposing)
    # Plain decoding (plan.k == 0) for up to this many steps in the target's one call, ending after
    # the first that retires a row: the draft's controller plans nothing else meanwhile (StepHook.plain_run).
    steps: int = 1
    # The draft actor's CPU threads the target may use for this call besides its own (StepCall.
    # lend_threads): the draft actor sleeps until the target rings `doorbell` at the call's end.
    lent_threads: int = 0
    doorbell: str | None = None
    # With StepCall.capture, the verify widths the target captures (CapturePlan.verify_widths: the
    # drafter's kind decides them, and the draft actor holds the drafter).
    verify_widths: tuple[int, ...] | None = None


def _ask_target_vocab_size(name: str) -> int:
    """The named target actor's vocabulary size, waited for as long as Ray says the target is alive
    or restarting, however slowly it loads: a draft restarted at the moment its target is
    restarting too must not fail its constructor (Ray never restarts an actor whose constructor
    raised)."""
    import ray

    from raysd.actors.liveness import TARGET_NAME_WAIT_S, answer

    deadline = time.monotonic() + TARGET_NAME_WAIT_S
    while True:
        try:
            target = ray.get_actor(name)
        except ValueError:  # no live actor by that name
            if time.monotonic() > deadline:
                raise RuntimeError(f"the target actor {name!r} is gone (no live actor by that name)") from None
            time.sleep(0.5)
            continue
        return answer(target.get_vocab_size.remote, target, "target")


def load_draft(spec: DrafterSpec, device: torch.device):
    """A drafter spec's model on `device` (None for a model-free drafter), and its own step costs for
    draft assist's assist k (`profile_assist_costs`, under assist_adaptive) or None."""
    model = spec.model_factory().to(device).eval() if spec.model_factory else None
    assist_costs = None
    if spec.draft_assist != "none" and spec.assist_adaptive and model is not None and not isinstance(model, EagleDraft):
        with torch.inference_mode():
            assist_costs = profile_assist_costs(model, spec.assist_k, spec.assist_batch_sizes)
    return model, assist_costs


def drafter_info(spec: DrafterSpec, model, vocab_size: int, device: torch.device, lends_threads: bool = False) -> ActorInfo:
    """What a drafter says of itself, wherever it runs (its own actor, or beside the target)."""
    feature = isinstance(model, EagleDraft)
    if model is None:
        limit = 2**31 - 1
    else:
        limit = model.config.max_position_embeddings if feature else max_model_len(model)
    # a draft model or an EAGLE draft (its config is its target's family) on the static runner, or a model-free drafter
    trees = model is None or (spec.runner != "dynamic" and supports_static(model) and spec.draft_assist == "none")
    return ActorInfo(os.getpid(), str(device), vocab_size, limit, feature, trees, assigned_gpu(), model_dtype(model),
                     current_node(), lends_threads=lends_threads)


def time_drafter(spec: DrafterSpec, model, batch_sizes: Sequence[int], context: int, reps: int) -> list[float]:
    """Seconds of one draft forward per batch size (0 for a model-free drafter)."""
    if model is None:
        return [0.0 for _ in batch_sizes]
    if isinstance(model, EagleDraft):  # a feature draft runs on the dynamic runner (FeatureDrafter)
        model, runner = EagleCausalLM(model, zero_features=True), "dynamic"
    else:
        runner = spec.runner
    return [time_forward(model, B, [0], context, reps, runner)[0] for B in batch_sizes]


class DraftWorker:
    """The draft half of a split replica's step. `target_vocab_size`: an int, or the name of the
    (named) target actor, which the draft asks once its own model has loaded (so both load in
    parallel), and asks again after a restart.
    A name travels inline with the constructor call; an ObjectRef or an actor handle would make
    Ray keep the argument in the object store, where it cannot guarantee it for a restart
    (ray-project/ray#53727). The K controller lives here: the plan is chosen where the drafts are
    drawn, from the evidence of every verdict the actor has applied."""

    def __init__(self, spec: DrafterSpec, target_vocab_size, measure_bytes: bool = True):
        exit_when_orphaned()
        self.spec, self.measure_bytes = spec, measure_bytes
        self.device = assigned_device()
        if spec.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs replays CUDA graphs: the draft actor runs on {self.device}, not a GPU")
        self.model, self.assist_costs = load_draft(spec, self.device)
        if isinstance(target_vocab_size, str):  # the target actor's name
            target_vocab_size = _ask_target_vocab_size(target_vocab_size)
        self.target_vocab_size = target_vocab_size
        self.suffix_index = SuffixIndex(spec.suffix.max_cached_sequences, spec.suffix.max_cached_tokens)
        self.sides = _Sides(lambda call: DraftSide(build_drafter(spec, self.model, target_vocab_size, self.device,
                                                                   self.assist_costs, self.suffix_index), call.spec, self.device))
        self.planner = _Planner()
        self.transfer = TransferStats()  # the proposals this actor sent, since the last `transfer_stats`
        self.draft_s: dict[int, tuple[float, float]] = {}  # per micro-batch: its last proposal's (draft, prefill) seconds
        self.plain_runs: dict[int, PlainRun] = {}  # per micro-batch: the plain run its last proposal asked for
        # Where the target wakes this actor after a call it lent its threads to (`rest`): CPUs only.
        self.doorbell = Doorbell() if Doorbell.available() and self.device.type == "cpu" else None
        self.rest_timeout_s = 0.0
        self.ringer = Ringer()  # wakes the target when a proposal is ready (StepCall.proposal_doorbell)

    def time_steps(self, batch_sizes: Sequence[int], context: int, reps: int) -> list[float]:
        """Seconds of one draft forward per batch size (0 for a model-free drafter)."""
        return time_drafter(self.spec, self.model, batch_sizes, context, reps)

    def info(self) -> ActorInfo:
        return drafter_info(self.spec, self.model, self.target_vocab_size, self.device, self.doorbell is not None)

    def controller_state(self) -> dict:
        """The K controller's pooled evidence and choices (_Planner.state)."""
        return self.planner.state()

    def draft_sources(self) -> dict[str, int]:
        """A suffix drafter's drafts by source, over the rows that finished here (SuffixIndex)."""
        return self.suffix_index.provenance() if self.spec.model_free == "suffix" else {}

    def transfer_stats(self) -> TransferStats:
        """The bytes of the proposals sent since the last call (then counted afresh)."""
        stats, self.transfer = self.transfer, TransferStats()
        return stats

    @torch.inference_mode()
    def propose(self, call: StepCall) -> Proposed:
        """The micro-batch's last step settled on this side (its verdict), its new rows admitted,
        then the draft half of its next step (raysd.engine.step: the engine's own code)."""
        start = time.perf_counter()
        side: DraftSide = self.sides.get(call)
        hook = self.planner.for_spec(side.spec)
        run = self.plain_runs.pop(call.mb, None)
        if run is not None and call.last_steps:
            hook.end_plain_run(run, call.last_steps)
        if call.verdict is not None:
            draft_s, prefill_s = self.draft_s.get(call.mb, (0.0, 0.0))
            settle(side, hook, call.verdict, draft_s, call.verify_s, prefill_s)
        if call.new_rows:
            side.add(call.new_rows)
        verify_widths = None
        if call.capture is not None:  # a fresh micro-batch: its programs now, not at a step
            capture, _ = capture_draft_ahead(side, side.spec, hook.controller, *call.capture)
            verify_widths = capture.verify_widths
        plan = hook.plan(side)
        steps, lent = 1, 0
        if plan.k == 0 and not plan.tree_budget and not side.drafter.needs_features:  # features: every step's
            run = hook.plain_run(side, call.max_steps)
            steps = run.steps
            if steps > 1:
                self.plain_runs[call.mb] = run
        if call.lend_threads and self.doorbell is not None:  # idle until the target's call ends: lend
            lent = torch.get_num_threads()
            self.doorbell.clear()
            # The call's expected time from the last call's (then spin as before: Doorbell.timeout_s).
            per_step = call.verify_s / call.last_steps if call.last_steps else 0.0
            self.rest_timeout_s = Doorbell.timeout_s(steps * per_step)
        doorbell = self.doorbell.address if lent else None
        _, proposal, draft_s, prefill_s = draft_half(side, hook, plan)  # the plan chose whether to lend
        self.draft_s[call.mb] = (draft_s, prefill_s)
        if call.device_proposal:  # device tensors, GPU to GPU over the step graph's NCCL channel
            return Proposed(plan, proposal, time.perf_counter() - start, steps, lent, doorbell, verify_widths)
        wire = encode_proposal(proposal, self.spec.probs_encoding)
        if self.measure_bytes:
            t = self.transfer
            t.steps, t.proposal = t.steps + 1, t.proposal + pickled_nbytes(wire)
            t.dense_equivalent += proposal.draft_probs.numel() * 4
            t.sparse_steps += wire.encoding != "dense"
        if call.proposal_doorbell is not None:  # the target sleeps until now (TargetActor.await_proposal)
            self.ringer.ring(call.proposal_doorbell, call.ticket)
        return Proposed(plan, wire, time.perf_counter() - start, steps, lent, doorbell, verify_widths)

    def rest(self, proposed: Proposed) -> None:
        """After `propose`, in the same step graph: through a target call this actor lent its threads
        to, sleep until the target rings (raysd.actors.turns), rather than spin in the channel read."""
        if proposed.lent_threads:
            self.doorbell.wait(self.rest_timeout_s)


class TargetWorker:
    """The target model, and per micro-batch its TargetSide (the rows' state beside the target's
    KV cache). `drafter`: in a colocated replica, the drafter to run here (a draft model, an EAGLE
    draft or a model-free one), one DraftSide per micro-batch beside its TargetSide, with this
    worker's own K controller; None in a split replica, whose draft worker proposes.

    `tensor_parallel`: this actor is one rank of a tensor-parallel target (raysd.models.
    tensor_parallel): it keeps its 1/N of the weights, sharded before it moves to its device and
    before any runner packs them. The ranks then join one torch.distributed group (`group_address`
    on rank 0, `join_group` on all at once) before their first forward. Every rank runs every
    call with the same arguments (the same rows, the same proposal, the same colocated drafter
    on the same tokens, the same draws), so they keep the same tokens without exchanging them.

    `cuda_graphs`: the target's decode and verify forwards replayed as CUDA graphs (TargetSide; a GPU only);
    `compile`: those forwards through torch.compile (TargetSide); `crossover`: measure the device's
    crossover for -k auto's learned costs (ActorInfo.crossover_tokens)."""

    def __init__(self, model_factory: ModelFactory, runner: str = "auto", drafter: DrafterSpec | None = None,
                 tokenizer_factory: Callable[[], object] | None = None, tensor_parallel: TensorParallel = TensorParallel(),
                 cuda_graphs: bool = False, compile: bool = False, crossover: bool = False):
        exit_when_orphaned()
        self.device = assigned_device()
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs replays CUDA graphs: the target actor runs on {self.device}, not a GPU")
        if drafter is not None and drafter.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs replays CUDA graphs: the draft model runs on {self.device}, not a GPU")
        self.tensor_parallel = tensor_parallel
        model = model_factory()
        # Shard where the factory loaded it (the host, for a model loaded on the CPU): the device then
        # receives 1/N of the weights only.
        self.model = shard_model(model, tensor_parallel.rank, tensor_parallel.world_size).to(self.device).eval()
        self.runner = runner
        self.vocab_size = output_vocab_size(self.model)
        # Where a forward turns compute-bound on this GPU (None on a CPU), for -k auto's learned costs:
        # measured once, by the rank that reports, and sent to every planner in the steps' spec. Its
        # buffers go back to the device before the caches are made.
        self.crossover_tokens = None
        if crossover and tensor_parallel.rank == 0 and self.device.type == "cuda":
            self.crossover_tokens = crossover_tokens(self.model)
            torch.cuda.empty_cache()
        self.colocated = drafter is not None
        self.drafter_spec = drafter
        # A colocated draft model lives here, on the target's device, beside the target's weights.
        self.draft_model, assist_costs = load_draft(drafter, self.device) if drafter is not None else (None, None)
        # The target's tokenizer, for stop strings (decoded where the rows' state lives).
        tokenizer = None if tokenizer_factory is None else tokenizer_factory()  # None: the target has none
        decode = None if tokenizer is None else decoder(tokenizer)

        self.ringer = Ringer()  # wakes a draft actor that lent this actor its threads for a call
        # Where a lending draft actor wakes this one when its proposal is ready (`await_proposal`): CPUs only.
        self.doorbell = Doorbell() if Doorbell.available() and self.device.type == "cpu" else None
        self.draft_s = 1.0  # the last proposal's seconds (Proposed.busy_s): how long `await_proposal` sleeps at most
        self.suffix_index = None if drafter is None else SuffixIndex(drafter.suffix.max_cached_sequences,
                                                                      drafter.suffix.max_cached_tokens)

        def make(call: StepCall):
            target = TargetSide(self.model, call.spec, runner, features=call.feature_draft, decode=decode,
                                cuda_graphs=cuda_graphs, compile=compile)
            if drafter is None:
                return target
            built = build_drafter(drafter, self.draft_model, self.vocab_size, self.device, assist_costs, self.suffix_index)
            return DraftSide(built, call.spec, self.device), target

        self.sides = _Sides(make)
        self.planner = _Planner()
        self._beams = None  # (the beam job's settings, its BeamSearchEngine), made by the first `beam_search`

    def group_address(self) -> tuple[str, int]:
        """Where the tensor-parallel group meets (rank 0's node address and a port free there now)."""
        import ray

        return free_address(ray.util.get_node_ip_address())

    def join_group(self, address: str, port: int, timeout_s: float) -> None:
        """Join the tensor-parallel group at tcp://address:port; returns once every rank has joined
        (all ranks are called at once). NCCL between GPUs, gloo on the CPU. `timeout_s` bounds the
        join and every collective (CoordinatorConfig.group_timeout_s)."""
        tp = self.tensor_parallel
        init_group(tp.rank, tp.world_size, address, port, default_backend(self.device), timeout_s)

    def time_steps(self, batch_sizes: Sequence[int], k_max: int, context: int, reps: int) -> list[list[float]]:
        """[len(batch_sizes)][k_max + 1] seconds of one target forward of K + 1 tokens per row.
        A tensor-parallel target's ranks are all asked at once: each forward's collectives need every rank."""
        return [time_forward_upto(self.model, B, k_max, context, reps, self.runner) for B in batch_sizes]

    def info(self) -> ActorInfo:
        trees = self.runner != "dynamic" and supports_static(self.model)
        colocated = None if self.drafter_spec is None else drafter_info(self.drafter_spec, self.draft_model, self.vocab_size,
                                                                        self.device)
        return ActorInfo(os.getpid(), str(self.device), self.vocab_size, max_model_len(self.model), supports_trees=trees,
                         gpu=assigned_gpu(), dtype=model_dtype(self.model), node=current_node(),
                         tensor_parallel=self.tensor_parallel, eos_token_ids=eos_token_ids(self.model),
                         doorbell=None if self.doorbell is None else self.doorbell.address, drafter=colocated,
                         crossover_tokens=self.crossover_tokens)

    def beam_search(self, requests: Sequence, spec: BeamSpec, eos_token_ids: tuple[int, ...]) -> list[list]:
        """A beam job's requests: each one's best `num_return_sequences` hypotheses, best first (raysd.
        engine.beam.BeamSearchEngine on this worker's target and, colocated, its drafter: a draft
        model's own beam search, or lookup trees). The engine is made at the first call, kept after."""
        from raysd.core.beam import BeamConfig
        from raysd.engine.beam import BeamEngineConfig, BeamSearchEngine
        from raysd.engine.beam_drafters import DraftBeamSearch, LookupBeams

        key = (spec, eos_token_ids)
        if self._beams is None or self._beams[0] != key:
            if spec.drafter == "model":
                drafter = DraftBeamSearch(self.draft_model, self.vocab_size, eos_token_ids=eos_token_ids)
            elif spec.drafter in ("ngram", "suffix"):
                model_free = DrafterSpec(None, model_free=spec.drafter, suffix=self.drafter_spec.suffix)
                drafter = LookupBeams(build_drafter(model_free, None, self.vocab_size, self.device,
                                                    suffix_index=self.suffix_index), spec.lookup_budget, spec.k)
            else:
                drafter = None
            config = BeamEngineConfig(BeamConfig(spec.num_beams, spec.length_penalty, spec.early_stopping,
                                                 spec.num_return_sequences), spec.k, spec.max_batch_size, eos_token_ids,
                                      spec.max_model_len)
            self._beams = (key, BeamSearchEngine(self.model, drafter, config))
        with torch.inference_mode():
            return self._beams[1].generate(requests)

    def time_drafter(self, batch_sizes: Sequence[int], context: int, reps: int) -> list[float]:
        """A colocated drafter's seconds of one draft forward per batch size (DraftWorker.time_steps)."""
        return time_drafter(self.drafter_spec, self.draft_model, batch_sizes, context, reps)

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def controller_state(self) -> dict:
        """A colocated drafter's K controller's pooled evidence and choices (_Planner.state)."""
        return self.planner.state()

    def draft_sources(self) -> dict[str, int]:
        """A colocated suffix drafter's drafts by source, over the rows that finished here (SuffixIndex)."""
        return self.suffix_index.provenance() if self.suffix_index is not None else {}

    def await_proposal(self, call: StepCall) -> StepCall:
        """Before `step`, in the same step graph: through a call the draft actor lends its threads to
        (one micro-batch: this actor has nothing else to do), sleep until the draft rings that its
        proposal is ready, rather than spin in the channel read (Ray 2.60: sched_yield) beside the
        drafting, which that spin slows where the two share the cores (raysd.actors.turns). A ring
        that never comes (the draft actor lost) ends the sleep after a few proposals' time, and the
        channel read then reports the loss. Returns `call` unchanged."""
        if call.proposal_doorbell is not None and self.doorbell is not None:
            self.doorbell.wait_for(call.ticket, Doorbell.timeout_s(self.draft_s))
        return call

    def step(self, call: StepCall, proposed: Proposed | None = None) -> tuple[Verdict, StepTimings]:
        """`_step`; on a tensor-parallel rank a failed collective (a peer died) is TensorParallelGroupBroken.
        However the call ends, rank 0 then rings the coordinator's doorbell with its ticket."""
        try:
            _slow_step_for_tests()
            if self.tensor_parallel.world_size == 1:
                return self._step(call, proposed)
            try:
                return self._step(call, proposed)
            except (MicroBatchStateLost, AssertionError):
                raise
            except RuntimeError as exc:  # gloo: "Connection reset by peer"; NCCL: its watchdog's timeout
                raise TensorParallelGroupBroken(f"rank {self.tensor_parallel.rank}: {type(exc).__name__}: {exc}") from exc
        finally:
            if call.caller_doorbell is not None and self.tensor_parallel.rank == 0:
                self.ringer.ring(call.caller_doorbell, call.ticket)

    @torch.inference_mode()
    def _step(self, call: StepCall, proposed: Proposed | None = None) -> tuple[Verdict, StepTimings]:
        """Admit the call's new rows and run the step on the draft actor's proposal: verify, accept,
        roll back, retire. The verdict (its features on the host, for a feature draft) goes back to
        the coordinator, which forwards it to the draft actor with the micro-batch's next call.

        With a colocated drafter (`proposed` None), one call runs up to `call.max_steps` steps and
        returns after the first that retires a row: until a row finishes no slot frees, so the
        coordinator has nothing to admit, and one call saves the others' round trips. Only the last
        step can retire rows, so its verdict is the call's; the timings count every step.
        A draft actor's plain decoding (`proposed.steps` > 1) runs likewise: its empty proposal
        stands for each step, and the steps' verdicts go back as one (`merge_plain`) for the draft."""
        start = time.perf_counter()
        if not self.colocated:
            assert proposed is not None and proposed.steps <= call.max_steps, "a draft actor proposes each step"
            target: TargetSide = self.sides.get(call)
            if call.new_rows:
                target.add(call.new_rows)
            hook = ReceivedPlan(target.spec, proposed.plan)
            if call.capture is not None:  # a fresh micro-batch: the verifies the draft actor's plan names
                rows, max_length = call.capture
                hook.timings.add_counts(capture_target_ahead(target, CapturePlan(rows, max_length, proposed.verify_widths,
                                                                                 (), False)))
            wire = proposed.wire
            proposal = decode_proposal(wire, self.device) if isinstance(wire, WireProposal) else on_device(wire, self.device)
            with borrowed_threads(proposed.lent_threads):
                verdicts = [speculative_step(ReceivedProposal(proposal), target, hook)]
                while len(verdicts) < proposed.steps and verdicts[-1].keep is None and not verdicts[-1].finished:
                    verdicts.append(speculative_step(ReceivedProposal(proposal), target, hook))
            if proposed.doorbell is not None:
                self.ringer.ring(proposed.doorbell)  # the draft actor's threads are its own again
            hook.timings.borrowed_steps = hook.timings.steps if proposed.lent_threads else 0
            verdict = merge_plain(verdicts)
            if verdict.features is not None:  # to the host in one copy: they travel to the draft actor
                sizes = [len(f) for f in verdict.features]
                host = tuple(torch.cat(verdict.features).cpu().split(sizes)) if sizes else ()
                verdict = dataclasses.replace(verdict, features=host)
            timings = hook.timings
            timings.draft_s = self.draft_s = proposed.busy_s  # the draft actor's seconds for this step, reported with it
        else:
            draft, target = self.sides.get(call)
            hook = self.planner.for_spec(target.spec)
            if call.new_rows:
                draft.add(call.new_rows)
                target.add(call.new_rows)
            before = dataclasses.replace(hook.timings)
            if call.capture is not None:  # a fresh micro-batch: its programs now, not at a step
                for counts in capture_ahead(draft, target, target.spec, hook.controller, *call.capture):
                    hook.timings.add_counts(counts)
            for _ in range(call.max_steps):
                verdict = speculative_step(draft, target, hook)
                if verdict.finished:
                    break
            timings = _minus(hook.timings, before)
            verdict = dataclasses.replace(verdict, features=None)  # a feature draft here read them already
        timings.wall_s = time.perf_counter() - start
        return verdict, timings


# A test hook: "CALLS:SECONDS" makes a target actor's first CALLS step calls each sleep SECONDS
# before stepping (tests/reliability/test_busy_machine.py: a step slower than any read deadline).
SLOW_STEPS_ENV = "RAYSD_TEST_SLOW_STEPS"
_slow_calls_done = 0


def _slow_step_for_tests() -> None:
    global _slow_calls_done
    value = os.environ.get(SLOW_STEPS_ENV)
    if not value:
        return
    calls, seconds = value.split(":")
    if _slow_calls_done < int(calls):
        _slow_calls_done += 1
        time.sleep(float(seconds))


def _minus(a: StepTimings, b: StepTimings) -> StepTimings:
    return StepTimings(**{f.name: getattr(a, f.name) - getattr(b, f.name) for f in dataclasses.fields(StepTimings)})
