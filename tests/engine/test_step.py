"""One speculative step (raysd.engine.step), driven as the Ray actors drive it: the draft side
proposes in one place, the target's step runs with the received proposal, and the draft side
applies the same verdict."""

from __future__ import annotations

from dataclasses import replace

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.verdict import Plan
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.engine.step import DraftSide, ReceivedPlan, ReceivedProposal, speculative_step
from raysd.engine.target import TargetSide
from tests.conftest import VOCAB, tiny_model
from tests.engine.test_equivalence import hf_greedy, prompts

SPEC = replace(SpeculationConfig(num_speculative_tokens=4), max_model_len=512)


def run_apart(target, draft, prompt_list, k_schedule, max_new: int, params=None):
    """The two sides apart, with the given K per step (cycled); returns the results and the draft
    runner's row count before each step."""
    target_side = TargetSide(target, SPEC)
    drafter = DraftModelDrafter(draft, VOCAB)
    draft_side = DraftSide(drafter, SPEC, "cpu")
    params = params or SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    items = [(i, Request(i, p, params)) for i, p in enumerate(prompt_list)]
    target_side.add(items)
    draft_side.add(items)
    results, draft_rows, step = {}, [], 0
    while len(target_side):
        plan = Plan(k_schedule[step % len(k_schedule)])
        draft_rows.append((plan.k, drafter.rows.runner.num_rows))
        proposal = draft_side.propose(plan)  # in the draft's actor
        verdict = speculative_step(ReceivedProposal(proposal), target_side, ReceivedPlan(SPEC, plan))  # the target's
        draft_side.commit(verdict)  # back in the draft's actor
        results.update(verdict.finished)
        step += 1
    return [results[i] for i in range(len(prompt_list))], draft_rows


def test_a_cold_draft_does_no_work_until_a_step_asks_for_drafts():
    """K = 0 steps leave the drafter empty (no prefill); the first K > 0 step prefills it with
    every row's tokens so far, and greedy output stays the target's own."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    ps = prompts(seed=3)[:3]
    results, draft_rows = run_apart(target, draft, ps, [0, 0, 0, 3, 0, 4], max_new=16)
    assert [rows for k, rows in draft_rows[:4]] == [0, 0, 0, 0]  # cold through three K = 0 steps
    assert draft_rows[4][1] == 3  # warm from the first K > 0 step on
    for p, r in zip(ps, results):
        assert r.token_ids == hf_greedy(target, p, 16)
    assert results[0].stats.num_steps_without_drafts >= 3


def test_an_all_plain_schedule_never_touches_the_draft():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    ps = prompts(seed=4)[:2]
    results, draft_rows = run_apart(target, draft, ps, [0], max_new=6)
    assert all(rows == 0 for _, rows in draft_rows)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 6) for p in ps]


def test_the_sides_apart_give_the_engines_tokens_and_statistics():
    """The engine is the same step with both sides in one process: same seeds, same tokens,
    same statistics, and both sides' rows agree on every count."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    ps = prompts(seed=5)[:4]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=10, seed=7, ignore_eos=True)
        engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(SPEC, max_batch_size=4))
        expected = engine.generate([Request(i, p, params) for i, p in enumerate(ps)])
        got, _ = run_apart(target, draft, ps, [4], max_new=10, params=params)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert [r.stats for r in got] == [r.stats for r in expected]


def test_both_sides_keep_the_same_rows_and_statistics():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(SPEC, max_batch_size=3))
    engine.add([(i, Request(i, p, SamplingParams(max_new_tokens=3 + 2 * i, ignore_eos=True)))
                for i, p in enumerate(prompts(seed=6)[:3])])
    while len(engine.target):
        engine.step()
        t, d = engine.target.batch, engine.draft.batch
        assert t.ids == d.ids and t.generated.tolist() == d.generated.tolist()
        assert t.stats.overlap_sum.tolist() == d.stats.overlap_sum.tolist() and t.room().tolist() == d.room().tolist()


def test_rows_admitted_after_drafting_stay_cold_until_the_next_drafting_step():
    """A draft model gets a row only at a step that drafts (DraftSide._warm_up): rows admitted while
    steps plan K = 0 cost it nothing, whether or not an earlier step drafted, and join its cache
    at the next drafting step, in the batch's order however finished rows' slots were refilled.
    With the draft the target itself, every draft is accepted: the drafter's rows are in sync;
    greedy output is the target's own."""
    target = tiny_model("llama", seed=0)
    ps = prompts(seed=6)[:7]
    lengths = [5, 12, 4, 7, 4, 10, 10]  # rows finish at different steps: freed slots are refilled mid-batch
    schedule = [2, 2, 0, 0, 2, 0, 2, 2, 4, 0]
    engine = SpecEngine(target, DraftModelDrafter(target, VOCAB), EngineConfig(SPEC, max_batch_size=3))
    side, seen, step, reorders = engine.draft, [], [0], []
    select = side.drafter.select

    def recording_select(rows):
        if sorted(rows) == list(range(len(rows))) != list(rows):  # every row, reordered: a warm-up's
            reorders.append(list(rows))
        select(rows)

    side.drafter.select = recording_select

    def plan(draft):
        k = schedule[step[0] % len(schedule)]
        seen.append((k, side.drafter.rows.runner.num_rows, len(side)))
        step[0] += 1
        return Plan(k)

    engine.hook.plan = plan
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                           for i, (p, n) in enumerate(zip(ps, lengths))])
    assert [r.token_ids for r in out] == [hf_greedy(target, p, n) for p, n in zip(ps, lengths)]
    assert all(r.stats.num_accepted_draft_tokens == r.stats.num_draft_tokens for r in out)
    assert sum(r.stats.num_draft_tokens for r in out) > 0
    assert any(k == 0 and 0 < rows < batch for k, rows, batch in seen)  # a warm drafter beside cold rows
    assert reorders  # a refilled slot put a cold row before a warm one: the warm-up restored the batch's order
    assert engine.timings.prefill_s > 0
