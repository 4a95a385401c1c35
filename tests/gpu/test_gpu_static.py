"""The static-cache runner on a CUDA device: exact logits, no host
synchronisation in a decode step, a step captured as a CUDA graph that replays exactly,
and the engine over static runners in bf16.

Skipped without CUDA (see conftest); RAYSD_GPU_TESTS_ON_CPU=1 dry-runs the parts that do
not need CUDA (the sync and CUDA-graph tests skip there).
"""

from __future__ import annotations

import random

import pytest
import torch

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.dynamic_runner import DynamicRunner
from raysd.models.static_runner import CudaGraphStep, StaticRunner
from tests.conftest import EOS, VOCAB
from tests.engine.test_equivalence import prompts as make_prompts
from tests.gpu.gpu_helpers import DEVICE, check_greedy_close, hf_greedy, tiny_on_device
from tests.models.test_dynamic_runner import right_aligned as cpu_right_aligned

needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA itself")


def right_aligned(rows, width=None):
    ids, valid = cpu_right_aligned(rows, width)
    return ids.to(DEVICE), valid.to(DEVICE)


@torch.inference_mode()
def reference(model, tokens, n):
    return model(torch.tensor([tokens], device=DEVICE)).logits[0, -n:].float()


def steps(model, runner, rng, hist, n_steps=6, width=5, step=None):
    """Feed `width` tokens per row per step (left-padded when fewer), check logits against the
    unpadded reference, roll back a random 0-3 tokens per row."""
    for _ in range(n_steps):
        new = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, width))] for _ in hist]
        ids, valid = right_aligned(new, width)
        num = torch.tensor([len(x) for x in new], device=DEVICE)
        logits = step(ids, valid, num) if step else runner.forward(ids, valid, num, max_logits=width)
        hist = [h + x for h, x in zip(hist, new)]
        for b, (h, x) in enumerate(zip(hist, new)):
            torch.testing.assert_close(logits[b, : len(x)], reference(model, h, len(x)), atol=1e-4, rtol=0)
        drop = [rng.randint(0, min(3, len(h) - 1)) for h in hist]
        runner.rollback(runner.lengths - torch.tensor(drop, device=DEVICE))
        hist = [h[: len(h) - d] for h, d in zip(hist, drop)]
    return hist


def prefilled(model, rng, rows=4, max_cache_len=64, compile=False):
    runner = StaticRunner(model, max_cache_len=max_cache_len, compile=compile)
    runner.add_rows(rows)
    hist = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(rows)]
    runner.forward(*right_aligned(hist), torch.ones(rows, dtype=torch.int64, device=DEVICE))
    return runner, hist


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_static_runner_on_device_matches_unpadded_reference(arch):
    model = tiny_on_device(arch, dtype=torch.float32)
    rng = random.Random(0)
    runner, hist = prefilled(model, rng, max_cache_len=16)  # small: the buffers grow
    steps(model, runner, rng, hist, n_steps=12)


