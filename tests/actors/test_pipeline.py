"""End to end through a local Ray, for both replica shapes (raysd.actors.settings.replica_shape):
the draft model in the target's actor (colocated) and in an actor of its own (split) give the
single-process engine's tokens (greedy and seeded sampling), refill slots, keep the target
distribution and survive a killed actor; the split shape reports its bytes and overlap."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
import ray
import torch

from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator
from raysd.actors.launch import PlacementFailed
from raysd.actors.wire import ReplicaGaveUp, StepTimedOut
from raysd.core.sampling import SamplingParams, SamplingTensors, logits_to_probs
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, FeatureDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.actors.actor_helpers import assert_same_stats, factory, greedy_and_sampled, hf_greedy, kill_mid_generate, random_prompts, requests
from tests.conftest import EOS, VOCAB, tiny_eagle, tiny_model
from tests.core.test_distribution import chi_square_pvalue

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]  # tests/actors/conftest.py
CPU = ActorResources(num_cpus=1, num_gpus=0)
K = 4
SHAPES = ["colocated", "split"]


def _coordinator(draft: DrafterSpec, k=K, micro_batch_size=3, target=factory("llama", 0), micro_batches=None,
                 **config) -> SpecCoordinator:
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,))
    cfg = CoordinatorConfig(speculation, micro_batch_size=micro_batch_size, num_micro_batches=micro_batches,
                            draft_resources=CPU, target_resources=CPU, **config)
    return SpecCoordinator(target, draft, cfg)


@pytest.fixture(scope="module", params=SHAPES)
def random_draft(request):
    """A random draft model beside the target (one micro-batch) or in an actor of its own (two)."""
    with _coordinator(DrafterSpec(factory("llama", 1), shape=request.param)) as c:
        assert c.shape == request.param and (c.draft is None) == (request.param == "colocated")
        yield c


def _engine(drafter, k=K, batch=3, target_seed=0, vocab=VOCAB):
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,))
    return SpecEngine(tiny_model("llama", target_seed, vocab=vocab), drafter, EngineConfig(speculation, max_batch_size=batch))


def _tokens(results):
    return [r.token_ids for r in results]


def test_greedy_random_draft_matches_engine_and_target(random_draft):
    reqs = requests(random_prompts(10, seed=1), max_new_tokens=12)
    out = random_draft.generate(reqs)
    engine = _engine(DraftModelDrafter(tiny_model("llama", 1), VOCAB)).generate(reqs)
    target = tiny_model("llama", 0)
    assert _tokens(out.results) == _tokens(engine)
    assert _tokens(out.results) == [hf_greedy(target, list(r.prompt_token_ids), 12) for r in reqs]
    assert [r.stats.num_accepted_draft_tokens for r in out.results] == [r.stats.num_accepted_draft_tokens for r in engine]
    t = out.transfer
    if random_draft.shape == "colocated":  # several steps per call, no proposal crosses a process
        assert 0 < t.steps < out.stats.steps and t.proposal == 0
        return
    # Bytes: greedy drafts are one-hot, so every proposal travels as its token ids.
    assert t.steps == out.stats.steps > 0 and t.sparse_steps == t.steps
    assert 0 < t.proposal < t.dense_equivalent / 4
    print("greedy bytes/step", t.per_step())


def test_the_step_graph_is_compiled_at_start_and_again_for_other_micro_batches():
    """The transport compiles its step graph when the coordinator starts (GraphTransport.open), so
    the first step shares no core with the graph's proxy actor starting; a run that keeps other
    micro-batches in flight gets a graph of its own, with the same tokens."""
    reqs = requests(random_prompts(6, seed=4), max_new_tokens=8)
    with _coordinator(DrafterSpec(factory("llama", 1), shape="split"), micro_batch_size=2, micro_batches=1) as c:
        cfg = c.config
        first = c.transport._graph
        assert first is not None
        one = c.generate(reqs)
        assert c.transport._graph is first
        c.config = dataclasses.replace(cfg, micro_batch_size=1, num_micro_batches=3)
        three = c.generate(reqs)
        assert c.transport._graph not in (None, first) and c.transport.config.num_micro_batches == 3
    engine = _engine(DraftModelDrafter(tiny_model("llama", 1), VOCAB)).generate(reqs)
    assert _tokens(one.results) == _tokens(three.results) == _tokens(engine)


def test_actors_off_the_drivers_node_step_as_tasks_with_the_same_tokens(random_draft):
    """Where this process and its actors are not on one node, each step runs as actor tasks instead
    of the compiled graph (raysd.actors.transport.open_transport): the same tokens and statistics,
    greedy and seeded sampling."""
    from raysd.actors.transport import GraphTransport, TaskTransport

    greedy, sampled = greedy_and_sampled(random_prompts(8, seed=9), max_new_tokens=10)
    reqs = greedy + sampled
    graph = random_draft.generate(reqs)
    assert random_draft._members().one_node and isinstance(random_draft.transport, GraphTransport)
    random_draft.transport.close()
    random_draft.transport = TaskTransport(random_draft._members(), random_draft._transport_config())
    try:
        tasks = random_draft.generate(reqs)
    finally:
        random_draft.transport.close()
        random_draft.transport = GraphTransport(random_draft._members(), random_draft._transport_config())
    assert _tokens(tasks.results) == _tokens(graph.results)
    assert [r.stats.num_accepted_draft_tokens for r in tasks.results] == [r.stats.num_accepted_draft_tokens for r in graph.results]


def test_read_pacer_waits_until_just_before_the_step_ends(monkeypatch):
    """The coordinator sleeps instead of spinning in the channel read until the step is about to
    end (raysd.actors.transport._ReadPacer): from when the target can start it (submission plus
    the draft's proposing, or the last result) plus the target's shortest recent time, less the
    slack; only once TRUSTED calls without new rows have been timed."""
    from raysd.actors import transport
    from raysd.engine.verdict import StepTimings

    now, slept = [10.0], []
    monkeypatch.setattr(transport.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    pacer = transport._ReadPacer()
    assert pacer.TRUSTED == 2
    pacer.nap(submitted_at=9.9)
    assert slept == []  # no estimate yet: read at once
    pacer.ready(StepTimings(draft_s=0.5, wall_s=1.0), colocated=False, admitted=True)  # a prefill: no estimate
    pacer.ready(StepTimings(draft_s=0.004, wall_s=0.020), colocated=False)
    pacer.nap(submitted_at=10.0)
    assert slept == []  # one steady call timed: not trusted yet
    pacer.ready(StepTimings(draft_s=0.004, wall_s=0.020), colocated=False)  # ready at 10.0
    pacer.nap(submitted_at=10.001)  # the target starts once the draft has proposed (10.005)
    assert slept == [pytest.approx(10.005 + 0.020 * (1 - pacer.SLACK_FRACTION) - pacer.SLACK_S - 10.0)]
    now[0] = 10.030
    pacer.ready(StepTimings(draft_s=0.004, wall_s=0.020), colocated=False)
    slept.clear()
    pacer.nap(submitted_at=10.0)  # submitted long ago (two micro-batches in flight): from the last result
    assert slept == [pytest.approx(0.020 * (1 - pacer.SLACK_FRACTION) - pacer.SLACK_S)]
    now[0] = 10.060
    pacer.ready(StepTimings(draft_s=0.002, wall_s=0.010), colocated=False)  # a cheaper step (K = 0)
    now[0] = 10.070
    pacer.ready(StepTimings(draft_s=0.004, wall_s=0.020), colocated=False)
    slept.clear()
    pacer.nap(submitted_at=10.070)  # the shortest recent times: a cheap step is not overslept
    assert slept == [pytest.approx(0.002 + 0.010 * (1 - pacer.SLACK_FRACTION) - pacer.SLACK_S)]
    pacer = transport._ReadPacer()
    for _ in range(2):
        pacer.ready(StepTimings(wall_s=0.0004), colocated=True)
    pacer.nap(submitted_at=10.070)  # a step shorter than the nap's wake-up jitter: spin
    assert slept == [pytest.approx(0.002 + 0.010 * (1 - pacer.SLACK_FRACTION) - pacer.SLACK_S)]


def test_seeded_sampling_matches_engine(random_draft):
    prompts = random_prompts(8, seed=2)
    reqs = requests(prompts[:4], temperature=1.0, max_new_tokens=10)
    reqs += [Request(10 + i, p, SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=100 + i, max_new_tokens=10))
             for i, p in enumerate(prompts[4:])]
    out = random_draft.generate(reqs)
    engine = _engine(DraftModelDrafter(tiny_model("llama", 1), VOCAB)).generate(reqs)
    assert _tokens(out.results) == _tokens(engine)
    again = random_draft.generate(reqs)  # same seeds, same tokens, whatever the scheduling
    assert _tokens(again.results) == _tokens(out.results)
    if random_draft.shape == "split":  # full-support draws travel dense; top-k rows alone would be sparse
        assert out.transfer.sparse_steps < out.transfer.steps


def test_top_k_rows_travel_sparse(random_draft):
    if random_draft.shape == "colocated":
        pytest.skip("a colocated replica's proposals never leave its actor")
    reqs = requests(random_prompts(6, seed=3), temperature=1.0, top_k=5, max_new_tokens=8)
    t = random_draft.generate(reqs).transfer
    assert t.sparse_steps == t.steps and t.proposal < t.dense_equivalent / 2


def test_continuous_refill_and_overlap_report(random_draft):
    # 14 requests for 2 x 3 slots, budgets from 1 to 27 tokens, one invalid prompt.
    prompts = random_prompts(14, seed=4)
    reqs = [Request(i, p, SamplingParams(max_new_tokens=1 + 2 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    reqs.append(Request("bad", [], SamplingParams()))
    out = random_draft.generate(reqs)
    assert [r.request_id for r in out.results] == [r.request_id for r in reqs]
    assert out.results[-1].finish_reason == "error"
    good = out.results[:-1]
    assert [len(r.token_ids) for r in good] == [1 + 2 * i for i in range(14)]
    target = tiny_model("llama", 0)
    expected = [hf_greedy(target, p, 1 + 2 * i) for i, p in enumerate(prompts)]
    # hf_greedy stops at EOS; ignore_eos rows go on, so compare up to the first EOS.
    for got, exp in zip(_tokens(good), expected):
        assert got[: len(exp)] == exp
    assert _tokens(good) == _tokens(_engine(DraftModelDrafter(tiny_model("llama", 1), VOCAB)).generate(reqs[:-1]))
    # No micro-batch waits for its longest row: a waiting request starts as soon as a
    # slot frees, so the run needs far fewer steps than batches padded to their longest row.
    stats = out.stats
    static_steps = sum(max(1 + 2 * i for i in range(j, min(j + 3, 14))) for j in range(0, 14, 3))
    assert stats.steps < static_steps
    assert stats.draft_s > 0 and stats.verify_s > 0 and stats.engine_loop_s > 0
    assert stats.generated_tokens == sum(len(r.token_ids) for r in good)
    if random_draft.shape == "colocated":  # drafting and verifying take turns in one process: the loop holds both
        assert stats.draft_s + stats.verify_s <= stats.engine_loop_s
        return
    assert stats.borrowed_steps == 0  # two micro-batches: the draft actor proposes for one while the other verifies
    # The efficiency is its definition over the loop's figures. Each actor runs its calls one at a
    # time, every one inside the loop's work, which lies inside the run's wall: max(d, v) <= loop <=
    # wall, so the efficiency lies in [(d + v - wall) / min(d, v), 1] (no bound above the first:
    # on a loaded machine the wall holds idle time that neither side's busy time covers).
    d, v, loop = stats.draft_s, stats.verify_s, stats.engine_loop_s
    assert stats.overlap_efficiency == pytest.approx((d + v - loop) / min(d, v))
    assert max(d, v) <= loop <= out.wall_s
    assert (d + v - out.wall_s) / min(d, v) <= stats.overlap_efficiency <= 1.0
    print(f"overlap: draft {stats.draft_s:.3f}s target {stats.verify_s:.3f}s "
          f"loop {stats.engine_loop_s:.3f}s efficiency {stats.overlap_efficiency:.2f}")


def test_draft_equal_to_target_accepts_everything():
    reqs = requests(random_prompts(6, seed=5), max_new_tokens=13)
    with _coordinator(DrafterSpec(factory("llama", 0))) as c:  # colocated: both on this machine's CPUs
        out = c.generate(reqs)
    target = tiny_model("llama", 0)
    assert _tokens(out.results) == [hf_greedy(target, list(r.prompt_token_ids), 13) for r in reqs]
    for r in out.results:
        assert r.stats.num_draft_tokens > 0 and r.stats.num_accepted_draft_tokens == r.stats.num_draft_tokens


@pytest.mark.parametrize("shape", SHAPES)
def test_ngram_drafter_k1(shape):
    """N-gram lookup inside the target actor (the default: no draft actor at all) and in a draft
    actor of its own give the engine's tokens."""
    colocate = shape == "colocated"
    base = random_prompts(6, seed=6)
    prompts = [p + p for p in base]  # repeats give the lookup something to find
    reqs = requests(prompts, max_new_tokens=10)
    with _coordinator(DrafterSpec(None, shape=shape), k=1, micro_batch_size=2) as c:
        assert (c.draft is None) == colocate
        out = c.generate(reqs)
        costs = c.profile_step_costs(1, [1], context=8, reps=1)
    assert costs.draft_s == (0.0,) and all(t > 0 for t in costs.target_s[0])
    target = tiny_model("llama", 0)
    assert _tokens(out.results) == [hf_greedy(target, p, 10) for p in prompts]
    assert _tokens(out.results) == _tokens(_engine(NgramDrafter(VOCAB), k=1, batch=2).generate(reqs))
    assert sum(r.stats.num_accepted_draft_tokens for r in out.results) > 0
    assert out.stats.drafted_steps == out.stats.steps
    if colocate:  # no proposal crosses a process boundary
        assert out.transfer.proposal == 0 and out.stats.draft_s > 0
    else:
        assert out.transfer.sparse_steps == out.transfer.steps


@pytest.mark.parametrize("shape", SHAPES)
def test_top_m_draft_keeps_the_target_distribution(shape):
    """First generated token at temperature 1 over many seeds, with one draft per row
    from a top-2 truncated draft: chi-square against the target's softmax."""
    V, n, m = 16, 1200, 2
    prompt = [3, 7, 5]
    spec = DrafterSpec(factory("llama", 4, vocab=V), draft_top_m=m, shape=shape)
    reqs = [Request(s, prompt, SamplingParams(temperature=1.0, seed=s, max_new_tokens=2, ignore_eos=True)) for s in range(n)]
    with _coordinator(spec, k=1, micro_batch_size=64, target=factory("llama", 3, vocab=V)) as c:
        out = c.generate(reqs)
    target = tiny_model("llama", 3, vocab=V)
    with torch.inference_mode():
        logits = target(torch.tensor([prompt])).logits[0, -1]
    p = logits_to_probs(logits[None], SamplingTensors.from_params([SamplingParams(temperature=1.0)]))[0].double().numpy()
    first = np.bincount([r.token_ids[0] for r in out.results], minlength=V)
    assert sum(r.stats.num_draft_tokens for r in out.results) == n  # every row's first token was a draft
    assert sum(r.stats.num_accepted_draft_tokens for r in out.results) < n  # and some were rejected
    assert chi_square_pvalue(first, p) > 1e-4, (first, p * n)  # cells expecting < 5 pooled
    # Exactness through the truncating wrapper: same tokens as the engine with it.
    drafter = DraftModelDrafter(tiny_model("llama", 4, vocab=V), V, draft_top_m=m)
    speculation = SpeculationConfig(num_speculative_tokens=1, eos_token_ids=(EOS,))
    engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=64)).generate(reqs[:200])
    assert _tokens(out.results[:200]) == _tokens(engine)
    if shape == "split":
        assert out.transfer.sparse_steps == out.transfer.steps


