"""`make fuzz`: the engine fuzzer's long mode.

Runs host_tests/portable/fuzz_engine.py (seeded mutations of every client
packet type, fed into the sans-IO Engine in process) under CPython and the
MicroPython unix port at once, --count inputs each (default 1,000,000), and
prints each interpreter's line: inputs, failures, time, rate, heap growth.
Exit 1 if any run reports a failure (its inputs are printed as hex, ready to
become regression vectors).

    python -m edgebroker_tools.fuzz [--count N] [--seed S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Final

from edgebroker_tools import runner

DEFAULT_COUNT: Final = 1_000_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgebroker_tools.fuzz", description=__doc__)
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="inputs per interpreter")
    parser.add_argument("--seed", type=int, default=1, help="the first seed (MicroPython: +1)")
    args = parser.parse_args(argv)
    root = runner.repo_root()
    script = root / "host_tests" / "portable" / "fuzz_engine.py"
    lib = root / "lib"
    runs = [
        ("cpython", sys.executable, args.seed),
        ("micropython", str(runner.micropython_executable()), args.seed + 1),
    ]
    procs = [
        (
            name,
            subprocess.Popen(
                [exe, str(script), str(lib), "--count", str(args.count), "--seed", str(seed)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
        for name, exe, seed in runs
    ]
    code = 0
    for name, proc in procs:
        out, _ = proc.communicate()
        lines = out.strip().splitlines()
        fails = [x for x in lines if x.startswith("FAIL ")]
        for line in fails[:20]:
            print(f"{name}: {line[:400]}")
        print(f"{name}: {lines[-1] if lines else '(no output)'}")
        if proc.returncode != 0:
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
