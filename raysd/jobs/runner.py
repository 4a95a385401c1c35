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
import dataclasses
import logging
import math
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from raysd.jobs.config import GenerateConfig, JobError, one_line
from raysd.jobs.io import IO_TASK_CPUS, InputSource, OutputStore, in_process, input_identity, open_input
from raysd.jobs.schema import output_schema, passthrough_fields, reserved_clashes

_PROGRESS_EVERY_S = 10.0  # a progress line when stderr is not a terminal (a log, `ray job submit`)
_TTY_EVERY_S = 1.0  # the progress line rewritten on a terminal


def pooled(totals: dict, tree_budget: int, beam_width: int = 0) -> dict:
    """Acceptance statistics pooled over rows, from `raysd.jobs.schema.row_totals` counts: the
    acceptance rate (accepted / drafted), the mean acceptance length (1 + accepted / steps) and,
    for a tree job (--tree-budget P > 0), the tree statistics named as their Parquet columns. A
    beam job (--beam-width W) counts in the same terms (SpecDecodeStats): its mean acceptance length
    is the levels per target pass, and `beam_node_selection_rate` the drafted nodes that lay on a
    selected beam / drafted nodes (each of a prompt's rows carries its search's counts: the ratios
    weigh every prompt alike)."""
    drafted, accepted, steps = totals["drafted"], totals["accepted"], totals["steps"]
    out = {"draft_acceptance_rate": accepted / drafted if drafted else None,
           "mean_acceptance_length": 1 + accepted / steps if steps else None,
           "mean_nodes_verified": None, "mean_accepted_depth": None, "num_branch_accepts": None,
           "beam_node_selection_rate": None}
    if beam_width and drafted:
        out["beam_node_selection_rate"] = totals.get("beam_nodes_selected", 0) / drafted
    if tree_budget:
        out.update(mean_nodes_verified=drafted / steps if steps else None,
                   mean_accepted_depth=accepted / steps if steps else None,
                   num_branch_accepts=totals.get("branch_accepts", 0))
    return out


@dataclass
class RunSummary:
    """One run's own figures: `JobSummary.latest_run`."""

    rows: int  # rows this run wrote
    rows_skipped: int  # already in the output when it started (resumed)
    rows_failed: int  # error rows this run wrote
    generated_tokens: int
    wall_s: float  # the whole run: the phases of time_breakdown["wall"] add up to it
    tokens_per_s: float
    draft_acceptance_rate: float | None  # accepted / drafted, over this run's rows
    mean_acceptance_length: float | None  # 1 + accepted / steps (tokens per target forward)
    overlap_efficiency: float | None  # draft/verify overlap, pooled over this run's batches
    # Draft trees (--tree-budget P > 0), pooled like the two above; null for a chain job.
    mean_nodes_verified: float | None = None  # drafted / steps: tree nodes the target verified per step
    mean_accepted_depth: float | None = None  # accepted / steps: depth of the accepted path per step
    num_branch_accepts: int | None = None  # accepted nodes that were not a rank-0 child, summed
    # Beam jobs (--beam-width W): drafted tree nodes on a selected beam / drafted nodes; null otherwise.
    beam_node_selection_rate: float | None = None
    replicas: int = 1
    occupancy: float | None = None  # mean rows in the replicas' micro-batches per step / their slots
    # "wall": the run's wall time as consecutive phases on the driver's clock, which add up to
    # wall_s (process, check, ray_start, pipeline_start, generating, pipeline_end, shutdown,
    # summary; `WallClock`); the rest: seconds per stage, summed over blocks and replicas
    # (overlapping; raysd.jobs.pipeline.time_breakdown).
    time_breakdown: dict = field(default_factory=dict)
    # --draft suffix: the drafts (tree nodes) proposed and accepted by source, over this run's rows:
    # drafted_self, drafted_other, accepted_self, accepted_other (the row's own tokens, or other rows').
    draft_sources: dict | None = None
    # The job's stats actor died (restarted empty, or unreachable at the end): rows_skipped,
    # overlap_efficiency, occupancy and time_breakdown then cover only part of the run. The rows
    # and tokens come from the parts written, so they are exact regardless.
    stats_partial: bool = False
    # Times a replica re-ran its rows in flight after a model actor died (each row written once).
    recoveries: int = 0
    # Replicas that retired because their model actors could not be placed (`notes` says why); their
    # rows were generated by another pass on the replicas left (`passes` in all).
    replicas_retired: int = 0
    passes: int = 1
    notes: list = field(default_factory=list)


