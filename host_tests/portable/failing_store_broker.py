# The real broker (lib/edgebroker.py main) with a durable store whose commit
# fails (OSError 28, no space) while it holds a change to a "fail/..." topic:
# flash full or an I/O error, as a board would see it. For
# test_store_failure.py; runs unchanged under CPython and MicroPython.
import sys

here = sys.argv[0].rsplit("/", 1)[0] if "/" in sys.argv[0] else "."
sys.path.insert(0, here + "/../../lib")
import edgebroker  # noqa: E402
import edgeram  # noqa: E402


class FailingStore(edgeram.RamStore):
    durable = True

    def __init__(self, capacity):
        edgeram.RamStore.__init__(self, capacity)
        self.bad = False

    def put(self, topic, msg):
        self.bad = self.bad or topic[:5] == "fail/"
        edgeram.RamStore.put(self, topic, msg)

    def commit(self):
        if self.bad:
            self.bad = False
            raise OSError(28)


def _open_store(cfg, data_dir=None, clock=None, wallclock=None, log=None):
    return FailingStore(cfg["max_retained_messages"])


edgebroker.open_store = _open_store
edgebroker.main(sys.argv)
