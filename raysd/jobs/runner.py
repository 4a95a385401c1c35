"""`generate(GenerateConfig) -> JobSummary`: the batch job, as a Ray Data pipeline.

Nothing heavy (Ray, models) starts before the job has been checked (`check_job`):
flags, input, columns, models, output. Then the output's ids are read (ids only) and
the pipeline runs, streaming end to end (raysd.jobs.pipeline):

    read -> AssignIds (1 actor, in order) -> GenerateReplica (--replicas actors) -> PartsSink

Ray Data's streaming executor bounds what is in flight at each stage, so memory does
not grow with the input.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from raysd.jobs.config import GenerateConfig, JobError
from raysd.jobs.io import IO_TASK_CPUS, InputSource, OutputStore, in_process, open_input
from raysd.jobs.schema import output_schema, passthrough_fields, reserved_clashes

_PROGRESS_EVERY_S = 10.0


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
    # Draft trees (--tree-budget P > 0), pooled over this run's rows as the Parquet columns of the
    # same names; null for a chain job.
    mean_nodes_verified: float | None = None  # drafted / steps: tree nodes the target verified per step
    mean_accepted_depth: float | None = None  # accepted / steps: depth of the accepted path per step
    num_branch_accepts: int | None = None  # accepted nodes that were not a rank-0 child, summed
    tree_budget: int = 0  # P (0: a chain)
    target_model: str = ""
    draft_model: str = ""
    num_speculative_tokens: int = 0
    replicas: int = 1
    finish_reasons: dict = field(default_factory=dict)  # over the whole output
    occupancy: float | None = None  # mean rows in the replicas' micro-batches per step / their slots
    time_breakdown: dict = field(default_factory=dict)  # seconds per stage, summed (raysd.jobs.pipeline.time_breakdown)
    # The job's stats actor died (restarted empty, or unreachable at the end): rows_skipped,
    # overlap_efficiency, occupancy and time_breakdown then cover only part of the run. The rows
    # and tokens come from the parts written, so they are exact regardless.
    stats_partial: bool = False

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
            f"overlap efficiency {f(self.overlap_efficiency, '.2f')}, occupancy {f(self.occupancy, '.2f')}"
            + (f"; tree P={self.tree_budget}: nodes verified/step {f(self.mean_nodes_verified, '.2f')}, "
               f"accepted depth/step {f(self.mean_accepted_depth)}, branch accepts {self.num_branch_accepts}"
               if self.tree_budget else "")
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
            check_model_exists(name, cfg.allow_pickle_weights)
        except (FileNotFoundError, ValueError) as exc:  # missing, or pickled weights not allowed
            raise JobError(str(exc)) from None
    store = OutputStore(cfg.output)
    return source, store, schema


def _init_ray(cfg: GenerateConfig) -> bool:
    """Connect to --address, to the cluster of a submitted job, or start a local Ray. True if we started it."""
    import ray

    from raysd.actors.local import LocalRayNotLoopback, start_local_ray

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
    # One logical CPU more than the model actors' placement groups can take, as a margin for Ray
    # Data's own tasks. (The streaming repartition, whose tasks once asked for a CPU each and hung
    # a resumed run behind the groups, now asks for none: raysd.jobs.pipeline._repartition_needs_no_cpu.)
    need = int(math.ceil(cfg.replicas * sum(cfg.actor_cpus)))
    try:
        start_local_ray(num_cpus=max(os.cpu_count() or 1, need) + 1, **quiet)
    except LocalRayNotLoopback as exc:
        raise JobError(str(exc)) from None
    return True


@contextlib.contextmanager
def _data_context(quiet: bool):
    """The job's Ray Data settings, restored afterwards (tests run several jobs in one process)."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    data_logger = logging.getLogger("ray.data")
    level = data_logger.level
    ctx.execution_options.preserve_order = True  # blocks reach each stage in input order (ids, parts)
    ctx.enable_progress_bars = not quiet
    if quiet:
        data_logger.setLevel(logging.WARNING)
    try:
        yield ctx
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        data_logger.setLevel(level)


def progress_text(t: dict, elapsed: float) -> str:
    """The progress line for JobStats totals `t`, `elapsed` seconds into the job. Until the first
    row is generated, written or found already there, the job is starting (the replicas load
    their models when the first batch reaches them) and the line says so rather than 0 tok/s."""
    if not any(t.get(k) for k in ("rows_generated", "rows_written", "rows_skipped")):
        read = int(t.get("rows_read", 0))
        return (f"raysd generate: starting ({elapsed:.0f}s): Ray is up; loading the models, generating the "
                f"first batch{f' ({read} rows read)' if read else ''}")
    rate = f"{t['accepted'] / t['drafted']:.3f}" if t.get("drafted") else "n/a"
    return (f"raysd generate: {int(t.get('rows_generated', 0))} rows generated, {int(t.get('rows_written', 0))} written, "
            f"{int(t.get('rows_skipped', 0))} already there; {t.get('tokens', 0) / max(elapsed, 1e-9):.1f} tok/s, "
            f"acceptance {rate}" + _breakdown_text(t))


def _breakdown_text(t: dict) -> str:
    from raysd.jobs.pipeline import breakdown_text  # occupancy and seconds per stage, once a step ran

    return breakdown_text(t)