def test_auto_speculation_length_through_the_actors(random_draft):
    """Step costs profiled in the actors drive the per-step K; greedy output is unchanged."""
    import dataclasses

    from raysd.core.speculation import AdaptiveConfig

    costs = random_draft.profile_step_costs(K, [1, 3], context=16, reps=1)
    assert costs.k_max == K and all(t > 0 for row in costs.target_s for t in row) and all(t > 0 for t in costs.draft_s)
    plain = random_draft.config
    adaptive = AdaptiveConfig(costs, overlapped=random_draft.shape == "split")
    random_draft.config = dataclasses.replace(plain, speculation=dataclasses.replace(plain.speculation, adaptive=adaptive))
    try:
        reqs = requests(random_prompts(6, seed=3), max_new_tokens=10)
        out = random_draft.generate(reqs)
    finally:
        random_draft.config = plain
    target = tiny_model("llama", 0)
    assert _tokens(out.results) == [hf_greedy(target, list(r.prompt_token_ids), 10) for r in reqs]
    for r in out.results:
        assert 0 <= r.stats.mean_speculation_length <= K
        assert r.stats.num_draft_tokens <= r.stats.speculation_length_sum


def _eight_steps_per_call(drafter: DrafterSpec, engine_drafter, reqs, **resources):
    """The requests through a coordinator at up to eight steps per call, and through the engine (one
    step at a time), under costs where drafting pays at the prior's acceptance but not at a low one (K
    varies by step). Checks what must not change: tokens, statistics, steps, the pooled evidence and
    every step's plan; returns (the coordinator's output, its K controller's state)."""
    from raysd.core.speculation import AdaptiveConfig, StepCosts

    adaptive = AdaptiveConfig(StepCosts((1, 3), ((1.0, 1.2, 1.4, 1.6, 1.8),) * 2, (0.0, 0.0)), prior_alpha=0.6)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), adaptive=adaptive)
    cfg = CoordinatorConfig(speculation, micro_batch_size=3, num_micro_batches=1, max_steps_per_call=8, **resources)
    with SpecCoordinator(factory("llama", 0), drafter, cfg) as c:
        out, state = c.generate(reqs), c.controller_state()
    engine = SpecEngine(tiny_model("llama", 0), engine_drafter, EngineConfig(speculation, max_batch_size=3))
    expected = engine.generate(reqs)
    assert _tokens(out.results) == _tokens(expected)
    assert_same_stats([r.stats for r in out.results], [r.stats for r in expected])
    assert out.stats.steps == engine.timings.steps
    assert 0 < out.stats.drafted_steps < out.stats.steps  # K was 0 on some steps, not on all
    # The pooled evidence (summed per call, not per step: float order), and every step's plan.
    assert state["overlap_sum"] == pytest.approx(engine.k_controller.overlap_sum)
    assert state["num_tested_positions"] == engine.k_controller.num_tested_positions
    assert state["chosen"] == dict(engine.k_controller.chosen)
    return out, state


