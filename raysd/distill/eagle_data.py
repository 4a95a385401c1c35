"""Training data for the EAGLE feature draft (`raysd distill --kind eagle`).

The target continues each prompt (HF generate, greedy or sampled at temperature 1) and a forward hook on
its final norm records its last-layer hidden state (before the norm) at every position, prompt and
continuation, in the same pass: no second forward. The target's next-token distribution at every
position is its final norm and head applied to that state, so it is not stored: training recomputes it
(over the draft's head tokens only, which is all the loss needs).

Prompts: Spec-Bench style files (raysd.distill.data.read_prompts), token-id prompts (a `prompt` field
holding a list of ids, for targets without a tokenizer), and code: windows of the Python standard
library's own source files, continued as raw text (`code_prompts`).
"""

from __future__ import annotations

import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from raysd.distill.data import Prompt
from raysd.models.eagle_draft import final_norm


@dataclass
class FeatureExample:
    """One sequence x_0..x_{n-1} (prompt + the target's continuation) with, for t = 0..n-2, the target's
    last-layer pre-norm hidden state f_t at position t (from which its distribution of x_{t+1} follows)."""

    input_ids: list[int]
    prompt_len: int
    features: torch.Tensor  # [n-1, H] bfloat16
    task: str = "default"
    temperature: float = 0.0

    def to_dict(self) -> dict:
        return {"input_ids": torch.tensor(self.input_ids, dtype=torch.int64), "prompt_len": self.prompt_len,
                "features": self.features, "task": self.task, "temperature": self.temperature}

    @staticmethod
    def from_dict(d: dict) -> "FeatureExample":
        return FeatureExample(d["input_ids"].tolist(), int(d["prompt_len"]), d["features"], d["task"],
                              float(d.get("temperature", 0.0)))


class FeatureRecorder:
    """Context manager: records the input of the target's final norm at every forward (prefill and decode)."""

    def __init__(self, target):
        self.norm = final_norm(target)
        self.calls: list[torch.Tensor] = []
        self._handle = None

    def __enter__(self):
        self.calls = []
        self._handle = self.norm.register_forward_hook(lambda mod, args, out: self.calls.append(args[0].detach()))
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        return False


@torch.no_grad()
def generate_feature_data(
    target,
    prompts: Sequence[Sequence[int]],
    tasks: Sequence[str] | None = None,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    batch_size: int = 8,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[FeatureExample]:
    """The target continues every prompt (greedy, or sampled at temperature 1); its pre-norm last-layer
    hidden states are kept at every position."""
    if temperature not in (0.0, 1.0):
        raise ValueError(f"continuations are generated at temperature 0 or 1, got {temperature}")
    tasks = list(tasks) if tasks is not None else ["default"] * len(prompts)
    device = next(target.parameters()).device
    eos = set(int(e) for e in eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, FeatureExample] = {}
    start, done_tokens = time.perf_counter(), 0
    for b0 in range(0, len(order), batch_size):
        idx = order[b0:b0 + batch_size]
        L = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), L), pad_token_id, dtype=torch.int64)
        mask = torch.zeros(len(idx), L, dtype=torch.int64)
        for r, i in enumerate(idx):
            p = torch.as_tensor(list(prompts[i]), dtype=torch.int64)
            ids[r, L - len(p):], mask[r, L - len(p):] = p, 1
        torch.manual_seed(seed + b0)
        sample = (dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if temperature
                  else dict(do_sample=False, temperature=None, top_k=None, top_p=None))
        with FeatureRecorder(target) as rec:
            gen = target.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                                  min_new_tokens=1, return_dict_in_generate=True, pad_token_id=pad_token_id,
                                  eos_token_id=sorted(eos) or None, **sample)
        # call 0: the prefill [B, L, H]; call s >= 1: the decode step that read generated token s - 1
        states = torch.cat([c.float() for c in rec.calls], dim=1)  # [B, L + S - 1, H]
        cont = gen.sequences[:, L:].cpu()
        for r, i in enumerate(idx):
            toks = cont[r].tolist()
            T = next((t + 1 for t, tok in enumerate(toks) if tok in eos), len(toks))
            P = len(prompts[i])
            n = P + T
            feats = states[r, L - P:L - P + n - 1]  # positions 0..n-2
            out[i] = FeatureExample(list(prompts[i]) + toks[:T], P, feats.to("cpu", torch.bfloat16), tasks[i], temperature)
            done_tokens += T
        if log:
            log(f"eagle data (T={temperature:g}): {len(out)}/{len(prompts)} prompts, {done_tokens} continuation tokens, "
                f"{time.perf_counter() - start:.0f} s")
    return [out[i] for i in range(len(prompts))]


def save_feature_data(examples: Sequence[FeatureExample], path: str | Path, meta: dict | None = None) -> None:
    torch.save({"kind": "eagle", "examples": [ex.to_dict() for ex in examples], "meta": dict(meta or {})}, str(path))


def load_feature_data(path: str | Path) -> tuple[list[FeatureExample], dict]:
    blob = torch.load(str(path), weights_only=True)
    if blob.get("kind") != "eagle":
        raise ValueError(f"{path}: not EAGLE feature data (built by `raysd distill --kind eagle`)")
    return [FeatureExample.from_dict(d) for d in blob["examples"]], blob.get("meta", {})


# ---------------------------------------------------------------------------- code prompts


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The Python standard library's own .py files (tests and site-packages excluded), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo", "ensurepip")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def is_heldout_code(path: Path, root: Path, fraction: float = 0.1) -> bool:
    """A fixed, content-independent split of the source files: about `fraction` of them are held out."""
    return zlib.crc32(str(path.relative_to(root)).encode()) % 1000 < fraction * 1000


def code_prompts(n: int, *, heldout: bool = False, chars: int = 1200, root: str | Path | None = None,
                 heldout_fraction: float = 0.1, window: int = 0) -> list[Prompt]:
    """`n` code prompts: one window of about `chars` characters (whole lines, from a line fixed by the
    file's name) of each of `n` standard-library files spread evenly over the training (or held-out) files.
    `window` j > 0 takes the j-th window after that one (starting again at the file's top after one that ends it), so
    windows 0, 1, 2, ... of the same files are disjoint text while the file is long enough.
    Task "code"; fed as raw text (no chat template)."""
    if window < 0:
        raise ValueError(f"code window must be >= 0, got {window}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib_sources(root) if is_heldout_code(p, root, heldout_fraction) == heldout]
    files = [p for p in files if p.stat().st_size > 2 * chars]
    if n <= 0 or not files:
        return []
    picked = [files[int((i + 0.5) * len(files) / min(n, len(files)))] for i in range(min(n, len(files)))]
    out = []
    for p in picked:
        lines = p.read_text(errors="replace").splitlines(keepends=True)
        start = zlib.crc32(p.name.encode()) % max(1, len(lines) // 2)
        for _ in range(window + 1):
            text, i = "", start
            while i < len(lines) and not (text and len(text) + len(lines[i]) > chars):
                text += lines[i]
                i += 1
            start = i % len(lines)  # a window that ends the file: the next one starts at its top
        out.append(Prompt(text, "code", f"{p.relative_to(root)}#{window}" if window else str(p.relative_to(root)), raw=True))
    return out
