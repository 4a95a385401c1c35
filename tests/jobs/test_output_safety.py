"""Your files: what raysd refuses to write into, what `--overwrite` deletes, and how a
resume checks that the output was started from the same input. No Ray: `check_job` and
`OutputStore` write the output as a job would (`_job.json`, parts), and the files are compared
byte for byte afterwards. The same properties through real jobs: tests/reliability/test_lifecycle.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raysd.jobs import GenerateConfig, JobError
from raysd.jobs.io import JOB_FILE, OutputStore, open_input
from raysd.jobs.replica import error_output
from raysd.jobs.runner import check_job
from raysd.jobs.schema import row_totals

ROOT = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file and directory under `root`: {relative path: content (None for a directory)}."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def write_jsonl(path: Path, prompts: list[list[int]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def cfg(inp, out, target, **kw) -> GenerateConfig:
    return GenerateConfig(input=str(inp), output=str(out), target=target, draft="none", **kw)


def start(c: GenerateConfig, ids=(0, 1)):
    """What a run does to its output before and while generating, without Ray: the checks,
    `_job.json`, and one part holding error rows for `ids`."""
    job = check_job(c)
    job.store.prepare(job.record, c.overwrite)
    rows = [{"id": i, "prompt": [5], **error_output(c, i, "x")} for i in ids]
    job.store.write_part(pa.Table.from_pylist(rows, schema=job.schema))
    return job


@pytest.fixture
def mydata(tmp_path):
    """A user's folder: an input and a notes file side by side."""
    d = tmp_path / "mydata"
    write_jsonl(d / "prompts.jsonl", [[5, 6], [7, 8, 9]])
    (d / "notes.txt").write_text("my notes")
    return d


def test_refusals_touch_nothing(tmp_path, mydata, model_dirs, monkeypatch):
    target, _ = model_dirs
    inp = mydata / "prompts.jsonl"
    (tmp_path / "precious_copy.txt").write_text("precious")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "mine.txt").write_text("mine")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cases = {  # output: (what the one-line error says), with and without --overwrite
        str(mydata): "holds the input file",  # the folder holding the input
        str(mydata / "sub"): None,  # a new directory beside the input: fine
        str(tmp_path / "precious_copy.txt"): "is a file",
        str(tmp_path / "foreign"): "was not written by raysd",
        "/": "is the filesystem root",
        os.path.expanduser("~"): "is your home directory",
        ".": "is the working directory",
        "..": "is the working directory or holds it",  # tmp_path: it holds the input too
    }
    before = snapshot(tmp_path)
    for out, message in cases.items():
        for overwrite in (False, True):
            if message is None:
                check_job(cfg(inp, out, target, overwrite=overwrite))
                continue
            with pytest.raises(JobError, match=message) as exc:
                check_job(cfg(inp, out, target, overwrite=overwrite))
            assert "\n" not in str(exc.value) and "--overwrite" not in str(exc.value), str(exc.value)
    assert snapshot(tmp_path) == before


def test_an_output_inside_the_input_is_refused(tmp_path, model_dirs):
    target, _ = model_dirs
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", [[5, 6]])
    for inp in (data, f"{data}/**"):  # a later run would read the output's parts as input
        with pytest.raises(JobError, match="inside the input|lies where the input"):
            check_job(cfg(inp, data / "out", target, overwrite=True))
    check_job(cfg(f"{data}/*.jsonl", data / "out", target))  # a glob that cannot read the parts: fine
    parquet = tmp_path / "pq"
    parquet.mkdir()
    pq.write_table(pa.table({"prompt": [[5, 6]]}), parquet / "a.parquet")
    with pytest.raises(JobError, match="lies where the input"):
        check_job(cfg(f"{parquet}/**/*.parquet", parquet / "out", target))


