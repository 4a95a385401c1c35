"""The single-process speculative decoding engine: continuous batching over one target
and one drafter. The Ray coordinator runs the same step with the two halves in actors."""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from raysd.core.acceptance import parse_acceptance
from raysd.core.stats import SpecDecodeStats
from raysd.engine.adaptive import AdaptiveConfig, KController
from raysd.engine.drafters import DraftModelDrafter, Drafter, FeatureDrafter
from raysd.engine.hierarchy import AssistedDraftModelDrafter
from raysd.engine.rows import GenerationResult, Request, request_error
from raysd.engine.step import DraftSide, RowLimits, StepOutcome, TargetSide
from raysd.engine.verifier import TargetVerifier
from raysd.models.linear import check_linear_kernels
from raysd.models.loading import max_model_len
from raysd.models.runners import check_runner_kind

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class EngineConfig:
    num_speculative_tokens: int = 4  # K: drafts per row per step
    max_batch_size: int = 8  # rows decoded together; waiting requests take freed slots
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None  # prompt + generated tokens per row; None: the models' own limit
    # Capacity planning only: accept each draft with this probability instead of the rejection
    # test. Outputs then do NOT follow the target distribution; None (default) is exact.
    synthetic_acceptance_rate: float | None = None
    # Choose K in 0..num_speculative_tokens each step for the best expected goodput
    # (raysd.engine.adaptive); None: always num_speculative_tokens.
    adaptive: AdaptiveConfig | None = None
    # The target's KV cache: "auto" = static slots for Llama-family models, the Hugging Face
    # dynamic cache otherwise (raysd.models.runners). A draft model's runner is its drafter's.
    runner: str = "auto"
    # The target's linear layers: "auto" = oneDNN-prepacked weights for a float32 model on a CPU
    # (a verify of K + 1 tokens then costs about one decode step; raysd.models.linear; one more
    # copy of the weights in memory), PyTorch's own otherwise; "packed" insists; "stock" never.
    linear_kernels: str = "auto"
    # "exact" (default), or "relaxed:LAMBDA": verify against (1 - LAMBDA) target + LAMBDA draft
    # (raysd.core.rejection.rejection_sample; lossy, on Yin et al. 2024's quality-speed front).
    acceptance: str = "exact"
    # P > 0: each step drafts a tree of at most P nodes per row, at most num_speculative_tokens
    # deep, verified in one target pass (raysd.core.tree_shape, docs/trees.md); it needs the
    # static runner and a draft-model, feature (EAGLE) or n-gram drafter. With `adaptive`, P is the largest
    # tree weighed: each step drafts the chain or tree of best expected goodput. 0: chains only.
    tree_budget: int = 0

    def __post_init__(self) -> None:
        check_runner_kind(self.runner)
        check_linear_kernels(self.linear_kernels)
        relax = parse_acceptance(self.acceptance)
        check_tree_config(self.tree_budget, self.runner, self.num_speculative_tokens,
                          relax is not None or self.synthetic_acceptance_rate is not None)
        if relax is not None and self.synthetic_acceptance_rate is not None:
            raise ValueError("synthetic_acceptance_rate and a relaxed acceptance cannot be combined")
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in 0..64, got {self.num_speculative_tokens}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        rate = self.synthetic_acceptance_rate
        if rate is not None and (isinstance(rate, bool) or not 0.0 <= rate <= 1.0):
            raise ValueError(f"synthetic_acceptance_rate must be None or in [0, 1], got {rate!r}")
        check_adaptive_costs(self.adaptive, self.num_speculative_tokens, self.tree_budget)
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


def check_adaptive_costs(adaptive: AdaptiveConfig | None, num_speculative_tokens: int, tree_budget: int) -> None:
    """Adaptive step costs must reach K + 1 tokens and, for a tree of P nodes, P + 1 (EngineConfig,
    CoordinatorConfig)."""
    if adaptive is not None and adaptive.costs.k_max < max(num_speculative_tokens, tree_budget):
        raise ValueError(f"adaptive step costs cover K <= {adaptive.costs.k_max}, below num_speculative_tokens "
                         f"({num_speculative_tokens}) or tree_budget ({tree_budget}): a tree of P nodes "
                         "needs T_target(B, P + 1)")


def check_tree_config(tree_budget: int, runner: str, num_speculative_tokens: int, inexact: bool) -> None:
    """What a tree refuses, in one line each (EngineConfig, CoordinatorConfig); the drafter and the
    models' runners are checked once they exist (tree_support_error)."""
    P = tree_budget
    if isinstance(P, bool) or not isinstance(P, int) or not 0 <= P <= 256:
        raise ValueError(f"tree_budget must be an int in 0..256 (0: a chain), got {P!r}")
    if not P:
        return
    if runner == "dynamic":
        raise ValueError("tree drafting needs the static runner (runner='auto' or 'static'), not 'dynamic'")
    if num_speculative_tokens < 1:
        raise ValueError("tree drafting needs num_speculative_tokens >= 1 (the tree's depth)")
    if inexact:
        raise ValueError("tree drafting verifies exactly: use acceptance='exact' and no synthetic_acceptance_rate")


def tree_support_error(drafter: Drafter, verifier: TargetVerifier) -> str | None:
    """Why this drafter and target cannot draft trees, or None."""
    if isinstance(drafter, AssistedDraftModelDrafter):
        return "tree drafting does not take an assisted draft model (draft assist 'ngram'): use a chain"
    if not drafter.supports_trees:
        return f"tree drafting needs the static runner and a draft-model, EAGLE or n-gram drafter, not {type(drafter).__name__}" + (
            " on the dynamic runner" if isinstance(drafter, (DraftModelDrafter, FeatureDrafter)) else "")
    if not verifier.supports_trees:
        return "tree drafting needs the static runner for the target (a Llama-family model: llama, qwen2, mistral)"
    return None


