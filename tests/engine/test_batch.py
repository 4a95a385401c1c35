"""Batch.emit on hand-built verdicts: exact kept tokens, finish reasons and statistics."""

import numpy as np

from raysd.core.sampling import SamplingParams
from raysd.engine.batch import Batch
from raysd.engine.rows import Request
from raysd.engine.verifier import Verdict

EOS = 2


def verdict(tokens, accepted, tested, drafted, overlaps):
    return Verdict(np.array(tokens), np.array(accepted), np.array(tested), np.array(drafted), np.array(overlaps, dtype=float))


def test_emit_stops_at_eos_stop_ids_budget_and_context():
    batch = Batch(3, max_model_len=12, eos_token_ids=(EOS,))
    batch.add([
        (0, Request("eos", [5, 6], SamplingParams(max_new_tokens=10))),
        (1, Request("stop", [5], SamplingParams(max_new_tokens=10, stop_token_ids=(9,)))),
        (2, Request("budget", [5], SamplingParams(max_new_tokens=2, ignore_eos=True))),
        (3, Request("context", [5] * 9, SamplingParams(max_new_tokens=10))),
        (4, Request("runs", [5], SamplingParams(max_new_tokens=10))),
    ])
    assert batch.room().tolist() == [3, 3, 1, 2, 3]
    v = verdict(
        tokens=[[7, EOS, 8, -1], [9, 4, -1, -1], [EOS, 3, -1, -1], [7, 7, 7, 7], [7, 8, 3, -1]],
        accepted=[2, 1, 1, 3, 2], tested=[3, 2, 1, 3, 3], drafted=[3, 3, 1, 3, 3],
        overlaps=[[0.5, 0.5, 0.1], [0.9, 0.2, 0.0], [1.0, 0.0, 0.0], [1, 1, 1], [0.8, 0.7, 0.1]],
    )
    kept = batch.emit(v, np.array([3, 3, 1, 2, 3]))
    assert kept == [[7, EOS], [9], [EOS, 3], [7, 7, 7], [7, 8, 3]]
    assert [batch.result(b).finish_reason for b in range(4)] == ["stop", "stop", "length", "length"]
    assert batch.finish[4] == 0 and batch.outputs[4] == [7, 8, 3]
    s = batch.stats(0)
    assert (s.num_spec_steps, s.num_draft_tokens, s.num_accepted_draft_tokens) == (1, 3, 2)
    assert s.acceptance_histogram == [0, 0, 1, 0] and s.accepted_per_position == [1, 1, 0]
    assert s.overlap_sum == 1.1 and s.num_tested_positions == 3 and s.speculation_length_sum == 3


def test_keep_reorders_every_array_and_add_widens_stop_sets():
    batch = Batch(2, 100, (EOS,))
    batch.add([(i, Request(i, [5], SamplingParams(max_new_tokens=4 + i))) for i in range(3)])
    batch.add([(3, Request(3, [5], SamplingParams(stop_token_ids=(10, 11, 12))))])
    assert batch.stop_ids.shape == (4, 4) and batch.stop_ids[3].tolist() == [EOS, 10, 11, 12]
    batch.keep([3, 1])
    assert batch.ids == [3, 1] and batch.max_new.tolist() == [64, 5]
    assert batch.stop_ids[0].tolist() == [EOS, 10, 11, 12] and batch.stop_ids[1].tolist() == [EOS, -2, -2, -2]
