"""`python -m bench`: the one entry point of raysd's benchmarks.

    python -m bench list                          the scenarios (bench.registry)
    python -m bench run SCENARIO [options]        run one; writes a result JSON (bench.record)
    python -m bench run SCENARIO --help           its options
    python -m bench run SCENARIO --quick          a smoke run (checks the scenario; measures nothing that matters)
    python -m bench report [--check]              regenerates docs/performance.md from bench/performance.toml

Run from the repository root (or with it on PYTHONPATH), so that Ray's workers import the same code.
A run writes bench/results/SCENARIO_<UTC date-time>.json (bench/results/quick/SCENARIO.json under
--quick) unless --out says where, and exits 1 when one of its checks failed (the file is written).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import environment, record, registry

RESULTS = Path(__file__).resolve().parent / "results"


def common_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("every scenario")
    g.add_argument("--quick", action="store_true", help="a smoke run: the scenario's QUICK sizes; not a measurement")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per variant, interleaved (medians reported)")
    g.add_argument("--threads", type=int, default=None, help="torch threads in this process (default: torch's own)")
    g.add_argument("--out", default=None, help="the result JSON (default: bench/results/SCENARIO_<date>.json)")


def scenario_parser(scenario: registry.Scenario, module, quick: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m bench run {scenario.name}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(p)
    module.add_arguments(p)
    p.set_defaults(**scenario.defaults)
    if quick:
        p.set_defaults(**{**module.QUICK, **scenario.quick})
    return p


def default_out(name: str, quick: bool, now: datetime) -> Path:
    return RESULTS / "quick" / f"{name}.json" if quick else RESULTS / f"{name}_{now:%Y%m%d-%H%M}.json"


def run(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m bench run SCENARIO [options]; `python -m bench list` lists them")
    scenario = registry.get(argv[0])
    module = scenario.load()
    a = scenario_parser(scenario, module, "--quick" in argv[1:]).parse_args(argv[1:])
    if a.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    now = datetime.now(timezone.utc)
    load_before, started = environment.load_average(), time.perf_counter()
    machine, versions = environment.machine(), environment.versions()
    print(f"{scenario.name}: {machine['cpu']} ({machine['cores']} cores), load {load_before}, commit {versions['raysd_commit']}",
          flush=True)
    outcome = module.run(a, log=lambda line: print(line, flush=True))
    result = record.build(scenario.name, "python -m bench run " + shlex.join(argv), vars(a), a.quick,
                          now.isoformat(timespec="seconds"), time.perf_counter() - started, machine, load_before,
                          environment.load_average(), versions, outcome)
    out = Path(a.out) if a.out else default_out(scenario.name, a.quick, now)
    out = record.write(result, out if out.suffix else out.with_suffix(".json"), outcome.markdown)
    from bench.report import variants_table

    print("\n" + "\n".join(variants_table(result)))
    for name, check in outcome.checks.items():
        print(f"check {name}: {'ok' if check.get('ok', True) else 'FAILED'}")
    print(f"wrote {out} ({result['elapsed_s']:.0f} s)")
    return 0 if outcome.ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command, rest = (argv[0], argv[1:]) if argv else ("help", [])
    if command == "list":
        for s in registry.SCENARIOS.values():
            print(f"{s.name:13s} {s.summary}" + (" [GPU]" if s.gpu else ""))
        return 0
    if command == "run":
        return run(rest)
    if command == "report":
        from bench.report import main as report_main

        return report_main(rest)
    print(__doc__)
    return 0 if command in ("help", "-h", "--help") else 2
