"""raysd's live metrics (raysd.jobs.metrics): the one table follows Prometheus's conventions, the
docs show it, the replica records what a step and a row hold, and every query of the Grafana
dashboard names a metric raysd exports. tests/jobs/test_prometheus.py reads them back from a real
Prometheus."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from raysd.engine.verdict import Plan, StepTimings, Verdict
from raysd.jobs import GenerateConfig, metrics
from raysd.jobs.metrics import JOB_COUNTS, METRICS, STAGE_SECONDS, JobCounters, ReplicaMetrics
from raysd.jobs.replica import error_output

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "raysd_dashboard.json"
EXPORTED = {s for m in METRICS for s in m.series}


def test_table_follows_prometheus_conventions():
    names = [m.name for m in METRICS]
    assert len(set(names)) == len(names)
    for m in METRICS:
        assert re.fullmatch(r"raysd_[a-z0-9_]+", m.name), m.name
        assert m.kind in ("counter", "gauge", "histogram"), m
        assert not m.name.endswith("_total")  # Ray adds it to a counter
        assert m.exported.endswith("_total") == (m.kind == "counter"), m
        assert (m.unit == "seconds") == m.name.endswith("_seconds"), m  # base unit, named
        assert bool(m.buckets) == (m.kind == "histogram"), m
        assert list(m.buckets) == sorted(set(m.buckets)) and all(b > 0 for b in m.buckets), m  # Ray: positive, ascending
        assert len(set(m.tag_keys)) == len(m.tag_keys), m
    # Every stage of the summary's time_breakdown has its counter, from the same JobStats key.
    assert {JOB_COUNTS[key] == ("raysd_stage_seconds", {"stage": stage}) for stage, key in STAGE_SECONDS} == {True}
    assert {name for name, _ in JOB_COUNTS.values()} == {m.name for m in METRICS if m.source == "job"}


def test_docs_show_the_table():
    assert metrics.markdown_table() in (ROOT / "docs" / "metrics.md").read_text()


class _Recorded:
    """Stands in for the Ray metrics: every record as (name, value, tags)."""

    def __init__(self, monkeypatch):
        self.records: list[tuple[str, float, dict]] = []
        monkeypatch.setattr(metrics, "_ray_metric", self.metric)

    def metric(self, name):
        rec = self.records

        class M:
            def inc(self, value, tags):
                rec.append((name, value, tags))

            observe = set = inc

        return M()

    def values(self, name, **labels):
        return [v for n, v, t in self.records if n == name and labels.items() <= t.items()]


CFG = GenerateConfig(input="in.jsonl", output="out", target="t-model", draft="d-model")


def _verdict(kept, k, tree_budget=0):
    b = len(kept)
    zeros = np.zeros(b, np.int64)
    return Verdict(Plan(k, tree_budget), tuple(tuple(r) for r in kept), zeros, zeros, zeros, zeros, zeros,
                   np.zeros(b), None, ())


def test_a_call_of_several_steps_records_each_step(monkeypatch):
    rec = _Recorded(monkeypatch)
    m = ReplicaMetrics(CFG, "r1")
    # A model-free drafter's call: 4 steps of 3 rows, 3 of them drafting K = 4, 15 tokens in all.
    m.on_step(StepTimings(draft_s=0.3, verify_s=2.0, steps=4, drafted_steps=3, row_steps=12, generated_tokens=15),
              _verdict([[1, 2], [3], [4, 5, 6]], k=4))
    assert [(t["k"], t["tree_budget"]) for n, _, t in rec.records if n == "raysd_steps"] == [("4", "0")] * 3 + [("0", "0")]
    assert rec.values("raysd_step_draft_seconds") == pytest.approx([0.1, 0.1, 0.1, 0.0])
    assert rec.values("raysd_step_verify_seconds") == [0.5] * 4
    assert rec.values("raysd_step_tokens") == [3.75] * 4 and rec.values("raysd_step_rows") == [3.0] * 4
    assert {tuple(sorted(t.items())) for n, _, t in rec.records if n != "raysd_steps"} == {
        (("draft_model", "d-model"), ("replica", "r1"), ("target_model", "t-model"))}
    # A draft actor's plain run (K = 0): its draft seconds spread over its steps.
    rec.records.clear()
    m.on_step(StepTimings(draft_s=0.2, verify_s=0.4, steps=2, drafted_steps=0, row_steps=4, generated_tokens=4),
              _verdict([[7, 8], [9, 10]], k=0))
    assert rec.values("raysd_step_draft_seconds") == [0.1, 0.1] and rec.values("raysd_steps", k="0") == [1, 1]
    # A tree step: its budget.
    rec.records.clear()
    m.on_step(StepTimings(steps=1, drafted_steps=1, row_steps=1, generated_tokens=3), _verdict([[1, 2, 3]], k=3, tree_budget=8))
    assert rec.values("raysd_steps", k="3", tree_budget="8") == [1]


def test_rows_by_finish_reason_and_error_kind(monkeypatch):
    rec = _Recorded(monkeypatch)
    m = ReplicaMetrics(CFG, "r1")
    row = {**error_output(CFG, 1, "x"), "finish_reason": "length", "error": None, "num_generated_tokens": 9,
           "num_draft_tokens": 8, "num_accepted_draft_tokens": 5, "num_spec_steps": 4, "num_steps_without_drafts": 1,
           "accepted_per_position": [3, 2, 0, 0]}
    m.observe_row(row)
    m.observe_row(error_output(CFG, 2, "duplicate id 2"), "id")
    assert rec.values("raysd_rows", finish_reason="length") == [1] and rec.values("raysd_rows", finish_reason="error") == [1]
    assert rec.values("raysd_error_rows", kind="id") == [1] and not rec.values("raysd_error_rows", kind="refused")
    assert (rec.values("raysd_generated_tokens"), rec.values("raysd_draft_tokens"), rec.values("raysd_accepted_draft_tokens"),
            rec.values("raysd_spec_steps"), rec.values("raysd_steps_without_drafts")) == ([9], [8], [5], [4], [1])
    assert [(v, t["position"]) for n, v, t in rec.records if n.endswith("per_position")] == [(3, "0"), (2, "1")]  # 0: none


def test_job_counters_export_what_job_stats_adds(monkeypatch):
    rec = _Recorded(monkeypatch)
    jc = JobCounters(metrics.job_tags(CFG))
    jc.add({"read_s": 0.5, "verify_s": 2.0, "rows_written": 8, "tokens": 99, "first_step_at": 1.7e9, "start_s": 0.0})
    assert rec.values("raysd_stage_seconds", stage="read") == [0.5] and rec.values("raysd_stage_seconds", stage="verify") == [2.0]
    assert rec.values("raysd_rows_written") == [8]
    assert len(rec.records) == 3  # the live counts (tokens: the replicas') and times are not exported; 0 is not recorded


def test_a_failing_metric_never_fails_the_job(monkeypatch, caplog):
    def broken(name):
        raise RuntimeError("metrics agent gone")

    monkeypatch.setattr(metrics, "_ray_metric", broken)
    m = ReplicaMetrics(CFG, "r1")
    m.observe_row(error_output(CFG, 1, "x"), "id")
    m.set_load(1, 2, 0.5)
    JobCounters({}).add({"read_s": 1.0})
    assert sum("a live metric failed" in r.message for r in caplog.records) == 2  # once per recorder


# The dashboard: its queries name raysd's metrics only.

PROMQL_WORDS = {"sum", "max", "min", "avg", "rate", "increase", "scalar", "histogram_quantile", "by", "without", "on",
                "ignoring", "group_left", "and", "or", "unless"}


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: what is left once strings, label matchers,
    ranges, grouping clauses, functions and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    unknown = words - PROMQL_WORDS - {w for w in words if w.startswith("ray_")}
    assert not unknown, f"not a metric nor a known PromQL word: {unknown} in {expr}"
    return {w for w in words if w.startswith("ray_")}


def dashboard_targets(board: dict) -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


def test_dashboard_queries_name_exported_metrics_only():
    board = json.loads(DASHBOARD.read_text())
    used = set()
    for title, target in dashboard_targets(board):
        names = metric_names(target["expr"])
        assert names and names <= EXPORTED, (title, names - EXPORTED)
        used |= names
    labels_of = {s: m.tag_keys for m in METRICS for s in m.series}
    for var in board["templating"]["list"]:
        if var["type"] == "query":  # label_values(metric, label): a label of an exported metric
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]["query"]).groups()
            assert label in labels_of[metric], var
    assert metric_names('sum by (le) (rate(ray_raysd_step_rows_bucket{le="0.5"}[1m])) / scalar(ray_x_total)') == {
        "ray_raysd_step_rows_bucket", "ray_x_total"}
    # Every metric is on the dashboard, bar the ones a panel reads through another series of it.
    assert {m.name for m in METRICS if not set(m.series) & used} == set()


def test_dashboard_has_the_panels_of_docs_metrics():
    board = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in board["panels"] if p["type"] != "row"}
    assert {"Throughput", "Acceptance rate", "Acceptance per position", "Step time split", "K chosen", "Occupancy", "Queue",
            "Errors"} <= titles
    # As Ray's own dashboards: a `datasource` variable, which every panel and query uses.
    assert board["templating"]["list"][0] == {**board["templating"]["list"][0], "name": "datasource", "type": "datasource"}
    assert {json.dumps(t["datasource"]) for _, t in dashboard_targets(board)} == {'{"type": "prometheus", "uid": "${datasource}"}'}
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids) and board["uid"] == "raysd"


def test_dashboard_is_the_build_scripts_output():
    spec = importlib.util.spec_from_file_location("build_dashboard", DASHBOARD.with_name("build_dashboard.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert DASHBOARD.read_text() == build.render(), "run: python deploy/grafana/build_dashboard.py"
