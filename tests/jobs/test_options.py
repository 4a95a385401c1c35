"""The job layer's options: N samples per prompt (resumed per (id, sample_index)), stop strings,
log-probabilities, per-row top_p/top_k, dtype auto, the cloud extras' hint, and one-line errors
for every new flag before anything loads."""

from __future__ import annotations

import argparse
import json
import shutil

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
from raysd.jobs.cli import add_arguments, config_from_args
from raysd.jobs.pipeline import DONE_SAMPLES, ID_ERROR, AssignIds, internal_schema
from raysd.jobs.replica import row_params, row_seed, sample_seed
from raysd.models.loading import ModelSpec, load_model, model_dtype, resolve_dtype
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_distribution_e2e import V, assert_first_two_tokens_follow_target, copyable_prompt
from tests.engine.test_outputs import forward_logprobs
from tests.jobs.conftest import token_prompts
from tests.reliability.conftest import tiny_tokenizer


def parse(*argv: str) -> GenerateConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["--input", "in.jsonl", "--output", "out", *argv]))


def test_every_new_flag_parses_and_bad_values_are_one_line_errors():
    cfg = parse("-n", "4", "--stop", "###", "--stop", "\n\n", "--include-stop-str-in-output", "--top-logprobs", "5",
                "--logprobs-mode", "processed", "--target-dtype", "bfloat16", "--verbose")
    assert (cfg.num_samples, cfg.stop, cfg.include_stop_str_in_output) == (4, ("###", "\n\n"), True)
    assert (cfg.logprobs, cfg.top_logprobs, cfg.logprobs_mode, cfg.verbose) == (True, 5, "processed", True)
    assert (cfg.target_dtype, cfg.draft_dtype) == ("bfloat16", "auto")
    default = parse()
    assert (default.num_samples, default.stop, default.logprobs, default.top_logprobs) == (1, (), False, 0)
    assert (default.target_dtype, default.draft_dtype, default.quiet, default.verbose) == ("auto", "auto", False, False)
    assert parse("--cuda-graphs", "--num-gpus-per-actor", "1").cuda_graphs and not default.cuda_graphs
    assert parse("--max-model-len", "40").speculation.max_model_len == 40 and default.speculation.max_model_len is None
    bad = {
        ("-n", "0"): "--num-samples must be an integer in 1..1024, got 0",
        ("--stop", ""): "--stop must be a non-empty string, got ''",
        ("--top-logprobs", "21"): "--top-logprobs must be an integer in 0..20, got 21",
        ("--logprobs-mode", "processed"): "--logprobs-mode processed needs --logprobs or --top-logprobs",
        ("--draft-dtype", "fp8"): "--draft-dtype must be one of auto, float32, bfloat16, float16, got 'fp8'",
        ("--cuda-graphs",): "--cuda-graphs replays CUDA graphs: it needs GPUs (--num-gpus-per-actor > 0)",
        ("--compile", "--num-gpus-per-actor", "1"): "--compile compiles the forwards that --cuda-graphs captures: it needs --cuda-graphs",
        ("--max-model-len", "1"): "--max-model-len must be an integer >= 2, got 1",
    }
    for argv, message in bad.items():
        with pytest.raises(JobError) as err:
            parse(*argv)
        assert str(err.value) == message and "\n" not in message
    with pytest.raises(JobError, match="exclude each other"):
        GenerateConfig(input="x", output="y", quiet=True, verbose=True)
    with pytest.raises(SystemExit):  # argparse refuses both flags together
        parse("--quiet", "--verbose")


