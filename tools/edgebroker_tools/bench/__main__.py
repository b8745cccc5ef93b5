"""`python -m edgebroker_tools.bench`."""

import sys

from edgebroker_tools.bench.cli import main

sys.exit(main())
