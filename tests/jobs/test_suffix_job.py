"""`raysd generate --draft suffix` (raysd.engine.suffix) through the Ray actors and Ray Data: the
target's own greedy tokens whatever the drafts, and the summary's count of where the drafts came
from (the row itself, or rows the replica finished before) equal to the rows' own statistics."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raysd.core.sampling import SamplingParams
from raysd.jobs import GenerateConfig, generate
from tests.jobs.test_generate import read_output, reference

pytestmark = pytest.mark.slow


def test_suffix_job_is_exact_and_counts_its_sources(tmp_path, model_dirs, local_ray):
    target, _ = model_dirs
    template = [7, 8, 9, 10, 11, 12, 13, 14]  # one instruction for every row, as a dataset built from a template
    prompts = [template + [20 + i, 30 + i] for i in range(12)]
    pq.write_table(pa.Table.from_pylist([{"id": i, "prompt": p} for i, p in enumerate(prompts)]), tmp_path / "in.parquet")
    cfg = GenerateConfig(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), target=target, draft="suffix",
                         max_new_tokens=12, batch_size=4, quiet=True, num_speculative_tokens=4)
    summary = generate(cfg)
    out = {r["id"]: r for r in read_output(cfg.output).to_pylist()}
    expected = reference(target, "ngram", prompts, [SamplingParams(max_new_tokens=12)] * len(prompts))
    assert [out[i]["generated_token_ids"] for i in range(len(prompts))] == expected  # greedy: the target's own
    assert all(r["draft_model"] == "suffix" for r in out.values())
    sources = summary.latest_run.draft_sources
    rows = out.values()
    assert sources["drafted_self"] + sources["drafted_other"] == sum(r["num_draft_tokens"] for r in rows)
    assert sources["accepted_self"] + sources["accepted_other"] == sum(r["num_accepted_draft_tokens"] for r in rows)
    assert sources["accepted_other"] > 0  # later rows drafted what earlier rows generated