class LossyAcceptanceWarning(UserWarning):
    """Raised (as a warning) whenever an engine verifies with a relaxed acceptance rule."""


class SyntheticAcceptanceWarning(UserWarning):
    """Raised (as a warning) whenever an engine runs in synthetic-acceptance mode."""


@dataclass
class EngineTimings:
    draft_s: float = 0.0
    target_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0  # both sides' prompt forwards, a cold drafter's deferred ones too (included in wall_s)
    steps: int = 0
    row_steps: int = 0  # sum over steps of the rows decoded: occupancy = row_steps / (steps x max_batch_size)
    generated_tokens: int = 0


class SpecEngine:
    """Continuous batching in one process: the step's two halves (raysd.engine.step) called
    one after the other, new requests taking the slots finished rows free."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter, config: EngineConfig):
        verifier = TargetVerifier(target, config.runner, features=drafter.needs_features,
                                  linear_kernels=config.linear_kernels)
        if config.tree_budget and (error := tree_support_error(drafter, verifier)):
            raise ValueError(error)
        self.config = config
        self.vocab_size = verifier.vocab_size
        limits = [max_model_len(target)] + ([config.max_model_len] if config.max_model_len else [])
        if isinstance(drafter, DraftModelDrafter):
            limits.append(max_model_len(drafter.seqs.runner.model))
        if isinstance(drafter, FeatureDrafter):
            limits.append(drafter.model.config.max_position_embeddings)
        self.max_model_len = min(limits)
        self.timings = EngineTimings()
        self.k_controller = None if config.adaptive is None else KController(
            config.adaptive, config.tree_budget, config.num_speculative_tokens)
        self.relax = parse_acceptance(config.acceptance)
        if self.relax is not None:
            warnings.warn(
                f"RELAXED ACCEPTANCE ({config.acceptance}): outputs do NOT follow the target distribution exactly "
                f"(total variation {self.relax} x TV(target, draft) at each drafted position)",
                LossyAcceptanceWarning,
                stacklevel=2,
            )
        if config.synthetic_acceptance_rate is not None:
            warnings.warn(
                f"SYNTHETIC ACCEPTANCE MODE (rate {config.synthetic_acceptance_rate}): drafts are accepted at random, "
                "outputs do NOT follow the target distribution; use for step-cost measurements only",
                SyntheticAcceptanceWarning,
                stacklevel=2,
            )
        row_limits = RowLimits(config.num_speculative_tokens, self.max_model_len, config.eos_token_ids,
                               feature_draft=drafter.needs_features, tree_budget=config.tree_budget)
        self.target_side = TargetSide(verifier, row_limits, config.synthetic_acceptance_rate, self.relax, config.acceptance)
        self.draft_side = DraftSide(drafter, row_limits, verifier.seqs.device)

    @property
    def verifier(self) -> TargetVerifier:
        return self.target_side.verifier

    @property
    def drafter(self) -> Drafter:
        return self.draft_side.drafter

    def generate(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Generate for every request; results come back in request order."""
        cfg = self.config
        results: dict[int, GenerationResult] = {}
        waiting = deque()
        for i, req in enumerate(requests):
            error = request_error(req, self.vocab_size, self.max_model_len)
            if error:
                result = GenerationResult(req.request_id, list(req.prompt_token_ids), [], "error", SpecDecodeStats(cfg.num_speculative_tokens), error)
                results[i] = self.target_side.label(result)
            else:
                waiting.append((i, req))
        start = time.perf_counter()
        while waiting or len(self.target_side):
            admitted = [waiting.popleft() for _ in range(min(len(waiting), cfg.max_batch_size - len(self.target_side)))]
            if admitted:
                t0 = time.perf_counter()
                self.target_side.add(admitted)
                self.draft_side.add(admitted)
                self.timings.prefill_s += time.perf_counter() - t0
            for i, result in self.step().finished:
                results[i] = result
                self.timings.generated_tokens += len(result.token_ids)
        self.timings.wall_s += time.perf_counter() - start
        return [results[i] for i in range(len(requests))]

    def step(self) -> StepOutcome:
        """One speculative step for every row: K (and the tree) for the batch, propose, verify (one
        read-back), and the draft side follows the target's decision."""
        k, tree = self.config.num_speculative_tokens, self.config.tree_budget
        batch = self.target_side.batch
        if self.k_controller is not None:
            k, tree = self.k_controller.choose_plan_from(batch.overlap_sum, batch.tested, batch.room())
        t0, deferred = time.perf_counter(), self.draft_side.deferred_prefill_s
        proposal = self.draft_side.propose(k, tree)
        t1 = time.perf_counter()
        deferred = self.draft_side.deferred_prefill_s - deferred  # a cold drafter's prompts: prefill, not drafting
        outcome = self.target_side.verify(proposal, k, tree)
        t2 = time.perf_counter()
        self.draft_side.commit(outcome.kept, outcome.accepted, outcome.keep, outcome.features, outcome.path)
        if self.k_controller is not None:
            self.k_controller.observe_all(outcome.step_overlap, outcome.step_tested)
            self.k_controller.observe_ranks(outcome.rank_offered, outcome.rank_moved)
        self.timings.prefill_s += deferred
        self.timings.draft_s += t1 - t0 - deferred
        self.timings.target_s += t2 - t1
        self.timings.steps += 1
        self.timings.row_steps += len(outcome.kept)
        return outcome
