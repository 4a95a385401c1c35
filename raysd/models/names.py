"""Names of models, draft kinds, dtypes and runners, and a rank's place in a tensor-parallel
group: what a config check needs, without torch.

`raysd.jobs.config` validates a job from these alone, and a replica's coordinator
(raysd.actors.coordinator) builds its actors' configs from them, so the Ray Data actors that only
move rows (the id stage, a replica) import no torch or transformers (seconds each, paid before
the first token). `raysd.models.loading` loads what they name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"  # the embedded default, as users name it
DEFAULT_DRAFT = "smollm2-135m-instruct-draft"  # its distilled draft, shipped in raysd/data (raysd distill)
DEFAULT_EAGLE = "smollm2-135m-instruct-eagle"  # its EAGLE feature draft, shipped in raysd/data/eagle (raysd distill --kind eagle)

# The draft kinds, and how each is named and loaded. One place: the jobs layer, the actors and
# the CLI ask `draft_kind`; the engine's drafters (raysd.engine.drafters) implement them.
NO_DRAFT, NGRAM, SUFFIX = "none", "ngram", "suffix"
MODEL_FREE = (NO_DRAFT, NGRAM, SUFFIX)  # --draft values naming no model
DRAFT_KINDS = {
    "none": "no drafter: plain autoregressive decoding through the same engine (`--draft none`)",
    "ngram": "prompt lookup in the row's own tokens, no model (`--draft ngram`)",
    "suffix": "suffix decoding over the row's own tokens and every row the replica has finished, no model "
              "(`--draft suffix`, raysd.engine.suffix)",
    "model": "a smaller causal LM, by Hugging Face id or path, loaded by `load_model`",
    "layers": "a raysd distilled draft (`raysd distill --kind layers`): a directory with raysd_draft.json, "
              "or DEFAULT_DRAFT; its own layers on the target's embedding and head (raysd.models.layer_draft)",
    "eagle": "a raysd EAGLE feature draft (`raysd distill --kind eagle`): a directory with raysd_eagle.json, or "
             "DEFAULT_EAGLE; reads the target's last-layer hidden states, loaded by `load_eagle_draft` "
             "(raysd.models.eagle_draft)",
}

EAGLE_CONFIG_FILE = "raysd_eagle.json"  # in an EAGLE draft's directory (raysd.models.eagle_draft)
DRAFT_CONFIG_FILE = "raysd_draft.json"  # in a distilled draft's directory (raysd.models.layer_draft)
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # ModelSpec.dtype; raysd.models.loading maps them to torch dtypes
# "auto": resolved where the model loads (raysd.models.loading.resolve_dtype): bfloat16 on a CUDA
# device (float16 if the GPU lacks bf16), float32 on the CPU.
AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, *DTYPE_NAMES)  # what --target-dtype / --draft-dtype / ModelSpec.dtype take


def draft_kind(name: str) -> str:
    """Which of DRAFT_KINDS a `--draft` value names (no file is read beyond a directory check)."""
    if name in MODEL_FREE:
        return name
    if name == DEFAULT_EAGLE or (Path(name).expanduser() / EAGLE_CONFIG_FILE).is_file():
        return "eagle"
    if name == DEFAULT_DRAFT or (Path(name).expanduser() / DRAFT_CONFIG_FILE).is_file():
        return "layers"
    return "model"


# The KV-cache runners (raysd.models.runner): "auto" takes the static one where the model supports it.
RUNNER_KINDS: tuple[str, ...] = ("auto", "static", "dynamic")
DRAFT_ASSISTS = ("none", "ngram")  # what may draft for the draft model (raysd.engine.draft_assist): nothing (two levels), n-gram lookup


def check_runner_kind(kind: str, cuda_graphs: bool = False, compile: bool = False) -> None:
    """A runner kind, and the options that only the static runner takes."""
    if kind not in RUNNER_KINDS:
        raise ValueError(f"runner must be one of {RUNNER_KINDS}, got {kind!r}")
    if (cuda_graphs or compile) and kind == "dynamic":
        raise ValueError("cuda_graphs and compile need the static runner (runner='auto' or 'static'), not 'dynamic'")


def check_draft_assist(kind: str) -> None:
    if kind not in DRAFT_ASSISTS:
        raise ValueError(f"draft assist must be one of {DRAFT_ASSISTS}, got {kind!r}")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank `rank` of `world_size`."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"tensor-parallel world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank must be in 0..{self.world_size - 1}, got {self.rank}")
