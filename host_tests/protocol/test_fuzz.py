"""The engine fuzzer (issue 11, item 6; host_tests/portable/fuzz_engine.py):
seeded mutations of every packet type a client sends, in 5.0 and 3.1.1,
fed in random chunks into the sans-IO Engine in process, under CPython and
the MicroPython unix port: no internal error, no exception out of the
engine, a well-formed client still served afterwards, the heap flat. In
`make test`: 40,000 inputs under CPython and 20,000 under MicroPython;
`make fuzz` runs a million per interpreter."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FUZZ = REPO / "host_tests" / "portable" / "fuzz_engine.py"


def _run(exe, seed, count):
    r = subprocess.run([str(exe), str(FUZZ), str(REPO / "lib"), "--count", str(count),
                        "--seed", str(seed), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " 0 failures" in r.stdout, r.stdout


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_fuzz_cpython(seed):
    _run(sys.executable, seed, 10000)


@pytest.mark.parametrize("seed", [21, 22])
def test_fuzz_micropython(seed):
    _run(Path(sys.executable).parent / "micropython", seed, 10000)


def test_fuzzer_finds_a_planted_bug(tmp_path):
    """The fuzzer is not vacuous: a copy of lib/ whose UNSUBSCRIBE handler
    raises on longer packets makes it report failures with their input."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for f in (REPO / "lib").glob("*.py"):
        (lib / f.name).write_text(f.read_text())
    src = (lib / "edgebroker.py").read_text()
    anchor = "    def on_unsubscribe(self, conn, b, i, end):\n"
    assert anchor in src
    (lib / "edgebroker.py").write_text(
        src.replace(anchor, anchor + "        if end - i > 9:\n            raise IndexError('planted')\n"))
    r = subprocess.run([sys.executable, str(FUZZ), str(lib), "--count", "3000", "--seed", "3",
                        "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "FAIL seed=3 input=" in r.stdout, r.stdout[-2000:]
