"""One replica of a generation job: a SpecCoordinator (draft + target actors) plus the
row handling around it: prompts to token ids, per-row sampling parameters, results to
output columns, live metrics.

`GenerationReplica` is plain Python; the job's Ray Data generation stage owns one per
actor of its pool (those actors need no CPU of their own: the model actors hold the
resources, in the coordinator's placement group).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import threading
import time
from typing import TYPE_CHECKING, Any

from raysd.core.stats import SpecDecodeStats
from raysd.engine.verdict import LoopStats
from raysd.jobs.config import EARLY_STOPPING_CHOICES, GenerateConfig, one_line
from raysd.jobs.metrics import ReplicaMetrics
from raysd.jobs.schema import is_int, num_samples_of
from raysd.models.names import NGRAM, NO_DRAFT, SUFFIX

if TYPE_CHECKING:  # a replica's process imports no torch (tests/jobs/test_light_imports.py)
    from raysd.actors.launch import ModelActors
    from raysd.core.params import SamplingParams

_MAX_SEED = 2**63 - 1


def row_seed(job_seed: int, row_id: Any) -> int:
    """A row's seed from the job's seed and the row's id: a stable hash, so it does not
    depend on the batching, the replica, or the Python process."""
    key = f"{job_seed}\x1f{type(row_id).__name__}\x1f{row_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") & _MAX_SEED


def sample_seed(row_seed_: int, sample_index: int) -> int:
    """Sample `sample_index`'s seed from its row's seed (`row_seed`, or the row's `seed` column):
    the row's own for sample 0, so a job without samples keeps its seeds; a stable hash of the
    two for the others. So each sample's seed is a function of (job seed, id, sample index)."""
    if sample_index == 0:
        return row_seed_
    key = f"{row_seed_}\x1fsample\x1f{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") & _MAX_SEED


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def prompt_token_ids(prompt, tokenizer, chat_template: bool) -> tuple[list[int] | None, str | None]:
    """(token ids, None) or (None, why not). Never raises: a prompt the tokenizer rejects is an error row."""
    try:
        return _prompt_token_ids(prompt, tokenizer, chat_template)
    except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate ("\ud800" in JSON) the tokenizer cannot encode
        return None, f"prompt cannot be tokenized: {one_line(exc)}"


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
        if all(is_int(t) for t in prompt):
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


def _row_stop(value, default: tuple[str, ...]) -> tuple[tuple[str, ...] | None, str | None]:
    """A row's `stop` value as stop strings: null keeps the job's; a string is one; a list of
    non-empty strings replaces the job's ([] : none for this row)."""
    if value is None:
        return default, None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) and x for x in value):
        return None, f"stop must be a list of non-empty strings, got {value!r}"
    return tuple(value), None


def row_params(row: dict, cfg: GenerateConfig) -> tuple[SamplingParams | None, int, str | None]:
    """(params, seed, None) or (None, seed, why not): the job's values with the row's overrides
    (OVERRIDE_COLUMNS), for the row's sample 0 (`sample_seed` gives the others' seeds)."""
    from raysd.core.params import SamplingParams

    seed = row.get("seed")
    if seed is None:
        seed = row_seed(cfg.seed, row["id"])
    elif not is_int(seed) or not 0 <= seed <= _MAX_SEED:
        return None, 0, f"seed must be an integer in [0, 2**63), got {seed!r}"

    def value(name):
        v = row.get(name)
        return getattr(cfg, name) if v is None else v

    max_new, temperature, top_p, top_k = value("max_new_tokens"), value("temperature"), value("top_p"), value("top_k")
    for name, v, ok, kind in (("max_new_tokens", max_new, is_int, "an integer"), ("temperature", temperature, _is_number, "a number"),
                              ("top_p", top_p, _is_number, "a number"), ("top_k", top_k, is_int, "an integer")):
        if not ok(v):
            return None, seed, f"{name} must be {kind}, got {v!r}"
    stop, error = _row_stop(row.get("stop"), cfg.stop)
    if error is not None:
        return None, seed, error
    try:
        params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p), seed=seed, max_new_tokens=max_new,
                                stop=stop, include_stop_str_in_output=cfg.include_stop_str_in_output, logprobs=cfg.logprobs,
                                top_logprobs=cfg.top_logprobs, logprobs_mode=cfg.logprobs_mode)
    except ValueError as exc:
        return None, seed, str(exc)
    return params, seed, None


