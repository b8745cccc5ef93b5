"""Vector tests of the sans-IO Engine (host_tests/portable/unit_engine.py):
each function a pytest test under CPython, and the whole module under the
MicroPython unix port through mp_runner.py. Tests named test_ENGINE_BUG_*
fail until the engine bug they name (lead's notes) is fixed."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO / "host_tests" / "portable"))

import unit_engine  # noqa: E402


@pytest.mark.parametrize("name", sorted(n for n in dir(unit_engine) if n.startswith("test_")))
def test_engine_cpython(name):
    getattr(unit_engine, name)()


def test_engine_units_under_micropython():
    mp = Path(sys.executable).parent / "micropython"
    r = subprocess.run(
        [str(mp), str(REPO / "host_tests" / "portable" / "mp_runner.py"), str(REPO / "lib"),
         "unit_engine"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0 and " 0 failed" in r.stdout, r.stdout + r.stderr
