"""Fixtures for the job tests: tiny random models saved as safetensors (no tokenizer, no
download), token-id prompts, and one local Ray shared by the in-process jobs."""

from __future__ import annotations

import pytest
import ray

from tests.conftest import VOCAB, tiny_model
from raysd.actors.local import start_local_ray


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft = root / "target", root / "draft"
    tiny_model("llama", seed=0).save_pretrained(target)
    tiny_model("llama", seed=1, layers=1).save_pretrained(draft)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def local_ray():
    # address="local": a fresh Ray even when /tmp/ray records a stale `ray start` head, which
    # a plain ray.init(num_cpus=...) would try to join (and fail).
    if not ray.is_initialized():
        start_local_ray(num_cpus=6, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def token_prompts(n: int, seed: int = 0, max_len: int = 8) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, max_len))] for _ in range(n)]
