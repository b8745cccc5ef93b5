# The real broker (lib/edgebroker.py main) over a filesystem with faults, as
# a board's flash has them, for test_store_faults.py; runs unchanged under
# CPython and MicroPython. It patches only edgestore.Fs (the store's one
# door to the filesystem); the broker and the store run as shipped.
#   --fault full       the store files may not grow past the number of bytes
#                      in <data-dir>/quota (read at every write; no file: no
#                      limit): a write beyond writes what fits and raises
#                      OSError 28 (ENOSPC). Raise the number: space returns.
#   --fault readonly   every open for writing, rename and remove raises
#                      OSError 30 (EROFS): a read-only filesystem.
import sys

import wrapper_args

wrapper_args.lib_on_path()
import edgebroker  # noqa: E402
import edgestore  # noqa: E402

FAULT, argv = wrapper_args.take_fault(sys.argv)
DATA = argv[argv.index("--data-dir") + 1]
_open = edgestore.Fs.open


def _quota():
    try:
        with open(DATA + "/quota") as f:
            return int(f.read())
    except OSError:
        return -1


class FullFile:
    def __init__(self, f):
        self.f = f

    def write(self, b):
        q = _quota()
        n = len(b)
        if q >= 0:
            pos = self.f.tell()
            if pos + n > q:
                if q > pos:
                    self.f.write(bytes(b)[:q - pos])
                raise OSError(28)  # ENOSPC
        return self.f.write(b)

    def read(self, n=-1):
        return self.f.read(n)

    def seek(self, *a):
        return self.f.seek(*a)

    def tell(self):
        return self.f.tell()

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()


def full_open(self, path, mode):
    return FullFile(_open(self, path, mode))


def ro_open(self, path, mode):
    if mode != "rb":
        raise OSError(30)  # EROFS
    return _open(self, path, mode)


def ro_change(self, *a):
    raise OSError(30)


if FAULT == "full":
    edgestore.Fs.open = full_open
elif FAULT == "readonly":
    edgestore.Fs.open = ro_open
    edgestore.Fs.rename = ro_change
    edgestore.Fs.remove = ro_change
else:
    raise SystemExit("unknown --fault " + FAULT)
edgebroker.main(argv)