@dataclass
class JobSummary:
    """The whole output (`_summary.json`): the rows on disk and their statistics, over every run
    that wrote them (a killed run's parts included), counted from the parts; `latest_run`: the
    run that wrote this summary."""

    output: str
    rows: int  # rows in the output
    rows_failed: int  # error rows in the output
    generated_tokens: int  # over the output's rows
    draft_acceptance_rate: float | None  # accepted / drafted, pooled over the output's rows
    mean_acceptance_length: float | None  # 1 + accepted / steps, pooled
    latest_run: RunSummary
    mean_nodes_verified: float | None = None  # tree jobs, pooled over the output's rows (see RunSummary)
    mean_accepted_depth: float | None = None
    num_branch_accepts: int | None = None
    beam_node_selection_rate: float | None = None  # beam jobs (see RunSummary)
    tree_budget: int = 0  # P (0: a chain)
    target_model: str = ""
    draft_model: str = ""
    num_speculative_tokens: int = 0
    finish_reasons: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        def f(x, spec=".3f"):
            return "n/a" if x is None else format(x, spec)

        run = self.latest_run
        tree = (f"; tree P={self.tree_budget}: nodes verified/step {f(run.mean_nodes_verified, '.2f')}, "
                f"accepted depth/step {f(run.mean_accepted_depth)}, branch accepts {run.num_branch_accepts}"
                if self.tree_budget else "")
        retired = (f"; {run.replicas_retired} of {run.replicas} replicas retired ({run.notes[0]}), their rows "
                   f"generated by the others" if run.replicas_retired else "")
        return (
            f"raysd generate: {self.rows} rows in {self.output} ({run.rows} generated now, {run.rows_skipped} already "
            f"there; {self.rows_failed} errors in all, {run.rows_failed} now); this run: {run.generated_tokens} tokens "
            f"in {run.wall_s:.1f}s = {run.tokens_per_s:.1f} tok/s, acceptance rate {f(run.draft_acceptance_rate)}, "
            f"mean acceptance length {f(run.mean_acceptance_length)}, overlap efficiency "
            f"{f(run.overlap_efficiency, '.2f')}, occupancy {f(run.occupancy, '.2f')}{tree}{retired}; whole output: "
            f"{self.generated_tokens} tokens, acceptance rate {f(self.draft_acceptance_rate)}, mean acceptance "
            f"length {f(self.mean_acceptance_length)}"
        )


@dataclass(frozen=True)
class CheckedJob:
    """A job that passed `check_job`: its input, output, output schema and `_job.json` record
    (the fingerprint, the config, the schema and the input's identity)."""

    source: InputSource
    store: OutputStore
    schema: pa.Schema
    record: dict
    resume: bool  # the output holds an earlier run of this job