def test_cuda_graphs_reach_the_model_actors_and_refuse_a_cpu():
    """--cuda-graphs sets the target's (CoordinatorConfig) and a draft model's (DrafterSpec) graphs; a
    model actor that is not on a GPU refuses them before loading its model (tests/gpu runs them)."""
    from raysd.actors.settings import CoordinatorConfig
    from raysd.actors.model_actors import DrafterSpec, DraftWorker, TargetWorker

    def never():
        raise AssertionError("a model actor on a CPU must refuse cuda_graphs before loading its model")

    with pytest.raises(ValueError, match="not a GPU"):
        TargetWorker(never, cuda_graphs=True)
    with pytest.raises(ValueError, match="not a GPU"):
        DraftWorker(DrafterSpec(never, cuda_graphs=True), VOCAB)
    with pytest.raises(ValueError, match="static runner"):
        CoordinatorConfig(runner="dynamic", cuda_graphs=True)
    for bad in ({}, {"runner": "dynamic"}, {"draft_assist": "ngram"}):
        with pytest.raises(ValueError, match="cuda_graphs needs a draft model"):
            DrafterSpec(never if bad else None, cuda_graphs=True, **bad)


def test_compile_reaches_the_runners_and_needs_the_static_one():
    """--compile (with --cuda-graphs) sets the target's (CoordinatorConfig, EngineConfig) and a draft model's
    (DrafterSpec, DraftModelDrafter) compiled steps; the dynamic runner and an assisted or absent draft
    model refuse it. Nothing compiles until a step runs (tests/gpu runs them)."""
    from raysd.actors.settings import CoordinatorConfig
    from raysd.actors.model_actors import DrafterSpec
    from raysd.engine.drafters import NoDrafter

    def never():
        raise AssertionError("not loaded")

    assert parse("--cuda-graphs", "--compile", "--num-gpus-per-actor", "1").compile
    with pytest.raises(ValueError, match="static runner"):
        CoordinatorConfig(runner="dynamic", compile=True)
    with pytest.raises(ValueError, match="static runner"):
        EngineConfig(runner="dynamic", compile=True)
    for bad in ({}, {"runner": "dynamic"}, {"draft_assist": "ngram"}):
        with pytest.raises(ValueError, match="compile needs a draft model"):
            DrafterSpec(never if bad else None, compile=True, **bad)
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    engine = SpecEngine(target, NoDrafter(VOCAB), EngineConfig(compile=True))
    assert engine.target.rows.runner._compiled is not None
    assert DraftModelDrafter(draft, VOCAB, compile=True).rows.runner._compiled is not None
    assert SpecEngine(target, NoDrafter(VOCAB), EngineConfig()).target.rows.runner._compiled is None


