"""StaticRunner (one preallocated slot per row) against the same oracle as DynamicRunner:
each row's logits equal a fresh, unpadded, batch-of-one forward over the row's history,
whatever was done to the cache (ragged chunks, rollback by moving lengths, select,
add_rows, add_prefilled, buffer growth).

Most scenarios are tests/models/test_dynamic_runner.py's own, run with StaticRunner in place
of DynamicRunner (its mask-layout checks do not apply: a slot runner has no mask); the rest
are specific to the slot layout.
"""

import functools
import os
import random

import pytest
import torch

import tests.models.test_dynamic_runner as base
from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.dynamic_runner import DynamicRunner
from raysd.models.runner import make_runner
from raysd.models.static_runner import PREFILL_CALL_TOKENS, StaticRunner, prefill_groups
from tests.conftest import EOS, VOCAB, tiny_model
from tests.models.test_dynamic_runner import assert_rows_match, random_tokens, right_aligned

ARCHS = ["llama", "qwen2"]

REUSED = [
    "test_ragged_left_padded_forward_matches_unpadded",
    "test_rollback_to_arbitrary_lengths_then_feed",
    "test_select_drops_and_reorders_rows",
    "test_add_rows_into_running_batch_including_one_token_prompts",
    "test_commit_keeps_longest_common_prefix_of_fed_and_committed",
    "test_commit_over_drafts_fed_in_two_steps",
    "test_random_engine_loop_keeps_every_row_exact",
]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=ARCHS.index(request.param))


def _sane(runner, lengths=None, packed=False):
    """Every cached key/value of every row (columns < its length) is finite; lengths as expected."""
    assert runner.lengths.shape == (runner.num_rows,)
    for i, layer in enumerate(runner._layers()):
        for b, n in enumerate(runner.lengths.tolist()):
            assert torch.isfinite(layer.keys[b, :, :n]).all() and torch.isfinite(layer.values[b, :, :n]).all(), (i, b)
    if lengths is not None:
        assert runner.lengths.tolist() == list(lengths)


@pytest.mark.parametrize("max_cache_len", [4, 512])  # 4: the buffers grow many times
@pytest.mark.parametrize("name", REUSED)
def test_runner_scenarios_with_a_static_cache(model, name, max_cache_len, monkeypatch):
    static = functools.partial(StaticRunner, max_cache_len=max_cache_len, checks=True, width_bucket=8)
    monkeypatch.setattr(base, "DynamicRunner", lambda model, repack_fraction=None: static(model))
    monkeypatch.setattr(base, "assert_cache_sane", _sane)
    getattr(base, name)(model, **({"repack": 1e9} if name == "test_rollback_to_arbitrary_lengths_then_feed" else {}))


def test_rollback_moves_lengths_and_select_copies_only_moved_rows(model):
    rng = random.Random(11)
    runner = StaticRunner(model, max_cache_len=64, checks=True)
    runner.add_rows(4)
    hist = [random_tokens(rng, n) for n in (5, 2, 7, 4)]
    runner.forward(*right_aligned(hist), torch.ones(4, dtype=torch.int64))
    keys = runner._layers()[0].keys
    before = keys.clone()
    runner.rollback(torch.tensor([3, 2, 4, 1]), max_length=4)
    hist = [h[:k] for h, k in zip(hist, [3, 2, 4, 1])]
    assert runner._layers()[0].keys is keys and torch.equal(keys, before)  # nothing moved, nothing written
    # Row 1 finished: the last row fills its slot; rows 0 and 2 are not touched.
    runner.select([0, 3, 2])
    hist = [hist[0], hist[3], hist[2]]
    assert torch.equal(keys[0], before[0]) and torch.equal(keys[2], before[2])
    for step in range(6):
        new = [random_tokens(rng, rng.randint(1, 3)) for _ in hist]
        num = [rng.randint(1, len(n)) for n in new]
        logits = runner.forward(*right_aligned(new), torch.tensor(num), max_logits=max(num))
        hist = [h + n for h, n in zip(hist, new)]
        assert_rows_match(model, logits, hist, num)
        keep = [len(h) - rng.randint(0, 1) for h in hist]
        runner.rollback(torch.tensor(keep), max(keep))
        hist = [h[:k] for h, k in zip(hist, keep)]
    with pytest.raises(AssertionError):
        runner.rollback(runner.lengths + 1)