@needs_cuda
def test_a_decode_step_makes_no_host_synchronisation():
    model = tiny_on_device("llama", dtype=torch.bfloat16)
    rng = random.Random(1)
    runner, hist = prefilled(model, rng)
    ids, valid = right_aligned([[5, 6, 7, 8, 9]] * 4)
    num = torch.full((4,), 5, device=DEVICE)
    runner.forward(ids, valid, num, max_logits=5)  # warm-up (lazy allocations)
    runner.rollback(runner.lengths - 5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.forward(ids, valid, num, max_logits=5)
        runner.rollback(runner.lengths - 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_step_replays_exactly(dtype):
    """The captured step gives the eager step's logits (fp32: to the reference; bf16: bit for
    bit against an eager twin fed the same inputs), through rollbacks and compactions."""
    model = tiny_on_device("llama", dtype=dtype)
    if dtype == torch.float32:
        rng = random.Random(2)
        runner, hist = prefilled(model, rng, max_cache_len=48)
        step = CudaGraphStep(runner, width=5, max_logits=5, attend=128)
        steps(model, runner, rng, hist, n_steps=12, step=step)
        return
    rng_a, rng_b = random.Random(3), random.Random(3)
    graphed, _ = prefilled(model, rng_a, max_cache_len=48)
    eager, _ = prefilled(model, rng_b, max_cache_len=48)
    step = CudaGraphStep(graphed, width=5, max_logits=5, attend=128)
    eager._reserve(128)
    for _ in range(12):
        new = [[rng_a.randrange(3, VOCAB) for _ in range(rng_a.randint(1, 5))] for _ in range(4)]
        ids, valid = right_aligned(new, 5)
        num = torch.tensor([len(x) for x in new], device=DEVICE)
        graph_logits = step(ids, valid, num)
        assert torch.equal(graph_logits, eager_step(eager, ids, valid, num))
        drop = torch.tensor([rng_a.randint(0, 2) for _ in range(4)], device=DEVICE)
        graphed.rollback(graphed.lengths - drop)
        eager.rollback(eager.lengths - drop)
    graphed.select([0, 1])  # fewer rows than captured is still valid (GraphedSteps pads the free slots)
    graphed._reserve(graphed.cache.capacity[1])  # the buffers double, and move
    with pytest.raises(RuntimeError, match="buffers moved.*capture a new step"):
        step(ids, valid, num)


@needs_cuda
def test_a_compiled_step_captured_as_a_cuda_graph_matches_the_reference():
    """torch.compile's kernels (Inductor's fusions) captured in the step's CUDA graph: fp32 logits
    equal the unpadded reference's through rollbacks, as the eager graph's do. The prefill runs eager."""
    model = tiny_on_device("llama", dtype=torch.float32)
    rng = random.Random(4)
    runner, hist = prefilled(model, rng, max_cache_len=48, compile=True)
    step = CudaGraphStep(runner, width=5, max_logits=5, attend=128)
    steps(model, runner, rng, hist, n_steps=8, step=step)


def eager_step(runner, ids, valid, num, attend=128):
    """The eager twin of a CudaGraphStep(attend=128): the same kernels at the same attended width."""
    lengths = runner._lengths[: runner.num_rows]
    out = runner._device_step(slice(0, runner.num_rows), lengths, ids, valid, num, 5, 5, attend)
    lengths.add_(valid.sum(dim=1))
    runner._bound += ids.shape[1]
    return out


def test_bf16_engine_over_static_runners_matches_hf_up_to_near_ties():
    target = tiny_on_device("llama", dtype=torch.bfloat16)
    draft = tiny_on_device("llama", seed=3, layers=1, dtype=torch.bfloat16)
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static"), EngineConfig(speculation, max_batch_size=8, runner="static"))
    assert isinstance(engine.target.rows.runner, StaticRunner)
    ps = make_prompts()
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])
    check_greedy_close(target, ps, [r.token_ids for r in results], [hf_greedy(target, p, 24) for p in ps])
    # and against the dynamic-cache engine, the same model in bf16
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
    dyn = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="dynamic"), EngineConfig(speculation, max_batch_size=8, runner="dynamic"))
    assert isinstance(dyn.target.rows.runner, DynamicRunner)
    check_greedy_close(target, ps, [r.token_ids for r in results],
                       [r.token_ids for r in dyn.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compile", [False, True], ids=["eager-kernels", "compiled"])
def test_engine_with_cuda_graphs_matches_eager(dtype, compile):
    """EngineConfig(cuda_graphs=True) and DraftModelDrafter(cuda_graphs=True): the target's decode and
    verify forwards and the draft's one-token forwards replayed as CUDA graphs (raysd.models.cuda_graphs).
    fp32 (TF32 off): tokens equal HF's exactly; bf16: within the near-tie rule, since a graph attends a
    wider (masked) window than the eager step and SDPA may tile it differently. `compile`: the graphs
    capture torch.compile's kernels (EngineConfig.compile, DraftModelDrafter(compile=True))."""
    target = tiny_on_device("llama", dtype=dtype)
    draft = tiny_on_device("llama", seed=3, layers=1, dtype=dtype)
    ps = make_prompts()

    def run(graphs: bool):
        speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
        engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static", cuda_graphs=graphs, compile=compile),
                            EngineConfig(speculation, max_batch_size=4, runner="static", cuda_graphs=graphs, compile=compile))
        out = [r.token_ids for r in engine.generate([Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(ps)])]
        return out, engine

    graphed, engine = run(True)
    assert engine.target.rows.runner.counts.replays > 0 and engine.draft.drafter.rows.runner.counts.replays > 0
    expected = [hf_greedy(target, p, 24) for p in ps]
    if dtype == torch.float32:
        assert graphed == expected
    else:
        check_greedy_close(target, ps, graphed, expected)


@needs_cuda
def test_an_engine_on_cuda_replays_graphs_of_compiled_forwards_by_default(monkeypatch):
    """EngineConfig() and DraftModelDrafter() on a CUDA device: CUDA graphs on, and torch.compile under
    them (tests/gpu's conftest turns the compile off for the other tests; nothing is run here)."""
    import raysd.models.runner

    monkeypatch.setattr(raysd.models.runner, "AUTO_COMPILE", True)
    target = tiny_on_device("llama", dtype=torch.bfloat16)
    draft = tiny_on_device("llama", seed=3, layers=1, dtype=torch.bfloat16)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(SpeculationConfig(num_speculative_tokens=4)))
    for runner in (engine.target.rows.runner, engine.draft.drafter.rows.runner):
        assert runner.graphs is not None and runner._compiled is not None