def test_fingerprint_adds_new_keys_only_when_not_default():
    old_keys = {"prompt_column", "id_column", "split", "chat_template", "target", "target_dtype", "draft", "draft_dtype",
                "num_speculative_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "seed"}
    plain = GenerateConfig(input="x", output="y").fingerprint()
    assert set(plain) == old_keys  # an output written before these options resumes
    # "auto" without a GPU is float32, as the outputs written before "auto" recorded it.
    assert plain["target_dtype"] == plain["draft_dtype"] == "float32"
    assert GenerateConfig(input="x", output="y", num_gpus_per_actor=1).fingerprint()["target_dtype"] == "auto"
    full = GenerateConfig(input="x", output="y", num_samples=2, stop=("a",), include_stop_str_in_output=True,
                          top_logprobs=1, max_model_len=40).fingerprint()
    assert {k: full[k] for k in set(full) - old_keys} == {
        "num_samples": 2, "stop": ["a"], "include_stop_str_in_output": True, "logprobs": True, "top_logprobs": 1,
        "logprobs_mode": "raw", "max_model_len": 40}


def test_row_overrides_and_sample_seeds():
    cfg = GenerateConfig(input="x", output="y", seed=7, top_p=0.9, top_k=3, stop=("job",), logprobs=True)
    params, seed, err = row_params({"id": 1}, cfg)
    assert err is None and (params.top_p, params.top_k, params.stop, params.logprobs) == (0.9, 3, ("job",), True)
    assert seed == row_seed(7, 1) == sample_seed(seed, 0)  # sample 0 keeps the row's seed
    params, _, err = row_params({"id": 1, "top_p": 0.5, "top_k": 0, "stop": ["x", "y"]}, cfg)
    assert err is None and (params.top_p, params.top_k, params.stop) == (0.5, 0, ("x", "y"))
    assert row_params({"id": 1, "stop": "x"}, cfg)[0].stop == ("x",)  # a string is one stop string
    assert row_params({"id": 1, "stop": []}, cfg)[0].stop == ()  # none for this row
    assert row_params({"id": 1, "top_p": 1.5}, cfg)[2] == "top_p must be in (0, 1], got 1.5"
    assert row_params({"id": 1, "top_k": -1}, cfg)[2] == "top_k must be >= 0 (0 disables), got -1"
    assert row_params({"id": 1, "top_k": 2.5}, cfg)[2] == "top_k must be an integer, got 2.5"
    assert row_params({"id": 1, "top_p": True}, cfg)[2] == "top_p must be a number, got True"
    assert row_params({"id": 1, "stop": ["", "a"]}, cfg)[2] == "stop must be a list of non-empty strings, got ['', 'a']"
    seeds = [sample_seed(row_seed(7, 1), j) for j in range(50)]
    assert len(set(seeds)) == 50 and all(0 <= s < 2**63 for s in seeds)
    assert seeds[3] == sample_seed(row_seed(7, 1), 3) != sample_seed(row_seed(7, 2), 3) != sample_seed(row_seed(8, 1), 3)


def test_samples_of_one_prompt_with_the_jobs_seeds_follow_the_target_law():
    """N > 1 samples of one prompt, seeded as a job seeds them (sample_seed of one row's seed),
    admitted together so they share one prefill: their first two tokens follow the target's law
    (tests/engine/test_distribution_e2e.py's check)."""
    target = tiny_model("llama", seed=11, vocab=V)
    prompt = copyable_prompt(target)
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=2, ignore_eos=True)
    drafter = DraftModelDrafter(tiny_model("llama", seed=12, layers=1, vocab=V), V)
    engine = SpecEngine(target, drafter, EngineConfig(SpeculationConfig(num_speculative_tokens=2), max_batch_size=1000))
    row = row_seed(0, "prompt-0")
    reqs = [Request(j, prompt, SamplingParams(**{**base.__dict__, "seed": sample_seed(row, j)})) for j in range(6000)]
    results = engine.generate(reqs)
    assert_first_two_tokens_follow_target(results, target, prompt, base, length=2)


def test_id_stage_resumes_per_id_and_sample_index():
    """The id stage drops rows every sample of which is in the output and marks the samples already
    there of the others; a row's N is its num_samples value (a bad one counts as 1) or the job's."""
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("prompt", pa.list_(pa.int64())),
                        pa.field("num_samples", pa.int64())])
    done = {0: frozenset({0, 1, 2}), 1: frozenset({0, 2}), 2: frozenset({0}), 3: frozenset({0}), 5: frozenset({0})}
    stage = AssignIds("id", False, done, internal_schema(schema, "id"), default_samples=3)
    rows = [{"id": 0, "prompt": [5], "num_samples": None},  # all 3 there: dropped
            {"id": 1, "prompt": [5], "num_samples": None},  # samples 0 and 2 there: 1 to generate
            {"id": 2, "prompt": [5], "num_samples": 1},  # its one sample there: dropped
            {"id": 3, "prompt": [5], "num_samples": 0},  # a bad value: one (error) row, there: dropped
            {"id": 4, "prompt": [5], "num_samples": 2},  # nothing there
            {"id": 5, "prompt": [5], "num_samples": 2},  # sample 0 there
            {"id": 1, "prompt": [5], "num_samples": None}]  # a repeat of a resumed id: its error row was written once
    out = stage(pa.Table.from_pylist(rows, schema=schema)).to_pylist()
    assert [(r["id"], r[DONE_SAMPLES], r[ID_ERROR]) for r in out] == [(1, [0, 2], None), (4, None, None), (5, [0], None)]
    # An iterable of ids (an output written before sample_index): every sample of those ids is done.
    stage = AssignIds("id", False, [0, 1], internal_schema(schema, "id"), default_samples=3)
    assert [r["id"] for r in stage(pa.Table.from_pylist(rows[:5], schema=schema)).to_pylist()] == [2, 3, 4]


