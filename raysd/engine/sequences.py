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

from raysd.models.runner import ModelRunner


class SequenceState:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pending: list[list[int]] = []
        self._spec: list[tuple[torch.Tensor, torch.Tensor]] = []  # fed drafts: ([B, E] ids, [B] counts)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def add_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        """New rows at the end; their prompts (all but the last token) are prefilled apart
        and merged in, so one long prompt does not widen every row's next step."""
        assert not self._spec, "add rows between steps"
        n_old = self.runner.num_rows
        with_prefix = [i for i, p in enumerate(prompts) if len(p) > 1]
        fresh = ModelRunner(self.runner.model, self.runner.vocab_size)
        if with_prefix:
            fresh.add_rows(len(with_prefix))
            ids, valid = _right_aligned([list(prompts[i][:-1]) for i in with_prefix], self.device)
            fresh.forward(ids, valid, torch.ones(len(with_prefix), dtype=torch.int64, device=self.device))
        self.runner.merge(fresh)
        empty = [i for i in range(len(prompts)) if len(prompts[i]) <= 1]
        self.runner.add_rows(len(empty))
        order = with_prefix + empty
        if empty and with_prefix:
            slot = {row: n_old + k for k, row in enumerate(order)}
            self.runner.select(list(range(n_old)) + [slot[i] for i in range(len(prompts))])
        self.pending.extend([list(p[-1:]) if len(p) > 1 else list(p) for p in prompts])

    def select(self, rows: Sequence[int]) -> None:
        assert not self._spec, "select rows between steps"
        self.runner.select(rows)
        self.pending = [self.pending[i] for i in rows]

    def feed(self, extra: torch.Tensor, extra_counts: torch.Tensor, num_logits: torch.Tensor) -> torch.Tensor:
        """Feed each row's pending tokens followed by its first extra_counts[b] speculative tokens.

        Args:
            extra: [B, E] speculative token ids (E may be 0).
            extra_counts: [B] how many of them are real per row.
            num_logits: [B] logits wanted at the last num_logits[b] fed tokens.
        Returns:
            [B, n, V] logits, left-aligned per row (see ModelRunner.forward).
        """
        B, E = extra.shape
        plen = torch.tensor([len(p) for p in self.pending], dtype=torch.int64, device=self.device)  # [B]
        P = int(plen.max()) if B else 0
        pend, _ = _left_aligned(self.pending, P, self.device)  # [B, P]
        combined = torch.cat([pend, extra], dim=1)  # [B, P + E]
        total = plen + extra_counts  # [B] real tokens per row
        W = P + E
        offset = torch.arange(W, device=self.device)[None, :] - (W - total)[:, None]  # [B, W] index into the row
        source = torch.where(offset < plen[:, None], offset, P + offset - plen[:, None]).clamp(0, max(W - 1, 0))
        valid = offset >= 0
        ids = torch.where(valid, combined.gather(1, source), 0)
        logits = self.runner.forward(ids, valid, num_logits)
        self.pending = [[] for _ in range(B)]
        if E:
            self._spec.append((extra, extra_counts))
        return logits

    def commit(self, new_tokens: Sequence[Sequence[int]]) -> None:
        """Make `new_tokens[b]` (at least one per row) the next committed tokens of row b."""
        spec = self._speculative_lists()
        self._spec = []
        drop = []
        for b, new in enumerate(new_tokens):
            assert new, "every row commits at least one token"
            fed = spec[b]
            keep = 0
            while keep < min(len(fed), len(new) - 1) and fed[keep] == new[keep]:
                keep += 1
            drop.append(len(fed) - keep)
            self.pending[b] = self.pending[b] + list(new[keep:])
        self.runner.rollback(self.runner.lengths - torch.tensor(drop, dtype=torch.int64, device=self.device))

    def _speculative_lists(self) -> list[list[int]]:
        rows: list[list[int]] = [[] for _ in range(self.runner.num_rows)]
        for ids, counts in self._spec:
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


def _right_aligned(rows: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        if row:
            ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.int64)
            valid[b, width - len(row) :] = True
    return ids.to(device), valid.to(device)
