"""A tiny study, run once per session through the real CLI: tiny Llama target and draft
saved with save_pretrained (safetensors), token-id prompts in a JSONL."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from raysd.cli import main
from tests.conftest import VOCAB, tiny_model

TASKS = ("qa", "translation")
KS = (1, 2)
BATCH_SIZES = (1, 3)


def save_tiny_pair(root):
    """The target, and as draft the same model with its last layer removed (so acceptance is partial)."""
    target = tiny_model("llama", seed=0)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft"


def write_token_prompts(path, per_task: int = 3):
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for task in TASKS:
            for i in range(per_task):
                f.write(json.dumps({"task": task, "prompt_token_ids": torch.randint(3, VOCAB, (4 + i,), generator=g).tolist()}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    target, draft = save_tiny_pair(root)
    prompts = write_token_prompts(root / "prompts.jsonl")
    out = root / "study.parquet"
    rc = main(["study", "--target", str(target), "--draft", str(draft), "--draft", "ngram", "--draft", "none",
               "--prompts", str(prompts), "--prompts-per-task", "2", "--batch-sizes", ",".join(map(str, BATCH_SIZES)),
               "--ks", ",".join(map(str, KS)), "--max-new-tokens", "8", "--temperature", "1.0",
               "--profile-context", "8", "--profile-reps", "1", "--output", str(out)])
    assert rc == 0
    return {"path": out, "target": str(target), "draft": str(draft), "prompts": prompts}
