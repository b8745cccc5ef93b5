"""MicroPython 1.16 (the ESP32 image run under emulation, docs/boards.md)
has its asyncio as `uasyncio` only. The broker falls back to that name: here
`import asyncio` is made to fail and the same module is offered as
`uasyncio`, then the asyncio server serves a real paho client (retained
QoS 1 in, delivered to a subscriber), under CPython and MicroPython."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mqtt_helpers import free_port, paho_client

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
    proc = subprocess.Popen([exe, "-u", "-c", code] if interp == "cpython" else [exe, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "fallback", line + (proc.stderr.read() if proc.poll() else "")
        pub = paho_client(port, client_id="ua-pub")
        pub.client.publish("ua/t", b"v", qos=1, retain=True).wait_for_publish(5)
        sub = paho_client(port, client_id="ua-sub")
        sub.subscribe_wait("ua/#", qos=1)
        msgs = sub.wait_messages(1)
        assert (msgs[0].topic, msgs[0].payload, msgs[0].retain) == ("ua/t", b"v", True)
        pub.client.disconnect()
        sub.client.disconnect()
    finally:
        proc.terminate()  # the process this test started, by its handle
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
