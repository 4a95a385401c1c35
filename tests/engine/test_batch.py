"""Batch on hand-built verdicts: exact kept tokens, finish reasons and statistics."""

import dataclasses

import numpy as np

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.batch import Batch
from raysd.engine.verdict import Plan, Verdict
from raysd.engine.requests import Request

EOS = 2


def batch(K: int, max_model_len: int) -> Batch:
    return Batch(SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), max_model_len=max_model_len))


def test_cut_at_stops_ends_at_eos_stop_ids_budget_and_context():
    b = batch(3, max_model_len=12)
    b.add([
        (0, Request("eos", [5, 6], SamplingParams(max_new_tokens=10))),
        (1, Request("stop", [5], SamplingParams(max_new_tokens=10, stop_token_ids=(9,)))),
        (2, Request("budget", [5], SamplingParams(max_new_tokens=2, ignore_eos=True))),
        (3, Request("context", [5] * 9, SamplingParams(max_new_tokens=10))),
        (4, Request("runs", [5], SamplingParams(max_new_tokens=10))),
    ])
    assert b.room().tolist() == [3, 3, 1, 2, 3]
    tokens = np.array([[7, EOS, 8, -1], [9, 4, -1, -1], [EOS, 3, -1, -1], [7, 7, 7, -1], [7, 8, 3, -1]])
    accepted = np.array([2, 1, 1, 2, 2])
    n_keep, finish = b.cut_at_stops(tokens, accepted)
    assert n_keep.tolist() == [2, 1, 2, 3, 3]
    kept = tuple(tuple(tokens[r, : n_keep[r]].tolist()) for r in range(5))
    assert kept == ((7, EOS), (9,), (EOS, 3), (7, 7, 7), (7, 8, 3))
    offered = np.array([3, 3, 1, 2, 3])
    verdict = Verdict(Plan(3), kept, finish, offered, offered, accepted, np.array([3, 2, 1, 2, 3]),
                      np.array([1.1, 1.1, 1.0, 2.0, 1.6]), None, ())
    b.accept(verdict)
    assert [b.result(r, "exact").finish_reason for r in range(4)] == ["stop", "stop", "length", "length"]
    assert b.finish[4] == 0 and b.outputs[4] == [7, 8, 3] and b.generated.tolist() == [2, 1, 2, 3, 3]
    s = b.stats.row(0)
    assert (s.num_spec_steps, s.num_draft_tokens, s.num_accepted_draft_tokens) == (1, 3, 2)
    assert s.acceptance_histogram == [0, 0, 1, 0] and s.accepted_per_position == [1, 1, 0]
    assert s.overlap_sum == 1.1 and s.num_tested_positions == 3 and s.speculation_length_sum == 3


def test_keep_reorders_every_array_and_add_widens_stop_sets():
    b = batch(2, 100)
    b.add([(i, Request(i, [5], SamplingParams(max_new_tokens=4 + i))) for i in range(3)])
    b.add([(3, Request(3, [5], SamplingParams(stop_token_ids=(10, 11, 12))))])
    assert b.stop_ids.shape == (4, 4) and b.stop_ids[3].tolist() == [EOS, 10, 11, 12]
    b.keep([3, 1])
    assert b.ids == [3, 1] and b.max_new.tolist() == [64, 5] and len(b.stats) == 2
    assert b.stop_ids[0].tolist() == [EOS, 10, 11, 12] and b.stop_ids[1].tolist() == [EOS, -2, -2, -2]


def test_plain_steps_merge_into_one_verdict_that_a_batch_applies_as_the_steps():
    """merge_plain: three plain steps of the same two rows, the last retiring row 0 at EOS, become
    one verdict; a batch that applies it holds what one that applies the three holds."""
    import pytest

    from raysd.engine.batch import STOP
    from raysd.engine.verdict import merge_plain

    def step(tokens, finish=(0, 0), keep=None, finished=()):
        zeros = np.zeros(2, dtype=np.int64)
        logprobs = -np.array(tokens, dtype=np.float64)[:, None]  # [B, 1]: one token per row a step
        top = (np.array(tokens, dtype=np.int64)[:, None, None], logprobs[:, :, None])  # [B, 1, 1]
        return Verdict(Plan(0), tuple((t,) for t in tokens), np.array(finish), zeros, zeros, zeros, zeros,
                       np.zeros(2), keep, finished, logprobs=logprobs, top_logprobs=top)

    steps = [step([7, 8]), step([9, 3]), step([EOS, 4], finish=(STOP, 0), keep=(1,), finished=((0, "row 0"),))]
    merged = merge_plain(steps)
    assert merged.kept == ((7, 9, EOS), (8, 3, 4)) and merged.steps == 3
    assert merged.finish.tolist() == [STOP, 0] and merged.keep == (1,) and merged.finished == ((0, "row 0"),)
    assert merged.logprobs.tolist() == [[-7, -9, -EOS], [-8, -3, -4]]
    assert merged.top_logprobs[0][:, :, 0].tolist() == [[7, 9, EOS], [8, 3, 4]]
    assert merge_plain(steps[:1]) is steps[0]

    def applied(verdicts):
        b = batch(2, 100)
        b.add([(i, Request(i, [5], SamplingParams(max_new_tokens=10, logprobs=True, top_logprobs=1))) for i in range(2)])
        for v in verdicts:
            b.accept(v)
        return b

    one, many = applied([merged]), applied(steps)
    assert one.outputs == many.outputs == [[7, 9, EOS], [8, 3, 4]] and one.generated.tolist() == [3, 3]
    assert one.logprobs == many.logprobs and one.top_logprobs == many.top_logprobs
    assert one.finish.tolist() == many.finish.tolist() == [STOP, 0]
    assert one.stats.row(1) == many.stats.row(1) and one.stats.row(1).num_spec_steps == 3
    with pytest.raises(AssertionError, match="last step retires"):
        merge_plain([steps[2], steps[0]])
    drafted = dataclasses.replace(steps[0], plan=Plan(2))
    with pytest.raises(AssertionError, match="plain steps only"):
        merge_plain([drafted, steps[1]])
