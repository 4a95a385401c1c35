"""Proposal encoding, byte accounting and the top-m drafter, without Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import VOCAB, tiny_model
from raysd.actors.coordinator import ActorResources, CoordinatorConfig
from raysd.actors.model_actors import DrafterSpec, MicroBatchStateLost, MicroBatchUpdate, _MicroBatchStore
from raysd.actors.transport import decode_proposal, dense_probs_nbytes, encode_proposal, pickled_nbytes
from raysd.core.sampling import SamplingParams, SamplingTensors
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, Proposal
from raysd.engine.rows import Request
from raysd.engine.step import DraftSide, RowLimits


def _proposal(B=4, K=3, V=50, support=None, seed=0) -> Proposal:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K, V, generator=g)
    if support is not None:  # keep `support` entries per position
        drop = logits.argsort(dim=-1)[..., : V - support]
        logits.scatter_(-1, drop, float("-inf"))
    probs = logits.softmax(dim=-1)  # [B, K, V]
    ids = probs.argmax(dim=-1)  # [B, K]
    num = torch.randint(0, K + 1, (B,), generator=g)
    return Proposal(ids, num, probs)


def _assert_same_drafted(a: Proposal, b: Proposal) -> None:
    assert torch.equal(a.draft_token_ids, b.draft_token_ids) and torch.equal(a.num_draft_tokens, b.num_draft_tokens)
    drafted = torch.arange(a.draft_probs.shape[1])[None, :] < a.num_draft_tokens[:, None]  # [B, K]
    assert torch.equal(a.draft_probs[drafted], b.draft_probs[drafted])  # bit for bit
    assert (b.draft_probs[~drafted] == 0).all()


@pytest.mark.parametrize("support", [1, 5, None])
@pytest.mark.parametrize("encoding", ["auto", "dense", "sparse"])
def test_roundtrip_is_lossless(support, encoding):
    p = _proposal(support=support)
    wire = encode_proposal(p, encoding)
    _assert_same_drafted(p, decode_proposal(wire))
    if encoding == "auto":
        assert wire.encoding == ("dense" if support is None else "sparse")


def test_sparse_is_smaller_for_exactly_sparse_drafts():
    B, K, V = 32, 5, 128_000
    ids = torch.randint(0, V, (B, K))
    one_hot = torch.zeros(B, K, V).scatter_(-1, ids[..., None], 1.0)
    p = Proposal(ids, torch.full((B,), K), one_hot)
    sparse = pickled_nbytes(encode_proposal(p))
    dense = pickled_nbytes(encode_proposal(p, "dense"))
    assert dense >= dense_probs_nbytes(B, K, V) > 80e6
    assert sparse < 4_000 and sparse * 10_000 < dense


def test_empty_proposal_roundtrips():
    p = Proposal.empty(3, VOCAB, "cpu")
    q = decode_proposal(encode_proposal(p))
    assert q.draft_probs.shape == (3, 0, VOCAB) and q.num_draft_tokens.tolist() == [0, 0, 0]


def test_ngram_proposal_travels_sparse():
    d = NgramDrafter(VOCAB)
    d.add_rows([[5, 6, 7, 5, 6], [9]])
    p = d.propose([3, 3], SamplingTensors.from_params([SamplingParams()] * 2), torch.rand(2, 3))
    wire = encode_proposal(p)
    assert wire.encoding == "sparse" and wire.index.shape[-1] == 1
    _assert_same_drafted(p, decode_proposal(wire))


def test_top_m_drafter_samples_from_its_reported_top_m():
    model = tiny_model("llama", 1)
    m, B, K = 3, 6, 4
    prompts = [[5, 9, 11], [7], [20, 21], [30, 31, 32, 33], [40], [50, 51]]
    params = [SamplingParams(temperature=t, seed=b) for b, t in enumerate([1.0, 0.0, 0.7, 1.0, 2.0, 0.0])]
    sampling = SamplingTensors.from_params(params)
    u = torch.rand(B, K, generator=torch.Generator().manual_seed(0))
    top = DraftModelDrafter(model, VOCAB, draft_top_m=m)
    full = DraftModelDrafter(model, VOCAB)
    for d in (top, full):
        d.add_rows(prompts)
    pt, pf = top.propose([K] * B, sampling, u), full.propose([K] * B, sampling, u)
    nnz = (pt.draft_probs > 0).sum(dim=-1)  # [B, K]
    assert (nnz <= m).all() and (nnz >= 1).all()
    drawn = pt.draft_probs.gather(-1, pt.draft_token_ids[..., None])[..., 0]
    assert (drawn > 0).all()  # every draft comes from the distribution it reports
    assert pt.draft_probs.sum(-1).sub(1).abs().max() < 1e-5
    greedy = sampling.temperature == 0
    assert torch.equal(pt.draft_token_ids[greedy], pf.draft_token_ids[greedy])
    assert encode_proposal(pt).encoding == "sparse"


def test_store_applies_updates_and_detects_lost_state():
    """A micro-batch's draft side: started fresh by `limits`, then each update forwards the
    target's decision (tokens kept, rows kept) before new rows join; unknown state is an error."""
    store = _MicroBatchStore(lambda limits: DraftSide(NgramDrafter(VOCAB), limits, "cpu"))
    with pytest.raises(MicroBatchStateLost):
        store.apply(0, MicroBatchUpdate())
    p = SamplingParams(max_new_tokens=8)
    limits = RowLimits(num_speculative_tokens=1, max_model_len=64)
    side = store.apply(0, MicroBatchUpdate(limits, new_rows=((0, Request(0, (1, 2), p)), (1, Request(1, (3,), p)))))
    side.propose(1)
    side = store.apply(0, MicroBatchUpdate(kept=((4,), (5, 6)), accepted=(0, 1), keep=(1,),
                                           new_rows=((2, Request(2, (7, 8), p)),)))
    assert side.drafter.history == [[3, 5, 6], [7, 8]]
    assert side.batch.ids == [1, 2] and side.batch.generated.tolist() == [2, 0]
    with pytest.raises(ValueError):
        MicroBatchUpdate(limits, keep=(0,))
    with pytest.raises(ValueError):
        MicroBatchUpdate(kept=((4,),), accepted=())


def test_config_validation():
    with pytest.raises(ValueError):
        ActorResources(num_cpus=0, num_gpus=0)
    with pytest.raises(ValueError):
        CoordinatorConfig(placement_strategy="ANYWHERE")
    with pytest.raises(ValueError):
        CoordinatorConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError):
        DrafterSpec(draft_top_m=4)  # top-m needs a draft model
    with pytest.raises(ValueError):
        DrafterSpec(probs_encoding="bf16")
    assert ActorResources(1, 0.5).bundle() == {"CPU": 1, "GPU": 0.5}
    assert ActorResources(1, 0).bundle() == {"CPU": 1}


def test_pickled_nbytes_counts_out_of_band_buffers():
    a = np.zeros((1000,), dtype=np.float32)
    assert 4000 <= pickled_nbytes(a) < 4300
