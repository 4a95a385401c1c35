"""One replica of a generation job: a SpecCoordinator (draft + target actors) plus the
row handling around it: prompts to token ids, per-row sampling parameters, results to
output columns, live metrics.

`GenerationReplica` is plain Python; the job's Ray Data generation stage owns one per
actor of its pool (those actors need no CPU of their own: the model actors hold the
resources, in the coordinator's placement group).
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
import time
from typing import Any

from raysd.core.sampling import SamplingParams
from raysd.core.stats import SpecDecodeStats
from raysd.jobs.config import GenerateConfig

_MAX_SEED = 2**63 - 1


def row_seed(job_seed: int, row_id: Any) -> int:
    """A row's seed from the job's seed and the row's id: a stable hash, so it does not
    depend on the batching, the replica, or the Python process."""
    key = f"{job_seed}\x1f{type(row_id).__name__}\x1f{row_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") & _MAX_SEED


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_token_ids(prompt, tokenizer, chat_template: bool) -> tuple[list[int] | None, str | None]:
    """(token ids, None) or (None, why not). Never raises: a prompt the tokenizer rejects is an error row."""
    try:
        return _prompt_token_ids(prompt, tokenizer, chat_template)
    except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate ("\ud800" in JSON) the tokenizer cannot encode
        text = str(exc).strip().splitlines()
        return None, f"prompt cannot be tokenized: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _prompt_token_ids(prompt, tokenizer, chat_template: bool) -> tuple[list[int] | None, str | None]:
    if prompt is None:
        return None, "prompt is null"
    if isinstance(prompt, str):
        if not prompt.strip():
            return None, "empty prompt"
        if tokenizer is None:
            return None, "the target model has no tokenizer; give prompts as token ids"
        if chat_template and getattr(tokenizer, "chat_template", None):
            return _chat(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer(prompt).input_ids), None
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return None, "empty prompt"
        if all(_is_int(t) for t in prompt):
            return [int(t) for t in prompt], None
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt):
            if tokenizer is None:
                return None, "the target model has no tokenizer; give prompts as token ids"
            if not getattr(tokenizer, "chat_template", None):
                return None, "chat messages given but the tokenizer has no chat template"
            return _chat(tokenizer, [{"role": m["role"], "content": m["content"]} for m in prompt])
        return None, "a list prompt must be token ids (ints) or chat messages ({role, content} strings)"
    return None, f"prompt must be a string, chat messages or token ids, got {type(prompt).__name__}"


def _chat(tokenizer, messages) -> tuple[list[int] | None, str | None]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the messages fails this row only
        return None, f"chat template failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return list(tokenizer(text, add_special_tokens=False).input_ids), None


def row_params(row: dict, cfg: GenerateConfig) -> tuple[SamplingParams | None, int, str | None]:
    """(params, seed, None) or (None, seed, why not): the job's values with the row's overrides."""
    seed = row.get("seed")
    if seed is None:
        seed = row_seed(cfg.seed, row["id"])
    elif not _is_int(seed) or not 0 <= seed <= _MAX_SEED:
        return None, 0, f"seed must be an integer in [0, 2**63), got {seed!r}"
    max_new = row.get("max_new_tokens")
    max_new = cfg.max_new_tokens if max_new is None else max_new
    temperature = row.get("temperature")
    temperature = cfg.temperature if temperature is None else temperature
    if not _is_int(max_new):
        return None, seed, f"max_new_tokens must be an integer, got {max_new!r}"
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        return None, seed, f"temperature must be a number, got {temperature!r}"
    try:
        params = SamplingParams(temperature=float(temperature), top_k=cfg.top_k, top_p=cfg.top_p, seed=seed, max_new_tokens=max_new)
    except ValueError as exc:
        return None, seed, str(exc)
    return params, seed, None


def _eos_ids(name: str, tokenizer, trust_remote_code: bool) -> tuple[int, ...]:
    """The target's EOS ids: generation config, else model config, else tokenizer."""
    from transformers import AutoConfig, GenerationConfig

    from raysd.models.loading import _source

    source, extra = _source(name)

    def as_tuple(eos):
        if eos is None:
            return None
        return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    try:
        found = as_tuple(GenerationConfig.from_pretrained(source, **extra).eos_token_id)
        if found:
            return found
    except (OSError, ValueError):
        pass
    if not extra:  # GGUF configs are slow to read; their tokenizer knows the EOS
        try:
            found = as_tuple(AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code).eos_token_id)
            if found:
                return found
        except (OSError, ValueError):
            pass
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (int(tokenizer.eos_token_id),)
    return ()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _local_dir_without_tokenizer(name: str) -> bool:
    import os

    path = os.path.expanduser(name)
    return os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)


