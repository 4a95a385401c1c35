"""A speculative step as two captured programs on the CPU: the draft's K steps with their sampling, then
the verify with its rejection test, each one replay of a graph, and one read-back per step. The capture
is tests/models/test_cuda_graphs.py's stand-in (EagerProgram: exact input shapes, no host read inside);
tests/gpu runs the real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, flags_of
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_host_syncs import count_host_reads
from tests.models.test_cuda_graphs import graphed


def engine_of(k: int = 4, batch: int = 4, graphs: bool = True, same: bool = False, **config) -> SpecEngine:
    """`same`: the draft is the target itself (every greedy draft accepted), else a one-layer draft."""
    target = tiny_model("llama", seed=0)
    draft = target if same else tiny_model("llama", seed=5, layers=1)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static"),
                        EngineConfig(SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,), **config),
                                     max_batch_size=batch, runner="static"))
    if graphs:
        graphed(engine.target.rows.runner)
        graphed(engine.draft.drafter.rows.runner)
    return engine


def requests(n: int, temperature: float, max_new: int = 12, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=g).tolist()
    return [Request(i, torch.randint(3, VOCAB, (m,), generator=g).tolist(),
                    SamplingParams(temperature=temperature, max_new_tokens=max_new + i % 5, seed=i, ignore_eos=True))
            for i, m in enumerate(lengths)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_is_one_draft_replay_one_verify_replay_and_one_read_back(temperature, monkeypatch):
    """Each step replays one draft program (its K forwards and draws; none where no row has room for a
    draft) and one verify program; a step runs no forward eagerly, and reads back from the device once
    (the verdict)."""
    engine = engine_of()
    draft, target = engine.draft.drafter.rows.runner, engine.target.rows.runner
    per_step, step = [], engine.step

    def counted_step():
        before = draft.counts.copy(), target.counts.copy()
        with count_host_reads(monkeypatch) as reads:
            verdict = step()
        d, t = draft.counts.minus(before[0]), target.counts.minus(before[1])
        drafted = int(verdict.offered.max(initial=0) > 0)  # the last rows' last step: no room for drafts
        per_step.append((verdict.plan.k, reads.count, d.replays - drafted, t.replays, d.eager_forwards + t.eager_forwards))
        return verdict

    engine.step = counted_step
    results = engine.generate(requests(6, temperature))
    assert all(len(r.token_ids) == 12 + i % 5 for i, r in enumerate(results))
    assert per_step and all(k == 4 for k, *_ in per_step)
    assert all(reads <= 1 and d == 0 and t == 1 and eager == 0 for _, reads, d, t, eager in per_step), per_step
    with torch.inference_mode():  # the same engine without graphs emits the same tokens
        assert [r.token_ids for r in engine_of(graphs=False).generate(requests(6, temperature))] == [r.token_ids for r in results]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_and_verify_programs_trace_as_one_graph_each(temperature):
    """torch._dynamo.explain of each program: no graph break (a break is Python between kernels, which a
    CUDA graph would replay without, or a host read), so torch.compile can take a program whole. The
    runners run stock linears, as on a GPU (the prepacked CPU kernels are an eager path)."""
    import torch._dynamo as dynamo

    engine = engine_of(graphs=False, acceptance="exact")
    engine.target.rows.runner._packed = engine.draft.drafter.rows.runner._packed = None
    engine.add([(r.request_id, r) for r in requests(3, temperature)])
    engine.step()  # every row warm in the drafter, one step verified
    drafter, target = engine.draft.drafter, engine.target
    sampling = engine.draft._sampling
    uniforms = torch.rand(3, 4, dtype=torch.float64)
    drafter.rows.catch_up(keep=2)
    with torch.inference_mode():
        inputs = drafter.draft_inputs(4, sampling, uniforms)
        explained = dynamo.explain(drafter.draft_program)(4, flags_of(sampling), 256, *inputs)
        assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
        assert explained.graph_count == 1
        proposal = drafter.propose([4, 4, 4], sampling, uniforms)
        inputs, flags = target.verify_inputs(proposal, 4)
        explained = dynamo.explain(target.verify_program)(4, flags, 256, *inputs)
        assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
        assert explained.graph_count == 1
    dynamo.reset()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("costs", ["learned", "profile"])
def test_steady_state_replays_only_under_k_auto_with_rows_finishing_and_refilling(temperature, costs):
    """A 200-step job under `-k auto` (the controller changes K as it learns acceptance, and step costs
    when it learns them too: then plain steps, after which the drafter catches up), rows finishing one
    by one and waiting requests taking their slots, the batch's tail: once the engine has captured its
    programs (SpecEngine.capture, before the first step), no step captures a graph or runs a forward
    eagerly; every step is replays. The tokens are the eager engine's (where both plan the same K:
    greedy, or a measured profile). The draft is the target itself,
    so acceptance is high and K worth raising; a profile that makes wider verifies cost more has the
    controller move K over 1..4 as the rows' evidence accumulates and their room shrinks."""
    from raysd.core.speculation import AdaptiveConfig, StepCosts

    profile = StepCosts((1,), ((1.0, 1.1, 1.3, 1.6, 2.0),), (0.05,))
    adaptive = AdaptiveConfig(costs=profile if costs == "profile" else None)

    def job():
        return requests(200, temperature, max_new=18, seed=1)

    engine = engine_of(same=True, adaptive=adaptive)
    draft, target = engine.draft.drafter.rows.runner, engine.target.rows.runner
    per_step, step = [], engine.step

    def counted_step():
        before = draft.counts.copy(), target.counts.copy()
        verdict = step()
        d, t = draft.counts.minus(before[0]), target.counts.minus(before[1])
        per_step.append((verdict.plan.k, len(verdict.kept), d.captures + t.captures, d.eager_forwards + t.eager_forwards))
        return verdict

    engine.step = counted_step
    out = [r.token_ids for r in engine.generate(job())]
    ks = {k for k, *_ in per_step}
    assert len(per_step) >= 200 and len({b for _, b, *_ in per_step}) >= 3  # the rows change: the batch's tail
    assert len(ks) >= 2 and 0 in ks if costs == "learned" else len(ks) >= 3, ks  # K changes (learned: plain steps too)
    assert all(captures == 0 and eager == 0 for *_, captures, eager in per_step), [s for s in per_step if s[2:] != (0, 0)]
    assert engine.timings.graph_captures > 0 and engine.timings.eager_forwards == 0
    if temperature == 0 or costs == "profile":  # else K follows timings, and which draws a row reads follows K
        eager = engine_of(graphs=False, same=True, adaptive=adaptive)
        assert [r.token_ids for r in eager.generate(job())] == out


