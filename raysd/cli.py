"""`raysd <command>`: each command lives in its own module, imported only when run.

A command module defines `add_arguments(parser)` and `run(args) -> int`; `comma_list` is the
argument type of every flag that takes a list.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("raysd.jobs.cli", "generate completions for a prompt dataset (Parquet in, Parquet out)"),
    "study": ("raysd.study.cli", "profile a model pair and compare measured speedups with the theory"),
    "distill": ("raysd.distill.cli", "train a small draft model for a target by distillation"),
}


def comma_list(kind=str):
    """An argparse type for a comma-separated list: "1,8" -> [1, 8] with `kind` int ("" -> [], blank
    items dropped); an item `kind` refuses is argparse's usage error, naming the text."""
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None

    return parse


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="raysd", description="Exact speculative decoding on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only the chosen command's module is imported: `raysd generate --help` never pays for `study`.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:
        print("raysd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
