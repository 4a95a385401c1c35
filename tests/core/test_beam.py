"""Beam bookkeeping on hand-built log-probabilities: HF's selection, finished set, length
penalty, early stopping and the length limit; and the replay against a hand-built tree."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raysd.core.beam import NO_SCORE, BeamConfig, BeamGroup, BeamTree, replay, top_candidates

V, EOS = 8, 7


def level(group: BeamGroup, log_probs) -> list[tuple[int, int]]:
    """One level of `group` from per-beam log-probabilities [W, V]."""
    lp = torch.tensor(log_probs, dtype=torch.float32)[None]  # [1, W, V]
    values, beams, tokens = top_candidates(lp, torch.from_numpy(group.scores)[None], group.num_candidates)
    return group.advance(values[0], beams[0], tokens[0])


def row(**tokens) -> list[float]:
    """A log-probability row: the named tokens' values, -20 elsewhere."""
    out = [-20.0] * V
    for t, value in tokens.items():
        out[int(t[1:])] = value
    return out


def test_first_level_extends_only_the_first_copy_of_the_prompt():
    g = BeamGroup(BeamConfig(num_beams=2), (EOS,), max_new_tokens=10)
    assert g.scores.tolist() == [0.0, NO_SCORE] and g.num_candidates == 4
    same = row(t3=-0.5, t1=-1.0, t4=-2.0)
    assert level(g, [same, same]) == [(0, 3), (0, 1)]  # never the NO_SCORE copy's
    assert g.tokens == [(3,), (1,)] and g.scores.tolist() == [-0.5, -1.0]


def test_eos_in_the_top_w_finishes_with_the_length_penalty_and_the_next_candidate_runs():
    g = BeamGroup(BeamConfig(num_beams=2, length_penalty=2.0), (EOS,), max_new_tokens=10)
    level(g, [row(t3=-0.5, t1=-1.0), row(t3=-0.5, t1=-1.0)])
    running = level(g, [row(t7=-0.25, t5=-1.0), row(t2=-0.5)])
    # candidates: (0, EOS) -0.75, (1, 2) -1.5, (0, 5) -1.5 - tie-free below, then the rest
    assert running[0] == (1, 2) or running[0] == (0, 5)
    assert [h.tokens for h in g.finished] == [(3, EOS)]
    assert g.finished[0].score == pytest.approx(-0.75 / 2**2.0)
    assert not g.done


def test_eos_below_the_top_w_does_not_finish():
    g = BeamGroup(BeamConfig(num_beams=2), (EOS,), max_new_tokens=10)
    level(g, [row(t3=-0.5, t1=-1.0), row(t3=-0.5, t1=-1.0)])
    level(g, [row(t4=-0.1, t5=-0.2, t7=-3.0), row(t6=-0.1, t7=-0.2)])  # beam 1's EOS is third
    assert g.finished == [] and sorted(g.tokens) == [(3, 4), (3, 5)]


def test_length_limit_finishes_the_top_w_and_ends_the_group():
    g = BeamGroup(BeamConfig(num_beams=2, num_return_sequences=2), (EOS,), max_new_tokens=2)
    level(g, [row(t3=-0.5, t1=-1.0), row(t3=-0.5, t1=-1.0)])
    assert level(g, [row(t4=-0.1, t5=-0.2), row(t6=-0.3)]) == [] and g.done
    assert [(h.tokens, h.score) for h in g.results()] == [((3, 4), pytest.approx(-0.3)), ((3, 5), pytest.approx(-0.35))]


def finish_two(early_stopping, length_penalty=1.0, max_new_tokens=10) -> BeamGroup:
    """Two hypotheses finish at level 2 (scores -0.6 / 2 and -1.1 / 2); the running beams go on."""
    g = BeamGroup(BeamConfig(2, length_penalty, early_stopping), (EOS,), max_new_tokens)
    level(g, [row(t3=-0.5, t1=-1.0), row(t3=-0.5, t1=-1.0)])
    level(g, [row(t7=-0.1, t4=-1.5, t5=-1.6), row(t7=-0.1, t6=-1.7)])
    assert [h.tokens for h in g.finished] == [(3, EOS), (1, EOS)]
    return g


def test_early_stopping_true_stops_once_w_finished():
    assert finish_two(True).done


def test_early_stopping_false_stops_when_the_best_running_beam_cannot_win():
    # best running -2.0 over 2 tokens = -1.0 < worst finished -0.55: HF's heuristic stops
    assert finish_two(False).done


