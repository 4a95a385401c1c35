#!/usr/bin/env bash
# Submit a `raysd generate` job to a running Ray cluster (the dashboard / Jobs API address).
#
#   RAY_ADDRESS=http://127.0.0.1:8265 jobs/submit_generate.sh \
#       --input s3://bucket/prompts/ --output s3://bucket/generations/ --draft ngram --replicas 4 --num-gpus-per-actor 0.5
#
# Every argument goes to `raysd generate`. Run from the repository root (the runtime_env
# uploads it as the job's working_dir). With token authentication on (a head started
# by `ray start` here), the client needs RAY_AUTH_MODE=token to send ~/.ray/auth_token.
set -euo pipefail
cd "$(dirname "$0")/.."
exec ray job submit \
    --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" \
    --runtime-env jobs/runtime_env.yaml \
    --submission-id "raysd-generate-$(date +%Y%m%d-%H%M%S)" \
    ${RAYSD_SUBMIT_ARGS:-} \
    -- python -m raysd generate --quiet "$@"
