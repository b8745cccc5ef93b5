"""Unit tests of codec, topic tree, RAM store and flash store: the portable
modules host_tests/portable/unit_codec.py and unit_store.py run here under
CPython (each function a pytest test) and, in
test_portable_units_under_micropython, under the MicroPython unix port
through a tiny runner."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO / "host_tests" / "portable"))

import unit_codec  # noqa: E402
import unit_store  # noqa: E402

PORTABLE = ["unit_codec", "unit_store"]


@pytest.mark.parametrize("name", sorted(n for n in dir(unit_codec) if n.startswith("test_")))
def test_cpython(name):
    getattr(unit_codec, name)()


@pytest.mark.parametrize("name", sorted(n for n in dir(unit_store) if n.startswith("test_")))
def test_store_cpython(name):
    getattr(unit_store, name)()


@pytest.mark.parametrize("module", PORTABLE)
def test_portable_units_under_micropython(module):
    """Each module in a fresh interpreter: a heap another module's tests
    fragmented would test that, not the module (the unix port's default
    2 MB heap, like a PSRAM board's)."""
    mp = Path(sys.executable).parent / "micropython"
    r = subprocess.run(
        [str(mp), str(REPO / "host_tests" / "portable" / "mp_runner.py"), str(REPO / "lib"), module],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0 and " 0 failed" in r.stdout, r.stdout + r.stderr


def _slots(path):
    import re
    text = (REPO / "lib" / path).read_text()
    return dict((m.group(1), int(m.group(2)))
                for m in re.finditer(r"^(_M_[A-Z]+) = const\((\d+)\)", text, re.M))


def test_store_reads_messages_by_the_brokers_slot_names():
    """edgestore takes and returns messages as edgebroker's tuples: both
    files name every slot the same (_M_TB .. _M_OWNEXP) with the same
    number, and edgestore reads no message slot by a bare number. (The
    names are consts, which MicroPython folds away: so the pin reads the
    sources.)"""
    import re
    broker, store = _slots("edgebroker.py"), _slots("edgestore.py")
    assert broker and store == broker
    import edgebroker
    import edgestore
    assert all(getattr(edgestore, k) == getattr(edgebroker, k) == v for k, v in broker.items())
    text = (REPO / "lib" / "edgestore.py").read_text()
    bare = re.findall(r"\b(?:m|msg|msgs\[s >> 8\]\[(?:k|s & 255)\])\[[0-9]\]", text)
    assert bare == []


def test_store_open_uses_the_stores_consts_and_slot_names():
    """lib/edgeopen.py (the store's reader and open, boot-only) keeps its
    own copies of edgestore's private consts (MicroPython folds a const
    named with "_" away: it cannot be imported) and of the message slots:
    the same names, the same numbers."""
    import re
    text = (REPO / "lib" / "edgeopen.py").read_text()
    store = (REPO / "lib" / "edgestore.py").read_text()
    pat = r"^(_[A-Z][A-Z0-9_]*) = const\((-?\d+)\)"
    mine = dict((m.group(1), int(m.group(2))) for m in re.finditer(pat, text, re.M))
    theirs = dict((m.group(1), int(m.group(2))) for m in re.finditer(pat, store, re.M))
    assert set(mine) >= {"_HDR", "_OK", "_BAD", "_TORN", "_CRC", "_CHUNK", "_M_TB"}
    assert all(theirs[k] == v for k, v in mine.items()), (mine, theirs)


_OPEN_PROBE = r"""
import sys
sys.path.insert(0, LIB)
import edgestore
s = edgestore.FlashStore(DIR + "/r.ebrs", "disc_only", 16)
s.put("a/b", (b"a/b", b"v", 1, b"", 0, 0))
s.commit()
print("open", "edgeopen" in sys.modules)
s.close()
s = edgestore.FlashStore(DIR + "/r.ebrs", "disc_only", 16)
print("reopened", "edgeopen" in sys.modules, s.count, s.get("a/b")[1])
s.close()
"""


@pytest.mark.parametrize("interpreter", ["cpython", "micropython"])
def test_store_open_code_is_dropped_once_the_store_is_open(interpreter, tmp_path):
    """lib/edgeopen.py (the file reader, recovery and load) is boot-only:
    FlashStore imports it to open its file and, on MicroPython, drops it
    again (its bytecode is heap on a board); a second open brings it back
    and reads what the
    first wrote. (CPython keeps it: a host opens stores by the thousand
    in the tests, and its heap is no board's.)"""
    lines = _probe(interpreter, _OPEN_PROBE.replace("DIR", repr(str(tmp_path))))
    kept = "True" if interpreter == "cpython" else "False"
    assert lines == ["open " + kept, "reopened %s 1 b'v'" % kept]


def test_ram_store_reads_messages_by_the_brokers_slot_names():
    """edgeram's RamStore reads a message's topic and expiry by the same
    slot names and numbers as edgebroker (a subset: the two it needs), and
    by no bare number."""
    import re
    broker, ram = _slots("edgebroker.py"), _slots("edgeram.py")
    assert set(ram) == {"_M_TB", "_M_EXP"}
    assert all(broker[k] == v for k, v in ram.items())
    text = (REPO / "lib" / "edgeram.py").read_text()
    assert re.findall(r"\bm\[[0-9]\]", text) == []


_AUTH_PROBE = r"""
import sys
sys.path.insert(0, LIB)
import edgebroker as eb
e = eb.Engine(eb.limits({}))
print("anonymous", e.auth is None, "edgeauth" in sys.modules)
rules = [{"who": "all", "access": "read", "topic": "a/#"},
         {"who": "user:ann", "access": "readwrite", "topic": "u/%u/#"}]
e = eb.Engine(eb.limits({"acl": rules}))
acl = e.acl_for("c1", "ann")
print("acl", "edgeauth" in sys.modules, e.auth.may(acl, "a/b", 1), e.auth.may(acl, "a/b", 2),
      e.auth.may(acl, "u/ann/x", 2), e.auth.may(acl, "u/bob/x", 1))
try:
    eb.limits({"acl": [{"who": "all", "access": "write", "topic": "a/#/b"}]})
except ValueError as x:
    print("refused", x)
"""


def _probe(interpreter, code):
    """A probe script's output lines, run by CPython or the MicroPython unix
    port, with LIB in it replaced by the lib/ directory."""
    exe = sys.executable
    if interpreter == "micropython":
        exe = str(Path(sys.executable).parent / "micropython")
    code = code.replace("LIB", repr(str(REPO / "lib")))
    r = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("interpreter", ["cpython", "micropython"])
def test_passwords_and_acls_load_only_for_a_profile_that_uses_them(interpreter):
    """lib/edgeauth.py: an Engine of an anonymous profile without an acl
    never imports it (its code is heap on a board); one with an acl does,
    and the rules hold; a bad rule is still refused naming its key."""
    lines = _probe(interpreter, _AUTH_PROBE)
    assert lines[0] == "anonymous True False"
    assert lines[1] == "acl True True False True False"
    assert lines[2].startswith("refused acl[0].topic: 'a/#/b'")


_CONF_PROBE = r"""
import gc, sys
sys.path.insert(0, LIB)
import edgebroker as eb
cfg = eb.limits(eb.with_secrets({"max_clients": 3}, {"users": {"ann": "x"}}))
print("checked", "edgeconf" in sys.modules, cfg["max_clients"], sorted(cfg["users"]))
eb.load_modules(cfg)
print("dropped", "edgeconf" in sys.modules)
try:
    eb.limits({"max_clients": 0})
except ValueError as x:
    print("refused", x)
"""


_CONF_BAD_PROBE = r"""
import sys
sys.path.insert(0, LIB)
import edgebroker as eb
for p in ([1], eb.with_secrets({}, {"users": {"u": 5}}),
          {"tls_client_ca": "ca.pem"}, {"tls_key": "k.pem"}):
    try:
        eb.limits(p)
        print("accepted")
    except ValueError as x:
        print("refused", x)
"""


@pytest.mark.parametrize("interpreter", ["cpython", "micropython"])
def test_profile_check_refuses_a_bad_shape_naming_the_key(interpreter):
    """The broker's own check (start(), a board's boot, --secrets on the
    host) refuses a profile that is not an object, a users entry that is
    not a password string (from a secrets file too: it failed at the first
    CONNECT before), and tls_client_ca or tls_key without tls_cert (both
    are used only by a TLS listener), each in one line naming the key."""
    lines = _probe(interpreter, _CONF_BAD_PROBE)
    assert lines[0] == "refused profile: [1] is not an object"
    assert lines[1] == "refused users.u: 5 is not a string (a password entry)"
    assert lines[2] == "refused tls_client_ca: 'ca.pem' needs tls_cert (a TLS listener)"
    assert lines[3] == "refused tls_key: 'k.pem' needs tls_cert (a TLS listener)"


@pytest.mark.parametrize("interpreter", ["cpython", "micropython"])
def test_profile_check_is_dropped_once_the_modules_are_loaded(interpreter):
    """lib/edgeconf.py (every key's default and allowed values, the profile
    check, the secrets merge) is boot-only: limits() and with_secrets()
    import it, load_modules() drops it (its bytecode is heap on a board),
    and a later limits() brings it back and still refuses a bad value
    naming the key."""
    lines = _probe(interpreter, _CONF_PROBE)
    assert lines[0] == "checked True 3 ['ann']"
    assert lines[1] == "dropped False"
    assert lines[2] == "refused max_clients: 0 (allowed 1..65535)"