def test_output_store_reads_sample_indices_and_parts_written_before_them(tmp_path):
    from raysd.jobs.io import OutputStore

    (tmp_path / "_job.json").write_text("{}")
    pq.write_table(pa.table({"id": ["a", "b"], "x": [1, 2]}), tmp_path / "part-old.parquet")  # before sample_index
    pq.write_table(pa.table({"id": ["c", "c", "d"], "sample_index": pa.array([0, 2, 1], pa.int32())}),
                   tmp_path / "part-new.parquet")
    done = OutputStore(str(tmp_path)).done_samples("id")
    assert done == {"a": {0}, "b": {0}, "c": {0, 2}, "d": {1}}
    assert done["a"] is done["b"]  # equal sets are one object


def test_dtype_auto_resolves_where_the_model_loads(tmp_path, monkeypatch):
    assert resolve_dtype("auto", "cpu") == "float32" and resolve_dtype("float16", "cpu") == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda:0") == "bfloat16" and resolve_dtype("float32", "cuda") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda") == "float16"  # a GPU before Ampere
    assert ModelSpec("m", "auto").resolved().dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelSpec("m", "int8")
    tiny_model("llama").save_pretrained(tmp_path / "m")
    model = load_model(ModelSpec(str(tmp_path / "m"), "auto"))
    assert model_dtype(model) == "float32" and model_dtype(None) is None


def test_a_missing_cloud_filesystem_names_the_extra():
    from raysd.jobs.io import open_input

    for url, extra in (("s3://bucket/prompts.jsonl", "s3"), ("gs://bucket/prompts.jsonl", "gcs")):
        if extra == "s3" and _has("s3fs") or extra == "gcs" and _has("gcsfs"):
            continue  # installed: nothing to hint
        with pytest.raises(JobError) as err:
            open_input(url)
        assert f"pip install 'raysd[{extra}]'" in str(err.value) and "\n" not in str(err.value)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_a_failure_line_names_the_innermost_cause():
    from raysd.jobs.cli import failure_line

    class Wrapper(Exception):
        pass

    try:
        try:
            raise NameError("name 'X' is not defined")
        except NameError as inner:
            raise Wrapper("To change retry attempts, configure ray.data.DataContext") from inner
    except Wrapper as exc:
        assert failure_line(exc) == "NameError: name 'X' is not defined"
    # Ray Data appends its retry advice to the message of the exception a stage raised: the first line is raysd's.
    advised = RuntimeError("the target actor died: killed\nFailed to apply UDF transform after 1/1 attempts.\n"
                           "To change retry attempts, backoff, or which errors are retried, configure ...")
    assert failure_line(advised) == "RuntimeError: the target actor died: killed"


# ---------------------------------------------------------------------------------------- a job


