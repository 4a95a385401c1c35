"""raysd distill on tiny models: losses go down, drafts stay exact, FR-Spec heads restrict
drafts, drafts save and load, and the CLI and loader work end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raysd.core.sampling import SamplingParams, SamplingTensors, logits_to_probs
from raysd.core.speculation import SpeculationConfig
from raysd.distill.data import (
    head_vocabulary,
    load_teacher_data,
    merge_teacher_meta,
    read_prompts,
    save_teacher_data,
    select_training_prompts,
    split_holdout,
)
from raysd.distill.train import TrainConfig, distill_loss, evaluate_loss, train_draft
from raysd.engine.drafters import DraftModelDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.models.layer_draft import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    build_draft,
    head_token_ids,
    load_draft,
    own_state_dict,
    read_draft_config,
    save_draft,
)
from raysd.models.loading import ModelSpec, load_model
from tests.conftest import EOS, tiny_model
from tests.core.test_distribution import chi_square_pvalue
from tests.distill.helpers import peaked, random_prompts, teacher_examples


@pytest.fixture(scope="module")
def target():
    return peaked(tiny_model("llama", seed=3, layers=3))


@pytest.fixture(scope="module")
def examples(target):
    return teacher_examples(target, n=16)


@pytest.mark.parametrize("loss", ["fkl", "tv"])
@pytest.mark.parametrize("head", [False, True])
def test_training_reduces_the_distillation_loss(target, examples, loss, head):
    head_ids = head_vocabulary(examples, 48, 96, always=(EOS,)) if head else None
    draft = build_draft(target, 1, head_ids=head_ids)
    before = evaluate_loss(draft, examples, loss)
    frozen = draft.get_input_embeddings().weight.clone()
    train_draft(draft, examples, TrainConfig(loss=loss, steps=25, lr=3e-3, batch_tokens=256, warmup_steps=2))
    after = evaluate_loss(draft, examples, loss)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert after["top1_agreement"] > before["top1_agreement"]
    assert torch.equal(draft.get_input_embeddings().weight, frozen)  # the target's embedding stays frozen


def test_losses_are_exact_on_a_full_head():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(5, 7), torch.randn(5, 7)
    lp = torch.log_softmax(p_logits, -1)
    p, q = lp.exp(), torch.softmax(q_logits, -1)
    idx = torch.arange(7).expand(5, 7)
    kl = (p * (lp - q.log())).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(distill_loss(q_logits, idx, lp, "fkl"), kl)
    torch.testing.assert_close(distill_loss(q_logits, idx, lp, "tv"), tv)
    # the order of the teacher's tokens does not matter
    perm = torch.randperm(7)
    torch.testing.assert_close(distill_loss(q_logits, idx[:, perm], lp[:, perm], "tv"), tv)


def test_build_draft_starts_from_the_targets_layers(target):
    draft = build_draft(target, 2, init_layers=[0, 2])
    t, d = target.state_dict(), draft.state_dict()
    assert torch.equal(d["model.layers.1.mlp.up_proj.weight"], t["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(d["model.norm.weight"], t["model.norm.weight"])
    assert not any("embed" in k or "lm_head" in k for k in own_state_dict(draft))
    x = torch.tensor([[5, 6, 7]])
    # a draft with all the target's layers is the target
    full = build_draft(target, 3)
    torch.testing.assert_close(full(x).logits, target(x).logits)


@pytest.fixture(scope="module")
def distilled(target, examples):
    head_ids = head_vocabulary(examples, 40, 96, always=(EOS,))
    draft = build_draft(target, 1, head_ids=head_ids)
    train_draft(draft, examples, TrainConfig(steps=15, lr=3e-3, batch_tokens=256, warmup_steps=2))
    return draft


@pytest.mark.parametrize("batch_size,k", [(1, 3), (4, 2), (4, 5)])
def test_distilled_draft_gives_the_targets_greedy_output(target, distilled, batch_size, k):
    prompts = random_prompts(6, 96, seed=7)
    with torch.no_grad():
        expected = []
        for p in prompts:
            out = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                                  max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=EOS)
            expected.append(out[0, len(p):].tolist())
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,))
    engine = SpecEngine(target, DraftModelDrafter(distilled, 96), EngineConfig(speculation, max_batch_size=batch_size))
    results = engine.generate([Request(i, p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(prompts)])
    got = [r.token_ids for r in results]
    assert got == [e[: len(g)] if e and e[-1] == EOS else e for e, g in zip(expected, got)]
    assert got == expected
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > 0  # the draft really drafted


def test_restricted_head_restricts_drafts(distilled):
    ids = head_token_ids(distilled)
    assert ids is not None and ids.numel() == 40
    outside = torch.ones(96, dtype=torch.bool)
    outside[ids] = False
    logits = distilled(torch.tensor([[5, 9, 11, 4]])).logits
    assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., ~outside]).all()
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        drafter = DraftModelDrafter(distilled, 96)
        drafter.add_rows([[5, 9, 11], [7, 8]])
        sampling = SamplingTensors.from_params([params] * 2)
        proposal = drafter.propose([4, 4], sampling, torch.rand(2, 4))
        assert not outside[proposal.draft_token_ids].any()
        assert float(proposal.draft_probs[..., outside].abs().sum()) == 0.0


def test_sampled_first_token_follows_the_target():
    """Chi-square of the first generated token over many seeds, tiny vocabulary, FR-Spec draft."""
    V, N = 16, 4000
    target = tiny_model("llama", seed=5, layers=2, vocab=V)
    examples = teacher_examples(target, n=8, temperature=1.0)
    draft = build_draft(target, 1, head_ids=torch.arange(2, 10))  # half the vocabulary
    train_draft(draft, examples, TrainConfig(steps=10, lr=3e-3, batch_tokens=256, warmup_steps=2))
    prompt = [4, 7, 9, 4, 7]
    params = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)
    speculation = SpeculationConfig(num_speculative_tokens=1)
    engine = SpecEngine(target, DraftModelDrafter(draft, V), EngineConfig(speculation, max_batch_size=1000))
    results = engine.generate([Request(i, prompt, SamplingParams(**{**params.__dict__, "seed": 777 + i})) for i in range(N)])
    assert sum(r.stats.num_draft_tokens for r in results) == N  # every first token went through the rejection test
    counts = np.bincount([r.token_ids[0] for r in results], minlength=V)
    with torch.no_grad():
        p = logits_to_probs(target(torch.tensor([prompt])).logits[:, -1], SamplingTensors.from_params([params]))[0]
    expected = p.double().numpy() * N
    assert (counts[expected == 0] == 0).all()
    assert counts[10:].sum() > 0  # tokens the draft can never propose still come out, via the residual
    assert chi_square_pvalue(counts, expected) > 1e-4  # cells expecting < 5 pooled


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, target, distilled, dtype):
    save_draft(distilled, tmp_path, "some/target", dtype=dtype, training={"steps": 15})
    cfg = read_draft_config(tmp_path)
    assert cfg.target == "some/target" and cfg.num_layers == 1 and cfg.head_vocab == 40 and cfg.training == {"steps": 15}
    from safetensors import safe_open

    with safe_open(str(tmp_path / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
    assert not any("embed" in k or "lm_head" in k for k in keys)  # the target's tensors are not saved
    loaded = load_draft(tmp_path, target=target)
    x = torch.tensor([[5, 9, 11, 4, 3]])
    if dtype == "float32":
        assert torch.equal(loaded(x).logits, distilled(x).logits)
    else:
        a, b = loaded(x).logits, distilled(x).logits
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], atol=0.1, rtol=0.05)
    assert torch.equal(head_token_ids(loaded), head_token_ids(distilled))


def test_load_by_name_through_load_model(tmp_path, target, distilled):
    """A draft directory is a model name: load_model finds its target by the name in the draft's config."""
    target.save_pretrained(tmp_path / "target")
    save_draft(distilled, tmp_path / "draft", str(tmp_path / "target"), dtype="float32")
    loaded = load_model(ModelSpec(str(tmp_path / "draft")))
    x = torch.tensor([[5, 9, 11]])
    assert torch.equal(loaded(x).logits, distilled(x).logits)


