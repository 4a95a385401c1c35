"""Batch on hand-built verdicts: exact kept tokens, finish reasons and statistics."""

import numpy as np

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.batch import Batch, Plan, Verdict
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
