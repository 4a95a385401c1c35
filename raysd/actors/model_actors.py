"""The two halves of a speculative step, each in its own (Ray actor) process.

DraftActor holds the draft model (or none, for n-gram lookup) and one engine
Drafter per micro-batch; TargetActor holds the target model and one engine
TargetVerifier per micro-batch. The per-micro-batch objects share the model
weights and differ only in their KV caches. Both classes are plain Python: the
coordinator makes them Ray actors with `ray.remote(...)`, and tests may call them
in process.

Every step call carries a MicroBatchUpdate (what happened to the micro-batch's
rows since its last step), so one call per actor per step is enough.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from raysd.core.sampling import SamplingParams, SamplingTensors
from raysd.engine.drafters import DraftModelDrafter, Drafter, NgramDrafter
from raysd.engine.verifier import TargetVerifier
from raysd.models.loading import max_model_len
from raysd.models.runners import check_runner_kind
from raysd.models.profile import time_forward
from raysd.actors.transport import ENCODINGS, ProbsEncoding, WireProposal, decode_proposal, encode_proposal, pickled_nbytes

ModelFactory = Callable[[], PreTrainedModel]  # picklable, e.g. functools.partial(load_model, spec)


class MicroBatchStateLost(RuntimeError):
    """The actor has no state for a micro-batch it was asked to step: it was restarted."""


@dataclass(frozen=True)
class DrafterSpec:
    """How the draft actor builds its drafter; picklable."""

    model_factory: ModelFactory | None = None  # None: n-gram prompt lookup, no model
    draft_top_m: int = 0  # > 0: the draft samples from its top-m tokens only (exact; see DraftModelDrafter)
    min_ngram: int = 1
    max_ngram: int = 3
    probs_encoding: ProbsEncoding = "auto"  # "auto": lossless sparse whenever smaller than dense
    runner: str = "auto"  # the draft model's KV cache (raysd.models.runners)

    def __post_init__(self) -> None:
        check_runner_kind(self.runner)
        if self.draft_top_m < 0:
            raise ValueError(f"draft_top_m must be >= 0 (0 disables), got {self.draft_top_m}")
        if self.draft_top_m and self.model_factory is None:
            raise ValueError("draft_top_m needs a draft model")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.probs_encoding not in ENCODINGS:
            raise ValueError(f"probs_encoding must be one of {ENCODINGS}, got {self.probs_encoding!r}")

    def build(self, model: PreTrainedModel | None, target_vocab_size: int, device: torch.device) -> Drafter:
        if model is None:
            return NgramDrafter(target_vocab_size, device, self.min_ngram, self.max_ngram)
        return DraftModelDrafter(model, target_vocab_size, draft_top_m=self.draft_top_m, runner=self.runner)


@dataclass(frozen=True)
class MicroBatchUpdate:
    """What happened to a micro-batch's rows since its last step, applied before the next:
    commit `kept` (one list per row of the last step, with the drafts each row `accepted`,
    so the caches roll back without reading the drafts back), keep rows `keep` (None: all),
    then append `new_rows`. `reset` starts from an empty micro-batch instead."""

    reset: bool
    kept: tuple[tuple[int, ...], ...] = ()
    accepted: tuple[int, ...] | None = None
    keep: tuple[int, ...] | None = None
    new_rows: tuple[tuple[tuple[int, ...], SamplingParams], ...] = ()  # (prompt, params)

    def __post_init__(self) -> None:
        if self.reset and (self.kept or self.keep is not None):
            raise ValueError("a reset update carries no commit or selection")


@dataclass
class _MicroBatch:
    side: Drafter | TargetVerifier
    params: list[SamplingParams] = field(default_factory=list)


class _MicroBatchStore:
    def __init__(self, make: Callable[[], Drafter | TargetVerifier]):
        self.make = make
        self.states: dict[int, _MicroBatch] = {}

    def apply(self, mb: int, update: MicroBatchUpdate) -> _MicroBatch:
        if update.reset:
            self.states[mb] = _MicroBatch(self.make())
        elif mb not in self.states:
            raise MicroBatchStateLost(f"no state for micro-batch {mb} in process {os.getpid()}")
        state = self.states[mb]
        if update.kept:
            state.side.commit([list(k) for k in update.kept], update.accepted)
        if update.keep is not None:
            state.side.select(list(update.keep))
            state.params = [state.params[i] for i in update.keep]
        if update.new_rows:
            state.side.add_rows([list(p) for p, _ in update.new_rows])
            state.params.extend(params for _, params in update.new_rows)
        return state


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


@dataclass(frozen=True)
class DraftMeta:
    busy_s: float  # time spent inside propose
    proposal_nbytes: int  # pickled size of the WireProposal sent to the target (0 if not measured)
    dense_nbytes: int  # what a dense draft_probs would have cost
    encoding: str


@dataclass(frozen=True)
class VerifyResult:
    tokens: list[list[int]]  # ragged emitted tokens per row
    drafted: list[int]  # drafts verified per row
    accepted: list[int]
    overlaps: list[list[float]]  # overlap at each tested position
    busy_s: float  # time spent inside verify


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
            import ray

            target_vocab_size = ray.get(ray.get_actor(target_vocab_size).get_vocab_size.remote())
        self.target_vocab_size = target_vocab_size
        self.store = _MicroBatchStore(lambda: spec.build(self.model, target_vocab_size, self.device))

    def time_steps(self, batch_sizes: Sequence[int], context: int, reps: int) -> list[float]:
        """Seconds of one draft forward per batch size (0 for a model-free drafter)."""
        if self.model is None:
            return [0.0 for _ in batch_sizes]
        return [time_forward(self.model, B, [0], context, reps)[0] for B in batch_sizes]

    def info(self) -> ActorInfo:
        limit = max_model_len(self.model) if self.model is not None else 2**31 - 1
        return ActorInfo(os.getpid(), str(self.device), self.target_vocab_size, limit)

    def propose(
        self,
        mb: int,
        update: MicroBatchUpdate,
        max_drafts: Sequence[int],
        uniforms: np.ndarray,  # [B, K] float32 drafting draws, from each row's generator
    ) -> tuple[WireProposal, DraftMeta]:
        start = time.perf_counter()
        state = self.store.apply(mb, update)
        sampling = SamplingTensors.from_params(state.params, self.device)
        proposal = state.side.propose(list(max_drafts), sampling, torch.tensor(uniforms, device=self.device))
        wire = encode_proposal(proposal, self.spec.probs_encoding)
        busy = time.perf_counter() - start
        B, K, V = proposal.draft_probs.shape
        nbytes = pickled_nbytes(wire) if self.measure_bytes else 0
        return wire, DraftMeta(busy, nbytes, B * K * V * 4, wire.encoding)


class TargetActor:
    def __init__(self, model_factory: ModelFactory, runner: str = "auto"):
        self.device = assigned_device()
        self.model = model_factory().to(self.device).eval()
        self.store = _MicroBatchStore(lambda: TargetVerifier(self.model, runner))
        self.vocab_size = TargetVerifier(self.model).vocab_size

    def time_steps(self, batch_sizes: Sequence[int], k_max: int, context: int, reps: int) -> list[list[float]]:
        """[len(batch_sizes)][k_max + 1] seconds of one target forward of K + 1 tokens per row."""
        out = []
        for B in batch_sizes:
            times = time_forward(self.model, B, range(k_max + 1), context, reps)
            out.append([times[k] for k in range(k_max + 1)])
        return out

    def info(self) -> ActorInfo:
        return ActorInfo(os.getpid(), str(self.device), self.vocab_size, max_model_len(self.model))

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def verify(
        self,
        mb: int,
        update: MicroBatchUpdate,
        wire: WireProposal,
        uniforms: np.ndarray,  # [B, K + 1] float32: K acceptance draws, then the final-token draw
    ) -> VerifyResult:
        start = time.perf_counter()
        state = self.store.apply(mb, update)
        sampling = SamplingTensors.from_params(state.params, self.device)
        proposal = decode_proposal(wire, self.device)
        u = torch.tensor(uniforms, device=self.device)  # [B, K + 1]
        Kp = proposal.draft_token_ids.shape[1]
        out = state.side.verify(proposal, sampling, u[:, :Kp], u[:, -1])
        tokens, _, accepted, overlaps = out.per_row()
        drafted = proposal.num_draft_tokens.tolist()
        return VerifyResult(tokens, drafted, accepted, overlaps, time.perf_counter() - start)
