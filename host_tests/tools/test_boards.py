"""Board profiles: boards/*.json against boards/schema.json and the boards'
limits, through the real `edgebroker config` command.

- every committed profile passes `config check`, and sets every key;
- broken profiles fail (exit 1), each error naming its key and value and
  the allowed range; all errors are listed, not just the first;
- a profile that cannot fit the esp32 heap is refused;
- `config show` fills in the defaults, which are the broker's own
  (lib/edgeconf.py DEFAULTS) for every key the broker reads;
- `config apply` merges a patch and checks the result before writing;
- docs/board-reference.md is what `config reference` generates now.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgebroker_tools import profiles

REPO = Path(__file__).resolve().parents[2]
BOARDS = REPO / "boards"
EDGEBROKER = Path(sys.executable).parent / "edgebroker"
SCHEMA = json.loads((BOARDS / "schema.json").read_text())
PROPS = SCHEMA["properties"]
PROFILES = sorted(p for p in BOARDS.glob("*.json")
                  if p.name not in ("schema.json", "memory_costs.json", "secrets.json"))


def config(*args, check=None):
    r = subprocess.run([str(EDGEBROKER), "config", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    if check is not None:
        assert r.returncode == check, (r.returncode, r.stdout, r.stderr)
    return r


def write(tmp_path, name, profile):
    path = tmp_path / ("%s.json" % name)
    path.write_text(json.dumps(profile, indent=1))
    return path


def esp32():
    return json.loads((BOARDS / "esp32.json").read_text())


def broker_defaults():
    sys.path.insert(0, str(REPO / "lib"))
    try:
        import edgeconf
    finally:
        sys.path.pop(0)
    return edgeconf.DEFAULTS


# ----------------------------------------------------------------- schema
def test_schema_is_draft_2020_12_and_documents_every_key():
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["type"] == "object" and SCHEMA["additionalProperties"] is False
    for key, sub in PROPS.items():
        for field in ("type", "default", "description", "x-unit", "x-consequence", "x-group"):
            assert field in sub and sub[field] not in ("", None) or field == "default", (key, field)
        if sub["type"] in ("integer", "number"):
            assert "minimum" in sub and "maximum" in sub, key
        assert sub["x-group"] in SCHEMA["x-groups"], key


def test_schema_knows_every_key_the_broker_reads_with_its_default():
    """Every key of lib/edgeconf.py DEFAULTS is in the schema with the same
    default, so the tools never refuse a key the broker reads, nor show a
    default the broker does not use."""
    defaults = broker_defaults()
    missing = sorted(set(defaults) - set(PROPS))
    assert not missing, "keys the broker reads but the schema lacks: %s" % missing
    for key, value in defaults.items():
        assert PROPS[key]["default"] == value, (key, PROPS[key]["default"], value)


def test_schema_defaults_pass_the_schema(tmp_path):
    path = write(tmp_path, "defaults", {k: v["default"] for k, v in PROPS.items()})
    config("check", str(path), check=0)


# -------------------------------------------------------- committed boards
def test_every_board_profile_passes_config_check():
    names = {p.stem for p in PROFILES}
    assert {"esp32", "esp32s3", "rp2040_picow", "rp2350_pico2w", "host"} <= names
    r = config("check", "--all", "-v", check=0)
    for p in PROFILES:
        assert "%s (%s): ok" % (p, json.loads(p.read_text())["board"]) in r.stdout, r.stdout


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_board_profile_sets_every_key(path):
    """Committed profiles are explicit: every schema key is written out, in
    schema order (a reader sees each limit without looking up defaults)."""
    prof = json.loads(path.read_text())
    assert list(prof) == list(PROPS), path
    assert prof["users"] == {}, "no credentials in committed profiles"


def test_board_limits_respect_sockets():
    for p in PROFILES:
        prof = json.loads(p.read_text())
        assert prof["max_clients"] <= prof["sockets"] - 1 - prof["spare_sockets"], p
    assert json.loads((BOARDS / "rp2040_picow.json").read_text())["max_clients"] <= 3
    assert json.loads((BOARDS / "esp32.json").read_text())["max_clients"] <= 8


def test_memory_costs_file():
    costs = json.loads((BOARDS / "memory_costs.json").read_text())
    assert costs["pointer_bytes"] == 8
    c = costs["costs"]
    for key in ("broker_idle", "per_connection", "per_subscription", "per_offline_session",
                "per_queued_message", "per_inflight_message", "message_overhead"):
        assert isinstance(c[key], int) and c[key] > 0, key
    # $SYS is made on demand: no standing cost, never a negative one
    assert isinstance(c["sys_retained"], int) and c["sys_retained"] >= 0
    assert c["import_mpy"]["edgebroker"] > c["import_romfs"]["edgebroker"] > 0
    assert c["min_heap_import_py"]["edgebroker"] > c["min_heap_import_mpy"]["edgebroker"]
    assert c["retained"]["ram"]["per_message"] > c["retained"]["disc_only"]["per_message"]


# ------------------------------------------------------- broken profiles
BROKEN = [
    # (name, change, key, value text, range text)
    ("unknown_key", {"max_client": 4}, "max_client", "max_client = 4", "unknown key"),
    ("wrong_type", {"max_clients": "4"}, "max_clients", 'max_clients = "4"', "must be an integer"),
    ("bool_is_not_int", {"max_queued": True}, "max_queued", "max_queued = true",
     "must be an integer"),
    ("float_is_not_int", {"io_chunk": 1024.0}, "io_chunk", "io_chunk = 1024.0",
     "must be an integer"),
    ("out_of_range", {"maximum_qos": 3}, "maximum_qos", "maximum_qos = 3", "must be 0..2"),
    ("negative", {"max_sessions": -1}, "max_sessions", "max_sessions = -1", "must be 0..1000000"),
    ("bad_enum", {"storage_type": "flash"}, "storage_type", 'storage_type = "flash"',
     'must be one of "ram", "disc", "disc_only"'),
    ("clients_over_sockets", {"max_clients": 12}, "max_clients", "max_clients = 12",
     "must be <= 8 (sockets 10 - listener 1 - spare 1) on esp32"),
    ("store_over_fs", {"store_budget_bytes": 1048576}, "store_budget_bytes",
     "store_budget_bytes = 1048576", "must be <= fs_bytes 2097152"),
    ("store_unbounded", {"store_budget_bytes": 0}, "store_budget_bytes",
     "store_budget_bytes = 0", "must be > 0"),
    ("heap_over", {"max_subscriptions": 48}, "heap_bytes", "heap_bytes = 110000",
     "the worst-case heap is"),
    ("code_over", {"code_budget_bytes": 32768}, "code_budget_bytes",
     "code_budget_bytes = 32768", "must be >="),
    ("reserve_too_small", {"fs_reserve_bytes": 4096}, "fs_reserve_bytes",
     "fs_reserve_bytes = 4096", "must be >="),
    # was: ignored (the broker listens in plain text and never asks for a certificate)
    ("client_ca_without_cert", {"tls_client_ca": "/ca.pem"}, "tls_client_ca",
     'tls_client_ca = "/ca.pem"', "needs tls_cert (client certificates are checked only by "
     "a TLS listener); tls_cert is empty on esp32"),
    # was: ignored the same way
    ("key_without_cert", {"tls_key": "/key.pem"}, "tls_key",
     'tls_key = "/key.pem"', "needs tls_cert (the key of the TLS listener's certificate); "
     "tls_cert is empty on esp32"),
]


@pytest.mark.parametrize("name,change,key,value,allowed", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_profile_fails_naming_key_and_value(tmp_path, name, change, key, value, allowed):
    prof = esp32()
    prof.update(change)
    path = write(tmp_path, name, prof)
    r = config("check", str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.strip().startswith("error:")]
    assert errors, r.stderr
    hit = [e for e in errors if value in e and allowed in e]
    assert hit, "no error naming %r with %r in:\n%s" % (value, allowed, r.stderr)
    assert key in hit[0]


BRIDGE = {"name": "cloud", "host": "mqtt.example.com",
          "topics": [{"pattern": "sensors/#", "remote_prefix": "site1/gw1/"}],
          "queue_bytes": 65536, "latest_topics": 16}


def _bridged(**change):
    b = dict(BRIDGE)
    b.update(change)
    return b


BRIDGE_BROKEN = [
    ("port", [_bridged(port=0)], "bridges[0].port = 0", "must be 1..65535"),
    ("direction", [_bridged(topics=[{"pattern": "a/#", "direction": "sideways"}])],
     'bridges[0].topics[0].direction = "sideways"', 'must be one of "out", "in", "both"'),
    ("when_full", [_bridged(when_full="block")], 'bridges[0].when_full = "block"',
     "must be one of"),
    ("unknown", [_bridged(hots="x")], "bridges[0].hots", "unknown key"),
    ("no_host", [{"name": "x", "topics": [{"pattern": "#"}]}], "bridges[0].host", "required"),
    ("no_rules", [_bridged(topics=[])], "bridges[0].topics", "must be at least 1"),
    ("two_on_esp32", [BRIDGE, _bridged(name="other")], "bridges: 2 bridges", "at most 1"),
    ("same_name", [BRIDGE, BRIDGE], 'bridges[1].name = "cloud"', "used twice"),
    ("queue_over_fs", [_bridged(queue_bytes=1048576)], "bridges:", "must be <= fs_bytes"),
]


@pytest.mark.parametrize("name,bridges,value,allowed", BRIDGE_BROKEN,
                         ids=[b[0] for b in BRIDGE_BROKEN])
def test_bad_bridge_fails_naming_its_key(tmp_path, name, bridges, value, allowed):
    prof = esp32()
    prof["bridges"] = bridges
    r = config("check", str(write(tmp_path, name, prof)), check=1)
    errors = [line for line in r.stderr.splitlines() if line.strip().startswith("error:")]
    assert [e for e in errors if value in e and allowed in e], r.stderr


def _acl_profile(topic):
    prof = json.loads((BOARDS / "host.json").read_text())
    prof.update({"allow_anonymous": False, "users": {"a": "pw"},
                 "acl": [{"who": "all", "access": "readwrite", "topic": topic}]})
    return prof


def test_acl_topic_that_is_not_a_filter_is_refused_naming_its_key(tmp_path):
    """The broker's own acl check (lib/edgeauth.py check_acl) runs in config
    check: was ok (exit 0), while `run` refused the same profile at start."""
    r = config("check", str(write(tmp_path, "bad_acl", _acl_profile("home/#/x"))), check=1)
    errors = [line for line in r.stderr.splitlines() if line.strip().startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert 'acl[0].topic = "home/#/x": must be a topic filter' in errors[0], r.stderr
    assert "%u" in errors[0] and "%c" in errors[0]
    # %u and %c (the user name, the client id) may stand for a whole level or part of one
    for good in ("home/%u/#", "clients/%c/+/state", "x/u-%u/c-%c"):
        config("check", str(write(tmp_path, "good_acl", _acl_profile(good))), check=0)


@pytest.mark.parametrize("value, says", [("TopSecret-" + "x" * 300, "<310 bytes, not shown>"),
                                         (987654321, "<integer, not shown>")])
def test_a_bad_password_value_is_refused_without_repeating_it(tmp_path, value, says):
    """A bridge password over its 256 bytes, or not a string, is refused in
    one line naming the key and what is allowed, never the password itself
    (it would land in terminals and CI logs; before: repeated in full)."""
    prof = esp32()
    prof["romfs"] = True
    prof["bridges"] = [dict(BRIDGE, password=value)]
    r = config("check", str(write(tmp_path, "pw", prof)), check=1)
    errors = [line for line in r.stderr.splitlines() if line.strip().startswith("error:")]
    assert len(errors) == 1 and "bridges[0].password = " + says in errors[0], r.stderr
    assert "TopSecret" not in r.stderr + r.stdout and "987654321" not in r.stderr + r.stdout


def test_bridge_heap_code_and_flash_are_counted(tmp_path):
    """A bridge's code (lib/edgebridge.py), heap and queue file are counted:
    on the esp32 it needs ROMFS (bytecode in flash), then one plain-TCP
    bridge fits; one TLS client does not fit that heap."""
    prof = esp32()
    prof["bridges"] = [BRIDGE]
    r = config("check", "-v", str(write(tmp_path, "bridged", prof)), check=1)
    assert "edgebridge" in r.stderr and "code_budget_bytes" in r.stderr
    prof["romfs"] = True
    r = config("check", "-v", str(write(tmp_path, "romfs", prof)), check=0)
    assert "bridge cloud" in r.stdout and "queue file + .new copy" in r.stdout
    assert "edgebridge" in r.stdout
    prof["bridges"] = [_bridged(tls={"ca": "/ca.pem"})]
    r = config("check", "-v", str(write(tmp_path, "tls", prof)), check=1)
    assert "heap_bytes = 110000" in r.stderr and "bridge cloud" in r.stderr


def _code_line(out):
    return next(line for line in out.splitlines() if line.strip().startswith("code "))


def test_frozen_code_is_counted_below_romfs_and_mpy(tmp_path):
    """frozen: true (the broker frozen into the firmware with
    firmware/freeze/manifest.py): config check counts each module's frozen
    figure measured on a Cortex-M build (profiles.FROZEN_32), scaled by its
    .mpy's growth since: less than ROMFS and far less than .mpy in RAM; with
    romfs true as well it is refused in one line naming frozen."""
    figures = {}
    for name, change in (("mpy", {}), ("romfs", {"romfs": True}), ("frozen", {"frozen": True})):
        prof = esp32()
        prof.update(change)
        r = config("check", "-v", str(write(tmp_path, name, prof)), check=0)
        line = _code_line(r.stdout)
        figures[name] = int(line.split()[1])
    assert "(frozen)" in line, line
    mpy = profiles.load_costs()["costs"]["mpy_file_bytes"]
    want = 0
    for m in ("edgebroker", "edgestore"):
        kept, then = profiles.FROZEN_32[m]
        want += round(kept * mpy[m] / then)
    assert figures["frozen"] == want
    assert figures["frozen"] < 0.5 * figures["romfs"] < figures["mpy"], figures
    # a stock profile over its heap that frozen code would fit is told so
    prof = esp32()
    prof["max_clients"] = 8
    r = config("check", str(write(tmp_path, "eight", prof)), check=1)
    assert "with the broker frozen into the firmware (frozen: true" in r.stderr, r.stderr
    prof = esp32()
    prof.update({"romfs": True, "frozen": True})
    r = config("check", str(write(tmp_path, "both", prof)), check=1)
    errors = [line for line in r.stderr.splitlines() if line.strip().startswith("error:")]
    assert len(errors) == 1 and "frozen = true" in errors[0] and "romfs" in errors[0], r.stderr


def test_every_lib_module_has_a_frozen_figure():
    """profiles.FROZEN_32 holds a measured frozen figure for every module in
    lib/ (a new module must be measured frozen before a frozen profile can
    count it), with its .mpy size of that day."""
    mods = {p.stem for p in (REPO / "lib").glob("*.py")}
    assert set(profiles.FROZEN_32) == mods
    assert all(kept > 0 and then > kept for kept, then in profiles.FROZEN_32.values())


def test_all_errors_are_listed(tmp_path):
    prof = esp32()
    prof.update({"max_clientz": 1, "maximum_qos": 7, "log_level": "loud", "romfs": "no"})
    r = config("check", str(write(tmp_path, "many", prof)), check=1)
    errors = [line for line in r.stderr.splitlines() if line.strip().startswith("error:")]
    assert len(errors) == 4, r.stderr
    assert "4 errors" in r.stderr
    assert "did you mean max_clients?" in r.stderr


def test_profile_that_cannot_fit_the_esp32_heap_is_refused(tmp_path):
    """Within the socket limit but not the heap: 8 clients with the esp32's
    per-client limits need far more than heap_bytes."""
    prof = esp32()
    prof.update({"max_clients": 8, "max_sessions": 4})
    r = config("check", "-v", str(write(tmp_path, "fat", prof)), check=1)
    assert "heap_bytes = 110000: the worst-case heap is" in r.stderr
    assert "max_clients = 8" not in r.stderr  # 8 is within the sockets
    # the breakdown shows what it is made of
    for item in ("code", "clients", "sessions", "retained", "heap_reserve"):
        assert "    %s " % item in r.stderr


def test_verbose_items_add_up():
    """Was: `retained 3638 index of 256 entries x 4` (256 x 4 = 1,024: the
    store's fixed cost was not named). Each line says what its figure is."""
    r = config("check", "-v", *[str(p) for p in PROFILES])
    items = re.findall(r"^    (retained|file) +(\d+)  (.*)$", r.stdout + r.stderr, re.MULTILINE)
    kinds = set()
    for name, figure, how in items:
        m = (re.fullmatch(r"fixed (\d+) \+ index of (\d+) entries x (\d+) \(disc_only\)", how)
             or re.fullmatch(r"fixed (\d+) \+ (\d+) messages x (\d+) \+ (\d+) data bytes, "
                             r"in RAM \((?:ram|disc)\)", how)
             or re.fullmatch(r"live (\d+) / \(1 - ([0-9.]+)\) before compaction", how))
        if m is None:
            assert name == "retained" and how == "retain_available is false", how
            continue
        n = [float(x) for x in m.groups()]
        if how.startswith("fixed") and len(n) == 3:
            kinds.add("disc_only")
            assert n[0] + n[1] * n[2] == int(figure), how
        elif how.startswith("fixed"):
            kinds.add("in RAM")
            assert n[0] + n[1] * n[2] + n[3] == int(figure), how
        else:
            kinds.add("file")
            assert math.ceil(n[0] / (1 - n[1])) == int(figure), how
    assert kinds == {"disc_only", "in RAM", "file"}, items
    # a file that the compact_min_bytes floor makes larger says so
    prof = profiles.load_profile(BOARDS / "esp32.json")
    cfg = profiles.effective(dict(prof, compact_min_bytes=1000000), SCHEMA)
    item = profiles.flash_breakdown(cfg)[0]
    live = int(re.search(r"live (\d+)", item.how).group(1))
    assert item.how == "compact_min_bytes 1000000 + live %d before compaction" % live
    assert item.bytes == 1000000 + live


@pytest.mark.parametrize("content,says", [
    (b"\xff\xfe{}", "is not UTF-8 text: byte 0xff at offset 0 (JSON files must be UTF-8)"),
    (b'{"max_clients": ' + b"9" * 5000 + b"}",
     "max_clients = 999999999999...9999 (5000 digits): must be an integer in 1..65535"),
    (b'{"bridges": [{"name": "a", "port": -' + b"1" * 5000 + b"}]}",
     "bridges[0].port = -11111111111...1111 (5000 digits): must be an integer in 1..65535"),
    (b'{"compact_ratio": 1e999}', "compact_ratio = 1e999: must be a number in 0.05..0.95"),
    (b'{"compact_ratio": NaN}', "is not valid JSON: NaN is not a JSON value"),
    (b'{"acl": ' + b"[" * 100000 + b"]" * 100000 + b"}",
     "acl = [[[[[[[[[[[[[[[[...: nested more than 32 levels deep; must be at most 32 levels "
     "of arrays and objects"),
    (b'{"acl": ' + b"[" * 900 + b"]" * 900 + b"}", "acl = [[[["),  # within Python's own limit
], ids=["not-utf8", "5000-digits", "5000-digits-nested", "inf", "nan", "nested-100000",
        "nested-900"])
@pytest.mark.parametrize("action", [["check"], ["show"], ["apply", "esp32"]], ids=lambda a: a[0])
def test_unreadable_file_is_one_line_exit_2(tmp_path, content, says, action):
    """Was: a traceback (UnicodeDecodeError, ValueError, RecursionError), exit 1."""
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    r = config(*action, str(path), check=2)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and says in lines[0], lines


def test_check_reports_heap_and_flash_sums():
    r = config("check", "-v", "esp32", check=0)
    assert "heap: worst case" in r.stdout and "of heap_bytes 110000" in r.stdout
    assert "flash: peak" in r.stdout and "of fs_bytes 2097152" in r.stdout


def test_bad_input_is_one_line_exit_2(tmp_path):
    r = config("check", str(tmp_path / "missing.json"), check=2)
    assert "missing.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "broken.json").write_text("{nope")
    r = config("check", str(tmp_path / "broken.json"), check=2)
    assert "not valid JSON" in r.stderr
    r = config("check", "no_such_board", check=2)
    assert "unknown board 'no_such_board'" in r.stderr and "esp32" in r.stderr


# ------------------------------------------------------------------ show
def test_show_fills_defaults(tmp_path):
    path = write(tmp_path, "small", {"board": "small", "max_clients": 3})
    r = config("show", str(path), check=0)
    shown = json.loads(r.stdout)
    assert list(shown) == list(PROPS)
    assert shown["max_clients"] == 3 and shown["board"] == "small"
    defaults = broker_defaults()
    for key, sub in PROPS.items():
        if key not in ("board", "max_clients"):
            assert shown[key] == sub["default"], key
            if key in defaults:
                assert shown[key] == defaults[key], key


def test_show_by_board_name():
    shown = json.loads(config("show", "rp2040_picow", check=0).stdout)
    assert shown == json.loads((BOARDS / "rp2040_picow.json").read_text())


def test_show_reports_schema_errors(tmp_path):
    r = config("show", str(write(tmp_path, "odd", {"max_clients": 0})), check=1)
    assert json.loads(r.stdout)["max_clients"] == 0
    assert "max_clients = 0: must be 1..65535" in r.stderr


# ----------------------------------------------------------------- apply
def test_apply_merges_checks_and_writes(tmp_path):
    board = write(tmp_path, "esp32", esp32())
    entry = "pbkdf2_sha256:1000:" + "ab" * 16 + ":" + "cd" * 32
    patch = write(tmp_path, "patch", {"max_retained_messages": 128, "log_level": None,
                                      "users": {"gw": entry}})
    r = config("apply", str(board), str(patch), check=0)
    merged = json.loads(r.stdout)
    assert merged["max_retained_messages"] == 128
    assert "log_level" not in merged  # null removes the key: its default applies
    assert merged["users"] == {"gw": entry}
    assert json.loads(board.read_text()) == esp32()  # not written without --write
    config("apply", str(board), str(patch), "--write", check=0)
    assert json.loads(board.read_text()) == merged
    config("check", str(board), check=0)


def test_apply_refuses_to_write_a_failing_result(tmp_path):
    board = write(tmp_path, "esp32", esp32())
    before = board.read_text()
    patch = write(tmp_path, "patch", {"max_clients": 12, "max_queue": 4})
    r = config("apply", str(board), str(patch), "--write", check=1)
    assert "max_clients = 12: must be <= 8" in r.stderr
    assert "max_queue = 4: unknown key" in r.stderr
    assert "not written" in r.stderr
    assert board.read_text() == before


# ------------------------------------------------------------- reference
def test_reference_page_is_up_to_date():
    r = config("reference", "--check")
    assert r.returncode == 0, "docs/board-reference.md is stale: run `make board-reference`\n" + r.stderr
    page = (REPO / "docs" / "board-reference.md").read_text()
    for key, sub in PROPS.items():
        assert "### %s\n" % key in page, key
        assert sub["x-consequence"] in page, key
    # docs/contract.md's table: every key the broker reads, with its consequence
    contract = (REPO / "docs" / "contract.md").read_text()
    for key, sub in PROPS.items():
        row = "| [`%s`](board-reference.md#%s) |" % (key, key)
        if "broker" in [r.strip() for r in sub["x-read-by"].split(",")]:
            assert row in contract and sub["x-consequence"].replace("|", "\\|") in contract, key
        else:
            assert row not in contract, key


def test_reference_check_notices_a_stale_contract_table():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from edgebroker_tools import reference
    finally:
        sys.path.pop(0)
    current = (REPO / "docs" / "contract.md").read_text()
    stale = current.replace("| [`heap_reserve`]", "| [`heap_reserved`]")
    assert stale != current
    assert reference.update_contract(stale, SCHEMA) == current


def test_reference_check_notices_a_stale_page(tmp_path):
    stale = tmp_path / "ref.md"
    stale.write_text("old\n")
    config("reference", "--check", "--out", str(stale), check=1)
    config("reference", "--out", str(stale), check=0)
    config("reference", "--check", "--out", str(stale), check=0)


@pytest.mark.parametrize(("secrets", "says"), [
    ({"bridges": {"cloud": {"username": "u", "password": "p"}}}, None),
    ({"users": {}}, None),
    ({"bridges": {"clod": {"password": "p"}}},
     "bridges.clod: the profile has no bridge named 'clod' (it has 'cloud')"),
    ({"bridges": {"cloud": {"passwd": "p"}}},
     "bridges.cloud.passwd: unknown key (allowed username, password)"),
    ({"bridges": {"cloud": {"password": 5}}}, "bridges.cloud.password: 5 is not a string"),
    ({"bridges": ["cloud"]}, "bridges: ['cloud'] is not an object"),
])
def test_secrets_bridges_map_is_checked_naming_the_key(secrets, says):
    """Issue 10 item 1: bridge credentials in the secrets file, checked by
    `flash` and `run` the way the broker's with_secrets() merges them."""
    sys.path.insert(0, str(REPO / "tools"))
    from edgebroker_tools import profiles

    profile = {"bridges": [{"name": "cloud", "host": "h", "topics": [{"pattern": "a/#"}]}]}
    got = profiles.check_secret_bridges(secrets, profile)
    assert got == says if says is None else says in (got or "")


def test_a_32bit_board_pays_each_module_import_as_measured_on_32_bits():
    """Issue 12 item 1: config check budgets a word_bytes 4 board with the
    32-bit measurement of each module's .mpy import (costs_32bit), not the
    64-bit figure times a ratio (the 64-bit figures carry qstr pools that
    fall to whichever module imports when one grows); every module,
    edgebridge included, is measured by `make measure-memory`."""
    sys.path.insert(0, str(REPO / "tools"))
    from edgebroker_tools import profiles

    costs = json.loads((REPO / "boards" / "memory_costs.json").read_text())
    figures = costs["costs_32bit"]["figures"]
    for word, want in ((4, lambda m: round(figures["import_mpy." + m]["bytes_32"])),
                       (8, lambda m: costs["costs"]["import_mpy"][m])):
        got = profiles.for_word_size(costs, {"word_bytes": word})["costs"]["import_mpy"]
        for m in ("edgebroker", "edgestore", "edgebridge"):
            assert got[m] == want(m), (word, m)
    assert {"edgebroker.py", "edgestore.py", "edgebridge.py"} <= set(costs["lib_sha256"])


def test_a_32bit_board_scales_a_message_overhead_by_the_overheads_ratio():
    """A message's overhead (beyond its payload and its topic as str and
    bytes, which are the same bytes on every port) is scaled to 32 bits by
    the measured ratio of the overheads themselves (costs_32bit
    message_overhead, retained.ram.overhead), not by the whole message's:
    that ratio, applied to the overhead alone, counted it about 45 B high."""
    sys.path.insert(0, str(REPO / "tools"))
    from edgebroker_tools import profiles

    costs = json.loads((REPO / "boards" / "memory_costs.json").read_text())
    figures = costs["costs_32bit"]["figures"]
    c64 = costs["costs"]
    c32 = profiles.for_word_size(costs, {"word_bytes": 4})["costs"]
    over = figures["message_overhead"]
    assert over["ratio"] < figures["per_queued_message"]["ratio"]
    assert c32["message_overhead"] == round(c64["message_overhead"] * over["ratio"])
    ram = figures["retained.ram.overhead"]
    for store in ("ram", "disc"):
        assert c32["retained"][store]["overhead"] == round(
            c64["retained"][store]["overhead"] * ram["ratio"]), store