def _patient_reads(monkeypatch) -> None:
    """The coordinator waits for every ring however slow the machine is (its wait's timeout is
    what lets a read spin for a target lost mid-call): so `rung_calls` counts rings, not timings."""
    from raysd.actors import transport
    from raysd.actors.turns import Doorbell

    monkeypatch.setattr(Doorbell, "MIN_TIMEOUT_S", 600.0)
    monkeypatch.setattr(transport._ReadPacer, "FIRST_BELL_TIMEOUT_S", 600.0)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_colocated_steps_per_call_change_nothing_but_the_calls(monkeypatch, drafter):
    """With the drafter in the target actor (n-gram lookup, or a draft model), one call runs several
    steps (until a row finishes), each choosing its K in the actor: tokens, statistics, steps and
    the controller's pooled evidence equal the single-process engine's, greedy and seeded; the
    calls are fewer."""
    prompts = [p + p[:5] for p in random_prompts(7, seed=11)]  # repeats give the lookup something to find
    reqs = requests(prompts[:4], max_new_tokens=12)
    reqs += [Request(20 + i, p, SamplingParams(temperature=1.0, seed=7 + i, max_new_tokens=11 + i))
             for i, p in enumerate(prompts[4:])]
    _patient_reads(monkeypatch)
    spec, engine_drafter = ((DrafterSpec(None), NgramDrafter(VOCAB)) if drafter == "ngram" else
                            (DrafterSpec(factory("llama", 1)), DraftModelDrafter(tiny_model("llama", 1), VOCAB)))
    out, _ = _eight_steps_per_call(spec, engine_drafter, reqs, target_resources=CPU, draft_resources=CPU)
    assert out.transfer.steps < out.stats.steps / 2  # calls
    assert out.stats.rung_calls == out.transfer.steps  # each read after the target's ring (caller_doorbell)


