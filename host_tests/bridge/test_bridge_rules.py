"""The bridge's topic mapping, retained state and upstream limits at their
edges (issue 10), against a real upstream (Debian's mosquitto) where one
behaves that way and a scripted one where none does: both interpreters,
the asyncio server (test_bridge.py's fixtures).

What each test holds:
- mosquitto's `topic` mapping for the parent of a "#" rule ("l/#" matches
  "l", MQTT-4.7.1.2): the prefix is swapped only where the topic starts
  with it, so "l" goes up as "r/l", never as "r/" (another topic);
- a prefix with a wildcard is refused at start and by `config check`
  (it would make every PUBLISH one the upstream must refuse, MQTT-3.3.2-2),
  and the two checks agree on patterns;
- the retained state reaches the upstream when a bridge is added to a
  gateway that already holds retained messages, when a queue file's first
  commit (the sync's) was torn by a power cut, and when the upstream comes
  back without our session (restarted without persistence);
- in `latest` mode a retained change or delete is not skipped for a later
  plain message of its topic;
- the upstream's Maximum QoS and Retain Available (MQTT-3.2.2-11/14) are
  kept to: QoS 2 goes at 1, retained goes as not retained, nothing flaps;
- on a 3.1.1 link an inbound PUBLISH over max_packet_size is acknowledged
  and dropped, the link stays up, and it is counted;
- a `both` rule on 5.0: the upstream's copy of our own retained message is
  not sent back on the resumed subscription (Retain Handling 1);
- an inbound QoS 2 PUBLISH resent (DUP) after a reconnect that resumes the
  session is published locally once (4.3.3);
- a resend to a resumed upstream session carries the Message Expiry
  Interval that is left (MQTT-3.3.2-6), also when downgraded to the
  upstream's new Maximum QoS.
"""

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mqtt_helpers import free_port, paho_client, wait_for
from test_bridge import (  # noqa: F401 (fixtures)
    ASYNC,
    OUT,
    REPO,
    arrived,
    bridge,
    bridge_state,
    collector,
    gateway,
    proxy,
    publish_many,
    retained_upstream,
    upstream,
    wait_connected,
)

from edgebroker_tools.mqttclient import split_packets


retained_local = retained_upstream  # what a new subscriber gets retained, from any broker


@ASYNC
def test_the_parent_of_a_hash_rule_keeps_its_name_like_mosquitto(broker_factory, upstream,
                                                                  collector):
    up = upstream()
    col = collector(up.port)
    rules = [{"pattern": "#", "direction": "out", "qos": 1, "local_prefix": "l/",
              "remote_prefix": "r/"},
             {"pattern": "#", "direction": "in", "qos": 1, "local_prefix": "dl/",
              "remote_prefix": "dr/"}]
    gw = gateway(broker_factory, [bridge(up.port, rules, status=False)])
    wait_connected(gw)
    local = paho_client(gw.port, "local-parent")
    local.subscribe_wait("dl/#", qos=1)
    pub = paho_client(gw.port, "pub-parent")
    pub.publish_wait("l/", b"slash", qos=1, retain=True)
    pub.publish_wait("l", b"parent", qos=1, retain=True)
    pub.publish_wait("l/x", b"child", qos=1)
    pub.close()
    want = {("r/", b"slash"), ("r/l", b"parent"), ("r/x", b"child")}
    assert wait_for(lambda: want <= arrived(col), 10), col.get()
    assert retained_upstream(up.port, "r/#") >= {("r/", b"slash"), ("r/l", b"parent")}
    cloud = paho_client(up.port, "cloud-parent")
    cloud.publish_wait("dr", b"parent-in", qos=1)
    assert local.wait_messages(1, timeout=10)
    assert [(m.topic, m.payload) for m in local.get_messages()] == [("dl/dr", b"parent-in")]
    local.close()
    cloud.close()


def _profile_with(tmp_path, rules):
    host = json.loads((REPO / "boards" / "host.json").read_text())
    host.update({"storage_type": "disc_only", "fs_reserve_bytes": 131072,
                 "bridges": [bridge(free_port(), rules)]})
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(host))
    return prof


