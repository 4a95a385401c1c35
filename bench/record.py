"""A result file: one JSON object per `python -m bench run`, the same envelope for every scenario.

    schema        RECORD_SCHEMA
    scenario      the registered name (bench.registry)
    command       the command line that reproduces it
    arguments     every option as parsed (defaults included)
    quick         whether --quick shrank it (a smoke run, not a measurement)
    date_utc      when it started (ISO 8601, UTC); elapsed_s: how long it took
    machine       CPU model, cores, SIMD flags, torch threads, GPU (bench.environment)
    load_average  {"before": [1, 5, 15 min], "after": [...]}
    versions      python, torch, transformers, ray, raysd_commit
    definitions   bench.measure.DEFINITIONS: what every figure means
    variants      [{name, settings, baseline, median, ratio, runs}] (bench.harness)
    extra         what else the scenario measured (step costs, per-task figures, ...)
    checks        {name: {ok, ...}}: e.g. greedy rows equal to plain decoding's
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.harness import Outcome
from bench.measure import DEFINITIONS

RECORD_SCHEMA = 1


def build(scenario: str, command: str, arguments: dict, quick: bool, date_utc: str, elapsed_s: float, machine: dict,
          load_before: list, load_after: list, versions: dict, outcome: Outcome) -> dict:
    return {"schema": RECORD_SCHEMA, "scenario": scenario, "command": command, "arguments": arguments, "quick": quick,
            "date_utc": date_utc, "elapsed_s": round(elapsed_s, 1), "machine": machine,
            "load_average": {"before": load_before, "after": load_after}, "versions": versions,
            "definitions": DEFINITIONS, "variants": outcome.variants, "extra": outcome.extra, "checks": outcome.checks}


def _clean(x):
    """JSON has no NaN or infinity: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write(record: dict, path: str | Path, markdown: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(record), indent=1, default=str) + "\n")
    if markdown:
        path.with_suffix(".md").write_text(markdown)
    return path


def read(path: str | Path) -> dict:
    record = json.loads(Path(path).read_text())
    if not isinstance(record, dict) or record.get("schema") != RECORD_SCHEMA:
        raise ValueError(f"{path} is not a bench result (schema {RECORD_SCHEMA})")
    return record
