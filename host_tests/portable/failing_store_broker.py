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
    """The first commit holding a change to each "fail/..." topic fails and
    undoes the changes since the last good commit, as the flash store does
    (edgestore FAILURES); a later change to that topic is written."""

    durable = True

    def __init__(self, capacity):
        edgeram.RamStore.__init__(self, capacity)
        self.bad = False
        self.failed = set()  # topics whose first commit failed
        self.undo = []

    def put(self, topic, msg):
        if topic[:5] == "fail/" and topic not in self.failed:
            self.failed.add(topic)
            self.bad = True
        self.undo.append((topic, self.get(topic)))
        edgeram.RamStore.put(self, topic, msg)

    def commit(self):
        undo = self.undo
        self.undo = []
        if self.bad:
            self.bad = False
            while undo:
                topic, old = undo.pop()
                if old is None:
                    edgeram.RamStore.delete(self, topic)
                else:
                    edgeram.RamStore.put(self, topic, old)
            raise OSError(28)


def _open_store(cfg, data_dir=None, clock=None, wallclock=None, log=None):
    return FailingStore(cfg["max_retained_messages"])


edgebroker.open_store = _open_store
edgebroker.main(sys.argv)