def _config_check(prof):
    tool = Path(sys.executable).parent / "edgebroker"
    return subprocess.run([str(tool), "config", "check", str(prof)], cwd=str(REPO),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("key,value", [("local_prefix", "a/+/"), ("remote_prefix", "r/+/"),
                                       ("remote_prefix", "r/#/")])
@pytest.mark.parametrize("which", ["cpython", "micropython"])
def test_a_wildcard_in_a_prefix_is_refused_naming_the_key(tmp_path, which, key, value):
    from conftest import micropython_exe

    rule = {"pattern": "s/#", "direction": "both", "qos": 1, key: value}
    prof = _profile_with(tmp_path, [rule])
    exe = [sys.executable] if which == "cpython" else [micropython_exe()]
    r = subprocess.run(exe + ["lib/edgebroker.py", "--board", str(prof), "--port", str(free_port()),
                              "--data-dir", str(tmp_path / "d"), "--server", "async"],
                       cwd=str(REPO), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    line = "bridges[0].topics[0].%s: %r (a topic prefix: no +, # or NUL)" % (key, value)
    assert line in r.stderr
    if which == "cpython":
        r = _config_check(prof)
        assert r.returncode != 0 and line in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("pattern,ok", [("a/#/b", False), ("a/b#", False), ("a+/b", False),
                                        ("", True)])
def test_config_check_and_the_broker_agree_on_patterns(tmp_path, pattern, ok):
    # "" with prefixes is mosquitto's empty pattern: exactly the prefixes' topic
    rule = {"pattern": pattern, "direction": "out", "qos": 1, "local_prefix": "loc/top",
            "remote_prefix": "rem/top"}
    r = _config_check(_profile_with(tmp_path, [rule]))
    if ok:
        assert "bridges[0]" not in r.stdout + r.stderr, r.stdout + r.stderr
    else:
        assert r.returncode != 0
        assert "bridges[0].topics[0].pattern: %r is not a topic filter" % pattern in (
            r.stdout + r.stderr), \
            r.stdout + r.stderr


@ASYNC
def test_a_bridge_added_later_sends_the_retained_state_it_finds(broker_factory, upstream,
                                                                tmp_path):
    up = upstream()
    gw = gateway(broker_factory, [])
    pub = paho_client(gw.port, "pre")
    pub.publish_wait("sensors/pre", b"before", qos=1, retain=True)
    pub.close()
    gw.stop()
    # added to a gateway that holds retained messages: it used to stop at
    # start (the sync ran before the bridge was made) and never sync again
    gw = gateway(broker_factory, [bridge(up.port, OUT)], port=gw.port)
    wait_connected(gw)
    want = {("site1/gw1/sensors/pre", b"before")}
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 10)
    gw.stop()
    # a queue file that never got past its header (a power cut before the
    # first commit) is new: the retained state is sent again (the upstream
    # keeps our session: only the queue file says so)
    cloud = paho_client(up.port, "clear")
    cloud.publish_wait("site1/gw1/sensors/pre", b"", qos=1, retain=True)
    cloud.close()
    assert retained_upstream(up.port, "site1/gw1/sensors/#") == set()
    qf = tmp_path / "data" / "bridge-cloud.ebrq"
    head = qf.read_bytes()[:8]  # magic, version: the file's own header
    assert head[:4] == b"EBRQ", head
    qf.write_bytes(head)
    gw = gateway(broker_factory, [bridge(up.port, OUT)], port=gw.port)
    wait_connected(gw)
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 10)