def with_eos_ids(cfg: GenerateConfig) -> GenerateConfig:
    """`cfg` with the target's EOS ids, read from its files before any actor starts: its generation
    config's, else its model config's (what its loaded model says: raysd.models.loading.
    config_eos_token_ids), else its tokenizer's. Rows end at them in every replica."""
    if cfg.eos_token_ids is not None:
        return cfg
    from raysd.models.loading import config_eos_token_ids, load_tokenizer

    eos = config_eos_token_ids(cfg.target, cfg.trust_remote_code)
    if not eos and not _local_dir_without_tokenizer(cfg.target):
        tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = (int(tokenizer.eos_token_id),)
    return dataclasses.replace(cfg, eos_token_ids=tuple(eos))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _local_dir_without_tokenizer(name: str) -> bool:
    import os

    path = os.path.expanduser(name)
    return os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def error_output(cfg: GenerateConfig, row_id: Any, message: str) -> dict:
    """The output columns of a row that cannot be generated under its id (null or duplicate): one
    error row, sample 0, whatever its num_samples."""
    k = cfg.effective_num_speculative_tokens
    return {
        "sample_index": 0, "generated_text": None, "generated_token_ids": [], "generated_logprobs": None, "top_logprobs": None,
        "num_prompt_tokens": 0, "num_generated_tokens": 0,
        "finish_reason": "error", "error": message, **SpecDecodeStats(k).to_dict(),
        "target_model": cfg.target, "draft_model": cfg.draft, "target_dtype": None, "draft_dtype": None,
        "num_speculative_tokens": k, "acceptance": cfg.acceptance, "tree_budget": cfg.tree_budget,
        "seed": row_seed(cfg.seed, row_id), "latency_s": 0.0,
    }


def load_on_actor_device(spec):
    """A model factory for a model actor (`functools.partial(load_on_actor_device, spec)`): the
    model loaded straight onto the device Ray gave the actor, where a "auto" dtype resolves
    (bfloat16 on its GPU, float32 on the CPU)."""
    from raysd.actors.model_actors import assigned_device
    from raysd.models.loading import load_model

    return load_model(dataclasses.replace(spec, device=str(assigned_device())))


def load_on_actor_host(spec):
    """As `load_on_actor_device`, in the dtype of the actor's device but on the host: a rank of a
    tensor-parallel target keeps its 1/N of the weights (TargetActor) before they move to its GPU,
    which could not hold the whole model (a 70B target in bf16: 141 GB)."""
    from raysd.actors.model_actors import assigned_device
    from raysd.models.loading import load_model, resolve_dtype

    return load_model(dataclasses.replace(spec, dtype=resolve_dtype(spec.dtype, assigned_device()), device="cpu"))


def load_eagle_on_actor_device(name: str, target_spec, dtype: str):
    """As `load_on_actor_device`, for an EAGLE draft built on the job's target."""
    from raysd.actors.model_actors import assigned_device
    from raysd.models.loading import load_eagle_for

    return load_eagle_for(name, dataclasses.replace(target_spec, device=str(assigned_device())), dtype)


def actor_resources(cfg: GenerateConfig):
    """(target, draft) ActorResources of a job's replica. A model-free drafter takes no GPU."""
    from raysd.actors.launch import ActorResources

    target_cpus, draft_cpus = cfg.actor_cpus
    gpus = cfg.num_gpus_per_actor
    return (ActorResources(num_cpus=target_cpus, num_gpus=gpus),
            ActorResources(num_cpus=draft_cpus, num_gpus=gpus if cfg.draft_is_model else 0))


