"""The "layers" draft kind: a few decoder layers on top of the target's own embedding and
head, trained by `raysd distill` (raysd/distill/), loaded here with the other models.

The draft is the target's architecture with `num_hidden_layers` cut to a few layers
(hidden size unchanged), so the target's input embedding and output head fit it as
they are. Those two stay frozen and are never saved: a draft file holds only the
draft's own layers and final norm; the embedding and head are copied from the target
when the draft loads.

FR-Spec head (`head_token_ids`): the draft scores only its most frequent tokens and
gives every other token the logit -inf. Drafting then costs a [hidden, N] matmul
instead of [hidden, V]; the output is still exact, because a drafter's `draft_probs`
is computed from these logits, so the rejection test sees the restricted distribution.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from raysd.models.draft_files import DRAFT_FORMAT, DraftFileConfig, is_draft_dir, read_draft_config  # noqa: F401 - re-exported
from raysd.models.names import DRAFT_CONFIG_FILE, DTYPE_NAMES

CONFIG_FILE = DRAFT_CONFIG_FILE
WEIGHTS_FILE = "draft.safetensors"
FORMAT = DRAFT_FORMAT
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # a dtype name (ModelSpec.dtype) -> torch dtype


class RestrictedHead(nn.Module):
    """An output head over V tokens that scores only `token_ids` (the rest get -inf).

    `weight` is the full [V, hidden] head (so `get_output_embeddings().weight.shape[0]`
    is still V); the scored rows are kept contiguous in `sub_weight` for speed.
    """

    def __init__(self, weight: nn.Parameter, token_ids: torch.Tensor):
        super().__init__()
        self.weight = weight  # the full head, frozen (shared with the input embedding if tied)
        ids = torch.as_tensor(token_ids, dtype=torch.int64).unique(sorted=True)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]:
            raise ValueError(f"head token ids must be a nonempty subset of [0, {weight.shape[0]})")
        self.register_buffer("token_ids", ids, persistent=False)
        self.register_buffer("sub_weight", weight.detach()[ids].clone(), persistent=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def restricted(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., N] logits of the head tokens only."""
        return hidden @ self.sub_weight.to(hidden.dtype).T

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.restricted(hidden)
        out = sub.new_full((*sub.shape[:-1], self.weight.shape[0]), float("-inf"))
        return out.index_copy_(-1, self.token_ids, sub)

    def extra_repr(self) -> str:
        return f"vocab={self.weight.shape[0]}, scored={self.token_ids.numel()}"


def head_token_ids(model) -> torch.Tensor | None:
    """The draft's scored tokens (sorted), or None when its head covers the whole vocabulary."""
    head = model.get_output_embeddings()
    return head.token_ids if isinstance(head, RestrictedHead) else None


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """[..., hidden] final hidden states -> logits over the head tokens ([..., N], or [..., V] for a full head)."""
    head = model.get_output_embeddings()
    if isinstance(head, RestrictedHead):
        return head.restricted(hidden)
    return hidden @ head.weight.T


def frozen_parameter_ids(model) -> set[int]:
    """ids of the parameters that come from the target: the input embedding and the output head."""
    return {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}


def own_state_dict(model) -> dict[str, torch.Tensor]:
    """The draft's own (trained, saved) tensors: everything but the target's embedding and head."""
    frozen = frozen_parameter_ids(model)
    named = dict(model.named_parameters(remove_duplicate=False))
    skip = {name for name, p in named.items() if id(p) in frozen}
    return {k: v for k, v in model.state_dict().items() if k not in skip and not k.endswith(("sub_weight", "token_ids"))}


def draft_config(target_config, num_layers: int):
    """The target's config with `num_layers` decoder layers (and no quantization)."""
    if num_layers < 1:
        raise ValueError(f"a draft needs at least one layer, got {num_layers}")
    cfg = copy.deepcopy(target_config)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(cfg, key):
            try:
                delattr(cfg, key)
            except AttributeError:
                pass
    cfg.num_hidden_layers = num_layers
    for key in ("layer_types",):  # per-layer lists (sliding/full attention) follow the cut
        value = getattr(cfg, key, None)
        if isinstance(value, list):
            setattr(cfg, key, value[:num_layers])
    return cfg


def _layer_prefix(model) -> str:
    """The state-dict prefix of the decoder layers (`model.layers.`, `transformer.h.`, ...)."""
    names = [n for n, _ in model.named_modules() if isinstance(_, nn.ModuleList)]
    if not names:
        raise TypeError(f"{type(model).__name__} has no decoder layer list")
    return max(names, key=lambda n: len(model.get_submodule(n))) + "."