class _Progress:
    """One line on stderr at once, then every few seconds: rows generated and written, tokens/s, acceptance."""

    def __init__(self, stats, started: float, quiet: bool):
        self.stats, self.started = stats, started
        self.stop = threading.Event()
        self.thread = None
        if not quiet:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def line(self) -> str:
        import ray

        return progress_text(ray.get(self.stats.get.remote(), timeout=30), time.perf_counter() - self.started)

    def _run(self) -> None:
        while True:  # one line at once (Ray is up by now), then one every _PROGRESS_EVERY_S
            try:
                print(self.line(), file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - progress is best effort
                pass
            if self.stop.wait(_PROGRESS_EVERY_S):
                return

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)


def generate(cfg: GenerateConfig) -> JobSummary:
    """Run a generation job; returns its summary (also written to `<output>/_summary.json`)."""
    source, store, schema = check_job(cfg)
    job = {"fingerprint": cfg.fingerprint(), "config": cfg.to_dict(), "schema": schema.to_string(show_schema_metadata=False)}
    store.prepare(job, cfg.overwrite)  # checks a resumed output belongs to the same job
    done = store.done_ids(cfg.id_column)  # the output's id column only
    started = time.perf_counter()

    import ray

    from raysd.jobs.pipeline import PartsSink, build_dataset, start_job_stats, write_on_driver

    if not cfg.quiet:
        print("raysd generate: starting Ray", file=sys.stderr, flush=True)  # the models load after it
    # `--num-cpus-per-actor auto`: the machine's cores when raysd starts the Ray here, else 1 per actor.
    starts_local = not (ray.is_initialized() or cfg.address or os.environ.get("RAY_ADDRESS"))
    cfg = cfg.resolve_actor_cpus(os.cpu_count() if starts_local else None)
    we_started_ray = _init_ray(cfg)
    stats = progress = job_key = None
    result: dict = {}
    try:
        stats = start_job_stats()  # on the driver's node: no worker node's loss takes it (issue 22)
        job_key = uuid.uuid4().hex  # names the job's records in the GCS (pipeline.release_job)
        sink = PartsSink(cfg.output, schema, cfg.rows_per_file, local=store.local, stats=stats)

        def finish(totals: dict) -> None:  # PartsSink.on_write_complete, on the driver
            result["summary"] = _summary(cfg, store, totals, live_totals(stats), time.perf_counter() - started)
            store.write_summary(result["summary"].to_dict())

        sink.finish = finish
        progress = _Progress(stats, started, cfg.quiet)
        with _data_context(cfg.quiet):
            ds = build_dataset(source, cfg, schema, done, stats, job_key)
            if in_process(store.fs):
                write_on_driver(ds, sink)  # Ray workers cannot see memory://
            else:
                ds.write_datasink(sink, ray_remote_args={"num_cpus": IO_TASK_CPUS})
    finally:
        if progress is not None:
            progress.close()
        _release(stats, job_key)
        if we_started_ray:
            ray.shutdown()
    return result["summary"]


def live_totals(stats) -> dict:
    """JobStats' totals for the summary; {} (counts unknown) if the actor cannot answer. The rows
    and tokens of the summary come from the parts' write results, not from here."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        return ray.get(stats.get.remote(), timeout=60)
    except (RayActorError, GetTimeoutError):  # ActorUnavailableError included
        return {"stats_lost": 1}


def _release(stats, job_key: str | None) -> None:
    """End of job: the stats actor and the job's records in the GCS. Best effort: the job's outcome
    is decided."""
    import ray

    from raysd.jobs.pipeline import release_job

    for step in (lambda: stats is not None and ray.kill(stats), lambda: job_key is not None and release_job(job_key)):
        try:
            step()
        except Exception:  # noqa: BLE001 - e.g. the actor is gone already
            pass


def _tree_summary(cfg: GenerateConfig, totals: dict) -> dict:
    """The tree statistics of the summary, pooled over this run's rows like `mean_acceptance_length`
    (from the parts' write results); null for a chain job."""
    if not cfg.tree_budget:
        return {}
    steps = totals["steps"]
    return {"tree_budget": cfg.tree_budget,
            "mean_nodes_verified": totals["drafted"] / steps if steps else None,
            "mean_accepted_depth": totals["accepted"] / steps if steps else None,
            "num_branch_accepts": totals.get("branch_accepts", 0)}


def _summary(cfg: GenerateConfig, store: OutputStore, totals: dict, live: dict, wall: float) -> JobSummary:
    from raysd.jobs.pipeline import occupancy, time_breakdown

    shorter = min(live.get("draft_busy_s", 0.0), live.get("target_busy_s", 0.0))
    # Only a draft model has work to overlap (a model-free drafter runs in one micro-batch).
    overlap = (live["draft_busy_s"] + live["target_busy_s"] - live["wall_s"]) / shorter if shorter > 0 and cfg.draft_is_model else None
    rows, reasons = store.value_counts("finish_reason")
    return JobSummary(
        output=cfg.output,
        rows=rows,
        rows_this_run=totals["rows"],
        rows_skipped=int(live.get("rows_skipped", 0)),
        rows_failed=totals["failed"],
        generated_tokens=totals["tokens"],
        wall_s=wall,
        tokens_per_s=totals["tokens"] / wall if wall > 0 else 0.0,
        draft_acceptance_rate=totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        mean_acceptance_length=1 + totals["accepted"] / totals["steps"] if totals["steps"] else None,
        overlap_efficiency=overlap,
        **_tree_summary(cfg, totals),
        target_model=cfg.target,
        draft_model=cfg.draft,
        num_speculative_tokens=cfg.effective_num_speculative_tokens,
        replicas=cfg.replicas,
        finish_reasons=reasons,
        occupancy=occupancy(live),
        time_breakdown=time_breakdown(live),
        stats_partial=bool(live.get("stats_restarted") or live.get("stats_lost")),
    )
