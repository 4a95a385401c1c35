"""A job survives the loss of a worker node, on a simulated multi-node cluster
(`ray.cluster_utils.Cluster`: several raylets on this machine; a node is lost by SIGKILLing its
raylet and everything on it, as when a machine dies).

- Two replicas, one per node (each node has CPUs for exactly one STRICT_PACK draft/target pair);
  the worker node is lost once a few rows are generated. A replacement node joins first, as an
  autoscaler would bring one: the lost replica's pair needs somewhere to go. While it joins, the
  replicas are held (SIGSTOP), so that the job cannot finish before the loss, however long a loaded
  machine takes to start a node.
- Two replicas, one per node, and no room anywhere else: the worker node is lost and nothing
  replaces it. The lost replica retires once its actors cannot be placed (a short
  `--placement-timeout` here), its rows go back, and the job finishes them on the replica left, in
  a second pass; the summary says so.
- One replica whose draft and target are on different nodes (`--placement-strategy STRICT_SPREAD`, each
  node has CPUs for one of them); the worker node is lost. The head has a CPU to spare, so the lost
  actor comes back there.

Each time the job finishes by itself with every row exactly once and the greedy tokens of a clean
run. The job's own actors that cannot be rebuilt (JobStats, the id stage) live on the driver's node,
which the tests check too.
"""

from __future__ import annotations

import pytest
import ray

from raysd.jobs import GenerateConfig
from tests.reliability.chaos import (VICTIMS, JobThread, Outcome, add_worker, alive_actors, compare, hold_replicas,
                                     lose_node, placement_groups, release_replicas, start_cluster, wait_for)
from tests.reliability.conftest import keyed_input, read_rows

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.xdist_group("own-rays")]  # tests/conftest.py

N_ROWS, MAX_NEW = 128, 12
MID_JOB = 8  # rows generated before the replicas are held and the node is lost: both at work, most rows not done
ID_STAGE = "MapWorker(MapBatches(AssignIds))"
REPLICA_HOST = "raysd_test_replica_host"  # a custom node resource: where the replica actors may go


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # another module's local Ray: one Ray at a time
        ray.shutdown()
    c = start_cluster(head_cpus=2)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def job_input(tmp_path_factory, model_dirs):
    return keyed_input(tmp_path_factory.mktemp("node-loss"), model_dirs, N_ROWS, MAX_NEW, seed=23)


def _config(inp, out, model_dirs, **kw) -> GenerateConfig:
    target, draft, _ = model_dirs
    return GenerateConfig(input=str(inp), output=str(out), id_column="key", target=target, draft=draft,
                          max_new_tokens=MAX_NEW, batch_size=4, rows_per_file=4, quiet=True, **kw)


def _exactly_once(out, expected) -> None:
    outcome = compare(Outcome("node", N_ROWS), read_rows(out), "key", expected)
    assert (outcome.rows_out, outcome.lost, outcome.duplicated, outcome.token_mismatches, outcome.error_rows) == \
        (N_ROWS, 0, 0, 0, 0), outcome


def _on_driver_node(head_id: str) -> None:
    """What cannot be rebuilt elsewhere lives where the driver lives (the id stage's actor may have
    finished its blocks and gone already)."""
    stats = [a["NodeID"] for a in alive_actors("JobStats")]
    assert stats == [head_id], f"JobStats on {stats}, not on the driver's node {head_id}"
    ids = [a["NodeID"] for a in alive_actors(ID_STAGE)]
    assert set(ids) <= {head_id}, f"the id stage on {ids}, not on the driver's node {head_id}"


def _cleanup(cluster, job, *nodes) -> None:
    """After a failure the job may still run: let it end before its nodes go (a job thread that
    outlives the test's Ray would start a Ray of its own)."""
    if job is not None:
        job.join(300)
    for node in nodes:
        if node is not None and node in cluster.worker_nodes:
            lose_node(cluster, node)


def _lose_worker_held(cluster, job: JobThread, worker, **spare_node) -> tuple[object, int]:
    """Hold the job's replicas (SIGSTOP), add the replacement node (`spare_node`: add_worker's
    arguments), lose `worker`, then release the replicas: the job cannot finish before the loss,
    however long a loaded machine takes to start a node. Returns the replacement node and the rows
    generated when the replicas were held."""
    held = hold_replicas()
    try:
        generated = job.rows_generated()
        assert job.is_alive() and generated < N_ROWS, "the job finished before its replicas were held"
        spare = add_worker(cluster, **spare_node)
        lose_node(cluster, worker)
    finally:
        release_replicas(held, lost_node_id=None if worker in cluster.worker_nodes else worker.node_id)
    return spare, generated


