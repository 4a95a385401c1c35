"""The Ray Data pipeline of a generation job (see docs/jobs.md, "Pipeline").

    read (InputSource.dataset: read_parquet / read_json / read_text+parse / Arrow files / from_arrow)
      -> map_batches(AssignIds)        one actor, in input order: ids, resume filter, null/duplicate ids
      -> repartition(target_num_rows_per_block=batch_size, strict=True)   streaming: blocks of one batch
      -> map_batches(GenerateReplica)  --replicas actors, each owning a SpecCoordinator (draft + target)
      -> write_datasink(PartsSink)     each write task writes one Parquet part atomically

Everything streams: Ray Data's executor backpressures the read when the generation
stage is busy, so memory holds a few batches per stage, not the input.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Iterable, Mapping

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy
from ray.data.datasource import Datasink
from ray.exceptions import GetTimeoutError, RayActorError

from raysd.actors.launch import PlacementFailed
from raysd.jobs.config import GenerateConfig
from raysd.jobs.io import OutputStore, decode_json_value, output_json_value
from raysd.engine.verdict import LoopStats
from raysd.jobs.metrics import STAGE_SECONDS, JobCounters, ReplicaMetrics
from raysd.jobs.schema import GENERATED_NAMES, OVERRIDE_COLUMNS, row_totals

logger = logging.getLogger(__name__)

ID_ERROR = "__raysd_id_error"  # set by AssignIds on rows whose id cannot be used; dropped before the output
# Set by AssignIds on a resumed row some of whose samples are in the output already: their indices
# (the generation stage skips them); null otherwise. Dropped before the output.
DONE_SAMPLES = "__raysd_done_samples"
ALL_SAMPLES = None  # `done` value: every sample of the id is in the output (AssignIds)
# The finish_reason of a row a retired replica hands back (GenerateReplica): never written (PartsSink
# counts and drops it); the job's next pass generates it on the replicas left (raysd.jobs.runner).
DEFERRED = "deferred"
_PROGRESS_REPORT_EVERY_S = 1.0  # a replica's finished samples reach JobStats this often during a block
# Blocks inside each generation actor at once (threads of the actor, `max_concurrent_calls_per_actor`).
# They all feed the replica's one RequestStream, so while the last rows of one block finish, rows of
# the next take the freed slots: with --batch-size slots, two blocks keep the micro-batches full and a
# third is being tokenised. The stream holds at most this many blocks' rows (bounded memory).
CONCURRENT_BLOCKS_PER_REPLICA = 3
_IN_FLIGHT_PER_REPLICA = 2 * CONCURRENT_BLOCKS_PER_REPLICA  # blocks queued on each actor, running ones included
_REPLICA_BUILD_ATTEMPTS = 3  # a replica's coordinator, started again when a model actor dies during its start


# Ray's label every node carries with its own id (Ray Data pins its own per-job actors the same way).
NODE_ID_LABEL = "ray.io/node-id"


def driver_node_selector() -> dict[str, str]:
    """A label selector for the driver's node. What must live as long as the job and cannot be
    rebuilt elsewhere goes there: losing the driver's node ends the job anyway, so such an actor
    adds no way for the job to die (a worker node's loss must not end a job)."""
    return {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}


@ray.remote(num_cpus=0)
class JobStats:
    """Running totals the stages report to, for the progress line and the summary: counts only.

    Reports are blocking calls (ray.get) from the stages, so once the dataset has run, every
    report has landed. Losing this actor costs counts, never the job: it lives on the driver's
    node and Ray restarts it there (empty) if its process dies (`start_job_stats`), and a
    report that cannot land is dropped (`_report`).
    """

    def __init__(self, metric_tags: dict[str, str] | None = None):
        self.totals: dict[str, float] = {}
        self.loop = LoopStats()  # the replicas' loops, summed
        self.notes: list[str] = []  # why replicas retired, in the order they did
        # A restarted instance starts from zero; the summary says its counts are partial.
        self.restarted = ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
        # The same counts as live metrics (raysd.jobs.metrics): the dashboard sums what the summary sums.
        self.metrics = JobCounters(metric_tags) if metric_tags is not None else None

    def add(self, loop: LoopStats | None = None, **counts: float) -> None:
        """Add what a replica's loop measured (`loop`) and sum each count; `first_*_at` (a wall-clock
        time) keeps the earliest."""
        if loop is not None:
            self.loop.add(loop)
        if self.metrics is not None:
            self.metrics.add({**({} if loop is None else dataclasses.asdict(loop)), **counts})
        for k, v in counts.items():
            if k.endswith("_at"):
                if v is not None:
                    pick = min if k.startswith("first_") else max
                    self.totals[k] = pick(self.totals.get(k, v), v)
            else:
                self.totals[k] = self.totals.get(k, 0) + v

    def note(self, text: str) -> None:
        """A line for the summary (e.g. why a replica retired)."""
        self.notes.append(text)

    def get(self) -> dict:
        totals = {**self.totals, "notes": list(self.notes), "loop": self.loop}
        return {**totals, "stats_restarted": int(self.restarted)} if self.restarted else totals


def start_job_stats(metric_tags: dict[str, str] | None = None):
    """The job's JobStats actor: on the driver's node, restarted by Ray if its process dies, and
    its calls retried across that restart (so a report waits for it instead of failing).
    `metric_tags` (raysd.jobs.metrics.job_tags): it exports the counts it adds as live metrics."""
    return JobStats.options(label_selector=driver_node_selector(), max_restarts=-1, max_task_retries=-1).remote(metric_tags)


# How long a stage waits for its report to land before dropping it (the call may still land later).
_REPORT_TIMEOUT_S = 60.0
_dropped_reports = 0  # per process: reports that could not land (counts lost, job unharmed)


def _report(stats, **counts) -> None:
    """Add `counts` to the job's totals. Never fails the stage: progress counts are not worth a job.
    An unreachable JobStats (ActorUnavailableError while its node or process is going, RayActorError
    once it is gone for good) or a slow one costs these counts only."""
    global _dropped_reports
    if stats is None or not any(counts.values()):
        return
    try:
        ray.get(stats.add.remote(**counts), timeout=_REPORT_TIMEOUT_S)
    except (RayActorError, GetTimeoutError) as exc:  # ActorUnavailableError is a RayActorError
        _dropped_reports += 1
        if _dropped_reports == 1:
            logger.warning("raysd: progress counts dropped, the job's stats actor is unreachable "
                           "(%s); the job goes on", type(exc).__name__)


# Job records in the GCS's internal KV (put-if-absent, survive any actor's loss or restart), under
# `<job key>/...`: the id stage's claim, the ids of the job's replica actors. The runner drops them
# at the end.
_JOB_KV = "raysd-jobs"


def claim_once(key: str) -> bool:
    """True the first time `key` is claimed in this Ray cluster, False after."""
    from ray.experimental.internal_kv import _internal_kv_put

    return not _internal_kv_put(key, b"1", overwrite=False, namespace=_JOB_KV)


def record_replica(job_key: str, actor_id: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(f"{job_key}/replica/{actor_id}", b"1", overwrite=True, namespace=_JOB_KV)


def placement_groups_created_by(actor_ids: set[str]) -> list[str]:
    """The live placement groups (ids, hex) that these actors created: Ray's own record of each
    group's creator, from the GCS. An actor id survives the actor's restarts."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    found = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if pg.creator_actor_id.hex() in actor_ids and pg.state != gcs_pb2.PlacementGroupTableData.REMOVED:
            found.append(pg.placement_group_id.hex())
    return found


def _kill_actors_in(pg_ids: list[str]) -> None:
    """Kill, without restart, the live named actors scheduled in these placement groups (ids, hex),
    from the GCS's actor table: every model actor that Ray would restart is named (SpecCoordinator),
    and a handle from its name is what ray.kill takes in a process that did not create it."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    wanted = set(pg_ids)
    if not wanted:  # a restarted replica with no previous groups: no need to read every actor in the cluster
        return
    for raw in state._connect_and_get_accessor().get_actor_table(None, None):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        if actor.name and actor.placement_group_id.hex() in wanted and actor.state != gcs_pb2.ActorTableData.DEAD:
            try:
                handle = ray.get_actor(actor.name, namespace=actor.ray_namespace)
            except ValueError:  # died since the table was read
                continue
            ray.kill(handle, no_restart=True)


def remove_placement_groups(pg_ids: list[str]) -> None:
    """Remove these placement groups (ids, hex), their actors first, for good. Removing a group
    kills its actors, but a model actor restarts (max_restarts) into a group that is gone and
    stays RESTARTING; a replica still tearing its step graph down (Ray Data ends its actors while
    the job's end runs) then waits on it, a core spinning in Ray's channel read, until the session
    ends."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    _kill_actors_in(pg_ids)
    for pg_id in pg_ids:
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
        except Exception as exc:  # noqa: BLE001 - removed meanwhile
            logger.info("raysd: placement group %s is gone already (%s)", pg_id[:8], exc)


def remove_stale_placement_groups() -> int:
    """In a restarted actor, before it creates anything: remove the placement groups its previous
    incarnations created. Their actors died with their owner, but Ray keeps a group until its creator
    actor AND the driver's job are both gone (a restart is not gone), and after a node's loss even
    moves it to another node, where it holds the CPUs/GPUs the new coordinator needs."""
    stale = placement_groups_created_by({ray.get_runtime_context().get_actor_id()})
    remove_placement_groups(stale)
    return len(stale)


def release_job(job_key: str) -> None:
    """End of job: remove every placement group its replica actors created, then drop its records.

    A replica removes its group when it shuts down cleanly, but Ray Data kills the actors of a failed
    job, and Ray removes a group only once its creator actor AND the driver's job are gone: a driver
    that goes on (a re-run in the same process, a notebook, the fault soak) would find the failed
    job's groups holding every CPU/GPU, and its replicas could not place."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_list

    prefix = f"{job_key}/replica/"
    replicas = {(k.decode() if isinstance(k, bytes) else k)[len(prefix):]
                for k in _internal_kv_list(prefix, namespace=_JOB_KV)}
    if replicas:
        remove_placement_groups(placement_groups_created_by(replicas))
    _internal_kv_del(f"{job_key}/", del_by_prefix=True, namespace=_JOB_KV)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema`'s columns, in order, cast to its types; missing columns are null.

    Blocks from different files may differ (a column all-null in one file, absent from
    some JSON lines); every block leaving the id stage has the same schema.
    """
    columns = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            columns.append(col if col.type == f.type else col.cast(f.type))
        else:
            columns.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(columns, schema=schema)


def internal_schema(input_schema: pa.Schema, id_column: str) -> pa.Schema:
    """The rows between the id stage and the generation stage: the input's columns, the id,
    ID_ERROR and DONE_SAMPLES."""
    fields = list(input_schema)
    if id_column not in input_schema.names:
        fields.append(pa.field(id_column, pa.int64()))
    return pa.schema([*fields, pa.field(ID_ERROR, pa.string()), pa.field(DONE_SAMPLES, pa.list_(pa.int32()))])


ID_STAGE_RESTARTED = ("the id stage (AssignIds) was started a second time in this job (its actor died); its ids "
                      "would restart from 0, so the job stops here. Run the same command again: it resumes.")


class AssignIds:
    """The id stage: ONE actor (concurrency 1, one task in flight) under preserve_order, so it
    sees the blocks in input order.

    - Ids: the id column, or (when absent) the row's position in the input: 0, 1, ...
    - Resume, per (id, sample_index): drops rows every sample of which is in the output, and marks
      the samples already there of the others (DONE_SAMPLES), which the generation stage skips.
      `done`: {id: sample indices in the output} (OutputStore.done_samples), or an iterable of ids done
      whole. A row's sample count is its `num_samples` value or `default_samples`, as the
      generation stage counts it (schema.num_samples_of).
    - Marks null and duplicate ids (ID_ERROR); the generation stage writes error rows for them.

    Memory: the ids already done plus the ids seen this run (ids only, never rows).
    """

    def __init__(self, id_column: str, make_ids: bool, done: Iterable, schema: pa.Schema, stats=None,
                 job_key: str | None = None, default_samples: int = 1, json_columns: frozenset[str] = frozenset(),
                 later_pass: bool = False):
        # Never a second instance in a job: a restarted (or replacement) actor would count positions
        # from 0 again and forget the ids seen, giving rows wrong ids or missing duplicates. Its
        # constructor fails instead, which fails the job; a re-run resumes exactly once. The stage
        # runs on the driver's node (build_dataset), so only its own process dying can cause that.
        if job_key is not None:
            if not claim_once(f"{job_key}/AssignIds"):
                raise RuntimeError(ID_STAGE_RESTARTED)
        elif ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None \
                and ray.get_runtime_context().was_current_actor_reconstructed:  # (an actor's property only)
            raise RuntimeError(ID_STAGE_RESTARTED)
        self.id_column, self.make_ids, self.schema, self.stats = id_column, make_ids, schema, stats
        self.done = dict(done) if isinstance(done, Mapping) else dict.fromkeys(done, ALL_SAMPLES)
        self.default_samples, self.json_columns = default_samples, json_columns
        # A later pass of one run (raysd.jobs.runner): every null or duplicate id's error row was
        # written by the first pass (a retired replica writes them too: they need no model), so they
        # are dropped here, and the rows read and skipped were counted by the first pass.
        self.later_pass = later_pass
        self.seen: set = set()
        self.position = 0

    def _num_samples(self, batch: pa.Table, i: int) -> int:
        from raysd.jobs.schema import num_samples_of

        if "num_samples" not in batch.column_names:
            return self.default_samples
        value = batch.column("num_samples")[i].as_py()
        if "num_samples" in self.json_columns:
            value = decode_json_value(value)
        return num_samples_of(value, self.default_samples)[0]

    def __call__(self, batch: pa.Table) -> pa.Table:
        n = batch.num_rows
        if self.make_ids:
            ids = list(range(self.position, self.position + n))
            batch = batch.append_column(self.id_column, pa.array(ids, pa.int64()))
        else:
            ids = batch.column(self.id_column).to_pylist()
        self.position += n
        keep, errors, partial, skipped = [], [], [], 0
        for i, row_id in enumerate(ids):
            done = None
            if row_id is not None and row_id in self.done:
                samples = range(self._num_samples(batch, i))
                have = self.done[row_id]
                done = list(samples) if have is ALL_SAMPLES else [j for j in samples if j in have]
                if len(done) == len(samples):  # every sample is there
                    skipped += len(done)
                    continue
                if row_id in self.seen:  # a repeat of an id resumed here: its error row was written once
                    continue
                skipped += len(done)
            error = "id is null" if row_id is None else f"duplicate id {row_id!r}" if row_id in self.seen else None
            if error is not None and self.later_pass:
                continue
            keep.append(i)
            partial.append(done or None)
            errors.append(error)
            if error is None:
                self.seen.add(row_id)
        if not self.later_pass:
            _report(self.stats, rows_read=n, rows_skipped=skipped)
        if len(keep) < n:
            batch = batch.take(pa.array(keep, pa.int64()))
        batch = batch.append_column(ID_ERROR, pa.array(errors, pa.string()))
        batch = batch.append_column(DONE_SAMPLES, pa.array(partial, pa.list_(pa.int32())))
        return conform(batch, self.schema)


def _rows_of(batch: pa.Table) -> tuple[list[dict], dict[int, str]]:
    """The batch's rows as dicts, and {row: why not} for rows holding a string that is not valid
    UTF-8 (possible in a Parquet input): such a value becomes null and its row an error row,
    instead of failing the whole batch."""
    try:
        return batch.to_pylist(), {}
    except UnicodeDecodeError:
        pass
    rows, bad = [], {}
    for i in range(batch.num_rows):
        row = {}
        for name in batch.column_names:
            try:
                row[name] = batch.column(name)[i].as_py()
            except UnicodeDecodeError:
                row[name] = None
                bad.setdefault(i, f"column {name!r} is not valid UTF-8")
        rows.append(row)
    return rows, bad


class GenerateReplica:
    """The generation stage's callable class: Ray Data runs `--replicas` of these as a fixed
    actor pool. Each owns one `GenerationReplica` (a SpecCoordinator: a draft and a target
    actor in a placement group, plus the tokenizer, plus the RequestStream that keeps its
    micro-batches full), created when the actor starts if the job is fresh (`eager`: nothing in
    the output yet, so its models load while Ray Data starts its other stages and reads), else at
    its first batch with rows to generate, so a resumed job with nothing left to do loads no model.

    A replica whose model actors cannot be placed within the placement timeout (the cluster has no
    room for them: a fixed-size cluster that lost a node) retires: it says why to JobStats, and
    hands every row it is given back unwritten (finish_reason DEFERRED, which PartsSink drops), for
    the job's next pass on the replicas left (raysd.jobs.runner). Rows whose id is unusable need no
    model: it writes their error rows as any replica would.

    Ray Data runs up to CONCURRENT_BLOCKS_PER_REPLICA calls at once on each actor (threads);
    their rows share the replica's micro-batches. A batch of rows in, each row's samples out
    (one output row per sample still to generate; one per row without --num-samples), in order,
    in the output schema: the id, the input's other columns passed through, the generated
    columns (error rows for bad rows). Finished samples are counted to the job's JobStats every
    _PROGRESS_REPORT_EVERY_S while a block runs (the driver's progress line).
    """

    def __init__(self, cfg: GenerateConfig, schema: pa.Schema, json_columns: frozenset[str], stats=None,
                 job_key: str | None = None, eager: bool = False):
        self.cfg, self.schema, self.json_columns, self.stats = cfg, schema, json_columns, stats
        self.passthrough = [n for n in schema.names if n != cfg.id_column and n not in GENERATED_NAMES]
        self.stop_strings = bool(cfg.stop) or "stop" in schema.names  # the target actor needs a tokenizer
        self.replica = None
        self.retired: str | None = None  # why this replica retired (PlacementFailed), or None
        self._reporter: threading.Thread | None = None
        self._replica_lock = threading.Lock()  # concurrent calls: one of them loads the models
        self._start_error: BaseException | None = None
        actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        self.actor_id, self.tag = actor_id, actor_id[-8:] if actor_id else "0"
        self.metrics = ReplicaMetrics(cfg, self.tag)  # the error rows made here; the replica counts its own
        # The job's end removes the placement groups its replica actors created (release_job); a
        # restarted replica removes those of its previous incarnations now (remove_stale_placement_groups).
        if job_key and actor_id:
            record_replica(job_key, actor_id)
            if ray.get_runtime_context().was_current_actor_reconstructed:
                removed = remove_stale_placement_groups()
                logger.warning("raysd: replica %s restarted; removed %d placement group(s) of its previous run",
                               self.tag, removed)
        if eager:
            # A fresh job has rows to generate: start the model actors now, while Ray Data starts
            # its other stages and reads, rather than at the first block (the first call waits).
            threading.Thread(target=self._start, name="raysd-replica-start", daemon=True).start()

    def _start(self) -> None:
        try:
            self._get_replica()  # a PlacementFailed retires the replica there
        except BaseException as exc:  # noqa: BLE001 - raised again by the first call, as a lazy start would
            self._start_error = exc

    def _value(self, row: dict, name: str):
        value = row.get(name)
        return decode_json_value(value) if name in self.json_columns else value

    def _get_replica(self):
        """The replica, started on the first call; None once retired."""
        with self._replica_lock:
            if self._start_error is not None:
                raise self._start_error
            if self.replica is None and self.retired is None:
                try:
                    self.replica = self._build_replica()
                except PlacementFailed as exc:
                    self._retire(exc)
                    return None
                if self.stats is not None:
                    self._reporter = threading.Thread(target=self._report_live, name="raysd-progress", daemon=True)
                    self._reporter.start()
            return self.replica

    def _retire(self, why: PlacementFailed) -> None:
        """No more generating here (under the replica lock, or before any replica exists): say why,
        release what the replica holds, hand back every row from now on."""
        if self.retired is not None:
            return
        self.retired = str(why)
        logger.warning("raysd: replica %s retires: %s", self.tag, why)
        _report(self.stats, replicas_retired=1)
        _note(self.stats, f"replica {self.tag} retired: {why}")
        replica, self.replica = self.replica, None
        if replica is not None:
            try:
                replica.shutdown()
            except Exception:  # noqa: BLE001 - its actors are lost already; the job's end removes its group
                pass

    def _generate(self, payload: list[dict]):
        """(outputs, report) from the replica, or None once it has retired: its actors were lost
        and cannot be placed again (PlacementFailed from its loop, which every concurrent call sees)."""
        replica = self._get_replica()
        if replica is None:
            return None
        try:
            generated, loop, sources = replica.generate(payload)
        except Exception as exc:
            placement = exc if isinstance(exc, PlacementFailed) else exc.__cause__
            if not isinstance(placement, PlacementFailed):
                raise
            with self._replica_lock:
                self._retire(placement)
            return None
        # This block's finished samples (those not yet taken by _report_live) go with its stage counts.
        _report(self.stats, loop=loop, **replica.live.take(), **sources)
        return generated

    def _report_live(self) -> None:
        """The replica's finished samples, to JobStats every _PROGRESS_REPORT_EVERY_S (a thread)."""
        while True:
            time.sleep(_PROGRESS_REPORT_EVERY_S)
            replica = self.replica
            if replica is None:  # retired
                return
            counts = replica.live.take()
            if counts["rows_generated"]:
                _report(self.stats, **counts)

    def _build_replica(self):
        """A new GenerationReplica. A model actor lost while its coordinator starts (its process or
        node dies: RayActorError, ActorUnavailableError included) fails the construction, which would
        fail the block and with it the job (seen in the fault soak). So try again, after removing the
        placement groups the failed try left (this actor runs no coordinator yet)."""
        from raysd.jobs.replica import GenerationReplica

        for attempt in range(1, _REPLICA_BUILD_ATTEMPTS + 1):
            try:
                return GenerationReplica(self.cfg, self.tag, max_pending=CONCURRENT_BLOCKS_PER_REPLICA * self.cfg.batch_size,
                                         stop_strings=self.stop_strings)
            except RayActorError as exc:
                # A constructor that raised (a model that does not load) raises again: only a lost
                # process or node is worth another try.
                if attempt == _REPLICA_BUILD_ATTEMPTS or exc.actor_init_failed:
                    raise
                logger.warning("raysd: replica %s lost a model actor while starting (%s); starting again",
                               self.tag, type(exc).__name__)
                if self.actor_id is not None:
                    remove_placement_groups(placement_groups_created_by({self.actor_id}))

    def __call__(self, batch: pa.Table) -> pa.Table:
        from raysd.jobs.replica import error_output

        cfg = self.cfg
        rows, bad = _rows_of(batch)
        outputs: list[list[dict]] = [[] for _ in rows]
        payload, index = [], []
        for i, row in enumerate(rows):
            if i in bad:
                outputs[i] = [error_output(cfg, row[cfg.id_column], bad[i])]
                self.metrics.observe_row(outputs[i][0], "input")
                continue
            if row.get(ID_ERROR):
                outputs[i] = [error_output(cfg, row[cfg.id_column], row[ID_ERROR])]
                self.metrics.observe_row(outputs[i][0], "id")
                continue
            payload.append({"id": row[cfg.id_column], "prompt": self._value(row, cfg.prompt_column),
                            "done_samples": row.get(DONE_SAMPLES),
                            **{c: self._value(row, c) for c in OVERRIDE_COLUMNS if c in row}})
            index.append(i)
        generated = self._generate(payload) if payload else []
        if generated is None:  # retired: the rows go back unwritten, for the replicas left
            generated = [[deferred_output(cfg, row["id"], self.retired)] for row in payload]
        for i, outs in zip(index, generated):
            outputs[i] = outs
        errors = sum(len(outs) for i, outs in enumerate(outputs) if i in bad or rows[i].get(ID_ERROR))
        _report(self.stats, rows_generated=errors)  # the id stage's and unreadable rows' error rows
        records = []
        for row, outs in zip(rows, outputs):
            base = {cfg.id_column: row[cfg.id_column]}
            for name in self.passthrough:
                value = row.get(name)
                base[name] = output_json_value(value) if name in self.json_columns else value
            records.extend({**base, **out} for out in outs)
        return pa.Table.from_pylist(records, schema=self.schema)

    def __del__(self):
        replica = getattr(self, "replica", None)
        if replica is not None:
            try:
                replica.shutdown()
            except Exception:  # noqa: BLE001 - the actor is going away; its children die with it
                pass


def deferred_output(cfg: GenerateConfig, row_id, why: str) -> dict:
    """The output columns of a row a retired replica hands back: never written (PartsSink)."""
    from raysd.jobs.replica import error_output

    return {**error_output(cfg, row_id, why), "finish_reason": DEFERRED}


def _note(stats, text: str) -> None:
    """A line for the job's summary; dropped, as counts are, if JobStats is unreachable."""
    if stats is None:
        return
    try:
        ray.get(stats.note.remote(text), timeout=_REPORT_TIMEOUT_S)
    except (RayActorError, GetTimeoutError):
        pass


def time_breakdown(totals: dict) -> dict:
    """The summary's time_breakdown beside its wall phases, from JobStats totals: seconds per stage
    (STAGE_SECONDS, raysd.jobs.metrics), then `engine_loop` (the replicas' step loops at work, idle
    excluded: engine_loop - verify - draft, a colocated drafter's, is what the actor round trips
    and the loop's own work cost; a draft actor's drafting overlaps), `engine_idle`, `occupancy`
    (mean rows in the micro-batches / the slots) and `drafted_steps` (the fraction of steps that
    drafted): a view of the replicas' summed LoopStats and the read and write tasks' seconds."""
    loop: LoopStats = totals.get("loop") or LoopStats()
    seen = {**loop.breakdown(), "read": round(float(totals.get("read_s", 0.0)), 3),
            "write": round(float(totals.get("write_s", 0.0)), 3)}
    return {**{name: seen[name] for name, _ in STAGE_SECONDS},
            **{name: seen[name] for name in ("engine_loop", "engine_idle", "occupancy", "drafted_steps")}}


def breakdown_text(totals: dict) -> str:
    """The progress line's tail: occupancy and the stage seconds, e.g.
    `; occupancy 0.93; s: read 0.1 tokenize 0.4 queue_wait 3.2 draft 1.0 verify 9.8 detokenize 0.2 write 0.3`."""
    breakdown = time_breakdown(totals)
    if breakdown["occupancy"] is None:
        return ""
    stages = " ".join(f"{name} {breakdown[name]:.1f}" for name, _ in STAGE_SECONDS)
    return f"; occupancy {breakdown['occupancy']:.2f}; s: {stages}"


class PartsSink(Datasink):
    """Writes each write task's rows as ONE Parquet part, atomically: `_tmp/<name>` first, then a
    rename into place in the same filesystem. A killed job leaves at most files under `_tmp/`,
    which never count and are removed by the next run; a part that exists is complete.

    Part names come from the run and the write task's index, so a retried write task
    replaces its own part instead of adding a second copy of its rows.

    `on_write_complete` (on the driver) adds up the write tasks' counts (`totals`), from which
    the runner writes `_summary.json`.
    """

    def __init__(self, url: str, schema: pa.Schema, rows_per_file: int, local: bool, stats=None):
        self.url, self.schema, self.rows_per_file, self.local, self.stats = url, schema, rows_per_file, local, stats
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.totals: dict | None = None

    @property
    def supports_distributed_writes(self) -> bool:
        # A local path is local to a node: write where the driver is (it reads ids and the summary there).
        return not self.local

    @property
    def min_rows_per_write(self) -> int:
        return self.rows_per_file

    def get_name(self) -> str:
        return "RaysdParts"

    def write(self, blocks: Iterable, ctx) -> dict:
        import pyarrow.compute as pc

        tables = [b for b in blocks if b.num_rows]
        if not tables:
            return {**row_totals(None), "deferred": 0}
        table = conform(pa.concat_tables(tables), self.schema)
        deferred = pc.equal(table.column("finish_reason"), DEFERRED)
        n_deferred = int(pc.sum(deferred).as_py() or 0)
        if n_deferred:  # a retired replica's rows: generated by the job's next pass
            table = table.filter(pc.invert(deferred))
            if not table.num_rows:
                return {**row_totals(None), "deferred": n_deferred}
        index = ctx.task_idx if ctx is not None else uuid.uuid4().hex[:8]
        name = f"part-{self.run_id}-{index:06d}.parquet" if isinstance(index, int) else f"part-{self.run_id}-{index}.parquet"
        start = time.perf_counter()
        OutputStore(self.url).write_part(table, name)
        totals = {**row_totals(table), "deferred": n_deferred}
        _report(self.stats, rows_written=totals["rows"], write_s=time.perf_counter() - start)
        return totals

    def on_write_complete(self, write_result) -> None:
        totals = {**row_totals(None), "deferred": 0}
        for part in write_result.write_returns:
            for k in totals:
                totals[k] += part.get(k, 0)
        self.totals = totals


class _TimedRead:
    """A read task's read function that reports the seconds it spent producing blocks (`read_s`)."""

    def __init__(self, read_fn, stats):
        self.read_fn, self.stats = read_fn, stats

    def __call__(self):
        total, blocks = 0.0, iter(self.read_fn())
        while True:
            start = time.perf_counter()
            try:
                block = next(blocks)
            except StopIteration:
                total += time.perf_counter() - start
                break
            total += time.perf_counter() - start
            yield block
        _report(self.stats, read_s=total)


def time_reads(ds, stats) -> bool:
    """Make the Read operator's tasks report their seconds to `stats`. Best effort, through Ray
    Data's logical plan (Ray 2.60: `Read.datasource_or_legacy_reader.get_read_tasks`): the read
    cannot be timed from a stage of ours, since Ray Data does not fuse a map into a read that
    splits its blocks. False (and nothing changed) when there is no Read operator (`memory://`
    input, already in the object store) or the plan has another shape."""
    if stats is None:
        return False
    try:
        from ray.data._internal.logical.operators.read_operator import Read

        op = ds._logical_plan.dag
        while op is not None and not isinstance(op, Read):
            op = op.input_dependencies[0] if op.input_dependencies else None
        if op is None:
            return False
        reader = op.datasource_or_legacy_reader
        inner = reader.get_read_tasks

        def get_read_tasks(*args, **kwargs):
            tasks = inner(*args, **kwargs)
            for task in tasks:
                task._read_fn = _TimedRead(task._read_fn, stats)
            return tasks

        reader.get_read_tasks = get_read_tasks
        return True
    except Exception:  # noqa: BLE001 - a measurement only
        return False


# Extra named map_batches options for the generation stage's actors, e.g. {"resources": {...}}: the
# node-loss tests pin the replicas to a node with a custom resource, so that a replica surely dies
# with the node and its restart elsewhere is what is tested. Empty in a job.
GENERATION_STAGE_OPTIONS: dict = {}


def build_dataset(source, cfg: GenerateConfig, schema: pa.Schema, done, stats=None, job_key: str | None = None,
                  later_pass: bool = False):
    """read -> ids (+ resume filter) -> generation: the lazy Dataset of output rows. `done`: the
    output's {id: sample indices} (OutputStore.done_samples), or ids done whole. `job_key` names
    the job's records in the GCS (the id stage's claim, the replicas' placement groups); drop them
    with release_job when the job ends. `later_pass`: a pass after the first of one run, for the
    rows retired replicas handed back (raysd.jobs.runner): the id errors are written already."""
    make_ids = cfg.id_column not in source.schema.names
    ds = source.dataset()
    time_reads(ds, stats)
    ds = ds.map_batches(
        AssignIds,
        fn_constructor_args=(cfg.id_column, make_ids, done, internal_schema(source.schema, cfg.id_column), stats,
                             job_key, cfg.samples_per_prompt, source.json_columns, later_pass),
        batch_format="pyarrow",
        batch_size=None,  # whole blocks: each one's position is where the previous one ended
        compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=1),
        num_cpus=0,
        # Its state (positions, ids seen) cannot be rebuilt, so it lives where the driver lives:
        # a worker node's loss never reaches it.
        label_selector=driver_node_selector(),
        # Never restarted: a new actor would start from position 0 with no ids seen. Ray 2.60 takes
        # max_restarts only as a deprecated ray_remote_args entry (removed in 2.64), so the stage
        # keeps Ray Data's default restarts and refuses a second start itself (AssignIds.__init__):
        # its death fails the job, and a re-run resumes exactly once.
    )
    ds = batch_blocks(ds, cfg.batch_size)
    ds = ds.map_batches(
        GenerateReplica,
        fn_constructor_args=(cfg, schema, source.json_columns, stats, job_key, not done),  # eager if fresh
        batch_format="pyarrow",
        batch_size=cfg.batch_size,
        # Several blocks inside each actor at once (threads), feeding its one stream: see GenerateReplica.
        compute=ActorPoolStrategy(size=cfg.replicas, max_tasks_in_flight_per_actor=_IN_FLIGHT_PER_REPLICA,
                                  max_concurrent_calls_per_actor=CONCURRENT_BLOCKS_PER_REPLICA,
                                  enable_true_multi_threading=True),
        num_cpus=0,  # the model actors (in the coordinator's placement group) hold the CPUs/GPUs
        # A row in, a row out, unless a row may ask for several samples.
        udf_modifying_row_count=cfg.samples_per_prompt > 1 or "num_samples" in source.schema.names,
        **GENERATION_STAGE_OPTIONS,
    )
    return ds


def batch_blocks(ds, batch_size: int):
    """Blocks of exactly `batch_size` rows, the last one excepted (streaming, no shuffle): one
    generation task each, spread over the replicas, whatever the input's files and blocks are.

    `strict=True`: Ray's default (best effort) leaves one short block per input block (an input
    block of 35 rows becomes 8, 8, 8, 8 and 3), so a replica's CONCURRENT_BLOCKS_PER_REPLICA calls
    would at times hold too few rows to fill its batch, and take more steps for the same tokens
    (docs/history/benchmarks.md, Benchmark 6). Strict blocks combine rows across input blocks, in
    order."""
    ds = ds.repartition(target_num_rows_per_block=batch_size, strict=True)
    _repartition_needs_no_cpu(ds)
    return ds


def _repartition_needs_no_cpu(ds) -> None:
    """The streaming repartition's tasks ask for no CPU, as the read and write tasks do (IO_TASK_CPUS).

    Ray Data gives a map task 1 CPU unless told otherwise, and `Dataset.repartition` takes no
    `ray_remote_args`. When the model actors' placement groups hold every CPU of the cluster (2
    replicas of 1+1 CPUs on 4 CPUs), a repartition task that comes after they were placed waits
    forever, and so do the replicas that wait for its blocks (a resumed run on a two-node cluster,
    as the fault soak runs it). The logical operator's `ray_remote_args` are read when the
    plan is executed; set num_cpus=0 there (Ray 2.60's `StreamingRepartition`)."""
    op = ds._logical_plan.dag
    args = getattr(op, "ray_remote_args", None)
    if type(op).__name__ != "StreamingRepartition" or not isinstance(args, dict):  # a Ray that changed it
        logger.warning("raysd: cannot set the repartition's CPUs to 0 (%s); a cluster whose CPUs the model "
                       "actors take entirely may stall", type(op).__name__)
        return
    args["num_cpus"] = 0


def write_on_driver(ds, sink: PartsSink) -> None:
    """For an output Ray workers cannot see (`memory://`): stream the rows to the driver with
    iter_batches and write the parts here, through the same sink."""
    from ray.data.datasource.datasink import WriteResult

    returns, rows = [], 0
    for i, batch in enumerate(ds.iter_batches(batch_size=sink.rows_per_file, batch_format="pyarrow")):
        ctx = type("Ctx", (), {"task_idx": i})()
        returns.append(sink.write([batch], ctx))
        rows += batch.num_rows
    sink.on_write_complete(WriteResult(num_rows=rows, size_bytes=0, write_returns=returns))