def test_a_draft_actors_plain_runs_change_nothing_but_the_calls(monkeypatch):
    """A draft actor whose controller plans K = 0 hands the target a run of plain steps for one
    call (Proposed.steps, ending after the first step that retires a row): tokens, statistics,
    steps, the pooled evidence and every step's plan equal the single-process engine's, greedy and
    seeded; the calls are fewer."""
    prompts = random_prompts(7, seed=12)  # a random draft: a few drafting steps, then plain
    reqs = requests(prompts[:4], max_new_tokens=28)
    reqs += [Request(20 + i, p, SamplingParams(temperature=1.0, seed=3 + i, max_new_tokens=24 + i))
             for i, p in enumerate(prompts[4:])]
    _patient_reads(monkeypatch)
    out, _ = _eight_steps_per_call(DrafterSpec(factory("llama", 1), shape="split"),
                                   DraftModelDrafter(tiny_model("llama", 1), VOCAB), reqs, draft_resources=CPU,
                                   target_resources=CPU)
    assert out.stats.drafted_steps < out.stats.steps / 2  # mostly plain
    assert out.transfer.steps < out.stats.steps / 2  # calls
    # One micro-batch on one node's CPUs: every call ran on the draft actor's threads too (raysd.actors.turns),
    # and this process slept through every call until the target rang.
    assert out.stats.borrowed_steps == out.stats.steps
    assert out.stats.rung_calls == out.transfer.steps