def check_job(cfg: GenerateConfig) -> CheckedJob:
    """Everything that can be checked before Ray starts or a model loads. Raises JobError. Writes
    nothing: the input, its columns, the models, where the output is, whether it is raysd's, and
    for a resume whether it was started by this job from this input (which reads every row of
    the input once, unless its files are as the output recorded them)."""
    from raysd.models.names import MODEL_FREE
    from raysd.models.loading import check_model_exists

    source = open_input(cfg.input, cfg.split)
    names = source.schema.names
    if cfg.prompt_column not in names:
        raise JobError(f"input has no column {cfg.prompt_column!r} (columns: {', '.join(names)}); set --prompt-column")
    if cfg.beam_width and "num_samples" in names:
        raise JobError("--beam-width returns --num-return-sequences rows per prompt: the input's num_samples column "
                       "does not apply to beam search; drop or rename it")
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
    for name in (cfg.target,) + ((cfg.draft,) if cfg.draft not in MODEL_FREE else ()):
        try:
            check_model_exists(name, cfg.allow_pickle_weights)
        except (FileNotFoundError, ValueError) as exc:  # missing, or pickled weights not allowed
            raise JobError(str(exc)) from None
    if cfg.target_tensor_parallel > 1:  # from the target's config alone: before any weights load
        from raysd.models.loading import load_config
        from raysd.models.tensor_parallel import check_tensor_parallel

        try:
            check_tensor_parallel(load_config(cfg.target, cfg.trust_remote_code), cfg.target_tensor_parallel)
        except ValueError as exc:
            raise JobError(f"--target-tensor-parallel: {exc}") from None
    store = OutputStore(cfg.output)
    previous = store.check(source, cfg.overwrite)  # None: a new output, or --overwrite
    record = {"fingerprint": cfg.fingerprint(), "config": cfg.to_dict(),
              "schema": schema.to_string(show_schema_metadata=False),
              "input": input_identity(source, cfg.id_column, (previous or {}).get("input"))}
    if previous is not None:
        store.check_resume(previous, record)
    return CheckedJob(source, store, schema, record, resume=previous is not None)


def _init_ray(cfg: GenerateConfig, gpus: dict) -> bool:
    """Connect to --address, to the cluster of a submitted job, or start a local Ray (with `gpus`,
    `_local_gpus`). True if this job connected or started it (and so shuts it down)."""
    import ray

    from raysd.actors.local import LocalRayNotLoopback, start_local_ray

    if ray.is_initialized():
        return False
    # The workers' own output (model loading bars, warnings) reaches this driver only with --verbose.
    quiet = {"log_to_driver": cfg.verbose, "configure_logging": False}
    if cfg.address or os.environ.get("RAY_ADDRESS"):
        try:
            with _ray_logger_quiet(not cfg.verbose):
                ray.init(address=cfg.address or os.environ["RAY_ADDRESS"], **quiet)
        except Exception as exc:  # noqa: BLE001
            raise JobError(f"cannot connect to Ray at {cfg.address or os.environ['RAY_ADDRESS']!r}: {one_line(exc)}") from None
        return True
    # Model actors ask for whole CPUs; a small machine still runs every replica (logical resources).
    # One logical CPU more than the model actors' placement groups can take, as a margin for Ray
    # Data's own tasks. (The streaming repartition, whose tasks once asked for a CPU each and hung
    # a resumed run behind the groups, now asks for none: raysd.jobs.pipeline._repartition_needs_no_cpu.)
    need = int(math.ceil(cfg.replicas * cfg.replica_cpus))
    try:
        with _ray_logger_quiet(not cfg.verbose):
            start_local_ray(num_cpus=max(os.cpu_count() or 1, need) + 1, **gpus, **quiet)
    except LocalRayNotLoopback as exc:
        raise JobError(str(exc)) from None
    return True


def _local_gpus(cfg: GenerateConfig) -> dict:
    """The GPUs of a Ray this job starts here: the ones torch sees, named to Ray (its own detection
    may differ), or a one-line error before Ray starts if one replica needs more: its actors would
    otherwise wait for resources that never come, until the placement times out."""
    if not cfg.num_gpus_per_actor:
        return {}
    import torch

    have = torch.cuda.device_count()
    actors = cfg.target_tensor_parallel + (1 if cfg.draft_is_model else 0)
    need = cfg.num_gpus_per_actor * actors
    if need > have:
        raise JobError(f"--num-gpus-per-actor {cfg.num_gpus_per_actor:g} asks {need:g} GPUs for one replica's {actors} "
                       f"model actor(s); this machine has {have} (torch.cuda.device_count())")
    return {"num_gpus": have}


@contextlib.contextmanager
def _ray_logger_quiet(quiet: bool):
    """Ray's Python warnings while it starts (e.g. "Token authentication is enabled for this Ray
    cluster"), shown with --verbose only: a job's output is raysd's lines."""
    ray_logger = logging.getLogger("ray")
    level = ray_logger.level
    if quiet:
        ray_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ray_logger.setLevel(level)