class _Metrics:
    """Live counters through ray.util.metrics (Prometheus, prefix `ray_`)."""

    def __init__(self, cfg: GenerateConfig, replica: int | str):
        from ray.util.metrics import Counter

        tags = {"replica": str(replica), "target_model": cfg.target, "draft_model": cfg.draft}
        keys = tuple(tags)

        def counter(name, description, extra=()):
            c = Counter(name, description, tag_keys=keys + extra)
            c.set_default_tags(tags)
            return c

        self.drafted = counter("raysd_draft_tokens", "draft tokens proposed and verified")
        self.accepted = counter("raysd_accepted_draft_tokens", "draft tokens accepted")
        self.generated = counter("raysd_generated_tokens", "tokens generated")
        self.rows_done = counter("raysd_rows_done", "rows finished (stop or length)")
        self.rows_failed = counter("raysd_rows_failed", "rows that became error rows")
        self.per_position = counter("raysd_accepted_draft_tokens_per_position", "accepts at each draft position", ("position",))

    def observe(self, out: dict) -> None:
        if out["finish_reason"] == "error":
            self.rows_failed.inc()
            return
        self.rows_done.inc()
        for metric, key in ((self.drafted, "num_draft_tokens"), (self.accepted, "num_accepted_draft_tokens"), (self.generated, "num_generated_tokens")):
            if out[key]:
                metric.inc(out[key])
        for position, n in enumerate(out["accepted_per_position"]):
            if n:
                self.per_position.inc(n, tags={"position": str(position)})


def error_output(cfg: GenerateConfig, row_id: Any, message: str) -> dict:
    """The output columns of a row that cannot be generated under its id (null or duplicate)."""
    k = cfg.effective_num_speculative_tokens
    return {
        "generated_text": None, "generated_token_ids": [], "num_prompt_tokens": 0, "num_generated_tokens": 0,
        "finish_reason": "error", "error": message, **SpecDecodeStats(k).to_dict(),
        "target_model": cfg.target, "draft_model": cfg.draft, "num_speculative_tokens": k,
        "acceptance": cfg.acceptance, "tree_budget": cfg.tree_budget, "seed": row_seed(cfg.seed, row_id), "latency_s": 0.0,
    }


