"""`python -m kvgate.loadtest.bench`."""

import sys

from kvgate.loadtest.bench.cli import main

sys.exit(main())