def test_unplaceable_actors_fail_fast_with_a_clear_error():
    gpu = ActorResources(num_cpus=1, num_gpus=1)  # this machine has no GPU
    cfg = CoordinatorConfig(draft_resources=gpu, target_resources=gpu, placement_timeout_s=2)
    with pytest.raises(PlacementFailed, match="could not place the model actors .* within 2 s"):
        SpecCoordinator(factory("llama", 0), DrafterSpec(None), cfg)


def test_a_death_beyond_the_recoveries_names_the_actor_that_died():
    """With no recovery allowed, a killed target ends the run at once in one line that says which
    actor died and that the replica gave up; Ray restarts the actor for the next run. (Its own
    coordinator: the module's share theirs, whose restarts the kill tests count on.)"""
    reqs = requests(random_prompts(6, seed=12), max_new_tokens=24, ignore_eos=True)
    with _coordinator(DrafterSpec(None), max_recoveries=0) as c:
        pid = ray.get(c.target.info.remote()).pid
        with pytest.raises(ReplicaGaveUp, match=r"^the target actor died: .*; 1 failure in a row .*: the replica gives up$") as failed:
            kill_mid_generate(c, reqs, pid, after_steps=2, timeout_s=150, raise_error=True)
        assert "\n" not in str(failed.value)
        assert len(c.generate(reqs).results) == len(reqs)  # the restarted target serves the next run