@ASYNC
@pytest.mark.parametrize("cut", ["in the first record", "in the second record"])
def test_a_retained_sync_torn_by_a_power_cut_is_sent_again(broker_factory, upstream, tmp_path,
                                                           cut):
    """The retained sync of a new queue file is written at the first commit;
    a power cut tearing that write leaves the header and a torn tail, or
    the sync's first records and a torn one. Nothing of it was acknowledged,
    so it is done again at the next start, also when the upstream keeps our
    session (before: only a file that never got past its header was new,
    and the upstream never got the rest)."""
    up = upstream()
    gw = gateway(broker_factory, [])
    pub = paho_client(gw.port, "pre")
    for t in ("sensors/pre1", "sensors/pre2"):
        pub.publish_wait(t, b"before", qos=1, retain=True)
    pub.close()
    gw.stop()
    # the upstream gets our session (and the retained state, cleared after)
    gw = gateway(broker_factory, [bridge(up.port, OUT)], port=gw.port)
    wait_connected(gw)
    want = {("site1/gw1/sensors/pre1", b"before"), ("site1/gw1/sensors/pre2", b"before")}
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 10)
    gw.stop()
    cloud = paho_client(up.port, "clear")
    for t, _ in want:
        cloud.publish_wait(t, b"", qos=1, retain=True)
    cloud.close()
    assert retained_upstream(up.port, "site1/gw1/sensors/#") == set()
    # a new queue file's first commit (the upstream away: nothing sent),
    # then torn as a power cut during that write leaves it
    qf = tmp_path / "data" / "bridge-cloud.ebrq"
    qf.unlink()
    gw = gateway(broker_factory, [bridge(free_port(), OUT)], port=gw.port)
    assert wait_for(lambda: qf.exists() and qf.stat().st_size > 8 + 2 * 9, 10)
    gw.stop()
    data = qf.read_bytes()
    assert data[:4] == b"EBRQ" and data[8:9] == b"M", data[:16]
    first = 8 + 9 + int.from_bytes(data[9:13], "big")  # type, length, body, crc
    assert data[first:first + 1] == b"M", data[first:first + 1]
    qf.write_bytes(data[:8 + 7] if cut == "in the first record" else data[:first + 7])
    gw = gateway(broker_factory, [bridge(up.port, OUT)], port=gw.port)
    wait_connected(gw)
    assert "session present" in gw.log_text(), gw.log_text()[-2000:]
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 10), \
        gw.log_text()[-2000:]


@ASYNC
def test_latest_mode_never_skips_a_retained_change_or_delete(broker_factory, upstream, collector,
                                                             proxy):
    from test_bridge import come_back, go_down

    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    rules = [{"pattern": "s/#", "qos": 1, "remote_prefix": "g/", "mode": "latest"}]
    gw = gateway(broker_factory, [bridge(px.port, rules, latest_topics=2, status=False)])
    wait_connected(gw)
    pub = paho_client(gw.port, "lpub")
    pub.publish_wait("s/a", b"old", qos=1, retain=True)
    pub.publish_wait("s/b", b"old", qos=1, retain=True)
    assert wait_for(lambda: retained_upstream(up.port, "g/#") == {("g/s/a", b"old"),
                                                                   ("g/s/b", b"old")}, 10)
    go_down(gw, up, px)
    pub.publish_wait("s/a", b"new", qos=1, retain=True)
    pub.publish_wait("s/a", b"live", qos=1)
    pub.publish_wait("s/b", b"", qos=1, retain=True)  # deleted while offline
    pub.publish_wait("s/b", b"live", qos=1)
    pub.publish_wait("s/c", b"3", qos=1)  # a third topic: beyond latest_topics 2
    pub.close()
    assert bridge_state(gw.port)["latest_untracked"] >= 1
    come_back(gw, up, px, col)
    assert wait_for(lambda: ("g/s/c", b"3") in arrived(col), 10), col.get()
    assert wait_for(lambda: retained_upstream(up.port, "g/#") == {("g/s/a", b"new")}, 10), \
        retained_upstream(up.port, "g/#")


@ASYNC
def test_the_upstream_maximum_qos_and_retain_available_are_kept(broker_factory, upstream,
                                                                collector):
    up = upstream("max_qos 1\nretain_available false\n")
    col = collector(up.port)
    rules = [dict(OUT[0], qos=2)]
    gw = gateway(broker_factory, [bridge(up.port, rules)])
    # the will asked for retain: refused once (0x9A), then without it
    wait_connected(gw)
    publish_many(gw.port, [("sensors/a", b"%d" % i) for i in range(20)], qos=2)
    pub = paho_client(gw.port, "rpub2")
    pub.publish_wait("sensors/r", b"kept", qos=2, retain=True)
    pub.close()
    want = {("site1/gw1/sensors/a", b"%d" % i) for i in range(20)}
    want.add(("site1/gw1/sensors/r", b"kept"))
    assert wait_for(lambda: want <= arrived(col), 15), sorted(arrived(col))[:5]
    # the last PUBACK may come after the collector's copy
    assert wait_for(lambda: bridge_state(gw.port)["backlog"] == 0, 10)
    assert bridge_state(gw.port)["connected"]
    # no link went down over a refused PUBLISH (0x9A, 0x9B)
    assert gw.log_text().count("bridge cloud: connected") == 1, gw.log_text()[-2000:]