def test_prompts_and_holdout(tmp_path):
    f = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "second"]} for i, c in
            enumerate(["writing"] * 4 + ["coding"] * 4 + ["qa"] * 6)]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = read_prompts(f)
    assert {p.task for p in prompts} == {"mt_bench", "qa"}
    train, held = split_holdout(prompts, 2)
    assert len(held) == 4 and len(train) == 10 and not {p.id for p in train} & {p.id for p in held}
    assert {p.text for p in held if p.task == "mt_bench"} == {"q2", "q6"}  # spread over the task
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert [p.text for p in read_prompts(tmp_path / "p.txt")] == ["one", "two"]


def test_cli_local_backend(tmp_path, target, examples):
    from raysd.cli import main

    target.save_pretrained(tmp_path / "target")
    save_teacher_data(examples, tmp_path / "data.pt", {"continuation_tokens": 1})
    assert len(load_teacher_data(tmp_path / "data.pt")[0]) == len(examples)
    rc = main(["distill", "--target", str(tmp_path / "target"), "--data-cache", str(tmp_path / "data.pt"),
               "--output", str(tmp_path / "draft"), "--layers", "1", "--head-vocab", "32", "--steps", "3",
               "--batch-tokens", "256", "--backend", "local", "--loss", "tv", "--save-dtype", "float32"])
    assert rc == 0
    cfg = json.loads((tmp_path / "draft" / CONFIG_FILE).read_text())
    assert cfg["head_vocab"] == 32 and cfg["training"]["loss"] == "tv" and cfg["training"]["train"]["steps"] == 3
    draft = load_model(ModelSpec(str(tmp_path / "draft")))
    assert head_token_ids(draft).numel() == 32


