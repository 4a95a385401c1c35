"""`python -m bench report`: docs/performance.md, generated from bench/performance.toml (which
result file feeds which table) and the result files it names.

Every table says where its figures come from: the file, the machine (CPU, cores, SIMD, torch
threads), the date the `python -m bench run` file records, the load average, and the command that
reproduces it. The page opens with "At a glance": one paired ratio per row, computed here from the
result files (nothing typed in by hand). Its prose must stay
under MAX_PROSE_WORDS and the whole page under MAX_LINES, so a user reads it in a minute; the
chronological log, with every figure's back story, is docs/history/benchmarks.md.

    python -m bench report                      # rewrite docs/performance.md
    python -m bench report --check              # exit 1 if the page is not what the manifest gives
    python -m bench report --manifest M --out P # another manifest or page (tests)
"""

from __future__ import annotations

import argparse
import glob
import sys
import tomllib
from pathlib import Path

from bench import record
from bench.environment import ROOT
from bench.measure import DEFINITIONS, fmt, paired_ratio

MANIFEST = ROOT / "bench" / "performance.toml"
PAGE = ROOT / "docs" / "performance.md"
MAX_LINES = 150  # a page read in a minute
MAX_PROSE_WORDS = 1000  # words outside tables, headings and the generated file lines
COLUMNS = (  # (figure, header, digits) of a `python -m bench run` result's table, in this order
    ("tokens_per_s", "tok/s", 1), ("acceptance_rate", "acceptance", 2), ("alpha", "alpha", 2),
    ("mean_acceptance_length", "tokens/pass", 2), ("mean_k_offered", "mean K", 2), ("occupancy", "occupancy", 2),
    ("step_s", "step ms", 2), ("decode_tokens_per_s", "decode tok/s", 1), ("mean_accepted_per_step", "accepted/step", 2))


RATIOS = {"tokens_per_s": "tok/s", "decode_tokens_per_s": "decode tok/s", "step_s": "step"}