def replica_parts(cfg: GenerateConfig, stop_strings: bool):
    """(target factory, drafter, coordinator config, tokenizer factory): everything a job's replica
    is made of, decided from the job's config alone before any of its actors starts, and never
    changed afterwards. The replica builds its coordinator from them, and each model actor it
    starts ahead builds itself from them (`job_target_actor`, `job_draft_actor`), as the
    coordinator would have built it. The shape (raysd.actors.settings.replica_shape) sets the
    micro-batches: one in a colocated replica, whose one process has nothing to overlap; two in a
    split one, the draft proposing for one while the target verifies the other. The EOS ids are
    the job's (`GenerateConfig.eos_token_ids`, read by the driver); -k auto learns its step costs
    from the replica's own steps. The tokenizer factory: for stop strings (None without)."""
    from raysd.actors import CoordinatorConfig, DrafterSpec
    from raysd.actors.liveness import GROUP_TIMEOUT_S
    from raysd.models.loading import ModelSpec, draft_kind, load_tokenizer

    target_spec = ModelSpec(cfg.target, cfg.target_dtype, trust_remote_code=cfg.trust_remote_code,
                            allow_pickle_weights=cfg.allow_pickle_weights)
    if cfg.draft_is_model:
        draft_spec = ModelSpec(cfg.draft, cfg.draft_dtype, trust_remote_code=cfg.trust_remote_code,
                               allow_pickle_weights=cfg.allow_pickle_weights)
        if draft_kind(cfg.draft) == "eagle":  # reads the target's features: built on the job's target
            drafter = DrafterSpec(functools.partial(load_eagle_on_actor_device, cfg.draft, target_spec, cfg.draft_dtype),
                                  shape=cfg.replica_shape)
        else:
            drafter = DrafterSpec(functools.partial(load_on_actor_device, draft_spec), draft_assist=cfg.draft_assist,
                                  cuda_graphs=cfg.cuda_graphs and cfg.draft_assist == "none",
                                  compile=cfg.compile and cfg.draft_assist == "none", shape=cfg.replica_shape)
    else:  # n-gram lookup, suffix decoding or no drafting: no model, no GPU
        drafter = DrafterSpec(None, model_free="suffix" if cfg.draft == SUFFIX else "ngram", shape=cfg.replica_shape)
    target_res, draft_res = actor_resources(cfg)
    micro = 1 if cfg.shape == "colocated" else 2
    speculation = cfg.speculation
    if speculation.adaptive is not None:  # the cost model weighs drafting beside verifying, or after it
        speculation = dataclasses.replace(speculation, adaptive=dataclasses.replace(speculation.adaptive, overlapped=micro > 1))
    ccfg = CoordinatorConfig(
        speculation,
        micro_batch_size=math.ceil(cfg.batch_size / micro),
        num_micro_batches=micro,
        draft_resources=draft_res,
        target_resources=target_res,
        placement_strategy=cfg.placement_strategy,
        placement_timeout_s=cfg.placement_timeout_s,
        step_timeout_s=cfg.step_timeout_s,
        # A rank waits in a collective at most a step's time: the step timeout bounds it too when set.
        group_timeout_s=cfg.step_timeout_s or GROUP_TIMEOUT_S,
        measure_bytes=False,
        target_tensor_parallel=cfg.target_tensor_parallel,
        cuda_graphs=cfg.cuda_graphs,
        compile=cfg.compile,
    )
    load_target = load_on_actor_host if cfg.target_tensor_parallel > 1 else load_on_actor_device
    tokenizer_factory = functools.partial(load_tokenizer, cfg.target, cfg.trust_remote_code) if stop_strings else None
    return functools.partial(load_target, target_spec), drafter, ccfg, tokenizer_factory


def job_target_actor(cfg: GenerateConfig, stop_strings: bool):
    """A job's target worker (raysd.actors.model_actors.TargetWorker), built in its actor's process."""
    from raysd.actors.launch import target_build

    target_factory, drafter, ccfg, tokenizer_factory = replica_parts(cfg, stop_strings)
    return target_build(target_factory, drafter, ccfg, tokenizer_factory)()


def job_draft_actor(cfg: GenerateConfig, target_name: str):
    """A split replica's draft worker (raysd.actors.model_actors.DraftWorker), built in its actor's process."""
    from raysd.actors.launch import draft_build

    _, drafter, ccfg, _ = replica_parts(cfg, False)
    return draft_build(drafter, ccfg)(target_name)


