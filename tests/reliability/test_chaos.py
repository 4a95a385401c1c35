"""Chaos: SIGKILL real processes in the middle of a real job.

- the target actor (a colocated replica's one model actor, or a split replica's target), the draft
  actor of a split replica (restarted by Ray, the coordinator re-runs the rows in flight);
- a whole replica: the generation stage's Ray Data actor, which owns the coordinator, its
  placement group and both model actors (Ray Data restarts it and retries its tasks);
- the driver with everything it started (`python -m raysd generate`), then the same command again.

Each time the job (or its re-run) finishes with every input id exactly once and the greedy tokens
of a clean run. A clean job equals the single-process SpecEngine (tests/jobs/test_generate.py),
which is the reference here.
"""

from __future__ import annotations

import pytest

from raysd.jobs import GenerateConfig
from tests.reliability.chaos import Outcome, compare, kill_actor_mid_job, kill_driver_mid_job
from tests.reliability.conftest import keyed_input, read_rows

pytestmark = [pytest.mark.slow, pytest.mark.alone]

# 64 rows: 16 blocks of 4, so the first part lands well before the job ends (with 32 a fast run
# could finish before the kill saw one, and the kill would find no job to hit).
N_ROWS, MAX_NEW = 64, 12


@pytest.fixture(scope="module")
def job_input(tmp_path_factory, model_dirs):
    return keyed_input(tmp_path_factory.mktemp("chaos"), model_dirs, N_ROWS, MAX_NEW, seed=11)


@pytest.mark.parametrize("fault, shape", [("target", "colocated"), ("replica", "colocated"), ("target", "split"),
                                          ("draft", "split")])
def test_kill_process_mid_job(fault, shape, job_input, model_dirs, local_ray, tmp_path):
    target, draft, _ = model_dirs
    inp, expected = job_input
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), id_column="key", target=target, draft=draft,
                         max_new_tokens=MAX_NEW, batch_size=4, rows_per_file=4, quiet=True, replica_shape=shape,
                         num_speculative_tokens=4)  # fixed: under auto an idle draft actor may never be called again
    outcome, summary = kill_actor_mid_job(cfg, fault)
    assert 0 < outcome.rows_written_at_kill < N_ROWS  # really mid-job
    outcome = compare(outcome, read_rows(cfg.output), "key", expected)
    assert (outcome.rows_out, outcome.lost, outcome.duplicated, outcome.token_mismatches, outcome.error_rows) == (N_ROWS, 0, 0, 0, 0), outcome
    assert summary.rows == N_ROWS and summary.rows_failed == 0
    assert outcome.restarted_pid is not None and outcome.restarted_pid != outcome.killed_pid  # Ray restarted it


@pytest.mark.xdist_group("own-rays")  # its `raysd generate` starts a Ray of its own (tests/conftest.py)
def test_kill_driver_mid_job_then_rerun(tmp_path, job_input, model_dirs):
    """A real crash: `raysd generate` SIGKILLed while it writes (its whole process group: the
    driver, the Ray it started, the actors), then the same command again. The re-run regenerates
    only what was not in a part, and what it regenerates beyond the unstarted rows is bounded by
    the rows that were in flight. Nothing lost, nothing doubled, no partial file counted, the
    killed run's parts kept as they were, and the tokens those of a clean run."""
    target, draft, _ = model_dirs
    inp, expected = job_input
    out = tmp_path / "out"
    batch, per_file = 4, 4
    args = ["--input", str(inp), "--output", str(out), "--id-column", "key", "--target", target, "--draft", draft,
            "--max-new-tokens", str(MAX_NEW), "--batch-size", str(batch), "--rows-per-file", str(per_file), "--json"]
    got = kill_driver_mid_job(args, out)
    in_parts = got["in_parts"]
    assert 0 < in_parts < N_ROWS
    assert got["stray_parts"] == [], got["stray_parts"]
    rerun = got["rerun"]["latest_run"]
    assert got["rerun"]["rows"] == N_ROWS and rerun["rows_skipped"] == in_parts and rerun["rows"] == N_ROWS - in_parts
    # No row of a complete part was generated again (the re-run's rows above). The work the kill threw
    # away is the rows generated but not yet in a part: the rows in flight, which are generated
    # again. It is NOT bounded by --rows-per-file: Ray Data queues finished blocks between the
    # generation stage and the write tasks (see docs/reliability.md); it is bounded by the input.
    wasted = max(0, got["generated_at_kill"] - in_parts)
    assert wasted <= N_ROWS - in_parts, got
    print(f"driver kill: {in_parts} rows in parts, {got['generated_at_kill']} generated at the kill, {wasted} regenerated")
    assert not (out / "_tmp").exists()
    assert set(got["killed_parts"]) <= {p.name for p in out.glob("part-*.parquet")}  # kept, not rewritten
    outcome = compare(Outcome("driver", N_ROWS), read_rows(out), "key", expected)
    assert (outcome.rows_out, outcome.lost, outcome.duplicated, outcome.token_mismatches) == (N_ROWS, 0, 0, 0), outcome


