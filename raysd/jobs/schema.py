"""The output schema of `raysd generate`: one Parquet row per input row.

Column order: the id column, the input's other columns (passed through with their
input types), then GENERATED_FIELDS. docs/jobs.md documents every column.
"""

from __future__ import annotations

import pyarrow as pa

FINISH_REASONS = ("stop", "length", "error")

GENERATED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("generated_text", pa.string()),  # null when the model has no tokenizer, or on error
    pa.field("generated_token_ids", pa.list_(pa.int32()), nullable=False),
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
    # Provenance.
    pa.field("target_model", pa.string(), nullable=False),
    pa.field("draft_model", pa.string(), nullable=False),  # a model, "ngram" or "none"
    pa.field("num_speculative_tokens", pa.int32(), nullable=False),
    pa.field("acceptance", pa.string(), nullable=False),  # the verification rule: exact, or relaxed:LAMBDA (lossy)
    pa.field("tree_budget", pa.int32(), nullable=False),  # P: draft tree nodes per step (0: a chain of K drafts)
    pa.field("seed", pa.int64(), nullable=False),  # the row's effective seed
    # Timing.
    pa.field("latency_s", pa.float64(), nullable=False),  # from the row's batch start to its last token
)
GENERATED_NAMES = frozenset(f.name for f in GENERATED_FIELDS)

# Optional per-row input columns that override the job's value for that row. An
# input `seed` column is an override too; its value is reported in the output `seed`.
OVERRIDE_COLUMNS = ("max_new_tokens", "temperature", "seed")


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
