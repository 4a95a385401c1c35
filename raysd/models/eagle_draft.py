"""The "eagle" draft kind: an EAGLE-style feature draft (Li et al. 2024, EAGLE; EAGLE-3's training-time test).

The draft reads the target's own last-layer hidden state (before the final norm) instead of tokens
alone. At sequence position t its input is

    x_t = fc([embed_norm(E[x_{t+1}]), feature_norm(f_t)])        (2H -> H)

where f_t is the target's pre-norm hidden state at t (which the target used to predict x_{t+1}) and
E is the target's frozen input embedding. One Llama decoder layer (transformers' LlamaDecoderLayer,
rotary embeddings as transformers computes them, position id t) maps x_t to the draft's own hidden
state h_t; the target's frozen final norm and output head (or an FR-Spec restriction of it) turn h_t
into logits for x_{t+2}.

Drafting K tokens after the target verified a prefix ending at position n:
  step 1: features f_n (from the target) and token x_{n+1} at position n -> logits for x_{n+2}, hidden h_n;
  step j: features h_{n+j-2} (the draft's OWN previous hidden state) and the token it drafted, position
          n+j-1 -> the next logits and hidden state (EAGLE's autoregression at the feature level).
The draft keeps a KV cache (a transformers Cache, e.g. DynamicCache); after verification the drafter
crops it to the accepted prefix and feeds the newly accepted positions with the target's real features
in one call (T > 1 rows), then drafts again.

Exactness: `draft_probs` is the engine's softmax of these logits under the row's sampling parameters, so
the rejection test keeps outputs distributed as the target's. With an FR-Spec head the logits of the
tokens outside the head are -inf (draft probability 0); those tokens still come out of the residual.

Files: `raysd_eagle.json` (target name, layer config, head size, training record) and
`eagle.safetensors` (the draft's own tensors: fc, the two input norms, the decoder layer; plus
`raysd.head_token_ids`). The target's embedding, final norm and head are not saved: they are taken
from the target when the draft loads. This module imports nothing from raysd.distill.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from raysd.models.compat import cache_keyword
from raysd.models.draft_files import EAGLE_FORMAT, EagleFileConfig, is_eagle_dir, read_eagle_config  # noqa: F401 - re-exported
from raysd.models.layer_draft import TORCH_DTYPES, RestrictedHead
from raysd.models.names import EAGLE_CONFIG_FILE

CONFIG_FILE = EAGLE_CONFIG_FILE
WEIGHTS_FILE = "eagle.safetensors"
FORMAT = EAGLE_FORMAT
_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias",
               "rope_parameters", "rope_theta", "rope_scaling", "attention_dropout")


def layer_config(target_config):
    """A LlamaConfig for the draft's decoder layer, derived from the target's (any Llama-family config)."""
    from transformers import LlamaConfig

    kw = {}
    for key in _LAYER_KEYS:
        value = getattr(target_config, key, None)
        if value is not None:
            kw[key] = copy.deepcopy(value)
    kw.setdefault("num_key_value_heads", kw.get("num_attention_heads"))
    if kw.get("head_dim") is None:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    cfg = LlamaConfig(num_hidden_layers=1, vocab_size=int(getattr(target_config, "vocab_size", 1) or 1), **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def _rms_norm(hidden_size: int, eps: float) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(hidden_size, eps=eps)


def final_norm(target) -> nn.Module:
    """The target's final norm (Llama family: model.norm), whose input is the last layer's output:
    the features an EAGLE draft reads."""
    base = target.base_model
    for name in ("norm", "final_layernorm", "ln_f"):
        if isinstance(getattr(base, name, None), nn.Module):
            return getattr(base, name)
    raise TypeError(f"{type(target).__name__}: no final norm found (a feature draft needs a Llama-family target)")


class EagleDraft(nn.Module):
    """The feature draft. Own (trained, saved) modules: `fc`, `embed_norm`, `feature_norm`, `layer`.
    From the target (frozen, not saved): `embed_tokens`, `norm`, `head`."""

    def __init__(self, config, embed_tokens: nn.Embedding, norm: nn.Module, head: nn.Module):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = config
        H = config.hidden_size
        self.embed_tokens, self.norm, self.head = embed_tokens, norm, head
        for p in (*embed_tokens.parameters(), *norm.parameters(), *head.parameters()):
            p.requires_grad_(False)
        self.embed_norm = _rms_norm(H, config.rms_norm_eps)
        self.feature_norm = _rms_norm(H, config.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_target(cls, target, head_ids: Sequence[int] | torch.Tensor | None = None, init_layer: int | None = None,
                    seed: int = 0) -> "EagleDraft":
        """A new draft for `target`: its embedding, final norm and head (copies, frozen), an FR-Spec head
        over `head_ids` if given, the decoder layer initialised from target layer `init_layer` (None: random),
        and `fc` initialised to pass the feature half through (and a small random embedding half)."""
        cfg = layer_config(target.config)
        # built on the CPU whatever the target's device: training moves the draft where it trains
        tied = target.get_output_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
        tw = target.get_input_embeddings().weight.detach().to("cpu", torch.float32)
        embed = nn.Embedding(tw.shape[0], tw.shape[1])
        embed.weight = nn.Parameter(tw.clone(), requires_grad=False)
        norm = copy.deepcopy(final_norm(target)).to("cpu", torch.float32)
        hw = target.get_output_embeddings().weight.detach().to("cpu", torch.float32)
        head_weight = embed.weight if tied else nn.Parameter(hw.clone(), requires_grad=False)
        if head_ids is not None:
            head = RestrictedHead(head_weight, torch.as_tensor(head_ids))
        else:
            head = nn.Linear(hw.shape[1], hw.shape[0], bias=False)
            head.weight = head_weight
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            draft = cls(cfg, embed, norm, head)
            H = cfg.hidden_size
            with torch.no_grad():
                nn.init.normal_(draft.fc.weight, std=0.02)
                draft.fc.weight[:, H:] += torch.eye(H)
                for m in draft.layer.modules():
                    if isinstance(m, nn.Linear):
                        nn.init.normal_(m.weight, std=cfg.initializer_range)
                if init_layer is not None:
                    layers = target.base_model.layers
                    src = layers[init_layer].state_dict()
                    draft.layer.load_state_dict({k: v.detach().to("cpu", torch.float32) for k, v in src.items()}, strict=False)
        return draft.float().eval()

    # ------------------------------------------------------------------ the API a drafter calls

    @property
    def vocab_size(self) -> int:
        return self.head.out_features if isinstance(self.head, RestrictedHead) else self.head.weight.shape[0]

    @property
    def head_token_ids(self) -> torch.Tensor | None:
        """The FR-Spec head's scored tokens (sorted), or None for a full head."""
        return self.head.token_ids if isinstance(self.head, RestrictedHead) else None

    def forward(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                past_key_values=None, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over T new positions per row.

        Args:
            features: [B, T, H] the feature at each position: the target's last-layer pre-norm hidden state
                there (accepted positions), or the draft's own hidden state from its previous step.
            token_ids: [B, T] the token that follows each position (x_{t+1} at position t).
            position_ids: [B, T] positions t (default: cache length + 0..T-1).
            past_key_values: a transformers Cache (e.g. DynamicCache) holding the earlier positions; updated
                in place with these T positions. None: no cache (a full forward).
            attention_mask: None (every cached and new position is real), a [B, P + T] 0/1 mask of real
                cache slots (P = cached length; e.g. for left-padded rows), or a ready boolean
                [B, 1, T, P + T] mask (True = attend). Causality is added to the first two.
        Returns:
            (logits [B, T, V] float32 for x_{t+2}: -inf outside an FR-Spec head;
             hidden [B, T, H]: the draft's own hidden states, the features of the next draft step)
        """
        hidden = self.hidden(features, token_ids, position_ids, past_key_values, attention_mask)
        return self.head(self.norm(hidden)).float(), hidden

    def hidden(self, features, token_ids, position_ids=None, past_key_values=None, attention_mask=None) -> torch.Tensor:
        """The draft's own hidden states [B, T, H] (forward without the head)."""
        B, T = token_ids.shape
        past = int(past_key_values.get_seq_length()) if past_key_values is not None else 0
        dev = token_ids.device
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=dev).unsqueeze(0).expand(B, T)
        emb = self.embed_tokens(token_ids).to(self.fc.weight.dtype)
        x = self.fc(torch.cat([self.embed_norm(emb), self.feature_norm(features.to(self.fc.weight.dtype))], dim=-1))
        mask = self.attention_mask(attention_mask, B, T, past, dev)
        pos = self.rotary_emb(x, position_ids)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, **{cache_keyword(self.layer): past_key_values},
                         use_cache=past_key_values is not None, position_embeddings=pos)
        return out[0] if isinstance(out, tuple) else out

    @staticmethod
    def attention_mask(mask: torch.Tensor | None, B: int, T: int, past: int, device) -> torch.Tensor:
        """A boolean [B, 1, T, P + T] mask (True = attend): causal over cache slots, AND real key slots.
        A query always sees its own slot, so a padding row never attends to nothing (no NaN)."""
        if mask is not None and mask.dim() == 4:
            return mask.bool()
        q = torch.arange(past, past + T, device=device).unsqueeze(1)
        k = torch.arange(past + T, device=device).unsqueeze(0)
        causal = (k <= q).unsqueeze(0).unsqueeze(0).expand(B, 1, T, past + T)
        if mask is None:
            return causal
        keys = mask.to(device=device).bool()[:, None, None, :]
        return (causal & keys) | (k == q).unsqueeze(0).unsqueeze(0)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] draft hidden states -> logits over the head tokens only ([..., N]; [..., V] for a full head)."""
        normed = self.norm(hidden)
        if isinstance(self.head, RestrictedHead):
            return self.head.restricted(normed)
        return normed @ self.head.weight.T

    # ------------------------------------------------------------------ own tensors

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained, saved tensors: fc, the input norms and the decoder layer (not the target's)."""
        out = {}
        for prefix in ("fc", "embed_norm", "feature_norm", "layer"):
            for k, v in getattr(self, prefix).state_dict().items():
                out[f"{prefix}.{k}"] = v
        return out

    def own_parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.fc, self.embed_norm, self.feature_norm, self.layer) for p in m.parameters()]


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers DynamicCache (the accepted prefix), in place.
    (DynamicCache.crop changed meaning across transformers 5.x; the layers' tensors did not.)"""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


# ---------------------------------------------------------------------------- files


def save_eagle(draft: EagleDraft, path: str | Path, target_name: str, architecture: str, dtype: str = "bfloat16",
               training: dict | None = None) -> Path:
    """Write the draft's own tensors (safetensors) and its config (json) into directory `path`."""
    from safetensors.torch import save_file

    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", TORCH_DTYPES[dtype]).contiguous() for k, v in draft.own_state_dict().items()}
    ids = draft.head_token_ids
    if ids is not None:
        tensors["raysd.head_token_ids"] = ids.to("cpu", torch.int32).contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": FORMAT})
    cfg = EagleFileConfig(target=str(target_name), architecture=architecture, hidden_size=draft.config.hidden_size,
                          layer_config=draft.config.to_dict(), head_vocab=None if ids is None else int(ids.numel()),
                          dtype=dtype, training=dict(training or {}))
    (path / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
    return path


def load_eagle(path: str | Path, target, dtype: str = "float32", device: str = "cpu") -> EagleDraft:
    """Load a saved EAGLE draft for `target` (already loaded: its embedding, norm and head are copied)."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    cfg = read_eagle_config(path)
    if type(target).__name__ != cfg.architecture:
        raise ValueError(f"EAGLE draft {path} was trained for a {cfg.architecture}, the target is a {type(target).__name__}")
    if target.config.hidden_size != cfg.hidden_size:
        raise ValueError(f"EAGLE draft {path} has hidden size {cfg.hidden_size}, the target {target.config.hidden_size}")
    tensors = load_file(str(path / WEIGHTS_FILE))
    ids = tensors.pop("raysd.head_token_ids", None)
    draft = EagleDraft.from_target(target, head_ids=None if ids is None else ids.long(), init_layer=None)
    own = draft.own_state_dict()
    if set(own) != set(tensors):
        raise ValueError(f"EAGLE draft {path} does not fit: missing {sorted(set(own) - set(tensors))[:3]}, "
                         f"unexpected {sorted(set(tensors) - set(own))[:3]}")
    draft.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return draft.to(device=device, dtype=TORCH_DTYPES[dtype]).eval()
