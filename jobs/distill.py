"""Entry point for `ray job submit`: train a draft by distillation on the cluster.

    ray job submit --working-dir . -- python jobs/distill.py \
        --prompts /data/prompts.jsonl --output /shared/drafts/my-draft --layers 2 --head-vocab 8192 \
        --steps 2000 --num-workers 4 --use-gpu

Takes the arguments of `raysd distill` (see `raysd distill --help`); inside a job it joins
the job's cluster (RAY_ADDRESS), so the Ray Train workers run on the cluster's nodes.
The output directory must be reachable from the driver (a shared or local path).
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from raysd.distill import cli

    parser = argparse.ArgumentParser(prog="jobs/distill.py", description=__doc__.splitlines()[0])
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.ray_address and os.environ.get("RAY_ADDRESS"):
        args.ray_address = "auto"
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
