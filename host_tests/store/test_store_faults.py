"""Flash faults under the real broker (issue 14), both interpreters, through
host_tests/portable/faulty_fs_broker.py (edgestore.Fs patched, nothing else):

  full disk   (#7) every retained publish after the disk fills is refused
              the documented way (no PUBACK, DISCONNECT 0x80, store_io),
              never an internal error; every acknowledged message stays
              deliverable; when space returns the broker recovers and a
              restart holds everything acknowledged.
  read-only   (#9) a data dir that cannot be written: the broker starts,
              says so loudly, serves the stored messages and keeps new
              ones in RAM (acknowledged at once: not durable).
  directory   (#9) retained.ebrs being a directory: moved aside, the broker
              starts with an empty store.
"""

from pathlib import Path

import pytest

from mqtt_helpers import DISCONNECT, RawClient, publish_packet, raw_connect, requires_edgebroker

SCRIPT = Path(__file__).resolve().parents[1] / "portable" / "faulty_fs_broker.py"
STORAGE = pytest.mark.parametrize("storage", ["disc", "disc_only"])


@pytest.fixture(autouse=True)
def _edgebroker_only(interp):
    requires_edgebroker(interp, "the flash store is edgebroker's")


def retained(port, flt="#"):
    c = raw_connect(port, "", version=5)
    c.subscribe([(flt, 1)])
    got = {}
    while True:
        try:
            m = c.expect_publish(1.0)
        except (TimeoutError, AssertionError):
            break
        got[m.topic] = m.payload
    c.disconnect()
    return got


def publish_acked(port, cid, topic, payload):
    """True when the retained QoS 1 publish was acknowledged; False when the
    broker refused it the documented way (no PUBACK; 5.0 DISCONNECT 0x80)."""
    c = RawClient(port, version=5)
    assert c.connect(cid).reason == 0
    c.send(publish_packet(topic, payload, qos=1, retain=True, pid=7, version=5))
    p = c.read_packet(5)
    if p is not None and p.ptype == 4:
        c.disconnect()
        return True
    assert p is not None and p.ptype == DISCONNECT and p.body[0] == 0x80, p
    c.close()
    return False


@STORAGE
def test_full_disk_refuses_cleanly_keeps_every_ack_and_recovers(broker_factory, storage):
    b = broker_factory(script=str(SCRIPT), extra_args=("--fault", "full"), storage_type=storage)
    (Path(b.data_dir) / "quota").write_text("2500")
    acked = {}
    refused = 0
    for i in range(80):
        t = "full/%d" % (i % 30)
        v = b"%d-" % i + b"p" * 40
        if publish_acked(b.port, "p%d" % i, t, v):
            acked[t] = v
        else:
            refused += 1
            if refused >= 3:
                break
    assert refused >= 3 and acked, (refused, len(acked))
    assert retained(b.port) == acked  # reads work after the failed writes
    assert not publish_acked(b.port, "again", "full/new", b"x" * 100)
    assert retained(b.port) == acked
    log = b.log_text()
    assert "store_io" in log or "commit failed" in log
    assert "internal error" not in log and "Traceback" not in log, log
    (Path(b.data_dir) / "quota").write_text("10000000")  # space returns
    assert publish_acked(b.port, "after", "full/after", b"ok")
    acked["full/after"] = b"ok"
    assert retained(b.port) == acked
    b.stop()
    b2 = broker_factory(storage_type=storage)
    assert retained(b2.port) == acked


@STORAGE
def test_read_only_data_dir_serves_from_ram_loudly(broker_factory, storage):
    b = broker_factory(storage_type=storage)
    c = raw_connect(b.port, "w", version=5)
    assert c.publish("ro/kept", b"on flash", qos=1, retain=True) == 0
    c.disconnect()
    b.stop()
    store = Path(b.data_dir) / "retained.ebrs"
    before = store.read_bytes()
    b = broker_factory(script=str(SCRIPT), extra_args=("--fault", "readonly"),
                       storage_type=storage)
    assert b.wait_log("read-only", timeout=5)
    assert retained(b.port) == {"ro/kept": b"on flash"}
    c = raw_connect(b.port, "w2", version=5)
    assert c.publish("ro/new", b"in ram", qos=1, retain=True) == 0
    c.disconnect()
    assert retained(b.port) == {"ro/kept": b"on flash", "ro/new": b"in ram"}
    # the $SYS flag says why retained messages are not kept on flash
    s = raw_connect(b.port, "sys", version=5)
    s.subscribe([("$SYS/broker/retained/degraded", 0)])
    m = s.expect_publish(5)
    assert m.retain and b"read-only" in m.payload
    s.disconnect()
    assert "Traceback" not in b.log_text()
    b.stop()
    assert store.read_bytes() == before


@STORAGE
def test_store_path_that_is_a_directory_is_moved_aside(broker_factory, storage, tmp_path):
    d = tmp_path / "data" / "retained.ebrs"
    d.mkdir(parents=True)
    (d / "x").write_text("not a store")
    b = broker_factory(storage_type=storage)
    assert b.wait_log("moved aside", timeout=5)
    c = raw_connect(b.port, "w", version=5)
    assert c.publish("dir/t", b"v", qos=1, retain=True) == 0
    c.disconnect()
    assert retained(b.port) == {"dir/t": b"v"}
    assert (tmp_path / "data" / "retained.ebrs.bad" / "x").exists()
