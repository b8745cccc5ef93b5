"""`edgebroker store inspect|check` on the golden store files of
host_tests/data/ (made by make_golden.py): the real console script, run as
a subprocess. Crash safety and rule E4 are what the reports show: torn and
corrupt records found, lifetimes left after a restart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "host_tests" / "data"
EDGEBROKER = Path(sys.executable).parent / "edgebroker"
LIVE = ["sensors/t1", "config/mode", "alerts/door", "$app/version", "caf\u00e9/\u6c34"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(EDGEBROKER), "store", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


def inspect_json(name: str, *extra: str) -> dict[str, Any]:
    r = cli("inspect", str(DATA / name), "--json", *extra)
    assert r.returncode == 0, r.stderr
    report: dict[str, Any] = json.loads(r.stdout)
    return report


@pytest.mark.parametrize(
    ("name", "code", "says"),
    [
        ("good.ebrs", 0, "ok (5 live message(s), 164 dead bytes)"),
        ("empty.ebrs", 0, "ok (0 live message(s), 0 dead bytes)"),
        ("unknown_record.ebrs", 0, "1 unknown record(s) skipped"),
        ("torn_tail.ebrs", 1, "damaged: torn tail of 20 bytes at offset 401"),
        ("corrupt_record.ebrs", 1, "damaged: 1 corrupt record(s) at offset 137"),
        ("bad_magic.ebrs", 1, "damaged: bad magic 45425258 'EBRX'"),
        ("future_version.ebrs", 1, "damaged: format version 2 is newer than this reader"),
    ],
)
def test_check_exit_code_names_the_damage(name: str, code: int, says: str) -> None:
    """check: 0 clean, 1 damaged (torn, corrupt, bad magic, future version)."""
    path = DATA / name
    before = path.read_bytes()
    r = cli("check", str(path))
    assert r.returncode == code, r.stdout + r.stderr
    assert says in r.stdout
    assert path.read_bytes() == before  # read-only


def test_inspect_json_good_store_e4() -> None:
    """The whole report: live messages with qos, sizes and lifetimes left
    (runtime clock and, with --now, the wall clock: E4), dead bytes, the
    expired message left out."""
    rep = inspect_json("good.ebrs", "--now", "1700000500")
    assert rep["status"] == "ok" and rep["damaged"] is False
    assert rep["header"] == {"magic": "45425253", "version": 1, "kind": "ok"}
    assert rep["file_bytes"] == 401 and rep["records"] == 10
    assert rep["by_type"] == {"PUT": 8, "DEL": 1, "CLOCK": 1}
    assert [e["topic"] for e in rep["live"]] == LIVE
    assert rep["live_bytes"] == 229 and rep["dead_bytes"] == 164
    assert rep["torn_bytes"] == 0 and rep["corrupt"] == 0
    door = rep["live"][2]
    assert door["qos"] == 1 and door["payload_bytes"] == 4 and door["own_expiry"] is True
    assert door["remaining_at_write"] == 3600 and door["remaining"] == 3100
    assert door["expires_at"] == 1700003600
    mode = rep["live"][1]
    assert mode["props_bytes"] == 13 and mode["remaining"] is None
    assert [e["topic"] for e in rep["expired"]] == ["status/boot"]
    assert rep["clock"] == {"stime": 300, "wall": 1700000270}


def test_inspect_json_damaged_stores() -> None:
    torn = inspect_json("torn_tail.ebrs", "--now", "1700000500")
    assert torn["status"] == "torn" and torn["torn_bytes"] == 20 and torn["torn_offset"] == 401
    assert [e["topic"] for e in torn["live"]] == LIVE
    # by this machine's clock (long after 2023-11-14) alerts/door has expired
    now = inspect_json("torn_tail.ebrs")
    assert [e["topic"] for e in now["expired"]] == ["alerts/door", "status/boot"]
    corrupt = inspect_json("corrupt_record.ebrs")
    assert corrupt["status"] == "corrupt" and corrupt["corrupt_offsets"] == [137]
    assert "config/mode" not in [e["topic"] for e in corrupt["live"]]
    unknown = inspect_json("unknown_record.ebrs")
    assert unknown["status"] == "ok" and unknown["unknown_types"] == ["0x5a"]
    bad = inspect_json("bad_magic.ebrs")
    assert bad["status"] == "bad_magic" and bad["damaged"] is True and bad["live"] == []


def test_inspect_text() -> None:
    r = cli("inspect", str(DATA / "good.ebrs"), "--now", "1700000500")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "header   magic 45425253 'EBRS', version 1 (ok)" in out
    assert "status   ok" in out
    assert "dead     164 bytes (40.9% of the file)" in out
    assert "expired  1 (status/boot)" in out
    assert "3100 s left (ends 2023-11-14T23:13:20Z)" in out
    for topic in LIVE:
        assert topic in out
    r = cli("inspect", str(DATA / "torn_tail.ebrs"))
    assert r.returncode == 0 and "DAMAGED: torn tail of 20 bytes at offset 401" in r.stdout


def test_missing_file_is_a_usage_error() -> None:
    r = cli("check", str(DATA / "no-such.ebrs"))
    assert r.returncode == 2 and "no such store file" in r.stderr
    # a directory (the data directory itself) is said to be one, naming
    # the files it may hold (before: "no such store file", misleading)
    r = cli("inspect", str(DATA))
    assert r.returncode == 2 and "is a directory: give a store file in it" in r.stderr, r.stderr


# ---------------------------------------------------------------------------
# store_report.inspect(): the host-only reader over edgestore.replay()

sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO / "tools"))

import edgestore as es  # noqa: E402

from edgebroker_tools.commands import store_report  # noqa: E402


def test_inspect_reports_like_open() -> None:
    """inspect() decides as FlashStore's open: torn tail, expiry (E4), corrupt."""
    r = store_report.inspect(es, str(DATA / "torn_tail.ebrs"), wall_now=1700000500)
    assert r["status"] == "torn" and r["damaged"] is True and r["torn_offset"] == 401
    assert [e["topic"] for e in r["live"]] == LIVE
    door = r["live"][2]
    assert door["remaining"] == 3100 and door["expires_at"] == 1700003600
    assert [e["topic"] for e in r["expired"]] == ["status/boot"]
    r = store_report.inspect(es, str(DATA / "good.ebrs"))
    assert r["status"] == "ok" and not r["damaged"] and r["dead_bytes"] == 164
    assert r["live"][2]["remaining"] == 3330
    assert store_report.inspect(es, str(DATA / "bad_magic.ebrs"))["status"] == "bad_magic"
    future = store_report.inspect(es, str(DATA / "future_version.ebrs"))
    assert future["status"] == "future_version"
    corrupt = store_report.inspect(es, str(DATA / "corrupt_record.ebrs"))
    assert corrupt["corrupt_offsets"] == [137]


