"""The target's features for a feature draft (EAGLE), and the feature draft behind a runner.

`FeatureTap` records what the target's final norm receives: the last layer's pre-norm hidden
states, EAGLE's features (Li et al. 2024, section 3), for every position of the target's latest
forward, whichever runner made it. `EagleCausalLM` puts an `EagleDraft` behind the call a runner
makes (`model(input_ids=, attention_mask=, position_ids=, past_key_values=, ...)`), with the
features of the same positions handed in beside the tokens, so the draft gets the runners'
static cache, rollback and slot selection unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from raysd.models.eagle_draft import EagleDraft, final_norm


class FeatureTap:
    """Keeps the input of `model`'s final norm at each forward since the last `take`: [B, T, H] for
    the T positions of the chunk it ran (the runners right-align each row's real tokens in the
    chunk). A verify is one forward; a prefill may be several (the static runner prefills prompts
    of similar lengths together), told apart by the runner's `prefill_calls`."""

    def __init__(self, model: nn.Module):
        self.calls: list[torch.Tensor] = []
        self._handle = final_norm(model).register_forward_pre_hook(self._record)

    @staticmethod
    def of(model: nn.Module) -> "FeatureTap":
        """The model's one tap (every verifier on the model shares it: one hook, however many
        micro-batches come and go)."""
        tap = model.__dict__.get("_raysd_feature_tap")
        if tap is None:
            tap = model.__dict__["_raysd_feature_tap"] = FeatureTap(model)
        return tap

    def _record(self, module, args) -> None:
        self.calls.append(args[0].detach())

    def take_all(self) -> list[torch.Tensor]:
        """The features of every forward since the last take, in order."""
        calls, self.calls = self.calls, []
        return calls

    def take(self) -> torch.Tensor:
        """The features of the latest forward (earlier ones since the last take are dropped)."""
        calls = self.take_all()
        assert calls, "no target forward since the last take()"
        return calls[-1]

    def remove(self) -> None:
        self._handle.remove()


class EagleCausalLM(nn.Module):
    """An EagleDraft as a causal LM for a runner. Set `features` ([B, T, H], aligned with the chunk
    the runner will pass) before each call; `hidden` then holds the draft's own hidden states,
    the features of its next draft step."""

    def __init__(self, draft: EagleDraft, zero_features: bool = False):
        """`zero_features`: a call without features reads zeros (for timing the draft's forward
        with runners that know nothing of features, e.g. raysd.models.profile.time_forward)."""
        super().__init__()
        self.draft = draft
        self.zero_features = zero_features
        self.config = draft.config
        self.features: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def get_input_embeddings(self) -> nn.Embedding:
        return self.draft.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.draft.head

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep: int = 0, **unused):
        B, T = input_ids.shape
        if self.features is None and self.zero_features:
            self.features = torch.zeros(B, T, self.config.hidden_size, device=input_ids.device)
        assert self.features is not None and self.features.shape[:2] == (B, T), "set features for the chunk first"
        d = self.draft
        self.hidden = d.hidden(self.features, input_ids, position_ids, past_key_values, attention_mask)  # [B, T, H]
        self.features = None
        # the head only where logits are kept: a catch-up over a whole prompt needs one position's, and
        # the head (FR-Spec or full) costs more than the layer
        kept = self.hidden[:, -logits_to_keep:] if logits_to_keep else self.hidden
        return SimpleNamespace(logits=d.head(d.norm(kept)).float())
