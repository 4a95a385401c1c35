"""The output schema of `raysd generate`: one Parquet row per sample of each input row (one per
row unless --num-samples or a `num_samples` column asks for more), keyed (id, sample_index).

Column order: the id column, the input's other columns (passed through with their
input types), then GENERATED_FIELDS. docs/jobs.md documents every column.
"""

from __future__ import annotations

import pyarrow as pa

FINISH_REASONS = ("stop", "length", "error")

# One entry of `top_logprobs`: a token id and the target's log-probability of it.
TOP_LOGPROB = pa.struct([pa.field("id", pa.int32(), nullable=False), pa.field("logprob", pa.float64(), nullable=False)])

GENERATED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("sample_index", pa.int32(), nullable=False),  # 0..N-1: which of the prompt's N samples
    pa.field("generated_text", pa.string()),  # null when the model has no tokenizer, or on error
    pa.field("generated_token_ids", pa.list_(pa.int32()), nullable=False),
    # --logprobs: the target's log-probability of each generated token; null without it, or on error.
    pa.field("generated_logprobs", pa.list_(pa.float64())),
    # --top-logprobs N: per generated token, the N most likely (id, logprob); null without it.
    pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),
    pa.field("num_prompt_tokens", pa.int32(), nullable=False),
    pa.field("num_generated_tokens", pa.int32(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
    pa.field("error", pa.string()),  # null on success
    # The engine's per-sample statistics (SpecDecodeStats.to_dict).
    pa.field("num_spec_steps", pa.int32(), nullable=False),
    pa.field("num_draft_tokens", pa.int32(), nullable=False),
    pa.field("num_accepted_draft_tokens", pa.int32(), nullable=False),
    pa.field("draft_acceptance_rate", pa.float64()),  # null when nothing was drafted
    pa.field("mean_acceptance_length", pa.float64()),  # null when no step ran
    pa.field("acceptance_histogram", pa.list_(pa.int32()), nullable=False),  # [K + 1]
    pa.field("accepted_per_position", pa.list_(pa.int32()), nullable=False),  # [K]
    pa.field("alpha_estimate", pa.float64()),
    pa.field("mean_speculation_length", pa.float64()),  # K offered per step (varies under --num-speculative-tokens auto)
    pa.field("num_steps_without_drafts", pa.int32(), nullable=False),  # steps with K = 0 (plain decoding)
    pa.field("mean_nodes_verified", pa.float64()),  # draft nodes the target verified per step (a chain: drafts)
    pa.field("mean_accepted_depth", pa.float64()),  # depth of the accepted path per step (a chain: drafts accepted)
    pa.field("num_branch_accepts", pa.int32(), nullable=False),  # accepted tree nodes other than the draft's sample (0: chain)
    # --beam-width W: drafted tree nodes that lay on a beam the target's beam search selected (0 otherwise),
    # and the row's hypothesis score, sum of log-probs / length ** length_penalty (null without beams).
    pa.field("num_beam_nodes_selected", pa.int32(), nullable=False),
    pa.field("beam_score", pa.float64()),
    # Provenance.
    pa.field("target_model", pa.string(), nullable=False),
    pa.field("draft_model", pa.string(), nullable=False),  # a model, "ngram" or "none"
    pa.field("target_dtype", pa.string()),  # the dtype the target ran in ("auto" resolved); null on an error row
    pa.field("draft_dtype", pa.string()),  # the draft model's; null without one (ngram, suffix, none) or on error
    pa.field("num_speculative_tokens", pa.int32(), nullable=False),
    pa.field("acceptance", pa.string(), nullable=False),  # the verification rule: exact, or relaxed:LAMBDA (lossy)
    pa.field("tree_budget", pa.int32(), nullable=False),  # P: draft tree nodes per step (0: a chain of K drafts)
    pa.field("seed", pa.int64(), nullable=False),  # the row's effective seed
    # Timing.
    pa.field("latency_s", pa.float64(), nullable=False),  # from the row's batch start to its last token
)
GENERATED_NAMES = frozenset(f.name for f in GENERATED_FIELDS)

# Optional per-row input columns that override the job's value for that row (a null keeps it;
# `stop` adds the row's stop strings to the job's). An input `seed` column is an override too;
# its value is reported in the output `seed` (of sample 0; the others derive from it).
OVERRIDE_COLUMNS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_samples")


# The most samples of one row: a replica holds a block's samples (requests, outputs) at once.
MAX_NUM_SAMPLES = 1024


def is_int(x) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count or a seed here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def num_samples_of(value, default: int) -> tuple[int, str | None]:
    """(N, None) for a row's `num_samples` value (None: the job's `default`), or (1, why not): a
    bad value is one error row, sample 0. The id stage (resume) and the replicas count alike."""
    if value is None:
        return default, None
    if not is_int(value) or not 1 <= value <= MAX_NUM_SAMPLES:
        return 1, f"num_samples must be an integer in 1..{MAX_NUM_SAMPLES}, got {value!r}"
    return value, None


def output_schema(id_field: pa.Field, passthrough: list[pa.Field]) -> pa.Schema:
    """The explicit output schema for an input with this id column and these other columns."""
    return pa.schema([id_field.with_name(id_field.name), *passthrough, *GENERATED_FIELDS])


def passthrough_fields(input_schema: pa.Schema, id_column: str) -> list[pa.Field]:
    """The input columns copied to the output unchanged: all but the id and the names the output owns.

    An input `seed` column is consumed as an override (the output `seed` reports it).
    """
    return [f for f in input_schema if f.name != id_column and f.name not in GENERATED_NAMES]


def reserved_clashes(input_schema: pa.Schema) -> list[str]:
    """Input columns whose names the output owns (other than the `seed` override)."""
    return [f.name for f in input_schema if f.name in GENERATED_NAMES and f.name != "seed"]


# The summary's counts and the output columns they add up (`row_totals`).
SUMMED_COLUMNS = {"tokens": "num_generated_tokens", "drafted": "num_draft_tokens", "accepted": "num_accepted_draft_tokens",
                  "steps": "num_spec_steps", "branch_accepts": "num_branch_accepts",
                  "beam_nodes_selected": "num_beam_nodes_selected"}
TOTALS_COLUMNS = ("finish_reason", *SUMMED_COLUMNS.values())


def row_totals(table: pa.Table | None) -> dict:
    """{rows, failed (error rows), tokens, drafted, accepted, steps, branch_accepts} over output rows
    (all 0 for None). A column a part lacks (written before it existed) adds 0."""
    totals = dict.fromkeys(("rows", "failed", *SUMMED_COLUMNS), 0)
    if table is None or not table.num_rows:
        return totals
    import pyarrow.compute as pc

    totals["rows"] = table.num_rows
    totals["failed"] = int(pc.sum(pc.equal(table.column("finish_reason"), "error")).as_py() or 0)
    for key, name in SUMMED_COLUMNS.items():
        if name in table.column_names:
            totals[key] = int(pc.sum(table.column(name)).as_py() or 0)
    return totals
