"""Requests, results, and the per-row bookkeeping shared by the engine and the Ray coordinator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch

from raysd.core.draws import counter_uniforms
from raysd.core.sampling import SamplingParams
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
    synthetic: bool = False  # synthetic-acceptance mode: tokens do NOT follow the target distribution
    acceptance: str = "exact"  # the rule that produced the tokens ("exact" or "relaxed:LAMBDA")


def request_error(request: Request, vocab_size: int, max_model_len: int) -> str | None:
    """Why a request cannot be generated, or None. Checked before it takes a batch slot."""
    prompt = request.prompt_token_ids
    if not prompt:
        return "empty prompt"
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    if len(prompt) >= max_model_len:
        return f"prompt has {len(prompt)} tokens; the model's context is {max_model_len}"
    return None


@dataclass
class RowState:
    """One request in flight: its tokens, its random stream, its statistics."""

    request: Request
    num_speculative_tokens: int
    stop_ids: frozenset[int]
    max_model_len: int
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.stats = SpecDecodeStats(self.num_speculative_tokens)

    @property
    def length(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output)

    def max_drafts(self) -> int:
        """Drafts worth verifying: no more than the tokens this row may still emit, minus the bonus."""
        room = min(self.request.params.max_new_tokens - len(self.output), self.max_model_len - self.length)
        return max(0, min(self.num_speculative_tokens, room - 1))

    def uniforms(self) -> torch.Tensor:
        """[2K + 1] float64 draws for one step: K for drafting, K for acceptance, 1 for the final token.

        Counter-based (raysd.core.draws), keyed by the row's seed and the tokens it has
        generated so far: a row's draws depend on its seed and its own history only, never
        on its batch. `step_uniforms` computes the same for a whole batch on its device."""
        return step_uniforms([self.request.params.seed], [len(self.output)], self.num_speculative_tokens, "cpu")[0]

    def append(self, tokens: Sequence[int]) -> list[int]:
        """Emit verified tokens up to a stop condition; returns those actually kept."""
        params = self.request.params
        kept = []
        for t in tokens:
            kept.append(t)
            self.output.append(t)
            if t in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.output) >= params.max_new_tokens or self.length >= self.max_model_len:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return kept

    def result(self) -> GenerationResult:
        return GenerationResult(
            self.request.request_id, list(self.request.prompt_token_ids), list(self.output), self.finish_reason or "length", self.stats
        )


def stop_ids_for(params: SamplingParams, eos_token_ids: Sequence[int]) -> frozenset[int]:
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return frozenset(eos) | frozenset(params.stop_token_ids)


def fill_holes(alive: Sequence[bool]) -> list[int]:
    """The rows to keep, in an order that moves as few as possible: each finished row's slot
    is taken by a surviving row from the end of the batch (a static cache copies only those)."""
    n = sum(alive)
    movers = [i for i in range(n, len(alive)) if alive[i]]
    return [i if alive[i] else movers.pop() for i in range(n)]


def step_uniforms(seeds: Sequence[int], positions: Sequence[int], K: int, device) -> torch.Tensor:
    """[B, 2K + 1] float64 draws for one step, computed on `device`: K for drafting, K for
    acceptance, 1 for the final token, keyed by each row's seed and tokens generated so far."""
    keys = torch.as_tensor(np.stack([np.asarray(seeds, dtype=np.int64), np.asarray(positions, dtype=np.int64)]))  # [2, B]
    keys = keys.to(device, non_blocking=True)
    return counter_uniforms(keys[0], keys[1], 2 * K + 1)
