"""`raysd generate`: completions for a prompt dataset, Parquet out (see docs/jobs.md)."""

from __future__ import annotations

import argparse
import json
import sys

from raysd.jobs.config import (DEFAULT_DRAFT, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TARGET, PLACEMENT_STRATEGIES, GenerateConfig,
                               JobError)


def add_arguments(p: argparse.ArgumentParser) -> None:
    io = p.add_argument_group("data")
    io.add_argument("--input", required=True, help="Parquet or JSON Lines file, directory or glob; any fsspec URL "
                    "(s3://, gs://, file://; memory:// for tests and small data); or a `datasets` dataset (save_to_disk directory, or a name in the local cache)")
    io.add_argument("--output", required=True, help="output directory of Parquet files (local path or fsspec URL)")
    io.add_argument("--prompt-column", default="prompt", help="string, chat messages [{role, content}], or token ids (default: prompt)")
    io.add_argument("--id-column", default="id", help="unique row id; made from the row order when absent (default: id)")
    io.add_argument("--split", default=None, help="split of a `datasets` DatasetDict (default: its only split, or train)")
    io.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                    help="tokenize string prompts as they are instead of through the chat template")
    io.add_argument("--rows-per-file", type=int, default=1024, help="rows per output Parquet file: at least this many, in whole batches, except the last; "
                    "also the most finished work a killed job can lose (default: 1024)")
    io.add_argument("--overwrite", action="store_true", help="delete the output first (default: resume into it)")

    m = p.add_argument_group("models")
    m.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: HF id or local path (default: {DEFAULT_TARGET})")
    m.add_argument("--target-dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    m.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (HF id or path), 'ngram' (prompt lookup), or 'none' "
                   f"(plain autoregressive) (default: {DEFAULT_DRAFT})")
    m.add_argument("--draft-dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    m.add_argument("--num-speculative-tokens", "-k", type=_k_value, default=None,
                   help="draft tokens per step, or 'auto': K in 0..8 chosen each step from the rows' acceptance "
                        "and step costs profiled at start-up (cached per models and machine); steps with K = 0 "
                        "skip the drafter; with --tree-budget, the tree's depth limit (default: auto)")
    m.add_argument("--acceptance", default="exact",
                   help="'exact' (outputs follow the target's distribution), or 'relaxed:LAMBDA' with LAMBDA in [0, 1]: "
                        "verify against (1 - LAMBDA) target + LAMBDA draft, LOSSY (total variation LAMBDA x TV(target, "
                        "draft) per drafted token; Yin et al. 2024); each row records its rule (default: exact)")
    m.add_argument("--tree-budget", type=int, default=0,
                   help="P > 0: each step drafts a tree of at most P nodes per row, at most K deep, verified in one "
                        "target pass, exactly (a draft model on the static runner, or ngram's several matches; Llama-family "
                        "target; docs/trees.md); with -k auto, the largest tree weighed: each step drafts the chain or "
                        "tree (budgets 2, 4, .. up to P, cut at any depth) of best expected goodput from the measured "
                        "acceptance by rank and step costs; 0: a chain of K drafts (default: 0)")
    m.add_argument("--draft-assist", default="none", choices=("none", "ngram"),
                   help="'ngram': n-gram prompt lookup drafts for the draft model, which verifies exactly, so the "
                        "target still sees the draft model's law (three levels; inner K chosen by goodput, 0 = two "
                        "levels; docs/hierarchy.md); needs a draft model (default: none)")
    m.add_argument("--trust-remote-code", action="store_true", help="allow a model repository's own code")
    m.add_argument("--allow-pickle-weights", action="store_true",
                   help="load pickled weights (pytorch_model.bin, .pt) when a model has no safetensors; unpickling runs "
                   "code from the file, so only for files you trust (default: refuse them)")

    s = p.add_argument_group("sampling (per-row columns max_new_tokens, temperature, seed override these)")
    s.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help=f"(default: {DEFAULT_MAX_NEW_TOKENS})")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0, off)")
    s.add_argument("--top-k", type=int, default=0, help="(default: 0, off)")
    s.add_argument("--seed", type=int, default=0, help="job seed; a row's seed is a stable hash of it and the row's id (default: 0)")

    r = p.add_argument_group("Ray")
    r.add_argument("--batch-size", type=int, default=16, help="rows per Ray Data block and per call on a replica (default: 16)")
    r.add_argument("--replicas", type=int, default=1, help="draft/target actor pairs running in parallel: the generation stage's actor pool (default: 1)")
    r.add_argument("--num-gpus-per-actor", type=float, default=0.0, help="GPUs for each model actor; 0.5 shares one GPU per pair (default: 0)")
    r.add_argument("--num-cpus-per-actor", type=_cpus_value, default=None,
                   help="CPUs (torch threads) for each model actor, or auto: on a local Ray without GPUs the machine's "
                        "cores, shared by the replicas' target and draft models (all to the target with ngram or none); "
                        "1 on a cluster (default: auto)")
    r.add_argument("--placement-strategy", default="STRICT_PACK", choices=PLACEMENT_STRATEGIES,
                   help="where a replica's draft and target actors go: STRICT_PACK (one node, the default), PACK, "
                        "SPREAD or STRICT_SPREAD (over nodes)")
    r.add_argument("--address", default=None, help="existing Ray cluster (default: the submitted job's cluster, else a local Ray on localhost)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar; print only the summary line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _cpus_value(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of CPUs or 'auto', got {text!r}") from None


def _k_value(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> GenerateConfig:
    fields = GenerateConfig.__dataclass_fields__
    return GenerateConfig(**{k: v for k, v in vars(args).items() if k in fields})


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        from raysd.jobs.runner import generate

        summary = generate(cfg)
    except JobError as exc:
        print(f"raysd generate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed job is one line; rows written so far are kept
        print(f"raysd generate: failed: {_one_line(exc)} (rows written so far are kept; re-run to resume)", file=sys.stderr)
        return 1
    print(json.dumps(summary.to_dict()) if args.json else summary.text())
    return 0


def _one_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # RayTaskError: the exception raised in the actor
    if isinstance(cause, BaseException):
        exc = cause
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