def test_overwrite_deletes_only_what_raysd_wrote(tmp_path, mydata, model_dirs):
    target, _ = model_dirs
    inp = mydata / "prompts.jsonl"
    out = tmp_path / "out"
    first = cfg(inp, out, target)
    start(first)
    start(first, ids=(1,))  # a resume: a second part
    (out / "_summary.json").write_text("{}")
    (out / "_tmp").mkdir(exist_ok=True)  # an interrupted run's leftovers
    (out / "_tmp" / "part-partial.parquet").write_bytes(b"PAR1")
    # The user's files in and beside the output, some with raysd-like names.
    (out / "README.txt").write_text("mine")
    (out / "part-notes.txt").write_text("mine")
    (out / "keep").mkdir()
    (out / "keep" / "part-0.parquet").write_bytes(b"mine")
    theirs = {k: v for k, v in snapshot(tmp_path).items() if "README" in k or "notes" in k or k.startswith("out/keep")}
    assert len(OutputStore(str(out)).parts()) == 2

    start(cfg(inp, out, target, max_new_tokens=7, overwrite=True), ids=(0,))  # another job: --overwrite
    after = snapshot(tmp_path)
    assert {k: after.get(k) for k in theirs} == theirs
    assert len(OutputStore(str(out)).parts()) == 1 and not (out / "_summary.json").exists()
    assert json.loads((out / JOB_FILE).read_text())["fingerprint"]["max_new_tokens"] == 7
    # A directory without _job.json is not raysd's: nothing in it is deleted, even if asked directly.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "part-0.parquet").write_bytes(b"mine")
    OutputStore(str(foreign)).remove_own_files()
    assert (foreign / "part-0.parquet").read_bytes() == b"mine"


def test_resume_refuses_another_input_or_a_changed_one(tmp_path, model_dirs):
    target, _ = model_dirs
    a = write_jsonl(tmp_path / "A.jsonl", [[5, 6], [7, 8]])
    b = write_jsonl(tmp_path / "B.jsonl", [[9, 9], [10, 11], [12, 13]])
    out = tmp_path / "outAB"
    start(cfg(a, out, target))
    parts = snapshot(out)
    # Input B into A's output: refused, naming the files.
    with pytest.raises(JobError, match=r"started from another input \(files it was made from that this input lacks: "
                                       rf"{a}; files new in this input: {b}; 3 rows now, 2 then\)"):
        check_job(cfg(b, out, target))
    # A changes in place: refused, whether its size changes or only its contents.
    original = a.read_bytes()
    write_jsonl(a, [[5, 6], [7, 8], [1, 2]])
    with pytest.raises(JobError, match=rf"{a} changed since \(size {len(original)} -> \d+ bytes\); 3 rows now, 2 then"):
        check_job(cfg(a, out, target))
    write_jsonl(a, [[5, 6], [7, 9]])  # same size, another prompt
    with pytest.raises(JobError, match=rf"{a} was modified since; the contents of its 2 rows differ"):
        check_job(cfg(a, out, target))
    # The same rows again, with a new modification time, then under another path: the same input.
    a.write_bytes(original)
    assert check_job(cfg(a, out, target)).resume
    moved = tmp_path / "moved" / "A.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(original)
    job = check_job(cfg(moved, out, target))
    assert job.resume and job.record["input"]["files"][0]["path"] == str(moved)
    assert snapshot(out) == parts  # checks write nothing


def test_a_resume_with_unchanged_files_reads_no_row(tmp_path, model_dirs, monkeypatch):
    target, _ = model_dirs
    a = write_jsonl(tmp_path / "A.jsonl", [[5, 6], [7, 8]])
    out = tmp_path / "out"
    start(cfg(a, out, target))
    from raysd.jobs import io

    def no_reads(*args):
        raise AssertionError("read the rows")

    monkeypatch.setattr(io.JsonlSource, "row_digest", no_reads)
    assert check_job(cfg(a, out, target)).resume


def test_an_output_from_before_input_records_resumes_only_from_the_same_input(tmp_path, model_dirs):
    target, _ = model_dirs
    a = write_jsonl(tmp_path / "A.jsonl", [[5, 6]])
    b = write_jsonl(tmp_path / "B.jsonl", [[7, 8]])
    out = tmp_path / "out"
    start(cfg(a, out, target))
    record = json.loads((out / JOB_FILE).read_text())
    del record["input"]  # as a raysd that recorded no input wrote it
    (out / JOB_FILE).write_text(json.dumps(record))
    with pytest.raises(JobError, match="predates input checks"):
        check_job(cfg(b, out, target))
    job = check_job(cfg(a, out, target))
    assert job.resume and job.record["input"]["rows"] == 1  # recorded from now on


