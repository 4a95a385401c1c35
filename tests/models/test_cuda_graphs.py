"""raysd.models.cuda_graphs on the CPU: which shapes are captured, when graphs are dropped, and that
a runner replaying "graphs" keeps the engine's output. The capture is an eager stand-in with
CudaGraphStep's contract (fixed rows, width, logits and attended columns; refuses moved buffers);
tests/gpu/test_gpu_static.py runs the real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.cuda_graphs import MIN_ATTEND, GraphedSteps, attend_bucket, buffer_pointers
from raysd.models.runner import make_runner
from raysd.models.static_runner import SMALL_CHUNK, StaticRunner
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_equivalence import prompts as make_prompts


class EagerStep:
    """CudaGraphStep's contract without CUDA: the step over `rows` slots (the runner's rows, then free
    slots fed all-padding chunks) at a fixed attended width, run eagerly."""

    captured_rows: list[int] = []  # every capture's rows, for the tests to read
    padded_replays = 0

    def __init__(self, runner: StaticRunner, rows: int, width: int, max_logits: int, attend: int, pool=None):
        assert runner.num_rows <= rows <= runner.cache.capacity[0]
        runner._reserve(attend)
        runner._lengths[runner.num_rows : rows] = 0  # as CudaGraphStep: free slots start empty
        self.runner, self.B, self.T, self.n, self.attend = runner, rows, width, max_logits, attend
        self.keep = width if width <= SMALL_CHUNK else max_logits
        self.pointers = buffer_pointers(runner)
        EagerStep.captured_rows.append(rows)

    def __call__(self, chunks, chunk_valid, num_logits):
        r = self.runner
        assert chunks.shape == (self.B, self.T) and r.num_rows <= self.B and r._bound + self.T <= self.attend
        assert not chunk_valid[r.num_rows :].any(), "a padding row is fed nothing"
        EagerStep.padded_replays += r.num_rows < self.B
        assert buffer_pointers(r) == self.pointers, "replayed over moved buffers"
        rows = slice(0, self.B)
        lengths = r._lengths[rows]
        out = r._device_step(rows, lengths, chunks, chunk_valid, num_logits, self.n, self.keep, self.attend)
        lengths.add_(chunk_valid.sum(dim=1))
        r._bound += self.T
        return out


def graphed(runner: StaticRunner, **options) -> StaticRunner:
    runner.graphs = GraphedSteps(runner, EagerStep, **options)
    return runner


def generate(target, draft, ps, k=4, batch=4, graphs=None, max_new=24):
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static"),
                        EngineConfig(SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,)), max_batch_size=batch,
                                     runner="static"))
    if graphs is not None:
        graphed(engine.target.rows.runner, **graphs)
        graphed(engine.draft.drafter.rows.runner, **graphs)
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=max_new)) for i, p in enumerate(ps)])
    return [r.token_ids for r in out], engine


def test_attend_bucket():
    assert attend_bucket(1, 4096) == MIN_ATTEND
    assert attend_bucket(MIN_ATTEND, 4096) == MIN_ATTEND
    assert attend_bucket(MIN_ATTEND + 1, 4096) == 2 * MIN_ATTEND
    assert attend_bucket(300, 400) == 400  # within the buffer when that is enough
    assert attend_bucket(500, 400) == 500  # else what the rows need (the capture grows the buffer)


@pytest.mark.parametrize("k", [0, 4])
def test_replayed_steps_keep_the_engines_tokens(k):
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    ps = make_prompts()
    eager, _ = generate(target, draft, ps, k=k)
    replayed, engine = generate(target, draft, ps, k=k, graphs={})
    assert replayed == eager
    steps = engine.target.rows.runner.graphs
    assert steps.captures > 0 and steps.replays > steps.captures  # captured once, replayed many times
    if k:
        assert engine.draft.drafter.rows.runner.graphs.replays > 0


def test_a_shape_is_captured_the_second_time_it_is_seen():
    runner = graphed(StaticRunner(tiny_model("llama", 0)), capture_after=2)
    runner.add_prefilled([[5, 6, 7], [8, 9]])
    one = torch.ones(2, dtype=torch.int64)

    def step():
        return runner.forward(torch.tensor([[11], [12]]), torch.ones(2, 1, dtype=torch.bool), one, 1)

    step()
    assert runner.graphs.captures == 0 and runner.graphs.replays == 0  # first sight: eager
    step()
    step()
    assert runner.graphs.captures == 1 and runner.graphs.replays == 2


def test_buffer_growth_drops_the_graphs_and_keeps_the_tokens():
    """Rows outgrow the initial buffer (8 columns): the buffers double, graphs captured on the old
    ones are dropped and captured again; the output is unchanged."""
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    ps = make_prompts()
    eager, _ = generate(target, draft, ps)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static"),
                        EngineConfig(SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,)), max_batch_size=4,
                                     runner="static"))
    small = StaticRunner(target, max_cache_len=8)
    engine.target.rows.runner = graphed(small)
    pointers = []
    original = small.graphs._capture

    def capture(key):
        pointers.append(tuple(buffer_pointers(small)))
        return original(key)

    small.graphs._capture = capture
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])
    assert [r.token_ids for r in out] == eager
    assert len(set(pointers)) > 1  # captured over more than one set of buffers


def test_at_most_max_graphs_are_kept():
    target, draft = tiny_model("llama", 0), tiny_model("llama", 3, layers=1)
    ps = make_prompts()
    eager, _ = generate(target, draft, ps)
    replayed, engine = generate(target, draft, ps, graphs={"max_graphs": 2, "capture_after": 1})
    assert replayed == eager
    assert len(engine.target.rows.runner.graphs.graphs) <= 2 and engine.target.rows.runner.graphs.captures > 2


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
    EagerStep.captured_rows, EagerStep.padded_replays = [], 0
    replayed, engine = run(True)
    assert replayed == eager and [len(t) for t in replayed] == [4 + 3 * i for i in range(8)]
    assert set(EagerStep.captured_rows) <= {1, 2, 4, 8} and EagerStep.padded_replays > 0
    steps = engine.target.rows.runner.graphs
    assert {key[0] for key in steps.graphs} <= {1, 2, 4, 8}
