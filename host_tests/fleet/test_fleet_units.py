"""Fleet pipeline pieces without Spark: MQTT 5 properties, the inventory, the
collector against misbehaving and silent servers, the executor-side readers
(snapshot Parquet and the golden store files), synth and the progress bar."""

from __future__ import annotations

import asyncio
import io
import json
import struct
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edgebroker_tools.cli import main as cli_main
from edgebroker_tools.fleet import collect, decode, mqtt5, props, synth
from edgebroker_tools.fleet.inventory import InventoryError, load_inventory
from edgebroker_tools.fleet.progress import Progress
from edgebroker_tools.fleet.schema import FACT_COLUMNS, SNAPSHOT_SCHEMA, TOTAL_COLUMNS
from mqtt_helpers import free_port

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "host_tests" / "data"
WHEN = datetime(2025, 6, 1, 10, 0, tzinfo=UTC)


# ------------------------------------------------------------------ props
def test_properties_round_trip_and_stored_size() -> None:
    raw = props.encode(
        payload_format=1,
        message_expiry=60,
        content_type="text/plain",
        user_properties=[("unit", "C"), ("unit", "F")],
    )
    p = props.decode(raw)
    assert (p.payload_format, p.message_expiry, p.content_type) == (1, 60, "text/plain")
    assert p.user_properties == [("unit", "C"), ("unit", "F")]  # order and repeats kept
    assert p.stored_bytes == len(raw) - 5  # Message Expiry is per delivery, not stored


@pytest.mark.parametrize(
    ("raw", "why"),
    [(b"\x7f\x00", "unknown property"), (b"\x03\x00\x09abc", "cut short"),
     (b"\x03\x00\x02\xff\xfe", "not UTF-8")],
)  # fmt: skip
def test_bad_properties_are_refused(raw: bytes, why: str) -> None:
    with pytest.raises(props.PropertyError, match=why):
        props.decode(raw)


# -------------------------------------------------------------- inventory
def _inventory(tmp_path: Path, gateways: list[dict[str, Any]], **extra: Any) -> Path:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"gateways": gateways, **extra}))
    return path


def test_inventory_resolves_boards_limits_and_credentials(tmp_path: Path) -> None:
    (tmp_path / "secrets.json").write_text(json.dumps({"a": {"username": "u", "password": "p"}}))
    path = _inventory(
        tmp_path,
        [
            {"id": "gw-1", "host": "10.0.0.5", "board": "esp32", "credentials": "a"},
            {"id": "gw-2", "host": "10.0.0.6", "port": 1884, "board": "rp2040_picow",
             "overrides": {"max_retained_messages": 300}},
            {"id": "gw-3", "board": "esp32", "store": "pulled.ebrs",
             "collected_at": "2025-06-01T10:00:00Z"},
        ],
        secrets="secrets.json",
    )  # fmt: skip
    gws = {g.id: g for g in load_inventory(path)}
    assert gws["gw-1"].username == "u" and gws["gw-1"].password == "p"
    assert gws["gw-1"].limits["max_retained_messages"] == 256
    assert gws["gw-2"].limits["max_retained_messages"] == 300 and gws["gw-2"].port == 1884
    assert gws["gw-2"].board == "rp2040_picow"
    assert gws["gw-3"].store == tmp_path / "pulled.ebrs" and gws["gw-3"].collected_at == WHEN


@pytest.mark.parametrize(
    ("gateways", "says"),
    [
        ([{"id": "a b", "host": "h", "board": "esp32"}], "must be 1-64 letters"),
        ([{"id": "x", "host": "h", "board": "esp32"}] * 2, "duplicate id"),
        ([{"id": "x", "host": "h", "board": "esp32", "port": 0}], "port 0"),
        ([{"id": "x", "host": "h", "board": "nope"}], "unknown board"),
        ([{"id": "x", "board": "esp32"}], "'host' (or 'store') is required"),
        ([{"id": "x", "host": "h", "board": "esp32", "credentials": "zz"}], "not in the secrets"),
        ([{"id": "x", "host": "h", "board": "esp32", "colour": 1}], "unknown key(s) colour"),
    ],
)
def test_inventory_errors_name_the_problem(
    tmp_path: Path, gateways: list[dict[str, Any]], says: str
) -> None:
    with pytest.raises(InventoryError) as err:
        load_inventory(_inventory(tmp_path, gateways))
    assert says in str(err.value)


