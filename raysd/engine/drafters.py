"""Drafters: whatever proposes tokens for the target to verify, behind one small interface.

A drafter keeps its own per-row state (a KV cache, or the token history) and is
told what happened through `commit`. Whatever it proposes, it also says from
which distribution it drew each draft (`draft_probs`), and the rejection test
makes the output exact for any drafter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from raysd.core.sampling import SamplingTensors, logits_to_probs, sample_from_probs
from raysd.engine.sequences import SequenceState
from raysd.models.loading import output_vocab_size
from raysd.models.runners import make_runner


@dataclass(frozen=True)
class Proposal:
    draft_token_ids: torch.Tensor  # [B, K] int64; entries past num_draft_tokens are ignored
    num_draft_tokens: torch.Tensor  # [B] int64
    draft_probs: torch.Tensor  # [B, K, V] the distribution each draft was drawn from
    num_draft_host: tuple[int, ...] | None = None  # num_draft_tokens on the host, when the drafter knows it

    @staticmethod
    def empty(batch_size: int, vocab_size: int, device) -> "Proposal":
        return Proposal(
            torch.zeros(batch_size, 0, dtype=torch.int64, device=device),
            torch.zeros(batch_size, dtype=torch.int64, device=device),
            torch.zeros(batch_size, 0, vocab_size, device=device),
            (0,) * batch_size,
        )


class Drafter(ABC):
    name: str
    vocab_size: int  # the width of draft_probs: the target's vocabulary

    @abstractmethod
    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None: ...

    @abstractmethod
    def select(self, rows: Sequence[int]) -> None: ...

    @abstractmethod
    def propose(self, max_drafts: Sequence[int], sampling: SamplingTensors, uniforms: torch.Tensor) -> Proposal:
        """Propose up to max_drafts[b] tokens for each row; `uniforms` is [B, K] with K >= max(max_drafts)."""

    @abstractmethod
    def commit(self, new_tokens: Sequence[Sequence[int]], num_accepted: Sequence[int] | None = None) -> None:
        """The tokens each row emitted this step (and, if known, how many drafts it accepted)."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same engine: the fair baseline."""

    name = "none"

    def __init__(self, vocab_size: int, device="cpu"):
        self.vocab_size, self.device, self.num_rows = vocab_size, device, 0

    def add_rows(self, prompts):
        self.num_rows += len(prompts)

    def select(self, rows):
        self.num_rows = len(rows)

    def propose(self, max_drafts, sampling, uniforms):
        return Proposal.empty(len(max_drafts), self.vocab_size, self.device)

    def commit(self, new_tokens, num_accepted=None):
        pass


class DraftModelDrafter(Drafter):
    """A smaller (or cheaper) causal LM sampled autoregressively with the rows' own parameters.

    `draft_top_m` > 0 makes the draft sample from its m largest logits only (the rest
    at -inf before temperature, top-k and top-p). Still exact: the rejection test gets
    the distribution the draft was really drawn from, which then has at most m
    nonzeros and crosses between actors sparse. Greedy drafts are unchanged.
    """

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, name: str = "draft-model", draft_top_m: int = 0,
                 runner: str = "auto"):
        if draft_top_m < 0:
            raise ValueError(f"draft_top_m must be >= 0 (0 disables), got {draft_top_m}")
        self.name = name
        self.draft_top_m = draft_top_m
        self.target_vocab_size = self.vocab_size = target_vocab_size
        own_vocab = output_vocab_size(model)
        # Drafts outside the target's vocabulary could never be accepted; a narrower
        # draft vocabulary gets zero probability on the target's extra tokens.
        self.seqs = SequenceState(make_runner(model, runner, vocab_size=min(own_vocab, target_vocab_size)))

    def add_rows(self, prompts):
        self.seqs.add_rows(prompts)

    def select(self, rows):
        self.seqs.select(rows)

    def commit(self, new_tokens, num_accepted=None):
        self.seqs.commit(new_tokens, num_accepted)

    def propose(self, max_drafts, sampling, uniforms):
        B, device = len(max_drafts), self.seqs.device
        K = max(max_drafts, default=0)
        if K == 0:
            return Proposal.empty(B, self.target_vocab_size, device)
        ones = torch.ones(B, dtype=torch.int64, device=device)
        host_ones = (1,) * B
        logits = self.seqs.feed(torch.zeros(B, 0, dtype=torch.int64, device=device), ones * 0, ones, 1)[:, 0]  # [B, V']
        tokens, probs = [], []
        for i in range(K):
            p = logits_to_probs(self._draft_logits(logits), sampling)  # [B, V]
            t = sample_from_probs(p, uniforms[:, i])  # [B]
            tokens.append(t)
            probs.append(p)
            if i + 1 < K:  # the last draft is fed at the next step, with the verified tokens
                logits = self.seqs.feed(t[:, None], ones, ones, 1, host_ones)[:, 0]
        num = torch.as_tensor(list(max_drafts), dtype=torch.int64, device=device)
        return Proposal(torch.stack(tokens, dim=1), num, torch.stack(probs, dim=1), tuple(int(k) for k in max_drafts))

    def _draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V'] draft logits -> [B, V] over the target's vocabulary, top-m applied."""
        missing = self.target_vocab_size - logits.shape[-1]
        if missing:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], missing), float("-inf"))], dim=-1)
        if 0 < self.draft_top_m < logits.shape[-1]:
            index = logits.topk(self.draft_top_m, dim=-1).indices  # [B, m]
            logits = torch.full_like(logits, float("-inf")).scatter_(-1, index, logits.gather(-1, index))
        return logits


class NgramDrafter(Drafter):
    """Prompt lookup: copy the tokens that followed the most recent earlier occurrence
    of the row's last n tokens (n from max_ngram down to min_ngram), in prompt and output.
    Drafts are deterministic, so draft_probs is one-hot."""

    name = "ngram"

    def __init__(self, vocab_size: int, device="cpu", min_ngram: int = 1, max_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.device = vocab_size, device
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.history: list[list[int]] = []

    def add_rows(self, prompts):
        self.history.extend(list(p) for p in prompts)

    def select(self, rows):
        self.history = [self.history[i] for i in rows]

    def commit(self, new_tokens, num_accepted=None):
        for row, new in zip(self.history, new_tokens):
            row.extend(new)

    def propose(self, max_drafts, sampling, uniforms):
        B, K = len(max_drafts), max(max_drafts, default=0)
        if K == 0:
            return Proposal.empty(B, self.vocab_size, self.device)
        ids = torch.zeros(B, K, dtype=torch.int64)
        counts = []
        for b, (row, k) in enumerate(zip(self.history, max_drafts)):
            draft = self.lookup(row, k)
            ids[b, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
            counts.append(len(draft))
        ids, num = ids.to(self.device), torch.tensor(counts, dtype=torch.int64).to(self.device)
        probs = torch.zeros(B, K, self.vocab_size, device=self.device).scatter_(-1, ids[..., None], 1.0)
        return Proposal(ids, num, probs, tuple(counts))

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # earlier n-grams
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence
                return seq[start : start + k].tolist()
        return []
