"""Whether a model actor is alive, asked of Ray, and waits that last exactly as long as it is.

A slow actor is not a dead one. A model actor's first call may load a model, convert a GGUF file,
compile, capture CUDA graphs or prefill a long prompt, and a busy machine slows all of it; no fixed
read deadline can tell that from a death. So raysd never infers a death from a timeout: it asks
the GCS's actor table (ALIVE, RESTARTING, DEAD and the death's cause), and Ray itself ends a
step's wait when an actor of the step graph dies (the graph's monitor tears the graph down and
the read raises). The waits here are unbounded while the actor is alive or restarting, and end
with `ActorDead`, naming the cause, once Ray gives it up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import ray

POLL_S = 1.0  # between two looks at an actor that cannot answer yet

# The limits raysd sets on a job's path, as defaults (each named in docs/reliability.md, "Waits
# and limits", with the setting that changes it):
# - Placing a replica's bundles takes moments where the cluster has room; beyond a few minutes it
#   has none (a fixed-size cluster that lost a node), or an autoscaler is slower than this, and the
#   replica retires (CoordinatorConfig.placement_timeout_s, `--placement-timeout`).
PLACEMENT_TIMEOUT_S = 180.0
# - A tensor-parallel group's join and collectives (torch.distributed needs a finite limit): far
#   beyond any one step, so that only a rank that stopped answering runs into it
#   (CoordinatorConfig.group_timeout_s).
GROUP_TIMEOUT_S = 1800.0
# - A draft actor looks this long for its target's name before it concludes the target is gone:
#   the name is missing only while a tensor-parallel target's ranks are started afresh (moments).
TARGET_NAME_WAIT_S = 60.0


class ActorDead(RuntimeError):
    """A model actor that Ray will not bring back (its restarts used up, its constructor failed, or
    killed for good): the message names it and the cause Ray recorded."""


@dataclass(frozen=True)
class ActorState:
    """One actor's row of the GCS actor table."""

    state: str  # DEPENDENCIES_UNREADY, PENDING_CREATION, ALIVE, RESTARTING or DEAD ("" when unknown)
    restarts: int
    death_cause: str  # one line; "" unless DEAD

    @property
    def dead(self) -> bool:
        return self.state == "DEAD"


def actor_state(actor) -> ActorState:
    """The GCS's record of `actor` (a handle), read directly (no dashboard needed)."""
    import ray

    info = ray._private.state.actors(actor._actor_id.hex())
    if not info:
        return ActorState("", 0, "")
    return ActorState(info["State"], int(info.get("NumRestarts", 0)), death_line(info.get("DeathCause")))


def death_line(cause) -> str:
    """Ray's recorded cause of an actor's death (an ActorDeathCause message) in one line."""
    if cause is None:
        return ""
    kind = cause.WhichOneof("context")
    if kind is None:
        return ""
    context = getattr(cause, kind)
    message = getattr(context, "error_message", "") or ""
    if kind == "creation_task_failure_context":
        message = "its constructor raised (see the actor's log)"
    message = message.split(" Some common causes", 1)[0].strip()
    return f"{kind.removesuffix('_context')}: {message}" if message else kind.removesuffix("_context")


def answer(submit: Callable[[], "ray.ObjectRef"], actor, role: str, check: Callable[[], None] | None = None):
    """The result of `submit()` (one method call on `actor`), waited for as long as Ray says the
    actor is alive or restarting: a call that fails because the actor died is made again once Ray
    has brought it back, and a slow one is waited for, however long. Raises ActorDead once Ray
    gives the actor up, and what the call raises otherwise (e.g. a constructor's error, with
    Ray's actor_init_failed). `check()`, called every POLL_S while waiting, may raise to stop
    waiting (e.g. an actor whose placement group lost its node, pending for ever)."""
    import ray
    from ray.exceptions import RayActorError

    ref = submit()
    while True:
        ready, _ = ray.wait([ref], timeout=POLL_S)
        if ready:
            try:
                return ray.get(ref)
            except RayActorError as exc:
                if getattr(exc, "actor_init_failed", False):
                    raise
                _raise_if_dead(actor, role, exc)
                time.sleep(POLL_S)
                ref = submit()
                continue
        _raise_if_dead(actor, role)
        if check is not None:
            check()


def _raise_if_dead(actor, role: str, exc: BaseException | None = None) -> None:
    state = actor_state(actor)
    if state.dead:
        cause = state.death_cause or (last_line(exc) if exc is not None else "")
        raise ActorDead(f"the {role} actor is dead: {cause}") from exc


def wait_until_dead(actor) -> None:
    """After `ray.kill(actor, no_restart=True)`: until the GCS records the death (its name is free then)."""
    while not actor_state(actor).dead:
        time.sleep(POLL_S / 5)


def last_line(exc: BaseException) -> str:
    """An exception's last non-empty line (Ray's errors end with their cause)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
