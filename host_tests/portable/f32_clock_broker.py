# The real broker (lib/edgebroker.py main) with its clock as a board with
# single-precision floats has it (ESP32 and RP2040 MicroPython:
# MICROPY_FLOAT_IMPL_FLOAT): MonoClock's seconds rounded to IEEE float32,
# starting at an uptime of --fault seconds (wrapper_args' option name). Runs unchanged under CPython
# and MicroPython (whose unix port has double floats). It patches only
# MonoClock.
import struct
import sys

import wrapper_args

wrapper_args.lib_on_path()
import edgebroker  # noqa: E402

UPTIME, argv = wrapper_args.take_fault(sys.argv)
_Mono = edgebroker.MonoClock


class F32Clock(_Mono):
    def __init__(self):
        _Mono.__init__(self)
        self._ms = int(UPTIME) * 1000  # as if the board had been up this long

    def __call__(self):
        s = _Mono.__call__(self)
        return struct.unpack("f", struct.pack("f", s))[0]


edgebroker.MonoClock = F32Clock
edgebroker.main(argv)
