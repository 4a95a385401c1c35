"""notebooks/throughput_study.ipynb runs top to bottom on a tiny study (so it cannot rot)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "throughput_study.ipynb"


def test_notebook_executes_on_a_tiny_study(tiny_study, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("RAYSD_STUDY_PARQUET", str(tiny_study["path"]))  # read by the parameter cell
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4
    assert any(str(tiny_study["path"]) in o.get("text", "") for o in outputs)


def test_committed_notebook_has_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs for c in code[1:]), "commit the notebook with its outputs"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
