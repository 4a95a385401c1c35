"""The EAGLE feature draft through the engine: the target hands over its
features, the draft drafts from them, and the output stays the target's: greedy token for token,
sampled in law."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysd.core.sampling import SamplingParams, SamplingTensors, logits_to_probs
from raysd.core.speculation import SpeculationConfig
from raysd.engine import drafters
from raysd.engine.drafters import FeatureDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.eagle_draft import EagleDraft, final_norm
from tests.conftest import VOCAB, tiny_model
from tests.core.test_distribution import chi_square_pvalue, tv_tolerance
from tests.engine.test_equivalence import hf_greedy, prompts


def eagle_engine(target, k: int, batch: int, runner: str, seed: int = 0, vocab: int = VOCAB) -> SpecEngine:
    draft = EagleDraft.from_target(target, init_layer=-1, seed=seed)  # untrained: a weak but real draft
    return SpecEngine(target, FeatureDrafter(draft, vocab, runner=runner),
                      EngineConfig(SpeculationConfig(num_speculative_tokens=k), max_batch_size=batch, runner=runner))


@pytest.mark.parametrize("runner", ["static", "dynamic"])
@pytest.mark.parametrize("k,batch", [(1, 1), (3, 3), (5, 8)])
def test_greedy_output_is_the_targets_own(runner, k, batch):
    target = tiny_model("llama", seed=0)
    ps = prompts(seed=1)[:6]
    engine = eagle_engine(target, k, batch, runner)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 3, 9, 14, 1, 7)]
    results = engine.generate([Request(i, p, q) for i, (p, q) in enumerate(zip(ps, params))])
    for p, q, r in zip(ps, params, results):
        assert r.token_ids == hf_greedy(target, p, q.max_new_tokens)
    assert sum(r.stats.num_draft_tokens for r in results) > 0
    assert engine.draft.drafter.runner.num_rows == 0 and engine.target.rows.runner.num_rows == 0


@pytest.mark.parametrize("runner", ["static", "dynamic"])
def test_the_draft_reads_the_targets_own_features(runner):
    """Every feature the draft receives is the target's pre-norm last-layer hidden state at that
    position, as a full forward over the finished sequence computes it."""
    target = tiny_model("llama", seed=0)
    ps = prompts(seed=2)[:2]
    engine = eagle_engine(target, 3, 2, runner)
    received: list[list[torch.Tensor]] = [[], []]
    commit = engine.drafter.commit

    def recording_commit(new_tokens, num_accepted=None, features=None):
        for b, f in enumerate(features):
            received[b].append(f.clone())
        return commit(new_tokens, num_accepted, features)

    engine.drafter.commit = recording_commit
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for i, p in enumerate(ps)])
    seen = []
    handle = final_norm(target).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    for b, r in enumerate(results):
        seen.clear()
        with torch.no_grad():
            target(torch.tensor([list(r.prompt_token_ids) + r.token_ids]))
        full = seen[0][0]  # [L, H]
        got = torch.cat(received[b])  # positions 0.. in order
        assert got.shape[0] == len(r.prompt_token_ids) + len(r.token_ids) - 1  # all but the unread last token
        torch.testing.assert_close(got, full[: got.shape[0]], atol=1e-4, rtol=1e-4)
    handle.remove()


@pytest.mark.parametrize("runner", ["static", "dynamic"])
def test_prompts_prefilled_in_several_forwards_get_their_own_features(runner):
    """The static runner prefills prompts of very different lengths in separate forwards
    (`prefill_groups`); each row's features are still its own: a 1-token prompt (nothing to
    prefill), short ones and a long one, admitted together, against a full forward of each."""
    target = tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 160, 6, 90)]
    engine = eagle_engine(target, 3, len(ps), runner)
    items = [(i, Request(i, p, SamplingParams(max_new_tokens=4, ignore_eos=True))) for i, p in enumerate(ps)]
    engine.target.add(items)
    features = list(engine.target.prompt_features)
    if runner == "static":
        assert len(engine.target.rows.runner.prefill_calls) > 1  # the case under test
    seen = []
    handle = final_norm(target).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    for p, f in zip(ps, features):
        seen.clear()
        with torch.no_grad():
            target(torch.tensor([p]))
        assert f.shape[0] == len(p) - 1
        torch.testing.assert_close(f, seen[0][0, : len(p) - 1], atol=1e-4, rtol=1e-4)
    handle.remove()
    engine.target.rows.select([])
    # and through the engine: greedy output is the target's own
    speculation = SpeculationConfig(num_speculative_tokens=3)
    results = SpecEngine(target, eagle_engine(target, 3, len(ps), runner).draft.drafter,
                         EngineConfig(speculation, max_batch_size=len(ps), runner=runner)).generate(
        [r for _, r in items])
    for p, r in zip(ps, results):
        assert r.token_ids == hf_greedy(target, p, 4)


def test_catch_up_feeds_a_long_prompt_in_its_own_forward(monkeypatch):
    """On the static runner the draft catches up on a newly joined row's whole prompt in its own
    forward (`prefill_groups`), not padding the other rows' one or two pairs to it, and drafts
    what one padded forward drafts: the same tokens, the same acceptance."""
    target = tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 150, 4, 120, 5)]
    requests = [Request(i, p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for i, p in enumerate(ps)]

    def run(grouped: bool):
        engine = eagle_engine(target, 3, 2, "static")  # batch 2: rows join as others finish
        runner, calls = engine.draft.drafter.runner, []
        forward_rows = runner.forward_rows
        with monkeypatch.context() as m:
            m.setattr(runner, "forward_rows", lambda rows, *a: calls.append(rows.stop - rows.start) or forward_rows(rows, *a))
            if not grouped:
                m.setattr(drafters, "prefill_groups", lambda counts: [(0, len(counts))])
            return engine.generate(requests), calls

    (grouped, grouped_calls), (single, single_calls) = run(True), run(False)
    assert len(grouped_calls) > len(single_calls)  # the case under test: some steps caught up in several forwards
    for a, b in zip(grouped, single):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 6
        assert a.stats.num_accepted_draft_tokens == b.stats.num_accepted_draft_tokens
        assert a.stats.num_draft_tokens == b.stats.num_draft_tokens


def test_a_rows_first_step_drafts_nothing():
    """The target prefills, so a row has features only after its first target pass."""
    target = tiny_model("llama", seed=0)
    engine = eagle_engine(target, 4, 2, "static")
    items = [(0, Request(0, prompts(seed=3)[0], SamplingParams(max_new_tokens=10, ignore_eos=True)))]
    engine.target.add(items)
    engine.draft.add(items)
    engine.step()
    assert engine.target.batch.stats.drafted.tolist() == [0] and engine.draft.drafter.runner.lengths.tolist() == [0]
    engine.step()
    assert engine.target.batch.stats.drafted.tolist() == [4]
    assert engine.draft.drafter.runner.lengths.tolist() == [len(items[0][1].prompt_token_ids)]  # its features, fed


V, N = 6, 12_000  # three tokens: 216 cells of ~56 expected counts each


def exact_joint3(target, prompt, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) from the target alone, under the same temperature/top-k/top-p."""
    sampling = SamplingTensors.from_params([params])

    def law(seq):
        with torch.no_grad():
            return logits_to_probs(target(torch.tensor([seq])).logits[:, -1], sampling)[0].double()

    joint = np.zeros((V, V, V))
    first = law(prompt)
    for a in range(V):
        second = law(prompt + [a])
        for b in range(V):
            joint[a, b] = (first[a] * second[b] * law(prompt + [a, b])).numpy()
    return joint


