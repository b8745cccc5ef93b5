# gwboot: the gateway's boot steps, run once by gateway.main() and then
# dropped (removed from sys.modules) before the broker serves.
#
# Compiled to /lib/gwboot.mpy by `edgebroker build`. Its bytecode is heap on
# a board without ROMFS; nothing in it runs again after the broker starts,
# so the resident firmware (firmware/gateway.py) keeps only what serving
# needs: the housekeeping task, the watchdog, background Wi-Fi reconnects,
# NTP retries and the crash handling. Nothing may keep a reference into
# this module once start() has returned: the objects it makes (Gateway,
# Watchdog, Reconnector, the broker) are of classes that live elsewhere.
#
# Steps (gateway.main() calls prepare(), then start()):
#   prepare   the profile, the safe mode check, the crash counter + 1, the
#             secrets -> a Gateway (None: stay at the REPL)
#   start     watchdog, Wi-Fi (bounded attempts with backoff) or access
#             point, the clock by NTP, the retained store, the broker
#             listening, a bridge if the profile has one -> the Broker
#             (None: no credentials, nothing to serve)
import gc
import json
import os
import sys
import time

import gateway as g
import machine
import network

try:  # only the type checker has typing; annotations are never evaluated
    from typing import TYPE_CHECKING, Any, Callable
except ImportError:
    TYPE_CHECKING = False

WIFI_ATTEMPTS = 6  # station attempts at boot before the broker starts anyway
WIFI_TIMEOUT_MS = 15000  # one attempt: association + DHCP
WIFI_POLL_MS = 100


# ---------------------------------------------------------------- files
def read_json(path: str) -> "Any":
    """The JSON value in path; None if the file is missing.
    Raises ValueError if it is not JSON."""
    try:
        f = open(path)
    except OSError:
        return None
    try:
        return json.load(f)
    finally:
        f.close()


def load_secrets(path: str) -> "dict[str, Any] | None":
    """The secrets; None when the file is missing, {} (said) when it is
    there but no JSON object: its lines then name what it lacks, not a
    missing file."""
    try:
        s = read_json(path)
    except ValueError as e:
        g.say("%s is not valid JSON (%r): ignored" % (path, e))
        return {}
    if s is not None and not isinstance(s, dict):
        g.say("%s must hold a JSON object: ignored" % path)
        return {}
    return s


# ---------------------------------------------------------------- safe mode
def reset_cause() -> str:
    try:
        cause = machine.reset_cause()
    except (AttributeError, OSError):
        return "unknown"
    for attr, name in (
        ("PWRON_RESET", "power-on"),
        ("HARD_RESET", "hard"),
        ("WDT_RESET", "watchdog"),
        ("DEEPSLEEP_RESET", "deep sleep"),
        ("SOFT_RESET", "soft"),
    ):
        if getattr(machine, attr, None) == cause:
            return name
    return str(cause)


def safe_mode_reason(limit: int, clear_after_s: int) -> "str | None":
    """Why the broker must not start, or None."""
    if g.exists(g.SAFE_FLAG_PATH):
        try:
            with open(g.SAFE_FLAG_PATH) as f:
                why = f.read().strip()
        except OSError:
            why = ""
        return "%s present%s" % (g.SAFE_FLAG_PATH, (": " + why) if why else "")
    n = g.read_int(g.CRASHES_PATH)
    if limit > 0 and n >= limit:
        return (
            "%d boots in a row ended before the broker had served %d s, or their "
            "app.py crashed in that time (safe_mode_crashes %d)" % (n, clear_after_s, limit)
        )
    return None


