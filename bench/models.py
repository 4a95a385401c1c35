"""The models and drafters the scenarios run, by the names their options take.

Drafter names (`--drafters`):
    none         NoDrafter: plain decoding through the same engine (the baseline)
    ngram        NgramDrafter: prompt lookup, no model
    suffix       SuffixDrafter: suffix decoding over the row and every row finished before it in the run
    draft        the shipped distilled draft, smollm2-135m-instruct-draft (DraftModelDrafter)
    eagle        the shipped EAGLE feature draft, smollm2-135m-instruct-eagle (FeatureDrafter)
    draft+ngram  the distilled draft with n-gram lookup drafting for it (DraftAssistDrafter, three
                 levels; its inner k chosen by goodput on the draft's profiled step costs)
    anything else: a model name or path `raysd.models.loading` loads (an EAGLE directory gives a
    FeatureDrafter, any other model a DraftModelDrafter)

A `Models` loads each model once; `drafter(name)` builds a fresh drafter over them for every run
(a drafter holds its rows' state), and `timed_draft(name)` is what `profile_step_costs` times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raysd.models.loading import (DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_MODEL, ModelSpec, draft_kind, eos_token_ids,
                                  load_eagle_draft, load_model, load_tokenizer, output_vocab_size)
from raysd.models.names import MODEL_FREE

ALIASES = {"draft": DEFAULT_DRAFT, "eagle": DEFAULT_EAGLE}
ASSISTED = "draft+ngram"
ASSIST_K = 4  # the most n-gram drafts per draft-model step under draft+ngram


@dataclass
class Models:
    """A target, its tokenizer, and the draft models loaded so far (each loaded once)."""

    target_name: str = DEFAULT_MODEL
    dtype: str = "float32"
    target: object = None
    tokenizer: object = None
    loaded: dict = field(default_factory=dict)  # draft model name -> model (an EagleDraft for an EAGLE draft)
    assist_costs: dict = field(default_factory=dict)  # batch sizes -> the middle level's StepCosts
    with_tokenizer: bool = True

    def __post_init__(self) -> None:
        if self.target is None:
            self.target = load_model(ModelSpec(self.target_name, self.dtype))
        if self.tokenizer is None and self.with_tokenizer:
            self.tokenizer = load_tokenizer(self.target_name)

    @property
    def vocab_size(self) -> int:
        return output_vocab_size(self.target)

    @property
    def eos(self) -> tuple[int, ...]:
        return eos_token_ids(self.target)

    def model_name(self, drafter: str) -> str | None:
        """The draft model a drafter name needs, or None (model-free)."""
        if drafter in MODEL_FREE:
            return None
        return DEFAULT_DRAFT if drafter == ASSISTED else ALIASES.get(drafter, drafter)

    def draft_model(self, drafter: str):
        name = self.model_name(drafter)
        if name is not None and name not in self.loaded:
            if draft_kind(name) == "eagle":  # built on this target: its embedding, norm and head
                self.loaded[name] = load_eagle_draft(name, self.target, dtype=self.dtype)
            else:
                self.loaded[name] = load_model(ModelSpec(name, self.dtype))
        return None if name is None else self.loaded[name]

    def is_eagle(self, drafter: str) -> bool:
        name = self.model_name(drafter)
        return name is not None and draft_kind(name) == "eagle"

    def timed_draft(self, drafter: str):
        """What profile_step_costs times for this drafter: its model (an EAGLE draft's forward with
        zero features), or None for a model-free drafter."""
        from raysd.models.features import EagleCausalLM

        model = self.draft_model(drafter)
        return EagleCausalLM(model, zero_features=True) if self.is_eagle(drafter) else model

    def drafter(self, drafter: str, batch_sizes: tuple[int, ...] = (1,)):
        """A fresh drafter of this name (see the module docstring)."""
        from raysd.engine.drafters import DraftModelDrafter, FeatureDrafter, NgramDrafter, NoDrafter

        V = self.vocab_size
        if drafter == "none":
            return NoDrafter(V)
        if drafter == "ngram":
            return NgramDrafter(V)
        if drafter == "suffix":
            from raysd.engine.suffix import SuffixDrafter

            return SuffixDrafter(V)  # a fresh index: each run learns from its own rows, as a job's replica does
        model = self.draft_model(drafter)
        if self.is_eagle(drafter):
            return FeatureDrafter(model, V)
        if drafter == ASSISTED:
            from raysd.core.speculation import AdaptiveConfig
            from raysd.engine.draft_assist import DraftAssistDrafter, profile_assist_costs

            key = tuple(sorted(batch_sizes))
            if key not in self.assist_costs:
                with torch.inference_mode():
                    self.assist_costs[key] = profile_assist_costs(model, ASSIST_K, key)
            return DraftAssistDrafter(model, V, assist_k=ASSIST_K, assist_adaptive=AdaptiveConfig(self.assist_costs[key]))
        return DraftModelDrafter(model, V, name=drafter)
