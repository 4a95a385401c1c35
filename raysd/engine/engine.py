"""The single-process speculative decoding engine: continuous batching over one target
and one drafter. The Ray coordinator runs the same step with the two halves in actors."""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from transformers import PreTrainedModel

from raysd.core.sampling import SamplingTensors
from raysd.core.stats import SpecDecodeStats
from raysd.engine.adaptive import AdaptiveConfig, KController
from raysd.engine.drafters import DraftModelDrafter, Drafter
from raysd.engine.batch import Batch
from raysd.engine.rows import GenerationResult, Request, fill_holes, request_error, step_uniforms
from raysd.engine.verifier import TargetVerifier
from raysd.models.loading import max_model_len
from raysd.models.runners import check_runner_kind


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
    # "exact" (default), or "relaxed:LAMBDA": verify against (1 - LAMBDA) target + LAMBDA draft
    # (raysd.core.rejection.rejection_sample; lossy, on Yin et al. 2024's quality-speed front).
    acceptance: str = "exact"

    def __post_init__(self) -> None:
        check_runner_kind(self.runner)
        relax = parse_acceptance(self.acceptance)
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
        if self.adaptive is not None and self.adaptive.costs.k_max < self.num_speculative_tokens:
            raise ValueError(f"adaptive step costs cover K <= {self.adaptive.costs.k_max}, below num_speculative_tokens")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


def parse_acceptance(rule: str) -> float | None:
    """"exact" -> None; "relaxed:LAMBDA" -> LAMBDA in [0, 1]; anything else is a one-line error."""
    if rule == "exact":
        return None
    kind, _, value = rule.partition(":")
    try:
        lam = float(value)
    except ValueError:
        lam = float("nan")
    if kind != "relaxed" or not 0.0 <= lam <= 1.0:
        raise ValueError(f"acceptance must be 'exact' or 'relaxed:LAMBDA' with LAMBDA in [0, 1], got {rule!r}")
    return lam


class LossyAcceptanceWarning(UserWarning):
    """Raised (as a warning) whenever an engine verifies with a relaxed acceptance rule."""


class SyntheticAcceptanceWarning(UserWarning):
    """Raised (as a warning) whenever an engine runs in synthetic-acceptance mode."""


@dataclass
class EngineTimings:
    draft_s: float = 0.0
    target_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0  # admitting rows: both sides' prompt forwards (included in wall_s)
    steps: int = 0
    generated_tokens: int = 0


class SpecEngine:
    def __init__(self, target: PreTrainedModel, drafter: Drafter, config: EngineConfig):
        self.verifier = TargetVerifier(target, config.runner)
        self.drafter = drafter
        self.config = config
        self.vocab_size = self.verifier.vocab_size
        limits = [max_model_len(target)] + ([config.max_model_len] if config.max_model_len else [])
        if isinstance(drafter, DraftModelDrafter):
            limits.append(max_model_len(drafter.seqs.runner.model))
        self.max_model_len = min(limits)
        self.timings = EngineTimings()
        self.k_controller = KController(config.adaptive) if config.adaptive is not None else None
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

    def generate(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Generate for every request; results come back in request order."""
        cfg = self.config
        results: dict[int, GenerationResult] = {}
        waiting = deque()
        for i, req in enumerate(requests):
            error = request_error(req, self.vocab_size, self.max_model_len)
            if error:
                results[i] = self._flag(GenerationResult(req.request_id, list(req.prompt_token_ids), [], "error", SpecDecodeStats(cfg.num_speculative_tokens), error))
            else:
                waiting.append((i, req))
        batch = Batch(cfg.num_speculative_tokens, self.max_model_len, cfg.eos_token_ids)
        sampling: SamplingTensors | None = None
        start = time.perf_counter()
        while waiting or len(batch):
            admitted = [waiting.popleft() for _ in range(min(len(waiting), cfg.max_batch_size - len(batch)))]
            if admitted:
                t0 = time.perf_counter()
                prompts = [req.prompt_token_ids for _, req in admitted]
                self.verifier.add_rows(prompts)
                self.drafter.add_rows(prompts)
                batch.add(admitted)
                self.timings.prefill_s += time.perf_counter() - t0
            if admitted or sampling is None:  # the batch changed: its parameters go to the device once
                sampling = SamplingTensors.from_params(batch.params, self.verifier.seqs.device)
            self.step(batch, sampling)
            finished = batch.finish != 0
            for b in np.flatnonzero(finished):
                results[batch.ids[b]] = self._flag(batch.result(b))
                self.timings.generated_tokens += len(batch.outputs[b])
            if finished.any():
                keep = fill_holes((~finished).tolist())
                batch.keep(keep)
                self.verifier.select(keep)
                self.drafter.select(keep)
                sampling = None
        self.timings.wall_s += time.perf_counter() - start
        return [results[i] for i in range(len(requests))]

    def _flag(self, result: GenerationResult) -> GenerationResult:
        result.synthetic = self.config.synthetic_acceptance_rate is not None
        result.acceptance = self.config.acceptance
        return result

    def step(self, batch: Batch, sampling: SamplingTensors) -> None:
        """One speculative step for every row of the batch: propose, verify, emit, roll back.

        Nothing is read back from the device but the verdict, once."""
        K = self.config.num_speculative_tokens
        device = self.verifier.seqs.device
        # 1. Per-row budgets and K (host arrays); counter-based draws (on the device).
        offered = batch.room()  # [B]
        if self.k_controller is not None:
            k_step = self.k_controller.choose_k_from(batch.overlap_sum, batch.tested, offered)
            offered = np.minimum(offered, k_step)
        uniforms = step_uniforms(batch.seeds, batch.generated, K, device)  # [B, 2K + 1]
        # 2. Draft: up to offered[b] tokens per row, and the distributions they were drawn from.
        t0 = time.perf_counter()
        proposal = self.drafter.propose(offered.tolist(), sampling, uniforms[:, :K])
        t1 = time.perf_counter()
        # 3. Verify: one target pass over K + 1 positions, the rejection test, one read-back.
        Kp = proposal.draft_token_ids.shape[1]
        rate = self.config.synthetic_acceptance_rate
        verdict = self.verifier.verify(proposal, sampling, uniforms[:, K : K + Kp], uniforms[:, 2 * K], rate, self.relax).read_back()
        t2 = time.perf_counter()
        # 4. Emit up to each row's stop condition; both sides roll back to what was kept.
        kept = batch.emit(verdict, offered)
        if self.k_controller is not None:
            self.k_controller.observe_all(verdict.overlap_sums().sum(), verdict.num_tested.sum())
        accepted = verdict.num_accepted.tolist()
        self.verifier.commit(kept, accepted)
        self.drafter.commit(kept, accepted)
        self.timings.draft_s += t1 - t0
        self.timings.target_s += t2 - t1
        self.timings.steps += 1
