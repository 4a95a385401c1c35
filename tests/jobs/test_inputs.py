"""Input formats and fail-fast checks: no Ray, no model weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raysd.jobs import GenerateConfig, JobError
from raysd.jobs.config import DEFAULT_DRAFT
from raysd.jobs.io import open_input
from raysd.jobs.replica import prompt_token_ids, row_params, row_seed, with_eos_ids
from raysd.jobs.runner import check_job
from raysd.jobs.schema import GENERATED_FIELDS, output_schema

ROWS = [{"id": i, "prompt": [3 + i, 4, 5]} for i in range(7)]


def rows_of(source, batch_size=3):
    return [r for batch in source.batches(batch_size) for r in batch]


def test_parquet_file_dir_glob_and_memory(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), d / "a.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[4:]), d / "b.parquet")
    for url in (str(d), f"{d}/*.parquet", f"file://{d}"):
        src = open_input(url)
        assert src.kind == "parquet" and src.num_rows == 7
        assert rows_of(src) == ROWS  # in order, all of them
    assert rows_of(open_input(str(d / "a.parquet"))) == ROWS[:4]
    fs = fsspec.filesystem("memory")
    with fs.open("/inputs-test/x.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(ROWS), f)
    assert rows_of(open_input("memory://inputs-test/x.parquet")) == ROWS


def test_jsonl_mixed_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello"}, {"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [1, 2, 3], "extra": 1}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    src = open_input(str(path))
    assert src.kind == "jsonl" and "prompt" in src.json_columns
    assert rows_of(src, 2) == lines
    assert src.schema.field("extra").type == pa.int64()


def test_datasets_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    src = open_input(str(tmp_path / "ds"))
    assert src.kind == "datasets" and src.num_rows == 7 and rows_of(src) == ROWS
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dd"))
    assert rows_of(open_input(str(tmp_path / "dd"), split="test")) == ROWS[:2]
    assert open_input(str(tmp_path / "dd")).num_rows == 7  # train by default
    with pytest.raises(JobError, match="no split"):
        open_input(str(tmp_path / "dd"), split="nope")


def test_prompt_forms_and_row_params():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(m["content"] for m in messages) + "|assistant"

        def __call__(self, text, add_special_tokens=True):
            return type("E", (), {"input_ids": [len(w) for w in text.split("|")]})()

    assert prompt_token_ids([5, 6], None, True) == ([5, 6], None)
    assert prompt_token_ids("hi", None, True)[1].startswith("the target model has no tokenizer")
    assert prompt_token_ids("", Tok(), True) == (None, "empty prompt")
    assert prompt_token_ids([], Tok(), True) == (None, "empty prompt")
    assert prompt_token_ids("abc", Tok(), True) == ([3, 9], None)  # chat template applied
    assert prompt_token_ids([{"role": "user", "content": "ab"}], Tok(), True) == ([2, 9], None)
    assert "token ids" in prompt_token_ids([1, "a"], Tok(), True)[1]
    cfg = GenerateConfig(input="x", output="y", max_new_tokens=9, temperature=0.5, seed=11)
    params, seed, err = row_params({"id": 4}, cfg)
    assert err is None and params.max_new_tokens == 9 and params.temperature == 0.5 and seed == row_seed(11, 4)
    params, seed, err = row_params({"id": 4, "max_new_tokens": 2, "temperature": 0, "seed": 5}, cfg)
    assert (params.max_new_tokens, params.temperature, seed) == (2, 0.0, 5)
    assert row_params({"id": 4, "max_new_tokens": 0}, cfg)[2] is not None
    # Stable, id-dependent seeds (not Python's randomised hash).
    assert row_seed(0, 1) == row_seed(0, 1) != row_seed(0, 2) != row_seed(1, 2)
    assert row_seed(0, 1) != row_seed(0, "1")
    out = subprocess.run([sys.executable, "-c", "from raysd.jobs.replica import row_seed; print(row_seed(0, 'a'))"],
                         capture_output=True, text=True, check=True)
    assert int(out.stdout) == row_seed(0, "a")


def test_schema_is_explicit():
    schema = output_schema(pa.field("id", pa.int64()), [pa.field("prompt", pa.string())])
    assert schema.names[:2] == ["id", "prompt"]
    assert schema.field("generated_token_ids").type == pa.list_(pa.int32())
    assert [f.name for f in GENERATED_FIELDS][:8] == [
        "sample_index", "generated_text", "generated_token_ids", "generated_logprobs", "top_logprobs", "num_prompt_tokens",
        "num_generated_tokens", "finish_reason"]
    assert DEFAULT_DRAFT == "suffix"


def test_check_job_catches_problems_before_any_model(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    inp = str(tmp_path / "in.parquet")
    with pytest.raises(JobError, match="no column 'text'"):
        check_job(GenerateConfig(input=inp, output=str(tmp_path / "o"), prompt_column="text"))
    with pytest.raises(JobError, match="does not exist"):
        check_job(GenerateConfig(input=str(tmp_path / "missing.parquet"), output=str(tmp_path / "o")))
    with pytest.raises(JobError, match="top-p"):
        GenerateConfig(input=inp, output="o", top_p=0)
    with pytest.raises(JobError, match="--placement-strategy must be one of STRICT_PACK, PACK, SPREAD, STRICT_SPREAD"):
        GenerateConfig(input=inp, output="o", placement_strategy="spread")
    with pytest.raises(JobError, match="--replica-shape must be one of auto, colocated, split"):
        GenerateConfig(input=inp, output="o", replica_shape="both")


BAD_JOBS = {
    "missing column": (["--prompt-column", "text"], "no column 'text'"),
    "unreadable input": (["--input", "{tmp}/nope.parquet"], "does not exist"),
    "corrupt parquet": (["--input", "{tmp}/bad.parquet"], "cannot read Parquet"),
    "unknown model": (["--target", "{tmp}/no/such/model"], "does not exist"),
    "bad flag value": (["--temperature", "-1"], "--temperature must be >= 0"),
    "bad replicas": (["--replicas", "0"], "--replicas must be >= 1"),
    "foreign output": (["--output", "{tmp}/foreign"], "not written by raysd"),
    "missing GPUs": (["--num-gpus-per-actor", "0.5"], "model actor(s); this machine has 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_bad_job_fails_fast_with_one_line(tmp_path, case):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    extra, message = BAD_JOBS[case]
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--quiet"]
    args += [a.format(tmp=tmp_path) for a in extra]
    env = {**os.environ, "RAY_ADDRESS": ""}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raysd", "generate", *args], capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 20, elapsed  # before Ray or any model: the interpreter and torch import only
    assert not (tmp_path / "out" / "_job.json").exists() or case == "foreign output"


def test_num_speculative_tokens_auto_is_parsed_and_validated():
    from raysd.jobs.cli import _k_value
    from raysd.jobs.config import AUTO_MAX_K, GenerateConfig, JobError

    cfg = GenerateConfig(input="in.jsonl", output="out", num_speculative_tokens=_k_value("auto"))
    assert cfg.adaptive_speculation and cfg.effective_num_speculative_tokens == AUTO_MAX_K
    assert not GenerateConfig(input="in.jsonl", output="out", num_speculative_tokens=_k_value("3")).adaptive_speculation
    assert not GenerateConfig(input="in.jsonl", output="out", draft="none", num_speculative_tokens="auto").adaptive_speculation
    with pytest.raises(JobError, match="auto"):
        GenerateConfig(input="in.jsonl", output="out", num_speculative_tokens="fast")


def test_k_defaults_to_auto_with_or_without_a_tree():
    import argparse

    from raysd.jobs.cli import add_arguments, config_from_args
    from raysd.jobs.config import AUTO, AUTO_MAX_K, GenerateConfig

    assert GenerateConfig(input="in.jsonl", output="out").num_speculative_tokens == AUTO
    tree = GenerateConfig(input="in.jsonl", output="out", tree_budget=8)
    assert tree.num_speculative_tokens == AUTO and tree.adaptive_speculation
    assert tree.effective_num_speculative_tokens == AUTO_MAX_K  # the trees' depth limit
    fixed = GenerateConfig(input="in.jsonl", output="out", tree_budget=8, num_speculative_tokens=4)
    assert fixed.num_speculative_tokens == 4 and not fixed.adaptive_speculation
    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = ["--input", "in.jsonl", "--output", "out"]
    assert config_from_args(p.parse_args(flags)).num_speculative_tokens == AUTO
    assert config_from_args(p.parse_args(flags + ["--tree-budget", "8"])).num_speculative_tokens == AUTO
    assert config_from_args(p.parse_args(flags + ["-k", "3"])).num_speculative_tokens == 3


def test_actor_cpus_auto_shares_a_local_machine_and_is_one_elsewhere():
    import argparse

    from raysd.jobs.cli import add_arguments, config_from_args
    from raysd.jobs.config import MODEL_FREE_DRAFT_CPUS, GenerateConfig, JobError

    def cfg(**kw):
        return GenerateConfig(input="in.jsonl", output="out", **kw)

    # A local Ray on 16 cores: a model-free drafter leaves every core to the target...
    assert cfg(draft="ngram").resolve_actor_cpus(16).actor_cpus == (16.0, MODEL_FREE_DRAFT_CPUS)
    assert cfg(draft="none", replicas=2).resolve_actor_cpus(16).actor_cpus == (8.0, MODEL_FREE_DRAFT_CPUS)
    # ...a draft model shares them with it, and a crowded machine still gives each model one.
    assert cfg(draft="some/draft").resolve_actor_cpus(16).actor_cpus == (8.0, 8.0)
    assert cfg(draft="some/draft", replicas=3).resolve_actor_cpus(2).actor_cpus == (1.0, 1.0)
    # A cluster (cores unknown) or GPUs: 1 per model actor; an explicit number is kept.
    assert cfg(draft="ngram").resolve_actor_cpus(None).actor_cpus == (1.0, MODEL_FREE_DRAFT_CPUS)
    assert cfg(draft="some/draft", num_gpus_per_actor=1).resolve_actor_cpus(16).actor_cpus == (1.0, 1.0)
    assert cfg(draft="some/draft", num_cpus_per_actor=3).resolve_actor_cpus(16).actor_cpus == (3.0, 3.0)
    with pytest.raises(JobError, match="cannot both be 0"):
        cfg(num_cpus_per_actor=0)

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = ["--input", "in.jsonl", "--output", "out"]
    assert config_from_args(p.parse_args(flags)).num_cpus_per_actor is None
    assert config_from_args(p.parse_args(flags + ["--num-cpus-per-actor", "auto"])).num_cpus_per_actor is None
    assert config_from_args(p.parse_args(flags + ["--num-cpus-per-actor", "2"])).num_cpus_per_actor == 2.0
    with pytest.raises(SystemExit):
        p.parse_args(flags + ["--num-cpus-per-actor", "many"])


def test_a_parquet_read_starts_footer_readers_for_its_files_not_32(monkeypatch):
    """Ray Data lists a Parquet input through a pool of FooterReader actors, 32 processes by default
    whatever the input (~1 s of CPU each): raysd sizes the pool to the files (one reader per 10),
    for the read alone, through Ray Data's environment knob, which its file indexer reads when
    `read_parquet` builds it. A value the user set stands."""
    from ray.data._internal.datasource_v2.formats.parquet.footer_file_indexer import FooterFileIndexer

    from raysd.jobs.io import _footer_readers

    key = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
    monkeypatch.delenv(key, raising=False)
    for files, readers in ((1, 1), (2, 1), (10, 1), (11, 2), (2000, 32)):
        with _footer_readers(files):
            assert FooterFileIndexer(ignore_missing_paths=False)._num_actors == readers, files
        assert key not in os.environ
    assert FooterFileIndexer(ignore_missing_paths=False)._num_actors == 32  # Ray Data's own default
    monkeypatch.setenv(key, "5")
    with _footer_readers(2):
        assert FooterFileIndexer(ignore_missing_paths=False)._num_actors == 5
    assert os.environ[key] == "5"


FIRST_READ = """
from raysd.jobs.io import _footer_readers
with _footer_readers(1):  # a job's read in a process that had not imported Ray Data's Parquet indexer yet
    from ray.data._internal.datasource_v2.formats.parquet.footer_file_indexer import FooterFileIndexer