def test_worker_node_lost_mid_job_two_replicas(cluster, job_input, model_dirs, tmp_path, monkeypatch):
    """Both replica actors (Ray Data's, owning the coordinators) live on the worker, pinned there by
    a custom resource, with one draft/target pair on each node. The worker dies: both replica
    actors are restarted on the replacement node, build new coordinators, and the job goes on."""
    from raysd.jobs import pipeline

    inp, expected = job_input
    head_id = ray.get_runtime_context().get_node_id()
    monkeypatch.setattr(pipeline, "GENERATION_STAGE_OPTIONS", {"resources": {REPLICA_HOST: 0.01}})
    worker = add_worker(cluster, num_cpus=2, resources={REPLICA_HOST: 1})
    spare = job = None
    try:
        cfg = _config(inp, tmp_path / "out", model_dirs, replicas=2)
        job = JobThread(cfg)
        wait_for(lambda: len(placement_groups()) == 2 and job.rows_generated() >= MID_JOB, job, "both replicas at work")
        pair_nodes = sorted(sorted(set(pg["nodes"].values())) for pg in placement_groups())
        assert pair_nodes == sorted([[head_id], [worker.node_id]]), pair_nodes  # one pair per node
        _on_driver_node(head_id)
        replicas = alive_actors(VICTIMS["replica"])
        assert [a["NodeID"] for a in replicas] == [worker.node_id] * 2, replicas
        spare, generated = _lose_worker_held(cluster, job, worker, num_cpus=2, resources={REPLICA_HOST: 1})  # the replacement machine
        summary = job.result(timeout=400)
        assert summary.rows == N_ROWS and summary.rows_failed == 0
        _exactly_once(cfg.output, expected)
        # Ray 2.60 warns for these actors that their constructor arguments are in the object store
        # (ray#53727): they are, put there by the driver, on its node, which outlives the worker.
        # The restarts after the node's loss found them: the job finished on the restarted actors.
        print(f"lost the worker at {generated} of {N_ROWS} rows generated; {summary.text()}")
    finally:
        _cleanup(cluster, job, worker, spare)


def test_worker_node_lost_with_no_room_left_the_job_finishes_on_the_replica_left(cluster, job_input, model_dirs,
                                                                                  tmp_path):
    inp, expected = job_input
    worker = add_worker(cluster, num_cpus=2)  # room for one draft/target pair, as the head has
    job = None
    try:
        cfg = _config(inp, tmp_path / "out", model_dirs, replicas=2, placement_timeout_s=10)
        job = JobThread(cfg)
        wait_for(lambda: len(placement_groups()) == 2 and job.rows_generated() >= MID_JOB, job, "both replicas at work")
        held = hold_replicas()
        try:
            generated = job.rows_generated()
            assert job.is_alive() and generated < N_ROWS, "the job finished before its replicas were held"
            lose_node(cluster, worker)
        finally:
            release_replicas(held, lost_node_id=worker.node_id)
        summary = job.result(timeout=600)
        run = summary.latest_run
        assert summary.rows == N_ROWS and summary.rows_failed == 0, summary.text()
        _exactly_once(cfg.output, expected)
        assert (run.replicas_retired, run.passes) == (1, 2), summary.text()
        assert "could not place" in run.notes[0] or "could not be placed again" in run.notes[0], run.notes
        assert "replicas retired" in summary.text()
        print(f"lost the worker at {generated} of {N_ROWS} rows generated; {summary.text()}")
    finally:
        _cleanup(cluster, job, worker)


def test_worker_node_lost_mid_job_draft_and_target_spread(cluster, job_input, model_dirs, tmp_path):
    inp, expected = job_input
    head_id = ray.get_runtime_context().get_node_id()
    worker = add_worker(cluster, num_cpus=1)  # room for one model actor: the other goes on the head
    job = spare = None
    try:
        # STRICT_SPREAD: the two actors on two nodes whatever else holds a CPU when the group is
        # placed (under SPREAD, a Ray Data task on the worker at that moment put both on the head).
        cfg = _config(inp, tmp_path / "out", model_dirs, placement_strategy="STRICT_SPREAD", replica_shape="split")
        job = JobThread(cfg)
        wait_for(lambda: len(placement_groups()) == 1 and job.rows_generated() >= MID_JOB, job, "the replica at work")
        [pg] = placement_groups()
        assert pg["strategy"] == "STRICT_SPREAD" and set(pg["nodes"].values()) == {head_id, worker.node_id}, pg
        lost_actor = ("TargetActor", "DraftActor")[[n for _, n in sorted(pg["nodes"].items())].index(worker.node_id)]
        _on_driver_node(head_id)
        spare, generated = _lose_worker_held(cluster, job, worker, num_cpus=1)  # the lost actor's bundle goes there, not beside the other
        summary = job.result(timeout=400)
        assert summary.rows == N_ROWS and summary.rows_failed == 0
        _exactly_once(cfg.output, expected)
        print(f"lost the worker and the {lost_actor} on it at {generated} of {N_ROWS} rows generated; {summary.text()}")
    finally:
        _cleanup(cluster, job, worker, spare)
