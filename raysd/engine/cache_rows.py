"""Which tokens each row of a runner's KV cache holds, and which it still has to read.

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

import numpy as np
import torch

from raysd.core.device import host_to_device, padded_rows
from raysd.models.runner import Runner

CATCH_UP_WIDTHS = (4, 16)  # catch_up's forward widths: `short`, `piece` (raysd.engine.graphs captures both)


class CacheRows:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.pending: list[list[int]] = []
        self.cached: list[int] = []  # host copy of runner.lengths after each commit (read nothing back)
        self._spec: list[tuple[torch.Tensor, torch.Tensor, Sequence[int] | None]] = []  # fed drafts: ids, counts, host counts
        self._head = 0  # 1 while a fed tree starts with the rows' pending tokens (feed_tree), else 0

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def add_rows(self, prompts: Sequence[Sequence[int]], share: bool = True) -> None:
        """New rows at the end, their prompts (all but the last token) prefilled in the runner.
        With `share`, rows with the same prompt (several samples of one prompt) are prefilled once
        and the others copy its cache (Runner.fork)."""
        assert not self._spec, "add rows between steps"
        prefixes = [tuple(p[:-1]) for p in prompts]
        first: dict[tuple[int, ...], int] = {}  # prefix -> the first row with it
        if share:
            for i, prefix in enumerate(prefixes):
                first.setdefault(prefix, i)
        source = [first.get(prefix, i) for i, prefix in enumerate(prefixes)]  # the row each row's prefill is
        unique = [i for i, src in enumerate(source) if src == i]
        copies = [i for i, src in enumerate(source) if src != i]
        n_old = self.runner.num_rows
        self.runner.add_prefilled([list(prefixes[i]) for i in unique])
        if copies:
            slot = {i: n_old + k for k, i in enumerate(unique)}
            self.runner.fork([slot[source[i]] for i in copies])
            slot.update({i: n_old + len(unique) + k for k, i in enumerate(copies)})
            self.runner.select(list(range(n_old)) + [slot[i] for i in range(len(prompts))])
        self.pending.extend([list(p[-1:]) for p in prompts])
        self.cached.extend(len(p) - 1 for p in prompts)

    def select(self, rows: Sequence[int]) -> None:
        assert not self._spec, "select rows between steps"
        self.runner.select(rows)
        self.pending = [self.pending[i] for i in rows]
        self.cached = [self.cached[i] for i in rows]

    def gather(self, rows: Sequence[int]) -> None:
        """Row i becomes a copy of row rows[i], repeats allowed (StaticRunner.gather): beam search
        reorders its beams so, between `feed_tree` and `commit_path`."""
        assert not self._spec, "gather rows between steps"
        self.runner.gather(rows)
        self.pending = [list(self.pending[i]) for i in rows]
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
            [B, n, V] logits, left-aligned per row (see DynamicRunner.forward).
        """
        B, E = extra.shape
        lengths = [len(p) for p in self.pending]
        P = max(lengths, default=0)
        full = P + E > 0 and min(lengths, default=0) == P and (E == 0 or (host_counts is not None and min(host_counts) == E))
        if full:  # every row feeds P pending and E extra tokens (a decode or draft step): nothing to align
            pend = _left_aligned(self.pending, P, self.device) if P else extra[:, :0]  # [B, P]
            ids = torch.cat([pend, extra], dim=1) if P and E else (pend if P else extra)  # [B, P + E]
            valid = torch.ones(B, P + E, dtype=torch.bool, device=self.device)
        else:
            ids, valid = right_align(*self.pending_inputs(), extra, extra_counts)
        logits = self.runner.forward(ids, valid, num_logits, max_logits)
        self.mark_fed(extra, extra_counts, host_counts)
        return logits

    def pending_inputs(self, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's pending tokens on the device, [B, P] on the left (0-padded; P the most any row
        has, or `width`, at least that), and [B] how many: what `right_align` takes."""
        lengths = [len(p) for p in self.pending]
        P = max(lengths, default=0) if width is None else width
        assert P >= max(lengths, default=0), (P, lengths)
        return _left_aligned(self.pending, P, self.device), host_to_device(lengths, torch.int64, self.device)

    def mark_fed(self, extra: torch.Tensor, extra_counts: torch.Tensor, host_counts: Sequence[int] | None) -> None:
        """After a forward over every row's pending tokens then its first extra_counts[b] of `extra`
        ([B, E]; host_counts: the same on the host, if known): they are in the cache now, the
        extra ones speculative until `commit`."""
        self.cached = [c + len(p) for c, p in zip(self.cached, self.pending)]
        self.pending = [[] for _ in self.pending]
        if extra.shape[1]:
            self._spec.append((extra, extra_counts, host_counts))

    def catch_up(self, keep: int, piece: int = CATCH_UP_WIDTHS[1], short: int = CATCH_UP_WIDTHS[0]) -> None:
        """Feed each row's pending tokens but its last `keep` (a drafter's rows after plain steps,
        whose tokens it was not fed), in forwards of `short` columns when every row's fit, else of
        `piece` columns each (the tokens right-aligned over the pieces, the first piece left-padded):
        a few fixed widths, which a runner with CUDA graphs replays, whatever the rows hold. Their
        logits are not kept. The last `keep` stay pending."""
        older = [p[: len(p) - keep] for p in self.pending]
        n = max(map(len, older), default=0)
        if n == 0:
            return
        width = short if n <= short else -(-n // piece) * piece
        ids_host, valid_host = padded_rows(older, width, right_aligned=True)  # [B, width]
        ids, valid = host_to_device(ids_host, torch.int64, self.device), host_to_device(valid_host, torch.bool, self.device)
        fed = np.asarray(self.cached, dtype=np.int64)  # [B] each row's cached tokens as the pieces go in
        step = min(piece, width)
        for start in range(0, width, step):
            cols = slice(start, start + step)
            self.runner.feed_only(ids[:, cols], valid[:, cols])
            fed += valid_host[:, cols].sum(axis=1)
            self.runner.know_longest(int(fed.max()))  # the host counted: the next piece attends no wider than needed
        self.cached = [c + len(o) for c, o in zip(self.cached, older)]
        self.pending = [p[len(o):] for p, o in zip(self.pending, older)]

    def replace_speculative(self, tokens: torch.Tensor, host_counts: Sequence[int]) -> None:
        """Declare what the cache holds past each row's committed tokens: `tokens[b, :host_counts[b]]`
        ([B, F]), fed already and to be kept by `commit` as far as they are accepted. For a caller
        that fed, verified and rolled back drafts of its own (raysd.engine.draft_assist's middle level)."""
        counts = torch.as_tensor(list(host_counts), dtype=torch.int64, device=self.device)  # [B]
        self._spec = [(tokens.to(self.device), counts, tuple(int(h) for h in host_counts))]

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
        lengths = host_to_device(self.cached, torch.int64, self.device)
        self.runner.rollback(lengths, max(self.cached, default=0))

    def feed_tree(self, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                  start: int = 0) -> torch.Tensor:
        """Feed tree nodes start .. start + T - 1 after each row's cached tokens
        (StaticRunner.forward_tree); nothing is kept until `commit_path`.

        Args:
            tokens: [B, T] the nodes' token ids.
            parents: [B, start + T] parent of every node so far, -1 for the tree's root.
            num_nodes: [B] real nodes among the T (a prefix).
        Returns:
            [B, T, V] logits at the nodes; on the first call (start 0) of a state whose rows each
            have one pending token, [B, T + 1, V]: that token is fed as the tree's head (node 0,
            the root's place), so the first logits are those after it and the target scores
            the pending token and the whole tree in one forward.
        """
        B = tokens.shape[0]
        if start == 0:
            pending = {len(p) for p in self.pending}
            assert pending <= {0} or pending == {1}, "a tree follows one pending token per row, or none"
            self._head = int(pending == {1})
            if self._head:
                head = host_to_device(self.pending, torch.int64, self.device)  # [B, 1]
                tokens, num_nodes = torch.cat([head, tokens], dim=1), num_nodes + 1
                self.pending = [[] for _ in range(B)]
        h = self._head
        parents = torch.where(parents >= 0, parents + h, h - 1)  # the head is the root's children's parent
        if h:
            parents = torch.cat([parents.new_full((B, 1), -1), parents], dim=1)
        return self.runner.forward_tree(tokens, parents, num_nodes, start + h if start else 0)

    def commit_path(self, new_tokens: Sequence[Sequence[int]], path: Sequence[Sequence[int]], fed_depth: int) -> None:
        """After `feed_tree`: make `new_tokens[b]` the next committed tokens of row b. The cache
        keeps the tree's head and the first nodes of the row's accepted path (node indices
        `path[b]`), as many as were fed (`fed_depth` levels) and committed; the runner copies
        only that branch (StaticRunner.keep_path). The rest of the new tokens are pending."""
        h = self._head
        keeps = [min(len(p), fed_depth, len(new) - 1) for p, new in zip(path, new_tokens)]
        nodes = torch.full((len(keeps), h + max(keeps, default=0)), -1, dtype=torch.int64)
        for b, (new, p, keep) in enumerate(zip(new_tokens, path, keeps)):
            assert new, "every row commits at least one token"
            nodes[b, : h + keep] = torch.as_tensor(list(range(h)) + [n + h for n in p[:keep]], dtype=torch.int64)
            self.cached[b] += h + keep
            self.pending[b] = self.pending[b] + list(new[keep:])
        counts = torch.tensor([h + k for k in keeps], dtype=torch.int64)
        self.runner.keep_path(host_to_device(nodes, torch.int64, self.device), host_to_device(counts, torch.int64, self.device),
                              max(self.cached, default=0))
        self._head = 0

    def _speculative_lists(self) -> list[list[int]]:
        rows: list[list[int]] = [[] for _ in range(self.runner.num_rows)]
        for ids, counts, _ in self._spec:
            for b, (row, n) in enumerate(zip(ids.tolist(), counts.tolist())):
                rows[b].extend(row[:n])
        return rows


def right_align(pending: torch.Tensor, num_pending: torch.Tensor, extra: torch.Tensor,
                extra_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pending tokens then its real extra tokens, right-aligned, on the device with no host
    read: the chunk a runner's forward takes.

    Args:
        pending: [B, P] each row's pending tokens on the left (CacheRows.pending_inputs).
        num_pending: [B] how many.
        extra: [B, E] speculative tokens, each row's first extra_counts[b] real.
        extra_counts: [B].
    Returns:
        [B, P + E] token ids (0 where padding) and their validity.
    """
    P, E = pending.shape[1], extra.shape[1]
    W = P + E
    combined = torch.cat([pending, extra], dim=1)  # [B, P + E]
    total = num_pending + extra_counts  # [B] real tokens per row
    offset = torch.arange(W, device=extra.device)[None, :] - (W - total)[:, None]  # [B, W] index into the row
    source = torch.where(offset < num_pending[:, None], offset, P + offset - num_pending[:, None]).clamp(0, max(W - 1, 0))
    valid = offset >= 0
    return torch.where(valid, combined.gather(1, source), 0), valid


def _left_aligned(rows: Sequence[Sequence[int]], width: int, device) -> torch.Tensor:
    """[B, width] ids, each row's on the left, 0-padded on the right, copied to `device` once."""
    return host_to_device(torch.from_numpy(padded_rows(rows, width, right_aligned=False)[0]), torch.int64, device)