def test_collect_cli_reports_a_bad_inventory_as_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.json"
    path.write_text("{not json")
    assert cli_main(["fleet", "collect", "--inventory", str(path), "--out", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The command's stderr: exactly one `edgebroker fleet: error:` line, no traceback."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("edgebroker fleet: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [({"max_clients": "abc"}, 'max_clients = "abc": must be an integer in 1..65535'),
     ({"nokey": 1}, "nokey = 1: unknown key"),
     ({"max_clients": 0}, "max_clients = 0: must be 1..65535"),
     ({"max_clients": 9}, "max_clients = 9: must be <= 8 (sockets 10")],
)  # fmt: skip
def test_collect_refuses_overrides_the_profile_check_refuses_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: dict[str, Any], says: str
) -> None:
    # the gateway's effective profile (board + overrides) gets `config check`'s
    # checker: the message names the gateway, the key, the value and the range
    gws = [{"id": "gw-ok", "host": "127.0.0.1", "port": free_port(), "board": "esp32"},
           {"id": "gw-bad", "host": "127.0.0.1", "port": free_port(), "board": "esp32",
            "overrides": overrides}]  # fmt: skip
    path = _inventory(tmp_path, gws)
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert str(err.value).startswith("gateway gw-bad: ") and says in str(err.value)
    out = tmp_path / "snaps"
    assert cli_main(["fleet", "collect", "--inventory", str(path), "--out", str(out)]) == 2
    assert says in _one_error_line(capsys)
    assert not out.exists()  # refused before anything was collected or written


def test_collect_refuses_a_board_profile_file_the_profile_check_refuses(tmp_path: Path) -> None:
    (tmp_path / "custom.json").write_text(json.dumps({"board": "custom", "max_clients": -1}))
    path = _inventory(tmp_path, [{"id": "gw-1", "host": "h", "board": "custom.json"}])
    with pytest.raises(InventoryError, match=r"gateway gw-1: board profile .*custom\.json: "
                       r"max_clients = -1: must be 1\.\.65535"):  # fmt: skip
        load_inventory(path)
    # a null override removes the key: the board's own value is checked again
    fixed = _inventory(tmp_path, [{"id": "gw-1", "host": "h", "board": "custom.json",
                                   "overrides": {"max_clients": None}}])  # fmt: skip
    assert load_inventory(fixed)[0].limits["max_clients"] == 16


UNUSABLE_JSON = {
    "not UTF-8": (b"\xff\xfe{}", "is not UTF-8 text: byte 0xff at offset 0"),
    "5,000 digits": (b'{"n": ' + b"1" * 5000 + b"}", "a number with more than 4300 digits"),
    "5,000 deep": (b"[" * 5000 + b"]" * 5000, "nested deeper than Python's recursion limit"),
}