def _release(actors: ModelActors) -> None:
    """Model actors started ahead of a coordinator that was never made: their group removed, and
    with it the actors in it (again, if a coordinator that failed to start removed it already)."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(actors.placement_group)


class _LiveCounts:
    """Samples finished since the progress reporter last took them (rows, tokens, drafts,
    accepts), counted as each one's future completes, so the driver's progress line moves during
    a block, not only when a block ends."""

    KEYS = ("rows_generated", "tokens", "drafted", "accepted")

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.KEYS, 0)
        self._first: float | None = None  # wall-clock time of the first sample finished (JobStats keeps the earliest)

    def add(self, future) -> None:
        """A future's done callback: runs on the stream's loop thread, so only adds."""
        if future.cancelled() or future.exception() is not None:
            return
        res = future.result().result
        self._add(1, len(res.token_ids), res.stats.num_draft_tokens, res.stats.num_accepted_draft_tokens)

    def add_errors(self, rows: int) -> None:
        """Error rows made without a request (a bad prompt or override)."""
        if rows:
            self._add(rows, 0, 0, 0)

    def add_rows(self, outputs: list[dict]) -> None:
        """Output rows made at once (a beam job's hypotheses)."""
        for out in outputs:
            self._add(1, out["num_generated_tokens"], out["num_draft_tokens"], out["num_accepted_draft_tokens"])

    def _add(self, rows: int, tokens: int, drafted: int, accepted: int) -> None:
        with self._lock:
            c = self._counts
            c["rows_generated"] += rows
            c["tokens"] += tokens
            c["drafted"] += drafted
            c["accepted"] += accepted
            if self._first is None:
                self._first = time.time()

    def take(self) -> dict:
        """The counts since the last take, and `first_row_at`."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self.KEYS, 0)
        return {**counts, "first_row_at": self._first}


def _samples_to_do(row: dict, n: int) -> list[int]:
    """The sample indices 0..n-1 of a row that are not in the output yet (`done_samples`: a resumed job)."""
    done = set(row.get("done_samples") or ())
    return [j for j in range(n) if j not in done]


class GenerationReplica:
    """Owns one SpecCoordinator (its draft and target actors) for the life of the job.

    Ray Data runs one per actor of the generation stage (`raysd.jobs.pipeline.GenerateReplica`).
    """

    def __init__(self, cfg: GenerateConfig, replica: int | str = 0, max_pending: int | None = None,
                 stop_strings: bool | None = None):
        """`stop_strings`: rows may ask for stop strings (--stop, or an input `stop` column), so the
        target actor builds the target's tokenizer (None: from cfg.stop alone)."""
        from raysd.actors.launch import target_resources
        from raysd.actors.launch import start_model_actors

        started = time.perf_counter()
        cfg = with_eos_ids(cfg)  # a job's driver read them already
        self.cfg = cfg
        self.num_speculative_tokens = cfg.effective_num_speculative_tokens
        if stop_strings is None:
            stop_strings = bool(cfg.stop)
        parts = replica_parts(cfg, stop_strings)
        _, drafter, ccfg, _ = parts
        # The model actors first (raysd.actors.launch): they import torch and load their models while
        # this process sets up the coordinator and the tokenizer. A tensor-parallel target's ranks are
        # started by the coordinator, which restarts them together.
        actors = None
        if cfg.target_tensor_parallel == 1:
            split = drafter.shape_for(ccfg.target_resources.num_gpus, ccfg.draft_resources.num_gpus) == "split"
            actors = start_model_actors([functools.partial(job_target_actor, cfg, stop_strings)],
                                        functools.partial(job_draft_actor, cfg) if split else None,
                                        target_resources(drafter, ccfg), ccfg.draft_resources, cfg.placement_strategy,
                                        cfg.placement_timeout_s)
        try:
            self._start(cfg, parts, actors)
        except BaseException:
            if actors is not None and getattr(self, "coordinator", None) is None:
                _release(actors)
            raise
        self.metrics = ReplicaMetrics(cfg, replica)
        self.live = _LiveCounts()  # samples finished, for the driver's progress line (taken by the stage)
        # One loop for the replica's life, fed by every concurrent `generate` call: rows of the next
        # block take slots as soon as rows of the last one free them. Bounded: by default three
        # batches' rows queued or running (the Ray Data stage keeps about that many blocks inside).
        self.slots = ccfg.micro_batch_size * ccfg.num_micro_batches
        self.stream = self.coordinator.stream(max_pending or 3 * self.slots)
        self.coordinator.on_step = self._on_step
        self._reported = LoopStats()
        self._sources: dict[str, int] = {}  # a suffix drafter's drafts by source, as last reported
        self._start_s = time.perf_counter() - started  # actors, models, tokenizer: in the next report
        self._report_lock = threading.Lock()
        # Concurrent calls share the tokenizer: a fast tokenizer's Rust object refuses concurrent
        # use when a call changes its truncation/padding ("Already borrowed"), so one at a time.
        self._tokenizer_lock = threading.Lock()

    def _on_step(self, timings, verdict, in_flight: int) -> None:
        """After each call of the stream's loop (SpecCoordinator.on_step): the step metrics and the load."""
        self.metrics.on_step(timings, verdict)
        self.metrics.set_load(self.stream.pending - in_flight, in_flight, in_flight / self.slots)

    def _start(self, cfg: GenerateConfig, parts, actors: ModelActors | None) -> None:
        """The tokenizer and the coordinator (on `actors`, or starting its own), from `replica_parts`."""
        from raysd.actors import SpecCoordinator
        from raysd.models.loading import load_tokenizer

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
        target_factory, drafter, ccfg, tokenizer_factory = parts
        # Stop strings are matched where the rows live, in the target actor, on its own copy of the
        # target's tokenizer (built there); only a job whose rows may ask for them pays for it, and
        # only if the target has one (known once this replica's own copy has loaded: without one,
        # such rows become error rows, "stop strings need the target's tokenizer").
        if tokenizer_factory is not None:
            thread.join()
            if tokenizer_box.get("tok") is None:
                tokenizer_factory = None
        self.coordinator = SpecCoordinator(target_factory, drafter, ccfg, tokenizer_factory=tokenizer_factory, actors=actors)
        thread.join()
        if "error" in tokenizer_box:
            raise tokenizer_box["error"]
        self.tokenizer = tokenizer_box.get("tok")
        # The dtypes the models run in, "auto" resolved by each model actor on its device.
        self.target_dtype = self.coordinator.target_info.dtype
        self.draft_dtype = self.coordinator.draft_info.dtype if cfg.draft_is_model else None

    def shutdown(self) -> None:
        try:
            self.stream.close(timeout=5)
        finally:
            self.coordinator.shutdown()

    def generate(self, rows: list[dict]) -> tuple[list[list[dict]], LoopStats, dict[str, int]]:
        """Each row's output rows (schema.GENERATED_FIELDS), one per sample to generate, in order;
        what the replica measured since the last call (`_report`), this call's tokenising and
        detokenising seconds in it; and a suffix drafter's drafts by source since the last call.

        A row holds `id`, `prompt`, optionally the override columns (schema.OVERRIDE_COLUMNS) and
        `done_samples`: sample indices already in the output (a resumed job), which are skipped.
        A row of N samples becomes N requests submitted one after another, so that the engine
        admits them together where slots allow and prefills their prompt once. A row that cannot
        run (bad prompt, bad override) gives an error row per sample (one, sample 0, for a bad
        `num_samples`).
        Thread-safe: concurrent calls feed the same stream, so their rows share the micro-batches.
        A beam job's rows take `_generate_beams` instead.
        """
        from raysd.engine.requests import Request

        cfg = self.cfg
        if cfg.beam_width:
            return self._generate_beams(rows)
        outputs: list[list[dict]] = [[] for _ in rows]
        pending = []  # (row, sample index, seed, future)
        tokenize_s = 0.0
        for i, row in enumerate(rows):
            n, error = num_samples_of(row.get("num_samples"), cfg.num_samples)
            params, seed = None, row_seed(cfg.seed, row["id"])
            if error is None:
                params, seed, error = row_params(row, cfg)
            kind = "params"  # what an error row is (raysd.jobs.metrics.ERROR_KINDS)
            samples = _samples_to_do(row, n)
            ids = None
            if error is None and samples:
                ids, error, seconds = self._tokenize(row)
                tokenize_s += seconds
                kind = "prompt"
            if error is not None:
                outputs[i] = self._counted_errors([self._error_row(ids, error, sample_seed(seed, j), j) for j in samples], kind)
                continue
            for j in samples:
                params_j = params if j == 0 else dataclasses.replace(params, seed=sample_seed(seed, j))
                future = self.stream.submit(Request((i, j), ids, params_j))  # blocks while the stream is full
                future.add_done_callback(self.live.add)
                pending.append((i, j, params_j.seed, future))
        detokenize_s = 0.0
        for i, j, seed, future in pending:
            done = future.result()  # raises if the loop failed
            t = time.perf_counter()
            outputs[i].append(self._row(done.result.prompt_token_ids, done.result.token_ids, done.result.finish_reason,
                                        done.result.stats, done.result.error, seed, done.latency_s, j, done.result))
            detokenize_s += time.perf_counter() - t
            self.metrics.observe_row(outputs[i][-1], "refused")  # an engine's error row: refused at admission
        report = self._report()
        report.tokenize_s, report.detokenize_s = tokenize_s, detokenize_s
        return outputs, report, self._draft_sources_delta()

    def _generate_beams(self, rows: list[dict]) -> tuple[list[list[dict]], LoopStats, dict[str, int]]:
        """A beam job's block (as `generate`): each prompt's best --num-return-sequences hypotheses,
        one output row each (sample_index 0 the best, its `beam_score` beside), searched by the
        target's actor in one call (TargetWorker.beam_search, which batches the block's prompts
        itself), waited for as long as Ray says that actor lives. A request the search refuses is
        one error row, sample 0."""
        from raysd.actors.liveness import answer
        from raysd.actors.wire import BeamSpec
        from raysd.engine.requests import Request

        cfg = self.cfg
        outputs: list[list[dict]] = [[] for _ in rows]
        requests, wanted = [], []  # (row index, sample indices, seed) per request
        tokenize_s = 0.0
        for i, row in enumerate(rows):
            params, seed, error = row_params(row, cfg)
            kind = "params"  # what an error row is (raysd.jobs.metrics.ERROR_KINDS)
            samples = _samples_to_do(row, cfg.samples_per_prompt)
            ids = None
            if error is None and samples:
                ids, error, seconds = self._tokenize(row)
                tokenize_s += seconds
                kind = "prompt"
            if error is not None:
                outputs[i] = self._counted_errors([self._error_row(ids, error, seed, j) for j in samples], kind)
                continue
            if samples:
                requests.append(Request(i, ids, params))
                wanted.append((i, samples, seed))
        spec = BeamSpec(cfg.beam_width, cfg.length_penalty, EARLY_STOPPING_CHOICES[cfg.early_stopping], cfg.num_return_sequences,
                        "none" if cfg.draft == NO_DRAFT else cfg.draft if cfg.draft in (NGRAM, SUFFIX) else "model",
                        self.num_speculative_tokens, cfg.beam_lookup_budget, cfg.batch_size, cfg.max_model_len)
        target = self.coordinator.target
        start = time.perf_counter()
        searched = answer(lambda: target.beam_search.remote(requests, spec, cfg.eos_token_ids), target, "target") if requests else []
        latency = time.perf_counter() - start
        detokenize_s = 0.0
        for (i, samples, seed), hypotheses in zip(wanted, searched):
            t = time.perf_counter()
            for j in samples if hypotheses[0].finish_reason != "error" else [0]:
                h = hypotheses[j]
                outputs[i].append(self._row(h.prompt_token_ids, h.token_ids, h.finish_reason, h.stats, h.error, seed,
                                            latency, j, h))
            detokenize_s += time.perf_counter() - t
            for out in outputs[i]:
                self.metrics.observe_row(out, "refused")  # an error row here: refused by the search
            self.live.add_rows(outputs[i])
        report = self._report()
        report.tokenize_s, report.detokenize_s = tokenize_s, detokenize_s
        return outputs, report, {}

    def _tokenize(self, row: dict) -> tuple[list[int] | None, str | None, float]:
        """The row's prompt as token ids (`prompt_token_ids`: ids, or None and why not), and the seconds it took."""
        start = time.perf_counter()
        with self._tokenizer_lock:
            ids, error = prompt_token_ids(row.get("prompt"), self.tokenizer, self.cfg.chat_template)
        return ids, error, time.perf_counter() - start

    def _error_row(self, prompt_ids: list[int] | None, error: str, seed: int, sample_index: int) -> dict:
        """The output row of a sample that cannot run: no tokens, empty statistics, `error` saying why."""
        return self._row(prompt_ids or [], [], "error", SpecDecodeStats(self.num_speculative_tokens), error, seed, 0.0,
                         sample_index)

    def _counted_errors(self, rows: list[dict], kind: str) -> list[dict]:
        """Error rows made before any model ran, counted as such: in the live metrics under `kind`
        (raysd.jobs.metrics.ERROR_KINDS) and in the driver's progress."""
        for out in rows:
            self.metrics.observe_row(out, kind)
        self.live.add_errors(len(rows))
        return rows

    def _report(self) -> LoopStats:
        """What the stream measured since the last call took it (and, in the first report, the
        replica's start), so that summing the reports of every call counts each second once."""
        with self._report_lock:
            now = self.stream.stats()
            delta = now.since(self._reported)
            self._reported = now
            delta.start_s, self._start_s = self._start_s, 0.0
        return delta

    def _draft_sources_delta(self) -> dict[str, int]:
        """A suffix drafter's drafts by source since the last call took them ({} for other drafters)."""
        if self.cfg.draft != SUFFIX:
            return {}
        with self._report_lock:
            sources = self._draft_sources()
            delta = {f"suffix_{k}": v - self._sources.get(k, 0) for k, v in sources.items()}
            self._sources = sources
        return delta

    def _draft_sources(self) -> dict[str, int]:
        """The suffix drafter's drafts by source so far (in the target actor: SuffixIndex.provenance);
        the last known counts if the actor cannot answer (a report only)."""
        import ray

        try:
            return ray.get(self.coordinator.target.draft_sources.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - e.g. the actor is restarting: counts only
            return dict(self._sources)

    def _row(self, prompt_ids, tokens, finish_reason, stats: SpecDecodeStats, error, seed, latency, sample_index: int = 0,
             result=None) -> dict:
        """One output row. `result`: the GenerationResult, for its stop-cut text and logprobs."""
        text = None
        if result is not None and result.text is not None:  # ended by a stop string: cut there by the engine
            text = result.text
        elif self.tokenizer is not None and finish_reason != "error":
            with self._tokenizer_lock:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        logprobs = top = None
        if result is not None and finish_reason != "error":
            logprobs = None if result.logprobs is None else [float(x) for x in result.logprobs]
            if result.top_logprobs is not None:
                top = [[{"id": int(t), "logprob": float(lp)} for t, lp in position] for position in result.top_logprobs]
        return {
            "sample_index": sample_index,
            "generated_text": text,
            "generated_token_ids": list(tokens),
            "generated_logprobs": logprobs,
            "top_logprobs": top,
            "num_prompt_tokens": len(prompt_ids),
            "num_generated_tokens": len(tokens),
            "finish_reason": finish_reason,
            "error": error,
            **stats.to_dict(),
            "target_model": self.cfg.target,
            "draft_model": self.cfg.draft,
            "target_dtype": self.target_dtype,
            "draft_dtype": self.draft_dtype,
            "num_speculative_tokens": self.num_speculative_tokens,
            "acceptance": self.cfg.acceptance,
            "tree_budget": self.cfg.tree_budget,
            "seed": seed,
            "latency_s": latency if finish_reason != "error" else 0.0,
            "beam_score": None if result is None else result.beam_score,
        }