def test_id_stage_is_never_restarted(job_input, local_ray, tmp_path):
    """A restarted id actor would count positions from 0 again and forget the ids it has seen
    (wrong ids, missed duplicates). So a second start of the stage in one job fails in its
    constructor, which fails the job, and a re-run resumes exactly once
    (test_kill_driver_mid_job_then_rerun). No deprecated `ray_remote_args` (max_restarts) on the way:
    Ray 2.60 warns that they go in 2.64."""
    import warnings

    import pyarrow as pa
    import ray

    from raysd.jobs.pipeline import ID_STAGE_RESTARTED, AssignIds, build_dataset, release_job, start_job_stats
    from raysd.jobs.runner import check_job

    inp, _ = job_input
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), draft="ngram")  # ids from positions
    job = check_job(cfg)
    source, schema = job.source, job.schema
    from ray.util.annotations import RayDeprecationWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = build_dataset(source, cfg, schema, set())
    deprecated = [str(w.message) for w in caught if issubclass(w.category, RayDeprecationWarning)]
    assert not deprecated, deprecated  # e.g. "`ray_remote_args` is deprecated and will be removed in Ray 2.64"
    op, ops = ds._logical_plan.dag, {}
    while op is not None:
        ops[op.name] = op
        op = op.input_dependencies[0] if op.input_dependencies else None
    assert "max_restarts" not in ops["MapBatches(AssignIds)"].ray_remote_args
    assert "max_restarts" not in ops["MapBatches(GenerateReplica)"].ray_remote_args  # replicas keep restarting

    stats = start_job_stats()
    job_key = "test-id-stage"
    try:
        ids_schema = pa.schema([pa.field("prompt", pa.string()), pa.field("id", pa.int64()), pa.field("__raysd_id_error", pa.string())])
        first = AssignIds("id", True, [], ids_schema, stats, job_key)
        assert first(pa.table({"prompt": ["a", "b"]})).column("id").to_pylist() == [0, 1]
        with pytest.raises(RuntimeError, match="started a second time"):  # a restart or a replacement
            AssignIds("id", True, [], ids_schema, stats, job_key)
        assert "resumes" in ID_STAGE_RESTARTED
        # The claim lives in the GCS, not in an actor: losing the stats actor does not forget it.
        ray.kill(stats, no_restart=True)
        with pytest.raises(RuntimeError, match="started a second time"):
            AssignIds("id", True, [], ids_schema, stats, job_key)
    finally:
        ray.kill(stats)
        release_job(job_key)
    AssignIds("id", True, [], ids_schema, None, job_key)  # a new job (released key): first start
    release_job(job_key)


def test_no_pipeline_stage_asks_for_a_cpu(job_input, local_ray, tmp_path):
    """The model actors' placement groups may hold every CPU of a cluster (2 replicas of 1+1 CPUs on
    two 2-CPU nodes, the fault soak's). A stage task that asks for a CPU then waits forever, and the
    replicas wait for its blocks: the fault soak's resumed run hung so on the streaming repartition
    (Ray Data gives a map task 1 CPU by default, and `repartition` takes no ray_remote_args). Every
    operator of the pipeline asks for none (the write's are runner's IO_TASK_CPUS, also 0)."""
    from raysd.jobs.io import IO_TASK_CPUS
    from raysd.jobs.pipeline import build_dataset
    from raysd.jobs.runner import check_job

    inp, _ = job_input
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), draft="ngram")
    job = check_job(cfg)
    op, cpus = build_dataset(job.source, cfg, job.schema, set())._logical_plan.dag, {}
    while op is not None:
        cpus[type(op).__name__ + ":" + op.name] = op.ray_remote_args.get("num_cpus")
        op = op.input_dependencies[0] if op.input_dependencies else None
    assert any(name.startswith("StreamingRepartition") for name in cpus), cpus
    assert set(cpus.values()) == {0} and IO_TASK_CPUS == 0, cpus


