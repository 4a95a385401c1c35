"""Shared pieces of the actor tests: a local Ray, picklable tiny-model factories, references."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time

import pytest
import ray
import torch

import tests.conftest as conftest
from raysd.core.sampling import SamplingParams
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_model

# Ray workers cannot import the tests' conftest module; ship tiny_model by value.
ray.cloudpickle.register_pickle_by_value(conftest)


def factory(arch: str = "llama", seed: int = 0, vocab: int = VOCAB):
    return functools.partial(tiny_model, arch, seed, vocab=vocab)


def random_prompts(n: int, seed: int = 0, vocab: int = VOCAB, max_len: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def requests(prompts, **params) -> list[Request]:
    """One request per prompt; `seed` defaults to the request's index."""
    return [Request(i, p, SamplingParams(**{"seed": i, **params})) for i, p in enumerate(prompts)]


def greedy_and_sampled(prompts, max_new_tokens: int = 12) -> tuple[list[Request], list[Request]]:
    """The first half of `prompts` greedy (ids 0..), the second half seeded samples at T = 0.9,
    top-k 20 (ids 10..): the exactness tests' mix of both regimes."""
    half = len(prompts) // 2
    greedy = requests(prompts[:half], max_new_tokens=max_new_tokens)
    sampled = [Request(10 + i, p, SamplingParams(temperature=0.9, top_k=20, seed=200 + i, max_new_tokens=max_new_tokens))
               for i, p in enumerate(prompts[half:])]
    return greedy, sampled


def assert_same_stats(got, expected, vocab: int = VOCAB) -> None:
    """Two runs' per-row statistics: every count equal, and `overlap_sum` equal up to float32
    rounding. The overlap of a tested position is a float32 sum of min(target_probs, draft_probs)
    over the vocabulary, and a model actor computes with its own thread count (its threads plus
    those the idle side lends, raysd.actors.model_actors.borrowed_threads), so its GEMMs sum in
    another order than the test process's: a few float32 ulps per probability (seen: 4e-7 over 19
    positions, where a wrong token moves a position's overlap by ~0.1). Bound: 4 x vocab x eps per
    tested position."""
    assert len(got) == len(expected)
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(got, expected):
        assert dataclasses.replace(a, overlap_sum=0.0) == dataclasses.replace(b, overlap_sum=0.0)
        assert a.overlap_sum == pytest.approx(b.overlap_sum, rel=0, abs=4 * vocab * eps * b.num_tested_positions)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def kill_mid_generate(coordinator, reqs, pid: int, after_steps: int = 4, timeout_s: float = 240.0,
                      raise_error: bool = False):
    """`coordinator.generate(reqs)` in a thread, process `pid` SIGKILLed once `after_steps` more
    micro-batch steps have completed; the run's RunOutput (the call must finish within `timeout_s`).
    `raise_error`: what the run raised is raised here."""
    box = {}

    def run():
        try:
            box["out"] = coordinator.generate(reqs)
        except Exception as exc:  # noqa: BLE001 - handed to the test's thread
            box["error"] = exc

    runner = threading.Thread(target=run)
    start = coordinator.steps_completed
    runner.start()
    deadline = time.monotonic() + 60
    while coordinator.steps_completed < start + after_steps and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=timeout_s)
    assert not runner.is_alive(), "generate did not finish after the kill"
    if "error" in box and raise_error:
        raise box["error"]
    assert "error" not in box, box.get("error")
    return box["out"]
