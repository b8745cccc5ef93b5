# The real broker (lib/edgebroker.py main) whose engine runs out of heap
# once at one chosen point, for test_pubsub.py; runs unchanged under
# CPython and MicroPython. It patches only that Engine method:
#   --fault puback   the first PUBACK written raises MemoryError (with a
#                    flash store, retained QoS 1 acks wait for the commit
#                    and are written when it is done)
#   --fault pump     the first pump of a connected session with messages
#                    queued raises it (the turn's pump of a session whose
#                    send buffer drained, when no ack came meanwhile)
import sys

import wrapper_args

wrapper_args.lib_on_path()
import edgebroker  # noqa: E402

FAULT, argv = wrapper_args.take_fault(sys.argv)
left = [1]
Engine = edgebroker.Engine
_write = Engine.write
_pump = Engine.pump


def write(self, conn, data):
    if left[0] and data[0] == 0x40:
        left[0] = 0
        raise MemoryError("test: no heap for a PUBACK")
    _write(self, conn, data)


def pump(self, sess):
    if left[0] and sess.conn is not None and sess.queue:
        left[0] = 0
        raise MemoryError("test: no heap for a pump")
    _pump(self, sess)


if FAULT == "puback":
    Engine.write = write
elif FAULT == "pump":
    Engine.pump = pump
else:
    raise SystemExit("unknown --fault " + FAULT)
edgebroker.main(argv)
