"""The rows in flight, as arrays.

A step's verdict (raysd.engine.verdict) is read back from the device once and applied by both
sides (raysd.engine.step). The rows' state is one entry per batch slot, updated once per step
from the verdict.

Slot b is row b of the side's runner. Budgets, stop sets, emitted-token counts and the rows'
statistics (raysd.core.stats.BatchStats) live in numpy arrays indexed by slot, so the
bookkeeping after a step is a handful of vectorised operations on the step's one read-back,
whatever the batch size. Both sides of a step keep a Batch and apply the same verdicts to it
(`accept`, `keep`), so they agree on every row's room and acceptance without being told.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from raysd.core.params import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.core.stats import BatchStats
from raysd.engine.requests import GenerationResult, Request
from raysd.engine.verdict import Verdict

LENGTH, STOP = 1, 2  # finish reasons, as codes
_REASONS = {LENGTH: "length", STOP: "stop"}
_NO_TOKEN = -2  # pads each row's stop set (never a token id)


class Batch:
    """Slots of requests being generated. `add` appends, `keep` selects (the runners' order).

    `spec.max_model_len` must be resolved (raysd.engine.requests.Admission). `feature_draft`: the
    drafter reads the target's features (EAGLE), which a row has only after its first target
    pass, so a row's first step offers no drafts."""

    def __init__(self, spec: SpeculationConfig, feature_draft: bool = False, decode: Callable[[list[int]], str] | None = None):
        assert spec.max_model_len is not None, "a batch needs the resolved max_model_len (Admission.of)"
        self.spec, self.num_speculative_tokens, self.max_model_len = spec, spec.num_speculative_tokens, spec.max_model_len
        self.feature_draft = feature_draft
        self.decode = decode  # token ids -> text (the target's tokenizer), for stop strings
        self.requests: list[Request] = []
        self.ids: list[int] = []  # caller's index of each slot's request
        self.outputs: list[list[int]] = []
        i64 = lambda *shape: np.zeros(shape, dtype=np.int64)  # noqa: E731
        self.prompt_len, self.generated, self.max_new, self.seeds = i64(0), i64(0), i64(0), i64(0)
        self.stop_ids = np.full((0, 1), _NO_TOKEN, dtype=np.int64)  # [B, S]
        self.finish = i64(0)  # 0 while running, else LENGTH or STOP
        self.stats = BatchStats(self.num_speculative_tokens)
        # Rows whose requests asked for them: each emitted token's log-probability, and the top tokens'.
        self.logprobs: list[list[float] | None] = []
        self.top_logprobs: list[list[list[tuple[int, float]]] | None] = []
        self.searched: list[int] = []  # per row: characters of its text already searched for stop strings

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def params(self) -> list[SamplingParams]:
        return [r.params for r in self.requests]

    def add(self, items: Sequence[tuple[int, Request]]) -> None:
        n = len(items)
        reqs = [r for _, r in items]
        eos = self.spec.eos_token_ids
        stops = [(() if r.params.ignore_eos else eos) + r.params.stop_token_ids for r in reqs]
        width = max([self.stop_ids.shape[1]] + [len(s) for s in stops])
        stop_ids = np.full((len(self) + n, width), _NO_TOKEN, dtype=np.int64)
        stop_ids[: len(self), : self.stop_ids.shape[1]] = self.stop_ids
        for b, s in enumerate(stops):
            stop_ids[len(self) + b, : len(s)] = s
        self.stop_ids = stop_ids
        self.requests += reqs
        self.ids += [i for i, _ in items]
        self.outputs += [[] for _ in items]
        self.logprobs += [[] if r.params.logprobs else None for r in reqs]
        self.top_logprobs += [[] if r.params.top_logprobs else None for r in reqs]
        self.searched += [0] * n
        cat = lambda a, new: np.concatenate([a, np.asarray(new, dtype=np.int64)])  # noqa: E731
        self.prompt_len = cat(self.prompt_len, [len(r.prompt_token_ids) for r in reqs])
        self.max_new = cat(self.max_new, [r.params.max_new_tokens for r in reqs])
        self.seeds = cat(self.seeds, [r.params.seed for r in reqs])
        self.generated, self.finish = cat(self.generated, [0] * n), cat(self.finish, [0] * n)
        self.stats.add(n)

    def keep(self, order: Sequence[int]) -> None:
        """Keep the slots in `order`, in that order."""
        idx = np.asarray(order, dtype=np.int64)
        for name in ("requests", "ids", "outputs", "logprobs", "top_logprobs", "searched"):
            setattr(self, name, [getattr(self, name)[i] for i in order])
        for name in ("prompt_len", "generated", "max_new", "seeds", "stop_ids", "finish"):
            setattr(self, name, getattr(self, name)[idx])
        self.stats.keep(order)

    def tokens_left(self) -> np.ndarray:
        """[B] the tokens each row may still emit (its budget, or the context's end)."""
        return np.minimum(self.max_new - self.generated, self.max_model_len - self.prompt_len - self.generated)

    def room(self) -> np.ndarray:
        """[B] drafts worth verifying: the tokens each row may still emit, minus the bonus."""
        room = np.clip(self.tokens_left() - 1, 0, self.num_speculative_tokens)
        return np.where(self.generated == 0, 0, room) if self.feature_draft else room

    def cut_at_stops(self, tokens: np.ndarray, num_accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each row's emitted tokens end: its accepted drafts and the recovered or bonus
        token ([B, W] `tokens`, the first num_accepted + 1 of each row), cut after its first stop
        token, its budget or the context. Returns [B] tokens kept and [B] finish codes (0: runs on)."""
        B, W = tokens.shape
        pos = np.arange(W)[None, :]  # [1, W]
        emitted = pos < (num_accepted + 1)[:, None]  # [B, W]
        stop = (tokens[:, :, None] == self.stop_ids[:, None, :]).any(-1) & emitted  # [B, W]
        done = self.generated[:, None] + pos + 1  # [B, W] tokens generated once position w is kept
        length = ((done >= self.max_new[:, None]) | (self.prompt_len[:, None] + done >= self.max_model_len)) & emitted
        end = stop | length  # [B, W]
        finished = end.any(axis=1)  # [B]
        first = np.where(finished, end.argmax(axis=1), W)  # [B]
        n_keep = np.minimum(num_accepted + 1, first + 1)  # [B]
        codes = np.where(finished, np.where(stop[np.arange(B), np.minimum(first, W - 1)], STOP, LENGTH), 0)
        return n_keep, codes

    def stop_at_strings(self, tokens: np.ndarray, n_keep: np.ndarray, codes: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
        """Rows with stop strings (SamplingParams.stop) end at the first kept token whose decoding
        completes one; the tokens after it are never emitted. Checked incrementally: only the text
        past what earlier steps searched (less a stop string's length) is searched, and a row is
        decoded token by token only in the step where a stop string appears. Returns `n_keep`,
        the finish `codes` (STOP for those rows) and their output text, cut before the stop string
        (or after it, with include_stop_str_in_output), by row."""
        texts: dict[int, str] = {}
        for b, request in enumerate(self.requests):
            stops = request.params.stop
            if not stops or not n_keep[b]:
                continue
            new = tokens[b, : n_keep[b]].tolist()
            start = max(0, self.searched[b] - max(map(len, stops)) + 1)
            text = self.decode(self.outputs[b] + new)
            if not any(stop in text[start:] for stop in stops):
                self.searched[b] = len(text)
                continue
            for j in range(len(new)):  # the first token whose text holds a stop string
                text = self.decode(self.outputs[b] + new[: j + 1])
                hits = [(at, stop) for stop in stops if (at := text.find(stop, start)) >= 0]
                if hits:
                    at, stop = min(hits)
                    n_keep[b], codes[b] = j + 1, STOP
                    texts[b] = text[: at + len(stop)] if request.params.include_stop_str_in_output else text[:at]
                    break
        return n_keep, codes, texts

    def accept(self, verdict: Verdict) -> None:
        """The step's kept tokens and statistics, row by row (both sides apply the same verdict)."""
        self.generated += np.fromiter((len(k) for k in verdict.kept), dtype=np.int64, count=len(verdict.kept))
        for out, new in zip(self.outputs, verdict.kept):
            out += new
        if verdict.logprobs is not None:
            for b, (lp, kept) in enumerate(zip(self.logprobs, verdict.kept)):
                if lp is not None:
                    lp += verdict.logprobs[b, : len(kept)].tolist()
        if verdict.top_logprobs is not None:
            ids, values = verdict.top_logprobs  # [B, W, N]
            for b, (top, kept) in enumerate(zip(self.top_logprobs, verdict.kept)):
                if top is not None:
                    n = self.requests[b].params.top_logprobs
                    top += [list(zip(ids[b, w, :n].tolist(), values[b, w, :n].tolist())) for w in range(len(kept))]
        self.finish = np.where(verdict.finish != 0, verdict.finish, self.finish)
        for _ in range(verdict.steps):  # a plain run's steps (merge_plain) each count, their counts all 0
            self.stats.observe(verdict.offered, verdict.drafted, verdict.accepted, verdict.tested, verdict.overlap,
                               verdict.branch)

    def result(self, b: int, acceptance: str, text: str | None = None) -> GenerationResult:
        """Row b's result; `text`: its output cut at a stop string (stop_at_strings), if one ended it."""
        req = self.requests[b]
        reason = _REASONS.get(int(self.finish[b]), "length")
        return GenerationResult(req.request_id, list(req.prompt_token_ids), list(self.outputs[b]), reason,
                                self.stats.row(b), acceptance=acceptance, text=text, logprobs=self.logprobs[b],
                                top_logprobs=self.top_logprobs[b])


def fill_holes(alive: Sequence[bool]) -> list[int]:
    """The rows to keep, in an order that moves as few as possible: each finished row's slot
    is taken by a surviving row from the end of the batch (a static cache copies only those)."""
    n = sum(alive)
    movers = [i for i in range(n, len(alive)) if alive[i]]
    return [i if alive[i] else movers.pop() for i in range(n)]
