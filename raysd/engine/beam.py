"""Speculative beam search in one process: continuous batching of prompts, W target rows each.

A prompt's W running beams are W rows of the target's static cache (and of a draft model's).
Each pass:
  1. propose: the beam drafter's tree per row, at most K deep (raysd.engine.beam_drafters);
  2. verify: one target forward over every row's last token and its tree (StaticRunner.forward_tree);
  3. replay: beam selection level by level from those logits (raysd.core.beam.replay), as the
     target's own beam search (Hugging Face `generate(num_beams=W, do_sample=False)`) selects;
  4. reorder: row i becomes a copy of the row its new beam descends from, grown by the beam's
     new tokens: the tree nodes on its path keep their cached keys and values (`commit_path`),
     the last token is fed at the next pass. Rows are copied (`gather`), never recomputed;
  5. retire: a prompt whose finished hypotheses can no longer change frees its W rows, and its
     best num_return_sequences hypotheses are its results, best first.

Without a drafter (NoBeamDrafter) every pass is one level: the target's plain beam search.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from raysd.core.beam import BeamConfig, BeamGroup, BeamTree, Replayed, Walk, replay
from raysd.core.speculation import SpeculationConfig
from raysd.core.stats import BatchStats, SpecDecodeStats
from raysd.engine.batch import fill_holes
from raysd.engine.beam_drafters import BeamDrafter, NoBeamDrafter
from raysd.engine.cache_rows import CacheRows
from raysd.engine.requests import Admission, GenerationResult, Request
from raysd.models.loading import max_model_len, output_vocab_size
from raysd.models.static_runner import StaticRunner

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class BeamEngineConfig:
    beam: BeamConfig = field(default_factory=BeamConfig)
    num_speculative_tokens: int = 4  # K: the drafted trees' depth; a pass advances at most K + 1 levels
    max_batch_size: int = 8  # prompts decoded together, W target rows each
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None  # prompt + generated tokens; None: the models' own limit
    linear_kernels: str = "auto"  # the target's linear layers (EngineConfig.linear_kernels)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")


def beam_request_error(request: Request) -> str | None:
    """Why a request cannot run as beam search (greedy settings only), or None."""
    p = request.params
    if not p.greedy or p.top_k or p.top_p != 1.0:
        return f"beam search is deterministic: it takes greedy settings only (temperature 0), got temperature {p.temperature}"
    if p.stop:
        return "beam search does not take stop strings (stop token ids and EOS only)"
    if p.logprobs:
        return "beam search does not return logprobs (each row has its beam_score)"
    return None


@dataclass
class _Prompt:
    """A prompt in flight: its caller's index, request and beam search, the row of each running
    beam, and the drafted nodes that lay on a selected beam."""

    index: int
    request: Request
    group: BeamGroup
    rows: list[int]
    selected: int = 0


@dataclass
class BeamTimings:
    passes: int = 0
    levels: int = 0  # summed over prompts
    prompt_passes: int = 0  # prompts in flight, summed over passes
    draft_s: float = 0.0
    verify_s: float = 0.0  # the target pass and the replay
    reorder_s: float = 0.0  # both caches' row copies and commits
    prefill_s: float = 0.0
    generated_tokens: int = 0  # the returned hypotheses'
    wall_s: float = 0.0


class BeamSearchEngine:
    """Beam search of the target, speculated by a beam drafter, over continuously batched prompts."""

    def __init__(self, target: PreTrainedModel, drafter: BeamDrafter | None, config: BeamEngineConfig):
        self.config, self.W = config, config.beam.num_beams
        # Levels a tree drafts below each pass's own; no drafter: one level per pass.
        self.num_speculative_tokens = config.num_speculative_tokens if drafter is not None else 0
        self.drafter = drafter or NoBeamDrafter()
        limits = [max_model_len(target)] + ([self.drafter.max_model_len] if self.drafter.max_model_len else [])
        spec = SpeculationConfig(num_speculative_tokens=self.num_speculative_tokens,
                                 eos_token_ids=config.eos_token_ids, max_model_len=config.max_model_len)
        self.admission = Admission.of(spec, output_vocab_size(target), limits)
        self.rows = CacheRows(StaticRunner(target, linear_kernels=config.linear_kernels))
        self.prompts: list[_Prompt] = []  # in row order: prompt p holds rows p W .. p W + W - 1
        # One entry per prompt, in SpecDecodeStats' terms: a step is a target pass, a draft a tree
        # node, an accepted draft a level beyond the one each pass computes (so that
        # mean_acceptance_length is the levels advanced per pass).
        self.stats = BatchStats(self.num_speculative_tokens)
        self.timings = BeamTimings()

    def generate(self, requests: Sequence[Request]) -> list[list[GenerationResult]]:
        """Each request's best num_return_sequences hypotheses (best first; one error result for a
        request that cannot run), in request order."""
        admitted, refused = self.admission.split(requests)
        results: dict[int, list[GenerationResult]] = {i: [r] for i, r in refused.items()}
        waiting = deque()
        for i, request in admitted:
            if (error := beam_request_error(request)) is not None:
                results[i] = [GenerationResult(request.request_id, list(request.prompt_token_ids), [], "error",
                                               SpecDecodeStats(self.num_speculative_tokens), error)]
            else:
                waiting.append((i, request))
        start = time.perf_counter()
        while waiting or self.prompts:
            free = self.config.max_batch_size - len(self.prompts)
            if waiting and free:
                self._admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
            for prompt, stats in self._pass():
                results[prompt.index] = self._results(prompt, replace(stats, num_beam_nodes_selected=prompt.selected))
        self.timings.wall_s += time.perf_counter() - start
        return [results[i] for i in range(len(requests))]

    def _admit(self, items: Sequence[tuple[int, Request]]) -> None:
        """W rows per prompt, its prompt prefilled once and copied (CacheRows.add_rows shares it)."""
        t0 = time.perf_counter()
        W, first = self.W, self.rows.runner.num_rows
        prompts = [list(r.prompt_token_ids) for _, r in items for _ in range(W)]
        self.rows.add_rows(prompts)
        self.drafter.add_rows(prompts)
        for n, (i, request) in enumerate(items):
            p = request.params
            stops = (() if p.ignore_eos else self.admission.spec.eos_token_ids) + p.stop_token_ids
            room = min(p.max_new_tokens, self.admission.max_model_len - len(request.prompt_token_ids))
            rows = list(range(first + n * W, first + (n + 1) * W))
            self.prompts.append(_Prompt(i, request, BeamGroup(self.config.beam, stops, room), rows))
        self.stats.add(len(items))
        self.timings.prefill_s += time.perf_counter() - t0

    def _pass(self) -> list[tuple[_Prompt, SpecDecodeStats]]:
        """One target pass for every prompt in flight (module docstring); returns those that finished."""
        t0 = time.perf_counter()
        groups, rows = [p.group for p in self.prompts], [p.rows for p in self.prompts]
        # A tree K deep lets a pass reach K + 1 levels; no deeper than the levels a prompt has left.
        depths = [min(self.num_speculative_tokens, g.max_new - g.generated - 1) for g in groups]
        tree = self.drafter.propose(groups, rows, depths)
        t1 = time.perf_counter()
        logits = self._verify(tree)  # [R, N + 1, V]
        outcome = replay(groups, rows, logits, tree)
        t2 = time.perf_counter()
        self._count(outcome, depths, [sum(len(tree.tokens[r]) for r in p.rows) for p in self.prompts])
        finished = self._reorder(outcome, max(tree.depth(r) for r in range(len(tree.tokens))) if tree.tokens else 0)
        t = self.timings
        t.passes, t.prompt_passes = t.passes + 1, t.prompt_passes + len(groups)
        t.draft_s, t.verify_s, t.reorder_s = t.draft_s + t1 - t0, t.verify_s + t2 - t1, t.reorder_s + time.perf_counter() - t2
        return finished

    def _verify(self, tree: BeamTree) -> torch.Tensor:
        """One target forward over every row's pending token (its beam's last) and its tree."""
        device, R = self.rows.device, len(tree.tokens)
        N = max(tree.num_nodes, default=0)
        tokens = torch.zeros(R, N, dtype=torch.int64)
        parents = torch.full((R, N), -1, dtype=torch.int64)
        for r, (ts, ps) in enumerate(zip(tree.tokens, tree.parents)):
            tokens[r, : len(ts)], parents[r, : len(ps)] = torch.tensor(ts, dtype=torch.int64), torch.tensor(ps, dtype=torch.int64)
        num = torch.tensor(tree.num_nodes, dtype=torch.int64)
        return self.rows.feed_tree(tokens.to(device), parents.to(device), num.to(device))

    def _count(self, outcome: Sequence[Replayed], depths: Sequence[int], nodes: Sequence[int]) -> None:
        levels = np.array([out.levels for out in outcome], dtype=np.int64)  # [P]
        zeros = np.zeros(len(outcome), dtype=np.int64)
        self.stats.observe(depths, nodes, levels - 1, zeros, zeros.astype(np.float64), branch=zeros)
        for prompt, out in zip(self.prompts, outcome):
            prompt.selected += out.selected_nodes
        self.timings.levels += int(levels.sum())

    def _reorder(self, outcome: Sequence[Replayed], fed_depth: int) -> list[tuple[_Prompt, SpecDecodeStats]]:
        """Both caches' rows to the new running beams (each prompt's block of W rows: a beam takes
        the row it descends from when no better beam did, else a row a beam left; `_assign`); the
        blocks of finished prompts are dropped, the last blocks moving into their places."""
        W = self.W
        alive = [not p.group.done for p in self.prompts]
        order: list[int] = []
        new_tokens: list[tuple[int, ...]] = []
        paths: list[tuple[int, ...]] = []
        kept = fill_holes(alive)
        for slot, b in enumerate(kept):
            prompt = self.prompts[b]
            block = list(range(b * W, (b + 1) * W))
            placed = _assign(outcome[b].walks, block)
            prompt.rows = [slot * W + block.index(row) for row in placed]
            by_row = dict(zip(placed, outcome[b].walks))
            for row in block:
                walk = by_row[row]
                order.append(walk.row)
                new_tokens.append(walk.tokens)
                paths.append(walk.nodes)
        self.rows.gather(order)
        self.rows.commit_path(new_tokens, paths, fed_depth)
        self.drafter.reorder(order, new_tokens, paths)
        finished = [(p, self.stats.row(b)) for b, p in enumerate(self.prompts) if p.group.done]
        self.prompts = [self.prompts[b] for b in kept]
        self.stats.keep(kept)
        return finished

    def _results(self, prompt: _Prompt, stats: SpecDecodeStats) -> list[GenerationResult]:
        request, group = prompt.request, prompt.group
        out = []
        for h in group.results():
            reason = "stop" if h.tokens and h.tokens[-1] in group.eos else "length"
            out.append(GenerationResult(request.request_id, list(request.prompt_token_ids), list(h.tokens), reason,
                                        stats, beam_score=h.score))
            self.timings.generated_tokens += len(h.tokens)
        return out


def _assign(walks: Sequence[Walk], block: Sequence[int]) -> list[int]:
    """The row each new beam takes in its prompt's block: the row it descends from where no
    earlier beam took it (no copy: its tree path is kept in place), else a row left free."""
    taken: set[int] = set()
    rows: list[int | None] = []
    for walk in walks:
        rows.append(walk.row if walk.row not in taken else None)
        taken.add(walk.row)
    free = iter(r for r in block if r not in taken)
    return [r if r is not None else next(free) for r in rows]
