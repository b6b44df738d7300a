import sys

from kproxy.cli import main

sys.exit(main())
