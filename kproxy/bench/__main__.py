"""``python -m kproxy.bench bench sync ...``: the benchmarks without the rest of the command line."""

import sys

from kproxy.bench.cli import main

sys.exit(main())
