"""What crosses between a replica's coordinator and its model actors, as plain records: how an
actor builds its drafter (`DrafterSpec`), each step's call (`StepCall`), what an actor says of
itself (`ActorInfo`), the failures the coordinator recovers from, and the bytes it all takes.

Nothing here imports torch: the coordinator (raysd.actors.coordinator) only makes, sends and reads
these, so a job's replica, which runs it, imports no torch or transformers for it. The model
actors' workers build from them (raysd.actors.model_actors). Proposals travel between the actors
as raysd.actors.proposals encodes them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from raysd.actors.settings import REPLICA_SHAPES, replica_shape
from raysd.core.speculation import SpeculationConfig, SuffixConfig
from raysd.engine.requests import Request
from raysd.engine.verdict import Verdict
from raysd.models.names import TensorParallel, check_draft_assist, check_runner_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ProbsEncoding = Literal["auto", "dense", "sparse"]  # how a proposal's draft_probs travel (raysd.actors.proposals)
ENCODINGS = ("auto", "dense", "sparse")

ModelFactory = Callable[[], "PreTrainedModel"]  # picklable, e.g. functools.partial(load_model, spec)
MODEL_FREE_DRAFTERS = ("ngram", "suffix")


class MicroBatchStateLost(RuntimeError):
    """The actor has no state for a micro-batch it was asked to step: it was restarted."""


class StepTimedOut(RuntimeError):
    """A step outlasted the step timeout the user set (CoordinatorConfig.step_timeout_s) while its
    actors were alive: not an actor failure, so not recovered from."""


class ReplicaGaveUp(RuntimeError):
    """A replica's actors failed more times in a row than its recoveries allow; the message names
    the last failure."""


class TensorParallelGroupBroken(RuntimeError):
    """A collective of a tensor-parallel target failed (a peer rank died): the group is gone, and
    every rank must be started afresh in a new one."""


@dataclass(frozen=True)
class DrafterSpec:
    """How an actor builds its drafter (raysd.actors.model_actors.build_drafter); picklable."""

    model_factory: ModelFactory | None = None  # None: a model-free drafter (`model_free`); an EagleDraft: a feature draft
    model_free: str = "ngram"  # without a model: "ngram" (prompt lookup) or "suffix" (raysd.engine.suffix)
    suffix: SuffixConfig = SuffixConfig()  # the suffix drafter's settings (its index is shared by the actor's micro-batches)
    draft_top_m: int = 0  # > 0: the draft samples from its top-m tokens only (exact; see DraftModelDrafter)
    min_ngram: int = 1
    max_ngram: int = 3
    probs_encoding: ProbsEncoding = "auto"  # "auto": lossless sparse whenever smaller than dense
    runner: str = "auto"  # the draft model's KV cache (raysd.models.runner)
    # A draft model's one-token forwards replayed as CUDA graphs (DraftModelDrafter; static runner, CUDA).
    cuda_graphs: bool = False
    compile: bool = False  # a draft model's small forwards through torch.compile (DraftModelDrafter)
    # Draft assist (raysd.engine.draft_assist): "ngram" lets n-gram lookup draft for the draft model,
    # at most `assist_k` per draft-model step, chosen by goodput on the draft model's step costs
    # profiled in the actor at `assist_batch_sizes` (`assist_adaptive`), else always assist_k.
    draft_assist: str = "none"
    assist_k: int = 4
    assist_adaptive: bool = True
    assist_batch_sizes: tuple[int, ...] = (1, 16)
    # Where it runs (raysd.actors.settings.REPLICA_SHAPES): "auto" decides by where the models live
    # (`replica_shape`); "split" keeps even a model-free drafter in an actor of its own, for studies.
    shape: str = "auto"

    def __post_init__(self) -> None:
        check_runner_kind(self.runner)
        check_draft_assist(self.draft_assist)
        if self.model_free not in MODEL_FREE_DRAFTERS:
            raise ValueError(f"model_free must be one of {MODEL_FREE_DRAFTERS}, got {self.model_free!r}")
        if self.draft_assist != "none" and self.model_factory is None:
            raise ValueError(f"draft assist {self.draft_assist!r} needs a draft model")
        if not 0 <= self.assist_k <= 64:
            raise ValueError(f"assist_k must be in 0..64, got {self.assist_k}")
        if self.draft_top_m < 0:
            raise ValueError(f"draft_top_m must be >= 0 (0 disables), got {self.draft_top_m}")
        if self.draft_top_m and self.model_factory is None:
            raise ValueError("draft_top_m needs a draft model")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if (self.cuda_graphs or self.compile) and (self.model_factory is None or self.runner == "dynamic"
                                                   or self.draft_assist != "none"):
            raise ValueError(f"{'cuda_graphs' if self.cuda_graphs else 'compile'} needs a draft model on the static runner "
                             "(runner 'auto' or 'static'), without draft assist")
        if self.probs_encoding not in ENCODINGS:
            raise ValueError(f"probs_encoding must be one of {ENCODINGS}, got {self.probs_encoding!r}")
        if self.shape not in REPLICA_SHAPES:
            raise ValueError(f"shape must be one of {REPLICA_SHAPES}, got {self.shape!r}")

    def shape_for(self, target_gpus: float, draft_gpus: float, tensor_parallel: int = 1) -> str:
        """"colocated" or "split", given each model actor's GPUs (raysd.actors.settings.replica_shape)."""
        return replica_shape(self.shape, self.model_factory is not None, target_gpus, draft_gpus, tensor_parallel)



