"""Suffix decoding: a model-free drafter that learns from the job.

SuffixDecoding (Oliaro et al., arXiv 2411.04975, NeurIPS 2025; in vLLM through Snowflake's Arctic
Inference) matches the end of a row against (a) the row's own prompt and output and (b) every prompt
and output finished earlier in the job, and drafts what followed there. Taken from it:
  * every suffix length n = 1 .. max_match is matched, in both sources;
  * from a suffix's occurrences the draft follows the most frequent next token, scored by its
    empirical conditional probability count(path + x) / count(path); it stops where the product of
    these (the estimated chance that the whole prefix is accepted) drops below min_token_prob, or at
    max_spec_factor * n + max_spec_offset tokens (the adaptive length: a short match is weak evidence);
  * of all (source, n) candidates, the one of largest score = the sum of those products (the
    expected number of accepted drafts under the empirical model);
  * trees: a node's rank-r child is its r-th most frequent next token (on raysd.core.tree_shape);
  * the job's cache is bounded and evicts the oldest sequences first (Arctic's max_cached_requests).
Not taken: the suffix tree. Occurrences are found on flat token arrays instead (numpy): a posting list
per token holds the occurrences of the row's last token, and a longer suffix keeps those whose
preceding tokens match too; no memory per tree node, cheap insertion and eviction. To bound the work
per row, only the most recent max_occurrences occurrences of its last token count (all of them but for
the most frequent tokens of a large index), where a suffix tree counts every one. What a proposal
costs per row, against a few hundred finished sequences and against a large index, is printed by
tests/engine/test_suffix.py::test_proposal_cost.

Drafts are deterministic: draft_probs is one-hot and the rejection test keeps outputs exact. Which
tokens a seed gives (not their law) can depend on which rows finished before, as those change drafts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from raysd.core.speculation import SuffixConfig
from raysd.core.tree_shape import TreeShape
from raysd.engine.drafters import Drafter, Proposal

SELF, OTHER = 0, 1  # where a draft came from: the row's own tokens, or the rows finished before it
PROVENANCE = ("drafted_self", "drafted_other", "accepted_self", "accepted_other")
MATCH_BLOCK = 16  # suffix positions compared per numpy pass: long matches in few passes, few wasted


class _Growing:
    """An int64 array appended to in amortised O(1); the unused tail (at least one entry) holds -1,
    which ends every continuation read past the last token."""

    def __init__(self, values=(), capacity: int = 16):
        self.data, self.size = np.full(capacity, -1, dtype=np.int64), 0
        self.extend(values)

    def extend(self, values) -> None:
        need = self.size + len(values)
        if need >= len(self.data):
            data = np.full(max(need + 1, 2 * len(self.data)), -1, dtype=np.int64)
            data[: self.size] = self.data[: self.size]
            self.data = data
        self.data[self.size : need] = values
        self.size = need

    def copy(self) -> "_Growing":
        twin = _Growing.__new__(_Growing)
        twin.data, twin.size = self.data.copy(), self.size
        return twin


class SuffixIndex:
    """Every finished sequence (prompt and output) of a replica, shared by its drafters: one flat
    array, each sequence after a -1 separator (no match crosses it), and per token the positions
    where it occurs (increasing). At most `max_sequences` sequences and `max_tokens` tokens are
    kept, the oldest evicted first; a sequence longer than max_tokens keeps its last tokens. Memory:
    about 26 bytes per kept token (tokens and postings, int64; 50 MB at 2M), twice that before a compaction."""

    def __init__(self, max_sequences: int = 10_000, max_tokens: int = 2_000_000):
        if max_sequences < 0 or max_tokens < 0:
            raise ValueError(f"index bounds must be >= 0, got {max_sequences}, {max_tokens}")
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.buf = _Growing([-1])  # position 0: a separator, so a match never reads before the array
        self.postings: dict[int, _Growing] = {}
        self.spans: deque[tuple[int, int]] = deque()  # [start, stop) of each live sequence, oldest first
        self.num_tokens = 0  # live tokens
        # What the rows that finished into this index drafted and had accepted, by source (SELF, OTHER):
        # drafted self, drafted other, accepted self, accepted other (`provenance`).
        self.finished_counts = np.zeros(4, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.spans)

    def provenance(self) -> dict[str, int]:
        """Drafts (a tree's: its nodes) proposed and accepted, from a row itself and from other rows,
        summed over every row that finished into this index (whatever drafter held it)."""
        return dict(zip(PROVENANCE, map(int, self.finished_counts)))

    def sequences(self) -> list[list[int]]:
        return [self.buf.data[a:b].tolist() for a, b in self.spans]

    def insert(self, tokens: Sequence[int]) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)[max(0, len(tokens) - self.max_tokens) :]
        if not len(tokens) or not self.max_tokens or not self.max_sequences:
            return
        start = self.buf.size
        self.buf.extend(tokens)
        self.buf.extend([-1])
        self.spans.append((start, start + len(tokens)))
        self.num_tokens += len(tokens)
        self._post(np.arange(start, start + len(tokens)))
        while len(self.spans) > self.max_sequences or self.num_tokens > self.max_tokens:
            a, b = self.spans.popleft()
            self.num_tokens -= b - a
        if self.spans[0][0] > self.buf.size // 2:  # the dead prefix is over half: copy the live part down
            self._compact()

    def occurrences(self, token: int) -> np.ndarray:
        """Live positions of `token`, increasing (older sequences first)."""
        post = self.postings.get(token, _Growing((), 1))
        live = post.data[: post.size]
        return live[np.searchsorted(live, self.spans[0][0]) :] if post.size else live

    def _post(self, positions: np.ndarray) -> None:
        tokens = self.buf.data[positions]
        order = np.argsort(tokens, kind="stable")  # groups by token, positions still increasing
        tokens, positions = tokens[order], positions[order]
        cuts = np.flatnonzero(np.diff(tokens)) + 1
        for group, token in zip(np.split(positions, cuts), tokens[np.r_[0, cuts]].tolist()):
            self.postings.setdefault(token, _Growing()).extend(group)

    def _compact(self) -> None:
        shift = self.spans[0][0] - 1  # the oldest live sequence's separator goes to position 0
        live = self.buf.data[shift : self.buf.size]
        self.buf, self.postings = _Growing(live, len(live) + 16), {}
        self.spans = deque((a - shift, b - shift) for a, b in self.spans)
        self._post(np.flatnonzero(self.buf.data[: self.buf.size] >= 0))


# ---------------------------------------------------------------- matching and choosing (free functions)


def suffix_matches(buf: np.ndarray, ends: np.ndarray, own: np.ndarray, max_match: int) -> list[tuple[int, np.ndarray]]:
    """The occurrences in `buf` of the row's last n tokens, as the positions where they end, for the
    longest n of each distinct set (a longer suffix keeps a subset), n <= max_match, longest first.
    `own` is the row's buffer (-1, then its L tokens); `ends` the occurrences of its last token."""
    if not ends.size:
        return []
    L, M = len(own) - 1, min(len(own) - 1, max_match)
    lengths = np.zeros(len(ends), dtype=np.int64)  # [m] how many of the row's last tokens end at each
    alive = np.arange(len(ends))  # occurrences matched so far on every position compared
    for lo in range(0, M, MATCH_BLOCK):
        j = np.arange(lo, min(lo + MATCH_BLOCK, M))  # [b] distances before the row's last token
        same = buf[np.maximum(ends[alive, None] - j, 0)] == own[L - j]  # [m, b]; position 0 is a -1
        run = np.where(same.all(axis=1), len(j), same.argmin(axis=1))  # [m] up to the first difference
        lengths[alive] += run
        alive = alive[run == len(j)]
        if not alive.size:
            break
    return [(int(n), ends[lengths >= n]) for n in np.unique(lengths)[::-1]]


def ranked_next(following: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens in `following` (what follows each occurrence, oldest first; -1 where its
    sequence ended) and their counts: most frequent first, ties to the most recent."""
    following = following[::-1][following[::-1] >= 0]  # most recent first, ended ones out
    tokens, first, counts = np.unique(following, return_index=True, return_counts=True)
    order = np.lexsort((first, -counts))
    return tokens[order], counts[order]


def greedy_path(buf: np.ndarray, ends: np.ndarray, max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Follow the most frequent next token from the occurrences `ends`, at most max_tokens: the tokens
    and, per token, the product of the empirical conditional probabilities up to it, cut before it
    drops below min_prob. An occurrence whose sequence ended counts in the denominator."""
    tokens, probs, p = [], [], 1.0
    while len(tokens) < max_tokens and ends.size:
        r = max_tokens - len(tokens)
        # What follows every occurrence, r tokens on ([m, r]; past the array: its last entry, a -1).
        ahead = buf[np.minimum(ends[:, None] + np.arange(1, r + 1), len(buf) - 1)]
        agree = (ahead == ahead[0]).all(axis=0) & (ahead[0] >= 0)  # [r] every occurrence goes on alike
        run = r if agree.all() else int(agree.argmin())  # certain tokens: copied in one pass
        tokens += ahead[0, :run].tolist()
        probs += [p] * run
        if run == r:
            break
        nexts, counts = ranked_next(ahead[:, run])  # they part (or some ended): the most frequent
        if not nexts.size or p * counts[0] / ends.size < min_prob:
            break
        p *= float(counts[0] / ends.size)
        tokens.append(int(nexts[0]))
        probs.append(p)
        ends = ends[ahead[:, run] == nexts[0]] + run + 1
    return tokens, probs


@dataclass
class Candidate:
    tokens: list[int]
    probs: list[float]  # per draft: the estimated chance that the drafts up to it are all accepted
    source: int  # SELF or OTHER
    buf: np.ndarray  # where the match was found, and its occurrences (a tree branches from them)
    ends: np.ndarray
    depth: int  # the most drafts the match allowed

    @property
    def score(self) -> float:
        return float(sum(self.probs))


def best_candidate(sources: Sequence[tuple[np.ndarray, np.ndarray]], own: np.ndarray, k: int,
                   config: SuffixConfig) -> Candidate | None:
    """Of every (source, match length) the draft of largest score; ties go to the row itself, then to
    the longer match. `sources`: (buffer, occurrences of the row's last token), SELF then OTHER."""
    best = None
    for source, (buf, first) in enumerate(sources):
        for n, ends in suffix_matches(buf, first, own, config.max_match):
            depth = min(k, int(n * config.max_spec_factor + config.max_spec_offset + 1e-9))
            if n < config.min_match or (best is not None and best.score >= depth):  # cannot win
                continue
            tokens, probs = greedy_path(buf, ends, depth, config.min_token_prob)
            if tokens and (best is None or sum(probs) > best.score):
                best = Candidate(tokens, probs, source, buf, ends, depth)
    return best


def tree_tokens(candidate: Candidate, shape: TreeShape, depth: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Tokens of `shape`'s first nodes (at most min(depth, the match's) deep) and their estimated
    acceptance: node (r_1, .., r_d) holds the r_d-th most frequent next token after its parent's path,
    so the rank-0 chain is the candidate's chain. A node without such a token, or below min_prob,
    repeats its previous sibling (a repeat of a rejected one-hot draft is rejected for sure) or, at
    rank 0, its parent's token; the tree is cut after the deepest level holding a real token."""
    buf, depth = candidate.buf, min(depth, candidate.depth)
    pools: dict[int, tuple[np.ndarray, float]] = {-1: (candidate.ends, 1.0)}  # node -> (occurrences, probability)
    ranked: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out, conf, reach = [], [], 0
    for i in range(shape.nodes_within(depth)):
        up, rank, d = shape.parents[i], shape.ranks[i], shape.depths[i]
        ends, p = pools.get(up, (buf[:0], 0.0))
        if up not in ranked:
            ranked[up] = ranked_next(buf[ends + 1])
        nexts, counts = ranked[up]
        q = float(p * counts[rank] / ends.size) if rank < len(nexts) else 0.0
        if q > 0 and q >= min_prob:
            out.append(int(nexts[rank]))
            pools[i], reach = (ends[buf[ends + 1] == nexts[rank]] + 1, q), d
        else:
            out.append(out[i - 1] if rank else (out[up] if up >= 0 else int(buf[candidate.ends[0]])))
        conf.append(q if i in pools else 0.0)
    n = shape.nodes_within(reach)
    return out[:n], conf[:n]


# ---------------------------------------------------------------- the drafter


class SuffixDrafter(Drafter):
    """SuffixDecoding over the row's own tokens and a `SuffixIndex` of the finished rows, which several
    drafters (one per micro-batch) of a replica may share; a row's tokens join it when `select`
    drops the row. After each propose, `last_confidence` ([B, K] float64, or [B, N] after a tree;
    0 where nothing was drafted) holds each draft's estimated chance that it and the drafts before it
    (its path, in a tree) are accepted, for an adaptive K. `provenance()` counts drafts by source."""

    name = "suffix"
    supports_trees = True

    def __init__(self, vocab_size: int, index: SuffixIndex | None = None, config: SuffixConfig = SuffixConfig(),
                 device="cpu"):
        self.vocab_size, self.device, self.config = vocab_size, device, config
        self.index = SuffixIndex(config.max_cached_sequences, config.max_cached_tokens) if index is None else index
        self.rows: list[_Growing] = []  # per row: -1, then its prompt and output
        self.drafts: list[tuple[list[int], int]] = []  # per row: the last proposal's tokens and source
        self.counts = np.zeros((0, 4), dtype=np.int64)  # [B, 4] drafted self, other, accepted self, other (PROVENANCE)
        self.last_confidence = np.zeros((0, 0))
        self._planned: list[Candidate | None] | None = None  # `confidence`'s candidates, for the next propose

    def add_rows(self, prompts):
        self._planned = None
        self.rows += [_Growing([-1, *p], 2 * len(p) + 16) for p in prompts]
        self.drafts += [([], SELF)] * len(prompts)
        self.counts = np.concatenate([self.counts, np.zeros((len(prompts), 4), dtype=np.int64)])

    def select(self, rows):
        self._planned = None
        kept = set(rows)
        for b, row in enumerate(self.rows):
            if b not in kept:  # finished: the job learns its tokens
                self.index.insert(row.data[1 : row.size])
                self.index.finished_counts += self.counts[b]
        self.rows = [self.rows[i] for i in rows]
        self.drafts = [self.drafts[i] for i in rows]
        self.counts = self.counts[list(rows)]

    def gather(self, rows: Sequence[int]) -> None:
        """Row i becomes a copy of row rows[i], repeats allowed (beam search's reordering, which
        keeps the rows it drops out of the index: they are beams, not finished rows)."""
        self._planned = None
        self.rows = [self.rows[i].copy() for i in rows]
        self.drafts = [self.drafts[i] for i in rows]
        self.counts = self.counts[list(rows)]

    def commit(self, new_tokens, num_accepted=None):
        for b, new in enumerate(new_tokens):
            drafted, source = self.drafts[b]
            # A rejected one-hot draft is never emitted in its place, so the common prefix is what was accepted.
            agree = next((i for i, (d, t) in enumerate(zip(drafted, new)) if d != t), min(len(drafted), len(new)))
            self.counts[b, 2 + source] += agree if num_accepted is None else min(agree, num_accepted[b])
            self.rows[b].extend(new)
        self.drafts = [([], SELF)] * len(self.rows)

    def commit_path(self, new_tokens: Sequence[Sequence[int]], path: Sequence[Sequence[int]]) -> None:
        for b, (new, nodes) in enumerate(zip(new_tokens, path)):
            self.counts[b, 2 + self.drafts[b][1]] += min(len(nodes), len(new))
            self.rows[b].extend(new)
        self.drafts = [([], SELF)] * len(self.rows)

    def provenance(self) -> dict[str, int]:
        """Drafts proposed (a tree's: its nodes) and drafts accepted, from the row itself and from other
        rows: this drafter's rows in flight, and every row that finished into its index."""
        total = self.index.finished_counts + self.counts.sum(axis=0)
        return dict(zip(PROVENANCE, map(int, total)))

    def candidate(self, b: int, k: int) -> Candidate | None:
        """Row b's best draft of at most k tokens."""
        row = self.rows[b]
        if k <= 0 or row.size < 2:
            return None
        own, last = row.data[: row.size], int(row.data[row.size - 1])
        self_ends = np.flatnonzero(own[1:-1] == last) + 1  # earlier occurrences of the last token
        R = self.config.max_occurrences
        return best_candidate([(row.data, self_ends[-R:]), (self.index.buf.data, self.index.occurrences(last)[-R:])],
                              own, k, self.config)

    def confidence(self, max_drafts: Sequence[int]) -> np.ndarray:
        """[B, K]: each row's best candidate (kept for this step's `propose`), its drafts' estimated
        chance of acceptance (Candidate.probs), 0 past them."""
        self._planned = [self.candidate(b, int(k)) for b, k in enumerate(max_drafts)]
        out = np.zeros((len(max_drafts), max(max_drafts, default=0)))  # [B, K]
        for b, c in enumerate(self._planned):
            if c is not None:
                out[b, : len(c.probs)] = c.probs
        return out

    def propose(self, max_drafts, sampling, uniforms):
        planned, self._planned = self._planned, None
        if planned is not None:  # the candidates `confidence` estimated, cut to the plan's length
            return self._propose(max_drafts, lambda c, k: (c.tokens[:k], c.probs[:k]), planned)
        return self._propose(max_drafts, lambda c, k: (c.tokens, c.probs))

    def propose_tree(self, shape: TreeShape, max_depths: Sequence[int], sampling, uniforms) -> Proposal:
        """The best candidate's occurrences branched on `shape` (`tree_tokens`), at most max_depths[b]
        deep. Deterministic one-hot candidates: the exact tree verification applies whatever they are."""
        self._planned = None
        return self._propose(max_depths, lambda c, depth: tree_tokens(c, shape, depth, self.config.min_token_prob))

    def _propose(self, limits: Sequence[int], draft, candidates: Sequence[Candidate | None] | None = None) -> Proposal:
        """Each row's best candidate (or the given ones) drafted by `draft(candidate, limit)`, one-hot;
        keeps the confidence and the provenance."""
        drafts, confidence = [], []
        for b, k in enumerate(limits):
            c = self.candidate(b, int(k)) if candidates is None else candidates[b]
            c = c if c is not None and int(k) > 0 else None
            tokens, conf = ([], []) if c is None else draft(c, int(k))
            drafts.append(tokens)
            confidence.append(conf)
            self.drafts[b] = (tokens, SELF if c is None else c.source)
            self.counts[b, self.drafts[b][1]] += len(tokens)
        self.last_confidence = np.zeros((len(drafts), max(map(len, drafts), default=0)))  # [B, K]
        for b, c in enumerate(confidence):
            self.last_confidence[b, : len(c)] = c
        return Proposal.of_drafts(drafts, self.vocab_size, self.device)