class GenerationReplica:
    """Owns one SpecCoordinator (its draft and target actors) for the life of the job.

    Ray Data runs one per actor of the generation stage (`raysd.jobs.pipeline.GenerateReplica`).
    """

    def __init__(self, cfg: GenerateConfig, replica: int | str = 0, max_pending: int | None = None):
        from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator
        from raysd.models.loading import ModelSpec, draft_kind, load_eagle_for, load_model, load_tokenizer

        started = time.perf_counter()
        self.cfg = cfg
        self.K = cfg.effective_num_speculative_tokens
        tokenizer_box: dict = {}

        def load_tok():  # overlaps the model actors' loading
            try:
                if _local_dir_without_tokenizer(cfg.target):
                    tokenizer_box["tok"] = None  # skip transformers' slow search
                else:
                    tokenizer_box["tok"] = load_tokenizer(cfg.target, cfg.trust_remote_code)
            except Exception as exc:  # noqa: BLE001
                tokenizer_box["error"] = exc

        thread = threading.Thread(target=load_tok, daemon=True)
        thread.start()
        gpus = cfg.num_gpus_per_actor
        target_cpus, draft_cpus = cfg.actor_cpus
        target_spec = ModelSpec(cfg.target, cfg.target_dtype, trust_remote_code=cfg.trust_remote_code,
                                allow_pickle_weights=cfg.allow_pickle_weights)
        if cfg.draft_is_model:
            draft_spec = ModelSpec(cfg.draft, cfg.draft_dtype, trust_remote_code=cfg.trust_remote_code,
                                    allow_pickle_weights=cfg.allow_pickle_weights)
            if draft_kind(cfg.draft) == "eagle":  # reads the target's features: built on the job's target
                drafter = DrafterSpec(functools.partial(load_eagle_for, cfg.draft, target_spec, cfg.draft_dtype))
            else:
                drafter = DrafterSpec(functools.partial(load_model, draft_spec), inner=cfg.draft_assist)
            draft_res = ActorResources(num_cpus=draft_cpus, num_gpus=gpus)
        else:  # n-gram lookup or no drafting: no model, no GPU
            drafter = DrafterSpec(None)
            draft_res = ActorResources(num_cpus=draft_cpus, num_gpus=0)
        ccfg = CoordinatorConfig(
            num_speculative_tokens=self.K,
            # One micro-batch until the step costs say two pay (below): a model-free drafter has
            # nothing to overlap, and halving the batch would only slow the target.
            micro_batch_size=cfg.batch_size,
            num_micro_batches=1,
            draft_resources=draft_res,
            target_resources=ActorResources(num_cpus=target_cpus, num_gpus=gpus),
            placement_strategy=cfg.placement_strategy,
            measure_bytes=False,
            acceptance=cfg.acceptance,
            tree_budget=cfg.tree_budget,
        )
        self.coordinator = SpecCoordinator(functools.partial(load_model, target_spec), drafter, ccfg)
        thread.join()
        if "error" in tokenizer_box:
            raise tokenizer_box["error"]
        self.tokenizer = tokenizer_box.get("tok")
        eos = _eos_ids(cfg.target, self.tokenizer, cfg.trust_remote_code)
        # The EOS ids are known only now (the tokenizer loaded beside the models); rows read them at admission.
        import dataclasses

        adaptive, micro = None, 1
        if cfg.draft_is_model or cfg.adaptive_speculation:
            from raysd.engine.adaptive import AdaptiveConfig, choose_k, num_micro_batches
            from raysd.jobs.profiles import cached_step_costs

            # Step costs measured in the actors at the batch sizes this replica may run (cached per
            # models and machine): they choose one or two micro-batches, and K under `-k auto`.
            half = max(1, math.ceil(cfg.batch_size / 2))
            # Without a draft model the batch is never split: no need to time half of it.
            sizes = sorted({1, half, cfg.batch_size} if cfg.draft_is_model else {1, cfg.batch_size})
            k_max = max(self.K, cfg.tree_budget)  # a tree of P nodes is weighed by T_target(B, P + 1)
            c = self.coordinator
            key = {"target": cfg.target, "target_dtype": cfg.target_dtype, "draft": cfg.draft, "draft_dtype": cfg.draft_dtype,
                   "devices": [c.target_info.device, c.draft_info.device], "cpus": list(cfg.actor_cpus), "k_max": k_max,
                   "batch_sizes": sizes, "context": 64, "reps": 2}
            costs, _ = cached_step_costs(key, lambda: c.profile_step_costs(k_max, sizes, context=64, reps=2))
            serial = AdaptiveConfig(costs)
            # Under `-k auto`, split or not for the K a batch of rows at the prior acceptance would get.
            k = choose_k([serial.prior_alpha] * cfg.batch_size, [self.K] * cfg.batch_size, serial) if cfg.adaptive_speculation else self.K
            micro = num_micro_batches(costs, cfg.batch_size, k) if cfg.draft_is_model else 1
            if cfg.adaptive_speculation:
                adaptive = AdaptiveConfig(costs, overlapped=micro > 1)
        self.coordinator.config = ccfg = dataclasses.replace(
            self.coordinator.config, micro_batch_size=math.ceil(cfg.batch_size / micro), num_micro_batches=micro,
            eos_token_ids=eos, adaptive=adaptive)
        self.metrics = _Metrics(cfg, replica)
        # One loop for the replica's life, fed by every concurrent `generate` call: rows of the next
        # block take slots as soon as rows of the last one free them. Bounded: by default three
        # batches' rows queued or running (the Ray Data stage keeps about that many blocks inside).
        self.slots = ccfg.micro_batch_size * ccfg.num_micro_batches
        self.stream = self.coordinator.stream(max_pending or 3 * self.slots)
        self._reported: dict = {}
        self._start_s = time.perf_counter() - started  # actors, models, tokenizer, step costs: in the next report
        self._report_lock = threading.Lock()
        # Concurrent calls share the tokenizer: a fast tokenizer's Rust object refuses concurrent
        # use when a call changes its truncation/padding ("Already borrowed"), so one at a time.
        self._tokenizer_lock = threading.Lock()

    def ready(self) -> dict:
        return {"vocab_size": self.coordinator.vocab_size, "has_tokenizer": self.tokenizer is not None,
                "eos_token_ids": list(self.coordinator.config.eos_token_ids)}

    def shutdown(self) -> None:
        try:
            self.stream.close(timeout=5)
        finally:
            self.coordinator.shutdown()

    def generate(self, rows: list[dict]) -> tuple[list[dict], dict]:
        """Output columns (schema.GENERATED_FIELDS) for each row, in order, and the call's report.

        A row holds `id`, `prompt` and optionally `max_new_tokens`, `temperature`, `seed`.
        Thread-safe: concurrent calls feed the same stream, so their rows share the micro-batches.
        The report: this call's tokenise and detokenise seconds, and the stream's totals since the
        last report of any call (busy times, steps, occupancy sums, queue wait), so that summing
        the reports of every call counts each second once.
        """
        from raysd.engine.rows import Request

        cfg = self.cfg
        outputs: list[dict | None] = [None] * len(rows)
        futures, index, seeds = [], [], {}
        t0 = time.perf_counter()
        tokenize_s = 0.0
        for i, row in enumerate(rows):
            params, seed, error = row_params(row, cfg)
            seeds[i] = seed
            ids = None
            if error is None:
                t = time.perf_counter()
                with self._tokenizer_lock:
                    ids, error = prompt_token_ids(row.get("prompt"), self.tokenizer, cfg.chat_template)
                tokenize_s += time.perf_counter() - t
            if error is not None:
                outputs[i] = self._row(ids or [], [], "error", SpecDecodeStats(self.K), error, seed, 0.0)
                continue
            futures.append(self.stream.submit(Request(i, ids, params)))  # blocks while the stream is full
            index.append(i)
        submit_s = time.perf_counter() - t0
        detokenize_s = 0.0
        for i, future in zip(index, futures):
            done = future.result()  # raises if the loop failed
            res = done.result
            t = time.perf_counter()
            outputs[i] = self._row(res.prompt_token_ids, res.token_ids, res.finish_reason, res.stats, res.error,
                                   seeds[i], done.latency_s)
            detokenize_s += time.perf_counter() - t
        for out in outputs:
            self.metrics.observe(out)
        report = {"tokenize_s": tokenize_s, "detokenize_s": detokenize_s, "submit_s": submit_s, **self._stream_delta()}
        return outputs, report

    def _stream_delta(self) -> dict:
        """The stream's totals since the last call took them."""
        with self._report_lock:
            now = self.stream.totals()
            delta = {k: now[k] - self._reported.get(k, 0) for k in
                     ("draft_busy_s", "target_busy_s", "steps", "draft_steps", "active_rows", "queue_wait_s", "idle_s", "recoveries", "wall_s")}
            self._reported = now
            delta["start_s"], self._start_s = self._start_s, 0.0
        delta["wall_s"] -= delta["idle_s"]  # the loop's working time: the overlap's denominator
        delta["slots"] = now["slots"]
        return delta

    def _row(self, prompt_ids, tokens, finish_reason, stats: SpecDecodeStats, error, seed, latency) -> dict:
        text = None
        if self.tokenizer is not None and finish_reason != "error":
            with self._tokenizer_lock:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return {
            "generated_text": text,
            "generated_token_ids": list(tokens),
            "num_prompt_tokens": len(prompt_ids),
            "num_generated_tokens": len(tokens),
            "finish_reason": finish_reason,
            "error": error,
            **stats.to_dict(),
            "target_model": self.cfg.target,
            "draft_model": self.cfg.draft,
            "num_speculative_tokens": self.K,
            "acceptance": self.cfg.acceptance,
            "tree_budget": self.cfg.tree_budget,
            "seed": seed,
            "latency_s": latency if finish_reason != "error" else 0.0,
        }