@pytest.fixture(scope="module")
def target_with_tokenizer(model_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok-target") / "target"
    shutil.copytree(model_dirs[0], path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def _read(out) -> list[dict]:
    return [r for p in sorted(out.glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


@pytest.mark.slow
def test_samples_stop_strings_logprobs_and_per_row_overrides(tmp_path, target_with_tokenizer, local_ray):
    """One job: rows of 3 samples (the job's), 1 and 2 (their own num_samples), per-row top_p,
    top_k and stop, a bad num_samples and a bad top_p. Each sample is the engine's for its seed
    (sample_seed of the row's), its text cut at the stop strings, its logprobs and top logprobs a
    plain forward's. Then a part loses some samples of two ids: the re-run generates those alone."""
    target = target_with_tokenizer
    tok = tiny_tokenizer()
    prompts = token_prompts(5, seed=9)
    rows = [{"id": "a", "prompt": prompts[0], "num_samples": None, "top_p": None, "top_k": None, "stop": None},
            {"id": "b", "prompt": prompts[1], "num_samples": 1, "top_p": None, "top_k": 5, "stop": None},
            {"id": "c", "prompt": prompts[2], "num_samples": 2, "top_p": 0.9, "top_k": None, "stop": ["w"]},
            {"id": "d", "prompt": prompts[3], "num_samples": 0, "top_p": None, "top_k": None, "stop": None},
            {"id": "e", "prompt": prompts[4], "num_samples": None, "top_p": 2.0, "top_k": None, "stop": None}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cfg = GenerateConfig(input=str(inp), output=str(out), target=target, draft="ngram", num_speculative_tokens=3,
                         max_new_tokens=8, temperature=1.0, seed=7, num_samples=3, stop=("w9",),
                         include_stop_str_in_output=True, top_logprobs=2, batch_size=4, quiet=True)
    summary = generate(cfg)
    got = {(r["id"], r["sample_index"]): r for r in _read(out)}
    assert sorted(got) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1), ("d", 0), ("e", 0), ("e", 1), ("e", 2)]
    assert summary.rows == len(got) == 10 and summary.rows_failed == 4
    assert "num_samples must be an integer in 1..1024, got 0" == got["d", 0]["error"]
    assert all(got["e", j]["error"] == "top_p must be in (0, 1], got 2.0" for j in range(3))

    # The engine's tokens for each sample's seed and parameters, its stop-cut text, a forward's logprobs.
    ok = [k for k in sorted(got) if got[k]["finish_reason"] != "error"]
    params = {}
    for row_id, j in ok:
        row = next(r for r in rows if r["id"] == row_id)
        params[row_id, j] = SamplingParams(
            temperature=1.0, top_k=row["top_k"] or 0, top_p=row["top_p"] or 1.0, max_new_tokens=8,
            seed=sample_seed(row_seed(7, row_id), j), stop=tuple(row["stop"] or ("w9",)),
            include_stop_str_in_output=True, logprobs=True, top_logprobs=2)
    target_model = load_model(ModelSpec(target))
    engine = SpecEngine(target_model, NgramDrafter(VOCAB),
                        EngineConfig(SpeculationConfig(num_speculative_tokens=3, eos_token_ids=(EOS,)), max_batch_size=4),
                        tokenizer=tok)
    prompt_of = {r["id"]: r["prompt"] for r in rows}
    with torch.inference_mode():
        expected = engine.generate([Request(k, prompt_of[k[0]], params[k]) for k in ok])
    for key, ref in zip(ok, expected):
        row = got[key]
        assert row["generated_token_ids"] == ref.token_ids and row["finish_reason"] == ref.finish_reason, key
        assert row["seed"] == params[key].seed and row["target_dtype"] == "float32" and row["draft_dtype"] is None
        text = tok.decode(ref.token_ids, skip_special_tokens=True)
        assert row["generated_text"] == (ref.text if ref.text is not None else text)
        stop = params[key].stop
        if ref.text is not None:  # ended by a stop string: kept (include_stop_str_in_output), nothing after it
            assert row["finish_reason"] == "stop" and any(row["generated_text"].endswith(s) for s in stop)
            assert not any(s in tok.decode(ref.token_ids[:-1], skip_special_tokens=True) for s in stop)
        forward = forward_logprobs(target_model, prompt_of[key[0]], ref.token_ids, params[key], "raw")  # [n, V]
        want = forward.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(row["generated_logprobs"], dtype=torch.float32), want, atol=1e-4, rtol=1e-4)
        assert [len(t) for t in row["top_logprobs"]] == [2] * len(ref.token_ids)
        top = torch.tensor([[e["logprob"] for e in t] for t in row["top_logprobs"]], dtype=torch.float32)
        torch.testing.assert_close(top, forward.topk(2, dim=-1).values, atol=1e-4, rtol=1e-4)
    assert got["c", 0]["finish_reason"] == "stop"  # its own stop "w" replaced the job's
    assert len({tuple(got["a", j]["generated_token_ids"]) for j in range(3)}) > 1  # independent samples

    # A part that lost samples 1 and 2 of "a" and sample 1 of "c" (a writer that split an id's samples):
    # the re-run generates exactly those, with the same tokens.
    [part] = sorted(out.glob("part-*.parquet"))
    table = pq.read_table(part)
    lost = {("a", 1), ("a", 2), ("c", 1)}
    keep = [i for i, r in enumerate(table.to_pylist()) if (r["id"], r["sample_index"]) not in lost]
    pq.write_table(table.take(keep), part)
    again = generate(cfg)
    assert again.latest_run.rows == 3 and again.latest_run.rows_skipped == 7 and again.rows == 10
    resumed = {(r["id"], r["sample_index"]): r for r in _read(out)}
    assert len(_read(out)) == 10 and sorted(resumed) == sorted(got)
    assert all(resumed[k]["generated_token_ids"] == got[k]["generated_token_ids"] for k in lost)


@pytest.mark.slow
@pytest.mark.parametrize("beams", [0, 2])
def test_max_model_len_bounds_every_row(beams, tmp_path, model_dirs, local_ray):
    """--max-model-len L: a prompt of L tokens or more is an error row, and no row holds more than
    L tokens. Sampled rows: a row the bound cut ends with "length", its tokens the first ones of its
    run without the bound, and the others are that run's rows. Beam rows: the target's own beam
    search under the same bound (the bound changes which hypotheses win)."""
    from raysd.core.beam import BeamConfig
    from raysd.engine.beam import BeamEngineConfig, BeamSearchEngine

    target, draft = model_dirs
    prompts = token_prompts(6, seed=13)
    L = max(len(p) for p in prompts) + 4
    rows = [{"id": i, "prompt": p} for i, p in enumerate(prompts)] + [{"id": 99, "prompt": [5] * L}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {}
    for bound in ((L,) if beams else (None, L)):
        out = tmp_path / f"out-{bound}"
        cfg = GenerateConfig(input=str(inp), output=str(out), target=target, draft=draft, num_speculative_tokens=2,
                             max_new_tokens=12, max_model_len=bound, beam_width=beams, batch_size=4, quiet=True)
        generate(cfg)
        runs[bound] = {r["id"]: r for r in _read(out)}
    got = runs[L]
    assert got[99]["error"] == f"prompt has {L} tokens; the context is {L} (the models', or max_model_len)"
    assert all(r["num_prompt_tokens"] + r["num_generated_tokens"] <= L for r in got.values())
    if beams:
        engine = BeamSearchEngine(tiny_model("llama", seed=0), None,
                                  BeamEngineConfig(BeamConfig(beams), eos_token_ids=(EOS,), max_model_len=L))
        expected = engine.generate([Request(i, p, SamplingParams(max_new_tokens=12)) for i, p in enumerate(prompts)])
        assert [got[i]["generated_token_ids"] for i in range(len(prompts))] == [h[0].token_ids for h in expected]
        assert any(got[i]["finish_reason"] == "length" and got[i]["num_prompt_tokens"] + got[i]["num_generated_tokens"] == L
                   for i in range(len(prompts)))
        return
    cut = 0
    for i in range(len(prompts)):
        free, room = runs[None][i]["generated_token_ids"], L - got[i]["num_prompt_tokens"]
        if len(free) > room:
            cut += 1
            assert got[i]["finish_reason"] == "length" and got[i]["generated_token_ids"] == free[:room]
        else:
            assert got[i]["generated_token_ids"] == free and got[i]["finish_reason"] == runs[None][i]["finish_reason"]
    assert cut >= 1  # the bound cut some row
