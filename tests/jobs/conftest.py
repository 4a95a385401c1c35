"""Fixtures for the job tests: tiny random models saved as safetensors (no tokenizer, no
download), token-id prompts, and the session's local Ray (tests/conftest.py `local_ray`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable

import pytest

from tests.conftest import VOCAB, tiny_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft = root / "target", root / "draft"
    tiny_model("llama", seed=0).save_pretrained(target)
    tiny_model("llama", seed=1, layers=1).save_pretrained(draft)
    return str(target), str(draft)


def token_prompts(n: int, seed: int = 0, max_len: int = 8) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, max_len))] for _ in range(n)]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a driver started with start_new_session=True: its process group is the driver and
    the Ray it started. Then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def settled(read: Callable[[], object], quiet_s: float, max_wait_s: float = 90.0) -> object:
    """`read()` once it has stopped changing for `quiet_s`. After a driver is killed, a Ray worker
    that was inside a write task can still rename its part into place for a moment (it outlives
    the driver until it notices the raylet is gone): count parts only once they are settled."""
    value, since = read(), time.monotonic()
    deadline = since + max_wait_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.2)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def replica_processes() -> list:
    """The processes of this process's Ray that run a replica (Ray Data's GenerateReplica actor).
    Ray's actor table marks an actor dead when it starts to exit; its process can outlive that."""
    import psutil
    import ray
    from ray._private import ray_constants

    raylet = ray._private.worker._global_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    found = []
    for child in psutil.Process(raylet).children():
        try:
            if "GenerateReplica" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found