def test_stats_actor_loss_costs_counts_only(local_ray, monkeypatch):
    """JobStats (the progress counts) is the one raysd actor of a job besides the stages. Its loss
    must never end the job: it lives on the driver's node, Ray restarts it if its
    process dies (empty: the summary says its counts are partial), and a report or a read that
    cannot reach it is dropped, whether the actor is gone (RayActorError) or unreachable for a
    moment (ActorUnavailableError, as while its node is being lost)."""
    import os
    import signal

    import ray

    from raysd.jobs import pipeline
    from raysd.jobs.runner import live_totals
    from tests.reliability.chaos import alive_actors, wait_until

    stats = pipeline.start_job_stats()
    pipeline._report(stats, rows_generated=4)
    [actor] = alive_actors("JobStats")
    assert actor["NodeID"] == ray.get_runtime_context().get_node_id()  # the driver's node
    os.kill(actor["Pid"], signal.SIGKILL)
    pipeline._report(stats, rows_generated=2)  # waits for the restart, then lands
    assert {k: v for k, v in live_totals(stats).items() if k not in ("loop", "notes")} == {"rows_generated": 2, "stats_restarted": 1}
    wait_until(lambda: [a["NumRestarts"] for a in alive_actors("JobStats")] == [1], "the restart recorded")

    ray.kill(stats, no_restart=True)  # gone for good; the kill is asynchronous: wait for it to land
    wait_until(lambda: alive_actors("JobStats") == [], "the actor dead")
    pipeline._report(stats, rows_generated=2)  # dropped, no exception
    assert live_totals(stats) == {"stats_lost": 1}

    def unavailable(*args, **kwargs):
        raise ray.exceptions.ActorUnavailableError("its node is being lost", None)

    monkeypatch.setattr(pipeline.ray, "get", unavailable)
    pipeline._report(stats, rows_generated=2)
    assert live_totals(stats) == {"stats_lost": 1}


def test_job_end_removes_its_replicas_placement_groups(local_ray):
    """Ray removes a placement group only once its creator actor AND the driver's job are gone. So
    the group of a killed replica outlives it (Ray Data kills a failed job's actors without a clean
    shutdown), and a restarted replica finds its previous incarnation's group still holding CPUs
    (after a node's loss, moved to another node). A restarted replica removes the groups it created
    before, and the job's end removes every group its replicas created."""
    import os
    import signal

    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group

    from raysd.jobs import pipeline
    from tests.reliability.chaos import wait_until

    @ray.remote(num_cpus=0, max_restarts=1)
    class Replica:  # stands for GenerateReplica: creates a group, cleans up after a restart
        def __init__(self):
            self.removed = pipeline.remove_stale_placement_groups() if \
                ray.get_runtime_context().was_current_actor_reconstructed else 0

        def make_group(self) -> str:
            pg = placement_group([{"CPU": 1}])
            ray.get(pg.ready(), timeout=60)
            return pg.id.hex()

        def info(self) -> tuple[int, int]:
            return os.getpid(), self.removed

    def state(pg_id: str) -> str:
        return ray.util.placement_group_table(PlacementGroup(PlacementGroupID.from_hex(pg_id)))["state"]

    job_key = "test-job-end"
    a, b = Replica.remote(), Replica.remote()
    for actor in (a, b):
        pipeline.record_replica(job_key, actor._actor_id.hex())
    pg_a, pg_b = ray.get([a.make_group.remote(), b.make_group.remote()])
    pid, _ = ray.get(a.info.remote())
    os.kill(pid, signal.SIGKILL)  # a restarts
    wait_until(lambda: _restarted(a, pid), "the actor's restart")
    assert ray.get(a.info.remote())[1] == 1 and state(pg_a) == "REMOVED"  # its old group, removed by the new run
    ray.kill(b, no_restart=True)  # as Ray Data ends a failed job's actors: no clean shutdown
    assert state(pg_b) == "CREATED"  # Ray keeps it while this driver's job lives
    pipeline.release_job(job_key)
    assert state(pg_b) == "REMOVED"
    ray.kill(a)


def _restarted(actor, old_pid) -> bool:
    import ray

    try:
        return ray.get(actor.info.remote(), timeout=5)[0] != old_pid
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def test_replica_starts_again_when_a_model_actor_dies_during_its_start(monkeypatch):
    """The fault soak killed a draft actor while a (restarted) replica was building its coordinator:
    `SpecCoordinator.__init__` raised ActorUnavailableError and the job failed. The replica now
    starts its coordinator again (a bounded number of times) on RayActorError, of which
    ActorUnavailableError is one."""
    import pyarrow as pa
    import ray

    from raysd.jobs import pipeline, replica

    failures = [ray.exceptions.ActorUnavailableError("its process died", None),
                ray.exceptions.RayActorError()]
    built = []

    class Flaky:
        def __init__(self, *args, **kwargs):
            if failures:
                raise failures.pop(0)
            built.append(self)

    monkeypatch.setattr(replica, "GenerationReplica", Flaky)
    cfg = GenerateConfig(input="in.jsonl", output="out", draft="ngram")
    stage = pipeline.GenerateReplica(cfg, pa.schema([]), frozenset())
    assert stage._get_replica() is built[0] and not failures  # third try
    assert stage._get_replica() is built[0]  # built once

    failures[:] = [ray.exceptions.RayActorError()] * pipeline._REPLICA_BUILD_ATTEMPTS
    again = pipeline.GenerateReplica(cfg, pa.schema([]), frozenset())
    with pytest.raises(ray.exceptions.RayActorError):  # bounded: a replica that cannot start fails
        again._get_replica()
