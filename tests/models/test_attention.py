"""packed_gqa_attention: grouped-query attention folded into the query length gives the same
outputs as transformers' sdpa (keys/values repeated per group), for the masks the static runner
passes; and switching a model to it is undone afterwards."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from raysd.models.attention import PACKED_SDPA, packed_gqa, packed_gqa_attention
from raysd.models.static_runner import StaticRunner
from tests.conftest import tiny_model


class _Heads(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("groups,T,additive", [(3, 4, False), (2, 7, True), (4, 1, False), (1, 5, False)])
def test_packed_attention_equals_sdpa_with_repeated_keys_and_values(groups, T, additive):
    g = torch.Generator().manual_seed(groups * 10 + T)
    B, Hkv, W, D = 3, 2, 19, 8
    query = torch.randn(B, Hkv * groups, T, D, generator=g)  # (B, H, T, D)
    key, value = torch.randn(B, Hkv, W, D, generator=g), torch.randn(B, Hkv, W, D, generator=g)  # (B, Hkv, W, D)
    allowed = torch.rand(B, 1, T, W, generator=g) < 0.7  # (B, 1, T, W), a ragged mask like a tree's
    allowed[..., 0] = True  # no empty attention row
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min) if additive else allowed
    module = _Heads(groups)
    ours, _ = packed_gqa_attention(module, query, key, value, mask, scaling=D ** -0.5)
    ref, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=D ** -0.5)
    assert ours.shape == ref.shape == (B, T, Hkv * groups, D)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_switch_applies_inside_and_restores_the_config_even_on_error():
    model = tiny_model("llama")  # 4 query heads over 2 key/value heads
    assert model.config._attn_implementation == "sdpa"
    with packed_gqa(model):
        assert model.config._attn_implementation == PACKED_SDPA
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), packed_gqa(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    with packed_gqa(eager):
        assert eager.config._attn_implementation == "eager"  # only sdpa is switched


def test_static_runner_verify_chunk_logits_unchanged_by_packing():
    """A K + 1 chunk after a prompt, through StaticRunner, against the model's own forward."""
    model = tiny_model("llama", seed=3)
    g = torch.Generator().manual_seed(0)
    prompt, chunk = torch.randint(3, 96, (2, 9), generator=g), torch.randint(3, 96, (2, 5), generator=g)
    runner = StaticRunner(model)
    runner.add_rows(2)
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(2, dtype=torch.int64), max_logits=1)  # the prompts
    got = runner.forward(chunk, torch.ones_like(chunk, dtype=torch.bool), torch.full((2,), 5), max_logits=5)  # (B, 5, V)
    with torch.no_grad():
        want = model(torch.cat([prompt, chunk], dim=1)).logits[:, -5:].float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == "sdpa"


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("compiling", [False, True])
def test_no_step_repeats_the_keys_and_values_per_query_head(T, compiling, monkeypatch):
    """A decode step (T = 1) and a verify step (T = 5) through StaticRunner never materialise the
    attended keys or values repeated per query head ([B, H, W, D]): transformers' sdpa does, with a
    mask, for every chunk in 5.17 and under torch.compile (`compiling`) in 5.25. Those copies are
    bandwidth that grows with the batch on a GPU."""
    import transformers.integrations.sdpa_attention as sdpa

    # 5.25 asks is_torchdynamo_compiling; 5.17 has no such name (it repeats them either way)
    monkeypatch.setattr(sdpa, "is_torchdynamo_compiling", lambda: compiling, raising=False)
    model = tiny_model("llama", seed=3)  # 4 query heads over 2 key/value heads
    H, D = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    runner = StaticRunner(model, linear_kernels="stock")
    runner.add_rows(2)
    prompt = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(2, dtype=torch.int64), max_logits=1)
    chunk = torch.randint(3, 96, (2, T), generator=torch.Generator().manual_seed(1))
    with _Shapes() as seen:
        runner.forward(chunk, torch.ones_like(chunk, dtype=torch.bool), torch.full((2,), T), max_logits=T)
    W = runner._attended(runner._bound)
    assert (2, H, W, D) not in seen.shapes and (2, H // 2, 2, W, D) not in seen.shapes
