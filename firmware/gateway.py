# gateway: what an edgebroker board runs after boot (main.py calls main()).
#
# Compiled to /lib/gateway.mpy by `edgebroker build`. The only modules, with
# gwboot.py, boot.py and main.py, that import `machine` and `network`: the
# broker (lib/edgebroker.py) knows nothing about the board it runs on.
#
# This module stays in the heap while the broker serves, so it holds only
# what serving needs. The boot steps (profile, safe mode check, secrets,
# the first Wi-Fi connect or the access point, starting the broker) are
# firmware/gwboot.py's: main() imports it, runs it, and drops it before the
# broker serves (its bytecode is heap on a board without ROMFS).
#
# Sections:
#   1. files and console     /board.json, /secrets.json, status lines
#   2. clock                 wallclock() in Unix seconds, NTP
#   3. Wi-Fi                 background station reconnects with bounded backoff
#   4. watchdog              machine.WDT fed from the housekeeping task
#   5. safe mode             a crash counter that breaks boot loops
#   6. the gateway           run the broker and the app; main() wraps it all
#
# Boot sequence (main(); the steps up to broker.listen are gwboot's):
#   profile -> safe mode check -> crash counter + 1 -> secrets -> watchdog ->
#   Wi-Fi (or access point) -> clock -> retained store -> broker.listen ->
#   one asyncio loop (asyncio.run) with three tasks:
#     - the broker: `await broker.serve_async()`;
#     - housekeeping, every HOUSEKEEPING_MS: feeds the watchdog, clears the
#       crash counter after CLEAR_AFTER_S of serving, reconnects Wi-Fi,
#       retries NTP;
#     - the user's app, if /app.py exists: its `async def main(broker)`
#       (firmware/userapp.py; README.md "Your code on the gateway").
#
# What happens when something is missing or fails (also in README.md,
# "Flash a gateway"):
#   - no /board.json or not JSON: message, the board stays at the REPL.
#   - no /secrets.json, or no credentials for the profile's wifi_mode: message,
#     radio off, broker NOT started, the board stays at the REPL (a broker
#     nobody can reach, or an open access point with an anonymous broker,
#     helps no one). Not counted as a crash.
#   - Wi-Fi does not connect within WIFI_ATTEMPTS attempts (exponential
#     backoff, WIFI_BASE_MS doubling up to WIFI_MAX_MS): the broker starts
#     anyway and the station keeps reconnecting in the background.
#   - NTP fails: the clock stays unset (wallclock() is None) and NTP is
#     retried from the housekeeping task with a growing interval.
#   - an exception escapes the broker (or the housekeeping task, which then
#     stops the broker): the traceback goes to the console and to
#     /last_crash.txt, then machine.reset() after CRASH_DELAY_MS (Ctrl-C in
#     that window keeps the board at the REPL).
#   - the app's main() raises (or app.py does not import): traceback on the
#     console, counted in broker.engine.app_errors, the broker goes on and
#     main() is not started again until the next reset. "At boot" means
#     before the broker has served CLEAR_AFTER_S: such a crash also goes to
#     /last_crash.txt and the crash counter is not cleared, so the boot
#     counts toward safe mode. A later crash does not count.
#   - anything that holds the loop (a blocking call in the app included)
#     longer than watchdog_ms starves the housekeeping task: watchdog reset.
#   - safe_mode_crashes boots in a row that never served CLEAR_AFTER_S
#     seconds (crashes, watchdog resets, power cuts during start-up) or whose
#     app crashed at boot, or a /safe_mode file (edgebroker flash writes it
#     while copying): safe mode. The broker is not started, no app, no
#     watchdog, the board stays at the REPL and says why. gateway.clear()
#     (or a new `edgebroker flash`) ends it.
#   - Ctrl-C (also mpremote connecting): the broker and the app stop, the
#     boot is not counted as a crash, and a running watchdog (it cannot be
#     stopped) is fed from a timer for MAINTENANCE_S so the REPL stays usable.
#
# Type-checked with mypy against micropython-esp32-stubs and
# micropython-rp2-stubs (host_tests/tools/test_firmware.py). Annotations cost
# nothing on the board: MicroPython's compiler ignores them.

import gc
import io
import os
import sys
import time

import machine
import network

try:  # only the type checker has typing; annotations are never evaluated
    from typing import TYPE_CHECKING, Any
