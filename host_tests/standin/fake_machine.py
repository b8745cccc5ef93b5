# Stand-in `machine` for the MicroPython unix port inside host_tests/standin_board.py.
#
# Registered as sys.modules["machine"] by prelude.py (the unix port's own
# `machine` has no WDT, Timer or reset). What a board would do in hardware
# is asked of the bridge over a UDP datagram to 127.0.0.1:$STANDIN_CTL:
#   "wdt <ms>"   start the watchdog      "feed"        feed it
#   "reset"      hard reset (machine.reset(): the bridge kills and restarts us)
#   "soft"       soft reset (machine.soft_reset())
# The bridge enforces the watchdog: no feed within <ms> -> it kills the
# interpreter and boots a new one with reset_cause() == WDT_RESET.
import os
import socket
import sys
import time

import _thread

PWRON_RESET = 1
HARD_RESET = 2
WDT_RESET = 3
DEEPSLEEP_RESET = 4
SOFT_RESET = 5

_CAUSES = {"power": PWRON_RESET, "hard": HARD_RESET, "wdt": WDT_RESET, "soft": SOFT_RESET}
_ctl_port = int(os.getenv("STANDIN_CTL") or "0")
_sock = None


def _send(msg):
    global _sock
    if not _ctl_port:
        return
    if _sock is None:
        _sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _sock.sendto(msg.encode(), socket.getaddrinfo("127.0.0.1", _ctl_port)[0][-1])


def reset_cause():
    return _CAUSES.get(os.getenv("STANDIN_RESET_CAUSE") or "power", PWRON_RESET)


def _wait_for_the_bridge():
    # a reset never returns: the bridge kills this process; bounded fallback
    for _ in range(100):
        time.sleep_ms(50)
    sys.exit(17)


def reset():
    _send("reset")
    _wait_for_the_bridge()


def soft_reset():
    _send("soft")
    _wait_for_the_bridge()


def unique_id():
    return b"\x00standin"


def freq(hz=None):
    return 240000000 if hz is None else None


def idle():
    time.sleep_ms(1)


class WDT:
    def __init__(self, id=0, timeout=5000):
        self.timeout = timeout
        _send("wdt %d" % timeout)

    def feed(self):
        _send("feed")


class Timer:
    """A periodic or one-shot timer on a thread (the unix port has no timer
    interrupts). Only what the firmware uses."""

    ONE_SHOT = 0
    PERIODIC = 1

    def __init__(self, id=-1, mode=PERIODIC, period=-1, callback=None, freq=None):
        self._gen = 0
        if callback is not None:
            self.init(mode=mode, period=period, callback=callback)

    def init(self, mode=PERIODIC, period=1000, callback=None, freq=None):
        self._gen += 1
        gen = self._gen
        if freq:
            period = 1000 // freq

        def run():
            while self._gen == gen:
                time.sleep_ms(period)
                if self._gen != gen:
                    break
                try:
                    callback(self)
                except Exception as e:
                    sys.print_exception(e)
                if mode == Timer.ONE_SHOT:
                    break

        _thread.start_new_thread(run, ())

    def deinit(self):
        self._gen += 1


class Pin:
    IN = 0
    OUT = 1
    OPEN_DRAIN = 2
    PULL_UP = 1
    PULL_DOWN = 2

    def __init__(self, id, mode=-1, pull=-1, value=None):
        self.id = id
        self._v = 0 if value is None else value

    def value(self, v=None):
        if v is None:
            return self._v
        self._v = 1 if v else 0
        return None

    def on(self):
        self._v = 1

    def off(self):
        self._v = 0

    def __call__(self, v=None):
        return self.value(v)


class RTC:
    def datetime(self, t=None):
        if t is None:
            g = time.gmtime()
            return (g[0], g[1], g[2], g[6], g[3], g[4], g[5], 0)
        return None
