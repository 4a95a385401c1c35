"""An output's lifecycle, property-based: random sequences of jobs (`raysd.jobs.generate` on the
tiny model, plain decoding) in one workspace: run, killed mid-job, re-run, --overwrite, another
config, another input, an input edited in place, an output around or inside the input or on a
regular file, and the user's files beside and inside the outputs.

After every step the workspace is compared with a model of what it must hold:
- a job the model says must be refused raises JobError and changes no file at all;
- no output row is lost (after a run that finished), none is duplicated, and every row's prompt is
  the one its id has in the input the output was started from (none from another input);
- every file raysd did not write is byte for byte as it was, inside an output or not;
- `_summary.json` after a finished run counts exactly the rows on disk.

A kill is made by removing parts: the job runs, then only some of its new parts are kept, the
previous `_summary.json` is put back (a killed run writes none) and a half-written file is left
in `_tmp/`. That is the state a SIGKILL leaves (parts appear whole by rename: tests/reliability/test_chaos.py kills a
real driver); a real kill would cost a driver start.

A real job that generates starts a replica and its model actor, seconds of a small machine, so
the generated sequences run the job's Ray stages in this process instead (`InProcessStages`: the
id stage, the generation stage and the sink are raysd's own classes, only the model's tokens and
Ray Data's scheduling are stood in for), which makes an example cost milliseconds:
`test_lifecycle_loses_mixes_and_deletes_nothing` runs 20 of them, drawn by the "ci" profile
(derandomized), and the fixed sequence LIFE. `test_a_whole_life_through_real_jobs` runs LIFE
through real jobs on Ray (3 that generate).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raysd.jobs import GenerateConfig, JobError, generate

pytestmark = pytest.mark.slow

# The input A as first written, with one prompt changed (the same size), and with a row appended.
A_VERSIONS = (((5, 6, 7), (8, 9), (10, 11, 12)), ((5, 6, 7), (9, 8), (10, 11, 12)),
              ((5, 6, 7), (8, 9), (10, 11, 12), (13, 14)))
CONTENTS = {"B": ((20, 21), (22, 23, 24)), "C": ((30, 31, 32),)}
INPUTS = {"A": "in/A.jsonl", "B": "in/B.jsonl", "C": "dir"}  # C: a directory input
# "holder" holds the inputs A and B (the folder), "inside" lies inside input C's directory,
# "file" is a regular file of the user's.
OUTPUTS = {"out": "out", "inside": "dir/out", "holder": "in", "file": "precious.txt"}
MAX_NEW_TOKENS = (3, 4)  # the two configs


@dataclass
class Output:
    """What the model knows of one output directory."""

    made_from: tuple | None = None  # the prompts of the input its rows come from (its _job.json's)
    config: int | None = None
    missing: bool = False  # rows of its input not in it yet (a killed job's)
    summary_fresh: bool = False  # _summary.json written by the last job (not a killed one)
    parts: bool = False
    leftover: bool = False  # a killed job's half-written file in _tmp/
    foreign: bool = False  # a directory holding a user's file and no _job.json


class Model:
    """The expected outcome of each step, without running anything."""

    def __init__(self):
        self.a_version = 0
        self.outputs = {"out": Output(), "inside": Output()}

    def content(self, inp: str) -> tuple:
        return A_VERSIONS[self.a_version] if inp == "A" else CONTENTS[inp]

    def expect(self, inp: str, out: str, config: int, overwrite: bool) -> tuple[str | None, bool]:
        """(the refusal's regex or None, whether the job generates rows)."""
        if inp == "C" and (self.outputs["inside"].parts or self.outputs["inside"].leftover):
            return "mixes Parquet and JSON Lines", False  # C's directory now holds parquet files
        if out == "file":
            return "is a file", False
        if out == "holder":
            return ("holds the input file" if inp in "AB" else "was not written by raysd"), False
        if out == "inside" and inp == "C":
            return "lies inside the input", False
        state = self.outputs[out]
        if state.foreign:
            return "was not written by raysd", False
        if state.made_from is None or overwrite:
            return None, True
        if state.config != config:
            return "written by a job with different max_new_tokens", False
        if state.made_from != self.content(inp):
            return "started from another input", False
        return None, state.missing

    def apply(self, step: tuple) -> None:
        kind = step[0]
        if kind == "edit_A":
            self.a_version = step[1]
        elif kind == "sentinel":
            state = self.outputs[step[1]]
            state.foreign = state.foreign or state.made_from is None
        else:
            _, inp, out, config, overwrite, keep = step
            refusal, generates = self.expect(inp, out, config, overwrite)
            if refusal is None:
                state = self.outputs[out]
                killed = keep is not None and generates
                state.made_from, state.config = self.content(inp), config
                state.missing = state.leftover = killed
                state.summary_fresh = not killed
                # A killed job's parts: as many as the workspace kept (it sets them).
                state.parts = (state.parts and not overwrite) or (generates and not killed)


def job(inp="A", out="out", config=0, overwrite=False, keep=None) -> tuple:
    """A job step; `keep` = k: killed once k of its new parts are in place."""
    return ("job", inp, out, config, overwrite, keep)


steps = st.lists(
    st.one_of(
        st.builds(job, st.sampled_from(sorted(INPUTS)), st.sampled_from(["out", "out", "inside", "holder", "file"]),
                  st.sampled_from([0, 1]), st.booleans()),
        st.builds(job, st.sampled_from(["A", "B"]), st.just("out"), st.sampled_from([0, 1]), st.just(False),
                  st.integers(0, 2)),
        st.tuples(st.just("edit_A"), st.sampled_from([0, 1, 2])),
        st.tuples(st.just("sentinel"), st.sampled_from(["out", "inside"])),
    ),
    min_size=2, max_size=8,
)


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def write_input(path: Path, prompts: tuple) -> None:
    path.write_text("".join(json.dumps({"prompt": list(p)}) + "\n" for p in prompts))


class Workspace:
    """The files: inputs, a folder holding two of them, the user's files; and the model."""

    def __init__(self, root: Path, target: str):
        self.root, self.target, self.model = root, target, Model()
        (root / "in").mkdir()
        (root / "dir").mkdir()
        write_input(root / INPUTS["A"], A_VERSIONS[0])
        write_input(root / INPUTS["B"], CONTENTS["B"])
        write_input(root / "dir" / "c.jsonl", CONTENTS["C"])
        self.users = {"notes.txt": b"beside the outputs", "in/notes.txt": b"beside the input",
                      "precious.txt": b"a regular file", "dir/notes.txt": b"in input C's directory"}
        for name, data in self.users.items():
            (root / name).write_bytes(data)

    def step(self, step: tuple) -> None:
        if step[0] == "edit_A":
            write_input(self.root / INPUTS["A"], A_VERSIONS[step[1]])
        elif step[0] == "sentinel":
            name = f"{OUTPUTS[step[1]]}/my-notes.txt"
            (self.root / name).parent.mkdir(parents=True, exist_ok=True)
            self.users[name] = f"the user's, dropped at step {len(self.users)}".encode()
            (self.root / name).write_bytes(self.users[name])
        kept = self.job(*step[1:]) if step[0] == "job" else None
        self.model.apply(step)
        if kept is not None:  # a killed job: the parts it kept
            self.model.outputs[step[2]].parts |= kept > 0
        self.check()

    def job(self, inp: str, out: str, config: int, overwrite: bool, keep: int | None) -> int | None:
        """Run the job; for a killed one, the parts it kept."""
        refusal, generates = self.model.expect(inp, out, config, overwrite)
        cfg = GenerateConfig(input=str(self.root / INPUTS[inp]), output=str(self.root / OUTPUTS[out]),
                             target=self.target, draft="none", max_new_tokens=MAX_NEW_TOKENS[config], batch_size=1,
                             rows_per_file=1, quiet=True, overwrite=overwrite)
        before = snapshot(self.root)
        if refusal is not None:
            with pytest.raises(JobError, match=refusal):
                generate(cfg)
            assert snapshot(self.root) == before, "a refused job changed files"
            return None
        out_dir = self.root / OUTPUTS[out]
        old_parts = set(out_dir.glob("part-*.parquet"))
        old_summary = (out_dir / "_summary.json").read_bytes() if (out_dir / "_summary.json").exists() else None
        summary = generate(cfg)
        new_parts = sorted(set(out_dir.glob("part-*.parquet")) - old_parts)
        assert bool(new_parts) == generates and (summary.latest_run.rows > 0) == generates
        after = snapshot(self.root)
        outside = {k: v for k, v in before.items() if not (self.root / k).is_relative_to(out_dir)}
        assert {k: after.get(k) for k in outside} == outside, "a job changed files outside its output"
        if keep is None or not generates:
            return None
        keep = min(keep, len(new_parts) - 1)  # killed: some of its parts made it (not all), and no summary
        for part in new_parts[keep:]:
            part.unlink()
        if old_summary is None:
            (out_dir / "_summary.json").unlink()
        else:
            (out_dir / "_summary.json").write_bytes(old_summary)
        (out_dir / "_tmp").mkdir(exist_ok=True)
        (out_dir / "_tmp" / "0-part-killed.parquet").write_bytes(b"PAR1 half written")
        return keep

    def check(self) -> None:
        for name, data in self.users.items():
            assert (self.root / name).read_bytes() == data, f"{name} changed"
        write = {"A": A_VERSIONS[self.model.a_version], **CONTENTS}
        for inp, prompts in write.items():
            path = self.root / (INPUTS[inp] if inp != "C" else "dir/c.jsonl")
            assert [tuple(json.loads(line)["prompt"]) for line in path.read_text().splitlines()] == list(prompts)
        for out, state in self.model.outputs.items():
            out_dir = self.root / OUTPUTS[out]
            rows = [r for p in sorted(out_dir.glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
            ids = [r["id"] for r in rows]
            assert len(ids) == len(set(ids)), f"{out}: duplicated rows"
            assert bool(rows) == state.parts, out
            for r in rows:  # each row is its input's: the prompt its id has there
                assert tuple(r["prompt"]) == state.made_from[r["id"]], f"{out}: row {r['id']} from another input"
            if state.summary_fresh and not state.missing:
                assert sorted(ids) == list(range(len(state.made_from))), f"{out}: rows lost"
                summary = json.loads((out_dir / "_summary.json").read_text())
                assert summary["rows"] == len(rows)
                assert summary["rows_failed"] == sum(r["finish_reason"] == "error" for r in rows) == 0
                assert summary["generated_tokens"] == sum(r["num_generated_tokens"] for r in rows) > 0
                assert summary["finish_reasons"] == dict(Counter(r["finish_reason"] for r in rows))


# A whole life in the output inside input C's directory: refused there for C; killed after one
# part; refusals (C, whose directory now holds parquet files; B, whose ids collide with A's;
# another config; A edited in place, same size); resumed once A is put back, with a user's file
# inside; a no-op re-run; --overwrite with B; the folder holding the inputs and a regular file as
# the output; A changed again.
LIFE = [job("C", "inside"), job("A", "inside", keep=1), job("C"), job("B", "inside"), job("A", "inside", config=1),
        ("edit_A", 1), job("A", "inside"), ("edit_A", 0), ("sentinel", "inside"), job("A", "inside"),
        job("A", "inside"), job("B", "inside", overwrite=True), job("A", "holder", overwrite=True),
        job("B", "file", overwrite=True), ("edit_A", 2), job("A", "inside")]


class InProcessStages:
    """A job's Ray stages run in this process, with raysd's own classes: the id stage (AssignIds)
    over the input's blocks in order, the generation stage (GenerateReplica) whose replica is stood
    in for by `tokens` (no model, no actors), and the sink (PartsSink, through write_on_driver, as
    for a `memory://` output). JobStats is answered here too. What the job's driver does (checks,
    the output's record, resume, parts, summary) runs unchanged: `raysd.jobs.pipeline`'s
    build_dataset and start_job_stats are patched for the job's call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from raysd.jobs import pipeline

        monkeypatch.setattr(pipeline, "build_dataset", self.build_dataset)
        monkeypatch.setattr(pipeline, "start_job_stats", lambda metric_tags=None: LocalStats())

    @staticmethod
    def tokens(prompt: list[int], max_new_tokens: int) -> list[int]:
        """The stand-in model's continuation: a function of the prompt alone, as a greedy model's."""
        return [(sum(prompt) + i) % 90 + 3 for i in range(max_new_tokens)]

    def build_dataset(self, source, cfg, schema, done, stats=None, job_key=None, later_pass=False):
        from raysd.jobs.pipeline import AssignIds, GenerateReplica, internal_schema, write_on_driver
        from raysd.jobs.replica import error_output
        from raysd.jobs.schema import num_samples_of

        ids = AssignIds(cfg.id_column, cfg.id_column not in source.schema.names, done,
                        internal_schema(source.schema, cfg.id_column), stats, None, cfg.samples_per_prompt,
                        source.json_columns, later_pass)
        replica = GenerateReplica(cfg, schema, source.json_columns, stats)

        def generate_rows(payload: list[dict]) -> list[list[dict]]:  # GenerationReplica.generate's rows
            out = []
            for row in payload:
                n = num_samples_of(row.get("num_samples"), cfg.num_samples)[0]
                tokens = self.tokens(row["prompt"], cfg.max_new_tokens)
                out.append([{**error_output(cfg, row["id"], ""), "sample_index": j, "error": None,
                             "finish_reason": "length", "generated_token_ids": tokens,
                             "num_prompt_tokens": len(row["prompt"]), "num_generated_tokens": len(tokens)}
                            for j in range(n) if j not in set(row.get("done_samples") or ())])
            return out

        replica._generate = generate_rows
        tables = [replica(ids(source.encode(rows))) for rows in source.batches(cfg.batch_size)]
        output = pa.concat_tables(tables) if tables else schema.empty_table()

        def iter_batches(batch_size: int, batch_format: str = "pyarrow"):
            for start in range(0, output.num_rows, batch_size):
                yield output.slice(start, batch_size)

        dataset = SimpleNamespace(iter_batches=iter_batches)
        dataset.write_datasink = lambda sink, ray_remote_args=None: write_on_driver(dataset, sink)
        return dataset


class LocalStats:
    """JobStats' counts kept here: `.add.remote(...)` and `.get.remote()` answer with object refs, as
    the actor's calls do."""

    def __init__(self):
        from raysd.engine.verdict import LoopStats

        self.totals, self.loop = {}, LoopStats()
        self.add = SimpleNamespace(remote=self._add)
        self.get = SimpleNamespace(remote=lambda: self._ref({**self.totals, "notes": [], "loop": self.loop}))

    @staticmethod
    def _ref(value):
        import ray

        return ray.put(value)

    def _add(self, loop=None, **counts):
        if loop is not None:
            self.loop.add(loop)
        for k, v in counts.items():
            if not k.endswith("_at"):
                self.totals[k] = self.totals.get(k, 0) + v
        return self._ref(None)


def live(steps: list, root: Path, target: str) -> None:
    """`steps` in a fresh workspace under `root`, checked after each."""
    workspace = Workspace(root, target)
    for step in steps:
        workspace.step(step)


@settings(settings.get_profile("ci"), max_examples=20,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=steps)
@example(steps=LIFE)
def test_lifecycle_loses_mixes_and_deletes_nothing(steps, tmp_path_factory, model_dirs, local_ray):
    target, _, _ = model_dirs
    with pytest.MonkeyPatch.context() as monkeypatch:
        InProcessStages(monkeypatch)
        live(steps, tmp_path_factory.mktemp("lifecycle"), target)


def test_a_whole_life_through_real_jobs(tmp_path, model_dirs, local_ray):
    """LIFE through real jobs: Ray Data's stages, a replica and its model actor for each job that
    generates. With the input check disabled it fails at the step that resumes input B into input
    A's output."""
    target, _, _ = model_dirs
    live(LIFE, tmp_path, target)
