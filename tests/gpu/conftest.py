"""GPU tests: collected everywhere, run only where CUDA is available.

Every test under tests/gpu is marked `gpu` and skipped cleanly on a machine without
CUDA, so `python -m pytest tests/gpu -q` on the CPU machine reports them all skipped.
`RAYSD_GPU_TESTS_ON_CPU=1` runs them on the CPU instead (same bf16 arithmetic, no
CUDA kernels): a dry run of the test code itself, not a GPU result.
See docs/contributing/gpu_runbook.md for how to run them on a lent GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.gpu_helpers import DEVICE, RUNNABLE, SKIP_REASON

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where torch.cuda.is_available() is False")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skipif(not RUNNABLE, reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _exact_fp32_matmuls():
    """fp32 references on CUDA must be fp32, not TF32 (TF32 rounds operands to 10 bits)."""
    if DEVICE.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def _graphs_without_compiling(monkeypatch):
    """On CUDA an engine replays CUDA graphs and compiles its forwards by default; compiling every
    test's models would take the session's minutes, so here the default graphs run uncompiled kernels
    and the tests that compile say so (compile=True)."""
    import raysd.models.runner

    monkeypatch.setattr(raysd.models.runner, "AUTO_COMPILE", False)


def pytest_runtest_logreport(report):
    """A failure's traceback at once, not at the session's end: a later hang (a Ray shutdown at a
    module's teardown) and a time limit on the run would swallow the summary."""
    if report.failed:
        print(f"\n{report.nodeid} ({report.when}) FAILED\n{report.longreprtext}", flush=True)
