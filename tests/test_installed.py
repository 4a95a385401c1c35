"""raysd as `pip install` leaves it, run from a directory outside the checkout: what its commands
read by default ships with the package (the distilled drafts), or the command says in one line
which flag to pass (`raysd study`'s prompts, which live beside a checkout only)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package built as a wheel from this checkout and installed (no dependencies) into a
    directory of its own; (the environment that imports it from there, a working directory
    outside the checkout)."""
    root = tmp_path_factory.mktemp("installed")
    src, wheels, site, elsewhere = root / "src", root / "wheels", root / "lib" / "site", root / "work"
    elsewhere.mkdir()
    # The build's own copy of the sources: setuptools writes build/ and *.egg-info beside them.
    shutil.copytree(ROOT / "raysd", src / "raysd", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   timeout=600, cwd=root)
    [wheel] = wheels.glob("raysd-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=600, cwd=root)
    env = {k: v for k, v in os.environ.items() if k not in ("RAYSD_SPEC_BENCH", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)  # ahead of the checkout's editable install, if any
    return env, elsewhere, site


def run(installed, *code_or_args: str) -> subprocess.CompletedProcess:
    env, cwd, _ = installed
    return subprocess.run([sys.executable, *code_or_args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_imports_the_installed_copy_and_its_shipped_drafts(installed):
    _, _, site = installed
    out = run(installed, "-c", "import raysd; from raysd.models.loading import distilled_draft_dir, eagle_draft_dir; "
                               "from raysd.models.names import DEFAULT_DRAFT, DEFAULT_EAGLE; "
                               "print(raysd.__file__); print(distilled_draft_dir(DEFAULT_DRAFT)); print(eagle_draft_dir(DEFAULT_EAGLE))")
    assert out.returncode == 0, out.stderr[-2000:]
    paths = [Path(line) for line in out.stdout.split()]
    assert all(site in p.parents for p in paths), paths
    assert (paths[1] / "draft.safetensors").is_file() and (paths[2] / "eagle.safetensors").is_file()


def test_study_without_prompts_names_the_flag(installed):
    out = run(installed, "-m", "raysd", "study", "--draft", "ngram")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raysd study: no prompt file") and "--prompts" in lines[0], out.stderr
