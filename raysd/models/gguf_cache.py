"""GGUF files converted once per machine, then loaded as safetensors.

transformers reads a GGUF file in Python at every load: it parses the metadata twice (config,
then weights; the vocabulary alone is ~50,000 strings) and builds a tensor-name map per tensor.
For the embedded SmolLM2-135M that takes seconds (the tokenizer's conversion as well), and every
job would pay it in every model actor and replica, and again at every actor restart (docs/history/
benchmarks.md, Benchmark 6: start-up). raysd keeps what transformers produced (the model through
`save_pretrained`, float tensors in safetensors, so they read back bit for bit; the tokenizer as
tokenizer.json) and loads that the next time, in well under a second.

Where: `cache_root()/gguf` ($RAYSD_CACHE_DIR, default ~/.cache/raysd), one directory per GGUF
file (resolved path, size, mtime), what (model or tokenizer), dtype and the transformers and
gguf versions: a changed file or library converts again. `RAYSD_GGUF_CACHE=0` turns it off.
An entry is written to a temporary directory and renamed into place whole, so concurrent
loaders (a target and a draft actor starting together) never read half of one. A cache that
cannot be written or read is reported (a warning) and the file is converted as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

_DONE = "raysd_gguf_cache.json"  # written last, inside the temporary directory: an entry with it is whole


def cache_root() -> Path:
    """raysd's per-machine cache ($RAYSD_CACHE_DIR, default ~/.cache/raysd)."""
    return Path(os.environ.get("RAYSD_CACHE_DIR", Path.home() / ".cache" / "raysd"))


def machine() -> dict:
    """What makes timings of the same models differ between hosts: the key of what raysd measures
    once per machine (the linear-kernel choice, raysd.models.linear)."""
    import platform

    import torch

    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def machine_entry(kind: str, key: dict) -> tuple[Path, dict]:
    """Where raysd keeps what it measured on this machine for `key` (step costs, linear kernels):
    cache_root()/kind/<digest>.json, the digest over `key` and `machine()`; and that whole key."""
    full = {**key, "machine": machine()}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / kind / f"{digest}.json", full


def write_entry(path: Path, data: dict) -> None:
    """`data` as JSON at `path`, whole or not at all (a temporary file renamed into place), so
    concurrent processes never read half of one. Raises OSError where the cache is not writable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def enabled() -> bool:
    return os.environ.get("RAYSD_GGUF_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def entry_dir(gguf: Path, what: str, dtype: str) -> Path:
    """The cache directory of one conversion: its key is everything the converted files depend on."""
    import gguf as gguf_lib
    import transformers

    gguf = gguf.resolve()
    st = gguf.stat()
    key = {"file": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "what": what, "dtype": dtype,
           "transformers": transformers.__version__, "gguf": getattr(gguf_lib, "__version__", "?")}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "gguf" / f"{gguf.stem}-{what}-{dtype}-{digest}"


def cached(gguf: Path, what: str, dtype: str, convert: Callable[[], Any], load: Callable[[Path], Any]) -> Any:
    """`load(entry)` if this conversion is cached, else `convert()`, stored for next time.

    `convert()` returns an object with `save_pretrained(directory)` (a model or a tokenizer)."""
    if not enabled():
        return convert()
    directory = entry_dir(gguf, what, dtype)
    if (directory / _DONE).is_file():
        try:
            return load(directory)
        except Exception as exc:  # noqa: BLE001 - a damaged entry: say so, drop it, convert again
            logger.warning("raysd: cached conversion %s unreadable (%s: %s); converting %s again",
                           directory, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", gguf.name)
            shutil.rmtree(directory, ignore_errors=True)
    converted = convert()
    _store(directory, converted, {"gguf": str(gguf), "what": what, "dtype": dtype})
    return converted


def _store(directory: Path, converted: Any, about: dict) -> None:
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
        converted.save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps(about) + "\n")
        os.rename(tmp, directory)  # whole or not at all; fails if another loader got there first
    except OSError as exc:
        if not (directory / _DONE).is_file():  # not merely beaten to it by a concurrent loader
            logger.warning("raysd: cannot cache the conversion of %s in %s (%s); the next load converts again",
                           about["gguf"], directory.parent, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
