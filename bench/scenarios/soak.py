"""soak: many rows through tiny random models via `raysd generate` on a local Ray, memory and
throughput sampled over the run (bench/soak.py, which tests/reliability/test_soak.py loads by path;
its docstring says what is sampled and fitted). One timed run per repeat (default 1): tokens/s is
the job's generated tokens / the wall of its `generate` call (Ray's start excluded, model start-up
included); the RSS per process class, its fit against rows written and the tokens/s per time window
go under extra. Checked: every row once, and no per-row memory growth in the second half above 4 KiB
in the driver, the model actors and the replica (the bounds tests/reliability/test_soak.py asserts).

    python -m bench run soak --rows 20000                # the documented soak (docs/reliability.md)
"""

from __future__ import annotations

from bench.harness import Outcome, Variant, run_variants
from bench.measure import Counts, figures

QUICK = {"rows": 300, "rows_per_file": 32, "sample_s": 1.0, "windows": 2}
WATCHED = ("driver", "target_actor", "draft_actor", "replica_actor")


def add_arguments(p) -> None:
    p.set_defaults(repeats=1)
    g = p.add_argument_group("soak")
    g.add_argument("--rows", type=int, default=20000)
    g.add_argument("--max-new-tokens", type=int, default=8)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--rows-per-file", type=int, default=128)
    g.add_argument("--draft", default="model", help="model (a tiny 1-layer draft), ngram or none")
    g.add_argument("--sample-s", type=float, default=2.0)
    g.add_argument("--windows", type=int, default=8)


def run(a, log=print) -> Outcome:
    from bench import soak

    argv = ["--rows", str(a.rows), "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.batch_size),
            "--rows-per-file", str(a.rows_per_file), "--draft", a.draft, "--sample-s", str(a.sample_s),
            "--windows", str(a.windows)]
    results: list[dict] = []

    def one() -> dict:
        r = soak.main(argv)
        results.append({k: v for k, v in r.items() if k != "series"})
        return figures(Counts(r["generated_tokens"]), r["wall_s"], timed="raysd generate (tiny models)",
                       rows_out=r["rows_out"], unique_ids=r["unique_ids"])

    summaries, _ = run_variants([Variant(f"soak {a.rows} rows, draft {a.draft}", {"rows": a.rows, "draft": a.draft}, one)],
                                a.repeats, log=log)
    bad = []
    for r in results:
        if not r["rows_out"] == r["unique_ids"] == a.rows:
            bad.append("rows")
        for name in WATCHED:
            late = r["rss"].get(name, {}).get("second_half_slope_bytes_per_row")
            if late is not None and late >= 4096:
                bad.append(name)
    return Outcome(summaries, {"soak": results}, {"rows_once_memory_flat": {"ok": not bad, "failed": bad}})
