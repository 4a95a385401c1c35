"""Fixtures for the reliability tests: tiny random models saved as safetensors, a tiny
tokenizer with a chat template built in-process (no download), and one local Ray."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import EOS, VOCAB, tiny_model

# The tiny tokenizer: 4 specials, then plain words; anything else is <unk>.
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS) - 8)] + ["user", "assistant", "system", ":", "hello", "world", "the", "a"]
# Unknown roles are refused by the template itself, as real templates do (raise_exception).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<s> {{ m['role'] }} : {{ m['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def tiny_tokenizer():
    """A PreTrainedTokenizerFast over a WordLevel model built here, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    assert len(vocab) == VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """(target, draft, target_with_tokenizer): safetensors only."""
    root = tmp_path_factory.mktemp("rel-models")
    target, draft, tok_target = root / "target", root / "draft", root / "target-tok"
    tiny_model("llama", seed=0).save_pretrained(target)
    tiny_model("llama", seed=1, layers=1).save_pretrained(draft)
    shutil.copytree(target, tok_target)
    tiny_tokenizer().save_pretrained(tok_target)
    assert EOS == 2
    return str(target), str(draft), str(tok_target)


def keyed_input(root, model_dirs, n_rows: int, max_new_tokens: int, seed: int):
    """(a JSON Lines input of `n_rows` token-id prompts keyed k000, k001, ..., {key: the greedy tokens
    of the single-process engine}): what a clean job writes for each key (tests/jobs/test_generate.py)."""
    import json

    from raysd.core.sampling import SamplingParams
    from tests.jobs.conftest import token_prompts
    from tests.jobs.test_generate import reference

    target, draft, _ = model_dirs
    prompts = token_prompts(n_rows, seed=seed)
    inp = root / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"key": f"k{i:03d}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    ref = reference(target, draft, prompts, [SamplingParams(max_new_tokens=max_new_tokens)] * n_rows)
    return inp, {f"k{i:03d}": toks for i, toks in enumerate(ref)}


def read_rows(out) -> list[dict]:
    import pyarrow.parquet as pq
    from pathlib import Path

    parts = sorted(Path(out).glob("part-*.parquet"))
    return [r for p in parts for r in pq.read_table(p).to_pylist()]
