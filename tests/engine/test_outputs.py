"""What a row can ask of its output beyond tokens: the target's log-probabilities (from the verify
pass, no extra forward), stop strings (checked incrementally, the tokens after the stop never
emitted), and several samples of one prompt prefilled once."""

from __future__ import annotations

import pytest
import torch

from raysd.core.sampling import SamplingParams, SamplingTensors, logits_to_probs
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_equivalence import prompts
from tests.reliability.conftest import tiny_tokenizer

CASES = {  # drafter, K, tree budget
    "plain": (lambda: NoDrafter(VOCAB), 0, 0),
    "chain": (lambda: DraftModelDrafter(tiny_model("llama", seed=1, layers=1), VOCAB), 3, 0),
    "tree": (lambda: DraftModelDrafter(tiny_model("llama", seed=1, layers=1), VOCAB), 3, 4),
    "ngram": (lambda: NgramDrafter(VOCAB), 3, 0),
}


def engine(case: str, batch: int = 4, tokenizer=None) -> SpecEngine:
    make, k, tree = CASES[case]
    spec = SpeculationConfig(num_speculative_tokens=k, tree_budget=tree, eos_token_ids=(EOS,))
    return SpecEngine(tiny_model("llama"), make(), EngineConfig(spec, max_batch_size=batch), tokenizer=tokenizer)


@torch.no_grad()
def forward_logprobs(target, prompt, output, params: SamplingParams, mode: str) -> torch.Tensor:
    """[n, V] the target's log-probabilities at each output position, from one plain forward."""
    logits = target(torch.tensor([list(prompt) + list(output)])).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1]
    if mode == "raw":
        return torch.log_softmax(logits.float(), dim=-1)
    return logits_to_probs(logits[None], SamplingTensors.from_params([params]))[0].log()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_are_a_plain_forwards(case, mode):
    eng = engine(case)
    target = eng.target.rows.runner.model
    params = [SamplingParams(temperature=t, top_k=tk, seed=i, max_new_tokens=9, logprobs=True, top_logprobs=3,
                             logprobs_mode=mode, ignore_eos=True)
              for i, (t, tk) in enumerate([(0.0, 0), (1.0, 0), (0.8, 5), (0.0, 0)])]
    ps = prompts(seed=4)[:4]
    results = eng.generate([Request(i, p, q) for i, (p, q) in enumerate(zip(ps, params))])
    for p, q, r in zip(ps, params, results):
        expected = forward_logprobs(target, p, r.token_ids, q, mode)  # [n, V]
        got = torch.tensor(r.logprobs)
        want = expected.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        assert len(r.logprobs) == len(r.token_ids) == len(r.top_logprobs)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)
        top_values, top_ids = expected.topk(3, dim=-1)
        for w, top in enumerate(r.top_logprobs):
            assert [i for i, _ in top][:1] == top_ids[w, :1].tolist()  # the most likely token, ties aside
            torch.testing.assert_close(torch.tensor([v for _, v in top]), top_values[w], atol=1e-4, rtol=1e-4)


def test_rows_that_ask_nothing_get_nothing():
    [r] = engine("chain").generate([Request(0, prompts()[0], SamplingParams(max_new_tokens=5))])
    assert r.logprobs is None and r.top_logprobs is None and r.text is None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("batch", [1, 4])
def test_stop_strings_end_rows_at_the_first_occurrence(case, batch):
    """A stop string ends its row at the token whose decoding completes it; the tokens after it are
    never emitted; the text is cut before it (or keeps it); other rows run on."""
    tok = tiny_tokenizer()
    ps = prompts(seed=5)[:4]
    plain = [r.token_ids for r in engine(case, batch).generate(
        [Request(i, p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for i, p in enumerate(ps)])]
    text = tok.decode(plain[0], skip_special_tokens=True)
    words = text.split(" ")
    stop = " ".join(words[3:5])  # two tokens' words: the stop spans a token boundary
    at = text.index(stop)
    for include in (False, True):
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop, "never-seen"), include_stop_str_in_output=include)
        results = engine(case, batch, tokenizer=tok).generate(
            [Request(0, ps[0], params)] + [Request(i, p, SamplingParams(max_new_tokens=12, ignore_eos=True))
                                           for i, p in enumerate(ps[1:], 1)])
        first = results[0]
        n = next(j + 1 for j in range(len(plain[0])) if stop in tok.decode(plain[0][: j + 1], skip_special_tokens=True))
        assert first.token_ids == plain[0][:n] and first.finish_reason == "stop"
        assert first.text == (text[: at + len(stop)] if include else text[:at])
        assert [r.token_ids for r in results[1:]] == plain[1:]


def test_stop_strings_need_a_tokenizer():
    [r] = engine("chain").generate([Request(0, prompts()[0], SamplingParams(stop=("w1",)))])
    assert r.finish_reason == "error" and "tokenizer" in r.error


@pytest.mark.parametrize("runner", ["static", "dynamic"])
def test_samples_of_one_prompt_are_prefilled_once_and_each_is_its_own(runner, monkeypatch):
    """Rows admitted together with the same prompt share one prefill (the others copy its cache),
    and each gives the tokens it gives alone."""
    target, draft = tiny_model("llama"), tiny_model("llama", seed=1, layers=1)
    prompt = prompts(seed=6)[0]
    reqs = [Request(i, prompt, SamplingParams(temperature=1.0, seed=i, max_new_tokens=10)) for i in range(4)]

    def run(batch):
        spec = SpeculationConfig(num_speculative_tokens=3)
        return SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner=runner), EngineConfig(spec, max_batch_size=batch,
                                                                                            runner=runner))

    eng = run(4)
    prefilled = []
    add = eng.target.rows.runner.add_prefilled
    monkeypatch.setattr(eng.target.rows.runner, "add_prefilled", lambda prefixes: prefilled.append(len(prefixes)) or add(prefixes))
    together = [r.token_ids for r in eng.generate(reqs)]
    assert prefilled == [1]  # four rows, one prefill
    assert together == [run(1).generate([r])[0].token_ids for r in reqs]