def test_a_step_beyond_the_step_timeout_fails_the_run_and_is_not_retried(random_draft):
    c, plain = random_draft, random_draft.config
    c.config = dataclasses.replace(plain, step_timeout_s=1e-4)
    try:
        with pytest.raises(StepTimedOut, match="a step took longer than 0.0001 s"):
            c.generate(requests(random_prompts(2, seed=13), max_new_tokens=8))
    finally:
        c.config = plain


def _stream_results(c: SpecCoordinator, chunks, max_pending: int):
    """Submit each chunk of requests from its own thread into one stream; results by request id."""
    got, errors = {}, []
    with c.stream(max_pending) as stream:
        def feed(chunk):
            try:
                futures = [stream.submit(r) for r in chunk]
                for r, f in zip(chunk, futures):
                    got[r.request_id] = f.result(timeout=300)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=feed, args=(chunk,)) for chunk in chunks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        stats = stream.stats()
        assert stream.pending == 0
    assert not errors, errors
    return got, stats


def test_stream_matches_generate_whatever_the_batch_composition(random_draft):
    """Rows of several callers share the micro-batches of one long-lived loop: each row gives exactly
    the tokens and statistics of `generate` (greedy and seeded sampling), results stream back as each
    row finishes, and the loop reports occupancy and queue wait."""
    prompts = random_prompts(16, seed=8)
    reqs = [Request(i, p, SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=0 if i % 3 else 6, seed=50 + i,
                                         max_new_tokens=3 + (7 * i) % 17)) for i, p in enumerate(prompts)]
    reqs.append(Request("bad", [], SamplingParams()))  # refused at submission, like generate does
    ref = {r.request_id: r for r in random_draft.generate(reqs).results}
    start = time.perf_counter()
    got, stats = _stream_results(random_draft, [reqs[0:5], reqs[5:11], reqs[11:]], max_pending=4)
    wall = time.perf_counter() - start
    assert set(got) == set(ref)
    for rid, done in got.items():
        assert done.result.token_ids == ref[rid].token_ids, rid
        assert done.result.finish_reason == ref[rid].finish_reason
        # Counts exactly; alpha_estimate to float precision (a batch's shape changes the last bits of its matmuls).
        assert done.result.stats.to_dict() == pytest.approx(ref[rid].stats.to_dict(), rel=1e-5)
        if rid != "bad":  # from its submission to its result, inside the stream's life
            assert 0 < done.latency_s < wall, (rid, done.latency_s, wall)
    assert got["bad"].result.finish_reason == "error" and got["bad"].latency_s == 0.0
    slots = 3 * random_draft.config.micro_batches(random_draft.shape)
    assert stats.slot_steps == stats.steps * slots and stats.steps > 0 and stats.recoveries == 0
    assert 0 < stats.occupancy <= min(4 / slots, 1) + 1e-9  # never more rows than max_pending
    assert stats.queue_wait_s > 0 and stats.draft_s > 0 and stats.verify_s > 0
    # the loop's time is counted as it runs, not when it ends: each actor's calls run within it, one at a time
    assert stats.engine_loop_s >= max(stats.verify_s, stats.draft_s)
    # The coordinator runs one loop at a time: generate works again once the stream is closed.
    assert [r.token_ids for r in random_draft.generate(reqs[:3]).results] == [ref[i].token_ids for i in range(3)]


