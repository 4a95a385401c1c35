"""Tables from result files written before `python -m bench` (the old per-script formats).

They stay readable so that docs/performance.md can show the newest figures that exist until the
scenarios are run again on the current code. Each adapter reads one old format and returns
(headers, rows); `meta` reads what an old file says about its machine and load. The old files
carry no date: the page shows the date the file was first committed (bench.environment.git_date).

Definitions in these files, checked against the scripts that wrote them (bench/ before issue 39):
tokens/s = generated tokens / wall of the generate call, prefill included (the pipeline files: the
job's wall, from models on disk; their engine side: model load + generate); acceptance = accepted /
drafted (the EAGLE files call it "alpha"); tokens/pass = 1 + accepted / target passes; ratios are
ratios of medians unless a column says "paired".
"""

from __future__ import annotations

import statistics


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def meta(data: dict) -> dict:
    """{machine, load: [start, end], during: (min, max) or None} of an old result file; `during`
    from the load averages its rows recorded, for files that kept no start."""
    info = data.get("info", data)
    machine = info.get("machine") or data.get("machine") or {}
    start = info.get("loadavg_start")
    end = info.get("loadavg_end", data.get("loadavg_end"))
    seen = []
    for row in data.get("rows", data.get("results", [])) if isinstance(data.get("rows", data.get("results")), list) else []:
        x = row.get("loadavg") if isinstance(row, dict) else None
        seen += [v for v in (x if isinstance(x, list) else [x]) if isinstance(v, (int, float))]
    return {"machine": machine, "load": [start, end], "during": (min(seen), max(seen)) if seen else None}


def _keep(row: dict, only: dict) -> bool:
    return all(row.get(k) in v for k, v in only.items())


def fastpath(data: dict, only: dict) -> tuple[list[str], list[list[str]]]:
    """bench/fastpath_bench.py: engine plain decoding against HF generate (and stock linears), and the draft."""
    k = data["args"]["k"]
    heads = ["B", "plain tok/s", "HF generate tok/s", "plain, stock linears", f"draft K={k} tok/s", "plain / HF",
             "plain / stock", "draft / plain", "acceptance", "tokens/pass"]
    rows = []
    for r in data["rows"]:
        if not _keep(r, only):
            continue
        t = r["tok_s"]
        rows.append([str(r["batch"]), fmt(t["engine AR"], 1), fmt(t["HF generate"], 1), fmt(t.get("engine AR stock"), 1),
                     fmt(t[f"engine draft K={k}"], 1), fmt(r["ar_vs_hf"]), fmt(r.get("ar_vs_stock")), fmt(r["spec_speedup"]),
                     fmt(r["acceptance"]), fmt(r["tokens_per_pass"])])
    return heads, rows


def eagle(data: dict, only: dict) -> tuple[list[str], list[list[str]]]:
    """bench/eagle_bench.py: the EAGLE draft at each K against plain decoding."""
    heads = ["dtype", "B", "K", "plain tok/s", "EAGLE tok/s", "EAGLE / plain", "acceptance", "tokens/pass", "rows equal plain"]
    rows = [[data["args"]["dtype"], str(r["batch"]), str(r["k"]), fmt(r["tok_s_plain"], 1), fmt(r["tok_s"], 1),
             fmt(r["speedup"]), fmt(r["alpha"]), fmt(r["tokens_per_step"]), f"{r['rows_identical_to_plain']}/{r['rows']}"]
            for r in data["rows"] if _keep(r, only)]
    return heads, rows


def _drafter(r: dict) -> str:
    return "none" if r["draft"] == "none" else f"{r['draft'].replace('smollm2-135m-instruct-', '')} K={r['k']}"


def pipeline_vs_engine(data: dict, only: dict) -> tuple[list[str], list[list[str]]]:
    """bench/pipeline_bench.py with both sides: `raysd generate` against the engine."""
    heads = ["B", "drafter", "engine tok/s (load + generate)", "pipeline tok/s (job wall)", "pipeline / engine", "occupancy"]
    rows = [[str(r["batch"]), _drafter(r), fmt(r["engine_tok_s"], 1), fmt(r["pipeline_tok_s"], 1),
             fmt(r["pipeline_vs_engine"]), fmt(r["occupancy"])] for r in data["results"] if _keep(r, only)]
    return heads, rows


def pipeline_drafters(data: dict, only: dict) -> tuple[list[str], list[list[str]]]:
    """bench/pipeline_bench.py, pipeline side only: drafters against --draft none of the same file,
    paired by repeat (the variants were interleaved in each repeat)."""
    heads = ["B", "drafter", "tok/s (median)", "/ none (paired median)", "occupancy", "repeats"]
    runs = data["results"]
    rows = []
    for r in runs:
        if not _keep(r, only):
            continue
        none = next((x for x in runs if x["draft"] == "none" and x["batch"] == r["batch"]), None)
        ratio = None
        if none is not None and len(none["pipeline_tok_s_all"]) == len(r["pipeline_tok_s_all"]):
            ratio = statistics.median(a / b for a, b in zip(r["pipeline_tok_s_all"], none["pipeline_tok_s_all"]))
        rows.append([str(r["batch"]), _drafter(r), fmt(r["pipeline_tok_s"], 1), fmt(ratio), fmt(r["occupancy"]),
                     str(len(r["pipeline_tok_s_all"]))])
    return heads, rows


def relaxed(data: dict, only: dict) -> tuple[list[str], list[list[str]]]:
    """bench/relaxed_bench.py, the real-model part: the relaxed acceptance dial (LOSSY) at T = 1."""
    heads = ["LAMBDA", "TV(target, draft)", "acceptance", "rejections per test", "front's", "tokens/pass",
             "TV(output, target) per tested", "tok/s"]
    rows = [[fmt(r["lam"]), fmt(r["tv_target_draft"]), fmt(r["acceptance_rate"]), fmt(r["rejection_rate"]), fmt(r["front_rejection_rate"]),
             fmt(r["tokens_per_pass"]), fmt(r["tv_out_target_per_tested"]), fmt(r["tok_s"], 1)]
            for r in data["real"]["rows"] if _keep(r, only)]
    return heads, rows


def tree_auto(data: dict, only: dict) -> tuple[list[str], list[list[str]]]:
    """bench/tree_auto_bench.py: draft trees, fixed and chosen each step, against the chain."""
    heads = ["variant", "tok/s (median)", "/ chain (per repeat)", "tokens/pass", "tree steps"]
    rows = [[name, fmt(s["tok_s_median"], 1), ", ".join(fmt(x) for x in s["vs_chain_per_repeat"]), fmt(s["tokens_per_pass"]),
             f"{s['tree_step_share']:.0%}"] for name, s in data["summary"].items() if _keep({"variant": name}, only)]
    return heads, rows


ADAPTERS = {"fastpath": fastpath, "eagle": eagle, "pipeline_vs_engine": pipeline_vs_engine,
            "pipeline_drafters": pipeline_drafters, "relaxed": relaxed, "tree_auto": tree_auto}
