"""Every program a job's steps will replay, captured before its first step (raysd.models.cuda_graphs).

A graph is keyed by its program (the verify of K drafts per row, the draft's K steps, a catch-up
feed), its rows' bucket, its attended width and its inputs' shapes. A job knows all of them before
its first step: its batch size bounds the rows (`row_buckets`), its longest request bounds the
attended width (`attend_buckets`), and the speculation config bounds K: the configured K and, for a
plain step, 0; with `-k auto` every K from 0 up, and the catch-up feeds a drafter needs after plain
steps. So nothing is captured or run eagerly in steady state: not when a row finishes (the next
bucket is there), not when the controller changes K, not when rows grow past a width bucket.
A proposal narrower than a captured width is padded to it (drafts no row counts: the verify's
result is the same), and a draft model drafts up to the next captured K (its drafts past a row's
room are never verified), so the widths captured are all a step ever uses.

Captures run each program on zeros (a padding row's input: nothing is fed). The buffers are grown
to their final size first, since growing them drops every graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from raysd.core.sampling import SamplingTensors
from raysd.engine.cache_rows import CATCH_UP_WIDTHS
from raysd.engine.drafters import PENDING, DraftModelDrafter, Drafter, NoDrafter, Proposal
from raysd.models.cuda_graphs import attend_bucket, attend_buckets, row_buckets
from raysd.models.static_runner import StaticRunner

if TYPE_CHECKING:
    from raysd.core.speculation import SpeculationConfig
    from raysd.engine.adaptive import KController
    from raysd.engine.step import DraftSide
    from raysd.engine.target import TargetSide
    from raysd.models.cuda_graphs import GraphCounts


@dataclass(frozen=True)
class CapturePlan:
    """What a job's steps can run: at most `rows` rows, each of at most `max_length` tokens; verifies
    of the drafts per row in `verify_widths` (0: plain decoding), draft programs of the K in
    `draft_ks`, and `catch_up` feeds (a drafter left behind by plain steps)."""

    rows: int
    max_length: int
    verify_widths: tuple[int, ...]
    draft_ks: tuple[int, ...]
    catch_up: bool


def capture_plan(drafter: Drafter, k: int, adaptive: bool, rows: int, max_length: int) -> CapturePlan:
    """The plan of a job of `rows` rows of up to `max_length` tokens with K = `k` (the most, under an
    adaptive controller, which may plan any K from 0 up to it). A draft model drafts the planned K
    (rounded up to a captured one); NoDrafter never drafts; a model-free drafter proposes as many as
    it finds, so every width up to K."""
    ks = tuple(range(1, k + 1)) if adaptive else ((k,) if k else ())
    if isinstance(drafter, NoDrafter):
        widths, draft_ks = (0,), ()
    elif type(drafter) is DraftModelDrafter:
        widths, draft_ks = (0, *ks), ks
    else:
        widths, draft_ks = tuple(range(k + 1)), ()
    return CapturePlan(rows, max_length, widths, draft_ks, adaptive and bool(draft_ks))


def zeros_like_rows(inputs: Sequence[torch.Tensor], rows: int) -> tuple[torch.Tensor, ...]:
    """Zeros of each input's trailing shape and dtype, `rows` rows: what a padding row is fed."""
    return tuple(t.new_zeros(rows, *t.shape[1:]) for t in inputs)


def capture_ahead(draft: DraftSide, target: TargetSide, spec: SpeculationConfig, controller: KController | None,
                  rows: int, max_length: int) -> tuple[GraphCounts, GraphCounts]:
    """Capture every program the steps of up to `rows` rows of up to `max_length` tokens each can
    replay under `spec`, on both sides (where they have graphs), and hold `controller` to the chains
    captured. Call with the first rows admitted: a program's inputs take their shapes from the rows'
    state and their sampling flags from the rows' parameters. Returns the captures' counts on each
    side (target, draft), for the step timings."""
    plan, draft_counts = capture_draft_ahead(draft, spec, controller, rows, max_length)
    return capture_target_ahead(target, plan), draft_counts