def prepare(profile_path: str, secrets_path: str, clear_after_s: int) -> "g.Gateway | None":
    """The profile and the safe mode check; then this boot is counted (the
    crash counter + 1, taken back by gateway.main() when the boot ends
    without a crash) and the Gateway made. None: stay at the REPL."""
    g.say("boot (%s reset), %s" % (reset_cause(), sys.version))
    try:
        profile = read_json(profile_path)
    except ValueError as e:
        profile = None
        g.say("%s is not valid JSON (%r)" % (profile_path, e))
    if not isinstance(profile, dict):
        g.say(
            "no board profile %s: run `edgebroker flash BOARD --port PORT`; "
            "staying at the REPL" % profile_path
        )
        return None
    limit = profile.get("safe_mode_crashes")
    if limit is None:
        limit = g.SAFE_MODE_CRASHES
    elif type(limit) is not int:
        # a hand-edited file (`edgebroker flash` refuses this): said, and
        # the default keeps boot loops broken
        g.say(
            "%s: safe_mode_crashes %r is not an integer (0..100): using %d"
            % (profile_path, limit, g.SAFE_MODE_CRASHES)
        )
        limit = g.SAFE_MODE_CRASHES
    why = safe_mode_reason(limit, clear_after_s)
    if why is not None:
        g.say("SAFE MODE: broker not started: " + why)
        if not g.exists(g.LAST_CRASH_PATH):
            # a crash from before the last boot that served is kept apart
            g.say(
                "no crash recorded since the last boot that served %d s (a watchdog "
                "reset or a power cut records none)%s"
                % (
                    clear_after_s,
                    "; an older one is in " + g.OLD_CRASH_PATH
                    if g.exists(g.OLD_CRASH_PATH)
                    else "",
                )
            )
        else:
            g.say("last crash (%s):" % g.LAST_CRASH_PATH)
            try:
                with open(g.LAST_CRASH_PATH) as f:
                    print(f.read(), end="")
            except OSError:
                pass
        g.say(
            "staying at the REPL. Fix the cause, then `import gateway; gateway.clear()` "
            "and reset (or run `edgebroker flash` again)"
        )
        return None
    before = g.read_int(g.CRASHES_PATH)
    g.write_text(g.CRASHES_PATH, str(before + 1))
    gw = g.Gateway(profile, load_secrets(secrets_path), clear_after_s, limit)
    gw.before = before
    return gw


# ---------------------------------------------------------------- Wi-Fi
def _status_names() -> "dict[int, str]":
    names = {}
    for attr, text in (
        ("STAT_WRONG_PASSWORD", "wrong password"),
        ("STAT_NO_AP_FOUND", "no access point found"),
        ("STAT_CONNECT_FAIL", "connection failed"),
    ):
        code = getattr(network, attr, None)
        if code is not None:
            names[code] = text
    return names


def wifi_attempt(
    wlan: "network.WLAN", ssid: str, key: str, timeout_ms: int, wait: "Callable[[int], None]"
) -> "str | None":
    """One station attempt: None when connected, else why it failed."""
    try:
        wlan.disconnect()
    except OSError:
        pass
    wlan.connect(ssid, key)
    failed = _status_names()
    waited = 0
    while waited < timeout_ms:
        if wlan.isconnected():
            return None
        st = wlan.status()
        if st in failed:
            return failed[st]
        wait(WIFI_POLL_MS)
        waited += WIFI_POLL_MS
    return "no connection after %d ms" % timeout_ms


def connect_wifi(
    wlan: "network.WLAN",
    ssid: str,
    key: str,
    wait: "Callable[[int], None]",
    attempts: int = WIFI_ATTEMPTS,
    base_ms: int = g.WIFI_BASE_MS,
    max_ms: int = g.WIFI_MAX_MS,
    timeout_ms: int = WIFI_TIMEOUT_MS,
) -> bool:
    """Bounded station connect: up to `attempts` tries with exponential
    backoff between them. True once connected."""
    say = g.say
    wlan.active(True)
    for n in range(1, attempts + 1):
        say("wifi connecting to %r (attempt %d of %d)" % (ssid, n, attempts))
        why = wifi_attempt(wlan, ssid, key, timeout_ms, wait)
        if why is None:
            say("wifi connected " + wlan.ifconfig()[0])
            return True
        if n < attempts:
            d = g.backoff_ms(n, base_ms, max_ms)
            say("wifi attempt %d failed (%s), retrying in %d ms" % (n, why, d))
            wait(d)
        else:
            say("wifi attempt %d failed (%s)" % (n, why))
    say(
        "wifi not connected after %d attempts: starting the broker anyway, "
        "reconnecting in the background" % attempts
    )
    return False


def wlan_interface(name: str) -> int:
    """network.WLAN.IF_STA / IF_AP (MicroPython 1.24+), else the older
    network.STA_IF / AP_IF."""
    n = getattr(network.WLAN, "IF_" + name, None)
    if n is None:
        n = getattr(network, name + "_IF")
    return int(n)


def start_ap(ssid: str, key: str) -> str:
    """Access point with WPA2 (key of 8..63 characters). Returns its address."""
    ap = network.WLAN(wlan_interface("AP"))
    sec = getattr(network.WLAN, "SEC_WPA2", getattr(network, "AUTH_WPA2_PSK", None))
    if sec is None:
        ap.config(ssid=ssid, key=key)
    else:
        ap.config(ssid=ssid, key=key, security=sec)
    ap.active(True)
    ip: str = ap.ifconfig()[0]
    g.say("access point %r up, address %s" % (ssid, ip))
    return ip


