"""Step costs of a tensor-parallel target on this machine: TP = N against TP = 1.

One step is one target forward of T = K + 1 tokens per row on B rows holding `--context` cached
tokens, through the static runner with the engine's default kernels (raysd.models.profile
.time_forward: the median of `--reps` forwards after a warm-up). TP = N runs N gloo ranks on this
machine (torch.multiprocessing, one torch thread each) and reports rank 0's times; TP = 1 runs in
one process with `--threads` threads (1, and the machine's cores: the same cores as N ranks).

Besides the forward, each rank times the step's all-reduces alone (2 per layer, each of
[B x T, hidden] float32) and the bytes they carry: 2 x layers x B x T x hidden x 4 per step.

Models: "smollm2" (SmolLM2-135M, 9 heads / 3 key/value heads: TP 3), and "smollm2-8h", a random
model of SmolLM2-135M's shape with 8 heads of 72 and 2 key/value heads (the same weights' sizes,
so the same bytes and FLOPs), which TP 2 divides.

    python -m bench.tensor_parallel --model smollm2-8h --tp 2 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

CONTEXT, REPS = 128, 5


def load(name: str):
    if name == "smollm2":
        from raysd.models.loading import ModelSpec, load_model

        return load_model(ModelSpec())
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # SmolLM2-135M's shape, 8 heads of 72 for 9 of 64 (576 wide either way)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=72, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def measure(rank: int, world_size: int, name: str, batch_sizes, ks, context: int, reps: int) -> dict:
    import torch.distributed as dist

    from raysd.models.profile import time_forward
    from raysd.models.tensor_parallel import shard_model

    model = shard_model(load(name), rank, world_size)
    cfg = model.config
    out = {"step_s": {}, "allreduce_s": {}, "allreduce_bytes": {}}
    for B in batch_sizes:
        times = time_forward(model, B, ks, context, reps)
        for k in ks:
            T = k + 1
            key = f"B{B}T{T}"
            out["step_s"][key] = times[k]
            out["allreduce_bytes"][key] = 2 * cfg.num_hidden_layers * B * T * cfg.hidden_size * 4
            if world_size > 1:  # the step's all-reduces alone, back to back
                y = torch.randn(B, T, cfg.hidden_size)
                samples = []
                for _ in range(reps + 1):
                    t0 = time.perf_counter()
                    for _ in range(2 * cfg.num_hidden_layers):
                        dist.all_reduce(y)
                    samples.append(time.perf_counter() - t0)
                out["allreduce_s"][key] = statistics.median(samples[1:])
    return out


def _rank(rank, world_size, port, path, args):
    torch.set_num_threads(1)
    from raysd.models.tensor_parallel import init_group

    init_group(rank, world_size, "127.0.0.1", port, "gloo")
    out = measure(rank, world_size, *args)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(out, f)


def run(name: str, tp: int, threads: int, batch_sizes, ks, context: int = CONTEXT, reps: int = REPS) -> dict:
    args = (name, batch_sizes, ks, context, reps)
    if tp == 1:
        torch.set_num_threads(threads)
        return measure(0, 1, *args)
    from raysd.models.tensor_parallel import free_address

    _, port = free_address()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(tp, port, path, args), nprocs=tp, join=True, start_method="spawn")
        with open(path) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-8h", choices=("smollm2", "smollm2-8h"))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1], help="TP = 1's thread counts")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 4])
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--out", default=None, help="JSON file for the results")
    a = p.parse_args()
    results = {"model": a.model, "load_before": os.getloadavg(), "cpus": os.cpu_count(), "runs": {}}
    for threads in a.threads:
        results["runs"][f"tp1_threads{threads}"] = run(a.model, 1, threads, a.batch_sizes, a.ks, a.context, a.reps)
    results["runs"][f"tp{a.tp}"] = run(a.model, a.tp, 1, a.batch_sizes, a.ks, a.context, a.reps)
    results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
