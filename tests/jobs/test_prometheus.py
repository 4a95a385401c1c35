"""raysd's live metrics read back through a real Prometheus: a Prometheus server (Debian's
`prometheus` package; .ci/run installs it) on the loopback address scrapes the metrics export of a
Ray started for the test, a small job runs, and raysd's series, queried through Prometheus's HTTP
API, add up to the job's summary. Every query of the Grafana dashboard runs there too.

Skipped where `prometheus` is not installed. Bounded: Prometheus ready in 60 s, the job's final
values scraped within 90 s of its end; the server is stopped whatever happens."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raysd.actors.model_actors import SLOW_STEPS_ENV
from raysd.jobs import GenerateConfig, generate
from raysd.jobs.metrics import STAGE_SECONDS
from tests.conftest import fresh_cache_dir, own_ray
from tests.jobs.conftest import token_prompts
from tests.jobs.test_metrics import DASHBOARD, dashboard_targets

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="the `prometheus` server is not installed (Debian: apt-get install "
                                                  "prometheus; .ci/run installs it)"),
]
# What the processes recorded reaches Ray's metrics agent this often (Ray's default: 10 s; its floor: 1 s).
REPORT_S = 1
SCRAPE_S = 1
# The load gauges hold a step's value until the next: a job that generates in under a report
# interval (a fast machine) may show only its final 0. The target's first steps each sleep, so
# rows are in flight over several reports and scrapes on any machine (the actors' test hook).
SLOW_STEPS = "16:0.3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping `targets` every SCRAPE_S, its data in `root`."""

    def __init__(self, root: Path, targets: list[str]):
        self.port = free_port()
        config = root / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
                          f"scrape_configs:\n  - job_name: ray\n    static_configs:\n      - targets: {json.dumps(targets)}\n")
        self.log_path = root / "prometheus.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.ready, 60, f"prometheus ready ({self.log_path})")

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited ({self.proc.returncode}): {self.log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        """A query's one value (None: no series)."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def by(self, promql: str, label: str) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(promql)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self.log.close()


@pytest.fixture(scope="module")
def scraped_ray(tmp_path_factory):
    """A local Ray exporting its metrics at a fixed loopback port, every REPORT_S, and a Prometheus
    scraping it."""
    import ray

    saved = {name: os.environ.get(name) for name in ("RAYSD_CACHE_DIR", SLOW_STEPS_ENV)}
    os.environ["RAYSD_CACHE_DIR"] = str(fresh_cache_dir(tmp_path_factory.mktemp("raysd-cache")))
    os.environ[SLOW_STEPS_ENV] = SLOW_STEPS  # the processes Ray starts inherit it
    port = free_port()
    own_ray(num_cpus=6, _metrics_export_port=port, _system_config={"metrics_report_interval_ms": REPORT_S * 1000})
    prometheus = None
    try:
        prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{port}"])
        wait_for(lambda: prometheus.value('up{job="ray"}') == 1.0, 30, "Ray's metrics export scraped")
        yield prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_series_add_up_to_the_summary(tmp_path, model_dirs, scraped_ray):
    prom = scraped_ray
    target, _ = model_dirs
    prompts = token_prompts(32, seed=21)
    rows = [{"id": i, "prompt": p} for i, p in enumerate(prompts)]
    rows += [{"id": 3, "prompt": [5, 6]}, {"id": 99, "prompt": []}]  # error rows: a duplicate id, an empty prompt
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The target drafting for itself: every draft accepted, unless a row ends first.
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft=target, num_speculative_tokens=2,
                         max_new_tokens=80, batch_size=4, rows_per_file=8, quiet=True)
    summary = generate(cfg)
    run = summary.latest_run
    table = pq.read_table(cfg.output).to_pylist()
    drafted, accepted = sum(r["num_draft_tokens"] for r in table), sum(r["num_accepted_draft_tokens"] for r in table)
    assert run.rows == len(rows) and run.rows_failed == 2 and drafted > 0 and accepted > 0

    def read() -> dict:
        return {
            "rows": prom.value("sum(ray_raysd_rows_total)"),
            "written": prom.value("sum(ray_raysd_rows_written_total)"),
            "reasons": prom.by("sum by (finish_reason) (ray_raysd_rows_total)", "finish_reason"),
            "errors": prom.by("sum by (kind) (ray_raysd_error_rows_total)", "kind"),
            "tokens": prom.value("sum(ray_raysd_generated_tokens_total)"),
            "drafted": prom.value("sum(ray_raysd_draft_tokens_total)"),
            "accepted": prom.value("sum(ray_raysd_accepted_draft_tokens_total)"),
            "per_position": prom.value("sum(ray_raysd_accepted_draft_tokens_per_position_total)"),
            "spec_steps": prom.value("sum(ray_raysd_spec_steps_total)"),
            "stages": prom.by("sum by (stage) (ray_raysd_stage_seconds_total)", "stage"),
            "active_rows": prom.value("sum(ray_raysd_engine_active_rows_total)"),
            "slot_steps": prom.value("sum(ray_raysd_engine_slot_steps_total)"),
            "engine_steps": prom.value("sum(ray_raysd_engine_steps_total)"),
            "drafted_steps": prom.value("sum(ray_raysd_engine_drafted_steps_total)"),
            "steps_by_k": prom.by("sum by (k) (ray_raysd_steps_total)", "k"),
            "step_count": prom.value("sum(ray_raysd_step_verify_seconds_count)"),
            "step_tokens_count": prom.value("sum(ray_raysd_step_tokens_count)"),
        }

    # The final values: each process reports within REPORT_S (one that exits, as it goes), then
    # the next scrape has them. Wait until the rows and the stage seconds are all there and the
    # values have held for a few scrapes.
    last, held_since = None, time.monotonic()

    def settled():
        nonlocal last, held_since
        now = read()
        if now != last:
            last, held_since = now, time.monotonic()
        return (now["rows"] == run.rows and now["written"] == run.rows and len(now["stages"]) == len(STAGE_SECONDS)
                and now["engine_steps"] == now["step_count"] and time.monotonic() - held_since > 3 * REPORT_S)

    try:
        wait_for(settled, 90, "the job's final values in Prometheus")
    except BaseException:
        print("last read:", last, "\nsummary:", json.dumps(summary.to_dict(), indent=1))
        raise
    got = last
    print(json.dumps(got, indent=1))
    assert got["tokens"] == run.generated_tokens == summary.generated_tokens
    assert got["reasons"] == {k: float(v) for k, v in summary.finish_reasons.items()}
    assert got["errors"] == {"id": 1.0, "prompt": 1.0}
    assert (got["drafted"], got["accepted"], got["per_position"]) == (drafted, accepted, accepted)
    assert got["accepted"] / got["drafted"] == run.draft_acceptance_rate
    assert 1 + got["accepted"] / got["spec_steps"] == run.mean_acceptance_length
    tb = run.time_breakdown
    for stage, _ in STAGE_SECONDS:  # the summary rounds to ms
        assert got["stages"][stage] == pytest.approx(tb[stage], abs=1e-3), stage
    assert round(got["active_rows"] / got["slot_steps"], 4) == run.occupancy
    assert round(got["drafted_steps"] / got["engine_steps"], 4) == tb["drafted_steps"] == 1.0
    # Each replica's steps (counted as each call returns) are the job's (as each block reports).
    assert got["steps_by_k"] == {"2": got["engine_steps"]} and got["step_tokens_count"] == got["engine_steps"]
    # The load while the job ran: a gauge is gone ~2 report intervals after its replica, so read the past.
    in_flight = prom.value("max_over_time(sum(ray_raysd_rows_in_flight)[10m:1s])")
    occupancy = prom.value("max_over_time(max(ray_raysd_engine_occupancy)[10m:1s])")
    assert 1 <= in_flight <= cfg.batch_size and 0 < occupancy <= 1, (in_flight, occupancy)
    assert prom.value("max_over_time(sum(ray_raysd_rows_queued)[10m:1s])") >= 0

    # Every query of the Grafana dashboard runs (the variables at "all"), and the throughput has data.
    variables = {"$interval": "5m", "$target_model": ".*", "$draft_model": ".*", "$replica": ".*"}
    board = json.loads(DASHBOARD.read_text())
    answered = {}
    for title, t in dashboard_targets(board):
        expr = t["expr"]
        for name, value in variables.items():
            expr = expr.replace(name, value)
        answered[(title, t["refId"])] = prom.query(expr)
    assert answered[("Throughput", "B")] and answered[("Acceptance rate", "A")], answered


def test_a_beam_jobs_rows_are_counted(tmp_path, model_dirs, scraped_ray):
    """A beam job's rows (each prompt's hypotheses, and its error rows) reach the same counters as
    a sampled job's. Its draft label ("none") keeps its series apart from the test above."""
    prom = scraped_ray
    target, _ = model_dirs
    rows = [{"id": i, "prompt": p} for i, p in enumerate(token_prompts(4, seed=5))] + [{"id": 9, "prompt": None}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft="none", beam_width=2,
                         num_return_sequences=2, max_new_tokens=8, batch_size=4, quiet=True)
    summary = generate(cfg)
    assert summary.rows == 2 * len(rows) and summary.rows_failed == 2  # the null prompt: an error row per hypothesis
    where = '{draft_model="none"}'

    def counted():
        return (prom.value(f"sum(ray_raysd_rows_total{where})"), prom.value(f"sum(ray_raysd_generated_tokens_total{where})"),
                prom.by(f"sum by (kind) (ray_raysd_error_rows_total{where})", "kind"))

    expected = (float(summary.rows), float(summary.generated_tokens), {"prompt": 2.0})
    wait_for(lambda: counted() == expected, 90, "the beam job's rows in Prometheus")
