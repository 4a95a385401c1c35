"""Fixtures for the actor tests."""

from __future__ import annotations

import pytest
import ray

from tests.actors.actor_helpers import start_ray


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray per test module that asks for it (`pytest.mark.usefixtures("local_ray")`)."""
    start_ray()
    yield
    ray.shutdown()
