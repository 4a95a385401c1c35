"""The acceptance rule by name: "exact" (Leviathan et al. 2023, Algorithm 1) or "relaxed:LAMBDA"
(raysd.core.rejection). Parsed here, without torch, so that a job's config can be checked anywhere."""

from __future__ import annotations


def parse_acceptance(rule: str) -> float | None:
    """"exact" -> None; "relaxed:LAMBDA" -> LAMBDA in [0, 1]; anything else is a one-line error."""
    if rule == "exact":
        return None
    kind, _, value = rule.partition(":")
    try:
        lam = float(value)
    except ValueError:
        lam = float("nan")
    if kind != "relaxed" or not 0.0 <= lam <= 1.0:
        raise ValueError(f"acceptance must be 'exact' or 'relaxed:LAMBDA' with LAMBDA in [0, 1], got {rule!r}")
    return lam
