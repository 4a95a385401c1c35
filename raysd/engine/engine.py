"""The single-process speculative decoding engine: continuous batching of `speculative_step`
over one target and one drafter. The Ray actors run the same step (raysd.actors)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from raysd.core.speculation import SpeculationConfig
from raysd.engine.adaptive import KController
from raysd.engine.draft_assist import DraftAssistDrafter
from raysd.engine.graphs import capture_ahead
from raysd.engine.drafters import Drafter
from raysd.engine.requests import Admission, GenerationResult, Request, warn_if_lossy
from raysd.engine.step import DraftSide, StepHook, speculative_step
from raysd.engine.target import TargetSide
from raysd.engine.verdict import StepTimings, Verdict
from raysd.models.linear import check_linear_kernels
from raysd.models.loading import max_model_len, output_vocab_size
from raysd.models.profile import crossover_tokens
from raysd.models.names import check_runner_kind

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class EngineConfig:
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    max_batch_size: int = 8  # rows decoded together; waiting requests take freed slots
    # The target's KV cache: "auto" = static slots for Llama-family models, the Hugging Face
    # dynamic cache otherwise (raysd.models.runner). A draft model's runner is its drafter's.
    runner: str = "auto"
    # The target's linear layers: "auto" = oneDNN-prepacked weights for a float32 model on a CPU
    # (a verify of K + 1 tokens then costs about one decode step; raysd.models.linear; one more
    # copy of the weights in memory), PyTorch's own otherwise; "packed" insists; "stock" never.
    linear_kernels: str = "auto"
    # The target's steps replayed as CUDA graphs, each captured before the first step
    # (raysd.models.cuda_graphs, raysd.engine.graphs; static runner on CUDA). None: on wherever the
    # target runs on a CUDA device with the static runner. A draft model's: DraftModelDrafter(cuda_graphs=).
    cuda_graphs: bool | None = None
    # The target's step forwards through torch.compile (static runner; with CUDA graphs, the graphs
    # capture Inductor's fused kernels). None: with the CUDA graphs. A draft model's: DraftModelDrafter(compile=).
    compile: bool | None = None

    def __post_init__(self) -> None:
        check_runner_kind(self.runner, self.cuda_graphs, self.compile)
        check_linear_kernels(self.linear_kernels)
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.speculation.tree_budget and self.runner == "dynamic":
            raise ValueError("tree drafting needs the static runner (runner='auto' or 'static'), not 'dynamic'")


def decoder(tokenizer):
    """Token ids -> the text a job writes (special tokens skipped), for stop strings."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def tree_support_error(drafter: Drafter, target: TargetSide) -> str | None:
    """Why this drafter and target cannot draft trees, or None."""
    if isinstance(drafter, DraftAssistDrafter):
        return "tree drafting does not take an assisted draft model (draft assist 'ngram'): use a chain"
    if not drafter.supports_trees:
        return (f"tree drafting needs the static runner and a draft-model, EAGLE, n-gram or suffix drafter, not "
                f"{type(drafter).__name__}" + (" on the dynamic runner" if drafter.max_model_len else ""))
    if not target.supports_trees:
        return "tree drafting needs the static runner for the target (a Llama-family model: llama, qwen2, mistral)"
    return None


class SpecEngine:
    """Continuous batching in one process: one `speculative_step` after another over a draft
    side and a target side, new requests taking the slots finished rows free."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter, config: EngineConfig, tokenizer=None):
        """`tokenizer`: the target's (a Hugging Face tokenizer), for requests with stop strings."""
        spec = config.speculation
        self.config = config
        limits = [max_model_len(target)] + ([drafter.max_model_len] if drafter.max_model_len else [])
        self.admission = Admission.of(spec, output_vocab_size(target), limits, can_decode=tokenizer is not None)
        warn_if_lossy(spec.acceptance)
        self.target = TargetSide(target, self.admission.spec, config.runner, drafter.needs_features, config.linear_kernels,
                                 decode=None if tokenizer is None else decoder(tokenizer), cuda_graphs=config.cuda_graphs,
                                 compile=config.compile)
        if spec.tree_budget and (error := tree_support_error(drafter, self.target)):
            raise ValueError(error)
        self.draft = DraftSide(drafter, self.admission.spec, self.target.device)
        if spec.adaptive is not None and spec.adaptive.wants_crossover:
            # learned costs know where the device's verify turns compute-bound (None on a CPU)
            spec = spec.with_crossover(crossover_tokens(target))
        adaptive = spec.adaptive
        controller = None if adaptive is None else KController(adaptive, spec.tree_budget, spec.num_speculative_tokens)
        self.hook = StepHook(self.admission.spec, controller)

    @property
    def vocab_size(self) -> int:
        return self.admission.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.admission.max_model_len

    @property
    def drafter(self) -> Drafter:
        return self.draft.drafter

    @property
    def timings(self) -> StepTimings:
        return self.hook.timings

    @property
    def k_controller(self) -> KController | None:
        return self.hook.controller

    def add(self, items: Sequence[tuple[int, Request]]) -> None:
        """Admit rows into both sides (the target prefills their prompts; a cold drafter waits)."""
        t0, before = time.perf_counter(), (self.target.graph_counts(), self.draft.graph_counts())
        self.target.add(items)
        self.draft.add(items)
        self.timings.prefill_s += time.perf_counter() - t0
        self.timings.add_counts(self.target.graph_counts().minus(before[0]))  # a drafter's admission forwards, if any
        self.timings.add_counts(self.draft.graph_counts().minus(before[1]))

    def step(self) -> Verdict:
        return speculative_step(self.draft, self.target, self.hook)

    @property
    def graphed(self) -> bool:
        """Whether either model replays its steps from CUDA graphs."""
        runners = [self.target.rows.runner, getattr(getattr(self.drafter, "rows", None), "runner", None)]
        return any(getattr(r, "graphs", None) is not None for r in runners)

    def capture(self, rows: int, max_length: int) -> None:
        """Capture every program the steps of up to `rows` rows of up to `max_length` tokens each can
        replay (raysd.engine.graphs), now rather than at a step, with their seconds in the timings.
        Needs the job's first rows admitted (their state and sampling give the programs' inputs)."""
        for counts in capture_ahead(self.draft, self.target, self.admission.spec, self.k_controller, rows,
                                    min(max_length, self.max_model_len)):
            self.timings.add_counts(counts)

    def generate(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Generate for every request; results come back in request order. With CUDA graphs, every
        program its steps will replay is captured once the first rows are in (`capture`)."""
        admitted, results = self.admission.split(requests)
        waiting = deque(admitted)
        start = time.perf_counter()
        capture = self.graphed and bool(admitted)
        while waiting or len(self.target):
            free = self.config.max_batch_size - len(self.target)
            if waiting and free:
                self.add([waiting.popleft() for _ in range(min(len(waiting), free))])
            if capture:
                self.capture(min(self.config.max_batch_size, len(admitted)),
                             max(len(r.prompt_token_ids) + r.params.max_new_tokens for _, r in admitted))
                capture = False
            for i, result in self.step().finished:
                results[i] = result
        self.timings.wall_s += time.perf_counter() - start
        return [results[i] for i in range(len(requests))]
