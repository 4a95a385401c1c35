"""raysd.models.cuda_graphs on the CPU: which shapes are captured, when graphs are dropped, and that
a runner replaying "graphs" keeps the engine's output. The capture is an eager stand-in with
CudaGraphProgram's contract (fixed rows, input shapes and attended columns; refuses moved buffers);
tests/gpu/test_gpu_static.py runs the real CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.cuda_graphs import MIN_ATTEND, GraphedSteps, attend_bucket, attend_buckets, buffer_pointers, row_buckets
from raysd.models.runner import make_runner
from raysd.models.static_runner import StaticRunner
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_equivalence import prompts as make_prompts
from tests.engine.test_host_syncs import SYNC_OPS


class NoHostReads(TorchDispatchMode):
    """Fails on any op that hands a device value to the host (tests/engine/test_host_syncs.py's list):
    a CUDA graph cannot capture one."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func.overloadpacket.__name__ not in SYNC_OPS, f"a host read inside a captured program: {func}"
        return func(*args, **(kwargs or {}))


class EagerProgram:
    """CudaGraphProgram's contract without CUDA: `fn` over the inputs' rows (the runner's rows, then
    free slots fed zeros) at a fixed attended width, run eagerly at every call on inputs of exactly
    the captured shapes, with no host read inside (as a graph could not hold one)."""

    captured_rows: list[int] = []  # every capture's rows, for the tests to read
    padded_replays = 0

    def __init__(self, runner: StaticRunner, fn, inputs, attend: int, pool=None):
        rows = inputs[0].shape[0]
        assert 1 <= rows <= runner.cache.capacity[0]
        runner._reserve(attend)
        runner._lengths[runner.num_rows : rows] = 0  # as CudaGraphProgram: free slots start empty
        self.runner, self.fn, self.attend, self.rows = runner, fn, attend, rows
        self.signature = [(t.shape, t.dtype) for t in inputs]
        self.pointers = buffer_pointers(runner)
        saved = runner._lengths[:rows].clone()  # a warm-up, as on CUDA: its writes past the lengths must not matter
        with torch.inference_mode(), runner.counted_as("graph"):
            fn(attend, *inputs)
        runner._lengths[:rows].copy_(saved)
        EagerProgram.captured_rows.append(rows)

    def __call__(self, *inputs):
        r = self.runner
        assert [(t.shape, t.dtype) for t in inputs] == self.signature and r.num_rows <= self.rows
        EagerProgram.padded_replays += r.num_rows < self.rows
        assert buffer_pointers(r) == self.pointers, "replayed over moved buffers"
        with torch.inference_mode(), r.counted_as("graph"), NoHostReads():
            return self.fn(self.attend, *inputs)


def graphed(runner: StaticRunner, **options) -> StaticRunner:
    runner.graphs = GraphedSteps(runner, EagerProgram, **options)
    return runner


def generate_with(target, draft, graphs=None, k=4, batch=4) -> SpecEngine:
    """An engine over static runners, with `graphs` (GraphedSteps' options) the stand-in capture's."""
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static"),
                        EngineConfig(SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,)), max_batch_size=batch,
                                     runner="static"))
    if graphs is not None:
        graphed(engine.target.rows.runner, **graphs)
        graphed(engine.draft.drafter.rows.runner, **graphs)
    return engine


def generate(target, draft, ps, k=4, batch=4, graphs=None, max_new=24):
    engine = generate_with(target, draft, graphs, k, batch)
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(ps)])
    return [r.token_ids for r in out], engine