# Ray Data's console messages per output mode: --verbose all of them (the execution plan, the
# operator table), the default its warnings and errors, --quiet none (raysd prints a failure itself).
_DATA_CONSOLE_LEVEL = {"verbose": None, "default": logging.WARNING, "quiet": logging.CRITICAL + 1}


def _no_errors(record: logging.LogRecord) -> bool:
    """Ray Data's console without its errors: a failed stage's traceback, which raysd reports in one
    line naming the file that holds the whole of it (raysd.jobs.cli)."""
    return record.levelno < logging.ERROR


@contextlib.contextmanager
def _data_context(quiet: bool, verbose: bool = False):
    """The job's Ray Data settings, restored afterwards (tests run several jobs in one process):
    blocks in input order; a stage's exception raised as itself; Ray Data's own progress (a table
    of its operators every few seconds when stderr is not a terminal, progress bars when it is)
    only with --verbose (raysd prints its own line, `_Progress`), and its console messages as
    _DATA_CONSOLE_LEVEL says, its errors only with --verbose. Its log file (ray-data.log in the
    session's logs) keeps everything."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.raise_original_map_exception)
    ctx.execution_options.preserve_order = True  # blocks reach each stage in input order (ids, parts)
    ctx.enable_progress_bars = verbose
    # A stage's own exception reaches the driver as its cause (not wrapped in a UserCodeException
    # whose message is Ray Data's retry advice): the CLI's one-line error names it (raysd.jobs.cli).
    ctx.raise_original_map_exception = True
    level = _DATA_CONSOLE_LEVEL["quiet" if quiet else "verbose" if verbose else "default"]
    consoles = [h for h in logging.getLogger("ray.data").handlers if h.name == "console"]  # ray.data's logging config
    console_levels = [h.level for h in consoles]
    # Its "Progress bars disabled. To enable, ..." warning, for the progress it was told to leave off.
    progress_logger = logging.getLogger("ray.data._internal.progress")
    progress_level = progress_logger.level
    if level is not None:
        for h in consoles:
            h.setLevel(level)
            h.addFilter(_no_errors)
        progress_logger.setLevel(logging.ERROR)
    try:
        yield ctx
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.raise_original_map_exception = saved
        for h, old in zip(consoles, console_levels):
            h.setLevel(old)
            h.removeFilter(_no_errors)
        progress_logger.setLevel(progress_level)


def progress_text(t: dict, elapsed: float, eta_s: float | None = None) -> str:
    """The progress line for JobStats totals `t`, `elapsed` seconds into the job, `eta_s` the
    estimated seconds left (None: not known yet). Until the first row is generated, written or
    found already there, the job is starting (the replicas load their models when the first
    batch reaches them) and the line says so rather than 0 tok/s."""
    if not any(t.get(k) for k in ("rows_generated", "rows_written", "rows_skipped")):
        read = int(t.get("rows_read", 0))
        return (f"raysd generate: starting ({elapsed:.0f}s): Ray is up; loading the models, generating the "
                f"first batch{f' ({read} rows read)' if read else ''}")
    rate = f"{t['accepted'] / t['drafted']:.3f}" if t.get("drafted") else "n/a"
    eta = "" if eta_s is None else f"; ETA {_duration(eta_s)}"
    return (f"raysd generate: {int(t.get('rows_generated', 0))} rows generated, {int(t.get('rows_written', 0))} written, "
            f"{int(t.get('rows_skipped', 0))} already there; {t.get('tokens', 0) / max(elapsed, 1e-9):.1f} tok/s, "
            f"acceptance {rate}" + eta + _breakdown_text(t))


def short_progress_text(t: dict, elapsed: float, todo: int | None, eta_s: float | None) -> str:
    """The line a terminal shows, rewritten in place: rows done (of `todo`, this run's output rows,
    when known), tokens/s, acceptance, ETA."""
    if not any(t.get(k) for k in ("rows_generated", "rows_written", "rows_skipped")):
        return progress_text(t, elapsed)
    done = int(t.get("rows_generated", 0))
    rate = f"{t['accepted'] / t['drafted']:.3f}" if t.get("drafted") else "n/a"
    return (f"raysd generate: {done}{'' if todo is None else f'/{todo}'} rows, "
            f"{t.get('tokens', 0) / max(elapsed, 1e-9):.1f} tok/s, acceptance {rate}, "
            f"ETA {'n/a' if eta_s is None else _duration(eta_s)}")


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _breakdown_text(t: dict) -> str:
    from raysd.jobs.pipeline import breakdown_text  # occupancy and seconds per stage, once a step ran

    return breakdown_text(t)


class _Progress:
    """raysd's progress on stderr (none with --quiet). On a terminal: one line rewritten in place
    (carriage return) every _TTY_EVERY_S: rows done, tokens/s, acceptance, ETA. Otherwise (a file, a
    pipe, a job under `ray job submit`): a new full line at once, then every _PROGRESS_EVERY_S. With
    --verbose Ray Data draws its own progress on the terminal too, so raysd writes plain lines.

    `todo`: the output rows this run has to generate (the input's rows x --num-samples, less those
    already in the output; None when a `num_samples` column makes it unknown): the ETA's basis,
    at the rate rows have been generated since the first one."""

    def __init__(self, stats, started: float, quiet: bool, todo: int | None = None, stream=None,
                 verbose: bool = False):
        self.stats, self.started, self.todo = stats, started, todo
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) and not verbose
        self.stop = threading.Event()
        self.thread = None
        self._drawn = False  # a terminal line is showing (close() ends it)
        if not quiet:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def totals(self) -> dict:
        import ray

        return ray.get(self.stats.get.remote(), timeout=30)

    def _eta(self, t: dict) -> float | None:
        """Seconds left at the rate rows have been generated since the first one finished."""
        done, first = t.get("rows_generated", 0), t.get("first_row_at")
        since = time.time() - first if first is not None else 0.0
        if self.todo is None or not done or since < 1.0:
            return None
        return max(0.0, self.todo - done) / (done / since)

    def line(self) -> str:
        t = self.totals()
        elapsed, eta = time.perf_counter() - self.started, self._eta(t)
        if self.tty:
            return short_progress_text(t, elapsed, self.todo, eta)
        return progress_text(t, elapsed, eta)

    def _run(self) -> None:
        every = _TTY_EVERY_S if self.tty else _PROGRESS_EVERY_S
        while True:  # one line at once (Ray is up by now), then one every `every`
            try:
                self._write(self.line())
            except Exception:  # noqa: BLE001 - progress is best effort
                pass
            if self.stop.wait(every):
                return

    def _write(self, line: str) -> None:
        if self.tty:  # rewrite the line in place, cut to the terminal's width (a wrapped line cannot be)
            width = shutil.get_terminal_size((120, 24)).columns
            self.stream.write("\r" + line[: max(20, width - 1)] + "\x1b[K")
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        if self._drawn:  # end the terminal's line, so what follows starts on its own
            self.stream.write("\n")
            self.stream.flush()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class WallClock:
    """A run's wall time on the driver's clock, as consecutive phases: each `mark(name)` closes the
    phase that ran since the previous mark, so the phases add up to the wall, nothing left out."""

    def __init__(self, start: float | None = None):
        self.start = self.last = time.time() if start is None else start
        self.phases: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        at = time.time() if at is None else min(max(at, self.last), time.time())
        self.phases[name] = round(self.phases.get(name, 0.0) + at - self.last, 3)
        self.last = at

    @property
    def total(self) -> float:
        return self.last - self.start


def process_start_time() -> float | None:
    """When this process started (wall clock), from /proc on Linux; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def generate(cfg: GenerateConfig, started_at: float | None = None) -> JobSummary:
    """Run a generation job; returns its summary (also written to `<output>/_summary.json`).

    `started_at` (wall clock): when the run began, if before this call (the CLI passes its
    process's start, so that interpreter start and imports count as the phase `process`)."""
    clock = WallClock(started_at)
    if started_at is not None:
        clock.mark("process")
    job = check_job(cfg)
    cfg = _with_eos_ids(cfg)
    source, store, schema = job.source, job.store, job.schema

    import ray

    starts_local = not (ray.is_initialized() or cfg.address or os.environ.get("RAY_ADDRESS"))
    gpus = _local_gpus(cfg) if starts_local else {}  # before anything is written
    store.prepare(job.record, cfg.overwrite)  # --overwrite deletes only what raysd wrote there
    done = store.done_samples(cfg.id_column)  # the output's id and sample_index columns only
    clock.mark("check")
    started = time.perf_counter()

    from raysd.jobs.metrics import job_tags
    from raysd.jobs.pipeline import PartsSink, build_dataset, start_job_stats, write_on_driver

    if not cfg.quiet:
        print("raysd generate: starting Ray", file=sys.stderr, flush=True)  # the models load after it
    # The output rows this run has to generate, for the progress line's ETA (unknown when rows say their own N).
    todo = None
    if "num_samples" not in source.schema.names:
        todo = max(0, job.record["input"]["rows"] * cfg.num_samples - sum(len(s) for s in done.values()))
    # `--num-cpus-per-actor auto`: the machine's cores when raysd starts the Ray here, else 1 per actor.
    cfg = cfg.resolve_actor_cpus(os.cpu_count() if starts_local else None)
    we_started_ray = _init_ray(cfg, gpus)
    stats = progress = job_key = None
    written: dict = {}
    passes: list[Pass] = []
    try:
        stats = start_job_stats(job_tags(cfg))  # on the driver's node: no worker node's loss takes it
        progress = _Progress(stats, started, cfg.quiet, todo, verbose=cfg.verbose)
        clock.mark("ray_start")
        replicas = cfg.replicas
        # One pass, unless a replica retired (its model actors could not be placed: the cluster lost
        # room): the rows it handed back are then generated by another pass on the replicas left,
        # which resumes the output as a re-run would.
        while True:
            before = live_totals(stats)
            job_key = uuid.uuid4().hex  # names the pass's records in the GCS (pipeline.release_job)
            sink = PartsSink(cfg.output, schema, cfg.rows_per_file, local=store.local, stats=stats)
            with _data_context(cfg.quiet, cfg.verbose):
                ds = build_dataset(source, dataclasses.replace(cfg, replicas=replicas), schema, done, stats, job_key,
                                   later_pass=bool(passes))
                if in_process(store.fs):
                    write_on_driver(ds, sink)  # Ray workers cannot see memory://
                else:
                    ds.write_datasink(sink, ray_remote_args={"num_cpus": IO_TASK_CPUS})
            live = live_totals(stats)
            retired = int(live.get("replicas_retired", 0) - before.get("replicas_retired", 0))
            passes.append(Pass(replicas, retired, sink.totals["deferred"]))
            written = {k: written.get(k, 0) + v for k, v in sink.totals.items()}
            if not sink.totals["deferred"]:
                break
            _release(None, job_key)  # the pass's placement groups, before the next pass places its own
            job_key = None
            if retired >= replicas:
                notes = "; ".join(live.get("notes", [])[-replicas:])
                raise RuntimeError(f"no replica could place its model actors, {sink.totals['deferred']} rows left "
                                   f"to generate: {notes}")
            replicas -= retired
            if not cfg.quiet:
                print(f"raysd generate: {retired} replica(s) retired; generating the {sink.totals['deferred']} rows "
                      f"they handed back on the {replicas} left", file=sys.stderr, flush=True)
            done = store.done_samples(cfg.id_column)
        _mark_pipeline(clock, live)
    finally:
        if progress is not None:
            progress.close()
        if not starts_local:  # a local Ray this job started ends with it, and everything it holds
            _release(stats, job_key)
        if we_started_ray:
            ray.shutdown()
    clock.mark("shutdown")
    summary = _summary(cfg, store, written, live, clock, passes)
    store.write_summary(summary.to_dict())
    return summary