@pytest.mark.parametrize("role", ["inventory", "secrets file", "board profile"])
@pytest.mark.parametrize("kind", list(UNUSABLE_JSON))
def test_unusable_json_in_inventory_secrets_or_board_file_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str, kind: str
) -> None:
    content, says = UNUSABLE_JSON[kind]
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    inventory = tmp_path / "fleet.json"
    gateway = {"id": "gw-1", "host": "h", "board": "esp32"}
    if role == "inventory":
        inventory = bad
    elif role == "secrets file":
        inventory.write_text(json.dumps({"secrets": "bad.json", "gateways": [gateway]}))
    else:
        inventory.write_text(json.dumps({"gateways": [gateway | {"board": "bad.json"}]}))
    out = tmp_path / "snaps"
    assert cli_main(["fleet", "collect", "--inventory", str(inventory), "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert f"{role} " in line and "bad.json" in line and says in line
    assert not out.exists()


# ---------------------------------------------------- outputs and options
def test_collect_and_synth_refuse_an_out_that_cannot_be_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = tmp_path / "out.json"
    existing.write_text("{}")
    gw = {"id": "gw-1", "host": "127.0.0.1", "port": free_port(), "board": "esp32"}
    inventory = _inventory(tmp_path, [gw])
    args = ["fleet", "collect", "--inventory", str(inventory), "--no-progress"]
    assert cli_main([*args, "--out", str(existing)]) == 2
    assert f"--out {existing}: exists and is not a directory" in _one_error_line(capsys)
    assert existing.read_text() == "{}"
    synth_args = ["fleet", "synth", "--gateways", "2", "--topics", "2", "--snapshots", "1"]
    assert cli_main([*synth_args, "--out", str(existing)]) == 2
    assert "exists and is not a directory" in _one_error_line(capsys)
    below_a_file = existing / "x"  # as /proc/x/: no directory can be made there
    assert cli_main([*synth_args, "--out", f"{below_a_file}/"]) == 2
    assert f"--out {below_a_file}: cannot create the directory" in _one_error_line(capsys)


def test_report_html_target_is_checked_and_written_without_a_traceback(tmp_path: Path) -> None:
    from edgebroker_tools.fleet import outputs, report

    missing = tmp_path / "nonexistent" / "dir" / "r.html"
    with pytest.raises(outputs.OutputError, match=r"--html .*r\.html: no such directory"):
        report.check_html_target(missing)
    with pytest.raises(outputs.OutputError, match="is a directory"):
        report.check_html_target(tmp_path)
    data = report.Data("wh", {}, None, 0, 0, 0, 0)
    with pytest.raises(outputs.OutputError, match="no such directory"):
        report.write_html(missing, data)
    report.write_html(tmp_path / "r.html", data)
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_build_refuses_a_master_or_driver_memory_spark_would_not_take_before_starting_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgebroker_tools.fleet import spark

    args = ["fleet", "build", "--snapshots", str(tmp_path), "--out", str(tmp_path / "wh"),
            "--no-progress"]  # fmt: skip
    assert cli_main([*args, "--master", "bogus"]) == 2
    assert "--master 'bogus': expected yarn or a master starting with local" in (
        _one_error_line(capsys)
    )
    assert cli_main([*args, "--driver-memory", "lots"]) == 2
    assert "--driver-memory 'lots': expected a number and a unit" in _one_error_line(capsys)
    for good in ("local", "local[*]", "local-cluster[2,1,1024]", "spark://h:7077", "yarn"):
        spark.check_master(good)
    for good in ("4g", "512m", "2048M"):
        spark.check_memory(good)
    assert spark._reason(
        Exception("An error occurred while calling None.org.apache.spark.api.java."
                  "JavaSparkContext.\n: org.apache.spark.SparkException: Could not parse "
                  "Master URL: 'local[abc]'\n\tat org.apache.spark.SparkContext$.x")
    ) == "Could not parse Master URL: 'local[abc]'"  # fmt: skip


def test_build_refuses_a_boards_directory_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgebroker_tools.fleet import job

    args = ["--snapshots", str(tmp_path), "--out", str(tmp_path / "wh")]
    for boards, says in ((tmp_path / "nonexistent", "no such directory"),
                         (tmp_path / "f.json", "not a directory")):  # fmt: skip
        (tmp_path / "f.json").write_text("{}")
        assert cli_main(["fleet", "build", *args, "--boards", str(boards)]) == 2
        assert f"--boards {boards}: {says}" in _one_error_line(capsys)
        assert job.main([*args, "--boards", str(boards)]) == 2  # the spark-submit entry
        assert f"fleet-job: error: --boards {boards}: {says}" in capsys.readouterr().err
    assert not (tmp_path / "wh").exists()


# -------------------------------------------------------------- collector
async def _serve(handler: Any) -> tuple[asyncio.Server, int]:
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    return server, port


def test_gather_fails_on_garbage_and_on_a_gateway_that_never_goes_quiet() -> None:
    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(100)
        w.write(b"\x20\x02\x00\x00" + b"\xff" * 8)  # CONNACK ok, then nonsense
        await w.drain()
        await asyncio.sleep(0.5)
        w.close()

    async def chatty(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(100)
        w.write(b"\x20\x03\x00\x00\x00")  # CONNACK
        await r.read(100)
        w.write(b"\x90\x05\x00\x01\x00\x00\x00")  # SUBACK, 2 filters granted QoS 0
        n = 0
        while n < 1000:  # a retained message every 50 ms: never quiet for 0.3 s... almost
            n += 1
            topic = f"t/{n}".encode()
            body = struct.pack(">H", len(topic)) + topic + b"\x00" + b"v"
            w.write(bytes((0x31, len(body))) + body)
            await w.drain()
            await asyncio.sleep(0.05)

    async def run() -> tuple[str, str]:
        s1, p1 = await _serve(garbage)
        s2, p2 = await _serve(chatty)
        async with s1, s2:
            with pytest.raises(mqtt5.CollectError) as e1:
                await mqtt5.gather_retained("127.0.0.1", p1, quiet=0.3, timeout=3)
            with pytest.raises(mqtt5.CollectError) as e2:
                await mqtt5.gather_retained("127.0.0.1", p2, quiet=0.3, timeout=1.0)
        return str(e1.value), str(e2.value)

    first, second = asyncio.run(run())
    assert "malformed remaining length" in first
    assert "no quiet period within 1 s" in second


def test_collect_logs_failures_and_keeps_going(tmp_path: Path) -> None:
    path = _inventory(
        tmp_path,
        [{"id": f"gw-{i}", "host": "127.0.0.1", "port": free_port(), "board": "esp32"}
         for i in range(5)]
        + [{"id": "gw-store", "board": "esp32", "store": str(DATA / "good.ebrs"),
            "collected_at": "2025-06-01T10:00:00Z"}],
    )  # fmt: skip
    out = tmp_path / "snaps"
    opts = collect.Options(concurrency=2, timeout=2, retries=1, backoff=0.05)
    results = collect.run(load_inventory(path), out, opts, show_progress=False)
    assert sum(r.ok for r in results) == 1
    log = [json.loads(x) for x in (out / "collect_log.jsonl").read_text().splitlines()]
    assert len(log) == 6
    assert {e["gateway_id"] for e in log if e["status"] == "failed"} == {
        f"gw-{i}" for i in range(5)
    }
    assert all(e["attempts"] == 2 for e in log if e["status"] == "failed")
    store = next(e for e in log if e["gateway_id"] == "gw-store")
    copied = out / store["file"]
    assert copied.read_bytes() == (DATA / "good.ebrs").read_bytes()
    meta = json.loads(copied.with_name(copied.name + ".json").read_text())
    assert meta["gateway_id"] == "gw-store" and meta["limits"]["max_payload_size"] == 512


def test_progress_bar_draws_on_a_tty_and_by_tenths_otherwise() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    with Progress(3, "collect", stream=tty) as bar:
        for ok in (True, False, True):
            bar.advance(ok)
    assert tty.getvalue().count("\r") == 4 and "3/3 failed 1" in tty.getvalue()
    plain = io.StringIO()
    with Progress(100, "collect", stream=plain) as bar:
        for _ in range(100):
            bar.advance()
    assert len(plain.getvalue().splitlines()) == 11  # 0%, 10%, ... 100%


# ---------------------------------------------------------------- readers
META = decode.CollectionMeta("gw-s", "esp32", WHEN, "store", "r1", {"max_retained_messages": 256})


def test_store_file_decodes_as_the_broker_would_load_it() -> None:
    table = decode.read_store((DATA / "good.ebrs").read_bytes(), META)
    assert table.schema == SNAPSHOT_SCHEMA
    rows = {r["topic"]: r for r in table.to_pylist()}
    assert rows[None]["gateway_id"] == "gw-s"  # the collection's header row
    assert {t: r["payload"] for t, r in rows.items() if t} == {
        "sensors/t1": b"22.0",
        "config/mode": b"auto",
        "$app/version": b"1.2",
        "caf\u00e9/\u6c34": b"\x00\x01\xff",
    }  # fmt: skip  (alerts/door's Message Expiry has run out by WHEN)
    assert rows["sensors/t1"]["qos"] == 2  # the replacing PUT's
    assert rows["config/mode"]["content_type"] == "text/plain"
    assert rows["caf\u00e9/\u6c34"]["payload_text"] is None
    assert rows["sensors/t1"]["limit_max_retained_messages"] == 256


@pytest.mark.parametrize(
    ("name", "says"),
    [("bad_magic.ebrs", "bad_magic"), ("future_version.ebrs", "future_version"),
     ("torn_tail.ebrs", "torn tail"), ("corrupt_record.ebrs", "corrupt record")],
)  # fmt: skip
def test_damaged_store_files_are_refused(name: str, says: str) -> None:
    with pytest.raises(decode.DecodeError, match=says):
        decode.read_store((DATA / name).read_bytes(), META)


def test_damaged_store_kept_on_request_is_the_good_prefix() -> None:
    table = decode.read_store((DATA / "torn_tail.ebrs").read_bytes(), META, keep_damaged=True)
    assert table.num_rows >= 2


def test_snapshot_reader_fills_optional_columns_and_refuses_non_snapshots(tmp_path: Path) -> None:
    minimal = pa.table(
        {
            "gateway_id": ["g", "g"],
            "collected_at": pa.array([WHEN, WHEN], pa.timestamp("ms")),  # naive, ms: cast
            "topic": ["a", "b"],
            "payload": [b"1", b"\xff"],
        }
    )
    pq.write_table(minimal, tmp_path / "min.parquet")
    table = decode.read_snapshot((tmp_path / "min.parquet").read_bytes())
    assert table.schema == SNAPSHOT_SCHEMA
    assert table.num_rows == 3  # a header row added for the collection
    assert [r["payload_text"] for r in table.to_pylist() if r["topic"]] == ["1", None]
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(decode.DecodeError, match="not a snapshot"):
        decode.read_snapshot((tmp_path / "other.parquet").read_bytes())
    (tmp_path / "junk.parquet").write_bytes(b"PAR1junk")
    with pytest.raises(decode.DecodeError, match="unreadable Parquet"):
        decode.read_snapshot((tmp_path / "junk.parquet").read_bytes())


def test_collection_totals_ride_on_the_first_header_row_of_each_collection() -> None:
    # what the build's collections step reads instead of every row: retained
    # rows (not $SYS) counted, their bytes (topic + payload + stored property
    # bytes; a row without a payload adds none), the largest payload
    later = datetime(2025, 6, 1, 11, 0, tzinfo=UTC)
    rows = [
        {"gateway_id": "g", "collected_at": WHEN, "topic": None, "payload": None,
         "props_bytes": None},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "a/b", "payload": b"1234",
         "props_bytes": 10},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "c", "payload": b"x"},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "d", "payload": None},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "$SYS/broker/heap/free",
         "payload": b"123456789"},
        {"gateway_id": "g", "collected_at": WHEN, "topic": None, "payload": None},  # again
        {"gateway_id": "g", "collected_at": later, "topic": None, "payload": None},  # empty
    ]  # fmt: skip
    table = decode.conform(pa.Table.from_pylist(rows), "test")
    out = decode.with_totals(table).to_pylist()
    got = [(r["topic"], r["collected_at"] == WHEN, *(r[c] for c in TOTAL_COLUMNS)) for r in out]
    assert got == [
        (None, True, 3, (3 + 4 + 10) + (1 + 1), 4),
        ("a/b", True, None, None, None),
        ("c", True, None, None, None),
        ("d", True, None, None, None),
        ("$SYS/broker/heap/free", True, None, None, None),
        (None, True, None, None, None),  # a second header: the first has the totals
        (None, False, 0, 0, 0),
    ]
    # the observations keep payload_text for the $SYS rows only (the
    # statistics); a retained row's text is derived from its payload
    text = decode.sys_text_only(table).column("payload_text").to_pylist()
    assert text == [None, None, None, None, "123456789", None, None]


