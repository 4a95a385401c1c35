"""Start a private Ray on this machine that only this machine can reach, its workers at normal priority."""

from __future__ import annotations

import ipaddress
import os


class LocalRayNotLoopback(RuntimeError):
    """The Ray we started took a routable node address, so its servers would face the network."""


# Ray's single-machine mode (its default on macOS and Windows): every Ray process takes the
# loopback address as the node's IP, and the GCS, raylet, workers and agents listen on it alone.
# `_node_ip_address="127.0.0.1"` is not enough on Linux: ray.init rewrites a loopback address to
# the host's routable one, and the servers then listen on all interfaces.
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# The GCS keeps the events of the last N tasks, for `ray.timeline()` and the state API (whose
# dashboard is off here). With Ray's default of 100,000, bench/soak.py's GCS grew by about 0.9 KB
# per generated row, without end in sight; with 1,000 kept, by 0.1 KB per row in the second half
# of 30,000 rows (docs/reliability.md). raysd's per-step actor calls record no events, so the
# last 1,000 tasks are all Ray Data's and span thousands of rows, enough to debug with.
TASK_EVENTS_KEPT_IN_GCS = 1_000

# Ray starts its worker processes (every actor and task, the model actors included) at nice 15 by
# default, below anything else the machine runs: on a busy machine a model actor then gets a few
# percent of a core, and a GPU's model actor leaves its GPU idle between the kernels it cannot
# launch in time. A Ray started for a job runs them at the priority of ordinary processes. On a
# cluster of one's own, `ray start` takes the same setting (docs/cluster.md).
WORKER_NICENESS = 0

# Ray gives a new raylet a fixed 30 s to register with the GCS (ray/_private/node.py), which a
# machine busy with other work can miss; starting again is then all there is to do.
START_ATTEMPTS = 3


def start_local_ray(**init_kwargs) -> None:
    """Start a new private Ray on this machine, reachable from this machine only, dashboard off,
    workers at nice WORKER_NICENESS, its GCS bounded in the task events it keeps (a `_system_config`
    passed in wins). A raylet that misses Ray's registration deadline is started again, up to
    START_ATTEMPTS times in all.

    Raises LocalRayNotLoopback if Ray still picked a non-loopback node address (a Ray upgrade that
    changed the mode above): the caller asked for a local Ray, not one open to the network.
    """
    import ray
    from ray._private import ray_constants

    system_config = {"task_events_max_num_task_in_gcs": TASK_EVENTS_KEPT_IN_GCS, "worker_niceness": WORKER_NICENESS,
                     **init_kwargs.pop("_system_config", {})}

    saved_env, saved_flag = os.environ.get(LOOPBACK_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ONLY_ENV] = "0"  # read at import by every process Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # ...and by this driver, which imported ray already
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                # address="local": always a new Ray, never a stale `ray start` one recorded in /tmp/ray.
                ray.init(address="local", include_dashboard=False, _system_config=system_config, **init_kwargs)
                break
            except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this one
                if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                    raise
                ray.shutdown()
    finally:  # the started processes keep the mode; later ray.init calls in this process do not
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOOPBACK_ONLY_ENV, None)
        else:
            os.environ[LOOPBACK_ONLY_ENV] = saved_env
    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        ray.shutdown()
        raise LocalRayNotLoopback(f"the local Ray took node address {node_ip}, not loopback; to run Ray "
                                  f"on a network, start it yourself (ray start --head) and connect to it")


ORPHAN_WATCH_THREAD = "raysd-orphan-watch"


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """In a Ray worker process (an actor): exit at once when the raylet that started it is gone.

    A worker whose raylet dies (its driver killed, its local Ray shut down, its node lost) runs
    Ray's exit path, `ray.shutdown()`, and in Ray 2.60 that tears down every compiled graph the
    process drives, waiting on a cluster that no longer answers: the process then spins a core
    for ever, orphaned. A daemon thread watching the parent process ends it instead. Idempotent;
    nothing outside an actor (a driver keeps its own parent).
    """
    import threading
    import time

    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    if any(t.name == ORPHAN_WATCH_THREAD for t in threading.enumerate()):
        return
    parent = os.getppid()  # the raylet

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name=ORPHAN_WATCH_THREAD, daemon=True).start()