@ASYNC
def test_a_311_link_drops_an_inbound_publish_over_max_packet_size_and_stays_up(
    broker_factory, upstream
):
    up = upstream()
    rules = [{"pattern": "cmd/#", "direction": "in", "qos": 1, "remote_prefix": "site1/gw1/"}]
    gw = gateway(broker_factory, [bridge(up.port, rules, protocol=4)], max_packet_size=1024)
    wait_connected(gw)
    local = paho_client(gw.port, "local-big4")
    local.subscribe_wait("cmd/#", qos=1)
    cloud = paho_client(up.port, "cloud-big4")
    cloud.publish_wait("site1/gw1/cmd/big", b"x" * 4000, qos=1)
    cloud.publish_wait("site1/gw1/cmd/big2", b"y" * 70000, qos=2)
    cloud.publish_wait("site1/gw1/cmd/small", b"ok", qos=1)
    assert local.wait_messages(1, timeout=10)
    time.sleep(1.0)
    assert [(m.topic, m.payload) for m in local.get_messages()] == [("cmd/small", b"ok")]
    assert "link down" not in gw.log_text(), gw.log_text()[-2000:]
    assert bridge_state(gw.port)["inbound_dropped"] == 2
    local.close()
    cloud.close()


@ASYNC
def test_a_both_rule_does_not_bring_back_its_own_older_retained_message(broker_factory, upstream,
                                                                        proxy, collector):
    from test_bridge import come_back, go_down

    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    rules = [{"pattern": "s/#", "direction": "both", "qos": 1}]
    gw = gateway(broker_factory, [bridge(px.port, rules, status=False)])
    wait_connected(gw)
    pub = paho_client(gw.port, "bpub")
    pub.publish_wait("s/a", b"old", qos=1, retain=True)
    assert wait_for(lambda: retained_upstream(up.port, "s/#") == {("s/a", b"old")}, 10)
    go_down(gw, up, px)
    pub.publish_wait("s/a", b"new", qos=1, retain=True)
    pub.close()
    come_back(gw, up, px, col)
    assert wait_for(lambda: retained_upstream(up.port, "s/#") == {("s/a", b"new")}, 10)
    time.sleep(1.0)
    assert retained_local(gw.port, "s/#") == {("s/a", b"new")}


@ASYNC
def test_an_upstream_that_lost_our_session_gets_the_retained_state_again(broker_factory,
                                                                         upstream):
    up = upstream("persistence false\n")
    gw = gateway(broker_factory, [bridge(up.port, OUT)])
    wait_connected(gw)
    pub = paho_client(gw.port, "spub")
    pub.publish_wait("sensors/a", b"1", qos=1, retain=True)
    pub.close()
    want = {("site1/gw1/sensors/a", b"1")}
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 10)
    up.stop()
    up.start()  # without persistence: no session of ours, no retained messages
    wait_connected(gw, 2, timeout=20)
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 10)


