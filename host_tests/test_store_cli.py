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

REPO = Path(__file__).resolve().parents[1]
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
