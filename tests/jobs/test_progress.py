"""The driver's progress line: while Ray starts and the models load it says the job
is starting, not "0 rows generated, 0 written, 0 already there; 0.0 tok/s"."""

import re
import time

from raysd.jobs import runner
from raysd.jobs.runner import progress_text

_PROGRESS = re.compile(r"(\d+) rows generated, (\d+) written")  # what tests/reliability/chaos.py parses


def test_line_says_starting_until_the_first_row():
    for totals in ({}, {"rows_read": 64}, {"rows_read": 64, "rows_generated": 0, "tokens": 0}):
        line = progress_text(totals, 12.3)
        assert line.startswith("raysd generate: starting (12s)") and "loading the models" in line, line
        assert "tok/s" not in line and not _PROGRESS.search(line), line
    assert "(64 rows read)" in progress_text({"rows_read": 64}, 1.0)


def test_line_counts_once_work_is_done():
    line = progress_text({"rows_read": 64, "rows_generated": 8, "rows_written": 4, "tokens": 100,
                          "drafted": 10, "accepted": 7}, 20.0)
    assert line == "raysd generate: 8 rows generated, 4 written, 0 already there; 5.0 tok/s, acceptance 0.700"
    assert _PROGRESS.search(line).groups() == ("8", "4")
    resumed = progress_text({"rows_read": 64, "rows_skipped": 64}, 2.0)  # everything already in the output
    assert resumed.startswith("raysd generate: 0 rows generated, 0 written, 64 already there;"), resumed


def test_first_line_comes_at_once_and_says_starting(monkeypatch, capsys):
    monkeypatch.setattr(runner, "_PROGRESS_EVERY_S", 3600.0)
    monkeypatch.setattr(runner._Progress, "line", lambda self: progress_text({}, time.perf_counter() - self.started))
    progress = runner._Progress(stats=None, started=time.perf_counter(), quiet=False)
    try:
        deadline = time.monotonic() + 10
        err = ""
        while "\n" not in err and time.monotonic() < deadline:  # not after _PROGRESS_EVERY_S
            time.sleep(0.05)
            err += capsys.readouterr().err
    finally:
        progress.close()
    assert err.splitlines()[0].startswith("raysd generate: starting (0s)"), err
    assert not runner._Progress(stats=None, started=0.0, quiet=True).thread  # --quiet: no line at all
