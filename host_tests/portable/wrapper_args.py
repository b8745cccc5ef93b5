# What the wrapper scripts here share (faulty_fs_broker.py and the
# oom_*_broker.py scripts: the real broker with one part patched): lib/ on
# the import path, and their own --fault option taken out of the command
# line before the rest goes to edgebroker.main. CPython and MicroPython.
import sys


def lib_on_path():
    here = sys.argv[0].rsplit("/", 1)[0] if "/" in sys.argv[0] else "."
    sys.path.insert(0, here + "/../../lib")


def take_fault(argv):
    """(the --fault value, argv without it)."""
    argv = list(argv)
    i = argv.index("--fault")
    fault = argv[i + 1]
    del argv[i:i + 2]
    return fault, argv
