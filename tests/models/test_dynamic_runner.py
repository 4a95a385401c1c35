"""DynamicRunner and CacheRows on tiny llama / qwen2 / gpt2 models.

The oracle everywhere is a fresh, unpadded, batch-of-one forward of the model over the
row's whole token history: whatever the runner did to its cache (left padding, rollback,
re-packing, selecting, merging), each row's logits must equal it.
"""
import random

import pytest
import torch

from raysd.engine.cache_rows import CacheRows
from raysd.models.dynamic_runner import DynamicRunner
from tests.conftest import VOCAB, tiny_model

ARCHS = ["llama", "qwen2", "gpt2"]
ATOL = 1e-5


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=ARCHS.index(request.param))


@torch.inference_mode()
def reference(model, tokens):
    """[len(tokens), V] float32 logits of an unpadded single-row forward."""
    return model(torch.tensor([tokens])).logits[0].float()


def right_aligned(rows, width=None):
    width = width or max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            ids[b, width - len(r):] = torch.tensor(r)
            valid[b, width - len(r):] = True
    return ids, valid


def assert_rows_match(model, logits, histories, num_logits):
    """Row b's first num_logits[b] logits are the reference's last num_logits[b]."""
    assert logits.dtype == torch.float32 and logits.shape[0] == len(histories)
    for b, (hist, n) in enumerate(zip(histories, num_logits)):
        expected = reference(model, hist)[-n:]
        torch.testing.assert_close(logits[b, :n], expected, atol=ATOL, rtol=0, msg=f"row {b}, history {hist}")


def assert_cache_sane(runner, lengths=None, packed=False):
    """No NaN/inf in any cached key or value; lengths consistent with the valid mask.

    A forward of a ragged chunk leaves padding holes between a row's tokens (allowed);
    `packed` also checks what rollback / select promise: each row's tokens form one
    right-aligned block and no column is unused by every row."""
    for i, layer in enumerate(runner.cache.layers):
        if getattr(layer, "keys", None) is None:
            continue
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all(), f"layer {i}"
        assert layer.keys.shape[0] == runner.num_rows and layer.keys.shape[2] == runner.valid.shape[1]
    valid = runner.valid
    assert valid.dtype == torch.bool and valid.shape[0] == runner.num_rows
    assert torch.equal(runner.lengths, valid.sum(1))
    L = valid.shape[1]
    if packed:
        suffix = torch.arange(L)[None, :] >= (L - runner.lengths)[:, None]
        assert torch.equal(valid, suffix), "each row's cached tokens must be a right-aligned block"
        if runner.num_rows:
            assert L == int(runner.lengths.max()), "no column is unused by every row"
    if lengths is not None:
        assert runner.lengths.tolist() == list(lengths)


