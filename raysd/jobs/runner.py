"""`generate(GenerateConfig) -> JobSummary`: the batch job, streamed end to end.

The driver reads the input lazily, in order, batch by batch; gives each row its id
(the id column, or its position in the input); skips the rows already in the output;
and hands batches to `replicas` GenerationReplica actors, at most two batches queued
per replica, so memory stays bounded whatever the input's size. Finished rows are
written as Parquet parts, each atomically. Nothing heavy (Ray, models) starts before
the job has been checked: flags, input, columns, models, output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from raysd.jobs.config import GenerateConfig, JobError
from raysd.jobs.io import InputSource, OutputStore, RowBuffer, open_input
from raysd.jobs.schema import OVERRIDE_COLUMNS, output_schema, passthrough_fields, reserved_clashes

_QUEUE_PER_REPLICA = 2  # batches queued on each replica: one running, one waiting
_FLUSH_S = 30.0  # write buffered rows at least this often


@dataclass
class JobSummary:
    output: str
    rows: int  # rows in the output now (this run and earlier ones)
    rows_this_run: int
    rows_skipped: int  # already in the output (resumed)
    rows_failed: int  # error rows written by this run
    generated_tokens: int  # by this run
    wall_s: float
    tokens_per_s: float
    draft_acceptance_rate: float | None  # accepted / drafted, this run
    mean_acceptance_length: float | None  # 1 + accepted / steps, this run (tokens per target forward)
    overlap_efficiency: float | None  # draft/verify overlap, pooled over this run's batches
    target_model: str = ""
    draft_model: str = ""
    num_speculative_tokens: int = 0
    replicas: int = 1
    finish_reasons: dict = field(default_factory=dict)  # over the whole output

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        def f(x, spec=".3f"):
            return "n/a" if x is None else format(x, spec)

        return (
            f"raysd generate: {self.rows} rows in {self.output} ({self.rows_this_run} generated now, "
            f"{self.rows_skipped} already there, {self.rows_failed} errors); "
            f"{self.generated_tokens} tokens in {self.wall_s:.1f}s = {self.tokens_per_s:.1f} tok/s; "
            f"acceptance rate {f(self.draft_acceptance_rate)}, mean acceptance length {f(self.mean_acceptance_length)}, "
            f"overlap efficiency {f(self.overlap_efficiency, '.2f')}"
        )


def check_job(cfg: GenerateConfig) -> tuple[InputSource, OutputStore, pa.Schema]:
    """Everything that can be checked before Ray starts or a model loads. Raises JobError."""
    from raysd.jobs.config import NGRAM, NO_DRAFT
    from raysd.models.loading import check_model_exists

    source = open_input(cfg.input, cfg.split)
    names = source.schema.names
    if cfg.prompt_column not in names:
        raise JobError(f"input has no column {cfg.prompt_column!r} (columns: {', '.join(names)}); set --prompt-column")
    clashes = reserved_clashes(source.schema)
    if clashes:
        raise JobError(f"input columns {clashes} clash with output columns; rename them")
    if cfg.id_column in names:
        id_field = source.schema.field(cfg.id_column)
        if not (pa.types.is_integer(id_field.type) or pa.types.is_string(id_field.type) or pa.types.is_large_string(id_field.type)):
            raise JobError(f"id column {cfg.id_column!r} must hold integers or strings, not {id_field.type}")
    else:
        id_field = pa.field(cfg.id_column, pa.int64())  # created from the row order
    schema = output_schema(id_field, passthrough_fields(source.schema, cfg.id_column))
    for name in (cfg.target,) + ((cfg.draft,) if cfg.draft not in (NGRAM, NO_DRAFT) else ()):
        try:
            check_model_exists(name)
        except FileNotFoundError as exc:
            raise JobError(str(exc)) from None
    store = OutputStore(cfg.output)
    return source, store, schema


def _init_ray(cfg: GenerateConfig) -> bool:
    """Connect to --address, to the cluster of a submitted job, or start a local Ray. True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "configure_logging": False}
    if cfg.address or os.environ.get("RAY_ADDRESS"):
        try:
            ray.init(address=cfg.address or os.environ["RAY_ADDRESS"], **quiet)
        except Exception as exc:  # noqa: BLE001
            raise JobError(f"cannot connect to Ray at {cfg.address or os.environ['RAY_ADDRESS']!r}: {str(exc).splitlines()[0]}") from None
        return True
    # Model actors ask for whole CPUs; a small machine still runs every replica (logical resources).
    need = math_ceil(2 * cfg.replicas * cfg.num_cpus_per_actor)
    ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False, _node_ip_address="127.0.0.1", **quiet)
    return True