def test_add_prefilled_runs_only_the_new_slots_and_buffers_grow(model):
    rng = random.Random(12)
    runner2 = StaticRunner(model, max_cache_len=4, checks=True, width_bucket=4)
    hist = [random_tokens(rng, 3), []]
    runner2.add_prefilled(hist)
    old = runner2._layers()[0].keys[0, :, :3].clone()
    more = [random_tokens(rng, 9), [], random_tokens(rng, 1)]
    runner2.add_prefilled(more)  # longer than the buffer: it doubles, slot 0 keeps its cache
    hist += more
    assert torch.equal(runner2._layers()[0].keys[0, :, :3], old)
    assert runner2.lengths.tolist() == [3, 0, 9, 0, 1] and runner2.cache.capacity[1] >= 10
    new = [random_tokens(rng, 2) for _ in hist]
    logits = runner2.forward(*right_aligned(new), torch.full((5,), 2), max_logits=2)
    hist = [h + n for h, n in zip(hist, new)]
    assert_rows_match(model, logits, hist, [2] * 5)


def test_prefill_groups_minimise_padding_plus_a_cost_per_forward():
    assert prefill_groups([]) == []
    assert prefill_groups([10] * 8) == [(0, 8)]  # equal lengths: one forward
    assert prefill_groups([53, 64, 769, 40, 85, 660, 78, 93], call_tokens=64) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8)]
    assert prefill_groups([5, 200], call_tokens=1000) == [(0, 2)]  # forwards dear: pad rather than split
    rng = random.Random(3)
    for _ in range(50):  # every partition is a cover of consecutive runs, no cheaper than one forward
        lengths = [rng.randint(0, 300) for _ in range(rng.randint(1, 9))]
        runs = prefill_groups(lengths)
        assert [r[0] for r in runs] == [0] + [r[1] for r in runs[:-1]] and runs[-1][1] == len(lengths)
        cost = sum(PREFILL_CALL_TOKENS + (hi - lo) * max(lengths[lo:hi]) for lo, hi in runs)
        assert cost <= PREFILL_CALL_TOKENS + len(lengths) * max(lengths)


def test_add_prefilled_in_several_forwards_keeps_every_row_exact(model):
    """Prompts of very different lengths go in separate forwards; each row's cache is still its own prompt's."""
    rng = random.Random(5)
    runner = StaticRunner(model, checks=True, width_bucket=8)
    runner.add_prefilled([random_tokens(rng, 4)])
    hist = [random_tokens(rng, n) for n in (3, 90, 2, 70, 1, 0)]
    assert len(prefill_groups([len(h) for h in hist])) > 1
    runner.add_prefilled(hist)
    assert runner.lengths.tolist()[1:] == [len(h) for h in hist]
    new = [random_tokens(rng, 2) for _ in range(runner.num_rows)]
    logits = runner.forward(*right_aligned(new), torch.full((runner.num_rows,), 2), max_logits=2)
    assert_rows_match(model, logits[1:], [h + n for h, n in zip(hist, new[1:])], [2] * len(hist))


def test_make_runner_picks_static_for_llama_family_and_refuses_quietly_nothing():
    assert isinstance(make_runner(tiny_model("llama")), StaticRunner)
    assert isinstance(make_runner(tiny_model("qwen2")), StaticRunner)
    assert isinstance(make_runner(tiny_model("gpt2")), DynamicRunner)
    assert isinstance(make_runner(tiny_model("llama"), "dynamic"), DynamicRunner)
    with pytest.raises(ValueError, match="StaticRunner supports"):
        make_runner(tiny_model("gpt2"), "static")
    with pytest.raises(ValueError, match="runner must be one of"):
        make_runner(tiny_model("llama"), "fast")


def test_engine_with_static_runners_matches_hf_greedy():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=3, layers=1)
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=(EOS,))
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB, runner="static"), EngineConfig(speculation, max_batch_size=3, runner="static"))
    assert isinstance(engine.target.rows.runner, StaticRunner)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 1, 12, 3, 7)]
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        out = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=20,
                              do_sample=False, eos_token_id=EOS, pad_token_id=0)
        assert r.token_ids == out[0, len(p):].tolist()


