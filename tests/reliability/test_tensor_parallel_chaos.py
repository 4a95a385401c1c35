"""Chaos with a tensor-parallel target: SIGKILL one of the target's two
rank actors in the middle of a real job. The rank's group is broken, so the replica's coordinator
kills the surviving rank and starts both afresh in a new group (raysd.actors.coordinator
`_recover`); the rows in flight re-run from their prompts. The job finishes with every input id
exactly once and the tokens of an unkilled run (the single-process SpecEngine's, as in
test_chaos.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from raysd.core.sampling import SamplingParams
from raysd.jobs import GenerateConfig
from tests.jobs.conftest import token_prompts
from tests.jobs.test_generate import reference
from tests.reliability.chaos import VICTIMS, JobThread, Outcome, alive_pids, compare, part_rows, wait_for
from tests.reliability.conftest import read_rows

pytestmark = [pytest.mark.slow, pytest.mark.alone]
N_ROWS, MAX_NEW = 64, 12  # 16 blocks of 4: the first part lands well before the job ends


def test_kill_one_rank_mid_job(model_dirs, local_ray, tmp_path):
    target, draft, _ = model_dirs
    prompts = token_prompts(N_ROWS, seed=13)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"key": f"k{i:03d}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    expected = {f"k{i:03d}": t for i, t in enumerate(reference(target, draft, prompts, [SamplingParams(max_new_tokens=MAX_NEW)] * N_ROWS))}
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), id_column="key", target=target, draft=draft,
                         max_new_tokens=MAX_NEW, batch_size=4, rows_per_file=4, quiet=True, num_speculative_tokens=4,
                         num_cpus_per_actor=1, target_tensor_parallel=2)
    out, victim = Path(cfg.output), VICTIMS["target"]
    start = time.monotonic()
    job = JobThread(cfg)
    wait_for(lambda: len(alive_pids(victim)) == 2 and part_rows(out) >= 1, job, "both ranks up and a part written")
    ranks = alive_pids(victim)
    outcome = Outcome("tensor-parallel rank", rows_in=N_ROWS, rows_written_at_kill=part_rows(out), killed_pid=ranks[-1])
    os.kill(ranks[-1], signal.SIGKILL)
    fresh: set[int] = set()
    while job.is_alive() and len(fresh) < 2:  # both ranks come back as new processes while the job runs
        fresh = set(alive_pids(victim)) - set(ranks)
        time.sleep(0.05)
    summary = job.result(300)
    outcome.wall_s = time.monotonic() - start
    assert 0 < outcome.rows_written_at_kill < N_ROWS  # really mid-job
    assert len(fresh) == 2, f"both ranks should restart in a new group, saw new pids {fresh}"
    outcome = compare(outcome, read_rows(cfg.output), "key", expected)
    assert (outcome.rows_out, outcome.lost, outcome.duplicated, outcome.token_mismatches, outcome.error_rows) == (N_ROWS, 0, 0, 0, 0), outcome
    assert summary.rows == N_ROWS and summary.rows_failed == 0
    print(outcome)
