"""Turn-taking between the model actors (raysd.actors.turns): borrowed threads, the doorbell, and a
draft actor that lends its threads to a plain run and sleeps until the target rings."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import time

import pytest
import torch

from raysd.actors.model_actors import DrafterSpec, DraftWorker, MicroBatchStateLost, StepCall, TargetWorker, borrowed_threads
from raysd.actors.turns import Doorbell, Ringer
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig, StepCosts
from raysd.engine.requests import Admission
from tests.actors.actor_helpers import random_prompts, requests
from tests.conftest import EOS, VOCAB, tiny_model

pytestmark = pytest.mark.skipif(not Doorbell.available(), reason="the doorbell is Linux's abstract socket namespace")


def test_borrowed_threads_add_to_the_own_and_give_them_back():
    own = torch.get_num_threads()
    with borrowed_threads(2):
        assert torch.get_num_threads() == own + 2
    assert torch.get_num_threads() == own
    with pytest.raises(RuntimeError), borrowed_threads(1):
        raise RuntimeError("the run failed")
    assert torch.get_num_threads() == own
    with borrowed_threads(0):
        assert torch.get_num_threads() == own


def test_a_doorbell_sleeps_until_rung_from_another_process():
    bell = Doorbell()
    try:
        t0 = time.perf_counter()
        assert not bell.wait(0.05)  # nobody rang: the timeout
        assert time.perf_counter() - t0 >= 0.05
        ring = f"from raysd.actors.turns import Ringer; import time; time.sleep(0.3); Ringer().ring({bell.address!r})"
        proc = subprocess.Popen([sys.executable, "-c", ring])
        t0 = time.perf_counter()
        assert bell.wait(30.0)  # woken by the ring, long before the timeout
        assert time.perf_counter() - t0 < 20.0
        proc.wait(timeout=30)
        Ringer().ring(bell.address)
        bell.clear()  # a stale ring (a run that ended after its wait timed out) ends no later wait
        assert not bell.wait(0.01)
    finally:
        bell.close()
    Ringer().ring(bell.address)  # nobody listens there any more: not an error


def test_a_doorbell_waits_for_its_ticket_or_a_later_one():
    """The coordinator's wait (`wait_for`): a ring for an earlier call (abandoned after a failure)
    does not end it, the call's own or a later one's does (calls end in order)."""
    bell, ringer = Doorbell(), Ringer()
    try:
        ringer.ring(bell.address, 4)
        assert not bell.wait_for(5, 0.05)  # only ticket 4 rang: the timeout
        ringer.ring(bell.address, 5)
        assert bell.wait_for(5, 30.0)
        ringer.ring(bell.address, 8)
        assert bell.wait_for(6, 30.0) and not bell.wait_for(9, 0.01)
    finally:
        bell.close()


def _first_call(spec, prompts, lend: bool = False) -> StepCall:
    reqs = requests(prompts, max_new_tokens=12)
    return StepCall(0, Admission.of(spec, VOCAB, [512]).spec, None, tuple(enumerate(reqs)), max_steps=8, lend_threads=lend)


def test_a_draft_actor_lends_its_threads_to_a_plain_run_and_rests_until_rung():
    """In process: a controller that plans K = 0 (drafting never pays under these costs) asks for a
    plain run; asked to lend, the proposal carries the draft actor's threads and its doorbell, the
    target runs the steps on them, and `rest` returns once the target has rung, well before its timeout."""
    costs = StepCosts((1, 4), ((1.0, 5.0, 5.0, 5.0, 5.0),) * 2, (5.0, 5.0))  # a draft dearer than the target
    spec = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), adaptive=AdaptiveConfig(costs))
    prompts = random_prompts(3, seed=5)
    draft = DraftWorker(DrafterSpec(functools.partial(tiny_model, "llama", 1)), VOCAB)
    target = TargetWorker(functools.partial(tiny_model, "llama", 0))
    assert draft.info().lends_threads
    lent = draft.propose(_first_call(spec, prompts, lend=True))
    assert lent.plan.k == 0 and lent.steps > 1
    assert lent.lent_threads == torch.get_num_threads() and lent.doorbell == draft.doorbell.address
    verdict, timings = target.step(_first_call(spec, prompts), lent)
    assert timings.steps >= 1 and timings.borrowed_steps == timings.steps
    t0 = time.perf_counter()
    draft.rest(lent)  # rung at the run's end: returns at once
    assert time.perf_counter() - t0 < Doorbell.MIN_TIMEOUT_S
    # Not asked to lend (two micro-batches, or another node): nothing lent, no rest.
    other = DraftWorker(DrafterSpec(functools.partial(tiny_model, "llama", 1)), VOCAB)
    kept = other.propose(_first_call(spec, prompts))
    assert kept.steps > 1 and kept.lent_threads == 0 and kept.doorbell is None
    other.rest(kept)
    # A drafting step lends too: the draft actor idles through the target's verification as well.
    fixed = SpeculationConfig(num_speculative_tokens=3, eos_token_ids=(EOS,))
    drafting = other.propose(_first_call(fixed, prompts, lend=True))
    assert drafting.plan.k == 3 and drafting.steps == 1 and drafting.lent_threads == torch.get_num_threads()


def test_the_target_rings_the_callers_doorbell_as_each_call_ends_a_failed_one_too():
    """The coordinator sleeps through a call on its doorbell (GraphTransport.caller_doorbell): the
    target rings it with the call's ticket when the call returns, and when it raises (here: a micro-
    batch whose state this process does not have, as after a restart), so a failure is read at once."""
    spec = SpeculationConfig(num_speculative_tokens=0, eos_token_ids=(EOS,))
    target = TargetWorker(functools.partial(tiny_model, "llama", 0), drafter=DrafterSpec(None))
    bell = Doorbell()
    try:
        call = dataclasses.replace(_first_call(spec, random_prompts(2, seed=3)), caller_doorbell=bell.address, ticket=7)
        verdict, timings = target.step(call)
        assert timings.steps >= 1 and bell.wait_for(7, 0.0)
        lost = StepCall(3, caller_doorbell=bell.address, ticket=8)
        with pytest.raises(MicroBatchStateLost):
            target.step(lost)
        assert bell.wait_for(8, 0.0)
        target.step(dataclasses.replace(call, spec=None, new_rows=(), ticket=9, caller_doorbell=None))
        assert not bell.wait_for(9, 0.05)  # a call without a doorbell rings none
    finally:
        bell.close()
