"""Proposal encoding, byte accounting, the top-m drafter and the actors' step protocol, without Ray."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from raysd.actors.settings import ActorResources, CoordinatorConfig
from raysd.actors.model_actors import DrafterSpec, DraftWorker, MicroBatchStateLost, StepCall, TargetWorker
from raysd.actors.proposals import decode_proposal, dense_probs_nbytes, encode_proposal
from raysd.actors.wire import pickled_nbytes
from raysd.core.sampling import SamplingParams, SamplingTensors
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter, Proposal
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Admission, Request
from tests.conftest import EOS, VOCAB, tiny_model


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


def test_ngram_proposal_travels_as_its_token_ids():
    d = NgramDrafter(VOCAB)
    d.add_rows([[5, 6, 7, 5, 6], [9]])
    p = d.propose([3, 3], SamplingTensors.from_params([SamplingParams()] * 2), torch.rand(2, 3))
    wire = encode_proposal(p)
    assert wire.encoding == "ids" and wire.index is None and wire.value is None and wire.dense is None
    assert pickled_nbytes(wire) < pickled_nbytes(encode_proposal(dataclasses.replace(p, one_hot=False), "sparse"))
    _assert_same_drafted(p, decode_proposal(wire))


def test_one_hot_proposals_travel_as_their_tokens():
    """A drafter that says its proposal is one-hot (greedy rows only, or n-gram lookup) is right,
    and the wire built from its tokens alone decodes to the tensor the general encoding gives."""
    prompts = [[5, 9, 11, 5, 9], [7], [20, 21, 20], [30, 31, 32, 33]]
    u = torch.rand(4, 3, generator=torch.Generator().manual_seed(0))
    greedy = SamplingTensors.from_params([SamplingParams()] * 4)
    mixed = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=1.0, seed=1)] * 2)
    model = DraftModelDrafter(tiny_model("llama", 1), VOCAB)
    ngram = NgramDrafter(VOCAB)
    for d in (model, ngram):
        d.add_rows(prompts)
    proposals = [model.propose([3, 3, 3, 3], greedy, u), ngram.propose([3, 3, 2, 3], greedy, u)]
    for p in proposals:
        assert p.one_hot
        drafted = torch.arange(p.draft_probs.shape[1])[None, :] < p.num_draft_tokens[:, None]  # [B, K]
        one_hot = torch.zeros_like(p.draft_probs).scatter_(-1, p.draft_token_ids[..., None], 1.0)
        assert torch.equal(p.draft_probs[drafted], one_hot[drafted])  # the claim holds
        wire = encode_proposal(p)
        assert wire.encoding == "ids"
        general = decode_proposal(encode_proposal(dataclasses.replace(p, one_hot=False)))
        assert torch.equal(decode_proposal(wire).draft_probs, general.draft_probs)
        _assert_same_drafted(p, decode_proposal(wire))
    sampled = DraftModelDrafter(tiny_model("llama", 1), VOCAB)
    sampled.add_rows(prompts)
    assert not sampled.propose([3, 3, 3, 3], mixed, u).one_hot  # a sampled row's probs are not one-hot


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


def test_the_actors_in_process_follow_the_step_protocol():
    """A DraftActor and a TargetActor called in process as the coordinator calls them: a fresh
    micro-batch, then each step's verdict forwarded to the draft with the next call; state the
    actor lacks is an error; the tokens and statistics are the engine's."""
    draft = DraftWorker(DrafterSpec(functools.partial(tiny_model, "llama", 1)), VOCAB)
    target = TargetWorker(functools.partial(tiny_model, "llama", 0))
    with pytest.raises(MicroBatchStateLost):
        draft.propose(StepCall(0))
    spec = SpeculationConfig(num_speculative_tokens=3, eos_token_ids=(EOS,))
    g = torch.Generator().manual_seed(3)
    reqs = [Request(i, torch.randint(3, VOCAB, (3 + i,), generator=g).tolist(),
                    SamplingParams(temperature=float(i % 2), seed=i, max_new_tokens=4 + 3 * i)) for i in range(4)]
    call, results, steps = StepCall(0, Admission.of(spec, VOCAB, [512]).spec, None, tuple(enumerate(reqs))), {}, 0
    while len(results) < len(reqs):
        proposed = draft.propose(call)
        verdict, timings = target.step(dataclasses.replace(call, verdict=None), proposed)
        assert timings.steps == 1 and timings.draft_s == proposed.busy_s > 0
        results.update(verdict.finished)
        call, steps = StepCall(0, verdict=dataclasses.replace(verdict, finished=())), steps + 1
    engine = SpecEngine(tiny_model("llama", 0), DraftModelDrafter(tiny_model("llama", 1), VOCAB),
                        EngineConfig(spec, max_batch_size=4))
    expected = engine.generate(reqs)
    assert [results[i].token_ids for i in range(4)] == [r.token_ids for r in expected]
    assert [results[i].stats for i in range(4)] == [r.stats for r in expected]
    assert steps == engine.timings.steps and draft.transfer_stats().steps == steps
    with pytest.raises(ValueError):
        StepCall(0, spec, verdict)  # a fresh micro-batch has no verdict to apply


def test_config_validation():
    with pytest.raises(ValueError):
        ActorResources(num_cpus=0, num_gpus=0)
    with pytest.raises(ValueError):
        CoordinatorConfig(placement_strategy="ANYWHERE")
    with pytest.raises(ValueError):
        CoordinatorConfig(SpeculationConfig(num_speculative_tokens=-1))
    with pytest.raises(ValueError):
        DrafterSpec(draft_top_m=4)  # top-m needs a draft model
    with pytest.raises(ValueError):
        DrafterSpec(probs_encoding="bf16")
    assert ActorResources(1, 0.5).bundle() == {"CPU": 1, "GPU": 0.5}
    assert ActorResources(1, 0).bundle() == {"CPU": 1}


def test_pickled_nbytes_counts_out_of_band_buffers():
    a = np.zeros((1000,), dtype=np.float32)
    assert 4000 <= pickled_nbytes(a) < 4300
