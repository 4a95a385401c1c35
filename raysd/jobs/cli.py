"""`raysd generate`: completions for a prompt dataset, Parquet out (see docs/jobs.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from raysd.actors.liveness import PLACEMENT_TIMEOUT_S
from raysd.jobs.config import (
    DEFAULT_DRAFT,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TARGET,
    PLACEMENT_STRATEGIES,
    REPLICA_SHAPES,
    GenerateConfig,
    JobError,
    one_line,
)


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
    io.add_argument("--overwrite", action="store_true",
                    help="start over: first delete what raysd wrote in the output (its part-*.parquet files, _job.json, "
                         "_summary.json and _tmp/; nothing else, and only in a directory holding its _job.json) "
                         "(default: resume into it)")

    m = p.add_argument_group("models")
    m.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: HF id or local path (default: {DEFAULT_TARGET})")
    m.add_argument("--target-dtype", default="auto", help="auto, float32, bfloat16 or float16; auto: bfloat16 where the "
                   "model's actor has a GPU (float16 if it lacks bf16), float32 on a CPU; each row records the dtype run (default: auto)")
    m.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (HF id or path), 'ngram' (prompt lookup), 'suffix' "
                   "(suffix decoding over the row and every row the replica has finished: learns the job's templates), "
                   f"or 'none' (plain autoregressive) (default: {DEFAULT_DRAFT})")
    m.add_argument("--draft-dtype", default="auto", help="as --target-dtype, for a draft model (default: auto)")
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
                        "levels; docs/draft_assist.md); needs a draft model (default: none)")
    m.add_argument("--trust-remote-code", action="store_true", help="allow a model repository's own code")
    m.add_argument("--allow-pickle-weights", action="store_true",
                   help="load pickled weights (pytorch_model.bin, .pt) when a model has no safetensors; unpickling runs "
                   "code from the file, so only for files you trust (default: refuse them)")

    s = p.add_argument_group("sampling (per-row columns max_new_tokens, temperature, top_p, top_k, seed, stop, "
                             "num_samples override these)")
    s.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help=f"(default: {DEFAULT_MAX_NEW_TOKENS})")
    s.add_argument("--max-model-len", type=int, default=None, metavar="L",
                   help="the most tokens a row holds, prompt and generated together (as vLLM's): a longer prompt is an "
                        "error row, a row that reaches it ends with finish_reason length (default: the models' context)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0, off)")
    s.add_argument("--top-k", type=int, default=0, help="(default: 0, off)")
    s.add_argument("--seed", type=int, default=0, help="job seed; a row's seed is a stable hash of it and the row's id (default: 0)")
    s.add_argument("--num-samples", "-n", type=int, default=1,
                   help="N independent completions per prompt: N output rows with the prompt's id and sample_index "
                        "0..N-1, each with its own seed (from the job seed, the id and the sample index); the prompt is "
                        "prefilled once for samples admitted together (default: 1)")
    s.add_argument("--beam-width", type=int, default=0, metavar="W",
                   help="W >= 2: beam search, token for token the target's own (Hugging Face generate(num_beams=W, "
                        "do_sample=False)), each target pass advancing as many levels as the drafter's tree lets it "
                        "(a draft model's own beam search, K levels deep; ngram or suffix lookups); greedy settings "
                        "only; docs/beam_search.md (default: 0, off)")
    s.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                   help="with --beam-width: the N <= W best hypotheses, N rows with sample_index 0..N-1 and beam_score "
                        "(default: 1)")
    s.add_argument("--length-penalty", type=float, default=1.0,
                   help="with --beam-width: a finished hypothesis scores its log-probability / length ** this (default: 1.0)")
    s.add_argument("--early-stopping", default="false", choices=("true", "false", "never"),
                   help="with --beam-width, as Hugging Face's: true stops once W hypotheses finished, false when the "
                        "best running beam cannot beat them at its current length, never at the longest (default: false)")
    s.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="stop string, repeatable: a row ends at the first occurrence in its decoded text (finish_reason "
                        "stop), the text cut before it; no token after it is generated (default: none)")
    s.add_argument("--include-stop-str-in-output", action="store_true", help="keep the stop string in generated_text")
    s.add_argument("--logprobs", action="store_true",
                   help="add generated_logprobs: the target's log-probability of each generated token, from the verify pass")
    s.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="add top_logprobs: the N (<= 20) most likely tokens' ids and log-probabilities at each generated "
                        "token; implies --logprobs (default: 0)")
    s.add_argument("--logprobs-mode", default="raw", choices=("raw", "processed"),
                   help="raw: log-softmax of the target's logits (vLLM's default); processed: of the distribution sampled, "
                        "after temperature, top-k and top-p (default: raw)")

    r = p.add_argument_group("Ray")
    r.add_argument("--batch-size", type=int, default=16, help="rows per Ray Data block and per call on a replica (default: 16)")
    r.add_argument("--replicas", type=int, default=1, help="draft/target actor pairs running in parallel: the generation stage's actor pool (default: 1)")
    r.add_argument("--target-tensor-parallel", type=int, default=1, metavar="N",
                   help="split the target over N rank actors, each with 1/N of its weights and KV cache and "
                        "--num-gpus-per-actor (Megatron-style; llama, qwen2, mistral; docs/tensor_parallel.md) (default: 1)")
    r.add_argument("--num-gpus-per-actor", type=float, default=0.0, help="GPUs for each model actor; 0.5 shares one GPU per pair (default: 0)")
    r.add_argument("--cuda-graphs", action="store_true",
                   help="replay the model actors' decode, verify and drafting forwards as CUDA graphs captured per "
                        "shape (GPUs, Llama-family models; greedy output unchanged) (default: off)")
    r.add_argument("--compile", action="store_true",
                   help="with --cuda-graphs: those forwards through torch.compile, the graphs capturing its fused "
                        "kernels (faster steps; a few compiles per model at the start) (default: off)")
    r.add_argument("--num-cpus-per-actor", type=_cpus_value, default=None,
                   help="CPUs (torch threads) for each model actor, or auto: on a local Ray without GPUs the machine's "
                        "cores, shared by the replicas' target and draft models (all to the target with ngram or none); "
                        "1 on a cluster (default: auto)")
    r.add_argument("--placement-strategy", default="STRICT_PACK", choices=PLACEMENT_STRATEGIES,
                   help="where a replica's draft and target actors go: STRICT_PACK (one node, the default), PACK, "
                        "SPREAD or STRICT_SPREAD (over nodes)")
    r.add_argument("--replica-shape", default="auto", choices=REPLICA_SHAPES,
                   help="where a replica's draft model runs: auto (in the target's actor when they share a device, "
                        "in an actor of its own when each has a GPU or the target is tensor-parallel), colocated or split "
                        "(default: auto)")
    r.add_argument("--placement-timeout", dest="placement_timeout_s", type=float, default=PLACEMENT_TIMEOUT_S,
                   metavar="SECONDS", help="a replica whose model actors cannot be placed in this time retires and "
                   f"its rows go to the others (default: {PLACEMENT_TIMEOUT_S:g})")
    r.add_argument("--step-timeout", dest="step_timeout_s", type=float, default=None, metavar="SECONDS",
                   help="fail the job if one call to the model actors takes longer (default: none; a step is waited "
                        "for as long as its actors are alive)")
    r.add_argument("--address", default=None, help="existing Ray cluster (default: the submitted job's cluster, else a local Ray on localhost)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--quiet", "-q", action="store_true", help="print only the summary line")
    out.add_argument("--verbose", "-v", action="store_true",
                     help="also Ray's messages, the workers' output and Ray Data's own progress (its operator table)")
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
    native_log = None
    try:
        cfg = config_from_args(args)
        from raysd.jobs.runner import generate, process_start_time

        with _native_stderr_to_file(not cfg.verbose) as native_log:
            summary = generate(cfg, started_at=process_start_time())  # interpreter start and imports count too
    except JobError as exc:
        print(f"raysd generate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed job is one line; rows written so far are kept
        log = _write_trace(exc, native_log)
        print(f"raysd generate: failed: {failure_line(exc)} (rows written so far are kept; re-run to resume; "
              f"the full trace and Ray's messages: {log})", file=sys.stderr)
        return 1
    if native_log and os.path.exists(native_log):  # a job that ran: the lines are in Ray's own driver log too
        os.remove(native_log)
    print(json.dumps(summary.to_dict()) if args.json else summary.text())
    return 0


@contextlib.contextmanager
def _native_stderr_to_file(enabled: bool):
    """Ray's C++ core worker in this process writes its ERROR lines to file descriptor 2 directly,
    past Python's logging and log_to_driver: e.g. ray-project/ray#53727's warning, once per job,
    for Ray Data's actor pools (docs/jobs.md, "Ray 2.60's deprecations and warnings"). Ray writes
    them to its driver log as well (python-core-driver-*.log in the session's logs). So unless
    --verbose, descriptor 2 goes to a file while the job runs, and raysd's own lines go to the
    real stderr through `sys.stderr`. Yields the file's path (kept, and named, if the job fails;
    None when not enabled)."""
    if not enabled:
        yield None
        return
    sys.stderr.flush()
    fd, path = tempfile.mkstemp(prefix="raysd-ray-stderr-", suffix=".log")
    saved = os.dup(2)
    real = os.fdopen(os.dup(saved), "w", buffering=1, encoding=sys.stderr.encoding or "utf-8", errors="backslashreplace")
    previous = sys.stderr
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = real
    try:
        yield path
    finally:
        real.flush()
        sys.stderr = previous
        os.dup2(saved, 2)
        os.close(saved)
        real.close()
        if os.path.getsize(path) == 0:
            os.remove(path)


def _write_trace(exc: BaseException, native_log: str | None) -> str:
    """The failure's whole trace (every cause, the remote ones included), appended to the file that
    holds Ray's own messages of this run (a new file when there is none); returns its path."""
    import traceback

    if native_log is None or not os.path.exists(native_log):
        fd, native_log = tempfile.mkstemp(prefix="raysd-failure-", suffix=".log")
        os.close(fd)
    with open(native_log, "a", encoding="utf-8", errors="backslashreplace") as f:
        f.write("\nraysd generate failed:\n" + "".join(traceback.format_exception(exc)))
    return native_log


def failure_line(exc: BaseException) -> str:
    """A failed job in one line: its innermost cause (a RayTaskError carries the exception raised in
    the actor as `cause`), whose type and first line say what failed there (`one_line`)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)  # RayTaskError: the exception raised in the actor
        if not isinstance(cause, BaseException):
            cause = exc.__cause__
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return one_line(exc)