class ScriptedUpstream:
    """A loopback MQTT 5 server that plays one script per connection: the
    QoS 2 resend case no real broker can be made to produce on demand."""

    def __init__(self):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(2)
        self.port = self.srv.getsockname()[1]
        self.errors = []
        self.done = threading.Event()
        self.go = threading.Event()  # the local subscriber is in place
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _packets(self, s, buf, want, timeout=10.0, whole=False):
        # reads until a packet of type `want` (or one of them) came; answers
        # the rest; its body (whole: its first byte and body)
        wanted = want if isinstance(want, tuple) else (want,)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            raw = bytes(buf)
            pkts, used = split_packets(raw)
            del buf[:used]
            for first, a, b in pkts:
                body = raw[a:b]
                t = first >> 4
                if t in wanted:
                    return (first, body) if whole else body
                if t == 3 and first & 6:  # the status PUBLISH: PUBACK it
                    tl = body[0] << 8 | body[1]
                    s.sendall(b"\x40\x02" + body[2 + tl:4 + tl])
                elif t == 8:  # SUBSCRIBE: granted
                    s.sendall(b"\x90\x04" + body[:2] + b"\x00\x01")
                elif t == 12:
                    s.sendall(b"\xd0\x00")
            s.settimeout(max(0.05, deadline - time.monotonic()))
            got = s.recv(4096)
            if not got:
                raise AssertionError("closed while waiting for type %d" % want)
            buf += got
        raise AssertionError("no packet of type %d" % want)

    def _accept(self, present=False, then=b""):
        # the next connection, past its CONNECT: CONNACK (session present or
        # not), and `then` in the same write
        s, _ = self.srv.accept()
        buf = bytearray()
        self._packets(s, buf, 1)
        s.sendall(b"\x20\x03" + (b"\x01" if present else b"\x00") + b"\x00\x00" + then)
        return s, buf

    def _finish(self, s):
        self.done.set()
        time.sleep(5)
        s.close()

    @staticmethod
    def _pid(body):
        # a PUBLISH body's packet identifier (its topic first)
        return body[2 + (body[0] << 8 | body[1]) :][:2]

    def _run(self):
        qos2 = b"\x00\x05cmd/x\x00\x07\x00once"  # topic, packet id 7, no properties
        try:
            # the local subscriber first; then the PUBLISH goes in the same
            # write as the new session's CONNACK (the bridge reads both at
            # once), its DUP resend after the CONNACK of the resumed one
            if not self.go.wait(20):
                raise AssertionError("the test did not subscribe")
            for n in range(2):
                dup = 0x08 if n else 0
                s, buf = self._accept(present=bool(n),
                                      then=bytes((0x34 | dup, len(qos2))) + qos2)
                body = self._packets(s, buf, 5)  # PUBREC
                if body[:2] != b"\x00\x07":
                    self.errors.append("PUBREC for %r" % body[:2])
                if not n:
                    s.close()  # the PUBREC "lost": the session resends the PUBLISH
                    continue
                s.sendall(b"\x62\x02\x00\x07")  # PUBREL
                self._packets(s, buf, 7)  # PUBCOMP
                self._finish(s)
        except Exception as e:  # reported by the test
            self.errors.append(repr(e))

    def close(self):
        self.srv.close()


@ASYNC
def test_an_inbound_qos2_publish_resent_after_a_reconnect_is_published_once(broker_factory):
    up = ScriptedUpstream()
    try:
        rules = [{"pattern": "cmd/#", "direction": "in", "qos": 2}]
        gw = gateway(broker_factory, [bridge(up.port, rules)])
        local = paho_client(gw.port, "local-q2")
        local.subscribe_wait("cmd/#", qos=2)
        up.go.set()
        assert up.done.wait(30), up.errors or gw.log_text()[-2000:]
        time.sleep(0.5)
        assert not up.errors, up.errors
        assert [(m.topic, m.payload) for m in local.get_messages()] == [("cmd/x", b"once")]
        local.close()
    finally:
        up.close()


def _through_script(broker_factory, up, rules, topic, qos):
    """A gateway bridged to a scripted upstream and one local message sent
    through it; returns the gateway once the script has played."""
    gw = gateway(broker_factory, [bridge(up.port, rules, status=False)])
    pub = paho_client(gw.port, "scripted-pub")
    pub.publish_wait(topic, b"x", qos=qos)
    pub.close()
    assert up.done.wait(30), up.errors or gw.log_text()[-2000:]
    assert not up.errors, up.errors
    return gw


class Qos2Upstream(ScriptedUpstream):
    """Connection 1 takes a QoS 2 PUBLISH, sends PUBREC and goes away as
    the PUBREL comes (no PUBCOMP: an upstream restarted without
    persistence); connection 2 answers session present 0. What the bridge
    sends first for that message on connection 2 is recorded."""

    def _run(self):
        self.first = None
        try:
            for n in range(2):
                s, buf = self._accept()  # session present 0, both times
                if not n:
                    body = self._packets(s, buf, 3)
                    s.sendall(b"\x50\x02" + self._pid(body))
                    self._packets(s, buf, 6)  # PUBREL: then gone
                    s.close()
                    continue
                first, body = self._packets(s, buf, (3, 6), whole=True)
                self.first = first >> 4
                if self.first == 3:
                    pid = self._pid(body)
                    s.sendall(b"\x50\x02" + pid)
                    self._packets(s, buf, 6)
                    s.sendall(b"\x70\x02" + pid)
                self._finish(s)
        except Exception as e:  # reported by the test
            self.errors.append(repr(e))


