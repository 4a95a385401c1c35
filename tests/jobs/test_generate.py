"""`raysd.jobs.generate` in process, on tiny models: counts, ids, exact tokens, error rows,
per-row overrides, resume, --overwrite, input formats."""

from __future__ import annotations

import dataclasses

import json
import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.jobs import GenerateConfig, JobError, generate
from raysd.jobs.io import OutputStore
from raysd.jobs.replica import row_seed
from raysd.models.loading import ModelSpec, load_model
from tests.conftest import EOS, VOCAB
from tests.jobs.conftest import replica_processes, token_prompts
from tests.reliability.chaos import wait_until

pytestmark = pytest.mark.slow


def read_output(path: str) -> pa.Table:
    store = OutputStore(path)
    tables = []
    for part in store.parts():
        with store.fs.open(part, "rb") as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables)


def by_id(table: pa.Table) -> dict:
    return {row["id"]: row for row in table.to_pylist()}


def reference(target_dir, draft, prompts, params, k=4):
    """SpecEngine, single process, on the same prompts: the tokens the job must reproduce."""
    target = load_model(ModelSpec(target_dir))
    if draft == "ngram":
        drafter = NgramDrafter(VOCAB)
    else:
        drafter = DraftModelDrafter(load_model(ModelSpec(draft)), VOCAB)
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,))
    engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=3))
    with torch.inference_mode():
        return [r.token_ids for r in engine.generate([Request(i, p, s) for i, (p, s) in enumerate(zip(prompts, params))])]


def test_job_matches_engine_with_error_rows_and_overrides(tmp_path, model_dirs, local_ray):
    target, draft = model_dirs
    prompts = token_prompts(9)
    rows = [{"prompt": p, "tag": f"t{i}", "max_new_tokens": None, "temperature": None} for i, p in enumerate(prompts)]
    rows[2]["max_new_tokens"] = 3  # per-row override
    rows[4]["temperature"] = 0.8  # sampled row: its seed comes from the job seed and its id
    rows += [
        {"prompt": [], "tag": "empty", "max_new_tokens": None, "temperature": None},
        {"prompt": [5, VOCAB + 7], "tag": "oov", "max_new_tokens": None, "temperature": None},
        {"prompt": [5] * 600, "tag": "long", "max_new_tokens": None, "temperature": None},  # context is 512
        {"prompt": [5, 6], "tag": "badtemp", "max_new_tokens": None, "temperature": -1.0},
    ]
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:6]), inp / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[6:]), inp / "b.parquet")
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft=draft, max_new_tokens=10,
                         seed=3, batch_size=4, quiet=True, num_speculative_tokens=4)  # the reference engine's K
    summary = generate(cfg)

    out = read_output(cfg.output)
    assert out.num_rows == len(rows) == summary.rows == summary.latest_run.rows
    ids = out.column("id").to_pylist()
    assert sorted(ids) == list(range(len(rows)))  # ids from the row order, each exactly once
    got = by_id(out)
    assert [got[i]["tag"] for i in range(len(rows))] == [r["tag"] for r in rows]  # passthrough
    errors = {got[i]["tag"]: got[i]["error"] for i in range(len(rows)) if got[i]["finish_reason"] == "error"}
    assert set(errors) == {"empty", "oov", "long", "badtemp"}
    assert "empty prompt" in errors["empty"]
    assert "outside the vocabulary" in errors["oov"]
    assert "context" in errors["long"]
    assert "temperature" in errors["badtemp"]
    assert summary.rows_failed == summary.latest_run.rows_failed == 4

    params = []
    for i, r in enumerate(rows[:9]):
        params.append(SamplingParams(temperature=r["temperature"] or 0.0, seed=row_seed(3, i),
                                     max_new_tokens=r["max_new_tokens"] or 10))
    expected = reference(target, draft, prompts, params)
    for i in range(9):
        assert got[i]["generated_token_ids"] == expected[i], i
        assert got[i]["num_generated_tokens"] == len(expected[i])
        assert got[i]["finish_reason"] in ("stop", "length")
        assert got[i]["error"] is None and got[i]["generated_text"] is None  # no tokenizer
        assert got[i]["seed"] == row_seed(3, i)
        assert sum(got[i]["acceptance_histogram"]) == got[i]["num_spec_steps"]
        assert got[i]["num_accepted_draft_tokens"] <= got[i]["num_draft_tokens"]
        assert got[i]["draft_model"] == draft and got[i]["num_speculative_tokens"] == 4
    assert got[2]["num_generated_tokens"] <= 3

    written = json.loads((tmp_path / "out" / "_summary.json").read_text())
    assert written["rows"] == len(rows) and written["generated_tokens"] == sum(len(e) for e in expected)
    assert written["generated_tokens"] == written["latest_run"]["generated_tokens"]  # a fresh output: one run
    assert written["mean_acceptance_length"] >= 1.0


