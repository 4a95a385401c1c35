"""The rows in flight, as arrays: one entry per batch slot, updated once per step from the verdict.

Budgets, stop sets, emitted-token counts and the acceptance statistics of every row live in
numpy arrays indexed by slot (slot b is row b of both runners), so the bookkeeping after a
step is a handful of vectorised operations on the step's one read-back, whatever the batch
size: no per-row objects, no per-row draws. The only per-row Python left is appending each
row's kept tokens to its output list.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from raysd.core.sampling import SamplingParams
from raysd.core.stats import SpecDecodeStats
from raysd.engine.rows import GenerationResult, Request
from raysd.engine.verifier import Verdict

LENGTH, STOP = 1, 2  # finish reasons, as codes
_REASONS = {LENGTH: "length", STOP: "stop"}


class Batch:
    """Slots of requests being generated. `add` appends, `keep` selects (the runners' order)."""

    def __init__(self, num_speculative_tokens: int, max_model_len: int, eos_token_ids: Sequence[int],
                 feature_draft: bool = False):
        K = self.K = num_speculative_tokens
        self.feature_draft = feature_draft  # a row's first step offers no drafts (no features yet)
        self.max_model_len = max_model_len
        self.eos = tuple(eos_token_ids)
        self.requests: list[Request] = []
        self.ids: list[int] = []  # caller's index of each slot's request
        self.outputs: list[list[int]] = []
        i64 = lambda *shape: np.zeros(shape, dtype=np.int64)  # noqa: E731
        self.prompt_len, self.generated, self.max_new, self.seeds = i64(0), i64(0), i64(0), i64(0)
        self.stop_ids = np.full((0, 1), -2, dtype=np.int64)  # [B, S] padded with -2 (no token id)
        self.finish = i64(0)  # 0 while running, else LENGTH or STOP
        # Statistics (SpecDecodeStats' fields, one entry per slot).
        self.steps, self.drafted, self.accepted, self.tested, self.k_sum, self.no_draft = (i64(0) for _ in range(6))
        self.branch = i64(0)  # a tree's accepted nodes that were not a rank-0 child
        self.histogram, self.per_position = i64(0, K + 1), i64(0, K)
        self.overlap_sum = np.zeros(0)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def params(self) -> list[SamplingParams]:
        return [r.params for r in self.requests]

    def add(self, items: Sequence[tuple[int, Request]]) -> None:
        n = len(items)
        reqs = [r for _, r in items]
        stops = [() if r.params.ignore_eos else self.eos for r in reqs]
        stops = [tuple(s) + r.params.stop_token_ids for s, r in zip(stops, reqs)]
        width = max([self.stop_ids.shape[1]] + [len(s) for s in stops])
        new_stops = np.full((n, width), -2, dtype=np.int64)
        for b, s in enumerate(stops):
            new_stops[b, : len(s)] = s
        old_stops = np.full((len(self), width), -2, dtype=np.int64)
        old_stops[:, : self.stop_ids.shape[1]] = self.stop_ids
        self.stop_ids = np.concatenate([old_stops, new_stops])
        self.requests += reqs
        self.ids += [i for i, _ in items]
        self.outputs += [[] for _ in items]
        cat = lambda a, new: np.concatenate([a, np.asarray(new, dtype=a.dtype).reshape((n,) + a.shape[1:])])  # noqa: E731
        self.prompt_len = cat(self.prompt_len, [len(r.prompt_token_ids) for r in reqs])
        self.max_new = cat(self.max_new, [r.params.max_new_tokens for r in reqs])
        self.seeds = cat(self.seeds, [r.params.seed for r in reqs])
        zeros = lambda a: cat(a, np.zeros((n,) + a.shape[1:]))  # noqa: E731
        self.generated, self.finish = zeros(self.generated), zeros(self.finish)
        for name in ("steps", "drafted", "accepted", "tested", "k_sum", "no_draft", "branch", "histogram", "per_position",
                     "overlap_sum"):
            setattr(self, name, zeros(getattr(self, name)))

    def keep(self, order: Sequence[int]) -> None:
        """Keep the slots in `order`, in that order."""
        idx = np.asarray(order, dtype=np.int64)
        self.requests = [self.requests[i] for i in order]
        self.ids = [self.ids[i] for i in order]
        self.outputs = [self.outputs[i] for i in order]
        for name in ("prompt_len", "generated", "max_new", "seeds", "stop_ids", "finish", "steps", "drafted", "accepted",
                     "tested", "k_sum", "no_draft", "branch", "histogram", "per_position", "overlap_sum"):
            setattr(self, name, getattr(self, name)[idx])

    def advance(self, kept: Sequence[Sequence[int]]) -> None:
        """Count the tokens each row kept, with no verdict (the draft side's copy of `emit`)."""
        self.generated += np.fromiter((len(k) for k in kept), dtype=np.int64, count=len(kept))

    def room(self) -> np.ndarray:
        """[B] drafts worth verifying: the tokens each row may still emit, minus the bonus."""
        left = np.minimum(self.max_new - self.generated, self.max_model_len - self.prompt_len - self.generated)
        room = np.clip(left - 1, 0, self.K)
        return np.where(self.generated == 0, 0, room) if self.feature_draft else room

    def emit(self, verdict: Verdict, offered: np.ndarray) -> list[list[int]]:
        """Append each row's emitted tokens up to its first stop condition, update the statistics,
        and return the tokens kept per row (for the runners' commit)."""
        tokens, n_acc = verdict.tokens, verdict.num_accepted  # [B, W], [B]
        B, W = tokens.shape
        pos = np.arange(W)[None, :]  # [1, W]
        emitted = pos < (n_acc + 1)[:, None]  # [B, W]
        stop = (tokens[:, :, None] == self.stop_ids[:, None, :]).any(-1) & emitted  # [B, W]
        done = self.generated[:, None] + pos + 1  # [B, W] tokens generated once position w is kept
        length = ((done >= self.max_new[:, None]) | (self.prompt_len[:, None] + done >= self.max_model_len)) & emitted
        end = stop | length  # [B, W]
        finished = end.any(axis=1)  # [B]
        first = np.where(finished, end.argmax(axis=1), W)  # [B]
        n_keep = np.minimum(n_acc + 1, first + 1)  # [B]
        rows = np.arange(B)
        self.finish = np.where(finished, np.where(stop[rows, np.minimum(first, W - 1)], STOP, LENGTH), self.finish)
        self.generated += n_keep
        kept = [tokens[b, : n_keep[b]].tolist() for b in range(B)]
        for out, new in zip(self.outputs, kept):
            out += new
        # Statistics (SpecDecodeStats.observe, vectorised).
        K = self.K
        self.steps += 1
        self.k_sum += offered
        self.no_draft += offered == 0
        self.drafted += verdict.num_drafted
        self.accepted += n_acc
        self.tested += verdict.num_tested
        np.add.at(self.histogram, (rows, n_acc), 1)
        self.per_position += np.arange(K)[None, :] < n_acc[:, None]
        self.overlap_sum += verdict.overlap_sums()
        if verdict.branch_accepts is not None:
            self.branch += verdict.branch_accepts
        return kept

    def stats(self, b: int) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.K, num_spec_steps=int(self.steps[b]), num_draft_tokens=int(self.drafted[b]),
            num_accepted_draft_tokens=int(self.accepted[b]), acceptance_histogram=self.histogram[b].tolist(),
            accepted_per_position=self.per_position[b].tolist(), overlap_sum=float(self.overlap_sum[b]),
            num_tested_positions=int(self.tested[b]), speculation_length_sum=int(self.k_sum[b]),
            num_steps_without_drafts=int(self.no_draft[b]), num_branch_accepts=int(self.branch[b]),
        )

    def result(self, b: int) -> GenerationResult:
        req = self.requests[b]
        reason = _REASONS.get(int(self.finish[b]), "length")
        return GenerationResult(req.request_id, list(req.prompt_token_ids), list(self.outputs[b]), reason, self.stats(b))
