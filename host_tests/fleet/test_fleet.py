"""The fleet pipeline end to end: real brokers -> `fleet collect` -> `fleet build` -> tables.

Three host-build brokers (CPython, lib/edgebroker.py) on loopback ports with
different retained content and limits, plus one inventory entry that
nothing listens on. Round 1 is collected and built; then values change
(an update, a delete, new topics) and round 2 is collected and merged in.
The tables must hold exactly the expected rows; a rebuild changes nothing;
a fresh build of the same snapshots gives the same tables as the two
incremental builds; bad input files are reported and skipped; the job runs
under spark-submit with two executor JVMs (local-cluster) with the same
result.

One SparkSession (local[2], bound to 127.0.0.1, Python workers on this
interpreter) serves the whole module; the spark-submit test starts its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from edgebroker_tools import runner
from edgebroker_tools.cli import main as cli_main
from edgebroker_tools.fleet import job
from edgebroker_tools.fleet import spark as fleet_spark
from edgebroker_tools.fleet.job_args import Options
from edgebroker_tools.fleet.schema import WAREHOUSE_FORMAT
from mqtt_helpers import free_port
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "host_tests" / "data"
BIN = Path(sys.executable).parent
TABLE_NAMES = ("fleet_state", "topic_history", "gateway_health", "limits_advice", "collect_status")

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The suite's one local SparkSession."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session, owned = fleet_spark.session("local[2]", driver_memory="2g", shuffle_partitions=4)
    yield session
    if owned:
        session.stop()


class Broker:
    def __init__(self, name: str, profile: dict[str, Any], tmp: Path) -> None:
        self.name = name
        self.port = free_port()
        self.profile_path = tmp / f"{name}.json"
        self.profile_path.write_text(json.dumps(profile))
        data = tmp / f"{name}-data"
        data.mkdir()
        cmd = runner.broker_command(board=self.profile_path, port=self.port, data_dir=data)
        self.log = (tmp / f"{name}.log").open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, cwd=REPO
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith("edgebroker listening on"), line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


def _profile(board: str, **overrides: Any) -> dict[str, Any]:
    profile: dict[str, Any] = json.loads((REPO / "boards" / f"{board}.json").read_text())
    profile.update(sys_interval=1, **overrides)
    return profile


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fleet")
    brokers = {
        # esp32 with tiny limits: the 5th topic and a 100-byte payload are refused
        "gw-esp": Broker(
            "gw-esp",
            _profile(
                "esp32",
                max_retained_messages=4,
                max_payload_size=64,
                store_budget_bytes=4096,
                max_clients=4,
            ),
            tmp,
        ),
        "gw-pico": Broker("gw-pico", _profile("rp2040_picow", max_clients=3), tmp),
        "gw-host": Broker(
            "gw-host", _profile("host", allow_anonymous=False, users={"fleet": "s3cret"}), tmp
        ),
    }
    (tmp / "secrets.json").write_text(
        json.dumps({"lab": {"username": "fleet", "password": "s3cret"}})
    )
    inventory = {
        "secrets": "secrets.json",
        "gateways": [
            *(
                {"id": name, "host": "127.0.0.1", "port": b.port, "board": b.profile_path.name}
                | ({"credentials": "lab"} if name == "gw-host" else {})
                for name, b in brokers.items()
            ),
            {"id": "gw-dead", "host": "127.0.0.1", "port": free_port(), "board": "esp32"},
        ],
    }
    (tmp / "fleet.json").write_text(json.dumps(inventory))
    try:
        yield {"tmp": tmp, "brokers": brokers, "inventory": tmp / "fleet.json"}
    finally:
        for b in brokers.values():
            b.stop()


def publish(broker: Broker, messages: list[tuple[str, bytes, int, dict[str, Any]]]) -> None:
    """Retained PUBLISHes over MQTT 5 (paho), each acknowledged before the next."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    if broker.name == "gw-host":
        client.username_pw_set("fleet", "s3cret")
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    try:
        for topic, payload, qos, props in messages:
            p = Properties(PacketTypes.PUBLISH)
            for key, value in props.items():
                setattr(p, key, value)
            info = client.publish(topic, payload, qos=qos, retain=True, properties=p)
            if qos:
                info.wait_for_publish(10)
        time.sleep(0.3)  # QoS 0 ones out of the socket
    finally:
        client.disconnect()
        client.loop_stop()