def test_resume_after_partial_output_and_overwrite(tmp_path, model_dirs, local_ray):
    target, _ = model_dirs
    prompts = token_prompts(12, seed=1)
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(12)], "prompt": prompts}), inp)
    out = tmp_path / "out"
    cfg = GenerateConfig(input=str(inp), output=str(out), target=target, draft="ngram", max_new_tokens=6,
                         batch_size=2, rows_per_file=2, replicas=2, quiet=True)
    first = generate(cfg)
    assert first.rows == 12 and first.latest_run.replicas == 2
    # Both replicas' processes end with the job, the one that got no block (one input block) too:
    # none is left tearing its step graph down against the job's removed model actors, spinning a core.
    wait_until(lambda: not replica_processes(), "the replicas' processes to end", timeout=20)
    assert first.latest_run.time_breakdown["start"] > 0  # a fresh job starts its models (with the replica actors)
    full = by_id(read_output(str(out)))
    parts = sorted(p for p in os.listdir(out) if p.startswith("part-"))
    assert len(parts) >= 3
    # A crash after some files were written: drop half the parts, and leave a partial temporary file.
    dropped = parts[: len(parts) // 2]
    lost = sum(pq.read_metadata(out / p).num_rows for p in dropped)
    for p in dropped:
        os.remove(out / p)
    (out / "_tmp").mkdir(exist_ok=True)
    (out / "_tmp" / "part-partial.parquet").write_bytes(b"PAR1 truncated")

    second = generate(dataclasses.replace(cfg, replicas=1))  # the replica count is no part of the job's identity
    assert second.latest_run.rows == lost and second.latest_run.rows_skipped == 12 - lost
    table = read_output(str(out))
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(full) and len(ids) == len(set(ids)) == 12  # nothing lost, nothing doubled
    again = by_id(table)
    assert all(again[k]["generated_token_ids"] == full[k]["generated_token_ids"] for k in full)

    # Everything written: a re-run generates nothing and starts no model, and the summary keeps
    # the output's totals (its latest run's own figures are the no-op's).
    third = generate(cfg)
    assert third.latest_run.rows == 0 and third.rows == 12
    assert third.latest_run.time_breakdown["start"] == 0  # resumed: models start at a first row, and there was none
    assert third.generated_tokens == sum(len(r["generated_token_ids"]) for r in table.to_pylist()) > 0
    assert third.latest_run.generated_tokens == 0 and third.mean_acceptance_length == second.mean_acceptance_length

    # A different job into the same output is refused; --overwrite starts over.
    with pytest.raises(JobError, match="different"):
        generate(GenerateConfig(**{**cfg.to_dict(), "max_new_tokens": 7}))
    fourth = generate(GenerateConfig(**{**cfg.to_dict(), "max_new_tokens": 7, "overwrite": True, "replicas": 1}))
    assert fourth.latest_run.rows == 12 and fourth.latest_run.rows_skipped == 0 and read_output(str(out)).num_rows == 12


def test_a_model_that_fails_to_load_at_the_eager_start_fails_the_job(tmp_path, model_dirs, local_ray):
    """A fresh job starts its replicas' models when the actors start (GenerateReplica, eager), in a
    thread; a load that fails there fails the job at the first block with the loader's error."""
    import shutil

    target = tmp_path / "broken"
    shutil.copytree(model_dirs[0], target)
    (target / "model.safetensors").write_bytes(b"not a safetensors file")  # passes check_job, fails the load
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(token_prompts(4))))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=str(target), draft="ngram",
                         max_new_tokens=4, batch_size=2, quiet=True)
    with pytest.raises(Exception, match="deserializing header"):
        generate(cfg)


