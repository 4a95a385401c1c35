"""Writes raysd_dashboard.json, the Grafana dashboard of raysd's live metrics (docs/metrics.md):

    python deploy/grafana/build_dashboard.py

The panels are the table below; tests/jobs/test_metrics.py checks that the committed JSON is
this script's output and that every query names a metric raysd exports (raysd.jobs.metrics).
Each panel is a Grafana time series on the `datasource` variable, as Ray's own dashboards are.
"""

from __future__ import annotations

import json
from pathlib import Path

# Label filters: every raysd metric has target_model and draft_model; a replica's also replica.
JOB = 'target_model=~"$target_model", draft_model=~"$draft_model"'
REP = JOB + ', replica=~"$replica"'


def rate(metric: str, by: str = "", filters: str = REP) -> str:
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{{{filters}}}[$interval]))"


def per(a: str, b: str) -> str:
    return f"{a} / {b}"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', 'le')})"


# (row, title, unit, description, [(expr, legend), ...]); the rows are laid out two panels wide.
PANELS = [
    ("Throughput", "Throughput", "tokens/s", "Tokens generated per second, per replica and in all.",
     [(rate("ray_raysd_generated_tokens_total", "replica"), "replica {{replica}}"),
      (rate("ray_raysd_generated_tokens_total"), "all")]),
    ("Throughput", "Rows", "rows/s", "Output rows made per second by finish reason, and rows written.",
     [(rate("ray_raysd_rows_total", "finish_reason"), "{{finish_reason}}"),
      (rate("ray_raysd_rows_written_total", filters=JOB), "written")]),
    ("Acceptance", "Acceptance rate", "percentunit",
     "Drafts accepted / drafts verified; mean acceptance length (tokens per row per step) on the right axis.",
     [(per(rate("ray_raysd_accepted_draft_tokens_total"), rate("ray_raysd_draft_tokens_total")), "acceptance rate"),
      ("1 + " + per(rate("ray_raysd_accepted_draft_tokens_total"), rate("ray_raysd_spec_steps_total")), "mean acceptance length")]),
    ("Acceptance", "Acceptance per position", "percentunit",
     "Drafts accepted at each position / the rows' steps that drafted.",
     [(per(rate("ray_raysd_accepted_draft_tokens_per_position_total", "position"),
           f'scalar({rate("ray_raysd_spec_steps_total")} - {rate("ray_raysd_steps_without_drafts_total")})'), "position {{position}}")]),
    ("Engine", "Step time split", "s",
     "Seconds per engine step: the job's drafting and target seconds (the summary's draft and verify stages) over its "
     "steps, and the 90th percentile of one step's drafting and verifying.",
     [(per(rate("ray_raysd_stage_seconds_total", filters=JOB + ', stage="draft"'), rate("ray_raysd_engine_steps_total", filters=JOB)),
       "draft (mean)"),
      (per(rate("ray_raysd_stage_seconds_total", filters=JOB + ', stage="verify"'), rate("ray_raysd_engine_steps_total", filters=JOB)),
       "verify (mean)"),
      (quantile(0.9, "ray_raysd_step_draft_seconds"), "draft (p90)"),
      (quantile(0.9, "ray_raysd_step_verify_seconds"), "verify (p90)")]),
    ("Engine", "Tokens per step", "short", "Tokens one step emits over its micro-batch (the mean and the median step's), "
     "and its rows (the median step's).",
     [(per(rate("ray_raysd_generated_tokens_total"), rate("ray_raysd_steps_total")), "tokens (mean)"),
      (quantile(0.5, "ray_raysd_step_tokens"), "tokens (median)"),
      (quantile(0.5, "ray_raysd_step_rows"), "rows (median)")]),
    ("Engine", "K chosen", "percentunit",
     "The share of steps by the drafts per row they planned (K = 0: plain decoding), by tree budget (tree jobs), and "
     "the job's share of steps that drafted.",
     [(per(rate("ray_raysd_steps_total", "k"), f'scalar({rate("ray_raysd_steps_total")})'), "K = {{k}}"),
      (per(rate("ray_raysd_steps_total", "tree_budget", REP + ', tree_budget!="0"'), f'scalar({rate("ray_raysd_steps_total")})'),
       "tree budget {{tree_budget}}"),
      (per(rate("ray_raysd_engine_drafted_steps_total", filters=JOB), rate("ray_raysd_engine_steps_total", filters=JOB)),
       "drafted (the job's time_breakdown drafted_steps)")]),
    ("Engine", "Occupancy", "percentunit", "Rows in the micro-batches / slots: per replica now, and the job's over the interval.",
     [(f"max by (replica) (ray_raysd_engine_occupancy{{{REP}}})", "replica {{replica}}"),
      (per(rate("ray_raysd_engine_active_rows_total", filters=JOB), rate("ray_raysd_engine_slot_steps_total", filters=JOB)), "job")]),
    ("Load", "Queue", "short", "Rows waiting for a slot and rows in the micro-batches, per replica.",
     [(f"max by (replica) (ray_raysd_rows_queued{{{REP}}})", "queued {{replica}}"),
      (f"max by (replica) (ray_raysd_rows_in_flight{{{REP}}})", "in flight {{replica}}")]),
    ("Load", "Seconds per stage", "s",
     "Seconds spent per second of wall time by each stage, summed over blocks and replicas (the summary's time_breakdown).",
     [(rate("ray_raysd_stage_seconds_total", "stage", JOB), "{{stage}}"),
      (rate("ray_raysd_engine_loop_seconds_total", filters=JOB), "engine loop"),
      (rate("ray_raysd_engine_idle_seconds_total", filters=JOB), "engine idle")]),
    ("Errors", "Errors", "rows/s", "Error rows per second, by kind (docs/metrics.md).",
     [(rate("ray_raysd_error_rows_total", "kind"), "{{kind}}")]),
    ("Errors", "Input", "rows/s", "Input rows read, and rows skipped because the output has them (a resumed job).",
     [(rate("ray_raysd_rows_read_total", filters=JOB), "read"), (rate("ray_raysd_rows_skipped_total", filters=JOB), "skipped")]),
]


