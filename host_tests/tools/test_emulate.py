"""`edgebroker emulate BOARD`: the broker with a board's heap, limits and flash
store, under the MicroPython unix port (and, where meaningful, CPython).

The full-load tests run a board's whole profile through the real command and
hold that the worst case `edgebroker config check` accepted really fits:

  1. max_sessions persistent sessions, each left offline with max_inflight
     unacknowledged and max_queued queued QoS 1 messages;
  2. max_retained_messages retained messages of typical_payload_bytes,
     stored with the profile's storage_type (disc/disc_only: lib/edgestore.py's
     FlashStore in the emulator's data directory);
  3. max_clients clients at once, each with max_subscriptions subscriptions of
     the shape boards/memory_costs.json was measured with (4 levels, no level
     shared); the last one's final subscription is `ret/#`, which delivers the
     whole retained set, paced by the inflight window;
  4. QoS 1 at full inflight: every client holds max_inflight unacknowledged
     messages with max_queued more queued behind them (with max_queued_total
     set, the queues of steps 1 and 4 hold that many together, the first
     ones full; topics of
     typical_topic_bytes, payloads of typical_payload_bytes); under
     MicroPython a $SYS round (gc.collect()) at that peak must still show
     heap_reserve free;
  5. everything is acknowledged and every message arrives exactly once; the
     offline sessions come back and get all of theirs;
  6. $SYS/broker/refusals/ shows no refusal of cause memory, retained_heap,
     heap_reserve or publish_heap; the broker is alive and stops cleanly on SIGINT (exit 0).

Under MicroPython the heap is exactly heap_bytes (-X heapsize). CPython runs
the same load with no heap limit.
"""

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgebroker_tools import profiles
from edgebroker_tools.commands import emulate as emulate_cmd
from edgebroker_tools.mqttclient import Client, parse_publish, puback_packet, publish_packet

REPO = Path(__file__).resolve().parents[2]
EDGEBROKER = Path(sys.executable).parent / "edgebroker"
BAD_CAUSES = ("memory", "retained_heap", "heap_reserve", "publish_heap")


def _free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def effective(board):
    r = subprocess.run([str(EDGEBROKER), "config", "show", board], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Emulator:
    """`edgebroker emulate` as a subprocess, stdout read up to the listening line."""

    def __init__(self, board, interp, tmp_path, extra=()):
        self.port = _free_port()
        self.log = tmp_path / "emulate.log"
        self.cmd = [str(EDGEBROKER), "emulate", board, "--port", str(self.port),
                    "--interpreter", interp, "--data-dir", str(tmp_path / "flash"), "--fresh",
                    *extra]
        self.err = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True)
        self.lines = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.err.flush()
                pytest.fail("emulate exited before listening:\n%s" % self.log.read_text())
            self.lines.append(line)
            if line.startswith("edgebroker listening on"):
                break

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGINT):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=5)
        self.lines += out.splitlines(True)
        self.err.close()
        return self.proc.returncode

    def log_text(self):
        if not self.err.closed:
            self.err.flush()
        return self.log.read_text()


# ---------------------------------------------------------------- the load
def padded(prefix, size):
    """A topic of `size` bytes (or the prefix, if that is longer)."""
    return prefix + "x" * max(size - len(prefix), 0)