@ASYNC
def test_a_qos2_message_past_pubrec_is_published_again_to_a_new_upstream_session(
    broker_factory
):
    """Its PUBREC came, its PUBREL was lost with an upstream that then came
    back without our session: the exchange is gone, so the PUBLISH goes
    again (before: only a PUBREL, which the new session ignores, and the
    message was lost: mosquitto delivers a QoS 2 message at PUBREL)."""
    up = Qos2Upstream()
    try:
        rules = [{"pattern": "s/#", "direction": "out", "qos": 2}]
        _through_script(broker_factory, up, rules, "s/x", 2)
        assert up.first == 3, "the bridge sent packet type %r first" % up.first
    finally:
        up.close()


@ASYNC
def test_a_retained_sync_cut_short_by_another_restart_is_sent_again(broker_factory, upstream):
    """An upstream without persistence restarts while the retained sync of
    its last restart is half sent (paced): what it had taken is gone with
    it, so the whole state is queued again (before: not, while the rest of
    the last sync still waited: the upstream kept a fraction for good)."""
    up = upstream("persistence false\n")
    gw = gateway(broker_factory, [bridge(up.port, OUT, replay_rate=20, status=False)])
    wait_connected(gw)
    publish_many(gw.port, [("sensors/r%d" % i, b"v%d" % i) for i in range(60)])
    pub = paho_client(gw.port, "rsync")
    for i in range(60):
        pub.publish_wait("sensors/r%d" % i, b"v%d" % i, qos=1, retain=True)
    pub.close()
    want = {("site1/gw1/sensors/r%d" % i, b"v%d" % i) for i in range(60)}
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 30)
    up.stop()
    up.start()  # the sync of all 60 is queued, sent at 20 a second
    wait_connected(gw, 2, timeout=20)
    time.sleep(1.0)
    up.stop()
    up.start()  # part of that sync was taken and is lost again
    wait_connected(gw, 3, timeout=20)
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 30), \
        len(retained_upstream(up.port, "site1/gw1/sensors/#"))


@ASYNC
def test_resends_of_a_resumed_session_keep_to_its_new_maximum_qos(broker_factory, upstream,
                                                                  collector, proxy):
    """QoS 2 messages in flight when the link went; the upstream (keeping
    our session) comes back with max_qos 1: they are sent again at QoS 1
    (before: at 2, and the upstream ended the link on every attempt)."""
    up = upstream()
    col = collector(up.port, qos=1)
    px = proxy(up.port)
    rules = [dict(OUT[0], qos=2)]
    gw = gateway(broker_factory, [bridge(px.port, rules, status=False, keepalive=30)])
    wait_connected(gw)
    px.freeze()  # what the bridge sends now stays in flight
    publish_many(gw.port, [("sensors/q%d" % i, b"%d" % i) for i in range(6)], qos=2)
    time.sleep(0.5)
    px.refuse = True
    px.cut()
    px.thaw()
    up.stop()
    with open(up.conf, "a") as f:
        f.write("max_qos 1\n")
    up.start()
    assert wait_for(lambda: col.c.is_connected(), 10)
    px.refuse = False
    want = {("site1/gw1/sensors/q%d" % i, b"%d" % i) for i in range(6)}
    assert wait_for(lambda: want <= arrived(col), 20), (sorted(arrived(col)),
                                                        gw.log_text()[-2000:])
    assert gw.log_text().count("bridge cloud: link down") == 1, gw.log_text()[-2000:]


@ASYNC
def test_latest_mode_a_retained_sync_does_not_skip_a_newer_plain_message(broker_factory,
                                                                         upstream, proxy,
                                                                         collector):
    up = upstream("persistence false\n")
    px = proxy(up.port)
    rules = [{"pattern": "l/#", "qos": 1, "mode": "latest", "remote_prefix": "g/"}]
    gw = gateway(broker_factory, [bridge(px.port, rules, status=False)])
    wait_connected(gw)
    pub = paho_client(gw.port, "lsync")
    pub.publish_wait("l/x", b"old-retained", qos=1, retain=True)
    assert wait_for(lambda: retained_upstream(up.port, "g/#") == {("g/l/x", b"old-retained")}, 10)
    px.refuse = True
    px.cut()
    assert gw.wait_log("bridge cloud: link down", 15)
    pub.publish_wait("l/x", b"plain", qos=1)  # newer, acknowledged while down
    pub.close()
    up.stop()
    up.start()  # no session of ours: the retained copy is queued after "plain"
    col = collector(up.port)
    px.refuse = False
    wait_connected(gw, 2, timeout=20)
    assert wait_for(lambda: ("g/l/x", b"plain") in arrived(col), 15), col.get()
    assert wait_for(lambda: retained_upstream(up.port, "g/#") == {("g/l/x", b"old-retained")},
                    10)