def test_jsonl_and_memory_fs_and_plain_decoding(tmp_path, model_dirs, local_ray):
    target, _ = model_dirs
    prompts = token_prompts(5, seed=2)
    # memory:// in and out (any fsspec URL), a string id column, plain autoregressive decoding.
    fs = fsspec.filesystem("memory")
    with fs.open("/jobs-in/prompts.parquet", "wb") as f:
        pq.write_table(pa.table({"key": [f"k{i}" for i in range(5)], "prompt": prompts}), f)
    cfg = GenerateConfig(input="memory://jobs-in", output="memory://jobs-out", id_column="key", target=target,
                         draft="none", max_new_tokens=5, batch_size=3, quiet=True)
    summary = generate(cfg)
    out = read_output("memory://jobs-out")
    assert sorted(out.column("key").to_pylist()) == [f"k{i}" for i in range(5)]
    assert set(out.column("num_speculative_tokens").to_pylist()) == {0} and summary.draft_acceptance_rate is None
    assert summary.latest_run.draft_acceptance_rate is None
    assert set(out.column("mean_acceptance_length").to_pylist()) == {1.0}
    expected = reference(target, "ngram", prompts, [SamplingParams(max_new_tokens=5)] * 5, k=0)
    got = {r["key"]: r["generated_token_ids"] for r in out.to_pylist()}
    assert [got[f"k{i}"] for i in range(5)] == expected
    assert fs.exists("/jobs-out/_summary.json")


def test_ids_follow_row_order_across_files_and_blocks(tmp_path, model_dirs, local_ray):
    """No id column: ids are positions in the input, across several files and blocks (AssignIds runs
    as one actor under preserve_order). JSON Lines whose prompt column mixes types (read_text + parse)."""
    target, _ = model_dirs
    prompts = token_prompts(17, seed=4)
    inp = tmp_path / "pq"
    inp.mkdir()
    bounds = [0, 7, 9, 17]  # three files; the first and last with several row groups (blocks)
    for f, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        table = pa.table({"prompt": prompts[lo:hi], "tag": [f"r{i}" for i in range(lo, hi)]})
        pq.write_table(table, inp / f"part{f}.parquet", row_group_size=3)
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft="none", max_new_tokens=2,
                         batch_size=3, rows_per_file=4, quiet=True)
    summary = generate(cfg)
    rows = read_output(cfg.output).to_pylist()
    assert summary.rows == len(rows) == 17
    assert sorted(r["id"] for r in rows) == list(range(17))
    assert all(r["tag"] == f"r{r['id']}" for r in rows)  # id == the row's position in the input
    assert all(r["generated_token_ids"] and r["finish_reason"] != "error" for r in rows)

    jl = tmp_path / "jl"
    jl.mkdir()
    lines = [{"prompt": p, "tag": f"j{i}"} for i, p in enumerate(token_prompts(5, seed=5))]
    lines[3]["prompt"] = "a string prompt"  # mixed types; no tokenizer: an error row
    (jl / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:2]))
    (jl / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[2:]))
    cfg = GenerateConfig(input=str(jl), output=str(tmp_path / "out-jl"), target=target, draft="none", max_new_tokens=2,
                         batch_size=2, quiet=True)
    summary = generate(cfg)
    got = by_id(read_output(cfg.output))
    assert sorted(got) == list(range(5)) and all(got[i]["tag"] == f"j{i}" for i in range(5))
    assert got[3]["finish_reason"] == "error" and "no tokenizer" in got[3]["error"]
    assert got[3]["prompt"] == "a string prompt" and json.loads(got[0]["prompt"]) == lines[0]["prompt"]
    assert summary.rows_failed == 1


def test_ray_data_readers_keep_rows_and_order(tmp_path, local_ray):
    """Every input kind as the pipeline reads it (InputSource.dataset), no model: same rows, same order."""
    import datasets
    from ray.data import DataContext

    from raysd.jobs.io import open_input

    rows = [{"id": i, "prompt": [3 + i, 4, 5]} for i in range(7)]
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:4]), d / "a.parquet", row_group_size=2)
    pq.write_table(pa.Table.from_pylist(rows[4:]), d / "b.parquet")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixed = [{"id": 0, "prompt": "text"}, {"id": 1, "prompt": [1, 2]}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    fs = fsspec.filesystem("memory")
    with fs.open("/readers-test/x.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(rows), f)

    ctx = DataContext.get_current()
    saved = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    try:
        for url in (str(d), f"{d}/*.parquet", f"file://{d}", str(tmp_path / "p.jsonl"), str(tmp_path / "ds"),
                    "memory://readers-test/x.parquet"):
            assert open_input(url).dataset().take_all() == rows, url
        got = open_input(str(tmp_path / "m.jsonl")).dataset().take_all()
        assert [json.loads(r["prompt"]) for r in got] == [r["prompt"] for r in mixed]  # carried as JSON text
    finally:
        ctx.execution_options.preserve_order = saved
