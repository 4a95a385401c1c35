"""raysd.models.linear: the prepacked CPU linear kernels compute what nn.Linear computes (to float32
summation order), are switched in only inside the runners' forwards, follow weights changed in
place, and leave the engine's greedy output identical to the target's own `generate`."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.dynamic_runner import DynamicRunner
from raysd.models.linear import AUTO_MARGIN, PACKED, ROW_BUCKETS, KernelChoice, auto_choice, choose, model_linears, use_packed
from raysd.models.static_runner import StaticRunner
from tests.conftest import EOS, tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs PyTorch built with oneDNN")

WIDE_VOCAB = 8232  # a real-sized output head (tiny models' heads and up-projections are wider than tall too)


def _switched(model: nn.Module) -> list[bool]:
    return ["forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear]


@pytest.mark.parametrize("out_features", [24, 200])  # taller than wide, wider
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 32), (1, 1, 32), (2, 32), (3, 5, 32), (40, 32)])
def test_packed_forward_equals_linear(out_features, bias, shape):
    g = torch.Generator().manual_seed(out_features + len(shape))
    layer = nn.Linear(32, out_features, bias=bias)
    x = torch.randn(shape, generator=g)
    expected = F.linear(x, layer.weight, layer.bias)  # (..., N)
    with torch.inference_mode(), model_linears(layer).active():
        assert _switched(layer) == [True]
        got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert _switched(layer) == [False]


def test_a_linear_made_under_inference_mode_packs():
    """A model built inside inference_mode has weights with no version counter; packing keys them by
    storage alone and computes what nn.Linear computes."""
    with torch.inference_mode():
        layer = nn.Linear(32, 48)
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
        with model_linears(layer).active(PACKED):
            got = layer(x)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_every_row_count_pads_to_a_bucket_or_runs_stock_with_the_same_results():
    """oneDNN caches a compiled primitive per shape, and keeps it: packed products see only the
    row counts of ROW_BUCKETS, the rows zero-padded up to the next; beyond the last, F.linear."""
    g = torch.Generator().manual_seed(9)
    layer = nn.Linear(32, 48)
    seen = set()
    with torch.inference_mode(), model_linears(layer).active():
        for rows in [*range(1, 20), 47, 48, 49, ROW_BUCKETS[-1], ROW_BUCKETS[-1] + 1, 300]:
            x = torch.randn(1, rows, 32, generator=g)  # (1, rows, K): the runners' 3-D activations
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            if 2 <= rows <= ROW_BUCKETS[-1]:
                seen.add(next(b for b in ROW_BUCKETS if b >= rows))
    assert seen <= set(ROW_BUCKETS) and ROW_BUCKETS == tuple(sorted(ROW_BUCKETS))


def test_switch_is_undone_on_error_and_never_applies_with_autograd():
    model = tiny_model("llama")
    linears = model_linears(model)
    with pytest.raises(RuntimeError), torch.inference_mode(), linears.active():
        assert all(_switched(model))
        raise RuntimeError("boom")
    assert not any(_switched(model))
    with linears.active():  # grad enabled: the copies carry no gradient, so the model stays stock
        assert not any(_switched(model))
    with torch.inference_mode(), linears.active(), linears.active():  # nested: switched once, undone once
        assert all(_switched(model))
    assert not any(_switched(model))


def test_copies_are_shared_per_model_kept_out_of_its_state_and_follow_in_place_updates():
    model = tiny_model("llama", seed=2)
    keys = set(model.state_dict())
    linears = model_linears(model)
    assert model_linears(model) is linears and set(model.state_dict()) == keys
    head = model.get_output_embeddings()
    x = torch.randn(3, 4, model.config.hidden_size)
    with torch.no_grad():
        head.weight.mul_(-2.0)  # as an optimizer step would: in place
    expected = F.linear(x, head.weight)
    with torch.inference_mode(), linears.active():
        torch.testing.assert_close(head(x), expected, rtol=1e-5, atol=1e-5)


def test_a_copied_or_pickled_model_packs_its_own():
    import copy
    import pickle

    model = tiny_model("llama", seed=4)
    linears = model_linears(model)
    x = torch.randn(2, 3, model.config.hidden_size)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert model_linears(twin) is not linears
        head = twin.get_output_embeddings()
        assert set(model_linears(twin).layers) == {m for m in twin.modules() if type(m) is nn.Linear}
        with torch.inference_mode(), model_linears(twin).active():
            torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-5)


def test_auto_is_float32_on_a_cpu_where_measured_faster_and_packed_refuses_anything_else_in_one_line():
    model = tiny_model("llama")
    assert use_packed(model, "packed") == PACKED and use_packed(model, "stock") is None
    auto = use_packed(model, "auto")  # this machine's measurement, made once and kept on the model
    assert auto is None or auto in {KernelChoice(a, b) for a in (True, False) for b in (True, False)}
    assert auto_choice(model) is auto_choice(model)
    if auto is None:  # measured slower here (or read so from the cache): no copies held, made again if asked for
        held = model.__dict__.get("_raysd_linears")
        assert held is None or not held.layers
    model_linears(model).release()
    with torch.inference_mode(), model_linears(model).active():
        assert model_linears(model).layers and any(_switched(model))
    half = tiny_model("llama").to(torch.bfloat16)
    assert use_packed(half, "auto") is None
    with pytest.raises(ValueError, match="float32"):
        use_packed(half, "packed")
    with pytest.raises(ValueError, match="linear_kernels must be one of"):
        use_packed(model, "fast")


def test_auto_takes_the_packed_copy_only_where_clearly_faster():
    stock = {1: 1.0, 8: 2.0}
    assert choose(stock, {1: 0.5, 8: 1.0}) == PACKED  # the AMD EPYCs' case
    assert choose(stock, {1: 1.3, 8: 1.95}) == KernelChoice(one_row=False, few_rows=False)  # a CPU where the two tie at 8 rows
    assert choose(stock, {1: 1.3, 8: 1.0}) == KernelChoice(one_row=False, few_rows=True)
    assert choose(stock, {1: AUTO_MARGIN, 8: 2.0}) == KernelChoice(one_row=False, few_rows=False)  # the margin is strict


def test_the_choice_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    import raysd.models.linear as linear

    monkeypatch.setenv("RAYSD_CACHE_DIR", str(tmp_path))
    measured = []
    monkeypatch.setattr(linear, "measure_choice", lambda linears: measured.append(1) or KernelChoice(False, True))
    first, second = tiny_model("llama", seed=3), tiny_model("llama", seed=4)  # the same shapes
    assert auto_choice(first) == KernelChoice(False, True) and len(measured) == 1
    assert auto_choice(second) == KernelChoice(False, True) and len(measured) == 1  # read back
    assert "_raysd_linears" not in second.__dict__  # read back before any copy is packed
    [entry] = (tmp_path / "linear_kernels").iterdir()
    entry.write_text("{not json")
    assert auto_choice(tiny_model("llama", seed=5)) == KernelChoice(False, True) and len(measured) == 2
    assert json.loads(entry.read_text()) == {"one_row": False, "few_rows": True}  # measured again, written whole
    wider = tiny_model("llama", seed=3, vocab=WIDE_VOCAB)  # other shapes: measured for themselves
    auto_choice(wider)
    assert len(measured) == 3 and len(list((tmp_path / "linear_kernels").iterdir())) == 2


def test_a_choice_routes_each_row_count_to_its_kernel():
    model = tiny_model("llama", seed=2, vocab=WIDE_VOCAB)
    head = model.get_output_embeddings()
    calls = []
    linear = F.linear
    for choice in (KernelChoice(one_row=False, few_rows=True), KernelChoice(one_row=True, few_rows=False)):
        calls.clear()
        with torch.inference_mode(), model_linears(model).active(choice), \
                pytest.MonkeyPatch.context() as mp:
            mp.setattr(F, "linear", lambda *a: calls.append(a[0].shape[0]) or linear(*a))
            for rows in (1, 3):
                x = torch.randn(rows, head.in_features)
                torch.testing.assert_close(head(x), linear(x, head.weight), rtol=1e-5, atol=1e-5)
        assert calls == ([1] if not choice.one_row else [3])  # the stock product only where the choice says so
    assert not choice.packed_for(ROW_BUCKETS[-1] + 1)  # prefill: always stock


@pytest.mark.parametrize("runner_cls", [StaticRunner, DynamicRunner])
def test_runner_logits_with_packed_kernels_equal_stock(runner_cls):
    """A prompt, then K + 1 = 5 tokens, then 1 token per row, through a runner on each kernel kind."""
    model = tiny_model("llama", seed=5, vocab=WIDE_VOCAB)
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(3, WIDE_VOCAB, (2, n), generator=g) for n in (9, 5, 1)]
    logits = {}
    for kind in ("stock", "packed"):
        runner = runner_cls(model, linear_kernels=kind)
        runner.add_rows(2)
        logits[kind] = [runner.forward(c, torch.ones_like(c, dtype=torch.bool), torch.full((2,), c.shape[1]), c.shape[1])
                        for c in chunks]  # [(B, T, V)]
        assert not any(_switched(model))  # stock outside the runner's forward
    for stock, packed in zip(logits["stock"], logits["packed"]):
        torch.testing.assert_close(packed, stock, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("runner", ["static", "dynamic"])
def test_engine_greedy_on_packed_kernels_equals_target_generate(runner):
    """A wide head (one-row products) and K + 1 verify chunks (oneDNN) against the target's
    own stock `generate`, at batch 1 and 4, a draft model and the n-gram drafter."""
    target = tiny_model("llama", seed=7, vocab=WIDE_VOCAB)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, WIDE_VOCAB, (n,), generator=g).tolist() for n in (6, 11, 2, 8)]
    expected = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=EOS,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    for batch in (1, 4):
        for drafter in (DraftModelDrafter(tiny_model("llama", seed=8, layers=1, vocab=WIDE_VOCAB), WIDE_VOCAB, runner=runner),
                        NgramDrafter(WIDE_VOCAB)):
            speculation = SpeculationConfig(num_speculative_tokens=3, eos_token_ids=(EOS,))
            config = EngineConfig(speculation, max_batch_size=batch, runner=runner, linear_kernels="packed")
            engine = SpecEngine(target, drafter, config)
            results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=16)) for i, p in enumerate(prompts)])
            assert [r.token_ids for r in results] == expected