def test_attend_and_row_buckets():
    assert attend_bucket(1, 4096) == MIN_ATTEND
    assert attend_bucket(MIN_ATTEND, 4096) == MIN_ATTEND
    assert attend_bucket(MIN_ATTEND + 1, 4096) == 2 * MIN_ATTEND
    assert attend_bucket(300, 400) == 400  # within the buffer when that is enough
    assert attend_bucket(500, 400) == 500  # else what the rows need (the capture grows the buffer)
    for columns, max_columns in [(1, 4096), (256, 4096), (257, 4096), (1500, 4096), (300, 400), (900, 1000)]:
        assert attend_buckets(columns, max_columns) == sorted({attend_bucket(c, max_columns) for c in range(1, columns + 1)})
    assert row_buckets(20, 64) == [1, 2, 4, 8, 16, 24] and row_buckets(20, 20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("k", [0, 4])
def test_replayed_steps_keep_the_engines_tokens(k):
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    ps = make_prompts()
    eager, _ = generate(target, draft, ps, k=k)
    replayed, engine = generate(target, draft, ps, k=k, graphs={})
    assert replayed == eager
    counts = engine.target.rows.runner.counts
    assert counts.captures > 0 and counts.replays > counts.captures  # captured once, replayed many times
    if k:
        assert engine.draft.drafter.rows.runner.counts.replays > 0


def test_a_shape_is_captured_the_second_time_it_is_seen():
    runner = graphed(StaticRunner(tiny_model("llama", 0)), capture_after=2)
    runner.add_prefilled([[5, 6, 7], [8, 9]])
    one = torch.ones(2, dtype=torch.int64)

    def step():
        return runner.forward(torch.tensor([[11], [12]]), torch.ones(2, 1, dtype=torch.bool), one, 1)

    step()
    assert runner.counts.captures == 0 and runner.counts.replays == 0 and runner.counts.eager_forwards == 1  # first sight: eager
    step()
    step()
    assert runner.counts.captures == 1 and runner.counts.replays == 2 and runner.counts.eager_forwards == 1


def test_buffer_growth_drops_the_graphs_and_keeps_the_tokens():
    """A job captures over buffers reserved for its longest request; a later, longer job grows them (the
    columns double): graphs captured on the old ones are dropped and captured again; the output is the
    eager engine's."""
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    ps = make_prompts()[:4]
    jobs = [[Request(i, p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for i, p in enumerate(ps)] for n in (24, 280)]
    eager = [r.token_ids for job in jobs for r in generate_with(target, draft, None).generate(job)]
    engine = generate_with(target, draft, {})
    small = engine.target.rows.runner
    pointers = []
    original = small.graphs._capture

    def capture(key, fn, inputs):
        pointers.append(tuple(buffer_pointers(small)))
        return original(key, fn, inputs)

    small.graphs._capture = capture
    out = [r.token_ids for job in jobs for r in engine.generate(job)]
    assert out == eager
    assert len(set(pointers)) > 1  # captured over more than one set of buffers


def test_at_most_max_graphs_are_kept():
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    ps = make_prompts()
    eager, _ = generate(target, draft, ps)
    replayed, engine = generate(target, draft, ps, graphs={"max_graphs": 2, "capture_after": 1})
    assert replayed == eager
    assert len(engine.target.rows.runner.graphs.graphs) <= 2 and engine.target.rows.runner.counts.captures > 2


def test_graphs_and_compile_default_off_on_a_cpu():
    """EngineConfig's and DraftModelDrafter's None (the default) turns CUDA graphs and torch.compile on
    for a static runner on a CUDA device only (tests/gpu/test_gpu_static.py checks it there)."""
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(SpeculationConfig(num_speculative_tokens=4)))
    for runner in (engine.target.rows.runner, engine.draft.drafter.rows.runner):
        assert isinstance(runner, StaticRunner) and runner.graphs is None and runner._compiled is None
    assert make_runner(tiny_model("gpt2", 0), "auto", cuda_graphs=None, compile=None).__class__.__name__ == "DynamicRunner"


def test_cuda_graphs_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="CUDA device"):
        StaticRunner(tiny_model("llama", 0), cuda_graphs=True)
    with pytest.raises(ValueError, match="static runner"):
        make_runner(tiny_model("gpt2", 0), "auto", cuda_graphs=True)
    with pytest.raises(ValueError, match="static runner"):
        make_runner(tiny_model("llama", 0), "dynamic", cuda_graphs=True)


