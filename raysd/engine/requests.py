"""What goes into a batch and what comes out: `Request`, `GenerationResult`, and `Admission`,
the one place that decides whether a request may take a batch slot (for the engine and the Ray
coordinator alike)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Hashable, Sequence

from raysd.core.params import SamplingParams
from raysd.core.speculation import Acceptance, SpeculationConfig
from raysd.core.stats import SpecDecodeStats


@dataclass(frozen=True)
class Request:
    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))


@dataclass
class GenerationResult:
    request_id: Hashable
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "error"
    stats: SpecDecodeStats
    error: str | None = None
    # The rule that produced the tokens: "exact", or (NOT the target's distribution) "relaxed:LAMBDA",
    # "synthetic:RATE" (raysd.core.speculation.Acceptance).
    acceptance: str = "exact"
    text: str | None = None  # a row ended by a stop string: its decoded output, cut there; else None
    logprobs: list[float] | None = None  # SamplingParams.logprobs: each token's log-probability under the target
    top_logprobs: list[list[tuple[int, float]]] | None = None  # and the top_logprobs most likely (id, logprob)
    # Beam search (raysd.engine.beam): the hypothesis' score, sum of log-probs / length ** length_penalty
    beam_score: float | None = None


class LossyAcceptanceWarning(UserWarning):
    """Warned whenever an engine or a coordinator verifies with a relaxed acceptance rule."""


class SyntheticAcceptanceWarning(UserWarning):
    """Warned whenever an engine or a coordinator accepts drafts at a synthetic rate."""


def warn_if_lossy(acceptance: Acceptance, stacklevel: int = 3) -> None:
    """Say loudly, once per engine or coordinator, that outputs will not follow the target."""
    if acceptance.relax is not None:
        warnings.warn(f"RELAXED ACCEPTANCE ({acceptance}): outputs do NOT follow the target distribution exactly "
                      f"(total variation {acceptance.relax} x TV(target, draft) at each drafted position)",
                      LossyAcceptanceWarning, stacklevel=stacklevel)
    if acceptance.synthetic_rate is not None:
        warnings.warn(f"SYNTHETIC ACCEPTANCE ({acceptance}): drafts are accepted at random, outputs do NOT follow "
                      "the target distribution; use for step-cost measurements only",
                      SyntheticAcceptanceWarning, stacklevel=stacklevel)


def request_error(request: Request, vocab_size: int, max_model_len: int, can_decode: bool = True) -> str | None:
    """Why a request cannot be generated, or None. Checked before it takes a batch slot."""
    prompt = request.prompt_token_ids
    if not prompt:
        return "empty prompt"
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    if request.params.stop and not can_decode:
        return "stop strings need the target's tokenizer, and this engine has none"
    if len(prompt) >= max_model_len:
        # the smallest of the models' contexts and the job's max_model_len (Admission.of)
        return f"prompt has {len(prompt)} tokens; the context is {max_model_len} (the models', or max_model_len)"
    return None


@dataclass(frozen=True)
class Admission:
    """Which requests may take a batch slot, for one speculation config and pair of models.

    `spec.max_model_len` here is resolved: the smallest of the models' contexts and the
    configured limit (`Admission.of`), so every row is capped by the same number on both sides."""

    spec: SpeculationConfig
    vocab_size: int
    can_decode: bool = False  # the engine has the target's tokenizer (stop strings need it)

    @classmethod
    def of(cls, spec: SpeculationConfig, vocab_size: int, model_limits: Sequence[int], can_decode: bool = False) -> "Admission":
        limits = list(model_limits) + ([spec.max_model_len] if spec.max_model_len else [])
        return cls(replace(spec, max_model_len=min(limits)), vocab_size, can_decode)

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    def refusal(self, request: Request) -> GenerationResult | None:
        """The error result of a request that cannot run, or None when it can."""
        error = request_error(request, self.vocab_size, self.max_model_len, self.can_decode)
        if error is None:
            return None
        stats = SpecDecodeStats(self.spec.num_speculative_tokens)
        return GenerationResult(request.request_id, list(request.prompt_token_ids), [], "error", stats, error,
                                str(self.spec.acceptance))

    def split(self, requests: Sequence[Request]) -> tuple[list[tuple[int, Request]], dict[int, GenerationResult]]:
        """(index, request) of those that may run, in order, and the error results of the others by index."""
        waiting, refused = [], {}
        for i, request in enumerate(requests):
            result = self.refusal(request)
            if result is None:
                waiting.append((i, request))
            else:
                refused[i] = result
        return waiting, refused
