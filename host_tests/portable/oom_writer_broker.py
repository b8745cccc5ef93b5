# The real broker (lib/edgebroker.py main) whose first flush to a full
# socket runs out of heap, for test_pubsub.py; runs unchanged under CPython
# and MicroPython. It patches only Broker._flush: the first call made while
# the connection waits for its socket to take more (conn.wait: the async
# writer task, or the poll server's POLLOUT) raises MemoryError before
# sending. The rest runs as shipped.
import sys

import wrapper_args

wrapper_args.lib_on_path()
import edgebroker  # noqa: E402

_flush = edgebroker.Broker._flush
left = [1]


def flush(self, conn):
    if conn.wait and left[0]:
        left[0] -= 1
        raise MemoryError("test: no heap while the socket was full")
    return _flush(self, conn)


edgebroker.Broker._flush = flush
edgebroker.main(sys.argv)
