"""The GGUF conversion cache (raysd.models.gguf_cache): a cached load gives exactly what converting
the file gives (weights bit for bit, tied head, config, generation config, tokenizer), a changed
file or library converts again, a damaged entry or an unwritable cache is reported and converted."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from raysd.models import gguf_cache
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, embedded_gguf_path, load_model, load_tokenizer

TEXTS = ["Hello world!", "def f(x):\n    return x ** 2  # squares", "émoji 🎉 and 中文, tabs\tand  spaces"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RAYSD_GGUF_CACHE", raising=False)
    return tmp_path / "gguf"


def entries(cache: Path, what: str) -> list[Path]:
    return sorted(p for p in cache.glob(f"*-{what}-*") if not p.name.startswith("."))


def same_tokenizer(a, b) -> None:
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids, text
        chat = [{"role": "user", "content": text}]
        assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (len(a), a.eos_token_id, a.all_special_ids) == (len(b), b.eos_token_id, b.all_special_ids)


def test_cached_model_is_the_conversion_bit_for_bit(cache):
    converted = load_model(ModelSpec())  # converts the GGUF file and stores the result
    (entry,) = entries(cache, "model")
    assert (entry / "model.safetensors").is_file()
    cached = load_model(ModelSpec())  # reads the entry
    a, b = converted.state_dict(), cached.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    ca, cb = converted.config.to_dict(), cached.config.to_dict()
    assert {k: v for k, v in ca.items() if k != "_name_or_path"} == {k: v for k, v in cb.items() if k != "_name_or_path"}
    assert converted.generation_config.to_dict() == cached.generation_config.to_dict()
    assert getattr(converted, "hf_quantizer", None) is None is getattr(cached, "hf_quantizer", None)
    ids = torch.tensor([[1, 504, 3300, 28, 2113]])
    with torch.inference_mode():
        assert torch.equal(converted(ids).logits, cached(ids).logits)


def test_cached_tokenizer_encodes_as_the_conversion(cache):
    converted = load_tokenizer(DEFAULT_MODEL)
    assert len(entries(cache, "tokenizer")) == 1
    same_tokenizer(converted, load_tokenizer(DEFAULT_MODEL))


def test_damaged_entry_is_reported_and_converted_again(cache, caplog):
    reference = load_tokenizer(DEFAULT_MODEL)
    (entry,) = entries(cache, "tokenizer")
    (entry / "tokenizer.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="raysd.models.gguf_cache"):
        again = load_tokenizer(DEFAULT_MODEL)
    assert "unreadable" in caplog.text
    same_tokenizer(reference, again)
    assert entries(cache, "tokenizer") == [entry] and "not json" not in (entry / "tokenizer.json").read_text()


def test_unwritable_cache_is_reported_and_the_file_still_loads(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("RAYSD_CACHE_DIR", str(blocker))  # a file: no directory can be made under it
    with caplog.at_level(logging.WARNING, logger="raysd.models.gguf_cache"):
        tok = load_tokenizer(DEFAULT_MODEL)
    assert "cannot cache" in caplog.text
    assert tok(TEXTS[0]).input_ids


def test_switched_off_writes_nothing(cache, monkeypatch):
    monkeypatch.setenv("RAYSD_GGUF_CACHE", "0")
    assert load_tokenizer(DEFAULT_MODEL) is not None
    assert not cache.exists()


def test_key_follows_the_file_the_dtype_and_what(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSD_CACHE_DIR", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    first = gguf_cache.entry_dir(f, "model", "float32")
    assert first == gguf_cache.entry_dir(f, "model", "float32")
    assert len({first, gguf_cache.entry_dir(f, "model", "bfloat16"), gguf_cache.entry_dir(f, "tokenizer", "-")}) == 3
    os.utime(f, ns=(1, 1))
    assert gguf_cache.entry_dir(f, "model", "float32") != first  # touched: converted again
    assert gguf_cache.entry_dir(embedded_gguf_path(), "model", "float32").parent == tmp_path / "gguf"


def test_a_concurrent_loader_that_stored_first_wins_quietly(tmp_path, caplog):
    class Saved:
        def __init__(self, text):
            self.text = text

        def save_pretrained(self, directory):
            (Path(directory) / "payload").write_text(self.text)

    directory = tmp_path / "entry"
    gguf_cache._store(directory, Saved("first"), {"gguf": "f"})
    with caplog.at_level(logging.WARNING, logger="raysd.models.gguf_cache"):
        gguf_cache._store(directory, Saved("second"), {"gguf": "f"})  # the rename fails: the entry exists
    assert (directory / "payload").read_text() == "first" and not caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no temporary directory left behind