@pytest.mark.parametrize("k", [0, 4])
def test_a_batchs_tail_replays_the_next_buckets_graph(k):
    """Eight rows end one by one (each its own token budget): the rows left are padded with free
    slots up to a bucket (8, 4, 2, 1), so the tail replays a few graphs, not one capture per batch
    size or eager steps; every row's tokens are the eager engine's."""
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    ps = make_prompts(lengths=(5, 9, 3, 7, 4, 6, 8, 2))
    reqs = [Request(i, p, SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True)) for i, p in enumerate(ps)]

    def run(graphs):
        engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static"),
                            EngineConfig(SpeculationConfig(num_speculative_tokens=k), max_batch_size=8, runner="static"))
        if graphs:
            graphed(engine.target.rows.runner, capture_after=1)
            graphed(engine.draft.drafter.rows.runner, capture_after=1)
        return [r.token_ids for r in engine.generate(reqs)], engine

    eager, _ = run(False)
    EagerProgram.captured_rows, EagerProgram.padded_replays = [], 0
    replayed, engine = run(True)
    assert replayed == eager and [len(t) for t in replayed] == [4 + 3 * i for i in range(8)]
    assert set(EagerProgram.captured_rows) <= {1, 2, 4, 8} and EagerProgram.padded_replays > 0
    steps = engine.target.rows.runner.graphs
    assert {key.rows for key in steps.graphs} <= {1, 2, 4, 8}


@pytest.mark.parametrize("graphs", [None, {}])
def test_the_steps_count_their_replays_eager_forwards_and_bytes(graphs):
    """StepTimings carries both runners' counts (raysd.models.cuda_graphs.GraphCounts) over the steps:
    without graphs every step forward is eager (the target's one, the draft's up to K: its pending
    tokens, then one per draft but the last); with them, what ran eager is what was not captured yet."""
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    _, engine = generate(target, draft, make_prompts(), k=4, graphs=graphs)
    t, runners = engine.timings, [engine.target.rows.runner, engine.draft.drafter.rows.runner]
    assert t.graph_replays == sum(r.counts.replays for r in runners)
    assert t.eager_forwards == sum(r.counts.eager_forwards for r in runners)
    assert t.graph_captures == sum(r.counts.captures for r in runners)
    assert t.bytes_read > 0 and all(r.counts.prefill_forwards > 0 for r in runners)
    if graphs is None:
        assert t.graph_replays == t.graph_captures == 0
        assert t.steps + t.drafted_steps < t.eager_forwards <= t.steps + 4 * t.drafted_steps
    else:
        assert t.graph_replays > t.eager_forwards and t.graph_captures > 0


def test_bytes_read_are_the_weights_and_the_attended_keys_and_values():
    """A step's bytes: every weight once (the input embedding only where it is the output head too),
    then keys and values of every attended column of every slot, padding included. Plain decoding of
    B rows for n steps reads n (weights + 2 L Hkv D itemsize B W) with W the attended width."""
    from raysd.engine.drafters import NoDrafter

    model = tiny_model("llama", 0)
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - model.get_input_embeddings().weight.numel() * 4
    column = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    runner = StaticRunner(model)
    assert runner.bytes_per_forward(3, 64) == weights + column * 3 * 64
    engine = SpecEngine(model, NoDrafter(VOCAB), EngineConfig(SpeculationConfig(num_speculative_tokens=0), max_batch_size=3,
                                                               runner="static"))
    ps = make_prompts()[:3]
    engine.generate([Request(i, p, SamplingParams(max_new_tokens=10, ignore_eos=True)) for i, p in enumerate(ps)])
    t = engine.timings
    assert t.bytes_read == t.steps * (weights + column * 3 * 64)  # three rows of under 64 tokens each step