def math_ceil(x: float) -> int:
    import math

    return int(math.ceil(x))


class _Progress:
    def __init__(self, total: int | None, quiet: bool):
        self.bar = None
        self.start = time.perf_counter()
        self.tokens = self.drafted = self.accepted = 0
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="row", desc="raysd generate", file=sys.stderr, dynamic_ncols=True)

    def update(self, outputs: list[dict]) -> None:
        for out in outputs:
            self.tokens += out["num_generated_tokens"]
            self.drafted += out["num_draft_tokens"]
            self.accepted += out["num_accepted_draft_tokens"]
        if self.bar is not None:
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            rate = f"{self.accepted / self.drafted:.2f}" if self.drafted else "n/a"
            self.bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s, acceptance {rate}", refresh=False)
            self.bar.update(len(outputs))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _passthrough_value(value, json_column: bool):
    if json_column and value is not None and not isinstance(value, str):
        return json.dumps(value)
    return value


def generate(cfg: GenerateConfig) -> JobSummary:
    """Run a generation job; returns its summary (also written to `<output>/_summary.json`)."""
    import ray

    source, store, schema = check_job(cfg)
    job = {"fingerprint": cfg.fingerprint(), "config": cfg.to_dict(), "schema": schema.to_string(show_schema_metadata=False)}
    store.prepare(job, cfg.overwrite)  # checks a resumed output belongs to the same job
    done = store.done_ids(cfg.id_column)
    started = time.perf_counter()

    passthrough = [f.name for f in schema if f.name != cfg.id_column and f.name not in _generated_names()]
    json_cols = source.json_columns
    overrides = [c for c in OVERRIDE_COLUMNS if c in source.schema.names]
    total = None if source.num_rows is None else max(source.num_rows - len(done), 0)
    progress = _Progress(total, cfg.quiet)

    we_started_ray = False
    replicas: list = []
    queued: list[int] = []
    pending: dict = {}  # ObjectRef -> (replica index, input rows)
    buffer = RowBuffer.empty()
    counts = {"rows": 0, "skipped": 0, "failed": 0, "tokens": 0, "drafted": 0, "accepted": 0, "steps": 0,
              "draft_busy": 0.0, "target_busy": 0.0, "wall": 0.0}
    seen: set = set()

    def start_replicas():
        nonlocal we_started_ray
        from raysd.jobs.replica import GenerationReplica

        we_started_ray = _init_ray(cfg)
        actor = ray.remote(GenerationReplica).options(num_cpus=0, max_restarts=0)
        for r in range(cfg.replicas):
            replicas.append(actor.remote(cfg, r))
            queued.append(0)
        ray.get([a.ready.remote() for a in replicas])  # model load errors surface here

    def flush(force: bool = False):
        nonlocal buffer
        if buffer.rows and (force or len(buffer.rows) >= cfg.rows_per_file or time.monotonic() - buffer.since > _FLUSH_S):
            store.write_part(pa.Table.from_pylist(buffer.rows, schema=schema))
            buffer = RowBuffer.empty()

    def collect(ref):
        r, inputs = pending.pop(ref)
        queued[r] -= 1
        outputs, report = ray.get(ref)
        for row, out in zip(inputs, outputs):
            record = {cfg.id_column: row["__id"]}
            for name in passthrough:
                record[name] = _passthrough_value(row["__row"].get(name), name in json_cols)
            record.update(out)
            buffer.rows.append(record)
            counts["rows"] += 1
            counts["failed"] += out["finish_reason"] == "error"
            counts["tokens"] += out["num_generated_tokens"]
            counts["drafted"] += out["num_draft_tokens"]
            counts["accepted"] += out["num_accepted_draft_tokens"]
            counts["steps"] += out["num_spec_steps"]
        for k in ("draft_busy", "target_busy", "wall"):
            counts[k] += report[f"{k}_s"]
        progress.update(outputs)
        flush()

    def submit(batch: list[dict]):
        if not replicas:
            start_replicas()
        while min(queued) >= _QUEUE_PER_REPLICA:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            collect(ref)
        r = min(range(len(replicas)), key=queued.__getitem__)
        payload = [{"id": row["__id"], "prompt": row["__row"].get(cfg.prompt_column),
                    **{c: row["__row"].get(c) for c in overrides}} for row in batch]
        ref = replicas[r].generate.remote(payload)
        queued[r] += 1
        pending[ref] = (r, batch)

    def error_record(row_id, row, message):
        from raysd.jobs.replica import row_seed

        stats_k = cfg.effective_num_speculative_tokens
        record = {cfg.id_column: row_id}
        for name in passthrough:
            record[name] = _passthrough_value(row.get(name), name in json_cols)
        record.update(generated_text=None, generated_token_ids=[], num_prompt_tokens=0, num_generated_tokens=0,
                      finish_reason="error", error=message, num_spec_steps=0, num_draft_tokens=0,
                      num_accepted_draft_tokens=0, draft_acceptance_rate=None, mean_acceptance_length=None,
                      acceptance_histogram=[0] * (stats_k + 1), accepted_per_position=[0] * stats_k, alpha_estimate=None,
                      target_model=cfg.target, draft_model=cfg.draft, num_speculative_tokens=stats_k,
                      seed=row_seed(cfg.seed, row_id), latency_s=0.0)
        return record

    try:
        position = 0
        pending_batch: list[dict] = []
        for rows in source.batches(cfg.batch_size):
            for row in rows:
                row_id = row.get(cfg.id_column) if cfg.id_column in source.schema.names else position
                position += 1
                if row_id in done:
                    counts["skipped"] += 1
                    continue
                if row_id is None or row_id in seen:
                    # Cannot be generated under its id: an error row, so the counts still match.
                    message = "id is null" if row_id is None else f"duplicate id {row_id!r}"
                    buffer.rows.append(error_record(row_id, row, message))
                    counts["rows"] += 1
                    counts["failed"] += 1
                    if progress.bar is not None:
                        progress.bar.update(1)
                    continue
                seen.add(row_id)
                pending_batch.append({"__id": row_id, "__row": row})
                if len(pending_batch) >= cfg.batch_size:
                    submit(pending_batch)
                    pending_batch = []
            # Collect whatever finished meanwhile, without waiting.
            if pending:
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
                for ref in ready:
                    collect(ref)
        if pending_batch:
            submit(pending_batch)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            collect(ref)
        flush(force=True)
    except BaseException:
        # Rows already finished are kept (a re-run resumes after them).
        try:
            flush(force=True)
        except Exception:  # noqa: BLE001
            pass
        raise
    finally:
        progress.close()
        for actor in replicas:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        if we_started_ray:
            ray.shutdown()

    wall = time.perf_counter() - started
    shorter = min(counts["draft_busy"], counts["target_busy"])
    overlap = (counts["draft_busy"] + counts["target_busy"] - counts["wall"]) / shorter if shorter > 0 else None
    final = store.read_columns([cfg.id_column, "finish_reason"])
    reasons = {}
    if final is not None:
        for reason in final.column("finish_reason").to_pylist():
            reasons[reason] = reasons.get(reason, 0) + 1
    summary = JobSummary(
        output=cfg.output,
        rows=0 if final is None else final.num_rows,
        rows_this_run=counts["rows"],
        rows_skipped=counts["skipped"],
        rows_failed=counts["failed"],
        generated_tokens=counts["tokens"],
        wall_s=wall,
        tokens_per_s=counts["tokens"] / wall if wall > 0 else 0.0,
        draft_acceptance_rate=counts["accepted"] / counts["drafted"] if counts["drafted"] else None,
        mean_acceptance_length=1 + counts["accepted"] / counts["steps"] if counts["steps"] else None,
        overlap_efficiency=overlap,
        target_model=cfg.target,
        draft_model=cfg.draft,
        num_speculative_tokens=cfg.effective_num_speculative_tokens,
        replicas=cfg.replicas,
        finish_reasons=reasons,
    )
    store.write_summary(summary.to_dict())
    return summary


def _generated_names():
    from raysd.jobs.schema import GENERATED_NAMES

    return GENERATED_NAMES
