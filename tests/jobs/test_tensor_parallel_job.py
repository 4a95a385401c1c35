"""`raysd generate --target-tensor-parallel N`: a job whose target is 2 rank actors writes the rows
a whole target writes (greedy and seeded samples, with a draft model); a split that does not
divide the target's heads fails in one line before any model loads."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raysd.core.sampling import SamplingParams
from raysd.jobs import GenerateConfig, JobError, generate
from raysd.jobs.replica import row_seed
from raysd.jobs.runner import check_job
from tests.jobs.conftest import token_prompts
from tests.jobs.test_generate import by_id, read_output, reference
from tests.jobs.test_options import parse

def _job(tmp_path, name, target, draft, tp, **kw) -> GenerateConfig:
    return GenerateConfig(input=str(tmp_path / "in.parquet"), output=str(tmp_path / name), target=target, draft=draft,
                          max_new_tokens=10, batch_size=4, quiet=True, num_speculative_tokens=3,
                          num_cpus_per_actor=1, target_tensor_parallel=tp, **kw)


@pytest.mark.slow
def test_tp2_job_writes_the_whole_targets_rows(tmp_path, model_dirs, local_ray):
    """Seeded samples (the stronger form: every draw must agree) equal to the whole target's in the
    single-process engine; greedy rows: the tests beside."""
    target, draft = model_dirs
    prompts = token_prompts(10, seed=5)
    pq.write_table(pa.Table.from_pylist([{"id": i, "prompt": p} for i, p in enumerate(prompts)]), tmp_path / "in.parquet")
    cfg = _job(tmp_path, "out", target, draft, 2, temperature=0.8, seed=3)
    generate(cfg)
    rows = by_id(read_output(cfg.output))
    # The whole target, in one process (a TP = 1 job writes the engine's tokens: tests/jobs/test_generate.py).
    params = [SamplingParams(temperature=0.8, seed=row_seed(3, i), max_new_tokens=10) for i in range(10)]
    expected = reference(target, draft, prompts, params, k=3)
    assert len(rows) == 10 and [rows[i]["generated_token_ids"] for i in range(10)] == expected


def test_the_flag_and_its_one_line_errors(tmp_path, model_dirs):
    assert parse("--target-tensor-parallel", "4").target_tensor_parallel == 4 and parse().target_tensor_parallel == 1
    with pytest.raises(JobError, match=r"^--target-tensor-parallel must be an integer >= 1, got 0$"):
        GenerateConfig(input="x", output="y", target_tensor_parallel=0)
    target, draft = model_dirs  # 4 heads, 2 key/value heads
    cfg = GenerateConfig(input="x", output="y", draft=draft, target_tensor_parallel=2, num_cpus_per_actor=1.5)
    assert cfg.replica_cpus == 2 * 1.5 + 1.5  # two target ranks and the draft
    assert dataclasses.replace(cfg, num_cpus_per_actor=None).resolve_actor_cpus(6).actor_cpus == (2.0, 2.0)  # 6 cores over 3 model actors
    assert cfg.fingerprint() == GenerateConfig(input="x", output="y", draft=draft).fingerprint()  # exact: the same rows
    pq.write_table(pa.Table.from_pylist([{"id": 0, "prompt": [5, 6]}]), tmp_path / "in.parquet")
    with pytest.raises(JobError) as err:
        check_job(_job(tmp_path, "out", target, draft, 3))
    assert str(err.value) == "--target-tensor-parallel: tensor parallel 3 does not divide the model's attention heads (4)"
    check_job(_job(tmp_path, "out", target, draft, 2))
