"""Fault injection helpers shared by the chaos tests and bench/soak.py-style offline trials.

A trial runs a real `raysd.jobs.generate` job (in a background thread, on the test's local
Ray) or a real `python -m raysd generate` driver (a subprocess), SIGKILLs one process while
the job runs, and returns what the output holds. The randomized fault soak (`--soak-kills N`)
runs every job attempt as its own `python -m raysd generate --address ...` driver on the soak's
cluster, as a user's re-run would be.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from raysd.actors.local import start_local_ray
from tests.jobs.conftest import kill_group, settled

ROOT = Path(__file__).resolve().parents[2]

# Ray class names of the processes a fault kills. The generation stage's Ray Data actor is named
# after its operator: MapWorker(MapBatches(GenerateReplica)).
VICTIMS = {"target": "TargetActor", "draft": "DraftActor", "replica": "MapWorker(MapBatches(GenerateReplica))"}


def alive_pids(class_name: str) -> list[int]:
    """Pids of this Ray session's ALIVE actors of a class (straight from the GCS: works without the dashboard)."""
    import ray

    table = ray._private.state.actors()
    return sorted(a["Pid"] for a in table.values() if a["ActorClassName"] == class_name and a["State"] == "ALIVE" and a["Pid"])


def restarted_pid(class_name: str, killed: int) -> int | None:
    """The pid of a restarted actor of this class (any state now, NumRestarts > 0) other than `killed`."""
    import ray

    for a in ray._private.state.actors().values():
        if a["ActorClassName"] == class_name and a.get("NumRestarts", 0) > 0 and a["Pid"] and a["Pid"] != killed:
            return a["Pid"]
    return None


def alive_actors(class_name: str) -> list[dict]:
    """This Ray session's ALIVE actors of a class, from the GCS: Pid, NodeID, NumRestarts."""
    import ray

    table = ray._private.state.actors()
    return [{"Pid": a["Pid"], "NodeID": a["Address"]["NodeID"], "NumRestarts": a.get("NumRestarts", 0)}
            for a in table.values() if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]


# ---- a simulated multi-node cluster (ray.cluster_utils.Cluster: several raylets on this machine) ----

# The GCS declares a node dead after this many missed health checks: faster than Ray's defaults
# (so a test does not wait half a minute), not so fast that a pause of a loaded machine reads as a
# death. Every node gets a small object store: tiny jobs, and /dev/shm is shared with other work.
NODE_DEATH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                     "health_check_timeout_ms": 2000, "health_check_failure_threshold": 5}
OBJECT_STORE_BYTES = 100 * 2**20


def start_cluster(head_cpus: float):
    """A head node (this driver's: it connects to it) with `head_cpus` CPUs; add workers with add_worker."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": head_cpus, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False,
        "_system_config": {**NODE_DEATH_CHECKS, "worker_niceness": 0}})  # as docs/cluster.md says to
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    return cluster


def add_worker(cluster, num_cpus: float, resources: dict | None = None):
    node = cluster.add_node(num_cpus=num_cpus, resources=resources or {}, object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    return node


def lose_node(cluster, node) -> None:
    """A machine dies: SIGKILL its raylet and every process on it (no graceful shutdown)."""
    cluster.remove_node(node, allow_graceful=False)


def hold_replicas() -> list[dict]:
    """SIGSTOP the job's replica processes (the coordinators that drive every step): no row
    finishes while a test sets up a fault, however long a loaded machine takes to add a node. Their
    model actors wait on their next call, as between two steps. `release_replicas` ends the hold."""
    held = alive_actors(VICTIMS["replica"])
    for actor in held:
        os.kill(actor["Pid"], signal.SIGSTOP)
    return held


def release_replicas(held: list[dict], lost_node_id: str | None = None) -> None:
    """The held replicas go on (SIGCONT); those on a lost node die with it (SIGKILL: a stopped process
    would never notice that its raylet is gone)."""
    for actor in held:
        try:
            os.kill(actor["Pid"], signal.SIGKILL if actor["NodeID"] == lost_node_id else signal.SIGCONT)
        except ProcessLookupError:
            pass


def placement_groups() -> list[dict]:
    """The CREATED placement groups (the replicas' draft/target pairs): bundle index -> node id."""
    import ray

    return [{"strategy": pg["strategy"], "nodes": dict(pg["bundles_to_node_id"])}
            for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]


def part_rows(out: Path) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in sorted(Path(out).glob("part-*.parquet")))


