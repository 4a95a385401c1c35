"""What a job prints: --quiet only the summary; the default raysd's own progress
(a line rewritten in place on a terminal, a line every 10 s elsewhere) and nothing of Ray's;
--verbose Ray Data's own progress and Ray's messages too."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from raysd.jobs import runner
from raysd.jobs.runner import _data_context, _duration, short_progress_text
from tests.jobs.conftest import token_prompts

ROOT = Path(__file__).resolve().parents[2]


def test_ray_data_progress_and_console_per_mode():
    from ray.data import DataContext

    ctx = DataContext.get_current()
    consoles = [h for h in logging.getLogger("ray.data").handlers if h.name == "console"]
    assert consoles, "ray.data's logging config has a console handler"
    before = (ctx.enable_progress_bars, [h.level for h in consoles])
    for quiet, verbose, bars, level in ((True, False, False, logging.CRITICAL + 1), (False, False, False, logging.WARNING),
                                        (False, True, True, before[1][0])):
        with _data_context(quiet, verbose) as c:
            assert c.enable_progress_bars is bars and c.execution_options.preserve_order
            assert all(h.level == level for h in consoles), (quiet, verbose)
            # Ray Data's "Progress bars disabled" warning is for the progress raysd turned off itself.
            progress_level = logging.getLogger("ray.data._internal.progress").level
            assert progress_level == logging.NOTSET if verbose else progress_level == logging.ERROR
        assert (ctx.enable_progress_bars, [h.level for h in consoles]) == before  # restored


class _Terminal:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def _progress(monkeypatch, tty: bool, totals: dict, verbose: bool = False):
    monkeypatch.setattr(runner, "_TTY_EVERY_S", 0.02)
    monkeypatch.setattr(runner, "_PROGRESS_EVERY_S", 0.02)
    # The first sample finished 10 s before each read: 10 rows in 10 s, 20 more to go.
    monkeypatch.setattr(runner._Progress, "totals", lambda self: {**totals, "first_row_at": time.time() - 10.0})
    stream = _Terminal(tty)
    progress = runner._Progress(stats=None, started=time.perf_counter() - 20.0, quiet=False, todo=30, stream=stream,
                                verbose=verbose)
    time.sleep(0.3)
    progress.close()
    return stream.text


def test_a_terminal_gets_one_line_rewritten_in_place(monkeypatch):
    totals = {"rows_generated": 10, "tokens": 200, "drafted": 10, "accepted": 4}
    text = _progress(monkeypatch, True, totals)
    assert text.count("\r") >= 3 and text.endswith("\n") and text.count("\n") == 1  # ended once, at close
    line = text.split("\r")[1].removesuffix("\x1b[K")
    assert line == "raysd generate: 10/30 rows, 10.0 tok/s, acceptance 0.400, ETA 20s", line
    # Not a terminal (a log, `ray job submit`), or --verbose (Ray Data draws its own): plain lines.
    for tty, verbose in ((False, False), (True, True)):
        text = _progress(monkeypatch, tty, totals, verbose)
        assert "\r" not in text and text.count("\n") >= 3
        assert text.splitlines()[0] == ("raysd generate: 10 rows generated, 0 written, 0 already there; 10.0 tok/s, "
                                        "acceptance 0.400; ETA 20s")


def test_progress_text_pieces():
    assert [_duration(s) for s in (0.4, 59, 61, 3725)] == ["0s", "59s", "1m01s", "1h02m"]
    assert short_progress_text({"rows_generated": 3, "tokens": 30}, 10.0, None, None) == (
        "raysd generate: 3 rows, 3.0 tok/s, acceptance n/a, ETA n/a")
    assert short_progress_text({}, 5.0, 10, None).startswith("raysd generate: starting (5s)")


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raysd", "generate", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_quiet_prints_the_summary_alone_and_the_default_only_raysds_lines(tmp_path, model_dirs):
    """The CLI as users run it, stdout and stderr not terminals (as under `ray job submit`): --quiet
    prints the summary on stdout and nothing else, the default adds raysd's own lines on stderr
    and nothing of Ray's (its startup warnings, Ray Data's execution plan and operator table, the
    C++ core worker's lines). Measured on 24 rows: 1 + 0 lines, 1 + 5 lines (--verbose: 1 + 63;
    docs/jobs.md, "Progress and metrics")."""
    target, _ = model_dirs
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(token_prompts(8))))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    kept_before = set(Path(tempfile.gettempdir()).glob("raysd-ray-stderr-*"))  # Ray's own lines, while a job runs
    common = ["--input", str(inp), "--target", target, "--draft", "ngram", "--max-new-tokens", "6", "--batch-size", "4"]
    quiet = _run([*common, "--output", str(tmp_path / "q"), "--quiet"], env)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stderr == "", quiet.stderr
    [summary] = quiet.stdout.splitlines()
    assert summary.startswith(f"raysd generate: 8 rows in {tmp_path / 'q'} ")

    # The default, on the same output: a resume with nothing left to generate (no model loads, so
    # cheaper), which still starts Ray and the whole pipeline, its actor pools and their warnings.
    default = _run([*common, "--output", str(tmp_path / "q")], env)
    assert default.returncode == 0, default.stderr[-3000:]
    assert len(default.stdout.splitlines()) == 1 and " (0 generated now, 8 already there;" in default.stdout
    lines = default.stderr.splitlines()
    assert lines[0] == "raysd generate: starting Ray" and len(lines) >= 2, default.stderr
    assert all(line.startswith("raysd generate: ") for line in lines), default.stderr
    # A job that succeeded leaves no file of Ray's lines (they are in Ray's driver log as well).
    assert set(Path(tempfile.gettempdir()).glob("raysd-ray-stderr-*")) <= kept_before