@dataclass(frozen=True)
class BeamSpec:
    """A beam job's search (raysd.core.beam.BeamConfig's fields, as plain values: this module imports
    no torch) and its drafting: `drafter` "none", "ngram", "suffix" or "model" (the colocated draft
    model's own beam search), `k` the drafted trees' depth, `lookup_budget` a lookup tree's nodes."""

    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    drafter: str = "none"
    k: int = 4
    lookup_budget: int = 8
    max_batch_size: int = 8  # prompts searched together, num_beams target rows each
    max_model_len: int | None = None  # prompt + generated tokens per row; None: the models' context


@dataclass(frozen=True)
class StepCall:
    """What happened to a micro-batch's rows since its last step, applied before the next: the
    last step's verdict (the draft side applies it; the target applied it already) and the rows
    admitted since ((caller's index, request) pairs). `spec` (resolved: Admission.spec) starts the
    micro-batch afresh, with no rows; `feature_draft` then says whether the drafter reads the
    target's features (EAGLE)."""

    mb: int
    spec: SpeculationConfig | None = None
    verdict: Verdict | None = None
    new_rows: tuple[tuple[int, Request], ...] = ()
    feature_draft: bool = False
    max_steps: int = 1  # a colocated drafter's steps per call, or a draft actor's plain run at most (TargetActor.step)
    device_proposal: bool = False  # the draft returns its proposal's device tensors (a GPU-to-GPU channel)
    verify_s: float = 0.0  # with `verdict`: the target's seconds for that step (costs learned as the job runs)
    # The steps the micro-batch's last call ran, with its verdict or without (the micro-batch emptied
    # and starts afresh): a plain run's end (Proposed.steps). 0: none, or unknown after a recovery.
    last_steps: int = 0
    # The draft actor lends the target its CPU threads for the call (GraphTransport.lend_threads).
    lend_threads: bool = False
    # The coordinator's doorbell on the target's node, and this call's ticket: the target (rank 0)
    # rings it when the call ends, and the coordinator sleeps until then (raysd.actors.turns).
    caller_doorbell: str | None = None
    ticket: int = 0
    # The target actor's doorbell, through a call the draft actor lends its threads to: the draft
    # rings it (with `ticket`) once its proposal is ready, and the target sleeps until then
    # (`TargetActor.await_proposal`) rather than spin in the channel read beside the drafting.
    proposal_doorbell: str | None = None
    # With `spec`, in a replica replaying CUDA graphs under a job's max_model_len: (rows, tokens per
    # row) the micro-batch's steps are bounded by, so that every program they can replay is captured
    # before its first step (raysd.engine.graphs.capture_ahead; in a split replica each actor its
    # half). None: each is captured the first time a step needs it.
    capture: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.spec is not None and self.verdict is not None:
            raise ValueError("a fresh micro-batch has no verdict to apply")
        if self.capture is not None and self.spec is None:
            raise ValueError("programs are captured as a micro-batch starts (with its spec)")


@dataclass(frozen=True)
class ActorInfo:
    """What a model actor says of itself once its model has loaded (`info()`)."""

    pid: int
    device: str
    vocab_size: int
    max_model_len: int  # the actor's model's context (no limit for a model-free drafter)
    feature_draft: bool = False  # the draft reads the target's features (EAGLE)
    supports_trees: bool = False  # can draft or verify trees: n-gram lookup, or a model on the static runner
    gpu: tuple[str, str] | None = None  # (node id, Ray's GPU id) of the actor's GPU; None on the CPU
    dtype: str | None = None  # the dtype its model runs in ("auto" resolved); None without a model
    node: str | None = None  # the Ray node id of its process (None outside Ray)
    tensor_parallel: TensorParallel = TensorParallel()  # a target rank's place in its group
    eos_token_ids: tuple[int, ...] = ()  # the target's (generation config, else model config); () for a draft
    lends_threads: bool = False  # a draft actor that can lend its CPU threads to the target (raysd.actors.turns)
    doorbell: str | None = None  # a target actor's on the CPU, where a lending draft wakes it (StepCall.proposal_doorbell)
    drafter: "ActorInfo | None" = None  # a target actor's: the drafter it runs itself (a colocated replica)
    crossover_tokens: float | None = None  # a target actor's on a GPU: tokens per forward past which it is compute-bound


def pickled_nbytes(obj) -> int:
    """Bytes `obj` takes pickled with protocol 5, out-of-band buffers (numpy arrays)
    counted at their size without copying them."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(b.raw().nbytes for b in buffers)


@dataclass
class TransferStats:
    """Bytes crossing actor boundaries over a run, as pickled (see pickled_nbytes).

    proposal: draft actor -> target actor (through the object store, never the coordinator).
    dense_equivalent: what the proposals' draft_probs would have cost dense.
    draft_args / target_args: coordinator -> actor (row updates and K).
    results: target actor -> coordinator (ragged tokens and statistics).
    features: target actor -> draft actor, a feature draft's target features (tensor bytes;
        through the object store, never the coordinator).
    """

    steps: int = 0
    proposal: int = 0
    dense_equivalent: int = 0
    draft_args: int = 0
    target_args: int = 0
    results: int = 0
    features: int = 0
    sparse_steps: int = 0  # steps whose proposal travelled smaller than dense (its ids alone, or sparse)

    @property
    def total(self) -> int:
        return self.proposal + self.draft_args + self.target_args + self.results + self.features

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        fields = ("proposal", "dense_equivalent", "draft_args", "target_args", "results", "features", "total")
        return {name: getattr(self, name) / n for name in fields}
