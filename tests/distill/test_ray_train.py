"""The Ray Train path: TorchTrainer with one CPU worker on a local Ray trains the draft."""

from __future__ import annotations

import pytest
import torch

from raysd.models.layer_draft import build_draft, own_state_dict
from raysd.distill.train import TrainConfig, evaluate_loss, train_with_ray
from tests.conftest import own_ray, tiny_model
from tests.distill.helpers import peaked, teacher_examples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.train.torch")
    own_ray(num_cpus=2)
    yield ray
    ray.shutdown()


def test_torch_trainer_with_one_cpu_worker(local_ray, tmp_path):
    target = peaked(tiny_model("llama", seed=3, layers=3))
    examples = teacher_examples(target, n=8)
    draft = build_draft(target, 1, head_ids=torch.arange(0, 64))
    before = {k: v.clone() for k, v in own_state_dict(draft).items()}
    loss_before = evaluate_loss(draft, examples, "fkl")["loss"]
    trained, history = train_with_ray(draft, examples, TrainConfig(steps=8, lr=3e-3, batch_tokens=256, warmup_steps=1, log_every=4),
                                      target_name="tiny", init_layers=[0], num_workers=1, storage_path=str(tmp_path))
    assert [m["step"] for m in history] == [4, 8]
    after = own_state_dict(trained)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the worker's weights came back
    assert evaluate_loss(trained, examples, "fkl")["loss"] < loss_before
