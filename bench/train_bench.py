"""`python bench/train_bench.py ...`: runs the benchmark package bench/train_bench/ (docs/performance.md).

The same as `python -m bench.train_bench ...` from the repository root.
"""

import os
import sys

if __name__ == "__main__":
    ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[0] = ROOT  # the repository, not bench/: the package is reached as bench.train_bench
    from bench.train_bench.cli import main

    sys.exit(main())