def filters_for(name, n, size=0):
    """n subscriptions of the measured shape (edgebroker_tools.measure FILTER):
    4 levels, the first three shared by pairs; the first one's last level
    padded to `size` bytes in all (topic_for: the topic it alone matches)."""
    out = ["%s%02d/device-%s%02d/sensor-%02d/v%02d" % (name, k // 2, name, k // 2, k // 2, k)
           for k in range(n)]
    if out:
        out[0] = padded(out[0], size)
    return out


def topic_for(name, size):
    """A topic of `size` bytes matched by filters_for(name, ..., size)[0] only."""
    return filters_for(name, 1, size)[0]


def payloads(tag, n, size):
    return [padded("%s-%05d-" % (tag, i), size).encode() for i in range(n)]


def connect(port, cid, clean=True):
    c = Client(port, cid)
    rc = c.connect(clean=clean)
    assert rc == 0, "%s: CONNACK %d" % (cid, rc)
    return c


class Received:
    """PUBLISHes a client got (not acknowledged unless asked), $SYS heap aside."""

    def __init__(self):
        self.msgs = []
        self.heap_free = []

    def take(self, first, body):
        m = parse_publish(first, body)
        if m.topic.startswith("$SYS/"):
            if m.topic == "$SYS/broker/heap/free":
                self.heap_free.append(int(m.payload))
            return None
        self.msgs.append(m)
        return m


def publish_collect(c, topic, items, got, timeout=60.0):
    """QoS 1 PUBLISHes pipelined (window 16), every PUBACK awaited; PUBLISHes
    arriving meanwhile go to `got` unacknowledged."""
    waiting = set()
    deadline = time.monotonic() + timeout
    items = list(items)
    i = 0
    while i < len(items) or waiting:
        while i < len(items) and len(waiting) < 16:
            pid = c.next_pid()
            c.send(publish_packet(topic, items[i], 1, False, pid))
            waiting.add(pid)
            i += 1
        first, body = c.read_packet(max(deadline - time.monotonic(), 0.1))
        if first >> 4 == 4:
            waiting.discard(body[0] << 8 | body[1])
        elif first >> 4 == 3:
            got.take(first, body)


def read_until(c, got, n, ack, timeout=60.0):
    """Read until `got` holds n messages; acknowledge each one if ack."""
    deadline = time.monotonic() + timeout
    while len(got.msgs) < n:
        first, body = c.read_packet(max(deadline - time.monotonic(), 0.1))
        if first >> 4 == 3:
            m = got.take(first, body)
            if m is not None and ack:
                c.ack(m)


def ack_all(c, msgs):
    for m in msgs:
        c.send(puback_packet(m.pid))


def read_sys(port):
    """The retained $SYS/broker/... set, read by a fresh connection."""
    c = connect(port, "sys-reader")
    c.subscribe([("$SYS/broker/#", 0)])
    values = {}
    while True:
        p = c.poll_packet(0.5)
        if p is None:
            break
        if p[0] >> 4 == 3:
            m = parse_publish(*p)
            values[m.topic[12:]] = m.payload.decode()
    c.disconnect()
    return values


def full_load(port, cfg, micropython):
    """Steps 1-6 of the module docstring; returns figures for the report."""
    n_clients = cfg["max_clients"]
    n_subs = cfg["max_subscriptions"]
    window = cfg["max_inflight"]
    queued = cfg["max_queued"]
    # max_queued_total: all queues together hold at most that many (the
    # bound would drop the rest): the first queues get it in full
    left = [cfg.get("max_queued_total") or (1 << 30)]

    def share():
        k = min(queued, left[0])
        left[0] -= k
        return k

    tsize = cfg["typical_topic_bytes"]
    psize = cfg["typical_payload_bytes"]
    report = {}

    # 1. offline sessions: a full window unacknowledged, then a full queue
    offline = {}
    for s in range(cfg["max_sessions"]):
        name = "o%d" % s
        c = connect(port, "offline-%03d" % s, clean=False)
        c.subscribe([(f, 1) for f in filters_for(name, n_subs, tsize)])
        got = Received()
        items = payloads(name, window + share(), psize)
        publish_collect(c, topic_for(name, tsize), items[:window], got)
        read_until(c, got, window, ack=False)
        c.close()  # no DISCONNECT, no ack: the window stays inflight in the session
        time.sleep(0.3)
        pub = connect(port, "filler")
        pub.publish_many((topic_for(name, tsize), p) for p in items[window:])
        pub.disconnect()
        offline[s] = items

    # 2. the retained set, as large as the profile allows
    n_ret = cfg["max_retained_messages"] if cfg["retain_available"] else 0
    if n_ret:
        pub = connect(port, "retainer")
        sent = pub.publish_many(
            ((padded("ret/%05d/state/" % i, tsize), p)
             for i, p in enumerate(payloads("r", n_ret, psize))),
            retain=True, window=16, timeout=300)
        pub.disconnect()
        report["retained"] = sent

    # 3. max_clients clients, max_subscriptions each (the last keeps one for ret/#)
    clients = []
    for i in range(n_clients):
        c = connect(port, "load-%03d" % i)
        fs = filters_for("c%d" % i, n_subs, tsize)
        if i == 0 and micropython and n_subs > 1:
            fs[1] = "$SYS/broker/heap/+"  # heap figures at the peak
        if i == n_clients - 1 and n_ret:
            fs = fs[:-1]
        for k in range(0, len(fs), 8):
            granted = c.subscribe([(f, 1) for f in fs[k:k + 8]])
            assert all(g < 0x80 for g in granted), granted
        clients.append(c)
    if n_ret:
        dash = clients[-1]
        assert dash.subscribe([("ret/#", 1)]) == [1]
        got = Received()
        read_until(dash, got, n_ret, ack=True, timeout=300)
        assert len({m.topic for m in got.msgs}) == n_ret
        assert all(m.retain for m in got.msgs)
        report["retained_delivered"] = len(got.msgs)

    # 4. QoS 1 at full inflight: each client publishes its own messages and
    #    receives them back (3.1.1 has no No Local), acknowledging none
    received = []
    for i, c in enumerate(clients):
        got = Received()
        items = payloads("c%d" % i, window + share(), psize)
        publish_collect(c, topic_for("c%d" % i, tsize), items, got)
        received.append((got, items))
    for (got, _), c in zip(received, clients):
        read_until(c, got, window, ack=False)
        assert c.poll_packet(0.3) is None or True  # nothing beyond the window is due
    if micropython:
        heap = received[0][0].heap_free
        deadline = time.monotonic() + 5
        seen = len(heap)
        while len(heap) == seen and time.monotonic() < deadline:
            p = clients[0].poll_packet(0.2)
            if p is not None and p[0] >> 4 == 3:
                m = received[0][0].take(*p)
                assert m is None, "message beyond the window at the peak: %s" % m.topic
        assert len(heap) > seen, "no $SYS heap figure at the peak"
        report["heap_free_at_peak"] = heap[-1]
        assert heap[-1] >= cfg["heap_reserve"], (
            "free heap %d below heap_reserve %d at the peak" % (heap[-1], cfg["heap_reserve"]))

    # 5. acknowledge: the queues flow, every message arrives exactly once
    for (got, items), c in zip(received, clients):
        for m in got.msgs:
            c.ack(m)
        read_until(c, got, len(items), ack=True)
        assert sorted(m.payload for m in got.msgs) == sorted(items)
    for c in clients:
        c.disconnect()
    time.sleep(0.3)
    for s, items in offline.items():
        c = Client(port, "offline-%03d" % s)
        assert c.connect(clean=False) == 0
        assert c.session_present
        got = Received()
        read_until(c, got, len(items), ack=True)
        assert sorted(set(m.payload for m in got.msgs)) == sorted(items)
        c.disconnect()

    # 6. no refusal for lack of memory
    time.sleep(1.2)  # one more $SYS round
    values = read_sys(port)
    bad = {k: v for k, v in values.items() if k.split("/")[-1] in BAD_CAUSES}
    assert not bad, "refusals: %s" % bad
    report["refusals"] = {k[9:]: v for k, v in values.items() if k.startswith("refusals/")}
    report["dropped"] = values.get("messages/dropped")
    assert values.get("messages/dropped") in (None, "0"), values
    if micropython:
        report["heap_free_after"] = int(values["heap/free"])
    return report


def run_full_load(board, interp, tmp_path):
    cfg = effective(board)
    emu = Emulator(board, interp, tmp_path, extra=["--no-monitor", "--sys-interval", "1"])
    try:
        report = full_load(emu.port, cfg, interp == "micropython")
        assert emu.alive(), emu.log_text()
    finally:
        code = emu.stop()
    log = emu.log_text()
    assert code == 0, "emulate exit %s\n%s" % (code, log)
    assert "MemoryError" not in log, log
    print(board, interp, report)
    return cfg, report, log


@pytest.mark.parametrize("interp", ["micropython", "cpython"])
def test_esp32_full_profile_load(interp, tmp_path):
    """The emulated esp32 (heap_bytes under MicroPython; CPython without a
    limit) runs its whole profile: max_clients x max_subscriptions, the
    retained set at max_retained_messages (storage_type from the profile),
    QoS 1 at full inflight and full queues, offline sessions; no MemoryError,
    no refusal for memory."""
    cfg, report, log = run_full_load("esp32", interp, tmp_path)
    assert report.get("retained_delivered") == cfg["max_retained_messages"]
    if cfg["storage_type"] != "ram":
        assert (tmp_path / "flash" / "retained.ebrs").stat().st_size > cfg["max_retained_messages"] * 29


@pytest.mark.parametrize("board", ["rp2040_picow", "rp2350_pico2w", "esp32s3"])
def test_other_boards_full_profile_load(board, tmp_path):
    """Pico W, Pico 2 W and ESP32-S3: the same full load with their own heaps."""
    run_full_load(board, "micropython", tmp_path)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("interp", ["micropython", "cpython"])
def test_esp32_frozen_eight_clients_5000_retained_and_a_bridge(interp, tmp_path):
    """Issue 12's esp32 load on firmware with the broker frozen in:
    boards/esp32_frozen.json (the esp32's per-client limits at 8 clients,
    all its sockets; 5,000 retained messages in disc_only; frozen: true; the
    6 MB filesystem of an 8 MB module, since 5,000 typical messages, their
    compaction copy and a bridge's queue do not fit the 2 MB of a 4 MB one)
    with one bridge with a 256 KB queue on flash passes config check with 8 KB
    spare, and the emulated esp32 (MicroPython, the board's heap scaled,
    the frozen code emulated as a ROMFS import with what it keeps beyond
    frozen added) runs that full load: no MemoryError, no refusal for
    memory, every message delivered."""
    prof = json.loads((REPO / "boards" / "esp32_frozen.json").read_text())
    assert prof["frozen"] is True and prof["max_clients"] == 8
    assert prof["max_retained_messages"] == 5000 and prof["storage_type"] == "disc_only"
    prof["bridges"] = [{
        "name": "cloud", "host": "127.0.0.1", "port": _free_port(),
        "queue_bytes": 262144,
        "topics": [{"pattern": "sensors/#", "direction": "out", "qos": 1}],
    }]
    path = tmp_path / "esp32_frozen_bridged.json"
    path.write_text(json.dumps(prof))
    r = subprocess.run([str(EDGEBROKER), "config", "check", "-v", str(path)], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "worst case" in x)
    worst = int(line.split("worst case")[1].split()[0])
    assert worst + 8192 <= prof["heap_bytes"], line
    assert "(frozen)" in r.stdout and "edgebridge" in r.stdout
    run = tmp_path / "run"
    run.mkdir()
    cfg, report, log = run_full_load(str(path), interp, run)
    assert report.get("retained_delivered") == 5000
    if interp == "micropython":
        assert "frozen: emulated as a ROMFS import" in log


# ------------------------------------------------------- the command itself
def test_emulate_prints_heap_status_and_stops_on_sigterm(tmp_path):
    """The monitor prints status lines with the $SYS heap figures; SIGTERM
    stops the broker cleanly (exit 0); the effective profile went to the
    data directory; storage disc_only uses the flash store there."""
    emu = Emulator("esp32", "micropython", tmp_path,
                   extra=["--sys-interval", "1", "--status-every", "0.5"])
    deadline = time.monotonic() + 15
    status = None
    while time.monotonic() < deadline:
        line = emu.proc.stdout.readline()
        if "heap free" in line:
            status = line
            break
    code = emu.stop(signal.SIGTERM)
    assert code == 0, emu.log_text()
    assert status is not None, "".join(emu.lines) + emu.log_text()
    assert status.startswith("emulate esp32: heap free ")
    # $SYS heap/free and heap/alloc are of the 64-bit port's heap (the
    # board's 110,000 scaled): the line names both, and its figures add up
    assert "(64-bit port; board 110000)" in status and "clients 1/" in status
    words = status.split()
    free, alloc, total = (int(words[words.index(w) + 1]) for w in ("free", "alloc", "of"))
    assert free + alloc <= total, status
    prof = json.loads((tmp_path / "flash" / "profile.json").read_text())
    assert prof["sys_interval"] == 1 and prof["heap_bytes"] == 110000
    assert (tmp_path / "flash" / "retained.ebrs").exists()


def test_emulate_heap_option_is_a_board_heap(tmp_path):
    """--heap is a board heap, like heap_bytes (32-bit bytes), scaled to
    the 64-bit port the same way: the esp32's own 110000 runs (as without
    --heap), and the note says what it became."""
    emu = Emulator("esp32", "micropython", tmp_path, extra=["--heap", "110000", "--no-monitor"])
    code = emu.stop()
    assert code == 0, emu.log_text()
    assert "the board's 110,000 bytes (32-bit, --heap) are 169,515 bytes" in emu.log_text()


def test_emulate_stops_on_sigint_cpython(tmp_path):
    emu = Emulator("esp32", "cpython", tmp_path, extra=["--status-every", "0.5"])
    time.sleep(1.0)
    assert emu.stop(signal.SIGINT) == 0, emu.log_text()
    assert any("heap n/a (cpython)" in line or "waiting for $SYS" in line for line in emu.lines)


def test_emulate_romfs_board_runs_code_in_place(tmp_path):
    """romfs: true: the .mpy files run from a ROMFS image outside the board's
    heap, so the same profile leaves more heap free than with romfs: false.
    frozen: true is emulated as a ROMFS import with what a frozen module does
    not keep (emulate.frozen_extra) added to the heap: more free again."""
    free = {}
    for kind in ("plain", "romfs", "frozen"):
        d = tmp_path / kind
        d.mkdir()
        sets = {"plain": [], "romfs": ["--set", "romfs=true"],
                "frozen": ["--set", "frozen=true"]}[kind]
        emu = Emulator("esp32", "micropython", d,
                       extra=["--sys-interval", "1", "--no-monitor", *sets])
        try:
            time.sleep(1.5)
            free[kind] = int(read_sys(emu.port)["heap/free"])
        finally:
            code = emu.stop()
            assert code == 0, "exit %s\n%s%s" % (code, "".join(emu.lines), emu.log_text())
        if kind == "frozen":
            assert "frozen: emulated as a ROMFS import" in emu.log_text(), emu.log_text()
    costs = json.loads((REPO / "boards" / "memory_costs.json").read_text())["costs"]
    saved = sum(costs["import_mpy"][m] - costs["import_romfs"][m]
                for m in ("edgebroker", "edgestore"))
    assert free["romfs"] - free["plain"] > saved * 0.8, (free, saved)
    chk = profiles.load_checked("esp32", ["frozen=true"])
    extra = emulate_cmd.frozen_extra(profiles.effective(chk.profile, profiles.load_schema()))
    assert extra > 0 and free["frozen"] - free["romfs"] > extra * 0.8, (free, extra)


def test_emulate_refuses_a_profile_with_schema_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"board": "bad", "max_clientz": 3}))
    r = subprocess.run([str(EDGEBROKER), "emulate", str(bad), "--port", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "max_clientz" in r.stderr and "unknown key" in r.stderr


# ------------------------------------------------------------ --app
class Output:
    """emulate's stdout after the listening line, read by a thread (stop()'s
    communicate(timeout=...) reads the pipe underneath the text buffer, so
    lines readline() had buffered would be lost)."""

    def __init__(self, emu):
        self.emu = emu
        self.lines = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.emu.proc.stdout:
            self.lines.append(line)

    def wait(self, text, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False

    def stop(self):
        """SIGINT, then the exit code once every line is read."""
        self.emu.proc.send_signal(signal.SIGINT)
        try:
            self.emu.proc.wait(15)
        finally:
            self.thread.join(10)
            code = self.emu.stop()
        return code, "".join(self.lines)

def wait_retained(port, topic, cid, timeout=10.0):
    """The retained message on topic, read by a fresh connection."""
    c = connect(port, cid)
    try:
        c.subscribe([(topic, 0)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = c.poll_packet(0.5)
            if p is not None and p[0] >> 4 == 3:
                return parse_publish(*p)
        return None
    finally:
        c.disconnect()


def test_emulate_app_runs_the_example_beside_the_broker(tmp_path):
    """--app examples/app.py under MicroPython with a board heap: the app is
    copied to the data directory as app.py and runs beside the asyncio
    server; its retained reading reaches a real client, and a command a
    real client publishes reaches it."""
    emu = Emulator("rp2040_picow", "micropython", tmp_path,
                   extra=["--no-monitor", "--app", str(REPO / "examples" / "app.py")])
    output = Output(emu)
    try:
        assert "(micropython, async server, with app.py)" in emu.lines[-1], emu.lines
        m = wait_retained(emu.port, "sensors/gw1/temperature", "emu-sub")
        assert m is not None and m.retain, emu.log_text()
        assert 15.0 <= float(m.payload) <= 30.0
        c = connect(emu.port, "emu-cmd")
        c.publish_many([("cmd/gw1/led", b"on")])
        c.disconnect()
        m = wait_retained(emu.port, "state/gw1/led", "emu-sub2")
        assert m is not None and m.payload == b"on", emu.log_text()
        assert output.wait("app: led on")
        assert emu.alive()
    finally:
        code, out = output.stop()
    assert code == 0, out + emu.log_text()
    assert "edgebroker: app: starting app.py main()" in out
    assert "app: led on" in out
    assert (tmp_path / "flash" / "app.py").read_bytes() == (REPO / "examples" / "app.py").read_bytes()


def test_emulate_app_crash_leaves_the_broker_serving(tmp_path):
    """An app whose main() raises: printed and counted, the broker serves on."""
    app = tmp_path / "crash.py"
    app.write_text("async def main(broker):\n    raise RuntimeError('boom')\n")
    emu = Emulator("host", "cpython", tmp_path, extra=["--no-monitor", "--app", str(app)])
    output = Output(emu)
    try:
        c = connect(emu.port, "emu-pub")
        c.publish_many([("after/crash", b"1")], retain=True)
        c.disconnect()
        m = wait_retained(emu.port, "after/crash", "emu-sub")
        assert m is not None and m.payload == b"1"
        assert output.wait("app errors 1")
        assert emu.alive()
    finally:
        code, out = output.stop()
    assert code == 0, out + emu.log_text()
    assert "app: app.py crashed (RuntimeError('boom')); the broker goes on, app errors 1" in out
    assert "RuntimeError: boom" in emu.log_text()  # the traceback (stderr under CPython)
