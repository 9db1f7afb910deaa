"""`python -m bench.train_bench`: the benchmark (bench/train_bench/cli.py)."""

import sys

from .cli import main

sys.exit(main())