except ImportError:
    TYPE_CHECKING = False
if TYPE_CHECKING:  # the stubs' type of time.ticks_ms() values
    from _mpy_shed.time_mp import _TicksMs as Ticks

# ---------------------------------------------------------------- 1. files and console
PROFILE_PATH = "/board.json"
SECRETS_PATH = "/secrets.json"
CRASHES_PATH = "/crashes"  # boots in a row that did not serve CLEAR_AFTER_S
SAFE_FLAG_PATH = "/safe_mode"  # present: safe mode (its text says why)
LAST_CRASH_PATH = "/last_crash.txt"
OLD_CRASH_PATH = "/last_crash.old.txt"  # recorded before the last boot that served
DATA_DIR = "/data"  # the retained store's directory
APP_PATH = "/app.py"  # the user's code (userapp.py): `edgebroker flash --app FILE` puts it here

CLEAR_AFTER_S = 30  # serving this long clears the crash counter ("at boot": before that)
HOUSEKEEPING_MS = 1000  # watchdog feed, crash counter, Wi-Fi, NTP: this often
CRASH_DELAY_MS = 2000  # pause before machine.reset() after a crash (Ctrl-C stays)
SAFE_MODE_CRASHES = 3  # default of the profile's safe_mode_crashes (0 = off)
MAINTENANCE_S = 600  # after Ctrl-C, a running watchdog is fed this long
WATCHDOG_MS = 8000  # default of the profile's watchdog_ms (0 = off)
PORT = 1883  # default of the profile's port
BIND = "0.0.0.0"  # default of the profile's bind: every interface

WIFI_BASE_MS = 1000  # first backoff delay; doubles after each failure
WIFI_MAX_MS = 30000  # backoff cap (boot and background)

NTP_RETRY_S = 60  # first NTP retry after a failure; doubles
NTP_RETRY_MAX_S = 3600
NTP_RESYNC_S = 86400  # re-sync once a day (board RTCs drift seconds a day)
MIN_CLOCK_YEAR = 2024  # an RTC showing an earlier year was never set


def say(text: str) -> None:
    """One status line on the console: `edgebroker: <text>`."""
    print("edgebroker: " + text)


def read_int(path: str) -> int:
    """A small counter file; 0 when missing or unreadable."""
    try:
        with open(path) as f:
            return int(f.read().strip() or "0")
    except (OSError, ValueError):
        return 0


def write_text(path: str, text: str) -> bool:
    """Write a small file whole (littlefs commits it at close). False, and
    said, when the filesystem refuses it (full, read-only): a counter or a
    crash record is not worth the boot."""
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError as e:
        say("cannot write %s (%r): is the filesystem full?" % (path, e))
        return False


def exists(path: str) -> bool:
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def store_log(level: str, text: str) -> None:
    """The retained store's log (opening, compaction): a console line."""
    say(level + " " + text)


def format_exc(e: BaseException) -> str:
    buf = io.StringIO()
    sys.print_exception(e, buf)
    text: str = buf.getvalue()
    return text


# ---------------------------------------------------------------- 2. clock
# The RTC counts from 2000-01-01 on ESP32 and from 1970-01-01 on the unix
# port and RP2; time.gmtime(0) says which, so no port names are needed.
UNIX_2000 = 946684800
EPOCH_OFFSET = UNIX_2000 if time.gmtime(0)[0] == 2000 else 0

_clock_synced = False


def unix_seconds(board_seconds: int, epoch_offset: int = EPOCH_OFFSET) -> int:
    """Board time.time() -> Unix seconds."""
    return board_seconds + epoch_offset


def wallclock() -> "int | None":
    """Unix seconds, or None while the board's clock was never set (no NTP
    this boot and the RTC still in its power-on year)."""
    if not _clock_synced and time.gmtime()[0] < MIN_CLOCK_YEAR:
        return None
    return unix_seconds(time.time())


