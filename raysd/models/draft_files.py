"""What a raysd draft's directory says about itself, read without torch.

A distilled draft (raysd.models.layer_draft) keeps `raysd_draft.json` beside its weights, an EAGLE
draft (raysd.models.eagle_draft) `raysd_eagle.json`. The job's driver reads them to check a job and to
find the target a draft belongs to; it loads no model, so it imports no torch (seconds of a job's start).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from raysd.models.names import DRAFT_CONFIG_FILE, EAGLE_CONFIG_FILE

DRAFT_FORMAT = "raysd-distilled-draft/1"
EAGLE_FORMAT = "raysd-eagle-draft/1"


@dataclass
class DraftFileConfig:
    """What `raysd_draft.json` holds."""

    target: str  # the target's name as load_model takes it
    num_layers: int
    init_layers: list[int]
    architecture: str  # the target's model class name
    head_vocab: int | None = None  # scored tokens of an FR-Spec head; None: the full vocabulary
    dtype: str = "bfloat16"  # dtype of the saved tensors
    format: str = DRAFT_FORMAT
    training: dict = field(default_factory=dict)  # how it was trained: data, loss, steps, results


@dataclass
class EagleFileConfig:
    """What `raysd_eagle.json` holds."""

    target: str  # the target's name as load_model takes it
    architecture: str  # the target's model class name
    hidden_size: int
    layer_config: dict  # the decoder layer's LlamaConfig (to_dict)
    head_vocab: int | None = None  # FR-Spec head size; None: the full vocabulary
    feature: str = "last_layer_pre_norm"  # what the features are: the target's last layer output, before its final norm
    dtype: str = "bfloat16"
    format: str = EAGLE_FORMAT
    training: dict = field(default_factory=dict)


def is_draft_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / DRAFT_CONFIG_FILE).is_file()


def is_eagle_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / EAGLE_CONFIG_FILE).is_file()


def read_draft_config(path: str | Path) -> DraftFileConfig:
    data = json.loads((Path(path).expanduser() / DRAFT_CONFIG_FILE).read_text())
    if data.get("format") != DRAFT_FORMAT:
        raise ValueError(f"{path}: not a raysd distilled draft (format {data.get('format')!r})")
    return DraftFileConfig(**data)


def read_eagle_config(path: str | Path) -> EagleFileConfig:
    data = json.loads((Path(path).expanduser() / EAGLE_CONFIG_FILE).read_text())
    if data.get("format") != EAGLE_FORMAT:
        raise ValueError(f"{path}: not a raysd EAGLE draft (format {data.get('format')!r})")
    return EagleFileConfig(**data)