def test_the_observations_keep_a_collections_facts_on_its_header_rows_only() -> None:
    # the build reads board, source, run_id and the limits from the header
    # rows alone (job.collections), and the property bytes only through
    # with_totals: the other rows carry nulls, not a copy each
    facts = {"board": "esp32", "source": "mqtt", "run_id": "r1",
             "limit_max_retained_messages": 256, "limit_max_clients": 4}  # fmt: skip
    rows = [
        {"gateway_id": "g", "collected_at": WHEN, "topic": None, "payload": None,
         "props_bytes": None, **facts},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "a/b", "payload": b"1",
         "props_bytes": 7, **facts},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "$SYS/broker/uptime",
         "payload": b"5", **facts},
    ]  # fmt: skip
    table = decode.with_totals(decode.conform(pa.Table.from_pylist(rows), "test"))
    out = decode.facts_on_headers(table).to_pylist()
    assert [r["topic"] for r in out] == [None, "a/b", "$SYS/broker/uptime"]
    for name in FACT_COLUMNS:
        assert [r[name] for r in out] == [out[0][name], None, None], name
    assert out[0]["board"] == "esp32" and out[0]["limit_max_clients"] == 4
    assert [r["props_bytes"] for r in out] == [None, None, None]
    # everything else is kept, the totals (summed before) included
    assert [r["payload"] for r in out] == [None, b"1", b"5"]
    assert out[0]["_retained_bytes"] == 3 + 1 + 7


