"""The EAGLE feature draft (raysd.models.eagle_draft): shapes, the FR-Spec head, incremental decoding
with a cache equal to a full forward, padded rows, save/load, and loading without raysd.distill."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from raysd.models.eagle_draft import WEIGHTS_FILE, EagleDraft, crop_cache, load_eagle, read_eagle_config, save_eagle
from raysd.models.loading import DEFAULT_EAGLE, DRAFT_KINDS, draft_kind, load_eagle_draft, load_model, load_tokenizer, ModelSpec
from tests.conftest import tiny_model

H, V = 64, 96


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=3, layers=3)


@pytest.fixture(scope="module")
def draft(target):
    d = EagleDraft.from_target(target, head_ids=torch.arange(0, 48), seed=1)
    with torch.no_grad():  # move away from the initialisation so that every tensor matters
        for p in d.own_parameters():
            p.add_(0.01 * torch.randn_like(p))
    return d


def _inputs(B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=g), torch.randint(3, V, (B, T), generator=g)


def test_shapes_and_restricted_head(draft):
    f, x = _inputs()
    logits, hidden = draft(f, x)
    assert logits.shape == (2, 9, V) and hidden.shape == (2, 9, H) and logits.dtype == torch.float32
    assert torch.isinf(logits[..., 48:]).all() and torch.isfinite(logits[..., :48]).all()
    assert draft.vocab_size == V and torch.equal(draft.head_token_ids, torch.arange(48))
    torch.testing.assert_close(draft.head_logits(hidden), logits[..., :48])


def test_target_tensors_are_frozen_copies(target, draft):
    assert not any(p.requires_grad for p in (*draft.embed_tokens.parameters(), *draft.norm.parameters()))
    assert all(p.requires_grad for p in draft.own_parameters())
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not any(k.startswith(("embed_tokens", "norm", "head")) for k in draft.own_state_dict())


def test_incremental_decoding_with_a_cache_equals_a_full_forward(draft):
    f, x = _inputs(T=11)
    full_logits, full_hidden = draft(f, x)
    cache = DynamicCache()
    parts = []
    for a, b in [(0, 4), (4, 5), (5, 6), (6, 11)]:
        logits, hidden = draft(f[:, a:b], x[:, a:b], past_key_values=cache)
        parts.append((logits, hidden))
    assert cache.get_seq_length() == 11
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), full_hidden, atol=1e-5, rtol=1e-5)
    got = torch.cat([p[0] for p in parts], 1)
    torch.testing.assert_close(got[..., :48], full_logits[..., :48], atol=1e-5, rtol=1e-5)


def test_drafting_on_own_features_after_a_crop(draft):
    """A drafter's loop: prefill real features, draft 3 steps on its own hidden states, crop back to the
    accepted prefix, feed the accepted positions' real features: the cache then equals a fresh prefill."""
    f, x = _inputs(B=1, T=12)
    cache = DynamicCache()
    _, h = draft(f[:, :6], x[:, :6], past_key_values=cache)
    feat = h[:, -1:]
    for j in range(3):
        _, feat = draft(feat, x[:, 6 + j:7 + j], past_key_values=cache)
    crop_cache(cache, 6)
    logits, hidden = draft(f[:, 6:9], x[:, 6:9], past_key_values=cache)
    ref_logits, ref_hidden = draft(f[:, :9], x[:, :9])
    torch.testing.assert_close(hidden, ref_hidden[:, 6:], atol=1e-5, rtol=1e-5)


def test_left_padded_rows_with_a_mask_equal_rows_alone(draft):
    """Rows of different lengths, left-padded, with a 0/1 mask and their own positions: each row's
    outputs equal that row run alone, in a prefill and in the following decode step."""
    f, x = _inputs(B=2, T=8, seed=3)
    lens = [8, 5]
    pf, px = f.clone(), x.clone()
    pf[1, :3], px[1, :3] = 0.0, 0
    pf[1, 3:], px[1, 3:] = f[1, :5], x[1, :5]
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    pos = torch.tensor([list(range(8)), [0, 0, 0] + list(range(5))])
    cache = DynamicCache()
    logits, hidden = draft(pf, px, position_ids=pos, past_key_values=cache, attention_mask=mask)
    nf, nx = _inputs(B=2, T=1, seed=4)
    step_logits, step_hidden = draft(nf, nx, position_ids=torch.tensor([[8], [5]]), past_key_values=cache,
                                     attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], 1))
    for r, n in enumerate(lens):
        c = DynamicCache()
        _, h_alone = draft(f[r:r + 1, :n], x[r:r + 1, :n], past_key_values=c)
        torch.testing.assert_close(hidden[r, 8 - n:], h_alone[0], atol=1e-5, rtol=1e-5)
        _, s_alone = draft(nf[r:r + 1], nx[r:r + 1], past_key_values=c)
        torch.testing.assert_close(step_hidden[r], s_alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, target, draft, dtype):
    save_eagle(draft, tmp_path, "some/target", type(target).__name__, dtype=dtype, training={"steps": 1})
    cfg = read_eagle_config(tmp_path)
    assert cfg.target == "some/target" and cfg.head_vocab == 48 and cfg.training == {"steps": 1}
    from safetensors import safe_open

    with safe_open(str(tmp_path / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
    assert not any(k.startswith(("embed_tokens", "norm.", "head")) for k in keys)  # the target's tensors are not saved
    loaded = load_eagle(tmp_path, target)
    f_, x_ = _inputs()
    a, b = loaded(f_, x_)[1], draft(f_, x_)[1]
    if dtype == "float32":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    assert torch.equal(loaded.head_token_ids, draft.head_token_ids)


def test_full_head_draft(target):
    d = EagleDraft.from_target(target, head_ids=None, init_layer=None)
    logits, _ = d(*_inputs())
    assert torch.isfinite(logits).all() and d.head_token_ids is None


def test_draft_kind_and_load_by_name(tmp_path, target, draft):
    assert "eagle" in DRAFT_KINDS and draft_kind(DEFAULT_EAGLE) == "eagle"
    target.save_pretrained(tmp_path / "target")
    save_eagle(draft, tmp_path / "eagle", str(tmp_path / "target"), type(target).__name__, dtype="float32")
    assert draft_kind(str(tmp_path / "eagle")) == "eagle"
    loaded = load_eagle_draft(str(tmp_path / "eagle"))  # loads the target named in the config
    f, x = _inputs()
    assert torch.equal(loaded(f, x)[1], draft(f, x)[1])
    with pytest.raises(ValueError, match="EAGLE"):
        load_model(ModelSpec(str(tmp_path / "eagle")))
    assert load_tokenizer(str(tmp_path / "eagle")) is None  # the tiny target has none


def test_loading_an_eagle_draft_imports_no_distillation_code(tmp_path, target, draft):
    target.save_pretrained(tmp_path / "target")
    save_eagle(draft, tmp_path / "eagle", str(tmp_path / "target"), type(target).__name__, dtype="float32")
    code = ("import sys; from raysd.models.loading import load_eagle_draft; "
            f"d = load_eagle_draft({str(tmp_path / 'eagle')!r}); "
            "bad = sorted(m for m in sys.modules if m.startswith('raysd.distill')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
