"""A job's live metrics, for Prometheus and Grafana: every metric raysd exports, in one table.

Each is a `ray.util.metrics` metric. Ray's metrics agent on each node serves it at the node's
metrics-export port as `ray_<name>`, a counter as `ray_<name>_total`, with Ray's own labels
(SessionName, NodeAddress, WorkerId, ...) beside raysd's. Two kinds of process record them:

- each replica (`ReplicaMetrics`, in its generation actor): an output row's counts when the row
  is made, an engine step's seconds, tokens and plan when its call returns, and the replica's
  queue and occupancy after each call. Labels: replica, target_model, draft_model.
- the job's JobStats actor (`JobCounters`): the counts every stage reports to it (seconds per
  stage, engine steps, rows read and written), as each report lands. The summary's
  `time_breakdown` and occupancy are computed from the same totals (`STAGE_SECONDS`), so the
  dashboard and the summary cannot disagree. Labels: target_model, draft_model.

Ray exports a recorded value a few seconds later (its metrics report interval), and a process
that exits normally exports what it recorded first. docs/metrics.md's table is `markdown_table()`
and deploy/grafana/raysd_dashboard.json queries these names only (tests/jobs/test_metrics.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Where a job's time goes, in pipeline order: (summary key, field) of the job's totals, each field
# the replicas' LoopStats' (raysd.engine.verdict) or, read_s and write_s, the read and write tasks'
# own. Each is summed over blocks or rows, over every replica: stages overlap, so they do not add
# up to the wall time. The summary's `time_breakdown` (raysd.jobs.pipeline) and the metric
# raysd_stage_seconds{stage} both read them.
STAGE_SECONDS = (("start", "start_s"), ("read", "read_s"), ("tokenize", "tokenize_s"), ("queue_wait", "queue_wait_s"),
                 ("draft", "draft_s"), ("verify", "verify_s"), ("detokenize", "detokenize_s"), ("write", "write_s"))

REPLICA_LABELS = ("replica", "target_model", "draft_model")
JOB_LABELS = ("target_model", "draft_model")

# Why a row is an error row (raysd_error_rows{kind}): a small fixed set, so a label of few values.
ERROR_KINDS = {
    "id": "its id is null or a duplicate",
    "input": "a value of the row is not valid UTF-8",
    "params": "a bad override column (max_new_tokens, seed, stop, num_samples, ...)",
    "prompt": "the prompt cannot become token ids (null, empty, not tokenizable, bad chat messages)",
    "refused": "the engine refused it: longer than the context, a token id outside the vocabulary, stop strings without a tokenizer",
}

# Histogram buckets. Ray exports a histogram's `_sum` from its buckets' midpoints, not from the
# values observed (ray/_private/telemetry/open_telemetry_metric_recorder.py), so a mean from it is
# approximate; the exact totals are counters, and the histograms are for quantiles.
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class Metric:
    name: str  # as registered with Ray (Prometheus: `exported`)
    kind: str  # counter, gauge or histogram
    unit: str
    description: str
    source: str = "replica"  # replica (REPLICA_LABELS) or job (JOB_LABELS)
    labels: tuple[str, ...] = ()  # raysd's labels besides the source's
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds

    @property
    def exported(self) -> str:
        return f"ray_{self.name}_total" if self.kind == "counter" else f"ray_{self.name}"

    @property
    def series(self) -> tuple[str, ...]:
        """The names Prometheus stores."""
        if self.kind == "histogram":
            return tuple(f"ray_{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.exported,)

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return (REPLICA_LABELS if self.source == "replica" else JOB_LABELS) + self.labels


def _replica(name, kind, unit, description, labels=(), buckets=()) -> Metric:
    return Metric(name, kind, unit, description, "replica", labels, buckets)


def _job(name, unit, description, labels=()) -> Metric:
    return Metric(name, "counter", unit, description, "job", labels)


METRICS = (
    # A replica's rows, counted when each output row is made (one per sample).
    _replica("raysd_rows", "counter", "rows", "output rows made, by finish_reason (stop, length, error)", ("finish_reason",)),
    _replica("raysd_error_rows", "counter", "rows", "error rows, by kind (" + ", ".join(ERROR_KINDS) + "; see below)", ("kind",)),
    _replica("raysd_generated_tokens", "counter", "tokens", "tokens generated (the rows' num_generated_tokens)"),
    _replica("raysd_draft_tokens", "counter", "tokens", "drafts (tree nodes) the target verified (num_draft_tokens)"),
    _replica("raysd_accepted_draft_tokens", "counter", "tokens", "drafts accepted (num_accepted_draft_tokens)"),
    _replica("raysd_accepted_draft_tokens_per_position", "counter", "tokens",
             "drafts accepted at each draft position, 0 first (accepted_per_position)", ("position",)),
    _replica("raysd_spec_steps", "counter", "steps",
             "the rows' steps (num_spec_steps): mean acceptance length = 1 + accepted / spec steps"),
    _replica("raysd_steps_without_drafts", "counter", "steps",
             "the rows' steps that drafted nothing for them (num_steps_without_drafts): per-position acceptance = "
             "accepted at the position / (spec steps - steps without drafts)"),
    # A replica's engine steps, observed when the call that ran them returns.
    _replica("raysd_steps", "counter", "steps", "engine steps, by the drafts per row they planned (k; 0: plain decoding) "
             "and the draft tree's node budget (tree_budget; 0: a chain)", ("k", "tree_budget")),
    _replica("raysd_step_draft_seconds", "histogram", "seconds", "one step's drafting (0 for a step that drafted nothing)",
             buckets=_SECONDS),
    _replica("raysd_step_verify_seconds", "histogram", "seconds",
             "one step's target pass, rejection test and read-back (prompts' prefill excluded)", buckets=_SECONDS),
    _replica("raysd_step_tokens", "histogram", "tokens", "tokens one step emitted over its micro-batch's rows", buckets=_COUNTS),
    _replica("raysd_step_rows", "histogram", "rows", "rows in one step's micro-batch", buckets=_COUNTS),
    # A replica's load, after each call.
    _replica("raysd_rows_queued", "gauge", "rows", "rows submitted to the replica's engine, not yet in a micro-batch"),
    _replica("raysd_rows_in_flight", "gauge", "rows", "rows in the replica's micro-batches"),
    _replica("raysd_engine_occupancy", "gauge", "ratio", "rows in the micro-batches / the replica's slots"),
    # The job's counts (JobStats): the totals the summary reads.
    _job("raysd_stage_seconds", "seconds", "seconds per stage, summed over blocks and replicas: the summary's "
         "time_breakdown (stages: " + ", ".join(name for name, _ in STAGE_SECONDS) + ")", ("stage",)),
    _job("raysd_engine_loop_seconds", "seconds", "the replicas' step loops at work, idle excluded (time_breakdown engine_loop)"),
    _job("raysd_engine_idle_seconds", "seconds", "the replicas' step loops with no row to run (time_breakdown engine_idle)"),
    _job("raysd_engine_steps", "steps", "micro-batch steps (one target forward each)"),
    _job("raysd_engine_drafted_steps", "steps", "micro-batch steps that drafted: / engine steps = time_breakdown drafted_steps"),
    _job("raysd_engine_active_rows", "rows", "rows in the micro-batches, summed over steps: / slot steps = occupancy"),
    _job("raysd_engine_slot_steps", "rows", "the replicas' slots, summed over steps"),
    _job("raysd_rows_read", "rows", "input rows read by the id stage"),
    _job("raysd_rows_skipped", "rows", "output rows already there, skipped (a resumed job)"),
    _job("raysd_rows_written", "rows", "output rows written"),
)
BY_NAME = {m.name: m for m in METRICS}

# JobStats key -> (metric, its own labels): what JobCounters exports of each report.
JOB_COUNTS = {
    **{key: ("raysd_stage_seconds", {"stage": stage}) for stage, key in STAGE_SECONDS},
    "engine_loop_s": ("raysd_engine_loop_seconds", {}), "engine_idle_s": ("raysd_engine_idle_seconds", {}),
    "steps": ("raysd_engine_steps", {}), "drafted_steps": ("raysd_engine_drafted_steps", {}),
    "active_rows": ("raysd_engine_active_rows", {}), "slot_steps": ("raysd_engine_slot_steps", {}),
    "rows_read": ("raysd_rows_read", {}), "rows_skipped": ("raysd_rows_skipped", {}), "rows_written": ("raysd_rows_written", {}),
}

_made: dict = {}
_made_lock = threading.Lock()


def _ray_metric(name: str):
    """The process's one Ray metric of this name (made at first use)."""
    with _made_lock:
        if name not in _made:
            from ray.util.metrics import Counter, Gauge, Histogram

            m = BY_NAME[name]
            if m.kind == "histogram":
                _made[name] = Histogram(m.name, m.description, boundaries=list(m.buckets), tag_keys=m.tag_keys)
            else:
                _made[name] = (Counter if m.kind == "counter" else Gauge)(m.name, m.description, tag_keys=m.tag_keys)
        return _made[name]