def _with_eos_ids(cfg: GenerateConfig) -> GenerateConfig:
    """The target's EOS ids read once, here, before any actor starts (raysd.jobs.replica.with_eos_ids)."""
    from raysd.jobs.replica import with_eos_ids

    try:
        return with_eos_ids(cfg)
    except Exception as exc:  # noqa: BLE001 - a target whose config cannot be read: one line, before Ray
        raise JobError(f"cannot read the target's EOS ids from {cfg.target!r}: {one_line(exc)}") from None


def _mark_pipeline(clock: WallClock, live: dict) -> None:
    """The pipeline's part of the wall: until the replicas' first step ended (Ray Data's actors,
    the models, the first block's prompts), the steps, and what followed the last step (its
    block's last rows, the last write)."""
    loop = live.get("loop")
    first, last = (None, None) if loop is None else (loop.first_step_at, loop.last_step_at)
    if first is None or last is None:  # no step ran (every row was there already, or all were errors)
        clock.mark("pipeline")
        return
    clock.mark("pipeline_start", at=first)
    clock.mark("generating", at=last)
    clock.mark("pipeline_end")


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
    """End of a job on a Ray that outlives it (a cluster, or a Ray this process had started): the
    stats actor, the model actors, their placement groups and the job's records in the GCS. A local
    Ray the job started goes with its shutdown. Best effort: the job's outcome is decided."""
    from raysd.jobs.pipeline import release_job

    for step in (lambda: stats is not None and _end_stats(stats), lambda: job_key is not None and release_job(job_key)):
        try:
            step()
        except Exception:  # noqa: BLE001 - e.g. the actor is gone already
            pass