def test_evaluate_draft_reports_per_task(target, distilled):
    from raysd.distill.evaluate import evaluate_draft, format_report

    prompts = random_prompts(4, 96, seed=9)
    report = evaluate_draft(target, distilled, prompts, ["a", "a", "b", "b"], num_speculative_tokens=3,
                            batch_sizes=(1, 2), max_new_tokens=8)
    for bs in ("1", "2"):
        entry = report["by_batch"][bs]
        assert entry["token_identical"] and set(entry["alpha_by_task"]) == {"a", "b"}
        assert all(0.0 <= a <= 1.0 for a in entry["alpha_by_task"].values())
    assert report["draft_step_s"] > 0 and report["target_step_s"] > 0
    assert "| **mean over tasks** |" in format_report(report)


def test_teacher_data_parts_describe_the_whole():
    """Shards of one prompt file plus a second file: counts add up (skipped prompts once per
    prompt set), files and per-task counts combine, and disagreeing settings are all kept."""
    shard = {"prompt_files": ["a.jsonl"], "num_prompts": 3, "skipped_long": 2, "continuation_tokens": 30,
             "prompts_per_task": {"qa": 2, "rag": 1}, "heldout_per_task": 4, "topk": 32, "generation_s": 5.0}
    other = {**shard, "prompt_files": ["b.jsonl"], "skipped_long": 0, "prompts_per_task": {"qa": 1}, "heldout_per_task": 0,
             "generation_s": 7.0}
    merged = merge_teacher_meta([shard, {**shard, "skipped_long": 0}, other])
    assert merged["parts"] == 3 and merged["num_prompts"] == 9 and merged["continuation_tokens"] == 90
    assert merged["skipped_long"] == 2 and merged["prompts_per_task"] == {"qa": 5, "rag": 2}
    assert merged["prompt_files"] == ["a.jsonl", "b.jsonl"] and merged["generation_s"] == 7.0
    assert merged["topk"] == 32 and merged["heldout_per_task"] == [4, 4, 0]


def test_prompt_selection_max_then_skip_partitions_each_task():
    from raysd.distill.data import Prompt

    prompts = [Prompt("x" * n, task, str(i)) for i, (n, task) in enumerate(
        [(3, "a"), (9, "a"), (2, "b"), (4, "a"), (5, "b"), (1, "a"), (6, "b"), (2, "a"), (3, "b")])]
    encode = lambda text: list(range(len(text)))  # noqa: E731 - one token per character
    first, tasks1, skipped1 = select_training_prompts(prompts, encode, 8, max_per_task=2)
    rest, tasks2, skipped2 = select_training_prompts(prompts, encode, 8, skip_per_task=2)
    everything, tasks_all, skipped_all = select_training_prompts(prompts, encode, 8)
    assert [len(x) for x in first] == [3, 2, 4, 5] and tasks1 == ["a", "b", "a", "b"]  # file order
    assert [len(x) for x in rest] == [1, 6, 2, 3] and skipped2 == skipped_all == 1  # the 9-token prompt
    assert sorted(map(len, first + rest)) == sorted(map(len, everything)) and len(everything) == 8
    assert [len(x) for x in select_training_prompts(prompts, encode, 8, max_per_task=1, skip_per_task=2)[0]] == [1, 6]


def test_a_time_bounded_schedule_fits_its_steps_and_ends_its_cosine():
    from raysd.distill.schedule import Schedule

    now = [0.0]
    plan = Schedule(1000, warmup_steps=4, max_seconds=15.0, probe=10, clock=lambda: now[0])
    assert plan.lr_factor(0) == 0.25 and plan.lr_factor(4) == 1.0
    for done in range(1, 21):
        now[0] += 1.0 if done <= 10 else 0.1  # slow first steps, then 0.1 s a step
        plan.after_step(done)
    assert plan.total == 60  # 11 s spent, 4 s left at 0.1 s a step: 40 more
    assert abs(plan.lr_factor(59) - 0.1) < 0.01  # the last step runs at about 10%
    for done in range(21, 41):
        now[0] += 0.0625  # faster still: planned again at 40 steps from the pace since 20
        plan.after_step(done)
        assert plan.total == (60 if done < 40 else 84)  # 12.25 s spent, 2.75 s left at 0.0625 s a step: 44 more
    agreed = Schedule(1000, 4, max_seconds=15.0, probe=10, clock=lambda: now[0], agree=lambda total: min(total, 50))
    for done in range(1, 21):
        now[0] += 0.1
        agreed.after_step(done)
    assert agreed.total == 50  # what the workers agreed on, not this one's 148
    assert Schedule(30, 4, max_seconds=5.0, clock=lambda: 0.0).total == 30  # never more than asked
    unbounded = Schedule(1000, 4)
    unbounded.after_step(10)
    assert unbounded.total == 1000
