"""What a generation job is: `GenerateConfig`, validated before anything heavy happens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from raysd.actors.liveness import PLACEMENT_TIMEOUT_S
from raysd.actors.settings import PLACEMENT_STRATEGIES, REPLICA_SHAPES, replica_shape  # the first two: flag choices
from raysd.core.params import LOGPROBS_MODES, MAX_TOP_LOGPROBS  # what --logprobs-mode and --top-logprobs take
from raysd.core.speculation import AdaptiveConfig, SpeculationConfig
from raysd.jobs.schema import MAX_NUM_SAMPLES, is_int
from raysd.models.names import (  # MODEL_FREE: --draft values naming no model
    AUTO_DTYPE,
    DEFAULT_MODEL,
    DRAFT_ASSISTS,
    DTYPE_CHOICES,
    MODEL_FREE,
    NO_DRAFT,
    draft_kind,
)

DEFAULT_TARGET = DEFAULT_MODEL  # the embedded SmolLM2-135M-Instruct (GGUF, run in fp32)
# The default drafter: one constant, changed here only. Suffix decoding learns the job's own
# templates at no model cost; on the embedded model it beats both n-gram lookup and plain decoding
# on a templated dataset and is about even on Spec-Bench (docs/performance.md).
DEFAULT_DRAFT = "suffix"
AUTO = "auto"
AUTO_MAX_K = 8  # the largest K the adaptive controller may choose
# K when --num-speculative-tokens is not given: chosen each step, so a drafter that does not pay
# (on a CPU, often the n-gram lookup) is switched off rather than slowing the job. With
# --tree-budget P the same: each step drafts the chain or tree (of at most P nodes) of best
# expected goodput, so a tree is drafted only where it pays (docs/trees.md).
DEFAULT_NUM_SPECULATIVE_TOKENS = AUTO
DEFAULT_MAX_NEW_TOKENS = 64
# Beam search (--beam-width): HF's early_stopping values as the flag takes them, K under -k auto (beam
# search has no adaptive K: a fixed tree depth), and the tree of an ngram or suffix drafter without
# --tree-budget.
EARLY_STOPPING_CHOICES = {"true": True, "false": False, "never": "never"}
BEAM_AUTO_K = 4
BEAM_LOOKUP_BUDGET = 8
MODEL_FREE_DRAFT_CPUS = 0.01  # an n-gram (or no) drafter's actor: Python lookups, no model, no torch threads


class JobError(Exception):
    """A job that cannot run as asked. The message is one line naming the problem."""


def one_line(exc: BaseException) -> str:
    """An exception in one line for a JobError or a failed row: its type and its message's first line
    (Ray and Ray Data append lines of advice to a message; raysd's own first line says what failed)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@dataclass(frozen=True)
class GenerateConfig:
    """A `raysd generate` job. Field names follow the CLI flags (`--max-new-tokens` -> max_new_tokens)."""

    input: str
    output: str
    prompt_column: str = "prompt"
    id_column: str = "id"
    split: str | None = None  # for a `datasets` DatasetDict
    chat_template: bool = True  # string prompts go through the tokenizer's chat template
    target: str = DEFAULT_TARGET
    target_dtype: str = AUTO_DTYPE  # "auto": bfloat16 on a GPU (float16 without bf16), float32 on the CPU
    draft: str = DEFAULT_DRAFT  # HF id or path, "suffix", "ngram", or "none" (plain autoregressive decoding)
    draft_dtype: str = AUTO_DTYPE
    # K, or "auto": K in 0..AUTO_MAX_K chosen each step for goodput. None: the default (above).
    num_speculative_tokens: int | str | None = None
    acceptance: str = "exact"  # or "relaxed:LAMBDA": lossy, Yin et al. 2024 (EngineConfig.acceptance)
    tree_budget: int = 0  # P > 0: a draft tree of at most P nodes per row per step, K deep (EngineConfig.tree_budget)
    draft_assist: str = "none"  # "ngram": n-gram lookup drafts for the draft model (three levels; raysd.engine.draft_assist)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # The most tokens a row holds, prompt and generated together (vLLM's --max-model-len): a longer
    # prompt is an error row, a row reaching it ends with finish_reason "length". None: the models' context.
    max_model_len: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # N independent completions per prompt (a per-row `num_samples` column overrides): output rows
    # (id, sample_index 0..N-1), each with its own seed (raysd.jobs.replica.sample_seed).
    num_samples: int = 1
    # Beam search (docs/beam_search.md): W >= 2 beams per prompt, token for token the target's own beam
    # search (HF generate(num_beams=W, do_sample=False)), in fewer target passes with a drafter; 0: off.
    beam_width: int = 0
    num_return_sequences: int = 1  # with --beam-width: the best N <= W hypotheses, rows sample_index 0..N-1
    length_penalty: float = 1.0  # a finished hypothesis scores sum of log-probs / length ** length_penalty
    early_stopping: str = "false"  # "true", "false" or "never", as HF's early_stopping
    # Stop strings (a per-row `stop` column adds its own): a row ends at the first occurrence in its
    # decoded text, finish_reason "stop", the text cut before it unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # generated_logprobs: the target's log-probability of each emitted token, from the verify pass;
    # top_logprobs > 0 adds the N most likely (implies logprobs). "raw": log-softmax of the target's
    # logits (vLLM's default); "processed": of the distribution sampled (temperature, top-k, top-p).
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"
    batch_size: int = 16  # rows per call on a replica (split into two pipelined micro-batches)
    replicas: int = 1  # draft/target actor pairs running in parallel
    # N > 1: each replica's target is N rank actors, each with 1/N of its weights (Megatron-style
    # tensor parallelism, raysd.models.tensor_parallel), and --num-gpus-per-actor each.
    target_tensor_parallel: int = 1
    num_gpus_per_actor: float = 0.0
    # The model actors' small forwards (decode, verify, a draft model's proposing) replayed as CUDA
    # graphs captured per shape (raysd.models.cuda_graphs): needs GPUs, Llama-family models.
    cuda_graphs: bool = False
    # Those forwards through torch.compile, the graphs capturing Inductor's fused kernels (a faster
    # step on a large model, for a compile per captured shape family at the start: docs/performance.md).
    compile: bool = False
    num_cpus_per_actor: float | None = None  # None: auto (resolve_actor_cpus; 1 on an existing cluster)
    placement_strategy: str = "STRICT_PACK"  # a replica's draft and target: one node; SPREAD: over nodes
    # Where a replica's drafter runs (raysd.actors.settings.REPLICA_SHAPES): "auto" puts a draft model in
    # the target's actor unless each has a GPU of its own or the target is tensor-parallel; "colocated"
    # or "split" insist (for studies).
    replica_shape: str = "auto"
    # A replica whose model actors cannot be placed within this many seconds retires: its rows go
    # to the replicas left (docs/reliability.md, "Waits and limits").
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S
    step_timeout_s: float | None = None  # a number: a step (one call to the model actors) longer than this fails the job
    rows_per_file: int = 1024  # completed rows buffered per output Parquet file
    address: str | None = None  # an existing Ray cluster; None starts a local one
    overwrite: bool = False
    quiet: bool = False  # print only the summary
    verbose: bool = False  # Ray Data's own progress and Ray's messages too
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False  # unpickle .bin/.pt model weights (runs code from the file): trusted files only
    # Not a flag: the target's EOS ids, read from its files by the driver before any actor starts
    # (raysd.jobs.runner.resolve_eos; None until then). Every replica's rows end at them.
    eos_token_ids: tuple[int, ...] | None = None
    # K, the tree, the acceptance rule, adaptive K and the EOS ids as every step obeys them, made from
    # the fields above and validated there (raysd.core.speculation). -k auto learns its step costs
    # from the job's own steps.
    speculation: SpeculationConfig = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise JobError(message)

        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
        need(bool(self.input), "--input must not be empty")
        need(bool(self.output), "--output must not be empty")
        need(bool(self.prompt_column), "--prompt-column must not be empty")
        need(bool(self.id_column), "--id-column must not be empty")
        need(self.prompt_column != self.id_column, "--prompt-column and --id-column must differ")
        need(bool(self.target) and self.target not in MODEL_FREE, f"--target must name a model, got {self.target!r}")
        need(bool(self.draft), "--draft must not be empty (use 'none' for plain decoding)")
        for flag, dtype in (("--target-dtype", self.target_dtype), ("--draft-dtype", self.draft_dtype)):
            need(dtype in DTYPE_CHOICES, f"{flag} must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        k = self.num_speculative_tokens
        need(k == AUTO or is_int(k), f"--num-speculative-tokens must be 'auto' or an integer, got {k!r}")
        P = self.tree_budget
        need(not P or self.draft != NO_DRAFT, "--tree-budget needs a drafter (a draft model, an EAGLE draft, ngram or suffix), not none")
        L = self.max_model_len
        need(L is None or (is_int(L) and L >= 2), f"--max-model-len must be an integer >= 2, got {L!r}")
        object.__setattr__(self, "speculation", self._speculation())
        need(self.draft_assist in DRAFT_ASSISTS, f"--draft-assist must be one of {', '.join(DRAFT_ASSISTS)}, got {self.draft_assist!r}")
        need(self.draft_assist == "none" or self.draft_is_model,
             f"--draft-assist {self.draft_assist} needs a draft model (--draft MODEL), got --draft {self.draft}")
        need(self.draft_assist == "none" or not P, "--draft-assist drafts a chain: use --tree-budget 0")
        need(self.draft_assist == "none" or draft_kind(self.draft) != "eagle",
             f"--draft-assist {self.draft_assist} needs a draft model, not an EAGLE feature draft ({self.draft})")
        need(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        need(self.temperature >= 0 and self.temperature == self.temperature, f"--temperature must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        need(self.top_k >= 0, f"--top-k must be >= 0 (0 disables), got {self.top_k}")
        need(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")
        need(is_int(self.num_samples) and 1 <= self.num_samples <= MAX_NUM_SAMPLES,
             f"--num-samples must be an integer in 1..{MAX_NUM_SAMPLES}, got {self.num_samples!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        bad = [x for x in stop if not isinstance(x, str) or not x]
        need(not bad, f"--stop must be a non-empty string, got {bad[0]!r}" if bad else "")
        need(is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"--top-logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.top_logprobs:  # the top N come with the emitted token's own, as in SamplingParams
            object.__setattr__(self, "logprobs", True)
        need(self.logprobs_mode in LOGPROBS_MODES,
             f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        need(self.logprobs or self.logprobs_mode == "raw", "--logprobs-mode processed needs --logprobs or --top-logprobs")
        self._check_beams(need)
        need(not (self.quiet and self.verbose), "--quiet and --verbose exclude each other")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.replicas >= 1, f"--replicas must be >= 1, got {self.replicas}")
        need(is_int(self.target_tensor_parallel) and self.target_tensor_parallel >= 1,
             f"--target-tensor-parallel must be an integer >= 1, got {self.target_tensor_parallel!r}")
        need(self.num_gpus_per_actor >= 0, f"--num-gpus-per-actor must be >= 0, got {self.num_gpus_per_actor}")
        need(
            self.num_gpus_per_actor <= 1 or self.num_gpus_per_actor == int(self.num_gpus_per_actor),
            f"--num-gpus-per-actor above 1 must be whole, got {self.num_gpus_per_actor}",
        )
        need(not self.cuda_graphs or self.num_gpus_per_actor > 0,
             "--cuda-graphs replays CUDA graphs: it needs GPUs (--num-gpus-per-actor > 0)")
        need(not self.compile or self.cuda_graphs,
             "--compile compiles the forwards that --cuda-graphs captures: it needs --cuda-graphs")
        if self.num_cpus_per_actor is not None:
            need(self.num_cpus_per_actor >= 0, f"--num-cpus-per-actor must be >= 0, got {self.num_cpus_per_actor}")
            need(
                self.num_cpus_per_actor > 0 or self.num_gpus_per_actor > 0,
                "--num-cpus-per-actor and --num-gpus-per-actor cannot both be 0",
            )
        need(self.placement_strategy in PLACEMENT_STRATEGIES,
             f"--placement-strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}")
        need(self.rows_per_file >= 1, f"--rows-per-file must be >= 1, got {self.rows_per_file}")
        need(self.replica_shape in REPLICA_SHAPES,
             f"--replica-shape must be one of {', '.join(REPLICA_SHAPES)}, got {self.replica_shape!r}")
        need(not (self.replica_shape == "colocated" and self.draft_is_model and self.target_tensor_parallel > 1),
             "--replica-shape colocated cannot put a draft model inside a tensor-parallel target's ranks: use split")
        need(self.placement_timeout_s > 0, f"--placement-timeout must be > 0 seconds, got {self.placement_timeout_s}")
        need(self.step_timeout_s is None or self.step_timeout_s > 0,
             f"--step-timeout must be > 0 seconds, got {self.step_timeout_s}")

    def _check_beams(self, need) -> None:
        """--beam-width and what goes with it: greedy settings only, one line per conflict."""
        W, N = self.beam_width, self.num_return_sequences
        need(is_int(W) and (W == 0 or W >= 2), f"--beam-width must be an integer >= 2 (0: off), got {W!r}")
        need(is_int(N) and 1 <= N <= max(W, 1),
             f"--num-return-sequences must be in 1..--beam-width ({W})" if W else "--num-return-sequences needs --beam-width")
        need(self.early_stopping in EARLY_STOPPING_CHOICES,
             f"--early-stopping must be one of {', '.join(EARLY_STOPPING_CHOICES)}, got {self.early_stopping!r}")
        need(self.length_penalty == self.length_penalty and abs(self.length_penalty) != float("inf"),
             f"--length-penalty must be finite, got {self.length_penalty}")
        if not W:
            need(self.length_penalty == 1.0 and self.early_stopping == "false",
                 "--length-penalty and --early-stopping need --beam-width")
            return
        need(self.temperature == 0, f"--beam-width is deterministic beam search: it needs --temperature 0, got {self.temperature}")
        need(self.top_p == 1.0 and self.top_k == 0, "--beam-width takes no --top-p or --top-k (greedy settings only)")
        need(self.num_samples == 1, "--beam-width returns the best beams: use --num-return-sequences, not --num-samples")
        need(not self.stop, "--beam-width does not take --stop strings (EOS and stop token ids only)")
        need(not self.logprobs, "--beam-width does not return --logprobs (each row has its beam_score)")
        need(self.acceptance == "exact", f"--beam-width verifies exactly: use --acceptance exact, not {self.acceptance}")
        need(self.draft_assist == "none", "--beam-width does not take --draft-assist")
        need(draft_kind(self.draft) != "eagle", f"--beam-width does not take an EAGLE feature draft ({self.draft})")
        need(not self.tree_budget or not self.draft_is_model,
             "--beam-width with a draft model drafts the draft's own beam search: use --tree-budget 0")
        need(self.target_tensor_parallel == 1 and not self.cuda_graphs,
             "--beam-width runs the target in one process: no --target-tensor-parallel or --cuda-graphs")
        need(self.shape == "colocated", "--beam-width searches in one process, the target's actor with its drafter: "
                                        "use --replica-shape colocated (and at most 1 GPU per replica)")

    @property
    def beam_config(self):
        """The job's raysd.core.beam.BeamConfig (None without --beam-width); imported here only, as it needs torch."""
        if not self.beam_width:
            return None
        from raysd.core.beam import BeamConfig

        return BeamConfig(self.beam_width, self.length_penalty, EARLY_STOPPING_CHOICES[self.early_stopping],
                          self.num_return_sequences)

    @property
    def samples_per_prompt(self) -> int:
        """Output rows per prompt (sample_index 0..N-1): --num-return-sequences with --beam-width, else
        --num-samples (a row's `num_samples` column overrides the latter only)."""
        return self.num_return_sequences if self.beam_width else self.num_samples

    @property
    def beam_lookup_budget(self) -> int:
        """With --beam-width and an ngram or suffix drafter: the nodes of each beam's lookup tree."""
        return self.tree_budget or BEAM_LOOKUP_BUDGET

    def _speculation(self) -> SpeculationConfig:
        """The job's SpeculationConfig; its one-line errors name the flags."""
        auto = self.adaptive_speculation
        try:
            return SpeculationConfig(num_speculative_tokens=self.effective_num_speculative_tokens,
                                     tree_budget=self.tree_budget, acceptance=self.acceptance,
                                     eos_token_ids=self.eos_token_ids or (), adaptive=AdaptiveConfig() if auto else None,
                                     max_model_len=self.max_model_len)
        except ValueError as exc:
            text = str(exc)
            for name, flag in (("num_speculative_tokens", "--num-speculative-tokens"), ("tree_budget", "--tree-budget"),
                               ("acceptance", "--acceptance")):
                text = text.replace(name, flag)
            raise JobError(text) from None

    @property
    def draft_is_model(self) -> bool:
        return self.draft not in MODEL_FREE

    @property
    def shape(self) -> str:
        """Where each replica's drafter runs, "colocated" or "split" (raysd.actors.settings.replica_shape):
        --replica-shape, or by where the models live (a GPU each: split)."""
        gpus = self.num_gpus_per_actor
        return replica_shape(self.replica_shape, self.draft_is_model, gpus, gpus if self.draft_is_model else 0.0,
                             self.target_tensor_parallel)

    @property
    def actor_cpus(self) -> tuple[float, float]:
        """(target, draft) CPUs of a replica's models. A colocated replica's one actor asks for both
        (raysd.actors.launch.target_resources); a model-free drafter's sliver is never placed,
        so the target's CPUs are the replica's. `auto` left unresolved (an existing cluster, whose
        nodes this job does not own) is 1 per model."""
        cpus = 1.0 if self.num_cpus_per_actor is None else self.num_cpus_per_actor
        return cpus, (cpus if self.draft_is_model else MODEL_FREE_DRAFT_CPUS)

    @property
    def target_threads(self) -> int:
        """torch threads of the actor that runs the target: the CPUs it asks for (Ray sets
        OMP_NUM_THREADS from them), both models' in a colocated replica with a draft model."""
        target, draft = self.actor_cpus
        return max(1, int(target + draft if self.shape == "colocated" and self.draft_is_model else target))

    @property
    def replica_cpus(self) -> float:
        """CPUs one replica's actors ask for: each target rank's and the draft's."""
        target, draft = self.actor_cpus
        return self.target_tensor_parallel * target + draft

    def resolve_actor_cpus(self, local_cores: int | None) -> "GenerateConfig":
        """`--num-cpus-per-actor auto` made a number. On a Ray this job starts on this machine
        (`local_cores` known) without GPUs, the model actors share the machine's cores: each
        replica's target and draft model get an equal share, the target all of it with a
        model-free drafter. torch runs as many threads as its actor has CPUs (Ray sets
        OMP_NUM_THREADS), and a target decodes faster on all the cores than on one
        (docs/history/benchmarks.md, Benchmark 6). No core is kept for the replica's own process:
        it sleeps through each step (raysd.actors.transport's _ReadPacer). Elsewhere (GPUs, or a
        cluster) 1."""
        if self.num_cpus_per_actor is not None:
            return self
        cpus = 1.0
        if local_cores and self.num_gpus_per_actor == 0:
            models = self.replicas * (self.target_tensor_parallel + (1 if self.draft_is_model else 0))
            cpus = float(max(1, local_cores // models))
        return dataclasses.replace(self, num_cpus_per_actor=cpus)

    @property
    def adaptive_speculation(self) -> bool:
        return self.num_speculative_tokens == AUTO and self.draft != NO_DRAFT and not self.beam_width

    @property
    def effective_num_speculative_tokens(self) -> int:
        """K as run (the largest K under 'auto'): plain decoding drafts nothing."""
        if self.draft == NO_DRAFT:
            return 0
        if self.num_speculative_tokens == AUTO:
            return BEAM_AUTO_K if self.beam_width else AUTO_MAX_K
        return self.num_speculative_tokens

    def fingerprint(self) -> dict:
        """What must match for a re-run to resume into the same output (everything that changes a row)."""
        keys = ("prompt_column", "id_column", "split", "chat_template", "target", "target_dtype", "draft", "draft_dtype",
                "num_speculative_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "seed")
        fingerprint = {k: getattr(self, k) for k in keys}
        if not self.num_gpus_per_actor:  # "auto" without a GPU is float32: outputs written before "auto" resume
            for k in ("target_dtype", "draft_dtype"):
                fingerprint[k] = "float32" if fingerprint[k] == AUTO_DTYPE else fingerprint[k]
        # Each of the below only when not its default, so that outputs written before it existed resume.
        if self.num_samples != 1:
            fingerprint["num_samples"] = self.num_samples
        if self.max_model_len is not None:  # a row may end sooner
            fingerprint["max_model_len"] = self.max_model_len
        if self.stop:
            fingerprint["stop"] = list(self.stop)
        if self.include_stop_str_in_output:
            fingerprint["include_stop_str_in_output"] = True
        if self.logprobs:  # adds a column's values: a resume must not mix rows with and without
            fingerprint.update(logprobs=True, top_logprobs=self.top_logprobs, logprobs_mode=self.logprobs_mode)
        if self.acceptance != "exact":  # absent when exact, so outputs written before the flag still resume
            fingerprint["acceptance"] = self.acceptance
        if self.tree_budget:  # likewise absent for a chain
            fingerprint["tree_budget"] = self.tree_budget
        if self.draft_assist != "none":  # and for two levels (the assist changes the seeded samples)
            fingerprint["draft_assist"] = self.draft_assist
        if self.beam_width:  # beam rows are other rows
            fingerprint.update(beam_width=self.beam_width, num_return_sequences=self.num_return_sequences,
                               length_penalty=self.length_penalty, early_stopping=self.early_stopping)
        return fingerprint

    def to_dict(self) -> dict:
        """The flags (what `GenerateConfig(**d)` takes back); the derived fields are left out."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name != "eos_token_ids"}