def test_ingest_reports_each_file_and_yields_only_good_ones(tmp_path: Path) -> None:
    (tmp_path / "junk.parquet").write_bytes(b"nope")
    units = pa.RecordBatch.from_pylist(
        [
            {"kind": "store", "path": str(DATA / "good.ebrs"),
             "content": (DATA / "good.ebrs").read_bytes(), "meta": META.to_json(),
             "keep_damaged": False},
            {"kind": "parquet", "path": str(tmp_path / "junk.parquet"), "content": b"nope",
             "meta": None, "keep_damaged": False},
            {"kind": "store", "path": str(DATA / "empty.ebrs"),
             "content": (DATA / "empty.ebrs").read_bytes(), "meta": META.to_json(),
             "keep_damaged": False},
        ]
    )  # fmt: skip
    statuses: list[decode.FileStatus] = []
    batches = list(decode.ingest([units], statuses))
    assert sum(b.num_rows for b in batches) == 5 + 1  # good: header + 4, empty: header
    assert [(Path(s.path).name, s.rows, bool(s.error)) for s in statuses] == [
        ("good.ebrs", 5, False), ("junk.parquet", 0, True), ("empty.ebrs", 1, False),
    ]  # fmt: skip


# ------------------------------------------------------------------ synth
def test_synth_is_deterministic_and_has_the_asked_shape(tmp_path: Path) -> None:
    a = synth.generate(tmp_path / "a", 30, 20, 3, seed=7, missing=0.0, per_file=10)
    b = synth.generate(tmp_path / "b", 30, 20, 3, seed=7, missing=0.0, per_file=10)
    assert a.rows == b.rows == 30 * 20 * 3 and a.files == 9
    for fa in sorted((tmp_path / "a").rglob("*.parquet")):
        fb = tmp_path / "b" / fa.relative_to(tmp_path / "a")
        assert pq.read_table(fa).equals(pq.read_table(fb))
    t = pq.read_table(next((tmp_path / "a").rglob("synth-000-00000.parquet")))
    assert t.schema == SNAPSHOT_SCHEMA
    rows = t.to_pylist()
    assert sum(r["topic"] is None for r in rows) == 10  # one header per gateway
    assert any(r["payload_text"] is None and r["topic"] for r in rows)  # binary payloads
    assert any(r["message_expiry"] for r in rows)
    assert {r["board"] for r in rows} <= {"esp32", "rp2040_picow", "esp32s3", "rp2350_pico2w"}
    assert all(r["payload_text"] == "0.1.0" for r in rows if r["topic"] == "$SYS/broker/version")


