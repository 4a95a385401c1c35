import sys

from raysd.cli import main

sys.exit(main())
