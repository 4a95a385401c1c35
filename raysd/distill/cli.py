"""`raysd distill`: train a small draft model for a target by knowledge distillation."""

from __future__ import annotations

import argparse
import json
import os

from raysd.cli import comma_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    from raysd.models.loading import DEFAULT_MODEL

    p.add_argument("--kind", choices=["layers", "eagle"], default="layers",
                   help="layers: a few decoder layers on tokens; eagle: a feature draft on the target's hidden states")
    g = p.add_argument_group("data")
    g.add_argument("--target", default=DEFAULT_MODEL, help="target model: HF id, local path, or the embedded default (%(default)s)")
    g.add_argument("--prompts", nargs="+", default=[], metavar="FILE",
                   help="prompt files (.jsonl with turns/prompt/text fields, or .txt one per line), read at run time")
    g.add_argument("--temperature", type=float, choices=[0.0, 1.0], default=0.0, help="continuations greedy (0) or sampled (1)")
    g.add_argument("--max-new-tokens", type=int, default=96, help="continuation length per prompt")
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts")
    g.add_argument("--max-prompts", type=int, default=0, help="use at most this many training prompts (0: all)")
    g.add_argument("--max-prompts-per-task", type=int, default=0, help="use at most this many training prompts per task (0: all)")
    g.add_argument("--skip-prompts-per-task", type=int, default=0,
                   help="skip each task's first N usable training prompts (more data after a run with --max-prompts-per-task N)")
    g.add_argument("--holdout-per-task", type=int, default=0, help="prompts per task kept out of training for --evaluate")
    g.add_argument("--temperatures", type=comma_list(float), default=[0.0, 1.0],
                   help="--kind eagle: continuations at each of these temperatures (0 and/or 1)")
    g.add_argument("--code-prompts", type=int, default=0,
                   help="--kind eagle: also N windows of Python standard-library files (raw text), a fixed tenth held out")
    g.add_argument("--code-windows", type=comma_list(int), default=[0],
                   help="--kind eagle: which windows of each code file, e.g. 0,1,2 (0: the first; j: the j-th after it, for more data)")
    g.add_argument("--holdout-tasks", type=comma_list(), default=[],
                   help="tasks kept entirely out of training, e.g. translation")
    g.add_argument("--topk", type=int, default=32, help="teacher log-probabilities kept per position")
    g.add_argument("--gen-batch-size", type=int, default=8)
    g.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    g.add_argument("--data-cache", help="teacher-data file: read if it exists, written otherwise "
                   "(a.pt,b.pt: read several, e.g. shards)")
    g.add_argument("--shard", default="0/1", help="i/n: build teacher data for every n-th training prompt from i "
                   "(run n processes in parallel, then train on all caches)")
    g.add_argument("--data-only", action="store_true", help="only build the teacher data (needs --data-cache)")
    g = p.add_argument_group("draft")
    g.add_argument("--output", "-o", help="output directory for the draft (raysd_draft.json + draft.safetensors)")
    g.add_argument("--layers", type=int, default=2, help="decoder layers in the draft")
    g.add_argument("--init-layers", type=comma_list(int), help="target layers to start from, e.g. 0,29 (default: the first ones)")
    g.add_argument("--head-vocab", type=int, default=0, help="FR-Spec: score only the N most frequent tokens (0: all)")
    g.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    g = p.add_argument_group("training")
    g.add_argument("--loss", choices=["fkl", "tv"], default="fkl", help="forward KL or total variation")
    g.add_argument("--steps", type=int, default=200)
    g.add_argument("--max-train-seconds", type=float, default=0,
                   help="> 0: train fewer than --steps steps when they would not fit in this time (the pace of steps 11-20 decides)")
    g.add_argument("--lr", type=float, default=5e-4)
    g.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per step and worker")
    g.add_argument("--max-context", type=int, default=0, help="> 0: truncate prompts to this many tokens before the continuation")
    g.add_argument("--warmup-steps", type=int, default=10)
    g.add_argument("--backend", choices=["ray", "local"], default="ray", help="Ray Train TorchTrainer, or in-process")
    g.add_argument("--num-workers", type=int, default=1, help="Ray Train workers")
    g.add_argument("--use-gpu", action="store_true", help="one GPU per Ray Train worker")
    g.add_argument("--cpus-per-worker", type=float, default=1)
    g.add_argument("--threads", type=int, default=0, help="torch threads (driver and workers; 0: default)")
    g.add_argument("--ray-address", help="Ray cluster address (default: the submitted job's cluster "
                   "via RAY_ADDRESS, else a private local Ray on loopback; 'local' forces the latter)")
    g.add_argument("--ttt-steps", type=int, default=3,
                   help="--kind eagle: draft steps per position in training, steps 2.. fed the draft's own features (EAGLE-3)")
    g.add_argument("--feature-weight", type=float, default=0.0,
                   help="--kind eagle: weight of EAGLE's smooth-L1 loss between the draft's and the target's next features")
    g.add_argument("--autocast", choices=["none", "bfloat16"], default="none",
                   help="--kind eagle: train under torch.autocast in bfloat16 (faster on CPUs with AVX512-BF16 and on GPUs)")
    g.add_argument("--prompt-weight", type=float, default=0.3,
                   help="--kind eagle: loss weight of prompt positions (continuation positions weigh 1)")
    g.add_argument("--device", default="cpu", help="device for the target in the driver")
    g.add_argument("--teacher-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="with --data-only: the target's dtype while it generates teacher data (bfloat16 is faster "
                        "on CPUs with AVX512-BF16)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("evaluation")
    g.add_argument("--evaluate", action="store_true", help="measure alpha per task and speedups on the held-out prompts")
    g.add_argument("--eval-k", type=int, default=4, help="speculative tokens per step")
    g.add_argument("--eval-batch-sizes", type=comma_list(int), default=[1, 8])
    g.add_argument("--eval-max-new-tokens", type=int, default=64)
    g.add_argument("--report", help="also write the evaluation report (json) here")


def config_from_args(args):
    from raysd.distill.api import DistillConfig
    from raysd.distill.train import TrainConfig

    return DistillConfig(
        target=args.target, prompts=list(args.prompts), output=args.output, num_layers=args.layers,
        init_layers=args.init_layers, head_vocab=args.head_vocab, loss=args.loss, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, max_prompts=args.max_prompts,
        max_prompts_per_task=args.max_prompts_per_task, skip_prompts_per_task=args.skip_prompts_per_task,
        holdout_per_task=args.holdout_per_task, topk=args.topk, gen_batch_size=args.gen_batch_size,
        train=TrainConfig(loss=args.loss, steps=args.steps, lr=args.lr, batch_tokens=args.batch_tokens,
                          max_context=args.max_context, warmup_steps=args.warmup_steps, seed=args.seed, threads=args.threads,
                          max_seconds=args.max_train_seconds),
        backend=args.backend, num_workers=args.num_workers, use_gpu=args.use_gpu, cpus_per_worker=args.cpus_per_worker,
        device=args.device, teacher_dtype=args.teacher_dtype, save_dtype=args.save_dtype, data_cache=args.data_cache, data_only=args.data_only,
        shard=tuple(int(x) for x in args.shard.split("/")), evaluate=args.evaluate, eval_k=args.eval_k, eval_batch_sizes=tuple(args.eval_batch_sizes),
        eval_max_new_tokens=args.eval_max_new_tokens, chat_template=not args.no_chat_template, seed=args.seed,
        kind=args.kind, temperatures=tuple(args.temperatures), code_prompts=args.code_prompts, code_windows=tuple(args.code_windows),
        holdout_tasks=tuple(args.holdout_tasks),
        eagle={"ttt_steps": args.ttt_steps, "feature_weight": args.feature_weight, "prompt_weight": args.prompt_weight,
               "autocast": args.autocast},
    )


def run(args) -> int:
    import sys

    if args.data_only and not args.data_cache:
        print("raysd distill: --data-only needs --data-cache", file=sys.stderr)
        return 2
    if not args.prompts and not args.code_prompts and not (args.data_cache and all(os.path.isfile(p) for p in args.data_cache.split(","))):
        print("raysd distill: give --prompts or --code-prompts (or an existing --data-cache)", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"raysd distill: {exc}", file=sys.stderr)
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if cfg.backend == "ray" and not cfg.data_only:
        import ray

        from raysd.actors.local import start_local_ray

        address = args.ray_address or os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            ray.init(address=address) if address not in (None, "local") else start_local_ray()
    from raysd.distill.api import distill

    result = distill(cfg)
    if args.report and result.evaluation is not None:
        with open(args.report, "w") as f:
            json.dump(result.evaluation, f, indent=2)
    return 0
