"""Bad input, property-based.

Hypothesis drives the input layer directly, with no Ray and no model, for most examples:
prompt preparation (`prompt_token_ids` through a real tokenizer with a chat template, built
in-process), per-row overrides (`row_params`), the engine's admission check (`request_error`),
the id stage (`AssignIds`), and the input readers (`open_input` on arbitrary bytes, JSON Lines
and Parquet). Each input gives an error row or a one-line JobError; nothing raises anything
else, and no row is lost. Then a few end-to-end jobs take the nastiest inputs through Ray.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from raysd.engine.requests import Request, request_error
from raysd.jobs import GenerateConfig, JobError
from raysd.jobs.io import open_input
from raysd.jobs.pipeline import ID_ERROR, AssignIds, internal_schema
from raysd.jobs.replica import error_output, prompt_token_ids, row_params
from raysd.jobs.runner import check_job
from tests.conftest import VOCAB
from tests.reliability.conftest import tiny_tokenizer

MAX_LEN = 512  # the tiny models' context
CFG = GenerateConfig(input="x", output="y", max_new_tokens=8)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = tiny_tokenizer()
    return _TOKENIZER


def prepare(row: dict, tok, chat_template: bool = True) -> tuple[list[int] | None, str | None]:
    """What a replica does with a row before generation: overrides, prompt -> ids, admission."""
    params, _seed, error = row_params(row, CFG)
    if error is not None:
        return None, error
    ids, error = prompt_token_ids(row.get("prompt"), tok, chat_template)
    if error is not None:
        return None, error
    error = request_error(Request(0, ids, params), VOCAB, MAX_LEN)
    return (None, error) if error else (ids, None)


# Any text, lone surrogates included (JSON can carry "\ud800"), control characters, RTL marks, emoji.
any_text = st.text(st.characters(codec=None, categories=None), max_size=40) | st.sampled_from(
    ["", " ", "\t\n \u3000", "\u200b\u200f\u202e", "\x00", "\ud800", "a\udfff", "💥" * 30, "e\u0301" * 10, "\ufeff"])
roles = st.sampled_from(["user", "assistant", "system", "tool", "", "USER", "bot", "\x00"]) | any_text
message = st.fixed_dictionaries({"role": roles, "content": any_text}) | st.dictionaries(
    st.sampled_from(["role", "content", "name"]), st.none() | st.integers() | any_text | st.lists(st.integers(), max_size=3), max_size=3)
big_ints = st.integers(min_value=-(2**70), max_value=2**70)
token_ids = st.lists(st.integers(-5, VOCAB + 5) | big_ints | st.booleans(), max_size=30)
prompts = (
    st.none() | any_text | token_ids | st.lists(message, max_size=4) | st.floats(allow_nan=True) | st.booleans()
    | st.binary(max_size=10) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    | st.lists(st.one_of(st.integers(0, VOCAB - 1), any_text), min_size=1, max_size=4)
    | st.builds(lambda n: [5] * n, st.integers(MAX_LEN - 2, MAX_LEN + 2))  # at the context's edge
)
overrides = st.none() | st.integers(-3, 2**64) | st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | any_text


@FAST
@given(prompt=prompts, max_new=overrides, temperature=overrides, seed=overrides, chat=st.booleans())
@example(prompt=[{"role": "bot", "content": "hi"}], max_new=None, temperature=None, seed=None, chat=True)
@example(prompt="\ud800", max_new=None, temperature=None, seed=None, chat=False)
@example(prompt=[1, 2**64], max_new=None, temperature=None, seed=None, chat=True)
def test_prepare_gives_ids_or_an_error(prompt, max_new, temperature, seed, chat):
    row = {"id": 0, "prompt": prompt, "max_new_tokens": max_new, "temperature": temperature, "seed": seed}
    for tok in (tokenizer(), None):
        ids, error = prepare(row, tok, chat)
        if error is None:
            assert ids and all(type(t) is int and 0 <= t < VOCAB for t in ids) and len(ids) < MAX_LEN
        else:
            assert ids is None and isinstance(error, str) and error and "\n" not in error


def test_named_bad_prompts_give_named_errors():
    tok = tokenizer()
    cases = {
        "": "empty prompt", "   \t\n": "empty prompt", None: "prompt is null", (): "empty prompt",
        (5, VOCAB): "outside the vocabulary", (5, -1): "outside the vocabulary",
        (5,) * MAX_LEN: "context", 3.5: "prompt must be", (1, "a"): "token ids (ints) or chat messages",
    }
    for prompt, message in cases.items():
        p = list(prompt) if isinstance(prompt, tuple) else prompt
        assert message in prepare({"id": 0, "prompt": p}, tok)[1], prompt
    assert "unknown role bot" in prepare({"id": 0, "prompt": [{"role": "bot", "content": "x"}]}, tok)[1]
    assert "no tokenizer" in prepare({"id": 0, "prompt": "hello"}, None)[1]
    assert prepare({"id": 0, "prompt": "hello world"}, tok)[0][-3:] == tok("<s> assistant :", add_special_tokens=False).input_ids


@FAST
@given(ids=st.lists(st.none() | st.integers(-3, 6) | st.sampled_from(["a", "../x", "", "a"]), max_size=25),
       done=st.sets(st.integers(-3, 6), max_size=4), cut=st.integers(0, 25))
def test_id_stage_keeps_every_row_once(ids, done, cut):
    """Every input row leaves the id stage exactly once (error-marked if null or repeated), unless
    its id is already done; in whatever blocks the rows come."""
    assume(len({type(i) for i in ids if i is not None}) <= 1)  # one id type per column
    id_type = pa.string() if any(isinstance(i, str) for i in ids) else pa.int64()
    schema = pa.schema([pa.field("id", id_type), pa.field("prompt", pa.list_(pa.int64()))])
    done = {str(d) for d in done} if id_type == pa.string() else done
    stage = AssignIds("id", False, done, internal_schema(schema, "id"))
    table = pa.Table.from_pylist([{"id": i, "prompt": [5]} for i in ids], schema=schema)
    out = [r for block in (table.slice(0, cut), table.slice(cut)) for r in stage(block).to_pylist()]
    kept = [i for i in ids if i is None or i not in done]
    assert [r["id"] for r in out] == kept
    seen = set()
    for r in out:
        expect_error = r["id"] is None or r["id"] in seen
        assert bool(r[ID_ERROR]) == expect_error
        seen.add(r["id"])
        if r[ID_ERROR]:
            assert error_output(CFG, r["id"], r[ID_ERROR])["finish_reason"] == "error"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.binary(max_size=300) | st.sampled_from([b"", b"\n\n", b"\xff\xfe\x00", b'{"prompt": "\xff"}\n', b'[1,2]\n',
                                                        b'{"prompt": "a"}\n{"prompt":', b'{"prompt": "\\ud800"}\n']),
       ext=st.sampled_from([".jsonl", ".parquet"]))
def test_arbitrary_bytes_are_a_source_or_one_job_error(tmp_path_factory, data, ext):
    path = tmp_path_factory.mktemp("bytes") / f"in{ext}"
    path.write_bytes(data)
    try:
        source = open_input(str(path))
    except JobError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    rows = [r for b in source.batches(7) for r in b]  # whatever opened can be read
    assert source.num_rows in (None, len(rows))


def _parquet_bytes(rows) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 2000), flip=st.integers(0, 2000))
def test_truncated_or_corrupt_parquet_is_one_job_error(tmp_path_factory, cut, flip):
    good = _parquet_bytes([{"id": i, "prompt": [5, 6, 7]} for i in range(20)])
    bad = bytearray(good[: cut % len(good)])
    if bad and flip % 3 == 0:
        bad[flip % len(bad)] ^= 0xFF
    path = tmp_path_factory.mktemp("pq") / "in.parquet"
    path.write_bytes(bytes(bad))
    with pytest.raises(JobError, match="cannot read Parquet"):
        open_input(str(path))


@pytest.mark.parametrize("column, message", [
    (pa.array([1.5, 2.5]), "must hold integers or strings"),
    (pa.array([[1], [2]]), "must hold integers or strings"),
    (pa.array([True, False]), "must hold integers or strings"),
])
def test_wrong_id_type_is_one_job_error(tmp_path, column, message):
    pq.write_table(pa.table({"id": column, "prompt": [[5], [6]]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match=message):
        check_job(GenerateConfig(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "o"), target=str(tmp_path)))


def test_empty_inputs_are_one_job_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(JobError, match="no rows"):
        open_input(str(tmp_path / "empty.jsonl"))
    (tmp_path / "zero.parquet").write_bytes(b"")
    with pytest.raises(JobError, match="cannot read Parquet"):
        open_input(str(tmp_path / "zero.parquet"))
    (tmp_path / "dir").mkdir()
    with pytest.raises(JobError, match="no .parquet or .jsonl"):
        open_input(str(tmp_path / "dir"))


def error_rows_for(ids: list, schema: pa.Schema) -> list[dict]:
    """Output rows (error rows) for these ids, in `schema` (used by test_safety)."""
    return [{"id": i, "prompt": "p", **error_output(CFG, i, "x")} for i in ids]


# The nastiest inputs, end to end through Ray: one JSON Lines file mixing every prompt kind,
# with path-like and duplicate ids, through a model that has a tokenizer and a chat template.
NASTY = [
    ("../x", "hello world"),
    ("../../escape", [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "w1"}, {"role": "user", "content": "w2"}]),
    ("/tmp/abs", [{"role": "bot", "content": "hello"}]),  # unknown role: the template refuses it
    ("a/b/c", ""),
    ("..", "   \t"),
    ("sur", "\ud800 lone surrogate"),
    ("nul", "\x00\u202e💥 e\u0301"),
    ("long", [5] * 600),
    ("oov", [5, VOCAB + 3]),
    ("neg", [5, -1]),
    ("huge", [5, 2**70]),
    ("mixed", [5, "w1"]),
    ("num", 3.25),
    ("null", None),
    ("obj", {"role": "user"}),
    ("ids", [7, 8, 9]),
    ("../x", "duplicate of the first id"),
]
GOOD = {"../x", "../../escape", "ids", "nul"}


@pytest.mark.slow
def test_nasty_inputs_end_to_end(tmp_path, model_dirs, local_ray):
    from raysd.jobs import generate
    from tests.reliability.conftest import read_rows

    _, _, tok_target = model_dirs
    work = tmp_path / "work"
    work.mkdir()
    inp = work / "in.jsonl"
    # json.dumps escapes the lone surrogate as \ud800, as any JSON writer would.
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in NASTY))
    out = work / "out"
    before = {p for p in tmp_path.rglob("*")}
    summary = generate(GenerateConfig(input=str(inp), output=str(out), target=tok_target, draft="ngram",
                                      max_new_tokens=4, batch_size=4, rows_per_file=5, quiet=True))
    rows = read_rows(out)
    assert len(rows) == len(NASTY) == summary.rows  # nothing lost: one output row per input row
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(i for i, _ in NASTY)
    errors = {}
    for r in rows:
        assert r["finish_reason"] in ("stop", "length", "error")
        if r["finish_reason"] == "error":
            assert r["error"] and "\n" not in r["error"] and "Traceback" not in r["error"]
            errors.setdefault(r["id"], []).append(r["error"])
    assert errors.pop("../x") == ["duplicate id '../x'"]
    assert set(errors) == {i for i, _ in NASTY} - GOOD, errors
    assert "unknown role bot" in errors["/tmp/abs"][0] and "context" in errors["long"][0]
    assert "tokenized" in errors["sur"][0]
    # Nothing written outside the output directory: part names are generated, never from the data.
    created = {p for p in tmp_path.rglob("*")} - before
    assert all(out in p.parents or p == out for p in created if p != out), sorted(map(str, created))
    assert not (work / "x").exists() and not (tmp_path / "escape").exists() and not os.path.exists("/tmp/abs")
    names = sorted(p.name for p in out.iterdir())
    assert all(n.startswith("part-") or n in ("_job.json", "_summary.json") for n in names), names
