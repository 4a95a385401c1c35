"""Where and with what a result was measured: the machine, its load, the versions, the commit.

Every result file carries these (bench.record), because a figure without its machine and load
cannot be compared with another: CPUs differ in SIMD (AVX2 against AVX-512), and on a machine
shared with other work the load moves tokens/s by tens of percent.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni")
PACKAGES = ("torch", "transformers", "ray")


def _cpuinfo(key: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


def machine() -> dict:
    """CPU model, cores, SIMD flags, torch threads, and the GPU if torch sees one."""
    import torch

    flags = (_cpuinfo("flags") or "").split()
    out = {"cpu": _cpuinfo("model name") or platform.processor() or "?", "cores": os.cpu_count(),
           "simd": [f for f in SIMD_FLAGS if f in flags], "torch_threads": torch.get_num_threads(), "gpu": None}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def git_commit() -> str | None:
    """The checkout's commit, with "+dirty" when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def versions() -> dict:
    """Python, torch, transformers, ray (read from their metadata: nothing imported) and raysd's commit."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["raysd_commit"] = git_commit()
    return out
