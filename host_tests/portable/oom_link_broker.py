# The real broker (lib/edgebroker.py main) whose bridge link runs out of
# heap, for test_bridge.py; runs unchanged under CPython and MicroPython.
# It patches only edgebridge.Bridge: the link's first two attempts raise
# MemoryError, and so does the log line that would report each (on a board
# short of heap the report may not fit either). The rest runs as shipped.
import sys

import wrapper_args

wrapper_args.lib_on_path()
import edgebroker  # noqa: E402
import edgebridge  # noqa: E402

_session = edgebridge.Bridge._session
_log = edgebridge.Bridge.log
left = [2]


async def session(self, aio, clock):
    if left[0]:
        left[0] -= 1
        raise MemoryError("test: no heap for the link")
    await _session(self, aio, clock)


def log(self, level, fmt, *args):
    if fmt.startswith("link "):  # "link down: %s", "link failed: %s"
        raise MemoryError("test: no heap for the report")
    _log(self, level, fmt, *args)


edgebridge.Bridge._session = session
edgebridge.Bridge.log = log
edgebroker.main(sys.argv)
