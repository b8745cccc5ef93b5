"""Host tools for edgebroker: run the broker, and later check, build, flash and collect.

The command line is `edgebroker <command>` (edgebroker_tools.cli); each
command lives in its own module under edgebroker_tools.commands. Reusable
pieces (e.g. edgebroker_tools.runner.broker_command) are importable by the
tests and the benchmark.
"""

__version__ = "0.1.0"
