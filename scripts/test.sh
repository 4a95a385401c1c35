#!/usr/bin/env bash
# The whole test suite, as CI runs it: every test but those marked `alone` over two pytest
# workers (a test module stays on one worker, so its models and its Ray are shared by its
# tests), then the `alone` tests, two groups at a time (they kill processes and nodes mid-job
# on clusters of their own, so they stay apart from the other tests' Rays and models: a
# machine loaded by those made a restarted actor miss the test's wait). A group is a module, or
# the tests that start Rays of their own, which run one after another (tests/conftest.py).
# Arguments go to both runs, e.g. `bash scripts/test.sh -x` or `bash scripts/test.sh tests/jobs`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

pytest_run() {  # exit status 5 (no test selected, e.g. no `alone` test under the paths given) is fine
  local rc=0
  "$PY" -m pytest -q "$@" || rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]
}

start=$SECONDS
pytest_run -n "${RAYSD_TEST_WORKERS:-2}" --dist loadfile -m "not alone" "$@"
shared=$((SECONDS - start)); start=$SECONDS
pytest_run -n "${RAYSD_TEST_WORKERS:-2}" --dist loadgroup -m alone "$@"
echo "scripts/test.sh: the shared tests $shared s, the alone tests $((SECONDS - start)) s"