def job_tags(cfg) -> dict[str, str]:
    """A job's JOB_LABELS (cfg: a GenerateConfig)."""
    return {"target_model": cfg.target, "draft_model": cfg.draft}


class _Recorder:
    """Records with `tags`. Never raises: a metric that fails is logged once and the job goes on."""

    def __init__(self, tags: dict[str, str]):
        self.tags = dict(tags)
        self._warned = False

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a metric is never worth a job
            if not self._warned:
                self._warned = True
                logger.warning("raysd: a live metric failed (%s: %s); the job goes on", type(exc).__name__, exc)


class ReplicaMetrics(_Recorder):
    """A replica's metrics (`source` replica)."""

    def __init__(self, cfg, replica: int | str):
        super().__init__({"replica": str(replica), **job_tags(cfg)})

    def _inc(self, name: str, value, **labels) -> None:
        if value > 0:
            _ray_metric(name).inc(value, tags={**self.tags, **labels})

    def observe_row(self, out: dict, error_kind: str = "refused") -> None:
        """One output row (schema.GENERATED_FIELDS); an error row counts under `error_kind`."""
        self._guard(self._observe_row, out, error_kind)

    def _observe_row(self, out: dict, error_kind: str) -> None:
        self._inc("raysd_rows", 1, finish_reason=out["finish_reason"])
        if out["finish_reason"] == "error":
            self._inc("raysd_error_rows", 1, kind=error_kind)
            return
        for name, key in (("raysd_generated_tokens", "num_generated_tokens"), ("raysd_draft_tokens", "num_draft_tokens"),
                          ("raysd_accepted_draft_tokens", "num_accepted_draft_tokens"), ("raysd_spec_steps", "num_spec_steps"),
                          ("raysd_steps_without_drafts", "num_steps_without_drafts")):
            self._inc(name, out[key])
        for position, n in enumerate(out["accepted_per_position"]):
            self._inc("raysd_accepted_draft_tokens_per_position", n, position=str(position))

    def observe_step(self, draft_s: float, verify_s: float, tokens: float, k: int, tree_budget: int, rows: float) -> None:
        """One engine step of one micro-batch."""
        self._guard(self._observe_step, draft_s, verify_s, tokens, k, tree_budget, rows)

    def _observe_step(self, draft_s, verify_s, tokens, k, tree_budget, rows) -> None:
        self._inc("raysd_steps", 1, k=str(k), tree_budget=str(tree_budget))
        for name, value in (("raysd_step_draft_seconds", draft_s), ("raysd_step_verify_seconds", verify_s),
                            ("raysd_step_tokens", tokens), ("raysd_step_rows", rows)):
            _ray_metric(name).observe(value, tags=self.tags)

    def on_step(self, timings, verdict) -> None:
        """A completed call's steps (raysd.engine.verdict StepTimings and Verdict), one
        `observe_step` each. A call may run several steps (a model-free drafter's, or a plain run):
        the timings count them all, the verdict is the last one's (the merged plain steps' for a
        draft actor). So each step gets the call's mean tokens and rows; its drafted steps the
        last plan's K and tree (K 0 and no tree for the others) and an equal share of the drafting
        seconds; every step an equal share of the verify seconds."""
        self._guard(self._on_step, timings, verdict)

    def _on_step(self, timings, verdict) -> None:
        n, drafted = timings.steps, timings.drafted_steps
        if n <= 0:
            return
        k, tree = verdict.plan.k, verdict.plan.tree_budget
        tokens, rows = timings.generated_tokens / n, timings.row_steps / n
        verify = timings.verify_s / n
        for i in range(n):
            plans = i < drafted
            draft = (timings.draft_s / drafted if plans else 0.0) if drafted else timings.draft_s / n
            self._observe_step(draft, verify, tokens, k if plans else 0, tree if plans else 0, rows)

    def set_load(self, queued: int, in_flight: int, occupancy: float) -> None:
        self._guard(self._set_load, queued, in_flight, occupancy)

    def _set_load(self, queued, in_flight, occupancy) -> None:
        for name, value in (("raysd_rows_queued", queued), ("raysd_rows_in_flight", in_flight),
                            ("raysd_engine_occupancy", occupancy)):
            _ray_metric(name).set(value, tags=self.tags)


class JobCounters(_Recorder):
    """The job's counts (`source` job), exported by the JobStats actor as each report lands: the
    JOB_COUNTS keys of `JobStats.add`'s counts and LoopStats fields, the very numbers its totals add."""

    def add(self, counts: dict) -> None:
        self._guard(self._add, counts)

    def _add(self, counts: dict) -> None:
        for key, value in counts.items():
            if key in JOB_COUNTS and value is not None and value > 0:  # a counter only grows
                name, labels = JOB_COUNTS[key]
                _ray_metric(name).inc(value, tags={**self.tags, **labels})


def markdown_table() -> str:
    """The tables of docs/metrics.md: the metrics, then the error kinds."""
    lines = ["| metric (Prometheus) | type | unit | labels | what |", "|---|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(f"`{x}`" for x in m.tag_keys)
        lines.append(f"| `{m.exported}` | {m.kind} | {m.unit} | {labels} | {m.description} |")
    lines += ["", "| error kind | the row |", "|---|---|", *(f"| `{k}` | {v} |" for k, v in ERROR_KINDS.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