# ----------------------------------------------------------------- advice
def _stats(gateways: int, collections: int, refused: int = 0) -> dict[str, Any]:
    return {
        "board": "esp32", "gateways": gateways, "collections": collections,
        "current_max_retained_messages": 256, "current_max_payload_size": 512,
        "current_store_budget_bytes": 65536, "count_q": [100.0, 180.0, 200.0],
        "retained_count_max": 256 if refused else 210, "payload_q": [40.0, 60.0, 90.0],
        "max_payload_max": 100, "bytes_q": [9000.0, 15000.0, 20000.0],
        "retained_bytes_max": 22000, "rf": refused, "rtl": 0,
    }  # fmt: skip


def test_advice_below_the_minimum_sample_says_not_enough_data() -> None:
    from edgebroker_tools.fleet import job

    rows, patches = job.advise([_stats(3, 30)], 1.25, None, min_gateways=5, min_collections=10)
    assert patches == {}
    (row,) = rows
    assert row["status"] == "not enough data" and row["suggested_max_retained_messages"] is None
    assert "3 gateway(s), minimum 5" in row["why_max_retained_messages"]
    rows, _ = job.advise([_stats(8, 9)], 1.25, None, min_gateways=5, min_collections=10)
    assert "9 collection(s), minimum 10" in rows[0]["why_store_budget_bytes"]


def test_advice_says_why_each_limit_changes() -> None:
    from edgebroker_tools.fleet import job

    rows, patches = job.advise([_stats(8, 24)], 1.25, None, min_gateways=5, min_collections=10)
    row = rows[0]
    assert row["status"] == "advice" and patches["esp32"]["max_retained_messages"] == 256
    assert row["why_max_retained_messages"].startswith("keep max_retained_messages 256 -> 256")
    assert "max 210 (above p99 200 x 1.25)" not in row["why_max_retained_messages"]
    assert "p99 200 x 1.25 = 250" in row["why_max_retained_messages"]
    refused, _ = job.advise([_stats(8, 24, refused=14)], 1.25, None)
    why = refused[0]["why_max_retained_messages"]
    assert why.startswith("raise max_retained_messages 256 -> 320")
    assert "14 refused (retained_full) at the limit 256" in why


def test_advice_rounds_the_exact_product_not_its_float_noise() -> None:
    # 400 x 1.1 is 440.00000000000006 in floats: the advice must be 440 (a
    # multiple of 8 already), not the next multiple; the same for the
    # refusal floor (the current limit x headroom) and the other limits
    from edgebroker_tools.fleet import job

    stats = _stats(8, 24) | {
        "count_q": [400.0, 400.0, 400.0], "retained_count_max": 400,
        "payload_q": [1600.0, 1600.0, 1600.0], "max_payload_max": 1600,
        "bytes_q": [409600.0, 409600.0, 409600.0], "retained_bytes_max": 409600,
    }  # fmt: skip
    (row,), _ = job.advise([stats], 1.1, None)
    assert row["suggested_max_retained_messages"] == 440
    assert row["suggested_store_budget_bytes"] == 450560
    assert row["why_store_budget_bytes"].endswith("to a multiple of 4,096 -> 450,560")
    (row,), _ = job.advise([stats], 2.2, None)
    assert row["suggested_max_payload_size"] == 3520  # 1,600 x 2.2, a multiple of 64
    floor = stats | {"current_max_retained_messages": 400, "count_q": [1.0, 1.0, 1.0],
                     "retained_count_max": 1, "rf": 3}  # fmt: skip
    (row,), _ = job.advise([floor], 1.1, None)
    assert row["suggested_max_retained_messages"] == 440  # limit 400 x 1.1
    assert job._round_up(440.5, 8) == 448 and job._round_up(0.2, 8) == 8