def credentials(gw: "g.Gateway", mode: str) -> "tuple[str, str] | None":
    s = gw.secrets or {}
    if mode == "ap":
        ssid = gw.profile.get("ap_ssid") or "edgebroker"
        key = s.get("ap_password") or ""
        if len(key) < 8:
            g.say(
                'no access point password: /secrets.json needs "ap_password" '
                '(8 to 63 characters) for wifi_mode "ap"'
            )
            return None
        return ssid, key
    ssid = s.get("wifi_ssid") or ""
    if not ssid:
        g.say('no Wi-Fi credentials: /secrets.json needs "wifi_ssid" and "wifi_password"')
        return None
    return ssid, s.get("wifi_password") or ""


def network_up(gw: "g.Gateway") -> bool:
    """Station or access point per wifi_mode, the watchdog, the clock.
    False: nothing to serve."""
    say = g.say
    mode = gw.profile.get("wifi_mode") or "sta"
    if mode != "sta" and mode != "ap":
        say('unknown wifi_mode %r (expected "sta" or "ap")' % (mode,))
        return False
    if gw.secrets is None:
        say("no %s: Wi-Fi stays off and the broker is not started." % g.SECRETS_PATH)
    creds = credentials(gw, mode)
    if creds is None:
        say(
            "copy firmware/secrets.example.json to firmware/secrets.json, fill it in, "
            "run `edgebroker flash` again (or mpremote cp it to :/secrets.json), then reset"
        )
        return False
    gw.wdt = g.Watchdog(int(gw.profile.get("watchdog_ms", g.WATCHDOG_MS)))
    if mode == "ap":
        start_ap(creds[0], creds[1])
        return True
    wlan = network.WLAN(wlan_interface("STA"))
    up = connect_wifi(wlan, creds[0], creds[1], gw.wait)
    gw.wifi = g.Reconnector(wlan, creds[0], creds[1], up)
    gw.ntp = bool(gw.profile.get("ntp", True))
    gw.ntp_host = gw.profile.get("ntp_host")
    if gw.ntp and up:
        gw.wdt.feed()
        if g.sync_clock(gw.ntp_host):
            gw.ntp_every_s = g.NTP_RESYNC_S
    gw.ntp_next_ms = time.ticks_add(time.ticks_ms(), gw.ntp_every_s * 1000)
    return True


# ---------------------------------------------------------------- the broker
def start_broker(gw: "g.Gateway") -> "Any":
    """edgebroker's public API: the profile's limits (with the users and
    bridge credentials of /secrets.json), its retained store in DATA_DIR,
    listening on the profile's bind:port. What edgebroker.start() does, but
    the store gets this board's wallclock(), which knows whether NTP set the
    clock (an RP2 boots with its RTC at 2021-01-01, a date that looks set)."""
    gc.collect()
    import edgebroker  # here, not at the top: an import failure is a crash like any other

    # users and bridge credentials live in /secrets.json, not the profile
    cfg = edgebroker.limits(edgebroker.with_secrets(gw.profile, gw.secrets))
    edgebroker.load_modules(cfg)  # before the broker's objects: no holes between them
    clock = edgebroker.MonoClock()  # one monotonic clock for the store and the broker
    try:
        os.mkdir(g.DATA_DIR)
    except OSError:
        pass  # exists
    store = edgebroker.open_store(cfg, g.DATA_DIR, clock, g.wallclock, g.store_log)
    broker = edgebroker.Broker(cfg, store, clock)
    bind = gw.profile.get("bind") or g.BIND
    port = int(gw.profile.get("port") or g.PORT)
    try:
        broker.listen(bind, port)
    except OSError:
        store.close()
        raise
    wifi = gw.wifi
    if wifi is not None:
        broker.net_up = wifi.wlan.isconnected  # a bridge waits for the station
    if cfg["bridges"]:
        import edgebridge  # only on a board whose profile bridges

        edgebridge.attach(broker, cfg["bridges"], g.DATA_DIR)
    print("edgebroker listening on %s:%d (%s)" % (bind, port, sys.implementation.name))
    return broker


def start(gw: "g.Gateway") -> "Any":
    """The network, then the broker: the Broker, or None (nothing to serve)."""
    if not network_up(gw):
        return None
    return start_broker(gw)