def _store(path: Path, n: int, payload: bytes = b"v" * 40) -> None:
    st = es.FlashStore(str(path), "disc_only", capacity=n)
    for i in range(n):
        t = f"sensor/{i}/value"
        st.put(t, (t.encode(), payload, 1, b"", 0, 0))
    st.close()


def test_inspect_and_open_agree_after_a_bad_length(tmp_path: Path) -> None:
    """A bad length in the first record (issue 14): inspect and open both
    resynchronise at the next good record and keep the same messages."""
    path = tmp_path / "r.ebrs"
    _store(path, 50)
    raw = bytearray(path.read_bytes())
    raw[9:13] = (len(raw) - 30).to_bytes(4, "big")
    path.write_bytes(bytes(raw))
    rep = store_report.inspect(es, str(path))
    assert rep["status"] == "corrupt" and rep["corrupt_offsets"] == [8]
    assert rep["torn_bytes"] == 0
    copy = tmp_path / "copy.ebrs"
    copy.write_bytes(bytes(raw))
    st = es.FlashStore(str(copy), "disc_only", capacity=64)
    opened = sorted(m[0].decode() for m in st.messages())
    st.close()
    assert sorted(e["topic"] for e in rep["live"]) == opened
    assert len(opened) == 49 and "sensor/0/value" not in opened
    r = cli("check", str(path))
    assert r.returncode == 1 and "1 corrupt record(s) at offset 8" in r.stdout


def test_inspect_json_piped_into_head_prints_no_traceback(tmp_path: Path) -> None:
    """`store inspect --json | head` ends quietly when head stops reading."""
    path = tmp_path / "big.ebrs"
    _store(path, 3000)
    r = subprocess.run(
        f"'{EDGEBROKER}' store inspect '{path}' --json | head -n 3",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.stdout.splitlines()[0] == "{"
    assert r.stderr == "", r.stderr