def test_advice_gives_gateways_without_a_board_no_row_and_no_patch() -> None:
    from edgebroker_tools.fleet import job

    rows, patches = job.advise([_stats(8, 24) | {"board": None}, _stats(8, 24)], 1.25, None)
    assert [r["board"] for r in rows] == ["esp32"] and list(patches) == ["esp32"]


# ----------------------------------------------------------------- report
def _warehouse(root: Path, health: list[dict[str, Any]]) -> Path:
    """A committed warehouse written with pyarrow (the report reads nothing else)."""
    from edgebroker_tools.fleet import report

    types: dict[str, pa.DataType] = {
        "gateway_id": pa.string(), "board": pa.string(), "collected_at": pa.timestamp("us", "UTC"),
        "is_latest": pa.bool_(), "refusals": pa.map_(pa.string(), pa.int64()),
        "near_limit": pa.bool_(), "low_heap": pa.bool_(),
        **{c: pa.float64() for c in ("retained_util", "bytes_util", "payload_util",
                                     "heap_util", "clients_util")},
    }  # fmt: skip
    schema = pa.schema([(c, types.get(c, pa.int64())) for c in report.HEALTH_READ])
    tables = {
        "gateway_health": pa.Table.from_pylist(health, schema=schema),
        "fleet_state": pa.Table.from_pylist(
            [
                {
                    "gateway_id": r["gateway_id"],
                    "board": r.get("board"),
                    "topic": "t",
                    "stale_reason": None,
                }
                for r in health
            ],
            schema=pa.schema(
                [
                    ("gateway_id", pa.string()),
                    ("board", pa.string()),
                    ("topic", pa.string()),
                    ("stale_reason", pa.string()),
                ]
            ),
        ),
        "topic_history": pa.table({"segment": pa.array([1] * len(health), pa.int64())}),
        "collect_status": pa.table(
            {"gateway_id": pa.array([], pa.string()), "status": pa.array([], pa.string())}
        ),
        "limits_advice": pa.table(
            {"board": pa.array([], pa.string()), "status": pa.array([], pa.string())}
        ),
    }
    for name, table in tables.items():
        (root / "builds" / "b1" / name).mkdir(parents=True)
        pq.write_table(table, root / "builds" / "b1" / name / "part-0.parquet")
    (root / "_commits").mkdir()
    record = {"seq": 1, "build_id": "b1", "patches": "builds/b1/patches",
              "tables": {n: f"builds/b1/{n}" for n in tables}, "build": {}}  # fmt: skip
    (root / "_commits" / "00000000000000000001.json").write_text(json.dumps(record))
    return root


def test_report_shows_a_measurement_nobody_sent_as_no_data_and_a_missing_board(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gw-1 sent no $SYS rows (no heap, no clients): "-", not "0%"; gw-2's
    # snapshot named no board: "(unknown)", and the report still renders
    from edgebroker_tools.fleet import report

    at = datetime(2025, 6, 1, tzinfo=UTC)
    wh = _warehouse(tmp_path / "wh", [
        {"gateway_id": "gw-1", "board": "esp32", "collected_at": at, "is_latest": True,
         "retained_util": 0.05, "payload_util": 0.02, "near_limit": False, "low_heap": False},
        {"gateway_id": "gw-2", "board": None, "collected_at": at, "is_latest": True,
         "retained_util": 0.5, "near_limit": False, "low_heap": False},
    ])  # fmt: skip
    data = report.load(str(wh))
    assert [u.board for u in data.boards] == ["(unknown)", "esp32"]
    esp = next(u for u in data.boards if u.board == "esp32")
    assert esp.quantiles["heap_util"] == (None, None, None)
    assert esp.quantiles["retained_util"] == (0.05, 0.05, 0.05)
    assert cli_main(["fleet", "report", str(wh)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("esp32") and "%" in x)
    assert line.split()[2:5] == ["-", "/", "-"]  # heap: no data
    assert "0% / 0% / 0%" not in out and "(unknown)" in out
    page = (wh / "report.html").read_text()
    assert "0% / 0% / 0%" not in page and "no data" in page


# ------------------------------------------------------ options out of range
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["build", "--stale-after", "inf"], "argument --stale-after: inf: expected 0 < hours <= "),
        (["build", "--stale-after", "1e20"], "argument --stale-after: 1e+20: expected 0 < hours"),
        (["synth", "--interval", "inf"], "argument --interval: inf: expected 0 < seconds <= "),
        (["synth", "--interval", "1e20"], "argument --interval: 1e+20: expected 0 < seconds"),
        (["synth", "--seed", "-1"], "argument --seed: -1: expected an integer >= 0"),
        (["collect", "--timeout", "inf"], "argument --timeout: inf: expected 0 < seconds <= "),
    ],
)
def test_options_out_of_range_are_refused_in_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    where = {
        "build": ["--snapshots", str(tmp_path), "--out", str(tmp_path / "wh")],
        "synth": ["--gateways", "1", "--topics", "1", "--snapshots", "2",
                  "--out", str(tmp_path / "snaps")],
        "collect": ["--inventory", str(tmp_path / "fleet.json"), "--out", str(tmp_path / "snaps")],
    }[args[0]]  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        cli_main(["fleet", args[0], *where, *args[1:]])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "wh").exists() and not (tmp_path / "snaps").exists()


