#!/usr/bin/env bash
# Submit a `raysd generate` job to a running Ray cluster (the dashboard / Jobs API address).
#
#   HF_TOKEN=hf_... RAY_ADDRESS=http://127.0.0.1:8265 jobs/submit_generate.sh \
#       --input s3://bucket/prompts/ --output s3://bucket/generations/ \
#       --target meta-llama/Llama-3.1-8B-Instruct --draft meta-llama/Llama-3.2-1B-Instruct \
#       --replicas 4 --num-gpus-per-actor 0.5
#
# Every argument goes to `raysd generate` (add --quiet for the summary line alone; without it the
# job prints a progress line every 10 s, which `ray job submit` streams). Run from the repository
# root: the runtime_env (jobs/runtime_env.yaml) uploads it as the job's working_dir. HF_TOKEN, when
# set here, is added to the runtime_env's env_vars, so the driver and the model actors can read
# gated models from the Hub; it is never written to a file (Ray shows a job's runtime_env in its
# dashboard and job records, so anyone who can read those can read the token).
# With token authentication on (a head started by `ray start` here), the client needs
# RAY_AUTH_MODE=token to send ~/.ray/auth_token.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNTIME_ENV=$(python3 -c '
import json, os, yaml
env = yaml.safe_load(open("jobs/runtime_env.yaml"))
if os.environ.get("HF_TOKEN"):
    env.setdefault("env_vars", {})["HF_TOKEN"] = os.environ["HF_TOKEN"]
print(json.dumps(env))
')
exec ray job submit \
    --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" \
    --runtime-env-json "$RUNTIME_ENV" \
    --submission-id "raysd-generate-$(date +%Y%m%d-%H%M%S)" \
    ${RAYSD_SUBMIT_ARGS:-} \
    -- python -m raysd generate "$@"
