"""The embedded default target (real SmolLM2-135M-Instruct weights): token-identical
greedy output to its own `generate`, at batch 1 and 8, prompts of different lengths."""

from __future__ import annotations

import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.loading import eos_token_ids
from tests.conftest import tiny_model

pytestmark = pytest.mark.slow
MAX_NEW = 16
QUESTIONS = [
    "What is 2+2?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Translate 'good morning' into French.",
    "hi",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away into the forest.",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def setup(smollm2):
    torch.set_num_threads(2)  # a real model uses both cores (the session default is 1)
    model, tok = smollm2
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    assert len({len(p) for p in prompts}) > 4  # really different lengths
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
            for p in prompts
        ]
    yield model, prompts, expected
    torch.set_num_threads(1)


def generate(model, drafter, prompts, k, batch_size):
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=eos_token_ids(model))
    engine = SpecEngine(model, drafter, EngineConfig(speculation, max_batch_size=batch_size))
    return [r for r in engine.generate([Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(prompts)])]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_self_draft_batch8(setup, k):
    model, prompts, expected = setup
    V = model.get_output_embeddings().weight.shape[0]
    results = generate(model, DraftModelDrafter(model, V), prompts, k, 8)
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.draft_acceptance_rate == 1.0 for r in results)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_ngram_and_random_draft(setup, batch_size):
    model, prompts, expected = setup
    V = model.get_output_embeddings().weight.shape[0]
    n = 2 if batch_size == 1 else len(prompts)
    assert [r.token_ids for r in generate(model, NgramDrafter(V), prompts[:n], 4, batch_size)] == expected[:n]
    random_draft = tiny_model("llama", seed=1, layers=1, vocab=V + 128)  # padded wider, as 49280 vs 49152
    assert [r.token_ids for r in generate(model, DraftModelDrafter(random_draft, V), prompts[:n], 8, batch_size)] == expected[:n]


@pytest.mark.parametrize("batch_size", [1, 8])
def test_shipped_distilled_draft(setup, batch_size):
    """The draft shipped in raysd/data (raysd distill, docs/distill.md) loads by name, offline, and
    changes nothing in greedy output; it drafts only inside its FR-Spec head. Batch 1 runs the
    prompts one after another: three of them (the shortest, a middle and the longest), as in
    test_ngram_and_random_draft; batch 8 runs all eight."""
    from raysd.models.loading import DEFAULT_DRAFT, ModelSpec, load_model

    model, prompts, expected = setup
    draft = load_model(ModelSpec(DEFAULT_DRAFT))
    assert draft.config.num_hidden_layers == 2
    V = model.get_output_embeddings().weight.shape[0]
    if batch_size == 1:
        by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        chosen = [by_length[0], by_length[len(by_length) // 2], by_length[-1]]
        prompts, expected = [prompts[i] for i in chosen], [expected[i] for i in chosen]
    results = generate(model, DraftModelDrafter(draft, V), prompts, 3, batch_size)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > 0  # it is a real draft, not a random one