def capture_draft_ahead(draft: DraftSide, spec: SpeculationConfig, controller: KController | None, rows: int,
                        max_length: int) -> tuple[CapturePlan, GraphCounts]:
    """The draft side of `capture_ahead` (a split replica's draft actor): the plan (`capture_plan`:
    its verify widths are the target's to capture), the draft model's programs, the widths it
    drafts up to and the chains `controller` may plan; with the captures' counts."""
    plan = capture_plan(draft.drafter, spec.num_speculative_tokens, spec.adaptive is not None, rows, max_length)
    before = draft.graph_counts()
    if isinstance(draft.drafter, DraftModelDrafter):
        draft.drafter.draft_widths = plan.draft_ks
    _capture_drafts(draft.drafter, plan, SamplingTensors.from_params(draft.batch.params, draft.device), len(draft))
    if controller is not None:  # the chains it plans are those captured
        controller.ks = plan.draft_ks or tuple(w for w in plan.verify_widths if w)
    return plan, draft.graph_counts().minus(before)


def capture_target_ahead(target: TargetSide, plan: CapturePlan) -> GraphCounts:
    """The target side of `capture_ahead`: the verify of each of the plan's widths, which its steps
    round a proposal up to; with the captures' counts."""
    before = target.graph_counts()
    target.verify_widths = plan.verify_widths
    _capture_verifies(target, plan, SamplingTensors.from_params(target.batch.params, target.device))
    return target.graph_counts().minus(before)


def _capture_verifies(target: TargetSide, plan: CapturePlan, sampling: SamplingTensors) -> None:
    """The target's verify of each width of the plan (TargetSide.verify_program), fed zero drafts."""
    runner = target.rows.runner
    if not (isinstance(runner, StaticRunner) and runner.graphs is not None and target._programs):
        return
    runner.reserve(plan.rows, attend_bucket(plan.max_length + 1 + max(plan.verify_widths)))
    target._sampling = sampling
    B, V = len(target.batch), target.vocab_size
    for width in plan.verify_widths:
        ids = torch.zeros(B, width, dtype=torch.int64, device=target.device)
        proposal = Proposal(ids, ids.new_zeros(B), torch.zeros(B, width, V, device=target.device), (0,) * B,
                            one_hot=sampling.all_greedy)
        inputs, flags = target.verify_inputs(proposal, width)
        P = inputs[0].shape[1]
        _capture_all(runner, plan, ("verify", P, width, *flags), target.program_fn(width, flags), inputs, P + width)


def _capture_drafts(drafter: Drafter, plan: CapturePlan, sampling: SamplingTensors, rows: int) -> None:
    """A draft model's K steps for each K of the plan (DraftModelDrafter.draft_program), and its
    catch-up feeds."""
    runner = getattr(getattr(drafter, "rows", None), "runner", None)
    if not (plan.draft_ks and isinstance(runner, StaticRunner) and runner.graphs is not None):
        return
    K = max(plan.draft_ks)
    runner.reserve(plan.rows, attend_bucket(plan.max_length + PENDING + K))
    drafter.reserve_probs(runner.cache.capacity[0], K)
    for k in plan.draft_ks:
        inputs = drafter.draft_inputs(k, sampling, torch.zeros(rows, k, device=runner.device))
        _capture_all(runner, plan, *drafter.program(k, sampling), inputs, PENDING + k - 1)
    if plan.catch_up:
        for width in CATCH_UP_WIDTHS:
            chunk = torch.zeros(1, width, dtype=torch.int64, device=runner.device)
            _capture_all(runner, plan, *runner.feed_program(width), (chunk, chunk.bool(), chunk[:, 0]), width)


def _capture_all(runner: StaticRunner, plan: CapturePlan, program: tuple, fn, inputs: Sequence[torch.Tensor],
                 advance: int) -> None:
    """`program` for every row bucket and attended width the plan's steps can reach."""
    for rows in row_buckets(plan.rows, runner.cache.capacity[0]):
        for attend in attend_buckets(plan.max_length + advance, runner.max_cache_len):
            runner.graphs.capture_at(program, fn, zeros_like_rows(inputs, rows), attend)
