"""raysd.models.compat: the KV-cache keyword is the one each module's own forward names, so a
forward on any supported transformers version neither fails nor warns of a deprecation."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import DynamicCache

from raysd.models.compat import cache_keyword
from raysd.models.features import EagleCausalLM
from tests.conftest import tiny_eagle, tiny_model


def test_cache_keyword_is_named_by_the_forward():
    model = tiny_model()
    layer = model.model.layers[0]
    for module in (model, layer):
        assert cache_keyword(module) in inspect.signature(module.forward).parameters
    assert cache_keyword(EagleCausalLM(tiny_eagle())) == "past_key_values"  # raysd's own adapter


def test_a_cached_forward_with_it_does_not_warn():
    model = tiny_model()
    ids = torch.tensor([[1, 2, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated keyword warns (FutureWarning) on newer transformers
        out = model(input_ids=ids, **{cache_keyword(model): DynamicCache()}, use_cache=True)
    assert out.logits.shape[:2] == (1, 3)
