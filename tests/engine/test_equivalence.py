"""End to end: the engine's greedy output is token-identical to the target's own
`generate`, whatever the drafter, batch size, prompt lengths and K."""

from __future__ import annotations

import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_model

PROMPT_LENGTHS = (5, 9, 1, 12, 3, 7, 4, 16)


def prompts(seed: int = 0, lengths=PROMPT_LENGTHS, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


RUNNERS = ["static", "dynamic"]  # every exactness test runs on both KV-cache runners (raysd.models.runner)


def run(target, drafter, prompt_list, k, batch_size, max_new_tokens, params=None, runner="auto"):
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,))
    config = EngineConfig(speculation, max_batch_size=batch_size, runner=runner)
    engine = SpecEngine(target, drafter, config)
    params = params or SamplingParams(max_new_tokens=max_new_tokens)
    return engine.generate([Request(i, p, params) for i, p in enumerate(prompt_list)])


def make_drafter(kind: str, target, arch: str, runner: str = "auto"):
    if kind == "same":
        return DraftModelDrafter(target, VOCAB, runner=runner)
    if kind == "random":
        return DraftModelDrafter(tiny_model(arch, seed=123, layers=1), VOCAB, runner=runner)
    if kind == "ngram":
        return NgramDrafter(VOCAB)
    return NoDrafter(VOCAB)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def arch_target(request):
    arch = request.param
    target = tiny_model(arch)
    ps = prompts()
    return arch, target, ps, [hf_greedy(target, p, 24) for p in ps]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("drafter_kind", ["same", "random", "ngram", "none"])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_matches_target_generate(arch_target, drafter_kind, k, batch_size, runner):
    arch, target, ps, expected = arch_target
    if arch == "gpt2" and runner == "static":
        pytest.skip("GPT-2 runs on the dynamic runner only (StaticRunner supports Llama-family models)")
    if batch_size == 1:  # batch 1 runs every prompt through a single slot; three prompts suffice
        ps, expected = ps[:3], expected[:3]
    results = run(target, make_drafter(drafter_kind, target, arch, runner), ps, k, batch_size, 24, runner=runner)
    assert [r.token_ids for r in results] == expected
    for r in results:
        s = r.stats
        assert sum(s.acceptance_histogram) == s.num_spec_steps
        assert sum(j * h for j, h in enumerate(s.acceptance_histogram)) == s.num_accepted_draft_tokens
        assert sum(s.accepted_per_position) == s.num_accepted_draft_tokens
        if drafter_kind == "none":
            assert s.num_draft_tokens == 0 and s.mean_acceptance_length == 1.0


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("k", [1, 4, 8])
def test_draft_equal_to_target_accepts_everything(k, runner):
    target = tiny_model("llama")
    # max_new_tokens a multiple of K + 1 and EOS ignored: every step drafts K and keeps all.
    params = SamplingParams(max_new_tokens=3 * (k + 1), ignore_eos=True)
    results = run(target, DraftModelDrafter(target, VOCAB, runner=runner), prompts(), k, 4, 0, params, runner=runner)
    for r in results:
        assert len(r.token_ids) == 3 * (k + 1)
        assert r.stats.draft_acceptance_rate == 1.0
        assert r.stats.mean_acceptance_length == k + 1
        assert r.stats.alpha_estimate == pytest.approx(1.0)
        assert r.stats.acceptance_histogram == [0] * k + [3]


@pytest.mark.parametrize("runner", RUNNERS)
def test_random_draft_changes_nothing_but_acceptance(runner):
    target = tiny_model("llama")
    ps = prompts()
    expected = [hf_greedy(target, p, 24) for p in ps]
    results = run(target, DraftModelDrafter(tiny_model("llama", seed=7, layers=1), VOCAB, runner=runner), ps, 4, 8, 24, runner=runner)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_draft_tokens for r in results) < sum(r.stats.num_draft_tokens for r in results)


def test_padded_vocabularies_of_different_sizes():
    """A draft with a wider padded vocabulary (as 49280 vs 49152) still gives the target's tokens."""
    target = tiny_model("llama", vocab=VOCAB)
    draft = tiny_model("llama", seed=5, layers=1, vocab=VOCAB + 32)
    narrow = tiny_model("llama", seed=6, layers=1, vocab=VOCAB - 16)
    ps = prompts()
    expected = [hf_greedy(target, p, 16) for p in ps]
    for d in (draft, narrow):
        assert [r.token_ids for r in run(target, DraftModelDrafter(d, VOCAB), ps, 4, 8, 16)] == expected


