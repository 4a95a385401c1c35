"""A busy machine is not a failure: `raysd generate` processes, each with the local Ray it starts,
as a user runs them.

- A target step slower than any read deadline (a test hook: the first step call sleeps 25 s) is
  waited for: the job writes every row once with 0 recoveries.
- The README's quick start and a draft-model job (bench/scenarios/busy.py, the same check as
  `python -m bench run busy`) finish with every row while two busy processes hold both cores.
- A step beyond `--step-timeout` fails the job in one line naming the timeout, and the file it
  names holds the whole trace.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from bench.environment import ROOT
from bench.scenarios.busy import JOBS, busy_processes, job_ok, run_job
from raysd.actors.model_actors import SLOW_STEPS_ENV
from tests.jobs.conftest import token_prompts
from tests.reliability.conftest import read_rows

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.xdist_group("own-rays")]  # tests/conftest.py

N_ROWS = 16


@pytest.fixture(scope="module")
def token_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("busy") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(token_prompts(N_ROWS, seed=5))))
    return path


def _generate(args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "raysd", "generate", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def test_a_step_slower_than_any_read_deadline_is_waited_for(token_input, model_dirs, tmp_path):
    target, draft, _ = model_dirs
    out = tmp_path / "out"
    proc = _generate(["--input", str(token_input), "--output", str(out), "--target", target, "--draft", draft, "-k", "4",
                      "--batch-size", "4", "--max-new-tokens", "8", "--json"], env={SLOW_STEPS_ENV: "1:25"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])["latest_run"]
    assert run["time_breakdown"]["wall"]["pipeline_start"] > 25  # the slow step really ran
    assert (run["rows"], run["recoveries"], run["passes"]) == (N_ROWS, 0, 1)
    ids = [r["id"] for r in read_rows(out)]
    assert sorted(ids) == list(range(N_ROWS))


@pytest.mark.parametrize("job", list(JOBS))
def test_jobs_finish_with_every_row_while_busy_processes_hold_both_cores(job, tmp_path):
    with busy_processes(2):
        result = run_job([*JOBS[job], "--max-new-tokens", "32"], tmp_path / "out", timeout=900)
    assert result["returncode"] == 0, result["stderr_tail"]
    assert job_ok(job, result), result["summary"]


def test_a_step_beyond_the_step_timeout_fails_in_one_line_naming_it(token_input, model_dirs, tmp_path):
    target, _, _ = model_dirs
    proc = _generate(["--input", str(token_input), "--output", str(tmp_path / "out"), "--target", target, "--draft", "none",
                      "--batch-size", "4", "--max-new-tokens", "8", "--step-timeout", "0.001"])
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and all(line.startswith("raysd generate: ") for line in lines), proc.stderr
    m = re.fullmatch(r"raysd generate: failed: StepTimedOut: a step took longer than 0.001 s \(the step timeout, "
                     r"--step-timeout\); .* the full trace and Ray's messages: (\S+)\)", lines[-1])
    assert m, lines[-1]
    trace = open(m.group(1)).read()
    assert "Traceback" in trace and "StepTimedOut" in trace
    os.remove(m.group(1))