def test_a_decode_step_traces_as_one_graph_and_never_recompiles():
    """torch.compile / CUDA-graph readiness: dynamo captures a whole verification step
    (`_device_step`: columns, mask, the Llama over the static cache, the logits gather)
    with no graph break, and later steps (other lengths, rollbacks in between, within one
    attended width) reuse that graph: static shapes. (DynamicRunner's DynamicCache also
    traces without a break, but its cache grows every step: new shapes, new buffers, so
    neither a fixed compiled graph nor a CUDA graph can be reused.) The runners here run stock
    linears: the prepacked CPU kernels (raysd.models.linear) are an eager path, off under
    `compile=True` and on a GPU, where these graphs are for."""
    import torch._dynamo as dynamo

    model = tiny_model("llama", seed=0)
    runner = StaticRunner(model, max_cache_len=64, linear_kernels="stock")
    runner.add_rows(4)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (4, 8), generator=g)
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(4, dtype=torch.int64), max_logits=1)
    tok = torch.randint(3, VOCAB, (4, 5), generator=g)
    with torch.inference_mode():  # the whole step: columns, mask, model, logits gather
        explained = dynamo.explain(runner._device_step)(slice(0, 4), runner.lengths, tok, torch.ones_like(tok, dtype=torch.bool),
                                                        torch.full((4,), 5), 5, 5, 64)
    dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1

    def graphs_over_steps(make_runner):
        graphs = []

        def backend(gm, example_inputs):  # counts graphs, runs them eagerly
            graphs.append(gm)
            return gm.forward

        r = make_runner()
        r._compiled = torch.compile(model, backend=backend, dynamic=False)  # the steps' model call
        r.add_rows(4)
        gen = torch.Generator().manual_seed(1)
        p = torch.randint(3, VOCAB, (4, 8), generator=gen)
        r.forward(p, torch.ones_like(p, dtype=torch.bool), torch.ones(4, dtype=torch.int64))
        counts = []
        for _ in range(4):
            tok = torch.randint(3, VOCAB, (4, 5), generator=gen)
            r.forward(tok, torch.ones_like(tok, dtype=torch.bool), torch.full((4,), 5))
            r.rollback(r.lengths - 2)
            counts.append(len(graphs))
        dynamo.reset()
        return counts

    assert graphs_over_steps(lambda: StaticRunner(model, max_cache_len=64, linear_kernels="stock")) == [2, 2, 2, 2]  # the 8-token prefill (a step's width: compiled) + one decode graph


def test_compiled_steps_recompile_only_at_sizes_one_and_the_slots():
    """`StaticRunner(compile=True)` traces with symbolic shapes: a job's many step shapes (row buckets,
    chunk widths, attended widths) cost a handful of compiles, not one each, which with CUDA graphs
    would be one per captured shape (~20 s each for an 8B model). Here 13 shapes over 7 row counts,
    2 chunk widths and 6 attended widths make 6 graphs: T = 1 and T > 1, each for B = the slots'
    count, 1 < B < slots, and B = 1. (A counting backend: nothing is compiled for real.)"""
    import torch._dynamo as dynamo
    from raysd.models.static_runner import COMPILES

    model = tiny_model("llama", seed=0)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    runner = StaticRunner(model, max_cache_len=1024, linear_kernels="stock", compile=True)
    runner._compiled = torch.compile(model, backend=backend, dynamic=True)  # the runner's, counted
    g = torch.Generator().manual_seed(1)
    runner.add_rows(8)
    prompt = torch.randint(3, VOCAB, (8, 40), generator=g)
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(8, dtype=torch.int64))  # 40 > SMALL_CHUNK: eager
    assert graphs == []
    widths = set()
    for B, T, grow in [(8, 5, 0), (8, 1, 0), (8, 5, 40), (8, 1, 40), (6, 5, 0), (6, 1, 80), (3, 5, 0), (3, 1, 100),
                       (1, 5, 0), (1, 1, 100), (2, 5, 0), (5, 1, 0), (7, 5, 0)]:
        if runner.num_rows > B:
            runner.select(list(range(B)))
        elif runner.num_rows < B:
            runner.add_rows(B - runner.num_rows)
        if grow:  # an eager forward that moves the attended width on
            more = torch.randint(3, VOCAB, (B, grow), generator=g)
            runner.forward(more, torch.ones_like(more, dtype=torch.bool), torch.ones(B, dtype=torch.int64))
        tok = torch.randint(3, VOCAB, (B, T), generator=g)
        runner.forward(tok, torch.ones_like(tok, dtype=torch.bool), torch.full((B,), T))
        widths.add(runner._attended(runner._bound))
    dynamo.reset()
    assert len(widths) == 6 and len(graphs) == 6 <= COMPILES