def sync_clock(host: "str | None") -> bool:
    """Set the RTC by NTP (blocks up to ntptime.timeout, 1 s). True if set."""
    global _clock_synced
    try:
        import ntptime
    except ImportError:
        say("clock not set: this firmware has no ntptime")
        return False
    if host:
        ntptime.host = host
    try:
        ntptime.settime()
    except (OSError, OverflowError, IndexError, ValueError) as e:
        say("clock not set: ntp %s failed (%r)" % (ntptime.host, e))
        return False
    _clock_synced = True
    t = time.gmtime()
    say(
        "clock set by ntp %s: %04d-%02d-%02d %02d:%02d:%02d UTC"
        % (ntptime.host, t[0], t[1], t[2], t[3], t[4], t[5])
    )
    return True


# ---------------------------------------------------------------- 3. Wi-Fi
def backoff_ms(failures: int, base_ms: int = WIFI_BASE_MS, max_ms: int = WIFI_MAX_MS) -> int:
    """Delay after the n-th failure (1-based): base, 2 base, 4 base ... max."""
    d = base_ms
    for _ in range(failures - 1):
        d *= 2
        if d >= max_ms:
            return max_ms
    return d if d < max_ms else max_ms


class Reconnector:
    """Background station reconnects from the housekeeping task, never blocking: connect()
    starts an association; the next try waits an exponentially growing
    delay (capped at max_ms) while the link stays down."""

    def __init__(
        self,
        wlan: "network.WLAN",
        ssid: str,
        key: str,
        up: bool,
        base_ms: int = WIFI_BASE_MS,
        max_ms: int = WIFI_MAX_MS,
    ) -> None:
        self.wlan = wlan
        self.ssid = ssid
        self.key = key
        self.up = up
        self.base_ms = base_ms
        self.max_ms = max_ms
        self.failures = 0
        self.next_ms = time.ticks_ms()

    def poll(self, now_ms: "Ticks") -> None:
        wlan = self.wlan
        if wlan.isconnected():
            if not self.up:
                self.up = True
                self.failures = 0
                say("wifi connected " + wlan.ifconfig()[0])
            return
        if self.up:
            self.up = False
            self.next_ms = now_ms
            say("wifi lost, reconnecting to %r" % self.ssid)
        if time.ticks_diff(now_ms, self.next_ms) < 0:
            return
        self.failures += 1
        self.next_ms = time.ticks_add(now_ms, backoff_ms(self.failures, self.base_ms, self.max_ms))
        try:
            wlan.disconnect()
            wlan.connect(self.ssid, self.key)
        except OSError as e:
            say("wifi reconnect failed (%r)" % (e,))