def test_synth_refuses_collections_past_the_last_representable_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "snaps"
    args = ["fleet", "synth", "--gateways", "1", "--topics", "1", "--out", str(out)]
    assert cli_main([*args, "--snapshots", "2", "--start", "9999-12-31T23:00:00Z"]) == 2
    line = _one_error_line(capsys)
    assert "--start 9999-12-31T23:00:00Z" in line and "expected --start <= " in line
    assert "expected --start <= 9999-12-31T17:54:59Z" in line  # 6 h and the 5 min jitter
    assert not out.exists()  # refused before the first file


def test_build_refuses_an_out_that_is_a_file_before_starting_spark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgebroker_tools.fleet import job

    (tmp_path / "snaps").mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    for out in (afile, afile / "wh", afile.as_uri()):
        args = ["--snapshots", str(tmp_path / "snaps"), "--out", str(out)]
        assert cli_main(["fleet", "build", *args, "--no-progress"]) == 2
        line = _one_error_line(capsys)
        assert f"--out {out}: " in line and "not a directory" in line
        assert job.main([*args, "--no-progress"]) == 2  # the spark-submit entry
        assert f"fleet-job: error: --out {out}: " in capsys.readouterr().err
    assert afile.read_text() == "x\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_build_refuses_an_out_it_cannot_write_before_starting_spark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not even root can make a directory in /proc (a chmod 0500 directory
    would not stop root, which the tests run as): was a started Spark and a
    traceback of hundreds of lines, exit 1."""
    from edgebroker_tools.fleet import job, spark

    def no_spark(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Spark was started for an --out that cannot be written")

    monkeypatch.setattr(spark, "session", no_spark)
    (tmp_path / "snaps").mkdir()
    for out, says in (("/proc/wh", "cannot create the directory in /proc: "),
                      ("/proc/wh/deeper/", "cannot create the directory in /proc: "),
                      ("file:///proc/wh", "cannot create the directory in /proc: "),
                      ("/proc", "cannot write in the directory: ")):  # fmt: skip
        args = ["--snapshots", str(tmp_path / "snaps"), "--out", out, "--no-progress"]
        assert cli_main(["fleet", "build", *args]) == 2
        line = _one_error_line(capsys)
        assert f"--out {out}: {says}" in line, line
        assert job.main(args) == 2  # the spark-submit entry
        err = capsys.readouterr().err
        assert err.startswith(f"fleet-job: error: --out {out}: {says}") and err.count("\n") == 1
    assert not Path("/proc/wh").exists()


def test_sys_rows_without_their_text_get_it_from_the_payload() -> None:
    # a writer that left payload_text null: the build reads the $SYS
    # statistics from the text, so the observations carry it
    rows = [
        {"gateway_id": "g", "collected_at": WHEN, "topic": None, "payload": None},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "a", "payload": b"1"},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "$SYS/broker/heap/free",
         "payload": b"2999", "payload_text": None},
        {"gateway_id": "g", "collected_at": WHEN, "topic": "$SYS/broker/x", "payload": b"\xff"},
    ]  # fmt: skip
    table = pa.Table.from_pylist(rows, schema=SNAPSHOT_SCHEMA)
    text = decode.sys_text_only(table).column("payload_text").to_pylist()
    assert text == [None, None, "2999", None]