@needs_cuda
@pytest.mark.parametrize("auto", [False, True], ids=["k4", "k-auto"])
def test_steady_state_steps_are_replays_of_captured_programs(auto):
    """The engine captures every program its steps replay before the first step (raysd.engine.graphs):
    with rows finishing and refilling, the batch's tail and, under -k auto, K changing, no step captures
    a graph or runs a forward eagerly, each drafting step is one draft replay and one verify replay, and
    fp32 greedy tokens equal HF's (tests/engine/test_graphed_steps.py on the CPU with a stand-in capture)."""
    from raysd.core.speculation import AdaptiveConfig

    target = tiny_on_device("llama", dtype=torch.float32)
    draft = tiny_on_device("llama", seed=3, layers=1, dtype=torch.float32)
    ps = make_prompts(lengths=(5, 9, 3, 7, 4, 6, 8, 2) * 3)
    budgets = [6 + i % 7 for i in range(len(ps))]
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,), adaptive=AdaptiveConfig() if auto else None)
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static", cuda_graphs=True, compile=False),
                        EngineConfig(speculation, max_batch_size=4, runner="static", cuda_graphs=True, compile=False))
    runners = engine.target.rows.runner, engine.draft.drafter.rows.runner
    per_step, step = [], engine.step

    def counted_step():
        before = [r.counts.copy() for r in runners]
        verdict = step()
        after = [r.counts.minus(b) for r, b in zip(runners, before)]
        per_step.append((verdict.plan.k, sum(c.captures for c in after), sum(c.eager_forwards for c in after)))
        return verdict

    engine.step = counted_step
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(ps, budgets))])
    assert [r.token_ids for r in out] == [hf_greedy(target, p, n) for p, n in zip(ps, budgets)]
    assert all(captures == 0 and eager == 0 for _, captures, eager in per_step), per_step
    assert engine.timings.graph_captures > 0 and engine.timings.eager_forwards == 0


@needs_cuda
def test_a_batchs_tail_replays_padded_cuda_graphs():
    """Eight rows end one by one (each its own token budget): the rows left replay the graph of the
    next row bucket (8, 4, 2, 1), free slots fed all-padding chunks (raysd.models.cuda_graphs). fp32
    (TF32 off): every row's tokens equal HF's greedy exactly."""
    target = tiny_on_device("llama", dtype=torch.float32)
    draft = tiny_on_device("llama", seed=3, layers=1, dtype=torch.float32)
    ps = make_prompts(lengths=(5, 9, 3, 7, 4, 6, 8, 2))
    budgets = [4 + 3 * i for i in range(8)]
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static", cuda_graphs=True),
                        EngineConfig(speculation, max_batch_size=8, runner="static", cuda_graphs=True))
    out = engine.generate([Request(i, p, SamplingParams(max_new_tokens=n)) for i, (p, n) in enumerate(zip(ps, budgets))])
    assert [r.token_ids for r in out] == [hf_greedy(target, p, n) for p, n in zip(ps, budgets)]
    keys = engine.target.rows.runner.graphs.graphs
    assert keys and {key.rows for key in keys} <= {1, 2, 4, 8}


@needs_cuda
@pytest.mark.parametrize("k", [0, 4])
def test_an_engine_step_synchronises_once(k):
    """The step's read-back is its one host synchronisation (counted on the CPU in
    tests/engine/test_host_syncs.py); on CUDA the step's host-to-device copies are asynchronous too
    (raysd.core.device). torch's sync debug mode counts the synchronising calls of a long and of a short
    run: their difference per step (admission and prefill cancel)."""
    import warnings

    from raysd.engine.drafters import NoDrafter

    target = tiny_on_device("llama", dtype=torch.bfloat16)
    draft = tiny_on_device("llama", seed=3, layers=1, dtype=torch.bfloat16)
    ps = make_prompts()[:4]

    def syncs(new_tokens: int) -> tuple[int, int]:
        drafter = DraftModelDrafter(draft, VOCAB, runner="static") if k else NoDrafter(VOCAB, DEVICE)
        engine = SpecEngine(target, drafter, EngineConfig(SpeculationConfig(num_speculative_tokens=k), max_batch_size=4))
        reqs = [Request(i, p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for i, p in enumerate(ps)]
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(reqs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught), engine.timings.steps

    (short, short_steps), (long, long_steps) = syncs(8), syncs(32)
    assert long_steps > short_steps
    assert (long - short) / (long_steps - short_steps) <= 1.0, (long - short, long_steps - short_steps)