# ---------------------------------------------------------------- 4. watchdog
class Watchdog:
    """machine.WDT when timeout_ms > 0, else nothing. Once started it cannot
    be stopped (ESP32, RP2): feed() must be called more often than timeout_ms."""

    def __init__(self, timeout_ms: int) -> None:
        self.wdt: "machine.WDT | None" = None
        self.timeout_ms = timeout_ms
        self.timer: "Any" = None
        if timeout_ms > 0:
            try:
                self.wdt = machine.WDT(timeout=timeout_ms)
            except (ValueError, OSError) as e:
                say("watchdog not started (%r)" % (e,))
                return
            say("watchdog %d ms" % timeout_ms)

    def feed(self) -> None:
        if self.wdt is not None:
            self.wdt.feed()

    def maintenance(self, seconds: int) -> None:
        """Feed from a timer for `seconds` (the REPL stays usable after
        Ctrl-C), then stop feeding: the board resets into normal operation.
        A soft reset also stops the timer, and the watchdog then fires."""
        wdt = self.wdt
        if wdt is None:
            return
        wdt.feed()  # the last feed may be most of a timeout ago
        period = min(1000, max(self.timeout_ms // 3, 1))
        left = [seconds * 1000 // period]

        def feed(t: "Any") -> None:
            if left[0] > 0:
                left[0] -= 1
                wdt.feed()
            else:
                t.deinit()

        for tid in (-1, 0):  # a virtual timer where the port has one
            try:
                self.timer = machine.Timer(
                    tid, mode=machine.Timer.PERIODIC, period=period, callback=feed
                )
                break
            except (ValueError, OSError, TypeError):
                continue
        if self.timer is None:
            say("watchdog %d ms still running: the board resets soon" % self.timeout_ms)
        else:
            say(
                "watchdog still running: fed for %d s (maintenance), then the board resets"
                % seconds
            )


# ---------------------------------------------------------------- 5. safe mode
def clear() -> None:
    """Leave safe mode: clear the crash counter and the flag. Reset next."""
    remove(CRASHES_PATH)
    remove(SAFE_FLAG_PATH)
    say("safe mode cleared: press Ctrl-D (soft reset) or reset the board to start the broker")


def record_crash(e: BaseException) -> None:
    text = format_exc(e)
    print(text, end="")
    write_text(LAST_CRASH_PATH, text[-2048:])


# ---------------------------------------------------------------- 6. the gateway
class Gateway:
    """One boot's run: network, clock, store, then one asyncio loop with the
    broker, the housekeeping task and the user's app. run() returns when
    there is nothing to do (no credentials) or the broker was stopped; it
    raises what the broker or the housekeeping raises (main() decides what
    that means). A crash of the app is not raised: see app()."""

    def __init__(
        self,
        profile: "dict[str, Any]",
        secrets: "dict[str, Any] | None",
        clear_after_s: int = CLEAR_AFTER_S,
        safe_limit: int = SAFE_MODE_CRASHES,
    ) -> None:
        self.profile = profile
        self.secrets = secrets
        self.clear_after_ms = clear_after_s * 1000
        self.wdt = Watchdog(0)
        self.wifi: "Reconnector | None" = None
        self.ntp = False
        self.ntp_host: "str | None" = None
        self.ntp_every_s = NTP_RETRY_S
        self.ntp_next_ms = time.ticks_ms()
        self.t0 = time.ticks_ms()
        self.boot_over = False  # served clear_after_s: later crashes are not at boot
        self.cleared = False  # ... and the crash counter was cleared
        self.app_crashed = False  # app.py crashed at boot: the counter stays
        self.safe_limit = safe_limit
        self.failure: "Exception | None" = None  # what stopped the broker from beside it
        self.before = 0  # the crash counter before this boot (gwboot.prepare)

    def wait(self, ms: int) -> None:
        """Sleep in watchdog-sized steps, feeding it."""
        while ms > 0:
            step = 200 if ms > 200 else ms
            self.wdt.feed()
            time.sleep_ms(step)
            ms -= step

    def run(self, broker: "Any") -> None:
        """Serves until the broker stops (gwboot.start() made it)."""
        import asyncio

        try:
            asyncio.run(self.serve(broker))
        finally:
            # Ctrl-C leaves asyncio.run() from whichever task it hit, so the
            # broker may not have shut down; shutdown() is a no-op if it did.
            # A fresh event loop drops the tasks left queued, so asyncio code
            # typed at the REPL afterwards does not run them.
            broker.shutdown()
            asyncio.new_event_loop()
        if self.failure is not None:
            raise self.failure

    async def serve(self, broker: "Any") -> None:
        """The broker's asyncio server with the housekeeping task and, if
        /app.py exists, the user's app beside it."""
        import asyncio

        self.t0 = time.ticks_ms()
        tasks = [asyncio.create_task(self.housekeeping(broker))]
        if exists(APP_PATH):
            tasks.append(asyncio.create_task(self.app(broker)))
        try:
            await broker.serve_async()
        finally:
            for t in tasks:
                t.cancel()

    async def housekeeping(self, broker: "Any") -> None:
        """Beside the broker, every HOUSEKEEPING_MS: watchdog, crash
        counter, Wi-Fi, NTP. Its own task, so a loop held up by anything
        (the broker, the app, a blocking call) starves the watchdog. An
        exception here stops the broker and run() raises it: a crash."""
        import asyncio

        try:
            while broker.running:
                self.tick()
                await asyncio.sleep_ms(HOUSEKEEPING_MS)
        except Exception as e:
            self.failure = e
            broker.stop()

    async def app(self, broker: "Any") -> None:
        """/app.py's main(broker), through userapp.run (which logs and counts
        a crash). A crash at boot (before the broker has served
        CLEAR_AFTER_S) is recorded in LAST_CRASH_PATH and keeps this boot
        counted in the crash counter: safe_mode_crashes such boots in a row
        mean safe mode. A later crash does not count."""
        import userapp

        e = await userapp.run(broker, say)
        if e is None:
            return
        if self.boot_over:
            say("app.py is not restarted until the next reset")
            return
        self.app_crashed = True
        write_text(LAST_CRASH_PATH, format_exc(e)[-2048:])
        if self.safe_limit > 0:
            say(
                "app.py crashed at boot: this boot counts toward safe mode (crash counter "
                "%d, safe mode at %d); app.py is not restarted until the next reset"
                % (read_int(CRASHES_PATH), self.safe_limit)
            )
        else:
            say(
                "app.py crashed at boot (safe mode off: safe_mode_crashes 0); "
                "app.py is not restarted until the next reset"
            )

    def tick(self) -> None:
        """From the housekeeping task: watchdog, crash counter, Wi-Fi, NTP.
        Must stay short: the broker waits for it."""
        self.wdt.feed()
        now = time.ticks_ms()
        if not self.boot_over and time.ticks_diff(now, self.t0) >= self.clear_after_ms:
            self.boot_over = True
            if self.app_crashed:
                say(
                    "up %d s; app.py crashed at boot: crash counter stays %d"
                    % (self.clear_after_ms // 1000, read_int(CRASHES_PATH))
                )
            else:
                self.cleared = True
                write_text(CRASHES_PATH, "0")
                if exists(LAST_CRASH_PATH):
                    # older than this boot that served: kept apart, so that
                    # safe mode never gives it as the reason for later boots
                    # (copied, at most 2 KB: rename differs between VFSes)
                    try:
                        with open(LAST_CRASH_PATH) as f:
                            text = f.read()
                    except OSError:
                        text = None
                    if text is not None and write_text(OLD_CRASH_PATH, text):
                        remove(LAST_CRASH_PATH)
                say("up %d s: crash counter cleared" % (self.clear_after_ms // 1000))
        wifi = self.wifi
        if wifi is not None:
            wifi.poll(now)
            if self.ntp and time.ticks_diff(now, self.ntp_next_ms) >= 0:
                if not wifi.up:
                    # due with Wi-Fi down: kept due at now, so that the
                    # deadline never falls more than half of ticks_ms'
                    # period (6.2 days) behind, where ticks_diff reads it as
                    # ahead and the sync would wait up to 6 days more
                    self.ntp_next_ms = now
                    return
                if sync_clock(self.ntp_host):
                    self.ntp_every_s = NTP_RESYNC_S
                elif self.ntp_every_s < NTP_RETRY_MAX_S:
                    self.ntp_every_s = min(self.ntp_every_s * 2, NTP_RETRY_MAX_S)
                self.ntp_next_ms = time.ticks_add(time.ticks_ms(), self.ntp_every_s * 1000)


def _drop_boot() -> None:
    # gwboot's code is heap: gone once nothing refers to it
    sys.modules.pop("gwboot", None)
    gc.collect()


def main(
    profile_path: str = PROFILE_PATH,
    secrets_path: str = SECRETS_PATH,
    clear_after_s: int = CLEAR_AFTER_S,
    crash_delay_ms: int = CRASH_DELAY_MS,
) -> None:
    """Boot the gateway (main.py). Returns to the REPL in safe mode, without
    a profile or credentials, or after Ctrl-C; resets the board on a crash.
    The boot steps are firmware/gwboot.py's, dropped before serving."""
    try:
        import gwboot
    except ImportError as e:  # a missing or damaged /lib/gwboot.mpy
        say("cannot import gwboot (%r): run `edgebroker flash` again; at the REPL" % (e,))
        return

    gw = gwboot.prepare(profile_path, secrets_path, clear_after_s)
    if gw is None:
        del gwboot
        _drop_boot()
        return
    try:
        broker = gwboot.start(gw)
        del gwboot
        _drop_boot()
        if broker is not None:
            gw.run(broker)
    except KeyboardInterrupt:
        if not gw.cleared:
            write_text(CRASHES_PATH, str(gw.before))  # a deliberate stop is not a crash
        say("stopped by Ctrl-C; at the REPL")
        gw.wdt.maintenance(MAINTENANCE_S)
        return
    except Exception as e:  # the broker crashed: record, then reset to recover
        record_crash(e)
        say("crashed (%r): reset in %d ms, Ctrl-C stays at the REPL" % (e, crash_delay_ms))
        try:
            gw.wait(crash_delay_ms)
        except KeyboardInterrupt:
            say("reset cancelled; at the REPL")
            gw.wdt.maintenance(MAINTENANCE_S)
            return
        machine.reset()
    if not gw.cleared:
        write_text(CRASHES_PATH, str(gw.before))  # nothing to serve is not a crash either
