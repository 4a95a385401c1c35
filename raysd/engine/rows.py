"""Requests, results, and the per-row helpers shared by the engine's step halves and the Ray coordinator."""

from __future__ import annotations

from dataclasses import dataclass
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
