"""What a step plans (`Plan`), decides (`Verdict`) and spends (`StepTimings`), and what a replica's
loop measured over its steps (`LoopStats`): plain records.

A verdict is the one record of a step, read back from the device once and applied by both sides
(raysd.engine.step); the Ray actors send it on through a job's replica (raysd.actors.coordinator),
which only reads and forwards it. Nothing here imports torch, so that process imports none: a
feature draft's `Verdict.features` are tensors, unpickled where they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Sequence

import numpy as np

from raysd.core.tree_shape import TreeShape, tree_shape
from raysd.engine.requests import GenerationResult

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Plan:
    """What a step drafts: up to `k` drafts per row (each capped by its room), or with
    `tree_budget` P > 0 the tree tree_shape(P, K) cut at depth k; k = 0 is plain decoding."""

    k: int
    tree_budget: int = 0

    def tree(self, depth: int) -> TreeShape | None:
        """The draft tree both sides grow (the configured depth K), or None for a chain."""
        return tree_shape(self.tree_budget, depth) if self.tree_budget else None


@dataclass(frozen=True)
class Verdict:
    """What one step decided for every row, in the step's row order: the one record of a step,
    read back from the device once. Both sides apply it (`commit`); the Ray actors send it on."""

    plan: Plan
    kept: tuple[tuple[int, ...], ...]  # each row's accepted drafts, then its recovered or bonus token, cut at its stop
    finish: np.ndarray  # [B] 0: the row runs on, else raysd.engine.batch.LENGTH or STOP
    offered: np.ndarray  # [B] drafts the row was allowed: min(room, k)
    drafted: np.ndarray  # [B] drafts (a tree's nodes) the target verified
    accepted: np.ndarray  # [B] drafts accepted (the accepted depth): both caches keep them
    tested: np.ndarray  # [B] positions whose rejection test ran
    overlap: np.ndarray  # [B] float64: sum_x min(target_probs, draft_probs) summed over the tested positions
    keep: tuple[int, ...] | None  # rows left once finished ones retire (fill_holes order); None: all
    finished: tuple[tuple[int, GenerationResult], ...]  # (caller's index, result) of the rows that ended
    # A tree: the nodes each row's accepted path went through (the draft keeps that branch), the
    # accepted nodes that were not a rank-0 child, and the walk counted by rank over the rows.
    path: tuple[tuple[int, ...], ...] | None = None
    branch: np.ndarray | None = None
    rank_offered: tuple[int, ...] = ()
    rank_moved: tuple[int, ...] = ()
    # A feature draft (EAGLE): each row's target features [n, H] of the positions it cached for good
    # this step (a new row's prompt first); else None.
    features: tuple[torch.Tensor, ...] | None = None
    # Rows that asked for them (SamplingParams.logprobs): the target's log-probability of each
    # emitted token [B, W], and the top tokens' ids and log-probabilities ([B, W, N] each); else None.
    logprobs: np.ndarray | None = None
    top_logprobs: tuple[np.ndarray, np.ndarray] | None = None
    steps: int = 1  # the plain steps this verdict stands for (`merge_plain`); 1 for any other

    @property
    def step_overlap(self) -> float:
        return float(self.overlap.sum())

    @property
    def step_tested(self) -> int:
        return int(self.tested.sum())


def merge_plain(verdicts: Sequence[Verdict]) -> Verdict:
    """One verdict for consecutive plain steps (K = 0) of the same rows, as if one step had emitted
    them all: each row's tokens in order, the statistics summed, and the last step's finish,
    retirements and results (a run of plain steps ends at the first that retires a row, so only
    the last may). What a draft actor applies after a target ran several plain steps in one call
    (raysd.actors.model_actors.TargetActor)."""
    assert verdicts, "at least one step"
    if len(verdicts) == 1:
        return verdicts[0]
    *earlier, last = verdicts
    assert all(v.plan.k == 0 and v.path is None and v.features is None for v in verdicts), "plain steps only"
    assert all(v.keep is None and not v.finished for v in earlier), "only a run's last step retires rows"
    assert len({len(v.kept) for v in verdicts}) == 1, "the same rows in every step"

    def cat(arrays):
        return None if arrays[0] is None else np.concatenate(arrays, axis=1)

    top = None
    if last.top_logprobs is not None:
        top = (cat([v.top_logprobs[0] for v in verdicts]), cat([v.top_logprobs[1] for v in verdicts]))
    return Verdict(
        plan=last.plan,
        kept=tuple(tuple(t for row in rows for t in row) for rows in zip(*(v.kept for v in verdicts))),
        finish=last.finish,
        offered=sum(v.offered for v in verdicts), drafted=sum(v.drafted for v in verdicts),
        accepted=sum(v.accepted for v in verdicts), tested=sum(v.tested for v in verdicts),
        overlap=sum(v.overlap for v in verdicts),
        keep=last.keep, finished=last.finished,
        logprobs=cat([v.logprobs for v in verdicts]), top_logprobs=top,
        steps=sum(v.steps for v in verdicts),
    )


@dataclass
class StepTimings:
    """Seconds and counts over the steps a hook has seen (and, filled by the engine that runs
    them, its admissions and wall time)."""

    draft_s: float = 0.0  # proposing (a cold drafter's deferred prefill excluded)
    verify_s: float = 0.0  # the target pass, the rejection test, the read-back, the bookkeeping
    prefill_s: float = 0.0  # prompts: both sides' at admission, a cold drafter's at its first drafting step
    steps: int = 0
    drafted_steps: int = 0  # steps with k > 0
    row_steps: int = 0  # rows decoded, summed over steps: occupancy = row_steps / (steps x batch slots)
    generated_tokens: int = 0  # tokens the steps emitted (each row's kept tokens)
    wall_s: float = 0.0
    borrowed_steps: int = 0  # steps run on another process's lent CPU threads too (raysd.actors.turns)
    # Both models' forwards (raysd.models.cuda_graphs.GraphCounts): programs replayed from CUDA graphs (a
    # draft's K steps, a verify: one each), step forwards run eagerly (0 in steady state with graphs),
    # graphs captured and their seconds (torch.compile's compiles included), torch.compile's compiles and
    # the seconds of the forwards that made them (a job's start-up counted too: SpecEngine.capture), and
    # the bytes of weights and attended keys/values the forwards read.
    graph_replays: int = 0
    eager_forwards: int = 0
    graph_captures: int = 0
    capture_s: float = 0.0
    compiles: int = 0
    compile_s: float = 0.0
    bytes_read: int = 0

    def add_counts(self, counts) -> None:
        """Add a GraphCounts difference (raysd.models.cuda_graphs) to the forwards' counts."""
        self.graph_replays += counts.replays
        self.eager_forwards += counts.eager_forwards
        self.graph_captures += counts.captures
        self.capture_s += counts.capture_s
        self.compiles += counts.compiles
        self.compile_s += counts.compile_s
        self.bytes_read += counts.bytes_read


