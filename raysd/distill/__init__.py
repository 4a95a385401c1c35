"""Distillation of small draft models (`raysd distill`): see docs/distill.md."""

from raysd.distill.api import DistillConfig, DistillResult, distill
from raysd.models.layer_draft import build_draft, is_draft_dir, load_draft, save_draft
from raysd.distill.train import TrainConfig

__all__ = ["DistillConfig", "DistillResult", "TrainConfig", "build_draft", "distill", "is_draft_dir", "load_draft", "save_draft"]
