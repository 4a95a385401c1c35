"""The step's two halves (raysd.engine.step), driven directly as the Ray actors drive them."""

from __future__ import annotations

import pytest

from raysd.core.sampling import SamplingParams
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.rows import Request
from raysd.engine.step import DraftSide, RowLimits, TargetSide
from raysd.engine.verifier import TargetVerifier
from tests.conftest import VOCAB, tiny_model
from tests.engine.test_equivalence import hf_greedy, prompts


def run_sides(target, draft, prompt_list, k_schedule, max_new: int, params=None):
    """Drive both halves with the given K per step (cycled); returns tokens and the draft runner's
    row count before each step."""
    limits = RowLimits(num_speculative_tokens=4, max_model_len=512)
    target_side = TargetSide(TargetVerifier(target), limits)
    drafter = DraftModelDrafter(draft, VOCAB)
    draft_side = DraftSide(drafter, limits, "cpu")
    params = params or SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    items = [(i, Request(i, p, params)) for i, p in enumerate(prompt_list)]
    target_side.add(items)
    draft_side.add(items)
    results, draft_rows, step = {}, [], 0
    while len(target_side):
        k = k_schedule[step % len(k_schedule)]
        draft_rows.append((k, drafter.seqs.runner.num_rows))
        outcome = target_side.verify(draft_side.propose(k), k)
        draft_side.commit(outcome.kept, outcome.accepted, outcome.keep)
        results.update(outcome.finished)
        step += 1
    return [results[i] for i in range(len(prompt_list))], draft_rows


def test_a_cold_draft_does_no_work_until_a_step_asks_for_drafts():
    """K = 0 steps leave the drafter empty (no prefill); the first K > 0 step prefills it with
    every row's tokens so far, and greedy output stays the target's own."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    ps = prompts(seed=3)[:3]
    results, draft_rows = run_sides(target, draft, ps, [0, 0, 0, 3, 0, 4], max_new=16)
    assert [rows for k, rows in draft_rows[:4]] == [0, 0, 0, 0]  # cold through three K = 0 steps
    assert draft_rows[4][1] == 3  # warm from the first K > 0 step on
    for p, r in zip(ps, results):
        assert r.token_ids == hf_greedy(target, p, 16)
    assert results[0].stats.num_steps_without_drafts >= 3


def test_an_all_plain_schedule_never_touches_the_draft():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    ps = prompts(seed=4)[:2]
    results, draft_rows = run_sides(target, draft, ps, [0], max_new=6)
    assert all(rows == 0 for _, rows in draft_rows)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 6) for p in ps]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sides_give_the_engines_tokens(temperature):
    """The engine is the two halves in one process: same seeds, same tokens, same statistics."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=5, layers=1)
    ps = prompts(seed=5)[:4]
    params = SamplingParams(temperature=temperature, max_new_tokens=10, seed=7, ignore_eos=True)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(num_speculative_tokens=4, max_batch_size=4))
    expected = engine.generate([Request(i, p, params) for i, p in enumerate(ps)])
    got, _ = run_sides(target, draft, ps, [4], max_new=10, params=params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.stats for r in got] == [r.stats for r in expected]


def test_row_limits_are_validated():
    with pytest.raises(ValueError):
        RowLimits(num_speculative_tokens=-1, max_model_len=64)
    with pytest.raises(ValueError):
        RowLimits(num_speculative_tokens=4, max_model_len=1)
    limits = RowLimits(4, 16)
    assert limits.first_room(Request(0, (1, 2, 3), SamplingParams(max_new_tokens=2))) == 1  # 2 tokens: 1 draft + bonus
    assert limits.first_room(Request(0, tuple(range(14)), SamplingParams(max_new_tokens=100))) == 1  # context: 2 left