class RefusingUpstream(ScriptedUpstream):
    """Answers the bridge's QoS 1 PUBLISH with PUBACK 0x87 (not authorized)."""

    def _run(self):
        try:
            s, buf = self._accept()
            body = self._packets(s, buf, 3)
            s.sendall(b"\x40\x03" + self._pid(body) + b"\x87")
            self._finish(s)
        except Exception as e:  # reported by the test
            self.errors.append(repr(e))


@ASYNC
def test_a_message_the_upstream_refuses_is_counted(broker_factory):
    """PUBACK with a reason code >= 0x80 ends the exchange (nothing to resend:
    the upstream will not take it); counted in refused_upstream, not lost
    silently."""
    up = RefusingUpstream()
    try:
        gw = _through_script(broker_factory, up, OUT, "sensors/denied", 1)
        assert wait_for(lambda: bridge_state(gw.port)["refused_upstream"] == 1, 10)
        assert bridge_state(gw.port)["backlog"] == 0
    finally:
        up.close()


def _expiry(first, body):
    # a PUBLISH's Message Expiry Interval (0x02), or None: its topic, its
    # packet id (QoS 1, 2), then the property block (the bridge writes 0x02
    # first)
    i = 2 + (body[0] << 8 | body[1]) + (2 if first & 6 else 0)
    n, shift = 0, 0
    while True:
        b = body[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    props = body[i:i + n]
    return int.from_bytes(props[1:5], "big") if props[:1] == b"\x02" else None


class ResendUpstream(ScriptedUpstream):
    """Connection 1 takes a QoS 1 PUBLISH, holds it unacknowledged for 3 s
    and goes away; connection 2 resumes the session (present 1), granting
    Maximum QoS `maxqos` (None: not limited), and takes the resend. Both
    PUBLISHes' Message Expiry Intervals are recorded."""

    def __init__(self, maxqos=None):
        self.maxqos = maxqos
        super().__init__()

    def _run(self):
        self.seen = []
        try:
            for n in range(2):
                if not n or self.maxqos is None:
                    s, buf = self._accept(present=bool(n))
                else:
                    s, _ = self.srv.accept()
                    buf = bytearray()
                    self._packets(s, buf, 1)
                    s.sendall(b"\x20\x05\x01\x00\x02\x24" + bytes((self.maxqos,)))
                first, body = self._packets(s, buf, 3, whole=True)
                self.seen.append(_expiry(first, body))
                if not n:
                    time.sleep(3)
                    s.close()
                    continue
                if first & 6:
                    s.sendall(b"\x40\x02" + self._pid(body))
                self._finish(s)
        except Exception as e:  # reported by the test
            self.errors.append(repr(e))


@ASYNC
@pytest.mark.parametrize("maxqos", [None, 0])
def test_a_resend_carries_the_message_expiry_that_is_left(broker_factory, maxqos):
    """MQTT-3.3.2-6: what goes on carries the received Message Expiry
    Interval minus the time the message waited here. A resend to a resumed
    upstream session counts the time since the write too (before: the
    first send's figure again, so the upstream kept the message seconds
    longer than its publisher allowed; and a resend downgraded to the
    upstream's new Maximum QoS 0 went with no expiry at all)."""
    up = ResendUpstream(maxqos)
    try:
        gw = gateway(broker_factory, [bridge(up.port, OUT, status=False)])
        pub = paho_client(gw.port, "expiring-pub")
        pub.publish_wait("sensors/exp", b"x", qos=1, properties={"MessageExpiryInterval": 60})
        pub.close()
        assert up.done.wait(30), up.errors or gw.log_text()[-2000:]
        assert not up.errors, up.errors
        first, again = up.seen
        assert first is not None and 58 <= first <= 60, up.seen
        assert again is not None and again <= first - 2, up.seen
    finally:
        up.close()
