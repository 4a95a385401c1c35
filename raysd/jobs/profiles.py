"""Step-cost profiles for `--num-speculative-tokens auto`, measured once per model pair and machine.

Profiling times the target at K + 1 = 1..9 tokens and the draft at a few batch sizes inside the
actors: seconds of work that a job would repeat at every start, on every replica. The result
depends only on the models, their dtypes, the devices the actors run on and the shapes timed,
so it is kept in a small JSON file under `cache_dir()` keyed by exactly those and by
STEP_CODE_VERSION (the engine code's), and read back by the next job with the same key. Delete
the directory (or set RAYSD_CACHE_DIR) to measure again.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from raysd.core.speculation import StepCosts
from raysd.models.gguf_cache import cache_root, machine_entry, write_entry

# Step times depend on the engine's own code as well: bump this when a change moves them, so that
# profiles measured before it are measured again. 2: the verify's packed grouped-query attention
# (raysd.models.attention) made K + 1 tokens much cheaper than the profiles of version 1 say.
# 3: profiles time the runner the actors run (the static runner for Llama-family models), where
# versions 1 and 2 timed Hugging Face's DynamicCache runner whatever the actors ran.
# 4: float32 models on a CPU run oneDNN-prepacked linears (raysd.models.linear): a pass over
# 2-8 tokens per row costs far less against one over 1 token than version 3 measured.
# 5: the K of a profile are timed in interleaved rounds and fitted non-decreasing in K
# (raysd.models.profile): version 4's could time K = 1 below K = 0 when start-up work overlapped.
# 6: "auto" linear kernels are the faster of packed and stock as measured on the machine, no
# longer packed everywhere (on an Intel Xeon a step at batch 1 runs ~1.3x faster).
STEP_CODE_VERSION = 6


def cache_dir() -> Path:
    return cache_root() / "step_costs"


def cached_step_costs(key: dict, measure: Callable[[], StepCosts] | None) -> tuple[StepCosts | None, bool]:
    """(costs, True) from the cache when `key` (JSON-able) was profiled before here, else
    (measure(), False) after storing it. An unreadable cache entry is measured again.
    `measure` None: look only ((None, False) when nothing is cached), as `-k auto` does, which
    learns its costs from the job's own steps rather than profile before the first token."""
    path, full_key = machine_entry(cache_dir().name, {**key, "step_code": STEP_CODE_VERSION})
    try:
        stored = json.loads(path.read_text())
        costs = StepCosts(tuple(stored["batch_sizes"]), tuple(map(tuple, stored["target_s"])), tuple(stored["draft_s"]))
        return costs, True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if measure is None:
        return None, False
    costs = measure()
    try:
        write_entry(path, {**dataclasses.asdict(costs), "key": full_key})  # concurrent replicas never read half a file
    except OSError:
        pass  # a read-only home: profile every time, as before
    return costs, False