def test_compiles_happen_at_start_up_and_are_counted():
    """With compiled forwards (a counting backend here: nothing is compiled for real), every graph
    torch.compile makes is made at admission or while capturing, before the first step, and the
    timings count them: no step compiles. On CUDA the graphs then capture the compiled kernels."""
    import torch._dynamo as dynamo

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dynamo.reset()
    engine = engine_of()
    runners = engine.target.rows.runner, engine.draft.drafter.rows.runner
    for runner in runners:
        runner._compiled, runner._packed = torch.compile(runner.model, backend=backend, dynamic=True), None
    per_step, step = [], engine.step

    def counted_step():
        before = sum(r.counts.compiles for r in runners)
        verdict = step()
        per_step.append(sum(r.counts.compiles for r in runners) - before)
        return verdict

    engine.step = counted_step
    engine.generate(requests(10, 0.0))
    dynamo.reset()
    assert engine.timings.compiles == len(graphs) > 0 and engine.timings.compile_s > 0
    assert per_step and not any(per_step), per_step


def _graphed_sides(worker, runners: list) -> None:
    """The worker's sides made from now on replay the stand-in capture; their runners go to `runners`."""
    make = worker.sides.make

    def make_graphed(call):
        made = make(call)
        for side in made if isinstance(made, tuple) else (made,):
            runner = side.rows.runner if hasattr(side, "rows") else side.drafter.rows.runner
            runners.append(graphed(runner))
        return made

    worker.sides.make = make_graphed


@pytest.mark.parametrize("shape", ["colocated", "split"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_replicas_actors_capture_ahead_under_a_job_bound(temperature, shape):
    """A replica's actors (in process here), the micro-batch started with a capture bound
    (StepCall.capture: a job's max_model_len), rows streaming in as slots free under `-k auto`: the
    first call captures every program, on both models, and no later call captures a graph or runs a
    forward eagerly. In a split replica the draft actor's plan names the verifies the target captures
    (Proposed.verify_widths). The tokens are those of the actors without graphs."""
    import dataclasses
    import functools

    from raysd.actors.model_actors import DrafterSpec, DraftWorker, StepCall, TargetWorker
    from raysd.core.speculation import AdaptiveConfig
    from raysd.engine.requests import Admission

    reqs = requests(60, temperature, max_new=18, seed=2)
    bound = max(len(r.prompt_token_ids) + r.params.max_new_tokens for r in reqs)
    spec = Admission.of(SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), adaptive=AdaptiveConfig(),
                                          max_model_len=bound), VOCAB, [512]).spec
    rows, same = 4, functools.partial(tiny_model, "llama", 0)
    drafter = DrafterSpec(same, runner="static")

    def run(graphs: bool):
        runners: list = []
        if shape == "colocated":
            workers = [TargetWorker(same, runner="static", drafter=drafter)]
        else:
            workers = [DraftWorker(drafter, VOCAB), TargetWorker(same, runner="static")]
        if graphs:
            for worker in workers:
                _graphed_sides(worker, runners)

        def counts():
            return sum(r.counts.captures for r in runners), sum(r.counts.eager_forwards for r in runners)

        waiting, running, results, per_call = list(enumerate(reqs)), 0, {}, []
        call = StepCall(0, spec, None, tuple(waiting[:rows]), max_steps=8, capture=(rows, bound) if graphs else None)
        waiting, running = waiting[rows:], rows
        while running:
            before = counts()
            if shape == "colocated":
                verdict, timings = workers[0].step(call)
            else:
                proposed = workers[0].propose(call)
                verdict, timings = workers[1].step(dataclasses.replace(call, verdict=None), proposed)
            after = counts()
            per_call.append((after[0] - before[0], after[1] - before[1]))
            results.update(verdict.finished)
            running -= len(verdict.finished)
            new = tuple(waiting[:len(verdict.finished)])
            waiting, running = waiting[len(new):], running + len(new)
            last = dataclasses.replace(verdict, finished=()) if shape == "split" else None
            call = StepCall(0, None, last, new, max_steps=8, verify_s=timings.verify_s, last_steps=timings.steps)
        return [results[i].token_ids for i in range(len(reqs))], per_call, runners

    out, per_call, runners = run(graphs=True)
    assert len(runners) == 2 and per_call[0][0] > 0 and per_call[0][1] == 0  # both models: captures, no eager forward
    assert all(c == (0, 0) for c in per_call[1:]), [c for c in per_call[1:] if c != (0, 0)]
    assert len(per_call) >= 20
    if temperature == 0:  # sampled, K follows the learned timings, and which draws a row reads follows K
        assert run(graphs=False)[0] == out
