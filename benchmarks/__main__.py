"""`python -m benchmarks ...`: the benchmark command line (benchmarks/cli.py)."""

import sys

from benchmarks.cli import main

sys.exit(main())
