"""`raysd distill --kind eagle`: prompts -> the target's continuations with its hidden states -> an EAGLE
feature draft on disk (raysd.models.eagle_draft). Driven by raysd.distill.api.distill."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from raysd.distill.data import DistillResult, Prompt, prompt_encoder, read_prompts, select_training_prompts, split_holdout
from raysd.distill.eagle_data import (code_prompts, generate_feature_data, load_feature_data, save_feature_data)


def split_prompts(cfg, prompts):
    """(training prompts, held-out prompts): whole tasks in cfg.holdout_tasks, then holdout_per_task per task."""
    out_tasks = set(cfg.holdout_tasks)
    kept = [p for p in prompts if p.task not in out_tasks]
    train, heldout = split_holdout(kept, cfg.holdout_per_task)
    return train, heldout + [p for p in prompts if p.task in out_tasks]


def build_feature_data(cfg, target, tokenizer, log):
    """The teacher data of an EAGLE draft: (examples, meta), read from cfg.data_cache when it exists."""
    if cfg.data_cache and all(Path(p).is_file() for p in cfg.data_cache.split(",")):
        examples, metas = [], []
        for path in cfg.data_cache.split(","):
            part, meta = load_feature_data(path)
            examples += part
            metas.append(meta)
        log(f"eagle data from {cfg.data_cache}: {len(examples)} sequences")
        from raysd.distill.data import merge_teacher_meta

        return examples, merge_teacher_meta(metas)
    from raysd.models.loading import eos_token_ids

    prompts = [p for path in cfg.prompts for p in read_prompts(path)]
    train, heldout = split_prompts(cfg, prompts)
    code = [p for w in cfg.code_windows for p in code_prompts(cfg.code_prompts, window=w)] if cfg.code_prompts else []
    encode = prompt_encoder(tokenizer, cfg.chat_template)
    enc, tasks, skipped = select_training_prompts(
        train, lambda text: encode(Prompt(text, "", "")), cfg.max_prompt_tokens, max_per_task=cfg.max_prompts_per_task,
        skip_per_task=cfg.skip_prompts_per_task, max_prompts=cfg.max_prompts)
    for p in code:
        ids = encode(p)
        if len(ids) <= cfg.max_prompt_tokens:
            enc.append(ids)
            tasks.append("code")
    i, n = cfg.shard
    enc, tasks = enc[i::n], tasks[i::n]
    if not enc:
        raise ValueError("no training prompts")
    eos = eos_token_ids(target)
    pad = getattr(target.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    log(f"{len(enc)} training prompts ({tasks.count('code')} code; {skipped} longer than {cfg.max_prompt_tokens} "
        f"tokens skipped; {len(heldout)} held out, tasks {sorted(cfg.holdout_tasks)} entirely); "
        f"continuations at temperatures {list(cfg.temperatures)}")
    examples, t = [], time.perf_counter()
    for temp in cfg.temperatures:
        examples += generate_feature_data(target, enc, tasks, max_new_tokens=cfg.max_new_tokens, temperature=temp,
                                          batch_size=cfg.gen_batch_size, eos_token_ids=eos,
                                          pad_token_id=pad, seed=cfg.seed, log=log)
    meta = {"kind": "eagle", "prompt_files": [str(p) for p in cfg.prompts], "num_prompts": len(enc),
            "skipped_long": skipped if i == 0 else 0,
            "prompts_per_task": {t: tasks.count(t) for t in sorted(set(tasks))},
            "heldout_per_task": cfg.holdout_per_task, "holdout_tasks": sorted(cfg.holdout_tasks),
            "code_prompts": cfg.code_prompts, "code_windows": list(cfg.code_windows), "temperatures": list(cfg.temperatures), "max_new_tokens": cfg.max_new_tokens,
            "continuation_tokens": sum(len(ex.input_ids) - ex.prompt_len for ex in examples),
            "prompt_tokens": sum(ex.prompt_len for ex in examples), "generation_s": time.perf_counter() - t}
    if cfg.data_cache:
        save_feature_data(examples, cfg.data_cache.split(",")[0], meta)
        log(f"eagle data saved to {cfg.data_cache}")
    return examples, meta


def distill_eagle(cfg, target=None, tokenizer=None, log=print):
    """The `--kind eagle` pipeline: teacher data with features, training, saving, optional evaluation."""
    from raysd.models.loading import ModelSpec, load_model, load_tokenizer

    t0 = time.perf_counter()
    if target is None:
        log(f"loading target {cfg.target}")
        target = load_model(ModelSpec(cfg.target, dtype=cfg.teacher_dtype, device=cfg.device))
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.target)
    examples, meta = build_feature_data(cfg, target, tokenizer, log)
    log(f"eagle data: {meta.get('continuation_tokens')} continuation tokens, {meta.get('prompt_tokens')} prompt tokens, "
        f"{len(examples)} sequences")
    if cfg.data_only:
        return DistillResult(None, None, [], None, meta)
    return _train_and_save(cfg, target, tokenizer, examples, meta, log, t0)


def eagle_head_vocabulary(examples, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """FR-Spec for the EAGLE draft: the `size` most frequent tokens of the training sequences (prompts
    and continuations, so code and chat tokens both count), always including `always` (e.g. EOS)."""
    from collections import Counter

    if not 0 < size <= vocab_size:
        raise ValueError(f"head vocabulary size must be in (0, {vocab_size}], got {size}")
    counts = Counter(t for ex in examples for t in ex.input_ids)
    chosen = list(dict.fromkeys([int(t) for t in always if 0 <= int(t) < vocab_size]))
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if t not in chosen and 0 <= t < vocab_size:
            chosen.append(t)
    rest = iter(t for t in range(vocab_size) if t not in set(chosen))
    while len(chosen) < size:
        chosen.append(next(rest))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def _train_and_save(cfg, target, tokenizer, examples, meta, log, t0):
    from raysd.distill.eagle_train import EagleTrainConfig, evaluate_eagle_loss, train_eagle, train_eagle_with_ray
    from raysd.models.eagle_draft import EagleDraft, save_eagle
    from raysd.models.loading import eos_token_ids, output_vocab_size

    V = output_vocab_size(target)
    tcfg = EagleTrainConfig(steps=cfg.train.steps, lr=cfg.train.lr, warmup_steps=cfg.train.warmup_steps,
                            batch_tokens=cfg.train.batch_tokens, max_context=cfg.train.max_context, loss=cfg.train.loss,
                            seed=cfg.train.seed, threads=cfg.train.threads, log_every=cfg.train.log_every,
                            max_seconds=cfg.train.max_seconds, **cfg.eagle)
    head_ids = eagle_head_vocabulary(examples, cfg.head_vocab, V, always=eos_token_ids(target)) if cfg.head_vocab else None
    # the decoder layer starts random (copied from the target's last layer, it starts from a higher loss)
    # unless --init-layers names a target layer to copy
    init_layer = cfg.init_layers[0] if cfg.init_layers else None
    draft = EagleDraft.from_target(target, head_ids=head_ids, init_layer=init_layer, seed=cfg.seed)
    probe = examples[: min(len(examples), 16)]
    before = evaluate_eagle_loss(draft, probe, tcfg)
    log(f"initial draft: loss {before['loss']:.3f}, top-1 agreement step 1 {before['top1_step1']:.3f} (first {len(probe)} sequences)")
    log(f"training an EAGLE draft (head {'full' if head_ids is None else head_ids.numel()}, training-time test "
        f"{tcfg.ttt_steps} steps, {tcfg.loss}) for {tcfg.steps} steps on {cfg.backend}")

    def progress(m):
        steps = " ".join(f"{m.get(f'top1_step{k}', 0):.3f}" for k in range(1, tcfg.ttt_steps + 1))
        total = m.get("total_steps", tcfg.steps)
        bar = "#" * int(20 * m["step"] / max(1, total))
        log(f"[{bar:<20}] step {m['step']}/{total}: loss {m['loss']:.4f}, top-1 by draft step {steps}, "
            f"eta {m['eta_s']:.0f} s")

    t = time.perf_counter()
    if cfg.backend == "ray":
        draft, history = train_eagle_with_ray(draft, examples, tcfg, target_name=cfg.target,
                                              architecture=type(target).__name__, num_workers=cfg.num_workers,
                                              use_gpu=cfg.use_gpu, cpus_per_worker=cfg.cpus_per_worker)
        for m in history:
            progress(m)
    else:
        history = train_eagle(draft, examples, tcfg, device=cfg.device, report=progress)
    draft = draft.to("cpu")
    train_s = time.perf_counter() - t
    after = evaluate_eagle_loss(draft, probe, tcfg)
    log(f"trained in {train_s:.0f} s: loss {after['loss']:.3f}, top-1 agreement step 1 {after['top1_step1']:.3f}")
    training = {"kind": "eagle", "target": cfg.target, "data": meta, "train": asdict(tcfg), "backend": cfg.backend,
                "num_workers": cfg.num_workers, "use_gpu": cfg.use_gpu, "train_s": train_s,
                "head_vocab": None if head_ids is None else int(head_ids.numel()),
                "loss_before": before, "loss_after": after, "final": history[-1] if history else None}
    save_eagle(draft, cfg.output, cfg.target, type(target).__name__, dtype=cfg.save_dtype, training=training)
    log(f"EAGLE draft saved to {cfg.output}")
    evaluation = None
    if cfg.evaluate:
        from raysd.distill.eagle_eval import evaluate_eagle_heldout
        from raysd.models.eagle_draft import CONFIG_FILE, load_eagle

        saved = load_eagle(cfg.output, target)
        prompts = [p for path in cfg.prompts for p in read_prompts(path)]
        _, heldout = split_prompts(cfg, prompts)
        evaluation = evaluate_eagle_heldout(target, saved, heldout, tokenizer, cfg, log=log)
        training["evaluation"] = evaluation
        f = Path(cfg.output) / CONFIG_FILE
        data = json.loads(f.read_text())
        data["training"] = training
        f.write_text(json.dumps(data, indent=2, default=str) + "\n")
    log(f"done in {time.perf_counter() - t0:.0f} s")
    return DistillResult(cfg.output, draft, history, evaluation, meta)