def build_draft(target, num_layers: int = 1, init_layers: Sequence[int] | None = None,
                head_ids: Sequence[int] | torch.Tensor | None = None):
    """A new draft for `target`: its architecture with `num_layers` layers, initialised from the
    target's layers `init_layers` (default the first ones), its final norm, its embedding and head
    (copied, frozen), and optionally an FR-Spec head over `head_ids`."""
    init_layers = list(range(num_layers)) if init_layers is None else [int(i) for i in init_layers]
    n_target = target.config.num_hidden_layers
    if len(init_layers) != num_layers or not all(0 <= i < n_target for i in init_layers):
        raise ValueError(f"init_layers must list {num_layers} layer indices in [0, {n_target}), got {init_layers}")
    cfg = draft_config(target.config, num_layers)
    draft = type(target)._from_config(cfg, dtype=torch.float32)
    prefix = _layer_prefix(draft)
    source = target.state_dict()
    mapped = {}
    for name in draft.state_dict():
        src = name
        if name.startswith(prefix):
            idx, rest = name[len(prefix):].split(".", 1)
            src = f"{prefix}{init_layers[int(idx)]}.{rest}"
        if src in source:
            mapped[name] = source[src].detach().float().clone()
    draft.load_state_dict(mapped, strict=False)
    _freeze_embeddings(draft)
    if head_ids is not None:
        set_head_vocab(draft, head_ids)
    return draft.eval()


def _freeze_embeddings(draft) -> None:
    for p in (draft.get_input_embeddings().weight, draft.get_output_embeddings().weight):
        p.requires_grad_(False)


def set_head_vocab(draft, head_ids) -> None:
    """Restrict the draft's output head to `head_ids` (FR-Spec); None restores the full head."""
    head = draft.get_output_embeddings()
    weight = head.weight
    if head_ids is None:
        if isinstance(head, RestrictedHead):
            full = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            full.weight = weight
            draft.set_output_embeddings(full)
        return
    if getattr(head, "bias", None) is not None:
        raise TypeError("an FR-Spec head needs an output head without bias")
    draft.set_output_embeddings(RestrictedHead(weight, torch.as_tensor(head_ids)))


def save_draft(draft, path: str | Path, target_name: str, dtype: str = "bfloat16", training: dict | None = None,
               init_layers: Sequence[int] | None = None) -> Path:
    """Write the draft's own tensors (safetensors) and its config (json) into directory `path`."""
    from safetensors.torch import save_file

    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", TORCH_DTYPES[dtype]).contiguous() for k, v in own_state_dict(draft).items()}
    ids = head_token_ids(draft)
    if ids is not None:
        tensors["raysd.head_token_ids"] = ids.to("cpu", torch.int32).contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": FORMAT})
    n = draft.config.num_hidden_layers
    cfg = DraftFileConfig(
        target=str(target_name), num_layers=n, init_layers=list(init_layers) if init_layers is not None else list(range(n)),
        architecture=type(draft).__name__, head_vocab=None if ids is None else int(ids.numel()), dtype=dtype,
        training=dict(training or {}),
    )
    (path / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return path


def load_draft(path: str | Path, target, dtype: str = "float32", device: str = "cpu"):
    """Load a distilled draft as a transformers PreTrainedModel, ready for DraftModelDrafter.

    `target`: the target model (already loaded) to take the embedding and head from
    (`raysd.models.loading.load_model` loads it from the name in the draft's config).
    """
    path = Path(path).expanduser()
    cfg = read_draft_config(path)
    if type(target).__name__ != cfg.architecture:
        raise ValueError(f"draft {path} was trained for a {cfg.architecture}, the target is a {type(target).__name__}")
    ids = _read_tensors(path).get("raysd.head_token_ids")
    draft = build_draft(target, cfg.num_layers, cfg.init_layers, head_ids=None if ids is None else ids.long())
    load_own_weights(draft, path)
    return draft.to(device=device, dtype=TORCH_DTYPES[dtype]).eval()


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / WEIGHTS_FILE))


def load_own_weights(draft, path: str | Path) -> None:
    """Load a saved draft's own tensors into `draft` (built for the same target and layer count)."""
    tensors = _read_tensors(Path(path).expanduser())
    ids = tensors.pop("raysd.head_token_ids", None)
    mine = head_token_ids(draft)
    if (ids is None) != (mine is None) or (ids is not None and not torch.equal(ids.long(), mine.cpu())):
        raise ValueError(f"draft {path}: its head vocabulary differs from the model it is loaded into")
    own = own_state_dict(draft)
    if set(own) != set(tensors):
        raise ValueError(f"draft {path} does not fit: missing {sorted(set(own) - set(tensors))[:3]}, "
                         f"unexpected {sorted(set(tensors) - set(own))[:3]}")
    dtype = next(iter(own.values())).dtype
    draft.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    refresh_head(draft)


def refresh_head(draft) -> None:
    """Recompute the FR-Spec head's cached rows (after the head weight changed)."""
    head = draft.get_output_embeddings()
    if isinstance(head, RestrictedHead):
        head.sub_weight = head.weight.detach()[head.token_ids].clone()