def _variable(name: str, label: str, metric: str) -> dict:
    query = f"label_values({metric}, {name})"
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "definition": query, "query": {"query": query, "refId": "StandardVariableQuery"}, "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": ["All"], "value": ["$__all"]},
            "hide": 0, "sort": 1}


def _panel(panel_id: int, title: str, unit: str, description: str, targets: list, datasource: dict, grid: dict) -> dict:
    panel = {
        "type": "timeseries", "id": panel_id, "title": title, "description": description, "datasource": datasource,
        "gridPos": grid,
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 2, "fillOpacity": 0}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": datasource, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + j)}
                    for j, (expr, legend) in enumerate(targets)],
    }
    if title == "Acceptance rate":  # the length (1 to K + 1) on an axis of its own
        panel["fieldConfig"]["overrides"] = [{"matcher": {"id": "byName", "options": "mean acceptance length"},
                                              "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                                             {"id": "unit", "value": "short"}]}]
    return panel


def dashboard() -> dict:
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels, y = [], 0
    for row in dict.fromkeys(p[0] for p in PANELS):  # each row: its header, then its panels two wide
        panels.append({"type": "row", "title": row, "id": 100 + len(panels), "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        y += 1
        in_row = [(i, p) for i, p in enumerate(PANELS) if p[0] == row]
        for j, (i, (_, title, unit, description, targets)) in enumerate(in_row):
            panels.append(_panel(i + 1, title, unit, description, targets, datasource,
                                 {"x": 12 * (j % 2), "y": y + 8 * (j // 2), "w": 12, "h": 8}))
        y += 8 * ((len(in_row) + 1) // 2)
    return {
        "title": "raysd", "uid": "raysd", "tags": ["raysd", "ray"], "editable": True, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "graphTooltip": 1,
        "description": "raysd generation jobs: throughput, acceptance, engine steps, load and errors (docs/metrics.md)",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "hide": 0,
             "current": {}},
            _variable("target_model", "Target", "ray_raysd_rows_total"),
            _variable("draft_model", "Draft", "ray_raysd_rows_total"),
            _variable("replica", "Replica", "ray_raysd_rows_total"),
            {"name": "interval", "label": "Interval", "type": "custom", "query": "30s,1m,5m,15m", "hide": 0,
             "current": {"text": "1m", "value": "1m"},
             "options": [{"text": v, "value": v, "selected": v == "1m"} for v in ("30s", "1m", "5m", "15m")]},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    path = Path(__file__).with_name("raysd_dashboard.json")
    path.write_text(render())
    print(f"wrote {path}")
