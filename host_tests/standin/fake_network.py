# Stand-in `network` for the MicroPython unix port inside host_tests/standin_board.py.
#
# WLAN "connects" at once, to any network, unless configured by environment:
#   STANDIN_WIFI_FAILS=N      the first N connect() calls of this boot fail
#                             (status STAT_NO_AP_FOUND after STANDIN_WIFI_DELAY_MS)
#   STANDIN_WIFI_SSID=name    only this network exists (others: STAT_NO_AP_FOUND)
#   STANDIN_WIFI_PASSWORD=pw  and this is its password (else STAT_WRONG_PASSWORD)
# The station's address is 127.0.0.1: the stand-in board is this machine.
# Status codes are ESP32's.
import os
import time

STA_IF = 0
AP_IF = 1
STAT_IDLE = 1000
STAT_CONNECTING = 1001
STAT_GOT_IP = 1010
STAT_NO_AP_FOUND = 201
STAT_WRONG_PASSWORD = 202
STAT_CONNECT_FAIL = 203
AUTH_OPEN = 0
AUTH_WPA2_PSK = 3

_fails_left = [int(os.getenv("STANDIN_WIFI_FAILS") or "0")]
_delay_ms = int(os.getenv("STANDIN_WIFI_DELAY_MS") or "50")
_want_ssid = os.getenv("STANDIN_WIFI_SSID")
_want_key = os.getenv("STANDIN_WIFI_PASSWORD")
connects = []  # (ssid, key) of every connect() call, for tests


def hostname(name=None):
    return "standin" if name is None else None


class WLAN:
    IF_STA = 0
    IF_AP = 1
    SEC_OPEN = 0
    SEC_WPA2 = 3

    def __init__(self, interface=0):
        self.interface = interface
        self._active = False
        self._status = STAT_IDLE
        self._until = 0
        self._outcome = STAT_IDLE
        self._cfg = {"ssid": "", "key": "", "security": 0}

    def active(self, is_active=None):
        if is_active is None:
            return self._active
        self._active = bool(is_active)
        if not self._active:
            self._status = STAT_IDLE
        return None

    def connect(self, ssid=None, key=None, *, bssid=None):
        if not self._active:
            raise OSError("Wifi Not Started")
        connects.append((ssid, key))
        if _fails_left[0] > 0:
            _fails_left[0] -= 1
            outcome = STAT_NO_AP_FOUND
        elif _want_ssid is not None and ssid != _want_ssid:
            outcome = STAT_NO_AP_FOUND
        elif _want_key is not None and key != _want_key:
            outcome = STAT_WRONG_PASSWORD
        else:
            outcome = STAT_GOT_IP
        self._status = STAT_CONNECTING
        self._outcome = outcome
        self._until = time.ticks_add(time.ticks_ms(), _delay_ms)

    def disconnect(self):
        self._status = STAT_IDLE

    def status(self, param=None):
        if param == "rssi":
            return -50
        if self._status == STAT_CONNECTING and time.ticks_diff(time.ticks_ms(), self._until) >= 0:
            self._status = self._outcome
        return self._status

    def isconnected(self):
        if self.interface == AP_IF:
            return self._active
        return self.status() == STAT_GOT_IP

    def ifconfig(self, config=None):
        if config is not None:
            return None
        if self.interface == AP_IF:
            return ("127.0.0.1", "255.0.0.0", "127.0.0.1", "127.0.0.1")
        if self.isconnected():
            return ("127.0.0.1", "255.0.0.0", "127.0.0.1", "127.0.0.1")
        return ("0.0.0.0", "0.0.0.0", "0.0.0.0", "0.0.0.0")

    def ipconfig(self, name):
        if name == "addr4":
            return (self.ifconfig()[0], self.ifconfig()[1])
        return None

    def config(self, *args, **kwargs):
        if args:
            return self._cfg.get(args[0])
        for k in kwargs:
            self._cfg[k] = kwargs[k]
        return None
