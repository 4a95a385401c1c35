"""Speculative beam search end to end: token for token the target's own beam search
(Hugging Face `generate(num_beams=W, do_sample=False)`, float32), whatever the drafter, with
rows ending at EOS and at the length limit, several prompts per batch and more prompts than
slots (beams reordered by row copies while prompts come and go)."""

from __future__ import annotations

import pytest
import torch

import raysd.core.beam as core_beam
from raysd.core.beam import BeamConfig
from raysd.core.sampling import SamplingParams
from raysd.engine.beam import BeamEngineConfig, BeamSearchEngine
from raysd.engine.beam_drafters import DraftBeamSearch, LookupBeams
from raysd.engine.drafters import NgramDrafter
from raysd.engine.requests import Request
from raysd.engine.suffix import SuffixDrafter
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_equivalence import prompts

MAX_NEW = 16
MIN_MARGIN = 1e-5  # closer candidate scores than this are a near-tie: float32 noise (~1e-6 here) may swap them


@pytest.fixture(scope="module")
def target():
    """A tiny Llama whose EOS logit is raised, so that some prompts' beams end at EOS."""
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        w = model.lm_head.weight
        w[EOS] += model.model.norm.weight.sign() * w.abs().mean()
    return model


@pytest.fixture(scope="module")
def ragged():
    return prompts(1, (5, 9, 3, 12, 7))


def hf_beams(model, prompt, W, N, **kwargs) -> list[tuple[list[int], float]]:
    """HF's N best hypotheses (tokens cut after EOS, score), best first."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, num_beams=W, do_sample=False, eos_token_id=EOS,
                         pad_token_id=0, num_return_sequences=N, output_scores=True, return_dict_in_generate=True,
                         **kwargs)
    rows = []
    for tokens, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        rows.append((tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens, score))
    return rows


def engine(target, drafter, W, N=None, K=3, batch=2, **beam):
    config = BeamEngineConfig(BeamConfig(W, num_return_sequences=N or W, **beam), num_speculative_tokens=K,
                              max_batch_size=batch, eos_token_ids=(EOS,))
    return BeamSearchEngine(target, drafter, config)


def run(eng, ps):
    return eng.generate([Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(ps)])


def assert_same(results, expected):
    for got, want in zip(results, expected):
        assert [r.token_ids for r in got] == [t for t, _ in want]
        assert [r.beam_score for r in got] == pytest.approx([s for _, s in want], abs=1e-4)
        for r in got:
            assert r.finish_reason == ("stop" if r.token_ids[-1] == EOS else "length")


@pytest.fixture
def margins(monkeypatch):
    """The smallest gap between adjacent candidate scores at any level's selection (top 2W + 1)."""
    seen = []
    top = core_beam.top_candidates

    def recording(log_probs, scores, k):
        values, index = torch.topk((log_probs + scores[:, :, None]).flatten(1), k=k + 1)
        real = values[values > core_beam.NO_SCORE / 2].view(-1)
        if real.numel() > 1:
            seen.append(float((real[:-1] - real[1:]).abs().min()))
        return top(log_probs, scores, k)

    monkeypatch.setattr(core_beam, "top_candidates", recording)
    return seen


def drafter(kind, target):
    if kind == "same":
        return DraftBeamSearch(target, VOCAB, eos_token_ids=(EOS,))
    if kind == "random":
        return DraftBeamSearch(tiny_model("llama", seed=123, layers=1), VOCAB, eos_token_ids=(EOS,))
    if kind == "wide":
        return DraftBeamSearch(tiny_model("llama", seed=123, layers=1), VOCAB, width=6, eos_token_ids=(EOS,))
    if kind == "ngram":
        return LookupBeams(NgramDrafter(VOCAB), budget=6, depth=3)
    if kind == "suffix":
        return LookupBeams(SuffixDrafter(VOCAB), budget=6, depth=3)
    return None


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("kind", ["none", "same", "random", "wide", "ngram", "suffix"])
def test_matches_hf_beam_search(target, ragged, margins, W, kind):
    expected = [hf_beams(target, p, W, W) for p in ragged]
    eng = engine(target, drafter(kind, target), W)
    results = run(eng, ragged)
    assert min(margins) > MIN_MARGIN, f"a near-tie ({min(margins):.2e}): choose other prompts"
    assert_same(results, expected)
    assert {r.finish_reason for rs in results for r in rs} == {"stop", "length"}  # both endings covered
    for rs in results:
        s = rs[0].stats
        levels = s.num_accepted_draft_tokens + s.num_spec_steps
        assert 1 <= s.mean_acceptance_length <= 4 and sum(s.acceptance_histogram) == s.num_spec_steps
        assert levels == sum((j + 1) * n for j, n in enumerate(s.acceptance_histogram))
        assert s.num_beam_nodes_selected <= s.num_draft_tokens
        if kind == "none":
            assert s.num_draft_tokens == 0 and s.mean_acceptance_length == 1