def collect(fleet: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    before = len(_log(out))
    code = cli_main(
        ["fleet", "collect", "--inventory", str(fleet["inventory"]), "--out", str(out),
         "--quiet", "0.5", "--timeout", "10", "--retries", "1", "--no-progress"]
    )  # fmt: skip
    assert code == 1  # gw-dead failed, the others did not stop because of it
    return _log(out)[before:]


def _log(out: Path) -> list[dict[str, Any]]:
    path = out / "collect_log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def commit(warehouse: Path) -> dict[str, Any]:
    """The warehouse's latest commit record (what a reader resolves)."""
    names = sorted(p.name for p in (warehouse / "_commits").glob("[0-9]*.json"))
    return json.loads((warehouse / "_commits" / names[-1]).read_text())


def rows(warehouse: Path, name: str) -> list[dict[str, Any]]:
    table = pq.read_table(warehouse / commit(warehouse)["tables"][name])
    out = table.to_pylist()
    return sorted(out, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def tables(warehouse: Path) -> dict[str, list[dict[str, Any]]]:
    return {name: rows(warehouse, name) for name in TABLE_NAMES}


UNIT_C = [("unit", "C")]
ROUND1 = {
    "gw-esp": [
        ("site/esp/temp", b"21.5", 1, {"ContentType": "text/plain", "UserProperty": UNIT_C}),
        ("site/esp/hum", b"40", 1, {}),
        ("site/esp/status", b"online", 1, {}),
        ("site/esp/cfg", b'{"mode":"eco"}', 2, {"PayloadFormatIndicator": 1}),
        ("site/esp/extra", b"x", 1, {}),  # 5th topic: refused (retained_full)
        ("site/esp/big", b"B" * 100, 1, {}),  # over max_payload_size: refused
    ],
    "gw-pico": [
        ("pico/a/temp", b"19.0", 1, {}),
        ("pico/a/blob", b"\x00\x01\xfe\xff", 1, {}),
        ("pico/a/alarm", b"door open", 1, {"MessageExpiryInterval": 3600}),
    ],
    "gw-host": [("h/x", b"1", 0, {}), ("h/y", b"2", 1, {})],
}  # fmt: skip
ROUND2 = {
    "gw-esp": [
        ("site/esp/temp", b"22.0", 1, {"ContentType": "text/plain", "UserProperty": UNIT_C}),
        ("site/esp/status", b"", 1, {}),  # delete
        ("site/esp/door", b"closed", 1, {}),
    ],
    "gw-host": [("h/x", b"10", 1, {}), ("h/z", b"3", 1, {})],
}  # fmt: skip


def opts(snapshots: Path | str, warehouse: Path | str, **kw: Any) -> Options:
    """Build options; each board of the test fleet has one gateway, so the advice's
    minimum sample is one gateway and one collection."""
    kw.setdefault("min_gateways", 1)
    kw.setdefault("min_collections", 1)
    return Options(str(snapshots), str(warehouse), **kw)


@pytest.fixture(scope="module")
def round1(fleet: dict[str, Any], spark: Any) -> dict[str, Any]:
    for name, msgs in ROUND1.items():
        publish(fleet["brokers"][name], msgs)
    time.sleep(1.2)  # $SYS republished (sys_interval 1) with the refusals in it
    snaps = fleet["tmp"] / "snapshots"
    log = collect(fleet, snaps)
    wh = fleet["tmp"] / "warehouse"
    result = job.build(spark, opts(snaps, wh))
    return {"log": log, "snapshots": snaps, "warehouse": wh, "result": result}


@pytest.fixture(scope="module")
def round2(fleet: dict[str, Any], round1: dict[str, Any], spark: Any) -> dict[str, Any]:
    for name, msgs in ROUND2.items():
        publish(fleet["brokers"][name], msgs)
    time.sleep(1.2)
    log = collect(fleet, round1["snapshots"])
    result = job.build(spark, opts(round1["snapshots"], round1["warehouse"]))
    return {**round1, "log2": log, "result2": result, "tables": tables(round1["warehouse"])}


def _times(log: list[dict[str, Any]]) -> dict[str, datetime]:
    return {
        e["gateway_id"]: datetime.fromisoformat(e["collected_at"])
        for e in log
        if e["status"] == "ok"
    }


# -------------------------------------------------------------------- tests
def test_collect_writes_one_snapshot_per_gateway_and_logs_the_unreachable(
    round1: dict[str, Any],
) -> None:
    log = {e["gateway_id"]: e for e in round1["log"]}
    assert set(log) == {"gw-esp", "gw-pico", "gw-host", "gw-dead"}
    dead = log["gw-dead"]
    assert dead["status"] == "failed" and dead["attempts"] == 2 and "connect" in dead["error"]
    assert {e["retained"] for n, e in log.items() if n != "gw-dead"} == {4, 3, 2}
    for name in ("gw-esp", "gw-pico", "gw-host"):
        path = round1["snapshots"] / log[name]["file"]
        assert path.parent.name.startswith("date=")
        table = pq.read_table(path)
        topics = [t for t in table.column("topic").to_pylist() if t]
        assert any(t.startswith("$SYS/broker/") for t in topics)  # the statistics came too
        assert set(table.column("gateway_id").to_pylist()) == {name}
    esp = pq.read_table(round1["snapshots"] / log["gw-esp"]["file"]).to_pylist()
    temp = next(r for r in esp if r["topic"] == "site/esp/temp")
    assert temp["payload"] == b"21.5" and temp["payload_text"] == "21.5" and temp["qos"] == 1
    assert temp["content_type"] == "text/plain"
    assert temp["user_properties"] == [{"key": "unit", "value": "C"}]
    assert temp["limit_max_retained_messages"] == 4 and temp["board"] == "esp32"
    pico = pq.read_table(round1["snapshots"] / log["gw-pico"]["file"]).to_pylist()
    blob = next(r for r in pico if r["topic"] == "pico/a/blob")
    assert blob["payload_text"] is None  # not UTF-8
    alarm = next(r for r in pico if r["topic"] == "pico/a/alarm")
    assert 3590 <= alarm["message_expiry"] <= 3600


def test_first_build_holds_exactly_the_retained_state(round1: dict[str, Any]) -> None:
    wh = round1["warehouse"]
    state = {(r["gateway_id"], r["topic"]): r for r in rows(wh, "fleet_state")}
    expected = {
        (gw, topic): payload
        for gw, msgs in ROUND1.items()
        for topic, payload, _q, _p in msgs
        if topic not in ("site/esp/extra", "site/esp/big")
    }
    assert {k: r["payload"] for k, r in state.items()} == expected
    assert all(r["change_count"] == 0 and r["present"] and not r["stale"] for r in state.values())
    assert state[("gw-esp", "site/esp/temp")]["value"] == 21.5
    assert state[("gw-pico", "pico/a/alarm")]["expires_at"] is not None
    assert state[("gw-esp", "site/esp/status")]["value"] is None
    assert len(rows(wh, "topic_history")) == len(expected)
    health = {r["gateway_id"]: r for r in rows(wh, "gateway_health")}
    assert set(health) == {"gw-esp", "gw-pico", "gw-host"}
    esp = health["gw-esp"]
    assert esp["retained_count"] == 4 and esp["sys_retained_count"] == 4
    assert esp["limit_max_retained_messages"] == 4 and esp["retained_util"] == 1.0
    assert esp["near_retained_limit"] and esp["near_limit"]
    refusals = dict(esp["refusals"])  # a Parquet map reads as (key, value) pairs
    assert refusals["retained_full"] >= 1 and refusals["retained_too_large"] >= 1
    assert esp["retained_bytes"] == esp["sys_retained_bytes"]  # the broker's own measure
    assert not health["gw-host"]["near_limit"] and health["gw-host"]["refusals_total"] == 0
    assert round1["result"].skipped == []


def test_second_run_updates_state_and_history(round2: dict[str, Any]) -> None:
    t = round2["tables"]
    t1, t2 = _times(round2["log"]), _times(round2["log2"])
    state = {(r["gateway_id"], r["topic"]): r for r in t["fleet_state"]}
    assert {k: r["payload"] for k, r in state.items()} == {
        ("gw-esp", "site/esp/temp"): b"22.0",
        ("gw-esp", "site/esp/hum"): b"40",
        ("gw-esp", "site/esp/status"): b"online",  # the last value it held
        ("gw-esp", "site/esp/cfg"): b'{"mode":"eco"}',
        ("gw-esp", "site/esp/door"): b"closed",
        ("gw-pico", "pico/a/temp"): b"19.0",
        ("gw-pico", "pico/a/blob"): b"\x00\x01\xfe\xff",
        ("gw-pico", "pico/a/alarm"): b"door open",
        ("gw-host", "h/x"): b"10",
        ("gw-host", "h/y"): b"2",
        ("gw-host", "h/z"): b"3",
    }
    temp = state[("gw-esp", "site/esp/temp")]
    assert temp["change_count"] == 1 and temp["value"] == 22.0
    assert temp["first_seen"] == t1["gw-esp"] and temp["last_changed"] == t2["gw-esp"]
    status = state[("gw-esp", "site/esp/status")]
    assert status["stale"] and status["stale_reason"] == "gone" and not status["present"]
    fresh = [r for k, r in state.items() if k != ("gw-esp", "site/esp/status")]
    assert not any(r["stale"] for r in fresh)
    assert state[("gw-esp", "site/esp/door")]["first_seen"] == t2["gw-esp"]
    assert state[("gw-pico", "pico/a/temp")]["last_seen"] == t2["gw-pico"]
    history = {
        (r["gateway_id"], r["topic"], r["segment"]): (
            r["payload"],
            r["valid_from"],
            r["valid_to"],
            r["ended_by"],
            r["observations"],
        )
        for r in t["topic_history"]
    }
    e1, e2, p1, h1, h2 = (t1["gw-esp"], t2["gw-esp"], t1["gw-pico"], t1["gw-host"],
                          t2["gw-host"])  # fmt: skip
    assert history == {
        ("gw-esp", "site/esp/temp", 1): (b"21.5", e1, e2, "changed", 1),
        ("gw-esp", "site/esp/temp", 2): (b"22.0", e2, None, None, 1),
        ("gw-esp", "site/esp/hum", 1): (b"40", e1, None, None, 2),
        ("gw-esp", "site/esp/status", 1): (b"online", e1, e2, "gone", 1),
        ("gw-esp", "site/esp/cfg", 1): (b'{"mode":"eco"}', e1, None, None, 2),
        ("gw-esp", "site/esp/door", 1): (b"closed", e2, None, None, 1),
        ("gw-pico", "pico/a/temp", 1): (b"19.0", p1, None, None, 2),
        ("gw-pico", "pico/a/blob", 1): (b"\x00\x01\xfe\xff", p1, None, None, 2),
        ("gw-pico", "pico/a/alarm", 1): (b"door open", p1, None, None, 2),
        ("gw-host", "h/x", 1): (b"1", h1, h2, "changed", 1),
        ("gw-host", "h/x", 2): (b"10", h2, None, None, 1),
        ("gw-host", "h/y", 1): (b"2", h1, None, None, 2),
        ("gw-host", "h/z", 1): (b"3", h2, None, None, 1),
    }
    health = t["gateway_health"]
    assert len(health) == 6
    assert sum(r["is_latest"] for r in health) == 3
    result = round2["result2"]
    assert result.new_files == 3 and len(result.ingested) == 3  # only round 2's files read


def test_rebuild_is_idempotent_and_equals_a_fresh_build(
    round2: dict[str, Any], spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wh = round2["warehouse"]
    again = job.build(spark, opts(round2["snapshots"], wh))
    assert again.new_files == 0
    assert tables(wh) == round2["tables"]
    # one build over both rounds == two builds; a file:// URI == a plain path
    fresh = tmp_path / "fresh"
    job.build(spark, opts(round2["snapshots"].as_uri(), fresh.as_uri()))
    assert tables(fresh) == round2["tables"]
    # the files decoded on the executors (a large input's way) == on the
    # driver (a tiny input's: no Python worker), compiled == interpreted
    with monkeypatch.context() as m:
        m.setattr(job, "TINY_INPUT_BYTES", 0)
        wide = job.build(spark, opts(round2["snapshots"], tmp_path / "executors"))
    assert tables(tmp_path / "executors") == round2["tables"]
    assert (
        wide.ingested == job.build(spark, opts(round2["snapshots"], tmp_path / "driver")).ingested
    )
    # a copied snapshot (same collection under another name) is counted once
    src = next((round2["snapshots"] / "retained").rglob("gw-host__*.parquet"))
    shutil.copy(src, src.with_name("copy-of-" + src.name))
    dup = job.build(spark, opts(round2["snapshots"], wh))
    assert dup.new_files == 1
    assert tables(wh) == round2["tables"]
    src.with_name("copy-of-" + src.name).unlink()
    # a warehouse of an older layout (a commit record without "format": its
    # batches lack the collection totals) is not added to: every snapshot is
    # ingested again, and the tables are a fresh build's
    last = sorted((wh / "_commits").glob("[0-9]*.json"))[-1]
    record = json.loads(last.read_text())
    assert record.pop("format") == WAREHOUSE_FORMAT
    last.write_text(json.dumps(record))
    last.with_name(f".{last.name}.crc").unlink(missing_ok=True)  # Hadoop's checksum of the old text
    upgraded = job.build(spark, opts(round2["snapshots"], wh))
    assert upgraded.new_files == upgraded.inputs and upgraded.inputs > 0
    assert tables(wh) == round2["tables"]


def _store(snaps: Path, source: Path, gateway: str, when: str) -> Path:
    folder = snaps / "stores" / "date=2025-06-01"
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / f"{gateway}__{when}.ebrs"
    shutil.copy(source, dest)
    meta = {"gateway_id": gateway, "board": "esp32", "collected_at": "2025-06-01T10:00:00Z",
            "source": "store", "run_id": "pulled",
            "limits": {"max_retained_messages": 256}}  # fmt: skip
    dest.with_name(dest.name + ".json").write_text(json.dumps(meta))
    return dest


def test_bad_files_are_reported_and_skipped_nothing_else_lost(
    round2: dict[str, Any], spark: Any, tmp_path: Path
) -> None:
    snaps = tmp_path / "snaps"
    shutil.copytree(round2["snapshots"], snaps)
    day = next((snaps / "retained").iterdir())
    (day / "garbage.parquet").write_bytes(b"PAR1 this is not parquet at all")
    good = next(day.glob("gw-pico__*.parquet"))
    (day / "truncated.parquet").write_bytes(good.read_bytes()[:-20])
    _store(snaps, DATA / "good.ebrs", "gw-store", "20250601T100000000000Z")
    _store(snaps, DATA / "bad_magic.ebrs", "gw-bad", "20250601T100000000000Z")
    _store(snaps, DATA / "corrupt_record.ebrs", "gw-corrupt", "20250601T100000000000Z")
    orphan = snaps / "stores" / "date=2025-06-01" / "gw-orphan__x.ebrs"
    shutil.copy(DATA / "good.ebrs", orphan)  # no .json beside it
    wh = tmp_path / "wh"
    result = job.build(spark, opts(snaps, wh))
    skipped = {Path(s["path"]).name: s["error"] for s in result.skipped}
    assert set(skipped) == {
        "garbage.parquet", "truncated.parquet", "gw-bad__20250601T100000000000Z.ebrs",
        "gw-corrupt__20250601T100000000000Z.ebrs", "gw-orphan__x.ebrs",
    }  # fmt: skip
    assert "bad_magic" in skipped["gw-bad__20250601T100000000000Z.ebrs"]
    assert "corrupt record" in skipped["gw-corrupt__20250601T100000000000Z.ebrs"]
    state = rows(wh, "fleet_state")
    store = {r["topic"]: r for r in state if r["gateway_id"] == "gw-store"}
    # good.ebrs as the broker would load it (alerts/door has expired by then)
    assert {t: r["payload"] for t, r in store.items()} == {
        "sensors/t1": b"22.0", "config/mode": b"auto", "$app/version": b"1.2",
        "caf\u00e9/\u6c34": b"\x00\x01\xff",
    }  # fmt: skip
    assert store["config/mode"]["content_type"] == "text/plain"
    assert store["sensors/t1"]["stale_reason"] == "gateway_silent"  # pulled long before as_of
    others = [r for r in state if r["gateway_id"] != "gw-store"]
    assert others == round2["tables"]["fleet_state"]
    # the damaged store, taken as the broker would keep it
    wh2 = tmp_path / "wh2"
    kept = job.build(spark, opts(snaps, wh2, keep_damaged_stores=True))
    assert "gw-corrupt__20250601T100000000000Z.ebrs" not in {
        Path(s["path"]).name for s in kept.skipped
    }
    assert any(r["gateway_id"] == "gw-corrupt" for r in rows(wh2, "fleet_state"))


def test_report_and_advice_patches(
    round2: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    wh = round2["warehouse"]
    assert cli_main(["fleet", "report", str(wh)]) == 0
    out = capsys.readouterr().out
    assert "esp32" in out and "stale topics" in out and "limits advice" in out
    assert "gw-dead" in out  # could not be collected
    page = (wh / "report.html").read_text()
    assert page.count("<svg") >= 6
    assert "<script" not in page and "src=" not in page and "https://" not in page
    advice = {r["board"]: r for r in rows(wh, "limits_advice")}
    assert set(advice) == {"esp32", "rp2040_picow", "host"}
    esp = advice["esp32"]
    # gw-esp refused at its limit of 4: the advice raises it with the headroom
    assert esp["suggested_max_retained_messages"] >= 8
    patch = wh / commit(wh)["patches"] / Path(esp["patch_file"]).name
    assert (
        json.loads(patch.read_text())["max_retained_messages"]
        == esp["suggested_max_retained_messages"]
    )
    code = cli_main(["config", "apply", "esp32", str(patch)])
    capsys.readouterr()
    assert (code == 0) == (esp["check_status"] == "ok")


def test_report_refuses_an_html_path_in_a_missing_directory_in_one_line(
    round2: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "nonexistent" / "dir" / "r.html"
    code = cli_main(["fleet", "report", str(round2["warehouse"]), "--html", str(target)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip().splitlines() == [
        f"edgebroker fleet: error: --html {target}: no such directory {target.parent} "
        "(expected a file in an existing directory)"
    ]
    assert captured.out == ""  # refused before the summary is printed


def test_job_runs_under_spark_submit_with_two_executor_jvms(
    round2: dict[str, Any], tmp_path: Path
) -> None:
    """local-cluster[2,1,1024]: two executor JVMs, so nothing may rest on driver state."""
    submit = BIN / "spark-submit"
    wh = tmp_path / "wh"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")  # fmt: skip
    cmd = [
        str(submit), "--master", "local-cluster[2,1,1024]",
        "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
        "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.session.timeZone=UTC",
        "--conf", "spark.sql.shuffle.partitions=4",
        str(REPO / "tools" / "edgebroker_tools" / "fleet" / "job.py"),
        "--snapshots", str(round2["snapshots"]), "--out", wh.as_uri(),
        "--min-gateways", "1", "--min-collections", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "ingested" in proc.stdout
    assert tables(wh) == round2["tables"]


# ------------------------------------------------ warehouse on Hadoop filesystems
def test_warehouse_on_a_hadoop_filesystem_that_is_not_the_local_disk(
    round2: dict[str, Any], spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Snapshots and warehouse behind a viewfs:// mount table (Spark's own Hadoop client):
    any os/pathlib/open shortcut on a location would miss it (or write ./viewfs:/...)."""
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "mounted"
    target.mkdir()
    mount = f"fleet{os.getpid()}"
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    conf.set(f"fs.viewfs.mounttable.{mount}.link./warehouse", target.as_uri())
    conf.set(f"fs.viewfs.mounttable.{mount}.link./snapshots", round2["snapshots"].as_uri())
    result = job.build(spark, opts(f"viewfs://{mount}/snapshots", f"viewfs://{mount}/warehouse"))
    assert result.new_files == len(result.ingested) > 0
    assert tables(target) == round2["tables"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mounted"]  # nothing beside it


# ------------------------------------------------------------------ faults
class Killed(BaseException):
    """What os._exit does in the in-process fault runs: nothing after it runs."""


def _leftovers(wh: Path) -> dict[str, list[str]]:
    c = commit(wh)
    named = {Path(t).parent.name for t in c["tables"].values()}
    return {
        "builds": sorted(p.name for p in (wh / "builds").iterdir() if p.name not in named),
        "batches": sorted(
            p.name for p in (wh / "_observations").iterdir() if p.name not in c["batches"]
        ),
        "tmp": sorted(p.name for p in (wh / "_commits").iterdir() if p.name.endswith(".tmp")),
    }


def test_a_build_killed_at_each_step_leaves_the_previous_tables_and_the_next_repairs(
    round2: dict[str, Any], spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snaps = tmp_path / "snaps"
    shutil.copytree(round2["snapshots"], snaps)
    wh = tmp_path / "wh"
    shutil.copytree(round2["warehouse"], wh)
    before = tables(wh)
    _store(snaps, DATA / "good.ebrs", "gw-store", "20250601T100000000000Z")  # new input
    # 1. a real process, ended hard (os._exit) by the hook after topic_history
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    env[job.FAIL_ENV] = "topic_history"
    cmd = [sys.executable, "-m", "edgebroker_tools.fleet.job", "--master", "local[1]",
           "--snapshots", str(snaps), "--out", str(wh), "--min-gateways", "1",
           "--min-collections", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert proc.returncode == job.FAIL_EXIT, proc.stderr[-4000:]
    assert tables(wh) == before
    assert _leftovers(wh)["builds"] and _leftovers(wh)["batches"]  # the dead build's

    # 2. in this process, at every step: os._exit raises, so nothing after the step runs
    def die(code: int) -> None:
        raise Killed(code)

    monkeypatch.setattr(job.os, "_exit", die)
    for step in job.STEPS:
        monkeypatch.setenv(job.FAIL_ENV, step)
        with pytest.raises(Killed):
            job.build(spark, opts(snaps, wh))
        if step != "swap":  # the commit record is published at "swap"
            assert tables(wh) == before, step
    monkeypatch.delenv(job.FAIL_ENV)
    committed = tables(wh)
    assert committed != before and any(
        r["gateway_id"] == "gw-store" for r in committed["fleet_state"]
    )
    # 3. the next build repairs: the tables a clean build gives, no leftovers
    job.build(spark, opts(snaps, wh))
    clean = tmp_path / "clean"
    job.build(spark, opts(snaps, clean))
    assert tables(wh) == tables(clean) == committed
    left = _leftovers(wh)
    assert len(left["builds"]) <= 1  # the previous commit's tables, kept for readers
    assert not left["batches"] and not left["tmp"]


def test_snapshots_without_a_collect_log_give_an_empty_collect_status_of_the_same_columns(
    round2: dict[str, Any], spark: Any, tmp_path: Path
) -> None:
    # synth (or copied) snapshots have no collect_log.jsonl: the table is
    # still written, with no row and the columns and types of a build that
    # had a log (the job writes it from an empty local relation)
    from edgebroker_tools.fleet import synth

    snaps = tmp_path / "snaps"
    synth.generate(snaps, 4, 3, 1, seed=5, per_file=4)
    assert not (snaps / "collect_log.jsonl").exists()
    wh = tmp_path / "wh"
    job.build(spark, opts(snaps, wh))
    empty = pq.read_table(wh / commit(wh)["tables"]["collect_status"])
    logged_wh = round2["warehouse"]
    logged = pq.read_table(logged_wh / commit(logged_wh)["tables"]["collect_status"])
    assert logged.num_rows > 0 and empty.num_rows == 0
    assert empty.schema.remove_metadata() == logged.schema.remove_metadata()
    assert tuple(empty.column_names) == job.COLLECT_STATUS_COLUMNS


def _snapshot(path: Path, rows: list[dict[str, Any]], **facts: Any) -> None:
    """A snapshot file of (topic, payload, payload_text) rows of one collection."""
    from edgebroker_tools.fleet.schema import SNAPSHOT_SCHEMA

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([facts | r for r in rows], schema=SNAPSHOT_SCHEMA)
    pq.write_table(table, path)


def test_a_collection_split_copied_or_re_ingested_counts_once_and_odd_gateways_render(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One collection in several files of one build: identical copies count once
    (their refusals too), parts that share no topic are merged, versions that
    share a topic leave the largest file name's; a file re-ingested later
    replaces its earlier copy. A gateway without a board and a measurement no
    gateway sent do not break (or flatter) the report."""
    day = tmp_path / "snaps" / "retained" / "date=2025-06-01"
    at = datetime(2025, 6, 1, tzinfo=UTC)
    facts = {"collected_at": at, "source": "mqtt", "run_id": "r1", "board": "esp32",
             "limit_max_retained_messages": 20, "limit_max_payload_size": 64,
             "limit_store_budget_bytes": 1000, "limit_heap_reserve": 1500,
             "limit_max_clients": 4}  # fmt: skip

    def row(topic: str | None, payload: bytes | None, text: bool = True) -> dict[str, Any]:
        shown = payload.decode() if payload is not None and text else None
        return {"topic": topic, "payload": payload, "payload_text": shown}

    copied = day / "gw-copy__a.parquet"
    _snapshot(copied, [row(None, None), row("c/1", b"1"), row("$SYS/broker/heap/free", b"50000"),
                       row("$SYS/broker/refusals/retained_full", b"3")],
              gateway_id="gw-copy", **facts)  # fmt: skip
    shutil.copy(copied, day / "gw-copy__b.parquet")  # the same collection under a second name
    # the retained rows in one file, the $SYS rows (without their text) in another
    _snapshot(day / "gw-split-1.parquet", [row(None, None), row("s/x", b"1"), row("s/y", b"2")],
              gateway_id="gw-split", **facts)  # fmt: skip
    _snapshot(day / "gw-split-2.parquet", [row("$SYS/broker/heap/free", b"2999", text=False),
                                           row("$SYS/broker/retained/count", b"2", text=False)],
              gateway_id="gw-split", **facts)  # fmt: skip
    # two versions of one collection (they share topic v/a): the larger name's is kept whole
    pico = facts | {"board": "rp2040_picow"}  # sends no $SYS rows: no heap, no clients
    _snapshot(day / "gw-ver-1.parquet", [row("v/a", b"1"), row("v/b", b"2"), row("v/old", b"9")],
              gateway_id="gw-ver", **pico)  # fmt: skip
    _snapshot(day / "gw-ver-2.parquet", [row("v/a", b"1"), row("v/b", b"3")],
              gateway_id="gw-ver", **pico)  # fmt: skip
    # an older layout: the required columns only, so no board
    minimal = {
        "gateway_id": ["gw-nob"],
        "collected_at": pa.array([at], pa.timestamp("us", "UTC")),
        "topic": ["n/a"],
        "payload": [b"2"],
    }
    pq.write_table(pa.table(minimal), day / "gw-nob.parquet")
    wh = tmp_path / "wh"
    job.build(spark, opts(tmp_path / "snaps", wh))  # tiny: dup seen while gateway_health is written
    got = tables(wh)
    health = {r["gateway_id"]: r for r in got["gateway_health"]}
    assert sorted(r["gateway_id"] for r in got["gateway_health"]) == [
        "gw-copy",
        "gw-nob",
        "gw-split",
        "gw-ver",
    ]
    copy = health["gw-copy"]
    assert dict(copy["refusals"]) == {"retained_full": 3} and copy["refusals_total"] == 3
    assert copy["retained_count"] == 1 and copy["heap_free"] == 50000
    split = health["gw-split"]
    assert (split["retained_count"], split["heap_free"], split["sys_retained_count"]) == (
        2,
        2999,
        2,
    )
    assert split["low_heap"] and split["board"] == "esp32"
    assert health["gw-ver"]["retained_count"] == 2 and health["gw-nob"]["board"] is None
    state = {(r["gateway_id"], r["topic"]): r["payload"] for r in got["fleet_state"]}
    assert state == {("gw-copy", "c/1"): b"1", ("gw-split", "s/x"): b"1",
                     ("gw-split", "s/y"): b"2", ("gw-ver", "v/a"): b"1",
                     ("gw-ver", "v/b"): b"3", ("gw-nob", "n/a"): b"2"}  # fmt: skip
    assert len(got["topic_history"]) == len(state)
    assert {r["board"] for r in got["limits_advice"]} == {"esp32", "rp2040_picow"}
    # the report: the board-less gateway shown as such, no heap data is no data
    assert cli_main(["fleet", "report", str(wh)]) == 0
    out = capsys.readouterr().out
    assert "(unknown)" in out
    pico_line = next(x for x in out.split("utilisation")[-1].splitlines()
                     if x.strip().startswith("rp2040_picow"))  # fmt: skip
    assert pico_line.split()[2:5] == ["-", "/", "-"]  # heap: p50 / p90 / max
    assert "0% / 0% / 0%" not in (wh / "report.html").read_text()
    # the copy touched and ingested again by a later build: its latest copy counts
    os.utime(copied, (time.time() + 5, time.time() + 5))
    again = job.build(spark, opts(tmp_path / "snaps", wh))
    assert again.new_files == 1 and tables(wh) == got
    # a warehouse or snapshot location Hadoop refuses: one line (the CLI checks a
    # local --out before Spark starts; this is the build's own check)
    with pytest.raises(
        job.BuildError, match=r"^--out .*gw-nob.parquet: cannot be used as the ware"
    ):
        job.build(spark, opts(tmp_path / "snaps", day / "gw-nob.parquet"))
    with pytest.raises(job.BuildError, match=r"^--snapshots nope://x: cannot be read: "):
        job.build(spark, opts("nope://x", wh))
    # a large input's way (the duplicate check in a pass of its own, compiled code)
    with monkeypatch.context() as m:
        m.setattr(job, "TINY_INPUT_BYTES", 0)
        job.build(spark, opts(tmp_path / "snaps", tmp_path / "wide"))
    assert tables(tmp_path / "wide") == got


# ------------------------------------------------------------------ report
def test_report_renders_in_headless_chromium_and_names_the_gateways_to_act_on(
    spark: Any, tmp_path: Path
) -> None:
    from edgebroker_tools.fleet import synth

    snaps = tmp_path / "snaps"
    synth.generate(snaps, 60, 8, 2, seed=3, per_file=30)
    dead = {"run_id": "20250601T120000000000Z", "gateway_id": "gw-unreachable",
            "address": "10.0.0.9:1883", "board": "esp32", "status": "failed", "attempts": 3,
            "error": "connect: [Errno 111] Connection refused", "collected_at": None}  # fmt: skip
    (snaps / "collect_log.jsonl").write_text(json.dumps(dead) + "\n")
    wh = tmp_path / "wh"
    job.build(spark, opts(snaps, wh))
    latest = [r for r in rows(wh, "gateway_health") if r["is_latest"]]
    worst_heap = max(latest, key=lambda r: r["heap_util"] or 0.0)["gateway_id"]
    html = tmp_path / "report.html"
    assert cli_main(["fleet", "report", str(wh), "--html", str(html)]) == 0
    page = html.read_text()
    assert "<script" not in page and "src=" not in page and "https://" not in page
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is needed (make venv installs it as root)"
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0",
             f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    shot = tmp_path / "report.png"
    proc = subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1200,2400", html.as_uri()],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr
    assert shot.stat().st_size > 20_000  # a page with content, not a blank one
    dom = subprocess.run(
        [*flags, "--dump-dom", html.as_uri()], capture_output=True, text=True, timeout=90,
        check=False,
    )  # fmt: skip
    assert dom.returncode == 0
    assert "Uncaught" not in dom.stderr and "CONSOLE" not in dom.stderr
    for section in ("attention-table", "unreachable-table", "low-heap", "trends-table",
                    "advice-table"):  # fmt: skip
        assert f'id="{section}"' in dom.stdout, section
    first = dom.stdout.split('id="attention-table"', 1)[1].split("</table>", 1)[0]
    assert worst_heap in first  # the gateway with the least heap, in the first table
    unreachable = dom.stdout.split('id="unreachable-table"', 1)[1].split("</table>", 1)[0]
    assert "gw-unreachable" in unreachable and "Connection refused" in unreachable
