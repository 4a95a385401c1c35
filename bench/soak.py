"""Soak: many rows through tiny random models, memory and throughput sampled over the run.

    python bench/soak.py --rows 20000 --json bench/results/soak.json
    python -m bench run soak --rows 20000      # the same, in the benchmarks' result format (bench/scenarios/soak.py)

Runs one `raysd.jobs.generate` job on a local Ray it starts (address="local") and, every
--sample-s seconds, records the RSS of the driver and of every process of that Ray (grouped
by class: TargetActor, DraftActor, the generation and id stages' Ray Data actors, raylet,
gcs, other workers) and the rows and tokens in the output so far. At the end it prints and
writes: RSS start/end/max per class, tokens/s per time window, and a least-squares fit of
RSS against rows written (bytes per row: flat memory means a slope near 0), over the steady
state and over its second half (after allocators and caches have warmed up).
Figures from this script are in docs/reliability.md.

This soak kills nothing. The randomized fault soak (processes and nodes killed at random times
on a simulated two-node cluster) is `python -m tests.reliability.chaos --soak-kills 100`,
beside the fault helpers it uses; its table is in docs/reliability.md too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq

from raysd.actors.local import start_local_ray

VOCAB = 96


def _tiny(seed: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 2
    return model


def process_class(p: psutil.Process) -> str:
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    for key, label in (("TargetActor", "target_actor"), ("DraftActor", "draft_actor"), ("GenerateReplica", "replica_actor"),
                       ("AssignIds", "id_actor"), ("gcs_server", "gcs"), ("raylet", "raylet")):
        if key in cmd or key in name:
            return label
    return "ray_other"


def sample_rss() -> dict[str, float]:
    """MiB per process class: this driver and every descendant (the Ray it started)."""
    me = psutil.Process()
    out = {"driver": me.memory_info().rss / 2**20}
    for p in me.children(recursive=True):
        try:
            rss = p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        c = process_class(p)
        out[c] = out.get(c, 0.0) + rss
    return out


class OutputWatcher:
    """Rows and tokens in the output's parts so far (footers + one column of each new part)."""

    def __init__(self, out: Path):
        self.out, self.seen, self.rows, self.tokens = out, set(), 0, 0

    def poll(self) -> tuple[int, int]:
        for p in sorted(self.out.glob("part-*.parquet")) if self.out.exists() else []:
            if p in self.seen:
                continue
            try:
                t = pq.read_table(p, columns=["num_generated_tokens"])
            except Exception:  # noqa: BLE001 - a part is renamed into place whole; retry next poll
                continue
            self.seen.add(p)
            self.rows += t.num_rows
            self.tokens += int(sum(t.column(0).to_pylist()))
        return self.rows, self.tokens


def fit(xs, ys) -> dict:
    if len(xs) < 3 or max(xs) == min(xs):
        return {"slope_bytes_per_row": None, "intercept_mib": None, "r2": None}
    a, b = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    pred = a * np.asarray(xs) + b
    ss = float(np.sum((np.asarray(ys) - np.mean(ys)) ** 2)) or 1e-12
    return {"slope_bytes_per_row": float(a * 2**20), "intercept_mib": float(b),
            "r2": 1 - float(np.sum((np.asarray(ys) - pred) ** 2)) / ss}


