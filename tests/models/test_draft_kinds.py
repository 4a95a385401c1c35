"""One place names the draft kinds (raysd.models.loading.DRAFT_KINDS); loading models,
drafts included, never imports the distillation code."""

import subprocess
import sys

from raysd.models.loading import DEFAULT_DRAFT, DRAFT_KINDS, draft_kind
from raysd.models.layer_draft import CONFIG_FILE


def test_draft_kind_of_each_name(tmp_path):
    assert set(DRAFT_KINDS) == {"none", "ngram", "suffix", "model", "layers", "eagle"}
    assert draft_kind("none") == "none" and draft_kind("ngram") == "ngram" and draft_kind("suffix") == "suffix"
    assert draft_kind(DEFAULT_DRAFT) == "layers"
    assert draft_kind("HuggingFaceTB/SmolLM2-135M-Instruct") == "model"
    assert draft_kind(str(tmp_path)) == "model"
    (tmp_path / CONFIG_FILE).write_text("{}")
    assert draft_kind(str(tmp_path)) == "layers"


def test_loading_imports_no_distillation_code():
    code = ("import sys; import raysd.models.loading, raysd.engine.engine, raysd.actors.model_actors; "
            "bad = sorted(m for m in sys.modules if m.startswith('raysd.distill')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
