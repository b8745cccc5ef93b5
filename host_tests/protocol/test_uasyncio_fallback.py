"""MicroPython 1.16 (the ESP32 image run under emulation, docs/boards.md)
has its asyncio as `uasyncio` only. The broker falls back to that name: here
`import asyncio` is made to fail and the same module is offered as
`uasyncio`, then the asyncio server serves a real paho client (retained
QoS 1 in, delivered to a subscriber), under CPython and MicroPython."""

import json
import sys
from pathlib import Path

import pytest
from mqtt_helpers import free_port, served_retained

REPO = Path(__file__).resolve().parents[2]
MP = Path(sys.executable).parent / "micropython"

# the interpreter's asyncio only as `uasyncio`; `import asyncio` fails
HIDE = {
    "micropython": (
        "import asyncio\n"
        "for _n in asyncio._attrs:\n"  # its lazily loaded parts, while the name works
        "    getattr(asyncio, _n)\n"
        "sys.modules['uasyncio'] = asyncio\n"
        "del sys.modules['asyncio']\n"
        "sys.path[:] = [p for p in sys.path if p != '.frozen']\n"
    ),
    "cpython": (
        "import asyncio\n"
        "asyncio.get_event_loop_policy()\n"  # imported lazily by the package name
        "sys.modules['uasyncio'] = asyncio\n"
        "del sys.modules['asyncio']\n"
        "class _NoAsyncio:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'asyncio':\n"
        "            raise ImportError('no module named asyncio')\n"
        "sys.meta_path.insert(0, _NoAsyncio())\n"
    ),
}

LAUNCH = r"""
import sys
sys.path.insert(0, %(lib)r)
%(hide)s
import json
import edgebroker
b = edgebroker.start(json.loads(%(profile)r), "127.0.0.1", %(port)d)
aio = edgebroker._asyncio()
print("fallback" if aio is sys.modules["uasyncio"] else "asyncio")
try:
    aio.run(b.serve_async())
finally:
    b.shutdown()
"""


@pytest.mark.parametrize("interp", ["cpython", "micropython"])
def test_asyncio_server_runs_on_uasyncio(interp):
    port = free_port()
    code = LAUNCH % {"lib": str(REPO / "lib"), "hide": HIDE[interp], "port": port,
                     "profile": json.dumps({"max_clients": 4})}
    exe = sys.executable if interp == "cpython" else str(MP)
    argv = [exe, "-u", "-c", code] if interp == "cpython" else [exe, "-c", code]
    line, m = served_retained(argv, "fallback", port, "ua/t", b"v", "ua/#", "ua")
    assert line == "fallback", line
    assert (m.topic, m.payload, m.retain) == ("ua/t", b"v", True)
