"""Which tokens each row of a ModelRunner has cached, and which it still has to read.

A row's tokens are committed (emitted by the engine) or speculative (drafts fed to
the model but not yet verified). Invariants kept here:
  * every committed token the cache lacks is pending, and pending tokens are fed
    before any speculative ones;
  * after `commit`, at least the last committed token is pending, so the next
    forward always yields logits after it.
Rollback is the longest common prefix of the speculative tail and the newly
committed tokens: a recovered token equal to the draft it replaces keeps its
cached key/values, which are the same.
"""

from __future__ import annotations

from typing import Sequence

import torch

from raysd.models.runners import Runner


class SequenceState:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.pending: list[list[int]] = []
        self.cached: list[int] = []  # host copy of runner.lengths after each commit (read nothing back)
        self._spec: list[tuple[torch.Tensor, torch.Tensor, Sequence[int] | None]] = []  # fed drafts: ids, counts, host counts

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        """New rows at the end, their prompts (all but the last token) prefilled in the runner."""
        assert not self._spec, "add rows between steps"
        self.runner.add_prefilled([list(p[:-1]) for p in prompts])
        self.pending.extend([list(p[-1:]) for p in prompts])
        self.cached.extend(len(p) - 1 for p in prompts)

    def select(self, rows: Sequence[int]) -> None:
        assert not self._spec, "select rows between steps"
        self.runner.select(rows)
        self.pending = [self.pending[i] for i in rows]
        self.cached = [self.cached[i] for i in rows]

    def feed(self, extra: torch.Tensor, extra_counts: torch.Tensor, num_logits: torch.Tensor,
             max_logits: int | None = None, host_counts: Sequence[int] | None = None) -> torch.Tensor:
        """Feed each row's pending tokens followed by its first extra_counts[b] speculative tokens.

        Args:
            extra: [B, E] speculative token ids (E may be 0).
            extra_counts: [B] how many of them are real per row.
            num_logits: [B] logits wanted at the last num_logits[b] fed tokens.
            max_logits: max(num_logits) if the caller knows it (saves reading it back).
            host_counts: extra_counts as host ints, if the caller knows them (lets `commit`
                with `num_accepted` roll back without reading the drafts back).
        Returns:
            [B, n, V] logits, left-aligned per row (see ModelRunner.forward).
        """
        B, E = extra.shape
        plen = torch.tensor([len(p) for p in self.pending], dtype=torch.int64, device=self.device)  # [B]
        P = max((len(p) for p in self.pending), default=0)
        pend, _ = _left_aligned(self.pending, P, self.device)  # [B, P]
        combined = torch.cat([pend, extra], dim=1)  # [B, P + E]
        total = plen + extra_counts  # [B] real tokens per row
        W = P + E
        offset = torch.arange(W, device=self.device)[None, :] - (W - total)[:, None]  # [B, W] index into the row
        source = torch.where(offset < plen[:, None], offset, P + offset - plen[:, None]).clamp(0, max(W - 1, 0))
        valid = offset >= 0
        ids = torch.where(valid, combined.gather(1, source), 0)
        logits = self.runner.forward(ids, valid, num_logits, max_logits)
        self.cached = [c + len(p) for c, p in zip(self.cached, self.pending)]
        self.pending = [[] for _ in range(B)]
        if E:
            self._spec.append((extra, extra_counts, host_counts))
        return logits

    def commit(self, new_tokens: Sequence[Sequence[int]], num_accepted: Sequence[int] | None = None) -> None:
        """Make `new_tokens[b]` (at least one per row) the next committed tokens of row b.

        The cache keeps the fed drafts that were committed. With `num_accepted` (drafts the
        rejection test accepted per row) and host counts for every feed, that is the first
        min(num_accepted, fed) of them, found without reading anything back; otherwise it is
        the longest common prefix of what was fed and what is committed."""
        if num_accepted is not None and all(h is not None for _, _, h in self._spec):
            fed = [sum(int(h[b]) for _, _, h in self._spec) for b in range(len(new_tokens))]
            keeps = [min(int(a), f, len(new) - 1) for a, f, new in zip(num_accepted, fed, new_tokens)]
        else:
            spec = self._speculative_lists()
            keeps = []
            for fed_b, new in zip(spec, new_tokens):
                keep = 0
                while keep < min(len(fed_b), len(new) - 1) and fed_b[keep] == new[keep]:
                    keep += 1
                keeps.append(keep)
        self._spec = []
        for b, (new, keep) in enumerate(zip(new_tokens, keeps)):
            assert new, "every row commits at least one token"
            self.cached[b] += keep
            self.pending[b] = self.pending[b] + list(new[keep:])
        lengths = torch.tensor(self.cached, dtype=torch.int64, device=self.device)
        self.runner.rollback(lengths, max(self.cached, default=0))

    def _speculative_lists(self) -> list[list[int]]:
        rows: list[list[int]] = [[] for _ in range(self.runner.num_rows)]
        for ids, counts, _ in self._spec:
            for b, (row, n) in enumerate(zip(ids.tolist(), counts.tolist())):
                rows[b].extend(row[:n])
        return rows


def _left_aligned(rows: Sequence[Sequence[int]], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
        valid[b, : len(row)] = True
    return ids.to(device), valid.to(device)