@pytest.mark.parametrize("runner", RUNNERS)
def test_rows_finish_independently_and_free_their_slots(runner):
    target = tiny_model("llama")
    ps = prompts()
    budgets = [3, 20, 1, 9, 14, 2, 30, 5]
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
    config = EngineConfig(speculation, max_batch_size=3, runner=runner)
    engine = SpecEngine(target, DraftModelDrafter(target, VOCAB, runner=runner), config)
    reqs = [Request(i, p, SamplingParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(ps, budgets))]
    results = engine.generate(reqs)
    assert [r.request_id for r in results] == list(range(len(ps)))
    for r, p, n in zip(results, ps, budgets):
        assert r.token_ids == hf_greedy(target, p, n)
        assert r.finish_reason == ("stop" if r.token_ids[-1] == EOS else "length")
    assert engine.target.rows.runner.num_rows == 0  # nothing left behind
    t = engine.timings  # 8 rows admitted in several rounds: prefill is timed, and part of the wall time
    assert 0 < t.prefill_s < t.wall_s and t.generated_tokens == sum(len(r.token_ids) for r in results)


def test_ngram_proposal_is_as_wide_as_the_longest_lookup():
    """The lookup's proposal has max(found) positions, not K: no row matched, no position at all
    (the step is plain decoding's); the one-hot draft_probs cover exactly the drafted tokens."""
    from raysd.core.sampling import SamplingTensors

    d = NgramDrafter(VOCAB)
    d.add_rows([[1, 2, 3, 4, 1, 2], [5, 6, 7, 8], [9, 9, 9]])  # row 0 finds "3 4 1 2"; row 1 nothing; row 2 "9"
    sampling = SamplingTensors.from_params([SamplingParams()] * 3, "cpu")
    p = d.propose([4, 4, 1], sampling, torch.zeros(3, 4))
    assert p.num_draft_host == (4, 0, 1) and p.draft_token_ids.shape == (3, 4)
    assert p.draft_token_ids[0].tolist() == [3, 4, 1, 2] and p.draft_token_ids[2, 0] == 9
    assert p.draft_probs.shape == (3, 4, VOCAB) and p.draft_probs[0, 1, 4] == 1 and p.draft_probs.sum() == 3 * 4
    p = d.propose([2, 0, 0], sampling, torch.zeros(3, 4))
    assert p.num_draft_host == (2, 0, 0) and p.draft_token_ids.shape == (3, 2)
    d.select([1])  # only the row without a match left
    p = d.propose([4], SamplingTensors.from_params([SamplingParams()], "cpu"), torch.zeros(1, 4))
    assert p.num_draft_host == (0,) and p.draft_token_ids.shape == (1, 0) and p.draft_probs.shape == (1, 0, VOCAB)


def test_stop_token_ids_end_a_row():
    target = tiny_model("llama")
    p = prompts()[1]
    free = hf_greedy(target, p, 24)
    stop = free[5]
    result = run(target, NgramDrafter(VOCAB), [p], 4, 1, 24, SamplingParams(max_new_tokens=24, stop_token_ids=(stop,)))[0]
    assert result.token_ids == free[: free.index(stop) + 1]
    assert result.finish_reason == "stop"


def test_bad_requests_become_error_results():
    target = tiny_model("llama")
    ps = [[], [5, 6, VOCAB + 3], [3 + i % 90 for i in range(600)], [4, 5, 6]]  # the model has 512 positions
    results = run(target, NoDrafter(VOCAB), ps, 4, 4, 8)
    assert [r.finish_reason for r in results[:3]] == ["error"] * 3
    assert "empty" in results[0].error and "vocabulary" in results[1].error and "context" in results[2].error
    assert results[3].finish_reason in ("stop", "length") and results[3].error is None


@pytest.mark.parametrize("runner", RUNNERS)
def test_same_seed_same_tokens_whatever_the_batch(runner):
    target = tiny_model("llama")
    draft = tiny_model("llama", seed=3, layers=1)
    ps = prompts()
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, max_new_tokens=16) for i in range(len(ps))]

    def sample(batch_size, order):
        speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
        engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner=runner), EngineConfig(speculation, max_batch_size=batch_size, runner=runner))
        res = engine.generate([Request(i, ps[i], params[i]) for i in order])
        return {r.request_id: r.token_ids for r in res}

    alone = sample(1, range(len(ps)))
    assert sample(8, range(len(ps))) == alone
    assert sample(3, reversed(range(len(ps)))) == alone
    assert sample(8, range(len(ps))) == sample(8, range(len(ps)))


def test_dynamically_quantized_draft_loads_and_changes_nothing():
    """An int8 draft whose head is quantized too has no `weight` tensor on its lm_head."""
    from torch.ao.quantization import quantize_dynamic

    target = tiny_model("llama")
    draft = quantize_dynamic(tiny_model("llama", seed=4, layers=1), {torch.nn.Linear}, dtype=torch.qint8)
    assert not isinstance(draft.get_output_embeddings().weight, torch.Tensor)
    ps = prompts()
    expected = [hf_greedy(target, p, 16) for p in ps]
    assert [r.token_ids for r in run(target, DraftModelDrafter(draft, VOCAB), ps, 4, 8, 16)] == expected
