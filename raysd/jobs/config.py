"""What a generation job is: `GenerateConfig`, validated before anything heavy happens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raysd.core.acceptance import parse_acceptance
from raysd.models.names import DEFAULT_MODEL, DTYPE_NAMES, NGRAM, NO_DRAFT, draft_kind  # NGRAM, NO_DRAFT: --draft values naming no model

DEFAULT_TARGET = DEFAULT_MODEL  # the embedded SmolLM2-135M-Instruct (GGUF, run in fp32)
DEFAULT_DRAFT = "ngram"  # the default drafter: one constant, changed here only
AUTO = "auto"
AUTO_MAX_K = 8  # the largest K the adaptive controller may choose
# K when --num-speculative-tokens is not given: chosen each step, so a drafter that does not pay
# (the n-gram lookup on this CPU) is switched off rather than slowing the job (docs/benchmarks.md,
# Benchmark 7). With --tree-budget P the same: each step drafts the chain or tree (of at most P
# nodes) of best expected goodput, so a tree is drafted only where it pays (docs/trees.md).
DEFAULT_NUM_SPECULATIVE_TOKENS = AUTO
DEFAULT_MAX_NEW_TOKENS = 64
# Where a replica's draft and target actors go (Ray placement group strategies; the coordinator's
# CoordinatorConfig.placement_strategy, raysd.actors.coordinator.STRATEGIES). Not imported from
# there: checking a config must not import torch.
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DRAFT_ASSISTS = ("none", "ngram")  # what drafts for the draft model (raysd.engine.hierarchy.INNER_KINDS)
MODEL_FREE_DRAFT_CPUS = 0.01  # an n-gram (or no) drafter's actor: Python lookups, no model, no torch threads


class JobError(Exception):
    """A job that cannot run as asked. The message is one line naming the problem."""


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
    target_dtype: str = "float32"
    draft: str = DEFAULT_DRAFT  # HF id or path, "ngram", or "none" (plain autoregressive decoding)
    draft_dtype: str = "float32"
    # K, or "auto": K in 0..AUTO_MAX_K chosen each step for goodput. None: the default (above).
    num_speculative_tokens: int | str | None = None
    acceptance: str = "exact"  # or "relaxed:LAMBDA": lossy, Yin et al. 2024 (EngineConfig.acceptance)
    tree_budget: int = 0  # P > 0: a draft tree of at most P nodes per row per step, K deep (EngineConfig.tree_budget)
    draft_assist: str = "none"  # "ngram": n-gram lookup drafts for the draft model (three levels; raysd.engine.hierarchy)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    batch_size: int = 16  # rows per call on a replica (split into two pipelined micro-batches)
    replicas: int = 1  # draft/target actor pairs running in parallel
    num_gpus_per_actor: float = 0.0
    num_cpus_per_actor: float | None = None  # None: auto (resolve_actor_cpus; 1 on an existing cluster)
    placement_strategy: str = "STRICT_PACK"  # a replica's draft and target: one node; SPREAD: over nodes
    rows_per_file: int = 1024  # completed rows buffered per output Parquet file
    address: str | None = None  # an existing Ray cluster; None starts a local one
    overwrite: bool = False
    quiet: bool = False
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False  # unpickle .bin/.pt model weights (runs code from the file): trusted files only

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
        need(bool(self.target) and self.target not in (NGRAM, NO_DRAFT), f"--target must name a model, got {self.target!r}")
        need(bool(self.draft), "--draft must not be empty (use 'none' for plain decoding)")
        try:
            parse_acceptance(self.acceptance)
        except ValueError as exc:
            raise JobError(f"--acceptance: {exc}") from None
        for flag, dtype in (("--target-dtype", self.target_dtype), ("--draft-dtype", self.draft_dtype)):
            need(dtype in DTYPE_NAMES, f"{flag} must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        k = self.num_speculative_tokens
        need(k == AUTO or (isinstance(k, int) and 0 <= k <= 64), f"--num-speculative-tokens must be 'auto' or in 0..64, got {k!r}")
        P = self.tree_budget
        need(isinstance(P, int) and 0 <= P <= 256, f"--tree-budget must be in 0..256 (0: a chain), got {P!r}")
        need(not P or self.draft != NO_DRAFT, "--tree-budget needs a drafter (a draft model, an EAGLE draft or ngram), not none")
        need(not P or self.num_speculative_tokens != 0, "--tree-budget needs --num-speculative-tokens >= 1 (the tree's depth)")
        need(not P or self.acceptance == "exact", "--tree-budget verifies exactly: use --acceptance exact")
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
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.replicas >= 1, f"--replicas must be >= 1, got {self.replicas}")
        need(self.num_gpus_per_actor >= 0, f"--num-gpus-per-actor must be >= 0, got {self.num_gpus_per_actor}")
        need(
            self.num_gpus_per_actor <= 1 or self.num_gpus_per_actor == int(self.num_gpus_per_actor),
            f"--num-gpus-per-actor above 1 must be whole, got {self.num_gpus_per_actor}",
        )
        if self.num_cpus_per_actor is not None:
            need(self.num_cpus_per_actor >= 0, f"--num-cpus-per-actor must be >= 0, got {self.num_cpus_per_actor}")
            need(
                self.num_cpus_per_actor > 0 or self.num_gpus_per_actor > 0,
                "--num-cpus-per-actor and --num-gpus-per-actor cannot both be 0",
            )
        need(self.placement_strategy in PLACEMENT_STRATEGIES,
             f"--placement-strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}")
        need(self.rows_per_file >= 1, f"--rows-per-file must be >= 1, got {self.rows_per_file}")

    @property
    def draft_is_model(self) -> bool:
        return self.draft not in (NGRAM, NO_DRAFT)

    @property
    def actor_cpus(self) -> tuple[float, float]:
        """(target, draft) actor CPUs of a replica. A model-free drafter (n-gram lookup, none) runs
        inside the target actor (DrafterSpec.colocated) and its sliver is never placed, so the
        target's CPUs are the replica's; `auto` left unresolved (an
        existing cluster, whose nodes this job does not own) is 1 per model actor."""
        cpus = 1.0 if self.num_cpus_per_actor is None else self.num_cpus_per_actor
        return cpus, (cpus if self.draft_is_model else MODEL_FREE_DRAFT_CPUS)

    def resolve_actor_cpus(self, local_cores: int | None) -> "GenerateConfig":
        """`--num-cpus-per-actor auto` made a number. On a Ray this job starts on this machine
        (`local_cores` known) without GPUs, the model actors share the machine's cores: each
        replica's target and draft model get an equal share, the target all of it with a
        model-free drafter. torch runs as many threads as its actor has CPUs (Ray sets
        OMP_NUM_THREADS), and on this 2-core CPU a target with both cores decodes 1.8x faster
        than with one (docs/benchmarks.md, Benchmark 6). Elsewhere (GPUs, or a cluster) 1."""
        if self.num_cpus_per_actor is not None:
            return self
        cpus = 1.0
        if local_cores and self.num_gpus_per_actor == 0:
            models = self.replicas * (2 if self.draft_is_model else 1)
            cpus = float(max(1, local_cores // models))
        return dataclasses.replace(self, num_cpus_per_actor=cpus)

    @property
    def adaptive_speculation(self) -> bool:
        return self.num_speculative_tokens == AUTO and self.draft != NO_DRAFT

    @property
    def effective_num_speculative_tokens(self) -> int:
        """K as run (the largest K under 'auto'): plain decoding drafts nothing."""
        if self.draft == NO_DRAFT:
            return 0
        return AUTO_MAX_K if self.num_speculative_tokens == AUTO else self.num_speculative_tokens

    def fingerprint(self) -> dict:
        """What must match for a re-run to resume into the same output (everything that changes a row)."""
        keys = ("prompt_column", "id_column", "split", "chat_template", "target", "target_dtype", "draft", "draft_dtype",
                "num_speculative_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "seed")
        fingerprint = {k: getattr(self, k) for k in keys}
        if self.acceptance != "exact":  # absent when exact, so outputs written before the flag still resume
            fingerprint["acceptance"] = self.acceptance
        if self.tree_budget:  # likewise absent for a chain
            fingerprint["tree_budget"] = self.tree_budget
        if self.draft_assist != "none":  # and for two levels (the assist changes the seeded samples)
            fingerprint["draft_assist"] = self.draft_assist
        return fingerprint

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