def test_summary_totals_are_the_rows_on_disk(tmp_path, mydata, model_dirs):
    target, _ = model_dirs
    c = cfg(mydata / "prompts.jsonl", tmp_path / "out", target)
    job = start(c)  # two error rows
    extra = [{"id": 7, "prompt": [5], **error_output(c, 7, "x"), "finish_reason": "length", "error": None,
              "num_generated_tokens": 5, "num_draft_tokens": 4, "num_accepted_draft_tokens": 3, "num_spec_steps": 2}]
    job.store.write_part(pa.Table.from_pylist(extra, schema=job.schema))
    table = pq.read_table(tmp_path / "out")
    totals = job.store.totals()
    assert {k: totals[k] for k in ("rows", "failed", "tokens", "drafted", "accepted", "steps")} == {
        "rows": 3, "failed": 2, "tokens": 5, "drafted": 4, "accepted": 3, "steps": 2}
    assert totals == {**row_totals(table), "finish_reasons": {"error": 2, "length": 1}}


BAD_LINES = {  # line 3 of an input: (text, the end of the one-line error)
    "control character": ('{"prompt": "a\x01b"}', "not valid JSON: Invalid control character at column 14"),
    "truncated": ('{"prompt": [1, 2', "not valid JSON: Expecting ',' delimiter at column 17"),
    "not an object": ("[1, 2]", "each line must be a JSON object"),
    "not UTF-8": (b'{"prompt": "\xff"}', "not valid UTF-8 (byte 13 of the line)"),
    "lone surrogate": ('{"prompt": "a\\ud800"}', "column 'prompt' holds a lone surrogate escape (\\ud800-\\udfff "
                                                  "without its pair), which is not valid text"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
@pytest.mark.parametrize("line", [3, 1503])  # within the lines that fix the columns' types, and past them
def test_a_malformed_line_is_one_complete_error_with_file_and_line(tmp_path, model_dirs, case, line):
    target, _ = model_dirs
    text, message = BAD_LINES[case]
    path = tmp_path / "in.jsonl"
    good = [json.dumps({"prompt": "text"}).encode()] * (line - 1)
    path.write_bytes(b"\n".join(good + [text if isinstance(text, bytes) else text.encode()]) + b"\n")
    with pytest.raises(JobError) as exc:
        check_job(cfg(path, tmp_path / "out", target))
    assert str(exc.value).startswith(f"{path}:{line}: ") and str(exc.value).endswith(message), str(exc.value)
    assert not (tmp_path / "out").exists()


def test_a_parquet_id_that_is_not_utf8_is_refused_with_its_row(tmp_path, model_dirs):
    target, _ = model_dirs
    ids = pa.array([b"a", b"\xff"], pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(pa.table({"id": ids, "prompt": [[5], [6]]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match=r"in.parquet: row 2: its id \('id'\) is not valid UTF-8"):
        check_job(cfg(tmp_path / "in.parquet", tmp_path / "out", target))
    prompts = pa.array([b"a", b"\xff"], pa.binary()).cast(pa.string(), safe=False)  # a prompt: an error row later
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": prompts}), tmp_path / "in2.parquet")
    assert open_input(str(tmp_path / "in2.parquet")).row_digest("id")[0] == 2


def test_an_output_over_its_input_folder_through_the_cli(tmp_path, mydata):
    """`--input mydata/prompts.jsonl --output mydata --overwrite`: one line, exit 2, before Ray or
    any model, and the folder as it was."""
    before = snapshot(tmp_path)
    args = ["--input", str(mydata / "prompts.jsonl"), "--output", str(mydata), "--overwrite", "--quiet"]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raysd", "generate", *args], capture_output=True, text=True,
                          env={**os.environ, "RAY_ADDRESS": ""}, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and time.monotonic() - started < 30
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"raysd generate: error: output {str(mydata)!r} holds the input file "
                     f"{str(mydata / 'prompts.jsonl')!r}; raysd never writes beside its input: choose another --output"]
    assert snapshot(tmp_path) == before
