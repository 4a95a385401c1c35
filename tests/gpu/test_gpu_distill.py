"""`raysd distill` on a CUDA device: teacher data from a target on the GPU, training there
(`--device cuda --backend local`), and drafts saved that load back. A tiny random Llama with token-id prompts,
so it runs in seconds; the real draft's recipe is in docs/distill.md."""

from __future__ import annotations

import json

import torch

from raysd.distill.data import save_teacher_data
from raysd.models.eagle_draft import load_eagle, read_eagle_config
from raysd.models.layer_draft import CONFIG_FILE, head_token_ids, load_draft
from tests.conftest import EOS, tiny_model
from tests.distill.helpers import peaked, random_prompts
from tests.gpu.gpu_helpers import DEVICE


def _target(tmp_path):
    target = peaked(tiny_model("llama", seed=3, layers=3))
    target.save_pretrained(tmp_path / "target")
    return target


def test_eagle_draft_trains_on_the_device(tmp_path):
    from raysd.cli import main

    target = _target(tmp_path)
    rows = [{"prompt": p, "category": c} for p, c in zip(random_prompts(24, 96, seed=5), ["a", "b"] * 12)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    rc = main(["distill", "--kind", "eagle", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.jsonl"),
               "--max-new-tokens", "12", "--gen-batch-size", "12", "--head-vocab", "48", "--steps", "40", "--lr", "3e-3",
               "--batch-tokens", "256", "--autocast", "bfloat16", "--backend", "local", "--device", str(DEVICE),
               "--save-dtype", "float32", "--output", str(tmp_path / "eagle")])
    assert rc == 0
    training = read_eagle_config(tmp_path / "eagle").training
    assert training["final"]["step"] == 40 and training["loss_after"]["loss"] < training["loss_before"]["loss"]
    draft = load_eagle(tmp_path / "eagle", target)
    assert draft.head_token_ids.numel() == 48


def test_layers_draft_trains_on_the_device(tmp_path):
    from raysd.cli import main
    from raysd.distill.data import generate_teacher_data

    target = _target(tmp_path)
    on_device = peaked(tiny_model("llama", seed=3, layers=3)).to(DEVICE)  # the same weights, on the device
    examples = generate_teacher_data(on_device, random_prompts(16, 96, seed=0), max_new_tokens=12, topk=96,
                                     eos_token_ids=(EOS,), batch_size=8)
    assert all(ex.topk_ids.device.type == "cpu" for ex in examples)
    save_teacher_data(examples, tmp_path / "data.pt", {"continuation_tokens": sum(ex.topk_ids.shape[0] for ex in examples)})
    rc = main(["distill", "--target", str(tmp_path / "target"), "--data-cache", str(tmp_path / "data.pt"),
               "--output", str(tmp_path / "draft"), "--layers", "1", "--head-vocab", "32", "--steps", "30", "--lr", "3e-3",
               "--batch-tokens", "256", "--backend", "local", "--device", str(DEVICE), "--save-dtype", "float32"])
    assert rc == 0
    training = json.loads((tmp_path / "draft" / CONFIG_FILE).read_text())["training"]
    assert training["loss_after"]["loss"] < training["loss_before"]["loss"]
    draft = load_draft(tmp_path / "draft", target=target)
    assert head_token_ids(draft).numel() == 32
    with torch.no_grad():
        assert torch.isfinite(draft(torch.tensor([[5, 6, 7]])).logits[..., head_token_ids(draft)]).all()