def assert_first_three_follow_target(results, target, prompt: list[int], params: SamplingParams) -> None:
    """The first three tokens of the rows against the target's exact joint law: nothing outside
    its support, chi-square at 1e-3, total variation within its sample-size bound."""
    n = len(results)
    counts = np.zeros((V, V, V))
    for r in results:
        counts[tuple(r.token_ids[:3])] += 1
    expected = exact_joint3(target, prompt, params) * n
    support = expected.ravel() > 0
    assert counts.ravel()[~support].sum() == 0, "a token outside the target's support was emitted"
    assert chi_square_pvalue(counts.ravel(), expected.ravel() / n) > 1e-3  # cells expecting < 5 pooled
    tv = 0.5 * np.abs(counts / n - expected / n).sum()
    assert tv <= tv_tolerance(int(support.sum()), n), tv


def test_sampled_output_follows_the_targets_law():
    """The joint law of three sampled tokens (the second and third drafted by the feature draft)
    equals the target's: chi-square, and total variation within its sample-size bound."""
    target = tiny_model("llama", seed=11, vocab=V)
    prompt = [3, 5, 1, 3, 5]
    base = SamplingParams(temperature=0.9, top_k=5, max_new_tokens=3, ignore_eos=True)
    engine = eagle_engine(target, 2, 2000, "static", seed=3, vocab=V)
    results = engine.generate([Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 50_000 + i}))
                               for i in range(N)])
    assert_first_three_follow_target(results, target, prompt, base)
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > 0  # the drafts were really used
