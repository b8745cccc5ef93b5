"""The `edgebroker run` host command (issue: its exact interface is driven
by outside checks) and refusals under memory pressure: the heap reserve on
MicroPython refuses new connections with 0x97 / rc 3 while the broker stays
up, and it accepts again once memory is back (MicroPython's own asyncio
start_server accept task dies for good on one MemoryError; ours must not)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mqtt_helpers import (SESSION_EXPIRY_INTERVAL, RawClient, mosquitto_pub, mosquitto_sub, mpy_build,
                          paho_client, prop_u32, puback, publish_packet)

REPO = Path(__file__).resolve().parents[2]
EDGEBROKER = Path(sys.executable).parent / "edgebroker"


def _free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_run_serves_and_stops_cleanly(interp, tmp_path, sig):
    """`edgebroker run --board --port --bind --interpreter [--heap] --data-dir`
    prints one line with the address once it listens, serves real clients,
    and exits 0 on SIGTERM and on SIGINT."""
    if interp == "mosquitto":
        pytest.skip("the CLI starts edgebroker only")
    port = _free_port()
    cmd = [str(EDGEBROKER), "run", "--board", "boards/host.json", "--port", str(port),
           "--bind", "127.0.0.1", "--interpreter", interp, "--data-dir", str(tmp_path / "d")]
    if interp == "micropython":
        cmd += ["--heap", "256k"]  # a board-sized heap: runs the .mpy build
    p = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "edgebroker listening on 127.0.0.1:%d (%s, poll server)" % (port, interp), line
        mosquitto_pub(port, ["-t", "cli/t", "-m", "hello", "-r", "-q", "1"])
        out = mosquitto_sub(port, ["-t", "cli/#", "-v"], count=1, timeout=5)
        assert out == ["cli/t hello"]
        p.send_signal(sig)
        assert p.wait(10) == 0, p.stderr.read()
        if interp == "micropython":
            # the tool stops a MicroPython child by closing its stdin
            assert "standard input closed: stopping" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@contextlib.contextmanager
def _cli_broker(tmp_path, *args):
    """`edgebroker run` with args, started here and ended by its PID
    (SIGTERM, then kill); yields (port, process) once it listens."""
    port = _free_port()
    cmd = [str(EDGEBROKER), "run", "--port", str(port), "--data-dir", str(tmp_path / "d"), *args]
    p = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().startswith("edgebroker listening on")
        yield port, p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.mark.parametrize("server", ["poll", "async"])
def test_cli_run_micropython_takes_a_packet_near_max_packet_size(tmp_path, server):
    """`run --interpreter micropython` without --heap gives the port the
    profile's heap (host: 512 MB, its config check's figure), so a client
    that keeps to the CONNACK's Maximum Packet Size (the host profile's
    1 MB) is served: a 900 KB QoS 1 PUBLISH is acknowledged and delivered
    (before: the port's default 2 MB, MemoryError, connection dropped)."""
    with _cli_broker(tmp_path, "--interpreter", "micropython", "--server", server) as (port, p):
        big = bytes(range(256)) * (900 * 1024 // 256)
        sub = paho_client(port, "big-sub")
        sub.subscribe_wait("big/#", qos=1)
        pub = paho_client(port, "big-pub")
        pub.publish_wait("big/t", big, qos=1, timeout=20)
        assert sub.wait_messages(1, timeout=20), p.stderr.read() if p.poll() is not None else ""
        assert sub.get_messages()[0].payload == big
        pub.close()
        sub.close()


@pytest.mark.parametrize("server", ["poll", "async"])
def test_a_memory_error_serving_a_client_is_disconnect_0x97(tmp_path, server):
    """A 5.0 client whose PUBLISH the heap cannot take (900 KB into a 2 MB
    MicroPython heap: within the 1 MB Maximum Packet Size, over what this
    heap holds) gets DISCONNECT 0x97 Quota exceeded, a reason it can tell
    from a network fault (before: a bare close), and the broker goes on."""
    with _cli_broker(tmp_path, "--interpreter", "micropython", "--heap", "2m",
                     "--server", server) as (port, _):
        c = RawClient(port, version=5)
        assert c.connect("big", version=5).reason == 0
        c.send_nowait(publish_packet("big/t", b"x" * 900000, qos=1, pid=1, version=5))
        reason = c.expect_disconnect(10)[0]
        assert reason == 0x97, reason
        again = RawClient(port, version=5)
        assert again.connect("after", version=5).reason == 0
        again.disconnect()


def test_micropython_broker_holds_sigint_and_stops_at_end_of_stdin(broker_factory, interp):
    """The unix port raises KeyboardInterrupt inside its signal handler and
    can deadlock its heap lock (docs/design.md, "Stopping a MicroPython
    unix-port broker"), so a MicroPython broker is started with SIGINT
    blocked and --stop-on-eof (as the harness and the tools do): a SIGINT
    meanwhile changes nothing, the broker serves on, and the end of its
    stdin is a clean stop (exit 0) that keeps the retained message."""
    if interp != "micropython":
        pytest.skip("CPython brokers stop on SIGINT itself")
    b = broker_factory(storage_type="disc")
    mosquitto_pub(b.port, ["-t", "eof/t", "-m", "kept", "-r", "-q", "1"])
    os.kill(b.pid, signal.SIGINT)
    time.sleep(0.5)
    assert b.alive(), b.log_text()
    assert mosquitto_sub(b.port, ["-t", "eof/#", "-v"], count=1, timeout=5) == ["eof/t kept"]
    assert b.stop() == 0, b.log_text()
    assert "standard input closed: stopping" in b.log_text()
    b2 = broker_factory(storage_type="disc")
    assert mosquitto_sub(b2.port, ["-t", "eof/#", "-v"], count=1, timeout=5) == ["eof/t kept"]


@pytest.mark.parametrize("server", ["poll", "async"])
@pytest.mark.parametrize("stdin", ["devnull", "file"])
def test_stop_on_eof_with_a_file_for_stdin(interp, tmp_path, server, stdin):
    """`--stop-on-eof` stops at the end of standard input when that is
    /dev/null or a regular file too (`broker < /dev/null`, a service
    manager's null input), not only a pipe. Under CPython on Linux both
    servers wait with epoll, which refuses such a file (EPERM): the poll
    server died with a PermissionError traceback, and the asyncio server's
    watcher task died silently and the broker never stopped."""
    if interp == "mosquitto":
        pytest.skip("edgebroker's own option")
    exe = sys.executable if interp == "cpython" else str(Path(sys.executable).parent / "micropython")
    src = os.devnull
    if stdin == "file":
        src = str(tmp_path / "input.txt")
        Path(src).write_text("some lines\nthe broker ignores\n")
    cmd = [exe, "lib/edgebroker.py", "--board", "boards/host.json", "--port", str(_free_port()),
           "--bind", "127.0.0.1", "--data-dir", str(tmp_path / "d"), "--server", server, "--stop-on-eof"]
    with open(src, "rb") as f:
        r = subprocess.run(cmd, cwd=str(REPO), stdin=f, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "standard input closed: stopping" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("server", ["poll", "async"])
def test_a_memory_error_out_of_the_server_loop_fails_loudly(interp, tmp_path, server):
    """Every MemoryError a connection, an accept or a turn raises is handled
    below the server loop; one that still leaves it (here from a turn made
    to raise it) is a broker that cannot go on: one line on stderr and exit
    status 3, not the silent exit 0 it was (main() took it for a SIGINT
    that landed inside a collection)."""
    if interp == "mosquitto":
        pytest.skip("edgebroker's own exit")
    exe = sys.executable if interp == "cpython" else str(Path(sys.executable).parent / "micropython")
    args = ["edgebroker.py", "--board", "boards/host.json", "--port", str(_free_port()),
            "--bind", "127.0.0.1", "--data-dir", str(tmp_path / "d"), "--server", server]
    code = ("import sys\nsys.path.insert(0, %r)\nimport edgebroker\n"
            "def boom(self):\n    raise MemoryError('test')\n"
            "edgebroker.Broker._turn = boom\nedgebroker.main(%r)\n") % (str(REPO / "lib"), args)
    r = subprocess.run([exe, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=30)
    assert r.returncode == 3, r.stderr
    assert r.stderr.strip().splitlines()[-1] == \
        "edgebroker: error: out of heap, the server stopped (heap_reserve)", r.stderr


def test_a_heap_too_small_to_start_is_one_line(interp, tmp_path):
    """A heap that cannot hold what the profile needs at start (here 108 KB
    for the host profile, the board build of the broker on MicroPython; a
    store that cannot be made under CPython, which has no heap limit) is
    one line on stderr and exit status 3, not a traceback."""
    if interp == "mosquitto":
        pytest.skip("edgebroker's own exit")
    args = ["edgebroker.py", "--board", "boards/host.json", "--port", str(_free_port()),
            "--bind", "127.0.0.1", "--data-dir", str(tmp_path / "d"), "--stop-on-eof"]
    if interp == "cpython":
        exe = [sys.executable]
        code = ("import sys\nsys.path.insert(0, %r)\nimport edgebroker\n"
                "def boom(*a, **k):\n    raise MemoryError('test')\n"
                "edgebroker.open_store = boom\nedgebroker.main(%r)\n") % (str(REPO / "lib"), args)
    else:
        mpy = Path(mpy_build(tmp_path / "mpy")).parent
        exe = [str(Path(sys.executable).parent / "micropython"), "-X", "heapsize=108k"]
        code = ("import sys\nsys.path.insert(0, %r)\nimport edgebroker\nedgebroker.main(%r)\n"
                % (str(mpy), args))
    r = subprocess.run(exe + ["-c", code], cwd=str(REPO), capture_output=True, text=True,
                       timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgebroker: error: out of heap while starting ("), \
        r.stderr
    assert "`edgebroker config check` counts it" in lines[0]


def test_a_heap_too_small_for_the_code_is_one_line(tmp_path):
    """`edgebroker run --interpreter micropython --heap 64k`: the broker's
    .mpy cannot even be imported into that heap; one line on stderr and
    exit status 3 (as a heap too small to start), not MicroPython's
    traceback."""
    r = subprocess.run([str(EDGEBROKER), "run", "--interpreter", "micropython", "--heap", "64k",
                        "--port", str(_free_port()), "--data-dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == ["edgebroker: error: out of heap while loading the broker: the heap is "
                     "smaller than its code; `edgebroker config check` counts it"], r.stderr


@pytest.mark.parametrize("item", ["port=19999", "bind=0.0.0.0"])
@pytest.mark.parametrize("command", ["run", "emulate"])
def test_set_port_or_bind_is_refused_naming_the_option(tmp_path, command, item):
    """`--set port=...` / `--set bind=...` would be ignored (the address
    comes from --port and --bind): refused in one line naming the option to
    use, exit 2, nothing started."""
    args = [str(EDGEBROKER), command] + (["esp32"] if command == "emulate" else [])
    r = subprocess.run(args + ["--set", item, "--data-dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.stdout, r.stderr)
    key = item.split("=")[0]
    assert r.stderr.strip().splitlines() == [
        "edgebroker %s: error: --set %s: %s listens where --port and --bind say; use --%s "
        "(the profile's %s is the board's)" % (command, item, command, key, key)], r.stderr
    assert "listening" not in r.stdout


def test_cli_run_secrets_users_checked_like_a_profile(tmp_path):
    """`run --secrets FILE`: its users are checked like a profile's (a
    password entry is a string; an unsalted sha256 hash is refused as
    `config check` refuses it), in one line naming the key, exit 2, before
    anything listens (a non-string entry failed at every CONNECT before)."""
    for users, want in (({"u": 5}, "users.u = <integer, not shown>: must be a string"),
                        ({"u": "sha256:abc"}, "unsalted sha256")):
        sec = tmp_path / "secrets.json"
        sec.write_text(json.dumps({"users": users}))
        r = subprocess.run([str(EDGEBROKER), "run", "--secrets", str(sec), "--port",
                            str(_free_port()), "--data-dir", str(tmp_path / "d"),
                            "--set", "allow_anonymous=false"],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0], r.stderr
        assert "listening" not in r.stdout


def test_cli_run_warns_on_a_plain_text_password_in_the_secrets_file(tmp_path):
    """A plain-text password in `run --secrets FILE` is served (as on the
    board) with one warning naming the user and never the password, as
    `flash` and `config check` warn (before: nothing)."""
    sec = tmp_path / "secrets.json"
    sec.write_text(json.dumps({"users": {"gw": "hunter22"}}))
    with _cli_broker(tmp_path, "--secrets", str(sec), "--set", "allow_anonymous=false") as (port, p):
        c = RawClient(port, version=5)
        assert c.connect("pw", username="gw", password=b"hunter22").reason == 0
        c.disconnect()
    err = p.stderr.read()
    assert "warning: secrets file %s: users.gw: plain-text password" % sec in err, err
    assert "hunter22" not in err


def test_cli_run_secrets_users_and_the_profiles_together_keep_the_bound(tmp_path):
    """The secrets file's users join the profile's: 200 + 100 users pass
    the schema's 256 each alone, and are refused together in one line
    (the broker took all 300 before)."""
    prof = json.loads((REPO / "boards" / "host.json").read_text())
    prof.update(allow_anonymous=False, users={"u%d" % i: "pw-%d-long-enough" % i
                                              for i in range(200)})
    board = tmp_path / "p.json"
    board.write_text(json.dumps(prof))
    sec = tmp_path / "secrets.json"
    sec.write_text(json.dumps({"users": {"v%d" % i: "pw-%d-long-enough" % i for i in range(100)}}))
    r = subprocess.run([str(EDGEBROKER), "run", "--board", str(board), "--secrets", str(sec),
                        "--port", str(_free_port()), "--data-dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "users: 300 with the profile's, must be at most 256" in r.stderr, r.stderr
    assert "listening" not in r.stdout


@pytest.mark.parametrize("interpreter", ["cpython", "micropython"])
def test_broker_stops_when_its_wrapper_is_killed(tmp_path, interpreter):
    """`edgebroker run` killed outright (SIGKILL: no signal to forward): the
    broker it started, in a process group of its own, stops too (Linux
    parent-death signal) and its port is free again, rather than running on
    orphaned."""
    port = _free_port()
    wrapper = subprocess.Popen([str(EDGEBROKER), "run", "--interpreter", interpreter, "--port",
                                str(port), "--data-dir", str(tmp_path / "d")],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               stdin=subprocess.DEVNULL)
    try:
        assert "listening" in wrapper.stdout.readline()
        wrapper.kill()
        wrapper.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                break  # nothing listens any more
            time.sleep(0.1)
        else:
            raise AssertionError("the broker still listens after its wrapper was killed")
    finally:
        if wrapper.poll() is None:
            wrapper.kill()


def test_cli_run_rejects_bad_input(tmp_path):
    """Bad input gets a clear one-line answer naming what is wrong."""
    r = subprocess.run([str(EDGEBROKER), "run", "--board", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "nope.json" in r.stderr
    r = subprocess.run([str(EDGEBROKER), "run", "--heap", "lots"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "lots" in r.stderr


def test_refused_when_full_then_accepts_again(broker_factory, interp, tmp_path):
    """MicroPython: -X heapsize=140k and a heap_reserve the broker reaches
    after a few connections: the next CONNECT gets 0x97 (5.0) / rc 3 (3.1.1),
    the broker stays up and serves the connected clients, and accepts again
    once they leave. CPython has no heap figure, so the same behaviour is
    held there with max_clients as the limit that fills."""
    if interp == "micropython":
        # (34000: 36000 let only 2 connections in on the async server once
        # the code grew by 0.9 KB, 2026-11-27 evening; 32000: 34000 the same
        # after 0.7 KB more, 2026-12-08)
        b = broker_factory(heap="140k", script=mpy_build(tmp_path / "mpy"), heap_reserve=32000,
                           max_clients=200,
                           io_chunk=1024, sys_interval=0)
    else:
        b = broker_factory(max_clients=12, sys_interval=0)
    held = []
    refused = None
    try:
        for i in range(150):  # bounded: the limit is reached long before
            c = RawClient(b.port, version=5 if i % 2 else 4)
            ack = c.connect("fill-%d" % i)
            if ack.reason != 0:
                refused = (c.version, ack.reason)
                c.close()
                break
            held.append(c)
        assert refused is not None, "never refused after %d connections" % len(held)
        assert refused[1] == (0x97 if refused[0] == 5 else 3)
        assert len(held) >= 3
        # the connected clients are unharmed
        assert held[0].subscribe([("full/#", 1)]) == [1]
        held[-1].publish("full/x", b"still here", qos=1, pid=7)
        m = held[0].expect_publish(5)
        assert m.payload == b"still here"
    finally:
        for c in held:
            c.disconnect()
    # memory (or room) is back: new connections are accepted again
    _accepts_again(b, "after the clients left")
    assert b.alive()


def _accepts_again(b, when):
    """A new client is accepted within 10 s (the broker may need a turn or
    a collection to see its heap back)."""
    deadline = time.monotonic() + 10
    while True:
        c = RawClient(b.port, version=5)
        ack = c.connect("after")
        c.disconnect()
        if ack.reason == 0:
            return
        assert time.monotonic() < deadline, "still refusing " + when
        time.sleep(0.3)


def test_session_holding_the_heap_resumes_below_the_reserve(broker_factory, interp, tmp_path):
    """MicroPython, -X heapsize=140k: QoS 1 messages queued for an offline
    persistent session take the free heap below heap_reserve, so a new
    client is refused (0x97), and so is a QoS 1 PUBLISH. The session's own CONNECT is still accepted,
    because its drain is what gives that heap back (refused, it would hold
    the heap until it expired, and every new client would be refused till
    then): every acknowledged message arrives, in order, and new clients are
    accepted again. CPython has no heap figure and never refuses; there the
    test holds the same delivery."""
    if interp == "micropython":
        # the reserve sits below the free heap of a drained broker in 140k
        # (about 36 KB on the async server): 36000 left no margin once the
        # code grew by 0.9 KB (2026-11-27), and new clients stayed refused;
        # 35000 the same after another 0.9 KB that evening, 33000 after
        # 0.7 KB more (2026-12-08)
        b = broker_factory(heap="140k", script=mpy_build(tmp_path / "mpy"), heap_reserve=31000,
                           io_chunk=1024, sys_interval=0, max_queued=96, max_outbuf=4096,
                           max_inflight=8)
    else:
        b = broker_factory(sys_interval=0, max_queued=96, max_outbuf=4096, max_inflight=8)
    expiry = prop_u32(SESSION_EXPIRY_INTERVAL, 600)
    q = RawClient(b.port)
    assert q.connect("holder", clean=False, props=expiry).reason == 0
    assert q.subscribe([("heap/#", 1)]) == [1]
    q.disconnect()
    pub = RawClient(b.port)
    assert pub.connect("pub").reason == 0
    pub4 = RawClient(b.port, version=4)
    assert pub4.connect("pub4").reason == 0
    payload = bytes(range(256)) * 8
    sent = 0
    refused = False
    while sent < 56 and not refused:  # bounded: 56 x 2 KB is far past the reserve
        for _ in range(4):
            rc = pub.publish("heap/%d" % (sent + 1), payload, qos=1, pid=sent + 1)
            if rc == 0x97:
                # below the reserve a PUBLISH is refused too (publish_heap):
                # not acknowledged, so not expected
                refused = True
                break
            assert rc == 0
            sent += 1
        if refused:
            break
        probe = RawClient(b.port)
        ack = probe.connect("probe-%d" % sent)
        probe.close()
        if ack.reason:
            assert ack.reason == 0x97, ack
            refused = True
    assert refused == (interp == "micropython"), "sent %d, refused %s" % (sent, refused)
    # more queued QoS 1 PUBLISHes: below the reserve (the heap is looked at
    # every 16th, then at each while it is low) 5.0 gets PUBACK 0x97, 3.1.1
    # a closed connection (MQTT-3.3.5-2); CPython takes them all. (Queued
    # ones, not to a topic nobody takes: the refused probe's connection
    # gave its heap back, which can lift the free heap over the reserve
    # again; each queued message takes some of it, 32 of 256 B at most
    # about 14 KB, far less than the reserve, so no MemoryError.)
    payloads = [payload] * sent
    small = bytes(range(256))
    codes = []
    for _ in range(32):
        rc = pub.publish("heap/%d" % (sent + 1), small, qos=1, pid=sent + 1)
        codes.append(rc)
        if rc == 0x97:
            break
        sent += 1
        payloads.append(small)
    assert (0x97 in codes) == (interp == "micropython"), codes
    assert set(codes) <= {0, 0x97}, codes
    pub4.send(publish_packet("none/4", b"x", qos=1, pid=1, version=4))
    closed = False
    for k in range(16):
        if not pub4.is_open(0.05):
            closed = True
            break
        pub4.send(publish_packet("none/4", b"x", qos=1, pid=k + 2, version=4))
    assert closed == (interp == "micropython")
    q = RawClient(b.port)
    ack = q.connect("holder", clean=False, props=expiry)
    assert ack.reason == 0 and ack.session_present, ack
    for i in range(1, sent + 1):
        m = q.expect_publish(10)
        assert (m.topic, m.payload, m.qos) == ("heap/%d" % i, payloads[i - 1], 1)
        q.send(puback(m.pid))
    assert q.no_publish(0.3)
    _accepts_again(b, "after the queue drained")
    q.disconnect()
    pub.disconnect()
    assert b.alive()