# The fields a LoopStats adds from each call's StepTimings under the same name.
_CALL_FIELDS = ("steps", "drafted_steps", "borrowed_steps", "graph_replays", "eager_forwards", "graph_captures", "draft_s")


@dataclass
class LoopStats:
    """What a replica's loop measured, summed: the one record that travels from each call's
    StepTimings (the coordinator's loop) through the replica's reports and the job's totals to the
    summary, whose `time_breakdown` is a view of it (`breakdown`). Records add field by field;
    `first_step_at` and `last_step_at` (wall-clock times) keep the earliest and the latest."""

    start_s: float = 0.0  # a replica's start: its model actors, models and tokenizer
    tokenize_s: float = 0.0  # prompts to token ids (chat template included)
    queue_wait_s: float = 0.0  # summed over rows: from submission to admission
    draft_s: float = 0.0  # proposing: a draft actor's calls, or a colocated drafter's share of the target's
    verify_s: float = 0.0  # the target's calls, a colocated drafter's proposing excluded
    detokenize_s: float = 0.0  # token ids to text
    engine_loop_s: float = 0.0  # the loop at work, its idle time excluded: the calls in flight and the loop's own work
    engine_idle_s: float = 0.0  # the loop with no row to run (its input starved)
    steps: int = 0  # engine steps (one target forward each)
    drafted_steps: int = 0  # of which drafted (K > 0)
    borrowed_steps: int = 0  # of which the target ran on the draft actor's lent threads too
    active_rows: int = 0  # rows in the micro-batches when each step ended, summed over steps
    slot_steps: int = 0  # the replica's slots, summed over steps
    recoveries: int = 0  # times the rows in flight re-ran after a model actor died
    generated_tokens: int = 0
    rung_calls: int = 0  # calls the loop slept through until the target rang (raysd.actors.turns)
    # The target's steps' forwards (StepTimings' counts): replayed from CUDA graphs, run eagerly, graphs captured.
    graph_replays: int = 0
    eager_forwards: int = 0
    graph_captures: int = 0
    first_step_at: float | None = None
    last_step_at: float | None = None

    def add(self, other: LoopStats) -> LoopStats:
        """Add `other` into this record; returns it."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name.endswith("_at"):
                pick = min if f.name.startswith("first_") else max
                setattr(self, f.name, theirs if mine is None else mine if theirs is None else pick(mine, theirs))
            else:
                setattr(self, f.name, mine + theirs)
        return self

    def add_call(self, timings: StepTimings, colocated: bool) -> None:
        """One call's StepTimings: its steps and forwards, and its seconds split between the sides (a
        colocated call's wall holds its drafting too, which `verify_s` leaves out)."""
        for name in _CALL_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(timings, name))
        self.verify_s += timings.wall_s - (timings.draft_s if colocated else 0.0)

    def since(self, earlier: LoopStats) -> LoopStats:
        """What was measured after `earlier` (a copy of this record, taken then); the times kept."""
        return LoopStats(**{f.name: getattr(self, f.name) if f.name.endswith("_at") else getattr(self, f.name) - getattr(earlier, f.name)
                            for f in fields(self)})

    @property
    def occupancy(self) -> float | None:
        """Mean rows in the micro-batches over steps / the slots: 1 when every step ran full."""
        return self.active_rows / self.slot_steps if self.slot_steps else None

    @property
    def overlap_efficiency(self) -> float | None:
        """(draft + verify - loop) / the shorter of the two: 1 when the shorter side hid behind the
        longer, 0 when they ran one after the other, below 0 when coordination cost more than both."""
        shorter = min(self.draft_s, self.verify_s)
        return (self.draft_s + self.verify_s - self.engine_loop_s) / shorter if shorter > 0 else None

    def breakdown(self) -> dict:
        """The summary's time_breakdown entries this record holds: each `X_s` field as `X`, in
        seconds; `occupancy`; `drafted_steps`, the fraction of steps that drafted."""
        out = {f.name[:-2]: round(getattr(self, f.name), 3) for f in fields(self) if f.name.endswith("_s")}
        out["occupancy"] = None if self.occupancy is None else round(self.occupancy, 4)
        out["drafted_steps"] = round(self.drafted_steps / self.steps, 4) if self.steps else None
        return out