def random_tokens(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# ---------------------------------------------------------------- DynamicRunner


def test_ragged_left_padded_forward_matches_unpadded(model):
    rng = random.Random(0)
    hist = [random_tokens(rng, n) for n in (6, 1, 3, 9)]
    runner = DynamicRunner(model)
    runner.add_rows(4)
    assert_cache_sane(runner, [0, 0, 0, 0])
    num = [2, 1, 3, 4]
    logits = runner.forward(*right_aligned(hist), torch.tensor(num))
    assert logits.shape == (4, 4, VOCAB)
    assert_rows_match(model, logits, hist, num)
    assert_cache_sane(runner, [6, 1, 3, 9])
    # A ragged continuation chunk, logits at every new token, then a single-token step.
    new = [random_tokens(rng, n) for n in (2, 3, 1, 4)]
    logits = runner.forward(*right_aligned(new), torch.tensor([2, 3, 1, 4]))
    hist = [h + n for h, n in zip(hist, new)]
    assert_rows_match(model, logits, hist, [2, 3, 1, 4])
    step = [[t] for t in random_tokens(rng, 4)]
    logits = runner.forward(*right_aligned(step), torch.ones(4, dtype=torch.int64))
    hist = [h + s for h, s in zip(hist, step)]
    assert_rows_match(model, logits, hist, [1] * 4)
    assert_cache_sane(runner, [len(h) for h in hist])


@pytest.mark.parametrize("repack", [0.0, 0.25, 1e9])  # after every rollback, by default, never (holes only)
def test_rollback_to_arbitrary_lengths_then_feed(model, repack):
    rng = random.Random(1)
    hist = [random_tokens(rng, n) for n in (7, 5, 8, 3)]
    runner = DynamicRunner(model, repack_fraction=repack)
    runner.add_rows(4)
    runner.forward(*right_aligned(hist), torch.ones(4, dtype=torch.int64))
    for it in range(4):
        keep = [rng.randint(0, len(h)) for h in hist]
        if it == 0:
            keep = [2, len(hist[1]), 0, 1]  # shrink, unchanged, emptied, to one token
        runner.rollback(torch.tensor(keep))
        hist = [h[:k] for h, k in zip(hist, keep)]
        assert_cache_sane(runner, keep, packed=repack == 0)
        if repack > 0 and runner.num_rows and hasattr(runner, "valid"):  # DynamicRunner: holes, never wider than the policy allows
            assert runner.valid.shape[1] <= max(keep) * (1 + repack)
        new = [random_tokens(rng, rng.randint(1, 4)) for _ in hist]
        num = [rng.randint(1, len(n)) for n in new]
        logits = runner.forward(*right_aligned(new), torch.tensor(num))
        hist = [h + n for h, n in zip(hist, new)]
        assert_rows_match(model, logits, hist, num)
        assert_cache_sane(runner, [len(h) for h in hist])
    lengths = runner.lengths.clone()
    runner.rollback(lengths)  # a no-op
    assert_cache_sane(runner, lengths.tolist())
    with pytest.raises(AssertionError):
        runner.rollback(lengths + 1)


def test_rollback_masks_rejected_tokens_without_copying_the_cache(model):
    rng = random.Random(5)
    runner = DynamicRunner(model)  # default policy: holes until the cache is 25% wider than the longest row
    runner.add_rows(3)
    hist = [random_tokens(rng, 12) for _ in range(3)]
    runner.forward(*right_aligned(hist), torch.ones(3, dtype=torch.int64))
    keys = runner._layers()[0].keys
    runner.rollback(torch.tensor([12, 10, 11]))  # rows 1 and 2 leave holes at their right end
    assert runner._layers()[0].keys.data_ptr() == keys.data_ptr() and runner.valid.shape[1] == 12  # nothing moved
    hist = [h[:k] for h, k in zip(hist, [12, 10, 11])]
    new = [random_tokens(rng, 3) for _ in hist]
    logits = runner.forward(*right_aligned(new), torch.full((3,), 3))
    assert_rows_match(model, logits, [h + n for h, n in zip(hist, new)], [3, 3, 3])
    runner.rollback(torch.tensor([5, 6, 4]))  # the columns no row uses are cut off (a view)
    assert runner.valid.shape[1] == 6 and runner._layers()[0].keys.shape[2] == 6
    hist = [(h + n)[:k] for h, n, k in zip(hist, new, [5, 6, 4])]
    new = [random_tokens(rng, 2) for _ in hist]
    logits = runner.forward(*right_aligned(new), torch.full((3,), 2))
    assert_rows_match(model, logits, [h + n for h, n in zip(hist, new)], [2, 2, 2])
    assert runner.valid.shape[1] == 8 and runner.valid[0].tolist() == [True] * 5 + [False] + [True] * 2
    runner.repack_fraction = 0.1
    runner.rollback(torch.tensor([7, 2, 1]))  # row 0's hole: 8 columns for 7 tokens is > 10% wider: re-packed
    assert_cache_sane(runner, [7, 2, 1], packed=True)


def test_select_drops_and_reorders_rows(model):
    rng = random.Random(2)
    hist = [random_tokens(rng, n) for n in (4, 9, 2, 6, 1)]
    runner = DynamicRunner(model)
    runner.add_rows(5)
    runner.forward(*right_aligned(hist), torch.ones(5, dtype=torch.int64))
    runner.select([3, 0, 4])  # the longest row (1) is dropped, so the cache narrows
    hist = [hist[3], hist[0], hist[4]]
    assert_cache_sane(runner, [6, 4, 1], packed=True)
    new = [random_tokens(rng, n) for n in (1, 3, 2)]
    logits = runner.forward(*right_aligned(new), torch.tensor([1, 3, 2]))
    hist = [h + n for h, n in zip(hist, new)]
    assert_rows_match(model, logits, hist, [1, 3, 2])
    runner.select([2, 1, 0])  # pure reorder
    hist = hist[::-1]
    assert_cache_sane(runner, [len(h) for h in hist], packed=True)
    step = [[t] for t in random_tokens(rng, 3)]
    logits = runner.forward(*right_aligned(step), torch.ones(3, dtype=torch.int64))
    hist = [h + s for h, s in zip(hist, step)]
    assert_rows_match(model, logits, hist, [1, 1, 1])
    assert_cache_sane(runner, [len(h) for h in hist])
    runner.select([])
    assert runner.num_rows == 0
    assert_cache_sane(runner, [], packed=True)


def test_merge_runners_with_different_widths(model):
    rng = random.Random(3)
    a_hist = [random_tokens(rng, n) for n in (3, 5)]
    b_hist = [random_tokens(rng, n) for n in (8, 1, 2)]
    a, b = DynamicRunner(model), DynamicRunner(model)
    a.add_rows(2)
    b.add_rows(3)
    a.forward(*right_aligned(a_hist), torch.ones(2, dtype=torch.int64))
    b.forward(*right_aligned(b_hist), torch.ones(3, dtype=torch.int64))
    a.merge(b)
    hist = a_hist + b_hist
    assert_cache_sane(a, [3, 5, 8, 1, 2])
    new = [random_tokens(rng, n) for n in (2, 1, 1, 3, 2)]
    logits = a.forward(*right_aligned(new), torch.tensor([2, 1, 1, 3, 2]))
    hist = [h + n for h, n in zip(hist, new)]
    assert_rows_match(model, logits, hist, [2, 1, 1, 3, 2])
    assert_cache_sane(a, [len(h) for h in hist])


# ---------------------------------------------------------------- CacheRows


def feed_and_check(model, seq, hist, drafts):
    """Feed each row's pending tokens and its drafts; check logits at pending-last and every draft."""
    counts = [len(d) for d in drafts]
    E = max(counts + [0])
    extra = torch.zeros(len(drafts), E, dtype=torch.int64)
    for b, d in enumerate(drafts):
        extra[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
    num = torch.tensor(counts) + 1
    logits = seq.feed(extra, torch.tensor(counts), num)
    assert_rows_match(model, logits, [h + d for h, d in zip(hist, drafts)], num.tolist())
    assert seq.pending == [[] for _ in hist]
    assert_cache_sane(seq.runner, [len(h) + len(d) for h, d in zip(hist, drafts)])
    return logits


def test_add_rows_into_running_batch_including_one_token_prompts(model):
    rng = random.Random(4)
    runner = DynamicRunner(model)
    seq = CacheRows(runner)
    # Only 1-token prompts: nothing to prefill, the fresh runner has no cache.
    hist = [[7], [9]]
    seq.add_rows(hist)
    assert seq.pending == [[7], [9]]
    assert_cache_sane(runner, [0, 0])
    # More rows before any forward: long prompts join rows that have no cache yet.
    new = [random_tokens(rng, 5), [11], random_tokens(rng, 2)]
    seq.add_rows(new)
    hist += new
    assert seq.pending == [[7], [9], new[0][-1:], [11], new[2][-1:]]
    assert_cache_sane(runner, [0, 0, 4, 0, 1])
    feed_and_check(model, seq, hist, [[] for _ in hist])
    committed = [[t] for t in random_tokens(rng, len(hist))]
    seq.commit(committed)
    hist = [h + c for h, c in zip(hist, committed)]
    # Rows joining a running batch: one longer than the cache, one shorter, 1-token ones, mixed order.
    new = [[13], random_tokens(rng, 12), [14], random_tokens(rng, 2), random_tokens(rng, 3)]
    seq.add_rows(new)
    hist += new
    assert [len(p) for p in seq.pending] == [1] * len(hist)
    assert_cache_sane(runner, [len(h) - 1 for h in hist])
    feed_and_check(model, seq, hist, [random_tokens(rng, rng.randint(0, 3)) for _ in hist])


def test_commit_keeps_longest_common_prefix_of_fed_and_committed(model):
    rng = random.Random(5)
    prompts = [random_tokens(rng, n) for n in (4, 3, 5, 2, 3, 4, 3)]
    seq = CacheRows(DynamicRunner(model))
    seq.add_rows(prompts)
    hist = [list(p) for p in prompts]
    plen = [len(p) for p in prompts]
    d = [random_tokens(rng, 3) for _ in prompts]
    drafts = [d[0], d[1], d[2][:2], [], d[4], d[5], []]
    feed_and_check(model, seq, hist, drafts)
    x = [t for t in random_tokens(rng, 20) if t not in sum(d, [])]
    new = [
        d[0] + [x[0]],          # all accepted + bonus: every draft kept, bonus pending
        [d[1][0], x[1]],        # rejected at 1: keep 1, recovered pending
        d[2][:2],               # commits exactly the drafts: the last one must stay pending
        [x[2]],                 # no drafts: plain step
        [x[3]],                 # rejected at 0: drop everything fed as draft
        [d[5][0], d[5][1], x[4]],  # rejected at 2
        [x[5], x[6], x[7]],     # several tokens and no drafts: all pending
    ]
    seq.commit(new)
    assert seq.runner.lengths.tolist() == [plen[0] + 3, plen[1] + 1, plen[2] + 1, plen[3], plen[4], plen[5] + 2,
                                           plen[6]]
    assert seq.pending == [[x[0]], [x[1]], [d[2][1]], [x[2]], [x[3]], [x[4]], [x[5], x[6], x[7]]]
    hist = [h + n for h, n in zip(hist, new)]
    assert_cache_sane(seq.runner, [len(h) - len(p) for h, p in zip(hist, seq.pending)])
    # The next feed continues every row from its committed history.
    feed_and_check(model, seq, hist, [random_tokens(rng, 2) for _ in hist])


def test_commit_over_drafts_fed_in_two_steps(model):
    rng = random.Random(6)
    prompts = [random_tokens(rng, 3), random_tokens(rng, 5)]
    seq = CacheRows(DynamicRunner(model))
    seq.add_rows(prompts)
    a, b = random_tokens(rng, 2), random_tokens(rng, 3)
    feed_and_check(model, seq, prompts, [a[:1], b[:1]])
    # Second feed: nothing pending, more drafts; the logits continue after the first drafts.
    logits = seq.feed(torch.tensor([[a[1], 0], b[1:]]), torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert_rows_match(model, logits, [prompts[0] + a, prompts[1] + b], [1, 2])
    y = [t for t in random_tokens(rng, 10) if t not in a + b]
    seq.commit([a + [y[0]], [b[0], y[1]]])  # row 0 keeps both, row 1 keeps b[0] of three
    assert seq.runner.lengths.tolist() == [3 + 2, 5 + 1]
    assert seq.pending == [[y[0]], [y[1]]]
    hist = [prompts[0] + a + [y[0]], prompts[1] + [b[0], y[1]]]
    feed_and_check(model, seq, hist, [[], random_tokens(rng, 1)])


def test_random_engine_loop_keeps_every_row_exact(model):
    """Steps of draft / verify / commit with rows finishing and joining at random."""
    rng = random.Random(7)
    seq = CacheRows(DynamicRunner(model))
    hist = [random_tokens(rng, rng.randint(1, 6)) for _ in range(3)]
    seq.add_rows(hist)
    for step in range(10):
        drafts = [random_tokens(rng, rng.randint(0, 3)) for _ in hist]
        feed_and_check(model, seq, hist, drafts)
        new = []
        for d in drafts:
            j = rng.randint(0, len(d))
            if rng.random() < 0.25:  # several committed tokens unrelated to the drafts
                new.append(random_tokens(rng, rng.randint(1, 3)))
            else:  # accepted prefix + recovered / bonus
                new.append(d[:j] + random_tokens(rng, 1))
        seq.commit(new)
        hist = [h + n for h, n in zip(hist, new)]
        assert all(seq.pending)
        assert_cache_sane(seq.runner, [len(h) - len(p) for h, p in zip(hist, seq.pending)])
        if step % 2 == 1 and len(hist) > 1:  # a row finishes, the rest are shuffled
            rows = rng.sample(range(len(hist)), len(hist) - 1)
            seq.select(rows)
            hist = [hist[i] for i in rows]
        prompts = [random_tokens(rng, rng.randint(1, 7)) for _ in range(rng.randint(0, 2))]
        seq.add_rows(prompts)
        hist += prompts
    feed_and_check(model, seq, hist, [[] for _ in hist])


def test_edge_cases_empty_rows_and_empty_batches(model):
    # Every row rolled back to nothing: the cache keeps zero columns and still works.
    runner = DynamicRunner(model)
    runner.add_rows(2)
    runner.forward(*right_aligned([[5, 6, 7], [8, 9]]), torch.ones(2, dtype=torch.int64))
    runner.rollback(torch.tensor([0, 0]))
    assert_cache_sane(runner, [0, 0], packed=True)
    assert runner.valid.shape == (2, 0)
    logits = runner.forward(*right_aligned([[3, 4], [5]]), torch.tensor([2, 1]))
    assert_rows_match(model, logits, [[3, 4], [5]], [2, 1])
    # Every row finished, then new ones arrive.
    seq = CacheRows(DynamicRunner(model))
    seq.add_rows([[5, 6, 7], [9]])
    feed_and_check(model, seq, [[5, 6, 7], [9]], [[], []])
    seq.commit([[4], [4]])
    seq.select([])
    assert seq.pending == [] and seq.runner.num_rows == 0
    seq.add_rows([[1, 2, 3, 4], [7]])
    feed_and_check(model, seq, [[1, 2, 3, 4], [7]], [[3], []])
    # Only 1-token prompts joining a batch that already has a cache.
    seq = CacheRows(DynamicRunner(model))
    seq.add_rows([[5, 6, 7]])
    feed_and_check(model, seq, [[5, 6, 7]], [[8]])
    seq.commit([[8, 9]])
    seq.add_rows([[3], [4]])
    assert seq.pending == [[9], [3], [4]]
    feed_and_check(model, seq, [[5, 6, 7, 8, 9], [3], [4]], [[1], [], [2, 2]])