@pytest.mark.skipif(os.environ.get("RAYSD_COMPILE_TESTS") != "1", reason="inductor compile takes minutes on a CPU; RAYSD_COMPILE_TESTS=1")
def test_torch_compile_of_the_static_runner_matches_eager():
    model = tiny_model("llama", seed=0)

    def run(runner):
        g = torch.Generator().manual_seed(0)
        runner.add_rows(4)
        prompt = torch.randint(3, VOCAB, (4, 8), generator=g)
        out = [runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(4, dtype=torch.int64), max_logits=1)]
        for _ in range(4):
            tok = torch.randint(3, VOCAB, (4, 5), generator=g)
            out.append(runner.forward(tok, torch.ones_like(tok, dtype=torch.bool), torch.full((4,), 5), max_logits=5))
            runner.rollback(runner.lengths - 2)
        return out

    eager = run(StaticRunner(model, max_cache_len=64))
    compiled = run(StaticRunner(model, max_cache_len=64, compile=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_tree_of_drafts_in_one_forward_then_one_branch_kept(model):
    """forward_tree: every node's logits equal an unpadded forward over context + its path;
    keep_path: the cache then holds exactly context + the kept branch."""
    rng = random.Random(21)
    runner = StaticRunner(model, max_cache_len=8, checks=True, width_bucket=8)  # small: buffers grow
    hist = [random_tokens(rng, n) for n in (5, 2, 7)]
    runner.add_prefilled(hist)
    trees = [[-1, -1, 0, 0, 1, 3], [-1, 0, 1], [-1, -1, -1, 2]]  # chunk-local parents, per row
    T = max(map(len, trees))
    parents = torch.tensor([t + [-1] * (T - len(t)) for t in trees])
    tokens = torch.tensor([random_tokens(rng, T) for _ in trees])
    logits = runner.forward_tree(tokens, parents, torch.tensor([len(t) for t in trees]))

    def path(b, t):
        return (path(b, trees[b][t]) if trees[b][t] >= 0 else []) + [int(tokens[b, t])]

    for b, tree in enumerate(trees):
        for t in range(len(tree)):
            torch.testing.assert_close(logits[b, t], base.reference(model, hist[b] + path(b, t))[-1], atol=1e-5, rtol=0)
    assert runner.lengths.tolist() == [5, 2, 7]  # nothing kept yet
    branches = [[0, 3, 5], [0], []]  # row 0: root -> 0 -> 3 -> 5; row 1: node 0 only; row 2: nothing
    nodes = torch.tensor([br + [-1] * (3 - len(br)) for br in branches])
    runner.keep_path(nodes, torch.tensor([len(br) for br in branches]))
    hist = [h + [int(tokens[b, t]) for t in br] for b, (h, br) in enumerate(zip(hist, branches))]
    assert runner.lengths.tolist() == [len(h) for h in hist]
    new = [random_tokens(rng, 2) for _ in hist]
    logits = runner.forward(*right_aligned(new), torch.full((3,), 2), max_logits=2)
    assert_rows_match(model, logits, [h + n for h, n in zip(hist, new)], [2, 2, 2])


def test_a_tree_fed_level_by_level_gives_the_logits_of_one_forward(model):
    """forward_tree(..., start=s): a tree written in several calls (a draft growing it level by
    level) gives every node the logits of an unpadded forward over context + its path, and
    keep_path then keeps a branch that spans the calls."""
    rng = random.Random(22)
    runner = StaticRunner(model, max_cache_len=8, checks=True, width_bucket=8)  # small: buffers grow
    hist = [random_tokens(rng, n) for n in (4, 6)]
    runner.add_prefilled(hist)
    ups = [-1, -1, 0, 0, 1, 2, 3]  # breadth first: levels [0, 2), [2, 5), [5, 7)
    T = len(ups)
    parents = torch.tensor([ups, ups])
    tokens = torch.tensor([random_tokens(rng, T) for _ in hist])
    counts = torch.tensor([T, 4])  # row 1: its first 4 nodes only
    logits = torch.cat([runner.forward_tree(tokens[:, s:e], parents[:, :e], (counts - s).clamp(0, e - s), start=s)
                        for s, e in ((0, 2), (2, 5), (5, 7))], dim=1)

    def path(t):
        return (path(ups[t]) if ups[t] >= 0 else []) + [t]

    for b in range(2):
        for t in range(int(counts[b])):
            want = base.reference(model, hist[b] + [int(tokens[b, n]) for n in path(t)])[-1]
            torch.testing.assert_close(logits[b, t], want, atol=1e-5, rtol=0)
    branches = [path(5), path(3)]  # nodes 0 -> 2 -> 5 (written by three calls), 1 -> 3 (two)
    runner.keep_path(torch.tensor([br + [-1] * (3 - len(br)) for br in branches]), torch.tensor([3, 2]), max_length=max(len(h) for h in hist) + 3)
    hist = [h + [int(tokens[b, n]) for n in br] for b, (h, br) in enumerate(zip(hist, branches))]
    assert runner.lengths.tolist() == [len(h) for h in hist]
    new = [random_tokens(rng, 2) for _ in hist]
    out = runner.forward(*right_aligned(new), torch.full((2,), 2), max_logits=2)
    assert_rows_match(model, out, [h + n for h, n in zip(hist, new)], [2, 2])
