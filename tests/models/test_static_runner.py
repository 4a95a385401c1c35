"""StaticModelRunner (preallocated key/value buffers) against the same oracle as ModelRunner:
each row's logits equal a fresh, unpadded, batch-of-one forward over the row's history,
whatever was done to the cache (ragged chunks, rollback by masking, compaction, select,
add_rows, merge with a ModelRunner or another StaticModelRunner).

Most scenarios are tests/models/test_runner.py's own, run with StaticModelRunner in place
of ModelRunner (its `packed` checks do not apply: a static cache keeps holes until it
compacts); the rest are specific to the static layout.
"""

import functools
import os
import random

import pytest
import torch

import tests.models.test_runner as base
from raysd.core.sampling import SamplingParams
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.rows import Request
from raysd.engine.sequences import SequenceState
from raysd.models.static_runner import StaticModelRunner
from tests.conftest import EOS, VOCAB, tiny_model
from tests.models.test_runner import assert_rows_match, random_tokens, right_aligned

ARCHS = ["llama", "qwen2", "gpt2"]

REUSED = [
    "test_ragged_left_padded_forward_matches_unpadded",
    "test_rollback_to_arbitrary_lengths_then_feed",
    "test_select_drops_and_reorders_rows",
    "test_merge_runners_with_different_widths",
    "test_add_rows_into_running_batch_including_one_token_prompts",
    "test_commit_keeps_longest_common_prefix_of_fed_and_committed",
    "test_commit_over_drafts_fed_in_two_steps",
    "test_random_engine_loop_keeps_every_row_exact",
]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=ARCHS.index(request.param))


_assert_cache_sane = base.assert_cache_sane


def _sane(runner, lengths=None, packed=False):
    """tests.models.test_runner.assert_cache_sane without the `packed` promise."""
    _assert_cache_sane(runner, lengths, packed=False)
    assert runner.valid.shape[1] == getattr(runner, "max_cache_len", runner.valid.shape[1])


@pytest.mark.parametrize("max_cache_len", [40, 512])  # 40: the loop test compacts many times
@pytest.mark.parametrize("name", REUSED)
def test_runner_scenarios_with_a_static_cache(model, name, max_cache_len, monkeypatch):
    static = functools.partial(StaticModelRunner, max_cache_len=max_cache_len, checks=True)
    monkeypatch.setattr(base, "ModelRunner", lambda model, repack_fraction=None: static(model))  # it compacts on its own
    monkeypatch.setattr(base, "assert_cache_sane", _sane)
    getattr(base, name)(model, **({"repack": 1e9} if name == "test_rollback_to_arbitrary_lengths_then_feed" else {}))


def test_rollback_is_a_mask_update_and_compaction_keeps_logits(model):
    rng = random.Random(11)
    runner = StaticModelRunner(model, max_cache_len=24, checks=True)
    runner.add_rows(3)
    hist = [random_tokens(rng, n) for n in (5, 2, 7)]
    runner.forward(*right_aligned(hist), torch.ones(3, dtype=torch.int64))
    assert runner.write == 7
    keys_before = runner._layers()[0].keys
    runner.rollback(torch.tensor([3, 2, 4]))
    hist = [h[:k] for h, k in zip(hist, [3, 2, 4])]
    assert runner._layers()[0].keys is keys_before  # nothing moved
    assert runner.write == 7 and runner.lengths.tolist() == [3, 2, 4]
    for step in range(12):  # 12 chunks of 1..3 tokens through 24 columns: compactions happen
        new = [random_tokens(rng, rng.randint(1, 3)) for _ in hist]
        num = [rng.randint(1, len(n)) for n in new]
        logits = runner.forward(*right_aligned(new), torch.tensor(num), max_logits=max(num))
        hist = [h + n for h, n in zip(hist, new)]
        assert_rows_match(model, logits, hist, num)
        runner.rollback(torch.tensor([len(h) - rng.randint(0, 1) for h in hist]))
        hist = [h[: int(k)] for h, k in zip(hist, runner.lengths)]
        if max(len(h) for h in hist) > 18:
            break
    with pytest.raises(AssertionError):
        runner.rollback(runner.lengths + 1)


