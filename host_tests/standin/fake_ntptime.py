# Stand-in `ntptime` for the MicroPython unix port inside host_tests/standin_board.py.
# The unix port's clock is this machine's, already set: settime() only
# pretends, or fails with ETIMEDOUT when STANDIN_NTP=fail (no traffic either way).
import os

host = "pool.ntp.org"
timeout = 1
calls = []


def settime():
    calls.append(host)
    if os.getenv("STANDIN_NTP") == "fail":
        raise OSError(110)  # ETIMEDOUT, as when no NTP answer comes
