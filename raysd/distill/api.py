"""`distill`: prompts -> the target's continuations and distributions -> a trained draft on disk."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


from raysd.distill.data import (DistillResult, encode_prompt, generate_teacher_data, head_vocabulary, load_teacher_data,
                                merge_teacher_meta, read_prompts, save_teacher_data, select_training_prompts,
                                split_holdout)
from raysd.models.layer_draft import CONFIG_FILE, build_draft, load_draft, save_draft
from raysd.distill.train import TrainConfig, evaluate_loss, train_draft, train_with_ray
from raysd.models.loading import DEFAULT_MODEL, ModelSpec, eos_token_ids, load_model, load_tokenizer


KINDS = ("layers", "eagle")


@dataclass
class DistillConfig:
    kind: str = "layers"  # layers: a few decoder layers on tokens (layer_draft); eagle: a feature draft (eagle_draft)
    target: str = DEFAULT_MODEL  # what load_model takes: HF id, local path, or the embedded default
    prompts: list[str] = field(default_factory=list)  # .jsonl / .txt prompt files, read at run time
    output: str | None = None  # directory for raysd_draft.json + draft.safetensors
    num_layers: int = 2
    init_layers: list[int] | None = None  # target layers the draft layers start from; default the first ones
    head_vocab: int = 0  # > 0: FR-Spec head over the N most frequent continuation tokens
    loss: str = "fkl"  # fkl | tv
    temperature: float = 0.0  # continuations: 0 greedy, 1 sampled
    max_new_tokens: int = 96
    max_prompt_tokens: int = 1024  # longer prompts are skipped
    max_prompts: int = 0  # > 0: use at most this many training prompts
    max_prompts_per_task: int = 0  # > 0: and at most this many of each task (the first ones)
    skip_prompts_per_task: int = 0  # skip each task's first N usable prompts (built earlier with max_prompts_per_task N)
    holdout_per_task: int = 0  # prompts per task kept out of training, for evaluation
    topk: int = 32  # teacher log-probabilities kept per position
    gen_batch_size: int = 8
    train: TrainConfig = field(default_factory=TrainConfig)
    backend: str = "ray"  # ray (Ray Train TorchTrainer) | local (in-process)
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1
    device: str = "cpu"  # where the driver runs the target (data generation, evaluation)
    # the target's dtype while it only generates teacher data (--data-only): bfloat16 generates faster on a
    # CPU with AVX512-BF16; training and evaluation always load it in float32 (the draft's frozen pieces)
    teacher_dtype: str = "float32"
    save_dtype: str = "bfloat16"
    data_cache: str | None = None  # reuse (or write) the teacher data here; "a.pt,b.pt" reads several (shards)
    shard: tuple[int, int] = (0, 1)  # (i, n): generate teacher data for training prompts i, i + n, ... only
    data_only: bool = False
    evaluate: bool = False  # measure alpha per task and speedups on the held-out prompts
    eval_k: int = 4
    eval_batch_sizes: tuple[int, ...] = (1, 8)
    eval_max_new_tokens: int = 64
    chat_template: bool = True
    seed: int = 0
    # --kind eagle
    temperatures: tuple[float, ...] = (0.0, 1.0)  # continuations at each of these temperatures
    code_prompts: int = 0  # > 0: also this many windows of Python standard-library files, continued as raw text
    code_windows: tuple[int, ...] = (0,)  # which windows of each of those files (0: the first; j: the j-th after it)
    holdout_tasks: tuple[str, ...] = ()  # tasks kept entirely out of training
    eagle: dict = field(default_factory=dict)  # EagleTrainConfig fields (raysd.distill.eagle_train)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if any(t not in (0.0, 1.0) for t in self.temperatures):
            raise ValueError(f"temperatures must be 0 or 1, got {self.temperatures}")
        if self.teacher_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"teacher_dtype must be float32, bfloat16 or float16, got {self.teacher_dtype!r}")
        if self.teacher_dtype != "float32" and not self.data_only:
            raise ValueError("a teacher dtype other than float32 is only for --data-only runs (training loads the "
                             "target's frozen embedding, norm and head in float32)")
        if self.backend not in ("ray", "local"):
            raise ValueError(f"backend must be ray or local, got {self.backend!r}")
        if self.temperature not in (0.0, 1.0):
            raise ValueError(f"temperature must be 0 or 1, got {self.temperature}")
        if min(self.max_prompts, self.max_prompts_per_task, self.skip_prompts_per_task) < 0:
            raise ValueError("max_prompts, max_prompts_per_task and skip_prompts_per_task must be >= 0")
        if not self.code_windows or min(self.code_windows) < 0:
            raise ValueError(f"code_windows must name windows >= 0, got {self.code_windows}")
        if self.head_vocab < 0:
            raise ValueError("head_vocab must be >= 0 (0: the full vocabulary)")
        if not self.data_only and not self.output:
            raise ValueError("an output directory is needed (or data_only)")
        if isinstance(self.train, dict):
            self.train = TrainConfig(**self.train)


def _log(msg: str) -> None:
    print(f"[raysd distill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def distill(cfg: DistillConfig, target=None, tokenizer=None, log=_log) -> DistillResult:
    """Build the teacher data, train the draft, save it, and optionally evaluate it.

    `target`/`tokenizer`: already loaded objects to use instead of loading `cfg.target`.
    """
    if cfg.kind == "eagle":
        from raysd.distill.eagle import distill_eagle

        return distill_eagle(cfg, target=target, tokenizer=tokenizer, log=log)
    t0 = time.perf_counter()
    if target is None:
        log(f"loading target {cfg.target}")
        target = load_model(ModelSpec(cfg.target, dtype=cfg.teacher_dtype, device=cfg.device))
    if tokenizer is None and (cfg.prompts and not _cache_ready(cfg) or cfg.evaluate):
        tokenizer = load_tokenizer(cfg.target)
    V = target.get_output_embeddings().weight.shape[0]
    eos = eos_token_ids(target)

    prompts = [p for path in cfg.prompts for p in read_prompts(path)]
    train_prompts, heldout = split_holdout(prompts, cfg.holdout_per_task)
    if _cache_ready(cfg):
        examples, metas = [], []
        for path in cfg.data_cache.split(","):
            part, part_meta = load_teacher_data(path)
            examples += part
            metas.append(part_meta)
        meta = merge_teacher_meta(metas)
        log(f"teacher data from {cfg.data_cache}: {len(examples)} sequences")
    else:
        if tokenizer is None:
            raise ValueError(f"no tokenizer for {cfg.target}")
        encoded, tasks, skipped = select_training_prompts(
            train_prompts, lambda text: encode_prompt(tokenizer, text, cfg.chat_template), cfg.max_prompt_tokens,
            max_per_task=cfg.max_prompts_per_task, skip_per_task=cfg.skip_prompts_per_task, max_prompts=cfg.max_prompts)
        i, n = cfg.shard
        encoded, tasks = encoded[i::n], tasks[i::n]
        if not encoded:
            raise ValueError("no training prompts")
        log(f"{len(encoded)} training prompts ({skipped} longer than {cfg.max_prompt_tokens} tokens skipped, "
            f"{len(heldout)} held out); generating continuations at temperature {cfg.temperature}")
        t = time.perf_counter()
        pad = getattr(target.generation_config, "pad_token_id", None)
        examples = generate_teacher_data(
            target, encoded, tasks, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, topk=cfg.topk,
            batch_size=cfg.gen_batch_size, eos_token_ids=eos, pad_token_id=pad if pad is not None else (eos[0] if eos else 0),
            seed=cfg.seed, log=log,
        )
        meta = {"prompt_files": [str(p) for p in cfg.prompts], "num_prompts": len(encoded),
                "skipped_long": skipped if i == 0 else 0,  # one count per prompt set (shard 0 holds it), so shards sum
                "prompts_per_task": {t: tasks.count(t) for t in sorted(set(tasks))},
                "heldout_per_task": cfg.holdout_per_task, "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                "topk": cfg.topk, "continuation_tokens": sum(ex.topk_ids.shape[0] for ex in examples),
                "prompt_tokens": sum(ex.prompt_len for ex in examples), "generation_s": time.perf_counter() - t}
        if cfg.data_cache:
            save_teacher_data(examples, cfg.data_cache.split(",")[0], meta)
            log(f"teacher data saved to {cfg.data_cache}")
    log(f"teacher data: {meta.get('continuation_tokens')} continuation tokens from {len(examples)} prompts")
    if cfg.data_only:
        return DistillResult(None, None, [], None, meta)

    head_ids = head_vocabulary(examples, cfg.head_vocab, V, always=eos) if cfg.head_vocab else None
    init_layers = cfg.init_layers if cfg.init_layers is not None else list(range(cfg.num_layers))
    draft = build_draft(target, cfg.num_layers, init_layers, head_ids)
    before = evaluate_loss(draft, examples[: min(len(examples), 32)], cfg.train.loss)
    log(f"initial draft: loss {before['loss']:.3f}, top-1 agreement {before['top1_agreement']:.3f} (first 32 sequences)")
    log(f"training a {cfg.num_layers}-layer draft (init from target layers {init_layers}, head "
        f"{'full' if head_ids is None else head_ids.numel()}) with {cfg.train.loss} for {cfg.train.steps} steps "
        f"on {cfg.backend} ({cfg.num_workers} worker{'s' if cfg.num_workers > 1 else ''}{', GPU' if cfg.use_gpu else ''})")
    t = time.perf_counter()
    if cfg.backend == "ray":
        draft, history = train_with_ray(draft, examples, cfg.train, target_name=cfg.target, init_layers=init_layers,
                                        num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, cpus_per_worker=cfg.cpus_per_worker)
    else:
        history = train_draft(draft, examples, cfg.train, device=cfg.device,
                              report=lambda m: log(f"step {m['step']}: loss {m['loss']:.4f}, top-1 agreement {m['top1_agreement']:.3f}"))
    draft = draft.to("cpu")  # the probe below and saving run on the CPU, wherever it trained
    train_s = time.perf_counter() - t
    after = evaluate_loss(draft, examples[: min(len(examples), 32)], cfg.train.loss)
    log(f"trained in {train_s:.0f} s: loss {after['loss']:.3f}, top-1 agreement {after['top1_agreement']:.3f} (first 32 sequences)")

    training = {
        "target": cfg.target, "data": meta, "loss": cfg.train.loss, "train": asdict(cfg.train), "backend": cfg.backend,
        "num_workers": cfg.num_workers, "use_gpu": cfg.use_gpu, "train_s": train_s,
        "head_vocab": None if head_ids is None else int(head_ids.numel()),
        "loss_before": before, "loss_after": after, "final": history[-1] if history else None,
    }
    save_draft(draft, cfg.output, cfg.target, dtype=cfg.save_dtype, training=training, init_layers=init_layers)
    log(f"draft saved to {cfg.output}")
    evaluation = None
    if cfg.evaluate:
        if not heldout:
            raise ValueError("evaluation needs held-out prompts (holdout_per_task > 0)")
        from raysd.distill.evaluate import evaluate_draft, format_report

        saved = load_draft(cfg.output, target=target, device=cfg.device)  # the weights as shipped
        enc = [encode_prompt(tokenizer, p.text, cfg.chat_template) for p in heldout]
        evaluation = evaluate_draft(target, saved, enc, [p.task for p in heldout], num_speculative_tokens=cfg.eval_k,
                                    batch_sizes=cfg.eval_batch_sizes, max_new_tokens=cfg.eval_max_new_tokens, log=log)
        training["evaluation"] = evaluation
        _update_training(cfg.output, training)
        log("evaluation:\n" + format_report(evaluation))
    log(f"done in {time.perf_counter() - t0:.0f} s")
    return DistillResult(cfg.output, draft, history, evaluation, meta)


def _cache_ready(cfg: DistillConfig) -> bool:
    return bool(cfg.data_cache) and all(Path(p).is_file() for p in cfg.data_cache.split(","))


def _update_training(path: str, training: dict) -> None:
    f = Path(path) / CONFIG_FILE
    data = json.loads(f.read_text())
    data["training"] = training
    f.write_text(json.dumps(data, indent=2) + "\n")