def test_cache_full_is_an_error(model):
    runner = StaticModelRunner(model, max_cache_len=8)
    runner.add_rows(1)
    runner.forward(*right_aligned([[5, 6, 7, 8, 9, 10]]), torch.ones(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not fit"):
        runner.forward(*right_aligned([[3, 4, 5]]), torch.ones(1, dtype=torch.int64))


def test_merge_static_into_static_and_empty_rows(model):
    rng = random.Random(12)
    a, b = StaticModelRunner(model, max_cache_len=64), StaticModelRunner(model, max_cache_len=64)
    a.add_rows(2)
    b.add_rows(2)
    ha, hb = [random_tokens(rng, n) for n in (3, 6)], [random_tokens(rng, n) for n in (9, 1)]
    a.forward(*right_aligned(ha), torch.ones(2, dtype=torch.int64))
    b.forward(*right_aligned(hb), torch.ones(2, dtype=torch.int64))
    a.rollback(torch.tensor([2, 6]))
    ha[0] = ha[0][:2]
    a.merge(b)
    e = StaticModelRunner(model, max_cache_len=64)
    e.add_rows(1)
    a.merge(e)  # a row that never ran a forward
    hist = ha + hb + [[]]
    new = [random_tokens(rng, n) for n in (2, 1, 3, 2, 4)]
    logits = a.forward(*right_aligned(new), torch.tensor([2, 1, 3, 2, 4]))
    hist = [h + n for h, n in zip(hist, new)]
    assert_rows_match(model, logits, hist, [2, 1, 3, 2, 4])
    a.select([])
    assert a.num_rows == 0 and a.write == 0


def test_engine_with_static_runners_matches_hf_greedy():
    """Wiring sketch: the engine unchanged, its two runners swapped for static ones
    (SequenceState prefills new rows in a ModelRunner and merges them in)."""
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=3, layers=1)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(4, 3, (EOS,)))
    engine.verifier.seqs = SequenceState(StaticModelRunner(target, max_cache_len=48))
    engine.drafter.seqs = SequenceState(StaticModelRunner(draft, vocab_size=VOCAB, max_cache_len=48))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 1, 12, 3, 7)]
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        out = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=20,
                              do_sample=False, eos_token_id=EOS, pad_token_id=0)
        assert r.token_ids == out[0, len(p):].tolist()


def test_a_decode_step_traces_as_one_graph_and_never_recompiles():
    """torch.compile / CUDA-graph readiness: dynamo captures a whole verification step
    (`_device_step`: columns, mask, the Llama over the static cache, the logits gather)
    with no graph break, and later steps (other write columns,
    rollbacks in between) reuse that graph: static shapes. (ModelRunner's DynamicCache also
    traces without a break, but its cache grows every step: new shapes, new buffers, so
    neither a fixed compiled graph nor a CUDA graph can be reused.)"""
    import torch._dynamo as dynamo

    model = tiny_model("llama", seed=0)
    runner = StaticModelRunner(model, max_cache_len=64)
    runner.add_rows(4)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (4, 8), generator=g)
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(4, dtype=torch.int64), max_logits=1)
    tok = torch.randint(3, VOCAB, (4, 5), generator=g)
    runner._w.fill_(runner.write)
    with torch.inference_mode():  # the whole step: columns, mask, model, logits gather
        explained = dynamo.explain(runner._device_step)(tok, torch.ones_like(tok, dtype=torch.bool), torch.full((4,), 5), 5, 5)
    dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1

    def graphs_over_steps(make_runner):
        graphs = []

        def backend(gm, example_inputs):  # counts graphs, runs them eagerly
            graphs.append(gm)
            return gm.forward

        r = make_runner()
        r._model_call = torch.compile(model, backend=backend, dynamic=False)
        r.add_rows(4)
        gen = torch.Generator().manual_seed(1)
        p = torch.randint(3, VOCAB, (4, 8), generator=gen)
        r.forward(p, torch.ones_like(p, dtype=torch.bool), torch.ones(4, dtype=torch.int64))
        counts = []
        for _ in range(4):
            tok = torch.randint(3, VOCAB, (4, 5), generator=gen)
            r.forward(tok, torch.ones_like(tok, dtype=torch.bool), torch.full((4,), 5))
            r.rollback(r.lengths - 2)
            counts.append(len(graphs))
        dynamo.reset()
        return counts

    assert graphs_over_steps(lambda: StaticModelRunner(model, max_cache_len=64)) == [2, 2, 2, 2]  # prefill + one decode graph


@pytest.mark.skipif(os.environ.get("RAYSD_COMPILE_TESTS") != "1", reason="inductor compile takes minutes on a CPU; RAYSD_COMPILE_TESTS=1")
def test_torch_compile_of_the_static_runner_matches_eager():
    model = tiny_model("llama", seed=0)

    def run(runner):
        g = torch.Generator().manual_seed(0)
        runner.add_rows(4)
        prompt = torch.randint(3, VOCAB, (4, 8), generator=g)
        out = [runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(4, dtype=torch.int64), max_logits=1)]
        for _ in range(4):
            tok = torch.randint(3, VOCAB, (4, 5), generator=g)
            out.append(runner.forward(tok, torch.ones_like(tok, dtype=torch.bool), torch.full((4,), 5), max_logits=5))
            runner.rollback(runner.lengths - 2)
        return out

    eager = run(StaticModelRunner(model, max_cache_len=64))
    compiled = run(StaticModelRunner(model, max_cache_len=64, compile=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
