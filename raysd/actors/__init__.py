"""Draft and target in separate Ray actors, drafting overlapped with batched verification."""

from raysd.actors.coordinator import ActorResources, CoordinatorConfig, RunOutput, RunReport, SpecCoordinator
from raysd.actors.model_actors import DrafterSpec
from raysd.actors.transport import TransferStats, decode_proposal, encode_proposal, pickled_nbytes

__all__ = [
    "ActorResources",
    "CoordinatorConfig",
    "DrafterSpec",
    "RunOutput",
    "RunReport",
    "SpecCoordinator",
    "TransferStats",
    "decode_proposal",
    "encode_proposal",
    "pickled_nbytes",
]
