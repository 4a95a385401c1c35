"""A real crash: `python -m raysd generate` SIGKILLed (its whole process group: driver, Ray,
actors) while it writes, then the same command again. Nothing lost, nothing doubled, no
partial file counted, and the tokens are those of a clean run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raysd.core.sampling import SamplingParams
from tests.jobs.conftest import kill_group, settled, token_prompts
from tests.jobs.test_generate import reference

pytestmark = [pytest.mark.slow, pytest.mark.alone]

ROOT = Path(__file__).resolve().parents[2]
N_ROWS = 240


def _parts(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet")) if out.exists() else []


def test_driver_killed_mid_job_then_rerun(tmp_path, model_dirs):
    target, _ = model_dirs
    prompts = token_prompts(N_ROWS, seed=7)
    inp = tmp_path / "prompts.jsonl"  # consistent types: read with ray.data.read_json
    inp.write_text("".join(json.dumps({"key": f"k{i:03d}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "raysd", "generate", "--input", str(inp), "--output", str(out), "--id-column", "key",
           "--target", target, "--draft", "ngram", "--max-new-tokens", "24", "--batch-size", "4",
           "--rows-per-file", "8", "--quiet", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: the driver and the Ray it starts
    try:
        deadline = time.monotonic() + 400
        while not _parts(out):
            assert proc.poll() is None, f"job ended before writing a part: {proc.stdout.read().decode()[-3000:]}"
            assert time.monotonic() < deadline, "no part written in time"
            time.sleep(0.5)
        time.sleep(1.0)
        assert proc.poll() is None, "the job finished before it could be killed: raise N_ROWS"
    finally:
        kill_group(proc)
    killed_parts = settled(lambda: _parts(out), quiet_s=5)
    # Every part that counts is complete (readable); anything half-written is under _tmp/.
    done_before = 0
    for part in killed_parts:
        done_before += pq.read_table(part).num_rows
    assert 0 < done_before < N_ROWS
    assert not [p for p in out.iterdir() if p.is_file() and p.name.startswith("part-") and p.suffix != ".parquet"]

    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["rows"] == N_ROWS and summary["latest_run"]["rows_skipped"] == done_before
    assert summary["latest_run"]["rows"] == N_ROWS - done_before
    assert not (out / "_tmp").exists()
    assert set(killed_parts) <= set(_parts(out))  # the killed run's parts are kept, not rewritten

    table = pq.read_table(out)
    keys = table.column("key").to_pylist()
    assert len(keys) == len(set(keys)) == N_ROWS and set(keys) == {f"k{i:03d}" for i in range(N_ROWS)}

    # Greedy tokens: exactly those of a clean run (SpecEngine, one process, which clean jobs equal).
    expected = reference(target, "ngram", prompts, [SamplingParams(max_new_tokens=24)] * N_ROWS)
    got = dict(zip(keys, table.column("generated_token_ids").to_pylist()))
    assert [got[f"k{i:03d}"] for i in range(N_ROWS)] == expected