print(FooterFileIndexer(ignore_missing_paths=False)._num_actors)
"""


def test_a_jobs_parquet_read_leaves_ray_datas_default_as_it_was():
    """The indexer's module takes its default from the variable when first imported: a job's read
    that imports it must not make one reader the default of every later read in the process."""
    out = subprocess.run([sys.executable, "-c", FIRST_READ], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "32"


def test_the_targets_eos_comes_from_its_files_then_its_tokenizer(tmp_path):
    """The driver reads the EOS ids before any actor starts: what the loaded model says (its
    generation config, else its model config), else its tokenizer's, else none."""
    from raysd.models.loading import eos_token_ids
    from tests.conftest import EOS, tiny_model
    from tests.reliability.conftest import tiny_tokenizer

    def eos(path):
        return with_eos_ids(GenerateConfig(input="in.jsonl", output="out", target=str(path))).eos_token_ids

    model = tiny_model("llama", seed=0)
    model.save_pretrained(tmp_path / "model")
    assert eos(tmp_path / "model") == eos_token_ids(model) == (EOS,)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "no-eos")
    assert eos(tmp_path / "no-eos") == ()
    tiny_tokenizer().save_pretrained(tmp_path / "no-eos")
    assert eos(tmp_path / "no-eos") == (2,)  # the tokenizer's </s>
