"""`raysd distill --kind eagle` on a tiny random Llama with token-id prompts: feature data, the
training-time test (equal to a drafter's incremental loop), training, the offline acceptance
evaluation, and the CLI end to end (local and Ray Train)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from raysd.distill.eagle_data import generate_feature_data, load_feature_data, save_feature_data
from raysd.distill.eagle_eval import eagle_chain_overlaps, summarize, token_draft_chain_overlaps
from raysd.distill.eagle_train import EagleTrainConfig, collate, evaluate_eagle_loss, train_eagle, ttt_mask
from raysd.models.eagle_draft import CONFIG_FILE, EagleDraft, read_eagle_config
from tests.conftest import EOS, own_ray, tiny_model
from tests.distill.helpers import peaked, random_prompts


@pytest.fixture(scope="module")
def target():
    return peaked(tiny_model("llama", seed=3, layers=3))


@pytest.fixture(scope="module")
def examples(target):
    prompts = random_prompts(12, 96, seed=0)
    return (generate_feature_data(target, prompts, max_new_tokens=10, eos_token_ids=(EOS,), batch_size=6)
            + generate_feature_data(target, prompts[:6], max_new_tokens=10, temperature=1.0, eos_token_ids=(EOS,)))


def test_features_are_the_targets_pre_norm_hidden_states(target, examples):
    ex = examples[0]
    assert ex.features.shape == (len(ex.input_ids) - 1, 64)
    with torch.no_grad():
        out = target(torch.tensor([ex.input_ids]), output_hidden_states=True)
        ref = target.get_output_embeddings()(target.model.norm(ex.features.float()))
    torch.testing.assert_close(ref, out.logits[0, :-1], atol=0.05, rtol=0.02)  # bf16 features
    assert (ref.argmax(-1)[ex.prompt_len - 1:] == torch.tensor(ex.input_ids[ex.prompt_len:])).float().mean() > 0.9


def test_training_time_test_is_the_drafters_loop(target):
    """Step k of the training-time test at row t equals a drafter's step k of the chain starting at
    t - k + 1: a cache of real features up to the chain start, then its own hidden states."""
    d = EagleDraft.from_target(target, head_ids=torch.arange(40), seed=2)
    R, K = 10, 3
    f, x = torch.randn(1, R, 64), torch.randint(3, 96, (1, R))
    cache, h, rows = DynamicCache(), None, []
    for k in range(1, K + 1):
        inp = f if k == 1 else torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
        h = d.hidden(inp, x, position_ids=torch.arange(R)[None], past_key_values=cache, attention_mask=ttt_mask(R, k))
        rows.append(h)
    for n in (0, 3, 6):
        c = DynamicCache()
        _, hn = d(f[:, :n + 1], x[:, :n + 1], past_key_values=c)
        feat = hn[:, -1:]
        torch.testing.assert_close(feat[0, 0], rows[0][0, n], atol=1e-5, rtol=1e-5)
        for j in range(2, K + 1):
            _, feat = d(feat, x[:, n + j - 1:n + j], past_key_values=c)
            torch.testing.assert_close(feat[0, 0], rows[j - 1][0, n + j - 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("autocast", ["none", "bfloat16"])
def test_training_raises_agreement(target, examples, autocast):
    d = EagleDraft.from_target(target, head_ids=None, seed=0)
    cfg = EagleTrainConfig(steps=30, lr=3e-3, batch_tokens=256, warmup_steps=2, ttt_steps=2, prompt_weight=1.0,
                           autocast=autocast)
    before = evaluate_eagle_loss(d, examples, cfg)
    frozen = d.embed_tokens.weight.clone()
    train_eagle(d, examples, cfg)
    after = evaluate_eagle_loss(d, examples, cfg)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert after["top1_step1"] > before["top1_step1"]
    assert torch.equal(d.embed_tokens.weight, frozen)
    assert d.fc.weight.dtype == torch.float32  # autocast trains float32 weights


def test_autocast_is_validated():
    with pytest.raises(ValueError, match="autocast"):
        EagleTrainConfig(autocast="float16")


def test_collate_weights(examples):
    b = collate(examples[:3], prompt_weight=0.25)
    for r, ex in enumerate(examples[:3]):
        n = ex.features.shape[0]
        w = b["weights"][r]
        assert (w[n - 1:] == 0).all()  # the last row has no target, padding none
        assert w[ex.prompt_len - 2] == 1.0 and (w[:ex.prompt_len - 2] == 0.25).all()
        assert b["next_tokens"][r, ex.prompt_len - 2] == ex.input_ids[ex.prompt_len]


def test_offline_overlaps(target, examples):
    d = EagleDraft.from_target(target, head_ids=torch.arange(60), seed=0)
    ex = examples[0]
    table = eagle_chain_overlaps(d, target, ex, 3, 0.0)
    chains = ex.features.shape[0] - ex.prompt_len
    assert table.shape == (chains, 3) and torch.isnan(table[-1, 1:]).all() and not torch.isnan(table[0]).any()
    assert set(table[~torch.isnan(table)].tolist()) <= {0.0, 1.0}
    # chain 0, step 1 by hand: features up to the prompt's end, the first generated token
    P = ex.prompt_len
    logits, _ = d(ex.features[None, :P].float(), torch.tensor([ex.input_ids[1:P + 1]]))
    with torch.no_grad():
        p = target.get_output_embeddings()(target.model.norm(ex.features[P].float()))
    assert table[0, 0] == float(logits[0, -1].argmax() == p.argmax())
    # a token draft that is the target itself agrees everywhere at T = 0
    same = token_draft_chain_overlaps(target, target, ex, 3, 0.0)
    assert same[~torch.isnan(same)].mean() > 0.9
    s = summarize([table, same], 3)
    assert 0.0 <= s["alpha"] <= 1.0 and s["chains"] > 0 and len(s["alpha_by_step"]) == 3


def _prompt_file(tmp_path):
    rows = [{"prompt": p, "category": c} for p, c in zip(random_prompts(9, 96, seed=5), ["a", "b", "c"] * 3)]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    return f


def test_cli_eagle_steps_1_local(tmp_path, target):
    from raysd.cli import main

    target.save_pretrained(tmp_path / "target")
    rc = main(["distill", "--kind", "eagle", "--target", str(tmp_path / "target"), "--prompts", str(_prompt_file(tmp_path)),
               "--holdout-tasks", "c", "--holdout-per-task", "1", "--max-new-tokens", "6", "--head-vocab", "40",
               "--steps", "1", "--batch-tokens", "128", "--backend", "local", "--save-dtype", "float32",
               "--data-cache", str(tmp_path / "data.pt"), "--output", str(tmp_path / "eagle"),
               "--evaluate", "--eval-k", "3", "--eval-max-new-tokens", "6"])
    assert rc == 0
    cfg = read_eagle_config(tmp_path / "eagle")
    assert cfg.head_vocab == 40 and cfg.training["train"]["steps"] == 1
    ev = cfg.training["evaluation"]
    assert set(ev["offline"]["eagle"]) == {"T=0", "T=1"} and "c" in ev["offline"]["eagle"]["T=0"]  # the held-out task
    assert ev["cost"]["draft_step_s"] > 0
    examples, meta = load_feature_data(tmp_path / "data.pt")
    assert meta["holdout_tasks"] == ["c"] and {ex.task for ex in examples} == {"a", "b"}
    assert {ex.temperature for ex in examples} == {0.0, 1.0}


@pytest.mark.slow
def test_cli_eagle_steps_1_ray_train(tmp_path, target):
    pytest.importorskip("ray.train.torch")
    import ray
    from raysd.cli import main

    target.save_pretrained(tmp_path / "target")
    own_ray(num_cpus=2)
    try:
        rc = main(["distill", "--kind", "eagle", "--target", str(tmp_path / "target"), "--prompts", str(_prompt_file(tmp_path)),
                   "--max-new-tokens", "6", "--steps", "1", "--batch-tokens", "128", "--backend", "ray",
                   "--save-dtype", "float32", "--output", str(tmp_path / "eagle")])
    finally:
        ray.shutdown()
    assert rc == 0 and (tmp_path / "eagle" / CONFIG_FILE).is_file()
    assert read_eagle_config(tmp_path / "eagle").training["final"]["step"] == 1


def test_saved_data_round_trip(tmp_path, examples):
    save_feature_data(examples[:2], tmp_path / "d.pt", {"x": 1})
    back, meta = load_feature_data(tmp_path / "d.pt")
    assert meta == {"x": 1} and back[0].input_ids == examples[0].input_ids
    assert torch.equal(back[1].features, examples[1].features)


def test_code_windows_are_consecutive_disjoint_text(tmp_path):
    from raysd.distill.eagle_data import code_prompts

    lines = [f"x_{i} = {i}  # line {i}\n" for i in range(400)]  # ~20 characters a line
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("".join(lines))
    w0, w1, w2 = (code_prompts(2, root=tmp_path, chars=600, heldout_fraction=0.0, window=j) for j in range(3))
    for a, b, c in zip(w0, w1, w2):
        assert len(a.text) <= 600 and a.text and b.text and c.text
        assert not set(a.text.splitlines()) & set(b.text.splitlines())
        assert not set(b.text.splitlines()) & set(c.text.splitlines())
        # window j + 1 starts on the line after window j ends
        assert int(b.text.split("=")[0][2:]) == int(a.text.splitlines()[-1].split("=")[0][2:]) + 1
        assert b.task == "code" and b.raw and b.id.endswith("#1") and not a.id.endswith("#0")
    with pytest.raises(ValueError, match="window"):
        code_prompts(1, root=tmp_path, window=-1)


def test_teacher_dtype_is_for_data_only_runs():
    from raysd.distill.api import DistillConfig

    DistillConfig(kind="eagle", data_only=True, teacher_dtype="bfloat16")
    with pytest.raises(ValueError, match="only for --data-only"):
        DistillConfig(kind="eagle", teacher_dtype="bfloat16")
    with pytest.raises(ValueError, match="teacher_dtype"):
        DistillConfig(kind="eagle", data_only=True, teacher_dtype="int8")