def median_slope(xs, ys) -> float | None:
    """Bytes per row, Theil-Sen: the median of the slopes between every two samples. A steady leak
    moves every pair; a one-off step (a batch's tail filling a bounded cache, a new allocator arena)
    moves only the pairs across it, so it does not read as a leak the way a least-squares fit at the
    run's end does (a target actor flat for hundreds of rows, then a few MiB more at the last sample)."""
    pairs = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return float(np.median(pairs)) * 2**20 if len(pairs) >= 3 else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rows-per-file", type=int, default=128, help="small: parts are the soak's progress samples")
    ap.add_argument("--draft", default="model", help="model (a tiny 1-layer draft), ngram or none")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--windows", type=int, default=8, help="time windows for tokens/s")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)

    import ray

    from raysd.jobs import GenerateConfig, generate

    root = Path(tempfile.mkdtemp(prefix="raysd-soak-"))
    _tiny(0, 2).save_pretrained(root / "target")
    _tiny(1, 1).save_pretrained(root / "draft")
    rng = random.Random(0)
    with open(root / "in.jsonl", "w") as f:
        for i in range(a.rows):
            f.write(json.dumps({"id": i, "prompt": [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))]}) + "\n")
    draft = str(root / "draft") if a.draft == "model" else a.draft
    cfg = GenerateConfig(input=str(root / "in.jsonl"), output=str(root / "out"), target=str(root / "target"), draft=draft,
                         max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, rows_per_file=a.rows_per_file, quiet=True,
                         num_speculative_tokens=4)  # as the documented soak ran: every step drafts
    started_ray = not ray.is_initialized()
    if started_ray:
        start_local_ray(num_cpus=max(os.cpu_count() or 1, 2), log_to_driver=False, configure_logging=False)
    watcher = OutputWatcher(root / "out")
    samples: list[dict] = []
    box: dict = {}

    def run():
        try:
            box["summary"] = generate(cfg)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    start = time.perf_counter()
    job = threading.Thread(target=run, daemon=True)
    job.start()
    while job.is_alive():
        rows, tokens = watcher.poll()
        samples.append({"t": time.perf_counter() - start, "rows": rows, "tokens": tokens, "rss_mib": sample_rss()})
        job.join(a.sample_s)
    wall = time.perf_counter() - start
    if started_ray:
        ray.shutdown()
    if "error" in box:
        raise box["error"]
    summary = box["summary"]
    out = pq.read_table(root / "out", columns=["id"]).column(0).to_pylist()

    # Steady state: from the first written part to the last sample before the output is complete
    # (model loading and start-up excluded, and so is the teardown, when the actors exit).
    steady = [s for s in samples if 0 < s["rows"] < a.rows and s["rss_mib"].get("target_actor", 0) > 0]
    classes = sorted({c for s in samples for c in s["rss_mib"]})
    # The second half's slope (median_slope) is the leak test: allocators and caches grow in the first
    # minutes and then level off, which a short run's whole-run fit reads as a slope (a draft actor
    # that takes some MiB early and none after).
    late = [s for s in steady if s["rows"] >= a.rows / 2]
    per_class = {}
    for c in classes:
        series = [s["rss_mib"].get(c, 0.0) for s in steady] or [0.0]
        per_class[c] = {"start_mib": series[0], "end_mib": series[-1], "max_mib": max(series),
                        **fit([s["rows"] for s in steady], [s["rss_mib"].get(c, 0.0) for s in steady]),
                        "second_half_slope_bytes_per_row": median_slope([s["rows"] for s in late],
                                                                        [s["rss_mib"].get(c, 0.0) for s in late])}
    total = [sum(s["rss_mib"].values()) for s in steady]
    per_class["all"] = {"start_mib": total[0] if total else 0, "end_mib": total[-1] if total else 0,
                        "max_mib": max(total) if total else 0, **fit([s["rows"] for s in steady], total)}
    windows = []
    if len(steady) >= 2:
        t0, t1 = steady[0]["t"], steady[-1]["t"]
        edges = np.linspace(t0, t1, a.windows + 1)
        for lo, hi in zip(edges[:-1], edges[1:]):
            inside = [s for s in steady if lo <= s["t"] <= hi]
            if len(inside) >= 2 and inside[-1]["t"] > inside[0]["t"]:
                dt = inside[-1]["t"] - inside[0]["t"]
                windows.append({"from_s": round(inside[0]["t"], 1), "to_s": round(inside[-1]["t"], 1),
                                "tokens_per_s": (inside[-1]["tokens"] - inside[0]["tokens"]) / dt,
                                "rows_per_s": (inside[-1]["rows"] - inside[0]["rows"]) / dt})
    result = {
        "rows": a.rows, "rows_out": len(out), "unique_ids": len(set(out)), "wall_s": wall,
        "generated_tokens": summary.generated_tokens, "tokens_per_s": summary.latest_run.tokens_per_s,
        "config": {k: getattr(cfg, k) for k in ("max_new_tokens", "batch_size", "rows_per_file", "replicas")} | {"draft": a.draft},
        "samples": len(samples), "sample_s": a.sample_s, "rss": per_class, "windows": windows,
        "cpu_count": os.cpu_count(), "load_avg_end": os.getloadavg(), "series": samples,
    }
    print(f"soak: {len(out)} rows ({len(set(out))} unique) in {wall:.0f}s, {summary.latest_run.tokens_per_s:.1f} tok/s overall")
    for c, r in per_class.items():
        slope, late = r["slope_bytes_per_row"], r.get("second_half_slope_bytes_per_row")
        print(f"  {c:14s} RSS start {r['start_mib']:7.1f} end {r['end_mib']:7.1f} max {r['max_mib']:7.1f} MiB; "
              f"slope {'n/a' if slope is None else f'{slope:8.1f}'} B/row, "
              f"second half {'n/a' if late is None else f'{late:8.1f}'} B/row")
    print("  tokens/s by window:", ", ".join(f"{w['tokens_per_s']:.0f}" for w in windows))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
