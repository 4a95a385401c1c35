"""Entry point for `ray job submit ... -- python jobs/generate.py --input ... --output ...`.

The same as `python -m raysd generate` (inside a submitted job Ray is already running:
the job connects to its cluster through RAY_ADDRESS). Kept as a file so a job can be
submitted with only the working_dir on the cluster's path.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's raysd first

from raysd.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
