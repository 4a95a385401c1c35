"""busy: `raysd generate` while busy processes hold every core. Each job is a `raysd generate`
process of its own (its own local Ray, as a user runs it), started while `--busy N` processes at
ordinary priority spin; the check is that each writes every row, in one pass, with no recovery.

- quickstart: the README's quick start (examples/prompts.jsonl, every default);
- draft: the same prompts with the shipped distilled draft at K = 4, two samples per prompt, a stop
  string and log-probabilities.

    python -m bench run busy                     # one busy process per core (default)
    python -m bench run busy --busy 4 --jobs draft

tests/reliability/test_busy_machine.py runs these jobs through `run_job` under `busy_processes`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.environment import ROOT
from bench.harness import Outcome, Variant, run_variants
from bench.measure import Counts, figures

QUICK = {"jobs": ["quickstart"], "max_new_tokens": 16}
PROMPTS = ROOT / "examples" / "prompts.jsonl"
JOBS = {
    "quickstart": [],
    "draft": ["--draft", "smollm2-135m-instruct-draft", "-k", "4", "--num-samples", "2", "--stop", "\n\n", "--logprobs"],
}
SAMPLES = {"quickstart": 1, "draft": 2}


def add_arguments(p) -> None:
    p.set_defaults(repeats=1)
    g = p.add_argument_group("busy")
    g.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy processes beside each job (default: one per core)")
    g.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--timeout", type=float, default=900, help="seconds a job may take before the check fails")


@contextlib.contextmanager
def busy_processes(n: int):
    """`n` processes spinning at ordinary priority (nice 0) until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_job(extra: list[str], out: Path, timeout: float, env: dict | None = None) -> dict:
    """One `raysd generate --json` process on the example prompts: {returncode, wall_s, summary
    (the JSON summary, None if it failed), stderr_tail}."""
    cmd = [sys.executable, "-m", "raysd", "generate", "--input", str(PROMPTS), "--output", str(out), "--json", *extra]
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - start
    summary = None
    if proc.returncode == 0:
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"returncode": proc.returncode, "wall_s": wall, "summary": summary, "stderr_tail": proc.stderr[-3000:]}


def expected_rows(job: str) -> int:
    return sum(1 for line in PROMPTS.read_text().splitlines() if line.strip()) * SAMPLES[job]


def job_ok(job: str, result: dict) -> bool:
    """Every row written, in one pass, with no recovery and no error row."""
    s = result["summary"]
    return bool(s) and s["rows"] == expected_rows(job) and s["rows_failed"] == 0 and \
        s["latest_run"]["recoveries"] == 0 and s["latest_run"]["passes"] == 1


def run(a, log=print) -> Outcome:
    results: dict[str, list[dict]] = {job: [] for job in a.jobs}

    def variant(job: str) -> Variant:
        def one() -> dict:
            with tempfile.TemporaryDirectory() as tmp, busy_processes(a.busy):
                r = run_job([*JOBS[job], "--max-new-tokens", str(a.max_new_tokens)], Path(tmp) / "out", a.timeout)
            results[job].append({k: v for k, v in r.items() if k != "summary"} | {"ok": job_ok(job, r)})
            tokens = r["summary"]["generated_tokens"] if r["summary"] else 0
            return figures(Counts(tokens), r["wall_s"], timed=f"raysd generate beside {a.busy} busy processes",
                           rows=r["summary"]["rows"] if r["summary"] else 0)

        return Variant(f"{job}, {a.busy} busy", {"job": job, "busy": a.busy, "max_new_tokens": a.max_new_tokens}, one)

    summaries, _ = run_variants([variant(job) for job in a.jobs], a.repeats, log=log)
    checks = {f"{job}_every_row": {"ok": all(r["ok"] for r in results[job]), "walls_s": [round(r["wall_s"], 1) for r in results[job]]}
              for job in a.jobs}
    return Outcome(summaries, {"jobs": results}, checks)