def test_stream_backpressure_and_one_loop_at_a_time(random_draft):
    reqs = requests(random_prompts(6, seed=9), max_new_tokens=30, ignore_eos=True)
    with random_draft.stream(max_pending=2) as stream:
        with pytest.raises(RuntimeError, match="already running"):
            random_draft.generate(reqs[:1])
        futures = [stream.submit(reqs[0]), stream.submit(reqs[1])]
        blocked = threading.Thread(target=lambda: futures.append(stream.submit(reqs[2])))
        blocked.start()
        blocked.join(timeout=0.05)
        assert blocked.is_alive() or futures[0].done() or futures[1].done()  # a third waits for room
        blocked.join(timeout=120)
        assert not blocked.is_alive() and stream.pending <= 2
        assert all(len(f.result(timeout=120).result.token_ids) == 30 for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(reqs[3])


def test_draft_actor_constructor_args_are_inline(random_draft):
    """No ObjectRef among the model actors' constructor arguments: Ray warns that such an actor's
    restart can fail (ray-project/ray#53727). The draft asks the target for its vocabulary itself.
    The driver's log holds Ray's warnings for every actor this process created, the module's
    `random_draft` actors among them."""
    import glob

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    assert random_draft.draft_info.vocab_size == VOCAB
    time.sleep(1.0)
    warned = [f for f in glob.glob(f"{logs}/python-core-driver-*{os.getpid()}.log")
              if "53727" in open(f, errors="replace").read()]
    assert not warned, warned


@pytest.mark.parametrize("runner,shape", [("static", "split"), ("dynamic", "colocated")])
def test_both_runners_through_the_actors_match_the_engine_and_the_target(runner, shape):
    """The actors on each KV-cache runner: greedy tokens equal the target's own `generate`,
    seeded samples equal the single-process engine's on the same runner."""
    prompts = random_prompts(8, seed=6)
    greedy, sampled = greedy_and_sampled(prompts)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    cfg = CoordinatorConfig(speculation, micro_batch_size=2, draft_resources=CPU, target_resources=CPU, runner=runner)
    with SpecCoordinator(factory("llama", 0), DrafterSpec(factory("llama", 1), runner=runner, shape=shape), cfg) as c:
        out = c.generate(greedy + sampled)
    target = tiny_model("llama", 0)
    assert _tokens(out.results[:4]) == [hf_greedy(target, list(r.prompt_token_ids), 12) for r in greedy]
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    engine = SpecEngine(target, DraftModelDrafter(tiny_model("llama", 1), VOCAB, runner=runner),
                        EngineConfig(speculation, max_batch_size=3, runner=runner))
    assert _tokens(out.results[4:]) == _tokens(engine.generate(sampled))


@pytest.mark.parametrize("shape", SHAPES)
def test_feature_draft_through_the_actors(shape):
    """EAGLE beside the target, or in an actor of its own (the target's features then go target ->
    draft through the step graph): greedy output is the target's own and sampled output the
    engine's, token for token."""
    eagle = functools.partial(tiny_eagle, 0, 3)
    with _coordinator(DrafterSpec(eagle, shape=shape)) as c:
        greedy = requests(random_prompts(7, seed=6), max_new_tokens=11)
        out = c.generate(greedy)
        target = tiny_model("llama", 0)
        assert _tokens(out.results) == [hf_greedy(target, list(r.prompt_token_ids), 11) for r in greedy]
        assert (out.transfer.features > 0) == (shape == "split") and sum(r.stats.num_draft_tokens for r in out.results) > 0
        sampled = requests(random_prompts(6, seed=7), temperature=1.0, max_new_tokens=9)
        engine = _engine(FeatureDrafter(tiny_eagle(0, 3), VOCAB)).generate(sampled)
        assert _tokens(c.generate(sampled).results) == _tokens(engine)


def test_plain_decoding_never_asks_the_draft_actor():
    with _coordinator(DrafterSpec(None), k=0) as c:
        reqs = requests(random_prompts(5, seed=8), max_new_tokens=9)
        out = c.generate(reqs)
    target = tiny_model("llama", 0)
    assert _tokens(out.results) == [hf_greedy(target, list(r.prompt_token_ids), 9) for r in reqs]
    assert out.stats.steps > 0 and out.stats.drafted_steps == 0 and out.stats.draft_s == 0


# The kill tests come last and run on `random_draft` itself: they check that the same coordinator
# gives the tokens it gave before its actors were killed, and the module's other tests keep actors
# that were never restarted. Per shape, at most three kills of one actor: within the actors'
# max_actor_restarts (3), so each kill below is a real restart.


def test_killed_actors_rerun_their_rows(random_draft):
    """SIGKILL each of the replica's actors mid-run (colocated: its one actor; split: the target,
    then the draft): Ray restarts it, the rows in flight re-run from their start, every request
    yields one correct result, and one death is one recovery."""
    reqs = requests(random_prompts(12, seed=7), max_new_tokens=24, ignore_eos=True)
    c = random_draft
    clean = _tokens(c.generate(reqs).results)
    for actor in [a for a in (c.target, c.draft) if a is not None]:
        pid = ray.get(actor.info.remote()).pid
        out = kill_mid_generate(c, reqs, pid, timeout_s=150)
        assert out.stats.recoveries == 1  # one death, one recovery: nothing else is taken for one
        assert ray.get(actor.info.remote()).pid != pid  # restarted
        assert [r.request_id for r in out.results] == [r.request_id for r in reqs]
        assert _tokens(out.results) == clean
        assert all(len(r.token_ids) == 24 for r in out.results)


def test_a_split_replica_lending_threads_survives_killed_actors(random_draft):
    """A split replica with one micro-batch: the draft actor lends its threads and sleeps on its
    doorbell through each target call (raysd.actors.turns). A target killed meanwhile never rings,
    the draft wakes at its timeout, and the rows re-run; likewise for a killed draft."""
    if random_draft.shape == "colocated":
        pytest.skip("a colocated replica has no draft actor to lend threads")
    reqs = requests(random_prompts(12, seed=7), max_new_tokens=24, ignore_eos=True)
    c, plain = random_draft, random_draft.config
    clean = _tokens(c.generate(reqs).results)
    c.config = dataclasses.replace(plain, num_micro_batches=1)  # `config` may change between calls
    try:
        for actor in (c.target, c.draft):
            pid = ray.get(actor.info.remote()).pid
            out = kill_mid_generate(c, reqs, pid, timeout_s=150)
            assert c.transport.lend_threads and out.stats.recoveries == 1 and out.stats.borrowed_steps > 0
            assert _tokens(out.results) == clean
    finally:
        c.config = plain


def test_killed_actor_mid_stream_reruns_its_rows_once(random_draft):
    """SIGKILL the target while a stream runs: Ray restarts it, the rows in flight re-run from their
    start, every future gets exactly one result with the clean tokens, and the stream goes on."""
    reqs = requests(random_prompts(12, seed=10), max_new_tokens=24, ignore_eos=True)
    c = random_draft
    clean = {r.request_id: r.token_ids for r in c.generate(reqs).results}
    pid = ray.get(c.target.info.remote()).pid
    with c.stream(max_pending=8) as stream:
        futures = [stream.submit(r) for r in reqs[:6]]
        deadline = time.monotonic() + 60
        start = c.steps_completed
        while c.steps_completed < start + 4 and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        futures += [stream.submit(r) for r in reqs[6:]]
        got = [f.result(timeout=200).result for f in futures]
        assert stream.stats().recoveries == 1
    assert ray.get(c.target.info.remote()).pid != pid
    assert [r.request_id for r in got] == [r.request_id for r in reqs]
    assert {r.request_id: r.token_ids for r in got} == clean