@pytest.mark.parametrize("W", [2, 4])
def test_target_as_its_own_draft_advances_k_plus_one_levels_per_pass(target, ragged, W):
    K = 3
    results = run(engine(target, drafter("same", target), W, K=K), ragged)
    for rs in results:
        s = rs[0].stats
        # every pass but the last reaches K + 1 levels (the last: whatever was left to the end)
        assert s.acceptance_histogram[K] >= s.num_spec_steps - 1, s.acceptance_histogram
        assert s.num_beam_nodes_selected > 0


@pytest.mark.parametrize("beam", [dict(early_stopping=True), dict(early_stopping="never", length_penalty=2.0),
                                  dict(length_penalty=0.5), dict(early_stopping=True, length_penalty=-1.0)])
@pytest.mark.parametrize("kind", ["none", "same"])
def test_early_stopping_and_length_penalty(target, ragged, margins, beam, kind):
    W = 4
    expected = [hf_beams(target, p, W, 2, **beam) for p in ragged]
    results = run(engine(target, drafter(kind, target), W, N=2, **beam), ragged)
    assert min(margins) > MIN_MARGIN, f"a near-tie ({min(margins):.2e})"
    assert_same(results, expected)


def test_one_prompt_per_batch_and_all_at_once_give_the_same_beams(target, ragged):
    one = run(engine(target, drafter("random", target), 2, batch=1), ragged)
    together = run(engine(target, drafter("random", target), 2, batch=len(ragged)), ragged)
    assert [[r.token_ids for r in rs] for rs in one] == [[r.token_ids for r in rs] for rs in together]


def test_requests_beam_search_cannot_run_are_error_results(target, ragged):
    eng = engine(target, None, 2)
    bad = [Request("hot", ragged[0], SamplingParams(temperature=0.7)), Request("empty", ()),
           Request("stops", ragged[1], SamplingParams(stop=("x",))), Request("ok", ragged[2], SamplingParams(max_new_tokens=4))]
    results = eng.generate(bad)
    assert [len(rs) for rs in results] == [1, 1, 1, 2]
    assert "greedy settings only" in results[0][0].error and results[1][0].error == "empty prompt"
    assert "stop strings" in results[2][0].error
    assert all(r.finish_reason == "length" and len(r.token_ids) == 4 for r in results[3])


def test_gather_copies_cache_rows_with_repeats(target, ragged):
    """Beams reorder by row copies (StaticRunner.gather): a row copied to several slots, one dropped."""
    from raysd.engine.cache_rows import CacheRows
    from raysd.models.static_runner import StaticRunner

    def next_logits(rows: CacheRows) -> torch.Tensor:
        R = rows.runner.num_rows
        zeros = torch.zeros(R, dtype=torch.int64)
        return rows.feed(torch.zeros(R, 0, dtype=torch.int64), zeros, zeros + 1, 1)[:, 0]

    moved = CacheRows(StaticRunner(target, checks=True))
    moved.add_rows(ragged[:3])
    moved.gather([2, 2, 0])
    fresh = CacheRows(StaticRunner(target, checks=True))
    fresh.add_rows([ragged[2], ragged[2], ragged[0]])
    torch.testing.assert_close(next_logits(moved), next_logits(fresh))