def variants_table(result: dict, only: list[str] | None = None) -> list[str]:
    """A result's variants as a markdown table: medians, and ratios to each variant's baseline."""
    variants = [v for v in result["variants"] if only is None or v["name"] in only]
    cols = [c for c in COLUMNS if any(v["median"].get(c[0]) is not None for v in variants)]
    ratio_keys = [k for k in RATIOS if any(k in v.get("ratio", {}) for v in variants)]
    heads = ["variant"] + [h for _, h, _ in cols] + [f"{RATIOS[k]} / baseline (paired)" for k in ratio_keys] + ["runs"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for v in variants:
        m = v["median"]
        cells = [v["name"]] + [fmt(m.get(k) * 1e3 if k == "step_s" and m.get(k) is not None else m.get(k), d) for k, _, d in cols]
        cells += [fmt(v.get("ratio", {}).get(k, {}).get("median")) for k in ratio_keys]
        lines.append("| " + " | ".join(cells + [str(len(v["runs"]))]) + " |")
    return lines


def machine_text(m: dict) -> str:
    simd = "/".join(s.upper() for s in m.get("simd", [])) or "no SIMD flags recorded"
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {simd}, torch threads {m.get('torch_threads', '?')}{gpu}"


def load_text(before, after, during=None) -> str:
    """The 1-minute load average: at the start (or its range during the runs) and at the end."""
    if before is not None:
        return f"load {fmt(before, 2)} at the start, {fmt(after, 2)} at the end"
    if during is not None:
        return f"load {fmt(during[0], 2)}-{fmt(during[1], 2)} during the runs, {fmt(after, 2)} at the end"
    return f"load {fmt(after, 2)} at the end (not recorded at the start)"


def bench_table(entry: dict) -> list[str]:
    """One table per result file (e.g. one run per batch size), each with its machine and command."""
    out: list[str] = []
    for f in entry["files"]:
        path = f["path"]
        r = record.read(ROOT / path)
        v = r["versions"]
        out += [f"`{path}`: {machine_text(r['machine'])}; measured {r['date_utc']}; "
                f"{load_text(r['load_average']['before'][0], r['load_average']['after'][0])}; torch {v['torch']}, "
                f"transformers {v['transformers']}, commit {str(v['raysd_commit'])[:12]}"
                + ("; **--quick: not a measurement**" if r["quick"] else "") + ".", ""]
        out += variants_table(r, entry.get("variants"))
        out += ["", f"Reproduce: `{r['command']}`.", ""]
    return out[:-1]


def smoke_line(pattern: str) -> str:
    """One line: each smoke run's scenario, date and checks (the files say the rest)."""
    files = sorted(glob.glob(str(ROOT / pattern)))
    if not files:
        return "None yet."
    runs = []
    for path in files:
        r = record.read(path)
        ok = all(c.get("ok", True) for c in r["checks"].values())
        runs.append(f"{r['scenario']} ({r['date_utc'][:10]}, {r['elapsed_s']:.0f} s, {'ok' if ok else 'FAILED'})")
    return f"`{pattern}`: " + "; ".join(runs) + "."


def glance_table(rows: list[dict]) -> list[str]:
    """One paired ratio per row: the median over repeats of variant / against, from one result file (of a
    time, `invert`: against / variant, so that above 1 is faster)."""
    out = ["| what | ratio | per repeat | machine | from |", "|---|---|---|---|---|"]
    for g in rows:
        r = record.read(ROOT / g["file"])
        by_name = {v["name"]: v for v in r["variants"]}
        variant, against = by_name[g["variant"]], by_name[g.get("against") or by_name[g["variant"]]["baseline"]]
        key = g.get("key", "tokens_per_s")
        ratio = (paired_ratio(against["runs"], variant["runs"], key) if g.get("invert")
                 else paired_ratio(variant["runs"], against["runs"], key))
        m = r["machine"]
        machine = m["gpu"] if m.get("gpu") else f"{m.get('cores', '?')}-core CPU"
        out.append(f"| {g['what']} | **{fmt(ratio['median'], 2)}x** | {', '.join(fmt(x, 2) for x in ratio['per_repeat'])} "
                   f"| {machine} | [{Path(g['file']).stem}](#{g['section']}) |")
    return out


def prose_words(text: str) -> int:
    """Words a user reads: everything but tables, headings, the comment, and the file and command lines."""
    skip = ("|", "#", "<!--", "`bench/results/", "Reproduce: ")
    return sum(len(line.split()) for line in text.splitlines() if not line.startswith(skip))


def render(manifest: dict) -> str:
    page = manifest["page"]
    lines = ["# Performance", "", "<!-- Generated by `python -m bench report` from bench/performance.toml and the result "
             "files it names; edit those, not this page. -->", "", page["intro"].strip(), ""]
    if manifest.get("glance"):
        lines += ["## At a glance", ""] + glance_table(manifest["glance"]) + ["", page["glance_note"].strip(), ""]
    lines += ["Every figure is defined once, in `bench/measure.py`:", ""]
    lines += [f"- {name}: {DEFINITIONS[k]}" for k, name in (("tokens_per_s", "tokens/s"), ("acceptance_rate", "acceptance"),
              ("alpha", "alpha"), ("mean_acceptance_length", "tokens/pass"), ("ratio", "ratios"))]
    for section in ("CPU", "GPU"):
        lines += ["", f"## {section}"]
        if page.get(f"{section.lower()}_notes"):
            lines += ["", page[f"{section.lower()}_notes"].strip()]
        entries = [t for t in manifest.get("table", []) if t["section"] == section]
        if not entries:
            lines += ["", page[f"no_{section.lower()}"].strip()]
        for t in entries:
            anchor = f'<a id="{t["anchor"]}"></a>' if t.get("anchor") else ""
            lines += ["", f"### {t['title']}{anchor}", ""]
            lines += bench_table(t)
            if t.get("note"):
                lines += [t["note"].strip()]
    lines += ["", "## Not measured yet", ""] + [f"- {x.strip()}" for x in page["not_measured"]]
    lines += ["", "## Smoke runs of the current code", "", page["smoke_intro"].strip() + " " + smoke_line(page["smoke"])]
    text = "\n".join(lines) + "\n"
    if text.count("\n") > MAX_LINES:
        raise ValueError(f"the page has {text.count(chr(10))} lines, over {MAX_LINES}: trim the manifest")
    if prose_words(text) > MAX_PROSE_WORDS:
        raise ValueError(f"the page has {prose_words(text)} words of prose, over {MAX_PROSE_WORDS}: trim the notes "
                         "(the back story belongs in docs/history/benchmarks.md)")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", default=str(MANIFEST))
    p.add_argument("--out", default=str(PAGE))
    p.add_argument("--check", action="store_true", help="exit 1 if --out differs from what the manifest gives")
    a = p.parse_args(argv)
    text = render(tomllib.loads(Path(a.manifest).read_text()))
    if a.check:
        same = Path(a.out).is_file() and Path(a.out).read_text() == text
        print(f"{a.out} is {'current' if same else 'STALE: run python -m bench report'}")
        return 0 if same else 1
    Path(a.out).write_text(text)
    print(f"wrote {a.out} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
