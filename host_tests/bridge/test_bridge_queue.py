"""The bridge's flash queue (lib/edgebridge.py Queue) in process, under
both interpreters (a script run by CPython and by the MicroPython unix
port), its config check, and the inspect report the host tools show."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO / "tools"))

import edgebridge  # noqa: E402
from conftest import micropython_exe  # noqa: E402

SCRIPT = r'''
import sys, os, json, struct
sys.path.insert(0, "lib")
import edgebridge as b
d = sys.argv[1]
out = {}
def log(level, text):
    out.setdefault("log", []).append(level + " " + text)
path = d + "/bridge-t.ebrq"
q = b.Queue(path, 1 << 20, True, 0.5, 4096, log)
out["created"] = q.created
for i in range(10):
    q.append(1, 0, 0, 0, b"t/%d" % (i % 3), b"", b"payload %d" % i)
q.commit()
q.advance(q.cursor, 0)
# acknowledge the first 4 messages: walk 4 records
pos = q.cursor
for i in range(4):
    rt, body, pos = q.read(pos)
q.advance(pos, 4)
q.commit()
out["count"] = q.count
size = os.stat(path)[6]
q.f.close()
# a power cut in the middle of the next record: half of it on flash
body = struct.pack(">IBBIIHI", 99, 1, 0, 0, 0, 3, 0) + b"t/x" + b"cut"  # a message body
rec = b.record(b.T_MSG, body)
f = open(path, "ab")
f.write(rec[:len(rec) // 2])
f.close()
q = b.Queue(path, 1 << 20, True, 0.5, 4096, log)
out["after_cut"] = [q.count, q.seq]
# the file as the next open reads it: every record whole, none torn
size = os.stat(path)[6]
f = open(path, "rb")
pos, n = 8, 0
while pos < size:
    rt, body, nxt = b.read_record(f, pos, size)
    if rt is None:
        break
    if rt == b.T_MSG and pos >= q.cursor:
        n += 1
    pos = nxt
f.close()
out["torn_after_open"] = size - pos
out["backlog"] = n
pos = q.cursor
first = None
while pos < q.end:
    rt, body, nxt = q.read(pos)
    if rt == b.T_MSG:
        first = bytes(b.decode_msg(body)[6])
        break
    pos = nxt
out["first"] = first.decode()
# a full queue: drop_oldest keeps the newest, counts the drops
q2 = b.Queue(d + "/bridge-full.ebrq", 4096, True, 0.5, 4096, log)
for i in range(100):
    q2.append(1, 0, 0, 0, b"f", b"", b"x" * 100)
q2.commit()
out["full"] = [q2.count, q2.drops, q2.nbytes <= 4096]
q3 = b.Queue(d + "/bridge-refuse.ebrq", 4096, False, 0.5, 4096, log)
ok = [q3.append(1, 0, 0, 0, b"f", b"", b"x" * 100) for i in range(100)]
out["refuse"] = [q3.count, q3.drops, ok.count(True)]
# compaction: everything acknowledged, the file shrinks, numbering goes on
moved = []
q3.moved = moved.append
q3.commit()
seq = q3.seq
q3.advance(q3.end, q3.count)
q3.commit()
q3.compact()
out["compacted"] = [os.stat(d + "/bridge-refuse.ebrq")[6], q3.seq == seq, len(moved)]
q3.close()
q4 = b.Queue(d + "/bridge-refuse.ebrq", 4096, False, 0.5, 4096, log)
out["reopened"] = [q4.count, q4.seq == seq]
# a file that is not a queue is moved aside
f = open(d + "/bridge-bad.ebrq", "wb")
f.write(b"NOPE\x01\x00\x00\x00junk")
f.close()
b.Queue(d + "/bridge-bad.ebrq", 4096, False, 0.5, 4096, log)
out["bad_moved"] = os.stat(d + "/bridge-bad.ebrq.bad")[6]
# compaction while messages are queued waits for `slack` dead bytes (an
# eighth of the budget: 8 KB here); a drained queue goes at min_bytes
q5 = b.Queue(d + "/bridge-slack.ebrq", 1 << 16, True, 0.5, 1024, log)
for i in range(60):
    q5.append(1, 0, 0, 0, b"t/s", b"", b"x" * 100)  # 132-byte records
q5.commit()
pos = q5.cursor
for i in range(50):
    rt, body, pos = q5.read(pos)
q5.advance(pos, 50)  # 6,600 dead bytes: over half the file, under the slack
q5.commit()
size_queued = os.stat(d + "/bridge-slack.ebrq")[6]
q5.advance(q5.end, q5.count)
q5.commit()
out["slack"] = [q5.slack, size_queued, os.stat(d + "/bridge-slack.ebrq")[6], q5.count]
print(json.dumps(out))
'''


@pytest.mark.parametrize("exe", ["cpython", "micropython"])
def test_queue_recovers_from_a_torn_tail_and_bounds_itself(tmp_path, exe):
    script = tmp_path / "q.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable if exe == "cpython" else micropython_exe(), str(script), str(tmp_path)]
    r = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["created"] is True
    assert out["count"] == 6
    # the cut record is ignored, the 6 unacknowledged ones stay, numbering goes on
    assert out["after_cut"] == [6, 10]
    assert out["torn_after_open"] == 0  # rewritten at open: no torn tail left behind
    assert out["backlog"] == 6
    assert out["first"] == "payload 4"
    assert any("torn tail" in line for line in out["log"])
    count, drops, bounded = out["full"]
    assert bounded and count + drops == 100 and drops > 0
    count, drops, accepted = out["refuse"]
    assert count == accepted and count + drops == 100 and drops > 0
    size, same_seq, moved = out["compacted"]
    assert size < 64 and same_seq and moved == 1
    assert out["reopened"] == [0, True]
    assert out["bad_moved"] > 0
    slack, size_queued, size_drained, count = out["slack"]
    assert slack == 8192 and size_queued > 60 * 132  # not rewritten for 6,600 dead bytes
    assert size_drained < 64 and count == 0  # drained: emptied at once
    # issue 10 item 8: the real console script reads the queue this
    # interpreter wrote (cursor, backlog, dead bytes) and checks it
    cli = [str(Path(sys.executable).parent / "edgebroker"), "store"]
    queue = str(tmp_path / "bridge-t.ebrq")
    r = subprocess.run(cli + ["inspect", queue, "--json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["kind"] == "ok" and rep["backlog"] == 6 and rep["next_seq"] == 10
    assert rep["first"][0]["topic"] == "t/1" and rep["torn_bytes"] == 0
    r = subprocess.run(cli + ["inspect", queue], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "backlog  6 message(s)" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cli + ["check", queue], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok (bridge queue: 6 message(s) in the backlog" in r.stdout
    with open(queue, "ab") as f:
        f.write(b"M\x00\x00")  # a power cut one record later: a torn tail
    r = subprocess.run(cli + ["check", queue], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "damaged: torn tail of 3 bytes" in r.stdout, r.stdout


# Files across firmware versions (the upgrade audit), both interpreters:
# a file made before the "K" rule (header flag 0: its backlog, never
# acknowledged, has no "K") is not new, so its retained sync is not queued
# again behind that backlog (in a full queue the sync pushed the oldest
# acknowledged messages out); a flagged file without "K" still is (its
# first commit was torn); a torn unflagged file is rewritten flagged, with
# a "K", so it stays not new; a newer version's file is left byte for byte
# (ValueError: its bridge does not run); new_session() voids the earlier "R"
# records in place, so that a reader predating the empty "R" (a firmware
# rolled back) does not take a message as past PUBREC and send only PUBREL.
VERSIONS = r'''
import sys, os, json, struct
sys.path.insert(0, "lib")
import edgebridge as b
d = sys.argv[1]
out = {}
def log(level, text):
    out.setdefault("log", []).append(level + " " + text)
def raw(path):
    f = open(path, "rb")
    data = f.read()
    f.close()
    return data
def write(path, data):
    f = open(path, "wb")
    f.write(data)
    f.close()
def old_file(path, n, torn=False):
    # what the firmware before the rule wrote: flag 0, messages, no "K"
    data = b"EBRQ\x01\x00\x00\x00"
    for i in range(n):
        body = struct.pack(">IBBIIHI", i, 1, 0, 0, 0, 1, 0) + b"t" + b"p%d" % i
        data += b.record(b.T_MSG, body)
    if torn:
        data += b"M\x00\x00"
    write(path, data)
old_file(d + "/old.ebrq", 5)
q = b.Queue(d + "/old.ebrq", 1 << 16, True, 0.5, 4096, log)
out["old"] = [q.created, q.count]
q.close()
out["old_header"] = list(raw(d + "/old.ebrq")[:8])
old_file(d + "/torn.ebrq", 3, True)
q = b.Queue(d + "/torn.ebrq", 1 << 16, True, 0.5, 4096, log)
out["torn"] = [q.created, q.count]
q.close()
q = b.Queue(d + "/torn.ebrq", 1 << 16, True, 0.5, 4096, log)
out["torn_again"] = [q.created, q.count, list(raw(d + "/torn.ebrq")[:8])]
q.close()
data = bytearray(raw(d + "/old.ebrq"))
data[5] = 1  # the same records in a file made under the rule: a torn first commit
write(d + "/cut.ebrq", data)
q = b.Queue(d + "/cut.ebrq", 1 << 16, True, 0.5, 4096, log)
out["cut"] = [q.created, q.count]
q.close()
q = b.Queue(d + "/new.ebrq", 1 << 16, True, 0.5, 4096, log)
out["new"] = [q.created, list(raw(d + "/new.ebrq")[:8])]
q.close()
future = b"EBRQ\x02\x00\x00\x00" + b"whatever version 2 keeps"
write(d + "/future.ebrq", future)
try:
    b.Queue(d + "/future.ebrq", 1 << 16, True, 0.5, 4096, log)
    out["future"] = "opened"
except ValueError as e:
    out["future"] = str(e)
out["future_kept"] = raw(d + "/future.ebrq") == future
out["future_bad"] = ".ebrq.bad" in " ".join(os.listdir(d))
# "R" records voided by new_session
q = b.Queue(d + "/rel.ebrq", 1 << 16, True, 0.5, 4096, log)
for i in range(4):
    q.append(2, 0, 0, 0, b"t/%d" % i, b"", b"x")
q.commit()
first = q.seq
q.released(first - 4)
q.released(first - 2)
q.commit()
pos = q.cursor
rt, body, pos = q.read(pos)  # the read-ahead holds the "R" bytes now
q.new_session()
def scan(path):
    data = raw(path)
    size = len(data)
    f = open(path, "rb")
    pos, rel4, void, empty = 8, 0, 0, 0
    while pos < size:
        rt, body, nxt = b.read_record(f, pos, size)
        if rt is None or rt == -1:
            return ["bad", pos]
        if rt == b.T_REL and len(body) == 4:
            rel4 += 1
        elif rt == b.T_REL:
            empty += 1
        elif rt == 0x72:
            void += 1
        pos = nxt
    f.close()
    return [rel4, void, empty]
out["rel_scan"] = scan(d + "/rel.ebrq")
out["rel_live"] = [q.count, len(q.rel)]
n = 0
pos = q.cursor
while pos < q.end:
    rt, body, pos = q.read(pos)
    n += rt == b.T_MSG
out["rel_read"] = n
q.close()
q = b.Queue(d + "/rel.ebrq", 1 << 16, True, 0.5, 4096, log)
out["rel_reopen"] = [q.count, len(q.rel), q.created]
q.close()
print(json.dumps(out))
'''


@pytest.mark.parametrize("exe", ["cpython", "micropython"])
def test_queue_files_across_firmware_versions(tmp_path, exe):
    script = tmp_path / "v.py"
    script.write_text(VERSIONS)
    cmd = [sys.executable if exe == "cpython" else micropython_exe(), str(script), str(tmp_path)]
    r = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["old"] == [False, 5]  # not new: no second sync behind its backlog
    assert out["old_header"] == [69, 66, 82, 81, 1, 0, 0, 0]  # untouched until compacted
    assert out["torn"] == [False, 3]
    assert out["torn_again"] == [False, 3, [69, 66, 82, 81, 1, 1, 0, 0]]
    assert out["cut"] == [True, 5]  # flagged, no "K": the sync is done again
    assert out["new"] == [True, [69, 66, 82, 81, 1, 1, 0, 0]]
    assert "format version 2 is newer" in out["future"] and "does not run" in out["future"]
    assert out["future_kept"] and not out["future_bad"]
    assert out["rel_scan"] == [0, 2, 1]  # no live 4-byte "R" left for an old reader
    assert out["rel_live"] == [4, 0] and out["rel_read"] == 4
    assert out["rel_reopen"][:2] == [4, 0]
    # store inspect reads them as the broker does
    cli = [str(Path(sys.executable).parent / "edgebroker"), "store", "inspect", "--json"]
    reps = {}
    for name in ("old", "cut", "rel"):
        r = subprocess.run(cli + [str(tmp_path / (name + ".ebrq"))], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        reps[name] = json.loads(r.stdout)
    assert reps["old"]["sync_again"] is False and reps["cut"]["sync_again"] is True
    assert reps["rel"]["by_type"]["r"] == 2 and reps["rel"]["released"] == 0
    r = subprocess.run(cli[:-1] + [str(tmp_path / "cut.ebrq")], capture_output=True, text=True,
                       timeout=60)
    assert "queues its retained sync again" in r.stdout, r.stdout


BR = {"name": "c", "host": "h", "topics": [{"pattern": "a/#"}]}


@pytest.mark.parametrize("change,key", [
    ({"port": 0}, "bridges[0].port: 0 (allowed 1..65535)"),
    ({"topics": [{"pattern": "a/#", "qos": 3}]}, "bridges[0].topics[0].qos: 3"),
    ({"topics": [{"pattern": "a/#", "direction": "up"}]}, "bridges[0].topics[0].direction: 'up'"),
    ({"topics": [{"pattern": "a/#/b"}]}, "bridges[0].topics[0].pattern"),
    ({"when_full": "block"}, "bridges[0].when_full: 'block'"),
    ({"tls": {"cert": "c.pem"}}, "bridges[0].tls.ca: required"),
    ({"colour": 1}, "bridges[0].colour: unknown key"),
    ({"retry_min": 10, "retry_max": 5}, "bridges[0].retry_min: 10"),
])
def test_bad_bridge_values_are_refused_naming_the_key(change, key):
    item = dict(BR)
    item.update(change)
    with pytest.raises(ValueError) as e:
        edgebridge.check([item])
    assert key in str(e.value)


def test_bridge_defaults_and_client_id_from_the_board():
    c = edgebridge.check([BR], "gw7")[0]
    assert c["client_id"] == "gw7" and c["port"] == 1883 and c["protocol"] == 5
    assert c["topics"][0] == {"pattern": "a/#", "direction": "out", "qos": 1,
                              "local_prefix": "", "remote_prefix": "", "mode": "queue"}
    with pytest.raises(ValueError, match="name"):
        edgebridge.check([BR, BR])


def test_inspect_report_and_its_text(tmp_path):
    from edgebroker_tools import bridge_inspect as bi

    path = tmp_path / "bridge-x.ebrq"
    q = edgebridge.Queue(str(path), 1 << 20, True, 0.5, 4096, lambda *a: None)
    for i in range(5):
        q.append(2 if i == 4 else 1, edgebridge.F_RETAIN if i == 0 else 0, 0, 1700000000,
                 b"site/t%d" % i, b"", b"p" * i)
    q.commit()
    pos = q.cursor
    rt, body, pos = q.read(pos)
    q.advance(pos, 1)
    q.released(4)
    q.commit()
    q.close()
    assert bi.is_bridge_queue(path)
    rep = bi.read_bridge_report(path)
    assert rep["kind"] == "ok" and rep["backlog"] == 4 and rep["next_seq"] == 5
    assert rep["dead_bytes"] > 0 and rep["released"] == 1
    assert [e["topic"] for e in rep["first"]] == ["site/t1", "site/t2", "site/t3", "site/t4"]
    assert rep["first"][-1]["released"] is True and rep["first"][-1]["qos"] == 2
    text = bi.format_bridge_report(rep)
    assert "backlog  4 message(s)" in text and "status   ok" in text and "site/t4" in text
    assert not bi.bridge_problems(rep)
    with path.open("ab") as f:
        f.write(b"M\x00\x00")  # a torn record
    rep = bi.read_bridge_report(path)
    assert bi.bridge_problems(rep) == ["torn tail of 3 bytes at offset %d" % rep["torn_offset"]]
    assert "DAMAGED" in bi.format_bridge_report(rep)


def test_a_durable_commit_fsyncs_what_the_cursor_commit_wrote(tmp_path, monkeypatch):
    """The link writes its cursor record with commit(False) (no fsync, at
    most every 0.2 s), and that writes the whole buffer: messages appended
    in the same turn too. The engine's durable commit that follows has
    nothing left to write, and must fsync anyway: the acknowledgements of
    those messages wait for it. CPython (the MicroPython unix port has no
    fsync at all; littlefs on a board syncs on flush)."""
    calls = []
    real = edgebridge._fsync
    monkeypatch.setattr(edgebridge, "_fsync", lambda fd: (calls.append(fd), real(fd)))
    q = edgebridge.Queue(str(tmp_path / "bridge-t.ebrq"), 1 << 20, True, 0.5, 4096,
                         lambda level, text: None)
    del calls[:]  # the new file's header
    q.append(1, 0, 0, 0, b"t/1", b"", b"p1")
    q.commit(False)
    assert calls == [] and q.unsynced and q.fend > 8
    q.commit(True)
    assert len(calls) == 1 and not q.unsynced
    q.commit(True)
    assert len(calls) == 1  # nothing written since: no second fsync
    q.append(1, 0, 0, 0, b"t/2", b"", b"p2")
    q.commit(False)
    q.advance(q.end, q.count)
    q.compact()  # the synced copy holds every live record
    assert not q.unsynced
    q.close()


def test_local_publish_returns_once_its_bridge_copy_is_fsynced(tmp_path, monkeypatch):
    """Broker.publish() (code beside the broker) returns with the durability
    a network PUBLISH gets at its PUBACK. Under CPython the bridge queue's
    fsync normally runs in a thread (the pipelined commit); a local publish
    waits for it: when publish() returns, an fdatasync has covered the
    whole queue file. CPython only (the thread and fsync are CPython's)."""
    import os

    import edgebroker as eb
    from mqtt_helpers import free_port

    synced = []
    real = os.fdatasync

    def traced(fd):
        size = os.fstat(fd).st_size
        real(fd)
        synced.append(size)

    monkeypatch.setattr(os, "fdatasync", traced)
    monkeypatch.setattr(edgebridge, "_fsync", traced)

    prof = {"storage_type": "disc_only", "log_level": "error", "bridges": [{
        "name": "cloud", "host": "127.0.0.1", "port": free_port(),  # nobody there
        "topics": [{"pattern": "sensors/#", "qos": 1}]}]}
    b = eb.start(prof, "127.0.0.1", free_port(), str(tmp_path))
    try:
        assert b.engine.syncer is not None
        q = tmp_path / "bridge-cloud.ebrq"
        for i in range(20):
            b.publish("sensors/x", b"v%d" % i, 1)
            assert synced and max(synced) >= q.stat().st_size, i
    finally:
        b.stop()
        b.shutdown()


class _UpSock:
    """The upstream end of a bridge link in process: keeps what is sent,
    has nothing to read (the test hands acknowledgements in itself)."""

    def __init__(self):
        self.sent = bytearray()

    def send(self, data):
        self.sent += data
        return len(data)

    def recv_into(self, mv):
        raise BlockingIOError


def _publishes(data):
    # (dup, qos, packet id, topic, payload) of each MQTT 5 PUBLISH in data
    out = []
    i = 0
    while i < len(data):
        first, n = data[i], data[i + 1]  # short packets only (< 128 B)
        body = bytes(data[i + 2 : i + 2 + n])
        tl = body[0] << 8 | body[1]
        topic = body[2 : 2 + tl]
        pid = body[2 + tl] << 8 | body[3 + tl]
        plen = body[4 + tl]
        out.append((first >> 3 & 1, first >> 1 & 3, pid, topic, body[5 + tl + plen :]))
        i += 2 + n
    return out


def test_packets_made_ahead_go_out_as_the_refill_would_send_them(tmp_path):
    """Bridge._prep (CPython) encodes the next records while the window is
    full; the acknowledgements that open it take those packets. What leaves
    is what the refill would send without them: every message once, in file
    order (per-topic order, issue's replay rule), packet id from its message
    number, no DUP on a first send (MQTT-3.3.1-1); and a compaction that
    moves the offsets discards what was made, so nothing stale is sent."""
    import edgebroker as eb
    from mqtt_helpers import free_port

    assert eb._PREP_BYTES > 0  # CPython; a board makes nothing ahead
    prof = {"storage_type": "disc_only", "log_level": "error", "bridges": [{
        "name": "cloud", "host": "127.0.0.1", "port": free_port(),  # nobody there
        "topics": [{"pattern": "sensors/#", "qos": 1, "remote_prefix": "r/"}]}]}
    b = eb.start(prof, "127.0.0.1", free_port(), str(tmp_path))
    try:
        br = b.engine.sinks[0]
        for i in range(30):
            b.publish("sensors/%d" % (i % 3), b"v%d" % i, 1)
        up = _UpSock()
        br.sock, br.up, br.window, br.v5 = up, True, 5, True
        br.rmv = memoryview(bytearray(4096))

        def ack_all():
            for e in list(br.inflight):
                br.rbuf += b"\x40\x02" + bytes((e[0] >> 8, e[0] & 0xFF))
            br._took(0, b.clock, True)

        br._took(0, b.clock, True)  # the first window leaves, the next is made
        assert len(br.inflight) == 5 and len(br.pre) == 5
        made = [bytes(x[5]) for x in br.pre]
        ack_all()  # taken from what was made
        assert bytes(up.sent).endswith(b"".join(made))
        ack_all()
        # a compaction moves every offset: what was made is dropped, and the
        # refill after it encodes from the file again
        assert br.pre
        br.q.compact()
        assert br.pre == [] and br.preb == 0
        ack_all()
        while br.inflight:
            ack_all()
        got = _publishes(up.sent)
        assert [(g[3], g[4]) for g in got] == [
            (b"r/sensors/%d" % (i % 3), b"v%d" % i) for i in range(30)
        ]
        assert all(g[0] == 0 and g[1] == 1 for g in got)  # no DUP, QoS 1
        assert len({g[2] for g in got}) == 30
        assert br.q.count == 0 and br.pre == []
    finally:
        b.stop()
        b.shutdown()


def test_packets_made_ahead_are_dropped_when_drop_oldest_passes_them(tmp_path):
    """when_full drop_oldest moves the cursor past records that were made
    ahead: the refill notices its position moved, drops what was made and
    sends from the new cursor (the dropped messages never leave)."""
    import edgebroker as eb
    from mqtt_helpers import free_port

    prof = {"storage_type": "disc_only", "log_level": "error", "bridges": [{
        "name": "cloud", "host": "127.0.0.1", "port": free_port(),
        "topics": [{"pattern": "sensors/#", "qos": 1}]}]}
    b = eb.start(prof, "127.0.0.1", free_port(), str(tmp_path))
    try:
        br = b.engine.sinks[0]
        for i in range(20):
            b.publish("sensors/a", b"v%d" % i, 1)
        up = _UpSock()
        br.sock, br.up, br.window, br.v5 = up, True, 4, True
        br.rmv = memoryview(bytearray(4096))
        br._took(0, b.clock, True)
        assert len(br.pre) == 4
        for _ in range(10):  # the 4 in flight and 6 behind them, 4 of which were made
            br.q._drop_first()
        for e in list(br.inflight):
            br.rbuf += b"\x40\x02" + bytes((e[0] >> 8, e[0] & 0xFF))
        br._took(0, b.clock, True)
        got = [g[4] for g in _publishes(up.sent)]
        assert got == [b"v%d" % i for i in (0, 1, 2, 3, 10, 11, 12, 13)]
    finally:
        b.stop()
        b.shutdown()