def _end_stats(stats) -> None:
    """End the stats actor as an actor exits normally, so that it exports its last metrics as it
    goes (ray.kill would drop those recorded since Ray's last report); killed if it cannot."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:  # not retried: the call ends the actor, and answers with its death
        ray.get(stats.__ray_terminate__.options(max_task_retries=0).remote(), timeout=30)
    except RayActorError:
        return
    except GetTimeoutError:
        pass
    ray.kill(stats)


@dataclass(frozen=True)
class Pass:
    """One pass of a run over the rows left (`generate`): the first, and one more after each pass
    whose replicas retired with rows handed back."""

    replicas: int  # the replicas it started with
    retired: int  # of which retired: their model actors could not be placed
    deferred: int  # rows they handed back, for the next pass


def _summary(cfg: GenerateConfig, store: OutputStore, totals: dict, live: dict, clock: WallClock,
             passes: list[Pass]) -> JobSummary:
    """The whole output's figures from its parts on disk; this run's from its parts' write results
    (`totals`), the job's live counts and its wall clock (the summary's own counting included)."""
    from raysd.engine.verdict import LoopStats
    from raysd.jobs.pipeline import time_breakdown

    disk = store.totals()
    clock.mark("summary")
    wall = clock.total
    loop = live.get("loop") or LoopStats()
    breakdown = time_breakdown(live)
    # Only a split replica overlaps anything: a colocated one drafts and verifies in one process.
    overlap = loop.overlap_efficiency if cfg.shape == "split" else None
    run = RunSummary(
        rows=totals["rows"],
        rows_skipped=int(live.get("rows_skipped", 0)),
        rows_failed=totals["failed"],
        generated_tokens=totals["tokens"],
        wall_s=wall,
        tokens_per_s=totals["tokens"] / wall if wall > 0 else 0.0,
        overlap_efficiency=overlap,
        **pooled(totals, cfg.tree_budget, cfg.beam_width),
        replicas=cfg.replicas,
        occupancy=breakdown["occupancy"],
        time_breakdown={"wall": dict(clock.phases), **breakdown},
        draft_sources={k[len("suffix_"):]: int(v) for k, v in live.items() if k.startswith("suffix_")} or None,
        stats_partial=bool(live.get("stats_restarted") or live.get("stats_lost")),
        recoveries=loop.recoveries,
        replicas_retired=sum(p.retired for p in passes),
        passes=len(passes),
        notes=list(live.get("notes", [])),
    )
    return JobSummary(
        output=cfg.output,
        rows=disk["rows"],
        rows_failed=disk["failed"],
        generated_tokens=disk["tokens"],
        latest_run=run,
        **pooled(disk, cfg.tree_budget, cfg.beam_width),
        tree_budget=cfg.tree_budget,
        target_model=cfg.target,
        draft_model=cfg.draft,
        num_speculative_tokens=cfg.effective_num_speculative_tokens,
        finish_reasons=disk["finish_reasons"],
    )