@dataclass
class Outcome:
    fault: str
    rows_in: int
    rows_out: int = 0
    lost: int = 0
    duplicated: int = 0
    token_mismatches: int = 0
    error_rows: int = 0
    rows_written_at_kill: int = 0
    killed_pid: int | None = None
    restarted_pid: int | None = None
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def compare(outcome: Outcome, rows: list[dict], id_column: str, expected: dict) -> Outcome:
    """Fill lost / duplicated / mismatches from the output rows against the clean tokens by id."""
    ids = [r[id_column] for r in rows]
    outcome.rows_out = len(ids)
    outcome.duplicated = len(ids) - len(set(ids))
    outcome.lost = len(set(expected) - set(ids))
    got = {r[id_column]: r for r in rows}
    outcome.token_mismatches = sum(1 for k, toks in expected.items() if k in got and got[k]["generated_token_ids"] != toks)
    outcome.error_rows = sum(1 for r in rows if r["finish_reason"] == "error")
    return outcome


class JobThread(threading.Thread):
    """`raysd.jobs.generate(cfg)` in a background thread of this driver (on its connected Ray)."""

    def __init__(self, cfg):
        super().__init__(daemon=True)
        self.cfg, self.summary, self.error, self.stats = cfg, None, None, None
        self.start()

    def run(self) -> None:
        from raysd.jobs import generate, pipeline

        start_job_stats = pipeline.start_job_stats

        def keep_handle(*args, **kwargs):  # the job's JobStats, so that a fault can wait on its counts
            self.stats = start_job_stats(*args, **kwargs)
            return self.stats

        pipeline.start_job_stats = keep_handle
        try:
            self.summary = generate(self.cfg)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result() in the test's thread
            self.error = exc
        finally:
            pipeline.start_job_stats = start_job_stats

    def why(self) -> str:
        """What the job raised, with every cause (a Ray Data UDF failure wraps the actor's own
        exception and its remote traceback): a failed test says what failed, not only where."""
        if self.error is None:
            return "no error"
        return "".join(traceback.format_exception(self.error))

    def totals(self) -> dict:
        """The job's JobStats totals so far ({} before it exists or when it cannot answer)."""
        import ray

        try:
            return ray.get(self.stats.get.remote(), timeout=30) if self.stats is not None else {}
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return {}

    def rows_generated(self) -> int:
        return int(self.totals().get("rows_generated", 0))

    def result(self, timeout: float):
        """The job's summary once it ends; raises what the job raised."""
        self.join(timeout)
        assert not self.is_alive(), "the job hung"
        if self.error is not None:
            raise self.error
        return self.summary


def wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_for(condition, job: JobThread, what: str, timeout: float = 300) -> None:
    """Poll `condition()` until true while the job runs (a mid-job fault needs a running job)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.is_alive(), f"the job ended before {what}: {job.why()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def kill_actor_mid_job(cfg, fault: str, min_rows_written: int = 1, timeout: float = 300) -> tuple[Outcome, object]:
    """Run `cfg` in a thread; once `min_rows_written` rows are in parts, SIGKILL the fault's process.

    Returns (outcome without the comparison, the job's summary). Raises what the job raised.
    """
    out = Path(cfg.output)
    start = time.monotonic()
    job = JobThread(cfg)
    outcome = Outcome(fault, rows_in=0)
    victim = VICTIMS[fault]
    while True:
        assert job.is_alive(), f"the job ended before the {fault} kill: {job.why()}"
        assert time.monotonic() - start < timeout, "no rows written in time"
        pids = alive_pids(victim)
        if pids and part_rows(out) >= min_rows_written:
            break
        time.sleep(0.05)
    outcome.rows_written_at_kill = part_rows(out)
    outcome.killed_pid = pids[0]
    os.kill(pids[0], signal.SIGKILL)
    while job.is_alive() and outcome.restarted_pid is None:  # Ray brings a new one up while the job runs
        fresh = [p for p in alive_pids(victim) if p != outcome.killed_pid]
        outcome.restarted_pid = fresh[0] if fresh else None
        time.sleep(0.05)
    if outcome.restarted_pid is None:  # the job ended before a poll saw it: the GCS keeps the restarted actor's last pid
        outcome.restarted_pid = restarted_pid(victim, outcome.killed_pid)
    summary = job.result(timeout)
    outcome.wall_s = time.monotonic() - start
    return outcome, summary


_PROGRESS = re.compile(r"(\d+) rows generated, (\d+) written")

# The driver with its progress line every 0.2 s instead of 10 s, so the kill knows how many rows
# had been generated (and not yet written) at that moment.
_DRIVER = ("import sys, raysd.jobs.runner as r; r._PROGRESS_EVERY_S = 0.2; "
           "from raysd.cli import main; sys.exit(main(sys.argv[1:]))")


def kill_driver_mid_job(args: list[str], out: Path, min_rows_written: int = 1, timeout: float = 400) -> dict:
    """Start the driver (its own process group: the driver plus the Ray it starts), SIGKILL the group
    once a progress line reports at least `min_rows_written` rows written, re-run the same command.

    Returns {written_at_kill, generated_at_kill (last progress line), in_parts (rows in complete
    parts after the kill), killed_parts (their names), stray_parts (part-* files outside _tmp/ that
    are not Parquet parts), rerun: the re-run's summary}.
    """
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-c", _DRIVER, "generate", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    last = {"generated": 0, "written": 0}
    tail: list[str] = []
    killed = threading.Event()

    def watch():
        for line in proc.stderr:
            tail.append(line)
            del tail[:-50]
            m = _PROGRESS.search(line)
            if m:
                last["generated"], last["written"] = int(m.group(1)), int(m.group(2))
                if last["written"] >= min_rows_written and not killed.is_set():
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        if not killed.wait(timeout):
            raise AssertionError("no progress line with rows written in time: " + "".join(tail[-20:]))
    finally:
        kill_group(proc)
    in_parts = settled(lambda: part_rows(out), quiet_s=3)  # every part that counts reads whole
    killed_parts = sorted(p.name for p in Path(out).glob("part-*.parquet"))
    stray = sorted(p.name for p in Path(out).iterdir() if p.is_file() and p.name.startswith("part-")
                   and p.suffix != ".parquet")  # a half-written part lives under _tmp/, never beside them
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    return {"written_at_kill": last["written"], "generated_at_kill": last["generated"], "in_parts": in_parts,
            "killed_parts": killed_parts, "stray_parts": stray, "rerun": summary}


def main(argv: list[str] | None = None) -> int:
    """Offline trials for docs/reliability.md: python -m tests.reliability.chaos --trials 3 --rows 64."""
    import argparse
    import dataclasses
    import tempfile


    from raysd.core.sampling import SamplingParams
    from raysd.jobs import GenerateConfig
    from tests.conftest import tiny_model
    from tests.jobs.conftest import token_prompts
    from tests.jobs.test_generate import reference
    from tests.reliability.conftest import read_rows

    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--faults", default="target,draft,replica,driver")
    p.add_argument("--soak-kills", type=int, default=0,
                   help="run the randomized fault soak instead: jobs on a simulated two-node cluster, "
                        "killed at random times until this many kills were made")
    p.add_argument("--kills-per-job", type=int, default=6)
    p.add_argument("--min-gap-s", type=float, default=1.0, help="soak: least time between two kills")
    p.add_argument("--max-gap-s", type=float, default=6.0, help="soak: most time between two kills")
    p.add_argument("--seed", type=int, default=0, help="soak: the random choices of victims and times")
    p.add_argument("--json", default=None, help="soak: append every kill and round as JSON lines here")
    p.add_argument("--job-timeout-s", type=float, default=900.0,
                   help="soak: a job attempt's driver still running this long after its start is killed (a hang)")
    a = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="raysd-chaos-"))
    target, draft = root / "target", root / "draft"
    tiny_model("llama", seed=0).save_pretrained(target)
    tiny_model("llama", seed=1, layers=1).save_pretrained(draft)
    prompts = token_prompts(a.rows, seed=11)
    inp = root / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"key": f"k{i:05d}", "prompt": q}) + "\n" for i, q in enumerate(prompts)))
    ref = reference(str(target), str(draft), prompts, [SamplingParams(max_new_tokens=a.max_new_tokens)] * a.rows)
    expected = {f"k{i:05d}": t for i, t in enumerate(ref)}
    if a.soak_kills:
        return soak_main(a, root, inp, expected, target, draft)
    faults = a.faults.split(",")
    actor_faults = [f for f in faults if f != "driver"]
    if actor_faults:
        start_local_ray(num_cpus=6, log_to_driver=False, configure_logging=False)
    for trial in range(a.trials):
        for fault in faults:
            out = root / f"out-{fault}-{trial}"
            try:
                if fault == "driver":
                    args = ["--input", str(inp), "--output", str(out), "--id-column", "key", "--target", str(target),
                            "--draft", str(draft), "-k", "4", "--max-new-tokens", str(a.max_new_tokens), "--batch-size", "4",
                            "--rows-per-file", "4", "--json"]
                    got = kill_driver_mid_job(args, out)
                    o = compare(Outcome("driver", a.rows), read_rows(out), "key", expected)
                    o.rows_written_at_kill = got["in_parts"]
                    o.extra = {"generated_at_kill": got["generated_at_kill"], "rerun_rows": got["rerun"]["rows_this_run"],
                               "regenerated_in_flight": max(0, got["generated_at_kill"] - got["in_parts"])}
                else:
                    cfg = GenerateConfig(input=str(inp), output=str(out), id_column="key", target=str(target), draft=str(draft),
                                         max_new_tokens=a.max_new_tokens, batch_size=4, rows_per_file=4, quiet=True,
                                         num_speculative_tokens=4)
                    o, _ = kill_actor_mid_job(cfg, fault)
                    o.rows_in = a.rows
                    o = compare(o, read_rows(out), "key", expected)
                print(json.dumps({"trial": trial, "outcome": "ok", **dataclasses.asdict(o)}), flush=True)
            except Exception as exc:  # noqa: BLE001 - a failed trial is a figure too
                print(json.dumps({"trial": trial, "fault": fault, "outcome": f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
    return 0


# ---- the randomized fault soak: not a CI test, figures for docs/reliability.md ----

SOAK_VICTIMS = ("target", "draft", "replica", "write", "stats", "node")


def _write_task_pids() -> list[int]:
    """This cluster's Ray workers running a write task now: Ray titles a worker by its task
    (`ray::Write`). Only processes this driver started (its nodes' raylets and their workers):
    other Rays on the machine are not ours to kill."""
    import psutil

    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title.startswith("ray::Write"):
            pids.append(proc.pid)
    return sorted(pids)


def _alive_actor_ids(class_name: str) -> set[str]:
    import ray

    return {i for i, a in ray._private.state.actors().items() if a["ActorClassName"] == class_name and a["State"] == "ALIVE"}


class DriverJob:
    """One job attempt as its own driver process, `python -m raysd generate ... --address A --json`,
    as a user runs it (the CLI, `ray job submit`): when it ends, failed or not, Ray ends the actors
    and placement groups it owned (a failed job's replica actors included, which Ray Data may leave
    running in a driver that lives on). stdout and stderr go to `log` + .out / .err.

    Has the part of JobThread's interface the soak uses: is_alive(), join(timeout), error, summary.
    """

    def __init__(self, args: list[str], address: str, log: Path):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.out_path, self.err_path = log.with_suffix(".out"), log.with_suffix(".err")
        self.started = time.monotonic()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            # Its own process group: a hung driver is SIGKILLed with anything it started.
            self.proc = subprocess.Popen([sys.executable, "-m", "raysd", "generate", *args, "--address", address,
                                          "--json", "--quiet"], cwd=ROOT, env=env, stdout=out, stderr=err,
                                         start_new_session=True)
        self.summary: dict | None = None
        self.error: str | None = None
        self.wall_s = 0.0
        self.connected_s: float | None = None  # from the start to the job's JobStats being up (the soak's kills wait for it)

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        self._finish()

    def kill(self, why: str) -> None:
        """SIGKILL the driver's process group (a hung job); Ray then ends the job's actors and groups."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(60)
        self._finish()
        self.error = why

    def _finish(self) -> None:
        if self.wall_s:
            return
        self.wall_s = round(time.monotonic() - self.started, 1)
        rc = self.proc.returncode
        lines = self.out_path.read_text().strip().splitlines()
        if rc == 0 and lines:
            try:
                self.summary = json.loads(lines[-1])
                return
            except json.JSONDecodeError:
                pass
        if rc is not None and rc < 0:
            self.error = f"driver killed by signal {-rc}"
            return
        err = [line.strip() for line in self.err_path.read_text().splitlines() if line.strip()]
        said = [line for line in err if line.startswith("raysd generate:")]  # the CLI's one-line failure
        last = said[-1] if said else (err[-1] if err else "")
        self.error = f"driver exit {rc}: {last[:400]}"


class FaultSoak:
    """Jobs on a simulated two-node cluster (head: the drivers' node, plus one worker), each killed at
    random times, by victim chosen at random, until it ends; a job that fails is re-run (it resumes).

    Every job attempt is its own driver process (DriverJob), connected to the cluster; this process
    only starts the cluster, kills and reads the outputs. A node kill first adds a replacement worker
    (as an autoscaler would), then SIGKILLs the old worker's raylet and everything on it. Every
    job's output is compared with the clean tokens.
    """

    def __init__(self, cluster, worker, rng, log):
        self.cluster, self.worker, self.rng, self.log = cluster, worker, rng, log
        self.driver: DriverJob | None = None  # the running attempt, for a clean stop

    def kill(self, victim: str) -> dict | None:
        """Kill one process (or the worker node) of kind `victim`; None if there is none right now."""
        if victim == "node":
            replacement = add_worker(self.cluster, num_cpus=2)
            old, self.worker = self.worker, replacement
            lose_node(self.cluster, old)
            return {"victim": "node", "node": old.node_id[:8]}
        if victim == "write":
            pids = _write_task_pids()
        elif victim == "stats":
            pids = alive_pids("JobStats")
        else:
            pids = alive_pids(VICTIMS[victim])
        if not pids:
            return None
        pid = self.rng.choice(pids)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return {"victim": victim, "pid": pid}

    def run_job(self, args: list[str], log: Path, max_kills: int, gap_s: tuple[float, float],
                wait_s: float = 30.0, timeout_s: float = 900.0) -> tuple[list[dict], list[str], DriverJob]:
        """One job attempt (a new driver) with kills at random times until it ends: (kills, victims
        missed, the ended DriverJob: its .error is None when it finished).

        Each kill picks its kind at random, then waits (up to `wait_s`) for a process of that kind:
        right after a node's loss, say, the model actors are restarting and there is none to kill.
        Taking whatever kind is alive instead would skew the kills toward the always-present
        ones (the node, JobStats). A driver still running `timeout_s` after its start is killed
        (its process group) and counts as a failed attempt ("the job hung")."""
        known = {a for a in _alive_actor_ids("JobStats")}
        job = self.driver = DriverJob(args, self.cluster.address, log)
        kills: list[dict] = []
        missed: list[str] = []
        # The kills start once the job is on Ray (its JobStats is up), not while the new driver
        # process imports torch: an in-process job is there at once.
        while max_kills and job.is_alive() and not _alive_actor_ids("JobStats") - known:
            job.join(0.2)
        if max_kills:
            job.connected_s = round(time.monotonic() - job.started, 1)
        while job.is_alive() and len(kills) < max_kills:
            job.join(self.rng.uniform(*gap_s))
            victim = self.rng.choice(SOAK_VICTIMS)
            deadline = time.monotonic() + wait_s
            done = None
            while job.is_alive() and done is None and time.monotonic() < deadline:
                done = self.kill(victim)
                if done is None:
                    time.sleep(0.1)
            if done is None:
                if job.is_alive():
                    missed.append(victim)  # none of that kind within wait_s: not counted as a kill
                    self.log({"missed": victim})
                continue
            done["t"] = round(time.monotonic(), 1)
            kills.append(done)
            self.log({"kill": done})
        job.join(max(1.0, timeout_s - (time.monotonic() - job.started)))
        if job.is_alive():
            job.kill(f"the job hung (driver killed after {timeout_s:.0f}s)")
        self.driver = None
        return kills, missed, job

    def stop(self) -> None:
        if self.driver is not None and self.driver.is_alive():
            self.driver.kill("soak stopped")


def soak_main(a, root: Path, inp: Path, expected: dict, target: Path, draft: Path) -> int:
    """The randomized fault soak: rounds of one job each until `a.soak_kills` kills were made.

    A round's first attempt and every re-run are separate driver processes (`python -m raysd
    generate --address <the soak's cluster>`), as a user's would be; a re-run resumes the output."""
    import dataclasses
    import random

    import ray

    from tests.reliability.conftest import read_rows

    rng = random.Random(a.seed)
    records: list[dict] = []
    sink = open(a.json, "a") if a.json else None

    def log(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if sink is not None:
            sink.write(line + "\n")
            sink.flush()

    cluster = start_cluster(head_cpus=2)  # this process connects too: it reads the GCS's actor table
    worker = add_worker(cluster, num_cpus=2)

    def stop(signum, frame):  # SIGTERM: end the running driver, then the cluster (finally below)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
        raise SystemExit(f"soak stopped by signal {signum}")

    # Set after the cluster's start: Ray's head node installs its own handler, which drains the
    # head for 30 s and leaves the worker nodes and the running driver to chance.
    signal.signal(signal.SIGTERM, stop)
    soak = FaultSoak(cluster, worker, rng, log)
    node = getattr(ray._private.worker, "_global_node", None)  # the session dir names this soak's Ray processes
    log({"soak": {"cluster": cluster.address, "session_dir": node.get_session_dir_path() if node else None,
                  "pid": os.getpid(), "workdir": str(root), "argv": sys.argv[1:]}})
    kills = 0
    started = time.monotonic()
    try:
        round_no = 0
        while kills < a.soak_kills:
            out = root / f"soak-{round_no}"
            args = ["--input", str(inp), "--output", str(out), "--id-column", "key", "--target", str(target),
                    "--draft", str(draft), "-k", "4", "--max-new-tokens", str(a.max_new_tokens), "--batch-size", "4",
                    "--rows-per-file", "8", "--replicas", "2"]
            made, missed, job = soak.run_job(args, root / f"driver-{round_no}-0", min(a.kills_per_job, a.soak_kills - kills),
                                             (a.min_gap_s, a.max_gap_s), timeout_s=a.job_timeout_s)
            kills += len(made)
            error = job.error
            attempts = [{"kills": len(made), "error": error, "wall_s": job.wall_s, "connected_s": job.connected_s}]
            reruns, rerun_errors = 0, []
            while error is not None and reruns < 3:  # the same command again, a new driver: it resumes
                reruns += 1
                rerun_errors.append(error)
                before = part_rows(out)
                job = soak.run_job(args, root / f"driver-{round_no}-{reruns}", 0, (0, 0), timeout_s=a.job_timeout_s)[2]
                error = job.error
                s = (job.summary or {}).get("latest_run") or {}
                attempts.append({"kills": 0, "error": error, "wall_s": job.wall_s, "rows_in_parts_before": before,
                                 "rows_this_run": s.get("rows"), "rows_skipped": s.get("rows_skipped"),
                                 "resumed": error is None and s.get("rows") == len(expected) - before})
            o = compare(Outcome("soak", len(expected)), read_rows(out), "key", expected)
            record = {"round": round_no, "kills": [k["victim"] for k in made], "missed": missed, "survived": reruns == 0,
                      "reruns": reruns, "failed": error, "errors": rerun_errors, "attempts": attempts,
                      **{k: v for k, v in dataclasses.asdict(o).items() if k in ("rows_in", "rows_out", "lost", "duplicated", "token_mismatches", "error_rows")},
                      "elapsed_s": round(time.monotonic() - started, 1)}
            records.append(record)
            log({"round_done": record})
            round_no += 1
    finally:
        soak.stop()
        if records:  # also when stopped early: the table of the rounds that ended
            log({"table": soak_table(records), "wall_s": round(time.monotonic() - started, 1),
                 "complete": kills >= a.soak_kills})
        ray.shutdown()
        cluster.shutdown()
        if sink is not None:
            sink.close()
    return 0


def soak_table(records: list[dict]) -> dict:
    """The figures of docs/reliability.md's fault soak table."""
    per_victim: dict[str, int] = {}
    for r in records:
        for v in r["kills"]:
            per_victim[v] = per_victim.get(v, 0) + 1
    missed: dict[str, int] = {}
    for r in records:
        for v in r.get("missed", []):
            missed[v] = missed.get(v, 0) + 1
    return {"kills": sum(per_victim.values()), "kills_by_victim": per_victim, "missed_by_victim": missed,
            "jobs": len(records),
            "jobs_survived": sum(r["survived"] for r in records),
            "jobs_resumed_by_rerun": sum(1 for r in records if not r["survived"] and r["failed"] is None),
            "reruns": sum(r["reruns"] for r in records),
            "reruns_that_resumed": sum(1 for r in records for t in r.get("attempts", [])[1:] if t.get("resumed")),
            "jobs_failed_after_reruns": sum(1 for r in records if r["failed"] is not None),
            "rows_lost": sum(r["lost"] for r in records), "rows_doubled": sum(r["duplicated"] for r in records),
            "token_mismatches": sum(r["token_mismatches"] for r in records),
            "error_rows": sum(r["error_rows"] for r in records)}


if __name__ == "__main__":
    sys.exit(main())