def test_early_stopping_never_with_a_positive_penalty_measures_the_running_beam_at_the_limit():
    # length_penalty 2: worst finished -1.1 / 4 = -0.275; best running -2.0 / 10**2 = -0.02 at the limit: goes on
    g = finish_two("never", length_penalty=2.0)
    assert not g.done
    # with early_stopping False the same group measures -2.0 / 2**2 = -0.5 < -0.275: stops
    assert finish_two(False, length_penalty=2.0).done


def test_finished_set_keeps_the_best_w():
    g = finish_two("never", length_penalty=2.0)
    # finished: (3, EOS) -0.6 / 4 = -0.15, (1, EOS) -1.1 / 4 = -0.275; running (3, 4) -2.0, (3, 5) -2.1
    level(g, [row(t7=-0.01, t2=-3.0), row(t7=-0.02, t2=-3.0)])  # -2.01 / 9 = -0.2233 and -2.12 / 9 = -0.2356 finish
    assert [h.tokens for h in g.finished] == [(3, EOS), (3, 4, EOS)]
    assert [h.score for h in g.finished] == pytest.approx([-0.15, -2.01 / 9])


def test_scores_are_hf_float32_arithmetic():
    g = BeamGroup(BeamConfig(2, length_penalty=0.7), (EOS,), 10)
    level(g, [row(t3=-0.123456789, t1=-1.0), row(t3=-0.5)])
    level(g, [row(t7=-0.987654321, t4=-2.0, t5=-2.1), row(t6=-3.0)])
    total = torch.tensor([-0.123456789], dtype=torch.float32) + torch.tensor([-0.987654321], dtype=torch.float32)
    assert g.finished[0].score == float(total / (2**0.7))


@pytest.mark.parametrize("kwargs", [dict(num_beams=1), dict(num_beams=2, num_return_sequences=3),
                                    dict(early_stopping="always"), dict(length_penalty=math.inf)])
def test_config_errors(kwargs):
    with pytest.raises(ValueError):
        BeamConfig(**kwargs)


def one_hot_logits(best: list[list[int]], N: int) -> torch.Tensor:
    """[R, N + 1, V] logits whose order of tokens after position n of row r is best[r][n]
    (the first token far ahead, then the others in order)."""
    R = len(best) // (N + 1)
    out = torch.full((R, N + 1, V), -10.0)
    for i, order in enumerate(best):
        for rank, t in enumerate(order):
            out[i // (N + 1), i % (N + 1), t] = 5.0 - 2.0 * rank
    return out


def test_replay_goes_on_while_every_selected_beam_is_a_node():
    # Two rows, W = 2, after the first level: beams (row 0: ..3), (row 1: ..1). Each row's head
    # prefers token 4 then 5; row 0's tree holds 4 (node 0) and under it 6 (node 1); row 1's holds 4.
    g = BeamGroup(BeamConfig(2), (EOS,), max_new_tokens=10)
    level(g, [row(t3=-0.5, t1=-1.0), row(t3=-0.5, t1=-1.0)])
    tree = BeamTree([[4, 6], [4]], [[-1, 0], [-1]])
    logits = one_hot_logits([[4, 5], [6, 5], [6, 5], [4, 5], [6, 5], [6, 5]], N=2)
    (out,) = replay([g], [[0, 1]], logits, tree)
    # level 2 selects (row 0, 4) and (row 1, 4): both nodes; level 3 (row 0, 4, 6) is node 1 but
    # row 1's 4 then 6 is not in its tree: the replay stops after level 3
    assert out.levels == 2 and g.generated == 3
    assert sorted((w.row, w.nodes, w.tokens) for w in out.walks) == [(0, (0, 1), (4, 6)), (1, (0,), (4, 6))]
    assert out.selected_nodes == 3


def test_replay_advances_one_level_without_a_tree():
    g = BeamGroup(BeamConfig(2), (EOS,), max_new_tokens=10)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [0.0] * (V - 3)] * 2))[:, None]  # [2, 1, V]
    (out,) = replay([g], [[0, 1]], logits, BeamTree.empty(2))
    assert out.levels == 1 and [w.tokens for w in out.walks] == [(0,), (1,)] and out.selected_nodes == 0
    assert np.allclose(g.scores, np.log([0.5, 0.3]))
