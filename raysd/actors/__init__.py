"""A replica's model actors on Ray: its target and drafter in one actor, or each in its own with
drafting overlapped with batched verification (raysd.actors.coordinator says which, and how).

The names below load on first use (PEP 562): `raysd.actors.local`, which a job's driver imports
to start Ray, then costs no torch and transformers import (seconds of CPU on the job's start).
"""

import importlib

_EXPORTS = {
    "ActorResources": "raysd.actors.settings",
    "CoordinatorConfig": "raysd.actors.settings",
    "RunOutput": "raysd.actors.coordinator",
    "SpecCoordinator": "raysd.actors.coordinator",
    "DrafterSpec": "raysd.actors.wire",
    "TransferStats": "raysd.actors.wire",
    "decode_proposal": "raysd.actors.proposals",
    "encode_proposal": "raysd.actors.proposals",
    "pickled_nbytes": "raysd.actors.wire",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
